// MoE routing kernels against float64 brute-force references: the router's
// softmax, top-k and gates, renormalised (Mixtral) or raw (Switch), ties
// included, every backward
// against central finite differences, hand-computed dispatch plans (drops,
// first-choice priority, dropless), the permute/combine round trip, a whole
// MoE layer's gradient, and determinism.
#include "kernels/cpu/moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace baton::kernels::cpu {
namespace {

using Vec = std::vector<float>;
using Dvec = std::vector<double>;
using Ivec = std::vector<int32_t>;
using Counts = std::vector<int64_t>;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr double kProbTol = 1e-6;  // max abs diff of probs and gates vs float64
constexpr double kFdTol = 1e-3;    // relative L2 of a gradient vs finite differences
constexpr double kFdStep = 1e-5;   // central difference step, in double

Dvec ToDouble(const Vec& v) { return Dvec(v.begin(), v.end()); }

double RelativeL2(const Vec& a, const Dvec& ref) {
  EXPECT_EQ(a.size(), ref.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double{a[i]} - ref[i]) * (double{a[i]} - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / den);
}

bool SameBits(const Vec& a, const Vec& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// The central-difference gradient of `loss` at x, all in double.
template <typename Loss>
Dvec FiniteDifferences(Dvec x, const Loss& loss) {
  Dvec grad(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + kFdStep;
    const double plus = loss(x);
    x[i] = x0 - kFdStep;
    const double minus = loss(x);
    x[i] = x0;
    grad[i] = (plus - minus) / (2 * kFdStep);
  }
  return grad;
}

// ---- float64 references ----

struct RefRouting {
  Dvec probs;   // [N,E]
  Ivec expert;  // [N,K]
  Dvec gate;    // [N,K]
};

// Softmax per token, then K passes each taking the largest probability not
// yet taken (the lowest index among equals), then gate = p / Σ selected p
// (renormalize) or p itself.
RefRouting RefRouter(const Dvec& logits, int64_t n, int64_t e, int64_t k, bool renormalize) {
  RefRouting r{Dvec(n * e), Ivec(n * k), Dvec(n * k)};
  for (int64_t t = 0; t < n; ++t) {
    const double* z = &logits[t * e];
    double* p = &r.probs[t * e];
    const double max = *std::max_element(z, z + e);
    double sum = 0;
    for (int64_t i = 0; i < e; ++i) sum += p[i] = std::exp(z[i] - max);
    for (int64_t i = 0; i < e; ++i) p[i] /= sum;
    std::vector<bool> taken(e, false);
    double selected = 0;
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t i = 0; i < e; ++i) {
        if (!taken[i] && (best < 0 || p[i] > p[best])) best = i;
      }
      taken[best] = true;
      r.expert[t * k + j] = static_cast<int32_t>(best);
      selected += p[best];
    }
    if (!renormalize) selected = 1;
    for (int64_t j = 0; j < k; ++j) r.gate[t * k + j] = p[r.expert[t * k + j]] / selected;
  }
  return r;
}

// The dispatch plan by its definition: (t,j) is kept iff fewer than
// `capacity` choices before it in (j, t) order go to the same expert, and its
// slot is that number.
Ivec RefPlan(const Ivec& expert, int64_t n, int64_t k, int64_t capacity) {
  Ivec slot(n * k);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      int64_t before = 0;
      for (int64_t j2 = 0; j2 <= j; ++j2) {
        for (int64_t t2 = 0; t2 < (j2 < j ? n : t); ++t2) {
          before += expert[t2 * k + j2] == expert[t * k + j];
        }
      }
      slot[t * k + j] = before < capacity ? static_cast<int32_t>(before) : kDroppedSlot;
    }
  }
  return slot;
}

struct Dims {
  int64_t n, e, k, h, c;  // tokens, experts, top-k, hidden, capacity
};

Dvec RefPermute(const Dvec& x, const Ivec& expert, const Ivec& slot, const Dims& d) {
  Dvec in(d.e * d.c * d.h, 0.0);
  for (int64_t i = 0; i < d.n * d.k; ++i) {
    if (slot[i] == kDroppedSlot) continue;
    for (int64_t h = 0; h < d.h; ++h) {
      in[(expert[i] * d.c + slot[i]) * d.h + h] = x[(i / d.k) * d.h + h];
    }
  }
  return in;
}

Dvec RefCombine(const Dvec& out, const Dvec& gate, const Ivec& expert, const Ivec& slot,
                const Dims& d) {
  Dvec y(d.n * d.h, 0.0);
  for (int64_t i = 0; i < d.n * d.k; ++i) {
    if (slot[i] == kDroppedSlot) continue;
    for (int64_t h = 0; h < d.h; ++h) {
      y[(i / d.k) * d.h + h] += gate[i] * out[(expert[i] * d.c + slot[i]) * d.h + h];
    }
  }
  return y;
}

// coef · E · Σ_e f_e P_e, with f from `expert` and P from softmax(logits).
double RefLoadBalancing(const Dvec& logits, const Ivec& expert, int64_t n, int64_t e, int64_t k,
                        double coef) {
  const Dvec probs = RefRouter(logits, n, e, 1, true).probs;
  double loss = 0;
  for (int64_t i = 0; i < e; ++i) {
    const double f = std::count(expert.begin(), expert.end(), i) / static_cast<double>(n * k);
    double p = 0;
    for (int64_t t = 0; t < n; ++t) p += probs[t * e + i];
    loss += f * p / n;
  }
  return coef * e * loss;
}

double Dot(const Dvec& a, const Dvec& b) {
  return std::inner_product(a.begin(), a.end(), b.begin(), 0.0);
}

// ---- kernel wrappers ----

struct Routing {
  Vec probs, gate;
  Ivec expert;
};

Routing Route(const Vec& logits, int64_t n, int64_t e, int64_t k, bool renormalize = true) {
  Routing r{Vec(n * e, kNaN), Vec(n * k, kNaN), Ivec(n * k, -7)};
  RouterTopK(r.probs.data(), r.expert.data(), r.gate.data(), logits.data(), n, e, k, renormalize);
  return r;
}

// The router's backward into a fresh dlogits [N,E].
Vec RouteBackward(const Routing& r, const Vec& dgate, int64_t n, int64_t e, int64_t k,
                  bool renormalize) {
  Vec dlogits(n * e, kNaN);
  RouterTopKBackward(dlogits.data(), dgate.data(), r.expert.data(), r.gate.data(), r.probs.data(),
                     n, e, k, renormalize);
  return dlogits;
}

struct Plan {
  Ivec slot;
  Counts counts;
};

Plan MakePlan(const Ivec& expert, int64_t n, int64_t e, int64_t k, int64_t capacity) {
  Plan p{Ivec(n * k, -7), Counts(e, -7)};
  PlanDispatch(p.slot.data(), p.counts.data(), expert.data(), n, e, k, capacity);
  return p;
}

int64_t Drops(const Ivec& slot) { return std::count(slot.begin(), slot.end(), kDroppedSlot); }

class MoeTest : public ::testing::Test {
 protected:
  Vec Normal(int64_t size, float stddev = 1.0f) {
    std::normal_distribution<float> dist(0.0f, stddev);
    Vec v(size);
    for (float& x : v) x = dist(rng_);
    return v;
  }

  // Logits whose sorted values per token are at least 0.3 apart (a shuffled
  // 0, 0.5, 1, … plus noise in ±0.1), so that no finite-difference step
  // changes the top-k.
  Vec SeparatedLogits(int64_t n, int64_t e) {
    std::uniform_real_distribution<float> noise(-0.1f, 0.1f);
    Vec z(n * e);
    std::vector<int> rank(e);
    for (int64_t t = 0; t < n; ++t) {
      std::iota(rank.begin(), rank.end(), 0);
      std::shuffle(rank.begin(), rank.end(), rng_);
      for (int64_t i = 0; i < e; ++i) z[t * e + i] = 0.5f * rank[i] - 1.5f + noise(rng_);
    }
    return z;
  }

  // K distinct random experts per token.
  Ivec RandomExperts(int64_t n, int64_t e, int64_t k) {
    Ivec expert(n * k), all(e);
    for (int64_t t = 0; t < n; ++t) {
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng_);
      std::copy(all.begin(), all.begin() + k, expert.begin() + t * k);
    }
    return expert;
  }

  std::mt19937 rng_{20240917};
};

// ---- router ----

TEST_F(MoeTest, RouterMatchesFloat64Reference) {
  const int64_t n = 37, e = 8;
  const Vec logits = Normal(n * e, 2.0f);
  for (int64_t k : {1, 2, 3}) {
    SCOPED_TRACE(k);
    const Routing r = Route(logits, n, e, k);
    const RefRouting ref = RefRouter(ToDouble(logits), n, e, k, true);
    for (int64_t i = 0; i < n * e; ++i) EXPECT_NEAR(r.probs[i], ref.probs[i], kProbTol) << i;
    EXPECT_EQ(r.expert, ref.expert);
    for (int64_t t = 0; t < n; ++t) {
      double sum = 0;
      for (int64_t j = 0; j < k; ++j) {
        EXPECT_NEAR(r.gate[t * k + j], ref.gate[t * k + j], kProbTol) << t << "," << j;
        sum += r.gate[t * k + j];
      }
      EXPECT_NEAR(sum, 1.0, kProbTol) << "token " << t;
      if (k == 1) {
        EXPECT_EQ(r.gate[t], 1.0f);
      }
    }
  }
}

TEST_F(MoeTest, RawGatesAreTheChosenProbabilities) {
  const int64_t n = 37, e = 8;
  const Vec logits = Normal(n * e, 2.0f);
  for (int64_t k : {1, 2, 3}) {
    SCOPED_TRACE(k);
    const Routing raw = Route(logits, n, e, k, /*renormalize=*/false);
    const RefRouting ref = RefRouter(ToDouble(logits), n, e, k, false);
    EXPECT_EQ(raw.expert, ref.expert);
    for (int64_t i = 0; i < n * k; ++i) EXPECT_NEAR(raw.gate[i], ref.gate[i], kProbTol) << i;
    // The probabilities and the choice do not depend on the mode, and each
    // raw gate is its probability's float, bit for bit.
    const Routing renormalized = Route(logits, n, e, k, /*renormalize=*/true);
    EXPECT_TRUE(SameBits(raw.probs, renormalized.probs));
    EXPECT_EQ(raw.expert, renormalized.expert);
    bool below_one = false;
    for (int64_t t = 0; t < n; ++t) {
      double sum = 0;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t i = t * k + j;
        EXPECT_EQ(raw.gate[i], raw.probs[t * e + raw.expert[i]]) << t << "," << j;
        sum += raw.gate[i];
      }
      below_one |= sum < 1.0 - 1e-3;
    }
    EXPECT_TRUE(below_one);  // unlike renormalised gates, they need not sum to 1
  }
}

TEST_F(MoeTest, RouterIsStableForLogitsFarFromZero) {
  // exp would overflow (first token) or underflow to 0/0 (second) without
  // the max subtraction.
  const Vec logits = {1000,  1001, 998,   1000.5f,  //
                      -1000, -999, -1001, -1000.25f};
  const Routing r = Route(logits, 2, 4, 2);
  const RefRouting ref = RefRouter(ToDouble(logits), 2, 4, 2, true);
  for (int64_t i = 0; i < 8; ++i) EXPECT_NEAR(r.probs[i], ref.probs[i], kProbTol) << i;
  EXPECT_EQ(r.expert, (Ivec{1, 3, 1, 0}));
  for (int64_t i = 0; i < 4; ++i) EXPECT_NEAR(r.gate[i], ref.gate[i], kProbTol) << i;
}

TEST_F(MoeTest, RouterBreaksTiesByLowestExpert) {
  // All equal: the first k experts, equal gates.
  const Routing all = Route(Vec(8, 0.25f), 1, 8, 3);
  EXPECT_EQ(all.expert, (Ivec{0, 1, 2}));
  for (float g : all.gate) EXPECT_NEAR(g, 1.0 / 3, 1e-7);
  // Ties below a strict maximum, and ties across the k boundary.
  const Vec logits = {1, 3, 3, 0, 3,  3,  //
                      5, 2, 2, 2, -1, 2};
  EXPECT_EQ(Route(logits, 2, 6, 2).expert, (Ivec{1, 2, 0, 1}));
  EXPECT_EQ(Route(logits, 2, 6, 3).expert, (Ivec{1, 2, 4, 0, 1, 2}));
  EXPECT_EQ(Route(logits, 2, 6, 5).expert, (Ivec{1, 2, 4, 5, 0, 0, 1, 2, 3, 5}));
}

TEST_F(MoeTest, RouterBackwardMatchesFiniteDifferences) {
  const int64_t n = 13, e = 8;
  const Vec logits = SeparatedLogits(n, e);
  for (int64_t k : {1, 2, 3}) {
    SCOPED_TRACE(k);
    const Routing r = Route(logits, n, e, k);
    const Vec w = Normal(n * k);  // loss = Σ w ⊙ gate, so dgate = w
    const Vec dlogits = RouteBackward(r, w, n, e, k, /*renormalize=*/true);
    // The renormalised form reads no probabilities.
    Vec without_probs(n * e, kNaN);
    RouterTopKBackward(without_probs.data(), w.data(), r.expert.data(), r.gate.data(), nullptr, n,
                       e, k, true);
    EXPECT_TRUE(SameBits(without_probs, dlogits));
    const Dvec fd = FiniteDifferences(ToDouble(logits), [&](const Dvec& z) {
      const RefRouting ref = RefRouter(z, n, e, k, true);
      EXPECT_EQ(ref.expert, r.expert);  // the step never changes the selection
      return Dot(ref.gate, ToDouble(w));
    });
    if (k == 1) {
      // The gate is the constant 1: no gradient at all.
      for (int64_t i = 0; i < n * e; ++i) {
        EXPECT_EQ(dlogits[i], 0.0f) << i;
        EXPECT_NEAR(fd[i], 0.0, 1e-9) << i;
      }
      continue;
    }
    EXPECT_LE(RelativeL2(dlogits, fd), kFdTol);
    // Unselected experts get exactly nothing.
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t i = 0; i < e; ++i) {
        const int32_t* top = &r.expert[t * k];
        if (std::find(top, top + k, i) == top + k) {
          EXPECT_EQ(dlogits[t * e + i], 0.0f) << t << "," << i;
        }
      }
    }
  }
}

// Raw (Switch) gates: every logit gets a gradient through the softmax, and
// a K = 1 router learns from its one gate.
TEST_F(MoeTest, RawRouterBackwardMatchesFiniteDifferences) {
  const int64_t n = 13, e = 8;
  const Vec logits = SeparatedLogits(n, e);
  for (int64_t k : {1, 2, 3}) {
    SCOPED_TRACE(k);
    const Routing r = Route(logits, n, e, k, /*renormalize=*/false);
    const Vec w = Normal(n * k);  // loss = Σ w ⊙ gate, so dgate = w
    const Vec dlogits = RouteBackward(r, w, n, e, k, /*renormalize=*/false);
    const Dvec fd = FiniteDifferences(ToDouble(logits), [&](const Dvec& z) {
      const RefRouting ref = RefRouter(z, n, e, k, false);
      EXPECT_EQ(ref.expert, r.expert);  // the step never changes the selection
      return Dot(ref.gate, ToDouble(w));
    });
    EXPECT_LE(RelativeL2(dlogits, fd), kFdTol);
    // The closed form against a float64 evaluation of it from the float
    // probabilities: p_e (a_e − Σ_j p_{e_j} w_j), per element.
    for (int64_t t = 0; t < n; ++t) {
      double dot = 0;
      for (int64_t j = 0; j < k; ++j) {
        dot += double{r.probs[t * e + r.expert[t * k + j]]} * w[t * k + j];
      }
      for (int64_t i = 0; i < e; ++i) {
        double a = 0;
        for (int64_t j = 0; j < k; ++j) {
          if (r.expert[t * k + j] == i) a = w[t * k + j];
        }
        const double ref = r.probs[t * e + i] * (a - dot);
        EXPECT_NEAR(dlogits[t * e + i], ref, 1e-6 * std::fabs(ref) + 1e-12) << t << "," << i;
        // Unchosen experts get a gradient too (the softmax couples them).
        EXPECT_NE(dlogits[t * e + i], 0.0f) << t << "," << i;
      }
    }
    // The raw gates' gradient is not the renormalised one (which is exactly 0
    // for K = 1): the test above can tell the modes apart.
    const Vec renormalized = RouteBackward(Route(logits, n, e, k), w, n, e, k, true);
    EXPECT_GT(RelativeL2(renormalized, ToDouble(dlogits)), 0.1);
  }
}

// ---- load balancing ----

TEST_F(MoeTest, LoadBalancingLossAndGradientMatchFloat64) {
  const int64_t n = 37, e = 8, k = 2;
  const float coef = 0.01f;
  const Vec logits = Normal(n * e, 1.5f);
  const Routing r = Route(logits, n, e, k);
  Vec dlogits(n * e, kNaN);
  const double loss =
      LoadBalancingLoss(dlogits.data(), r.probs.data(), r.expert.data(), n, e, k, coef);
  const double ref = RefLoadBalancing(ToDouble(logits), r.expert, n, e, k, coef);
  EXPECT_NEAR(loss, ref, 1e-6 * ref);
  // f is held at the unperturbed routing: the Switch Transformer gradient.
  const Dvec fd = FiniteDifferences(ToDouble(logits), [&](const Dvec& z) {
    return RefLoadBalancing(z, r.expert, n, e, k, coef);
  });
  EXPECT_LE(RelativeL2(dlogits, fd), kFdTol);
}

TEST_F(MoeTest, LoadBalancingLossIsCoefWhenBalancedAndCoefTimesEWhenCollapsed) {
  const int64_t n = 16, e = 4, k = 1;
  const float coef = 0.5f;
  // Uniform probabilities, routing round-robin: the minimum, coef, with no
  // gradient.
  const Routing uniform = Route(Vec(n * e, 0.0f), n, e, k);
  Ivec round_robin(n);
  for (int64_t t = 0; t < n; ++t) round_robin[t] = static_cast<int32_t>(t % e);
  Vec dlogits(n * e, kNaN);
  EXPECT_NEAR(
      LoadBalancingLoss(dlogits.data(), uniform.probs.data(), round_robin.data(), n, e, k, coef),
      coef, 1e-7);
  for (float g : dlogits) EXPECT_NEAR(g, 0.0f, 1e-9);
  // Every token on expert 0 with (nearly) all its probability: coef · E.
  Vec collapsed(n * e, 0.0f);
  for (int64_t t = 0; t < n; ++t) collapsed[t * e] = 30.0f;
  const Routing one = Route(collapsed, n, e, k);
  EXPECT_EQ(one.expert, Ivec(n, 0));
  EXPECT_NEAR(LoadBalancingLoss(dlogits.data(), one.probs.data(), one.expert.data(), n, e, k, coef),
              coef * e, 1e-6);
}

TEST_F(MoeTest, ExpertTokenCountsCountBeforeDrops) {
  const Ivec expert = {0, 1, 0, 2, 0, 1, 1, 0, 2, 1, 1, 2};
  Counts routed(3, -7);
  ExpertTokenCounts(routed.data(), expert.data(), 6, 3, 2);
  EXPECT_EQ(routed, (Counts{4, 5, 3}));
}

// ---- capacity and dispatch plan ----

TEST_F(MoeTest, ExpertCapacityIsTheCeilingOfTheFactorTimesTheFairShare) {
  EXPECT_EQ(ExpertCapacity(8, 4, 2, 1.0), 4);
  EXPECT_EQ(ExpertCapacity(8, 4, 2, 1.25), 5);
  EXPECT_EQ(ExpertCapacity(10, 4, 1, 1.0), 3);      // 2.5
  EXPECT_EQ(ExpertCapacity(10, 3, 1, 1.0), 4);      // 3.33…
  EXPECT_EQ(ExpertCapacity(7, 8, 1, 1.0), 1);       // 0.875
  EXPECT_EQ(ExpertCapacity(100, 10, 1, 1.1), 11);   // 11.000000000000002 in double
  EXPECT_EQ(ExpertCapacity(50, 1, 2, 1.1), 110);    // 110.00000000000001 in double
  EXPECT_EQ(ExpertCapacity(1000, 64, 2, 1.0), 32);  // 31.25
  EXPECT_EQ(ExpertCapacity(10, 4, 2, 0.0), 20);     // dropless: N·K
}

// 6 tokens, 3 experts, k = 2, capacity 2. First choices in token order fill
// expert 0 with tokens 0 and 1 (token 2 dropped) and expert 1 with tokens 3
// and 5, expert 2 with token 4; of the second choices only token 1's (to
// expert 2) finds room. Token 2 loses both choices.
TEST_F(MoeTest, PlanDispatchHandComputed) {
  const Ivec expert = {0, 1,  //
                       0, 2,  //
                       0, 1,  //
                       1, 0,  //
                       2, 1,  //
                       1, 2};
  const Plan plan = MakePlan(expert, 6, 3, 2, 2);
  EXPECT_EQ(plan.slot, (Ivec{0, -1,   //
                             1, 1,    //
                             -1, -1,  //
                             0, -1,   //
                             0, -1,   //
                             1, -1}));
  EXPECT_EQ(plan.counts, (Counts{2, 2, 2}));
  EXPECT_EQ(plan.slot, RefPlan(expert, 6, 2, 2));
}

TEST_F(MoeTest, FirstChoicesWinOverEarlierTokensSecondChoices) {
  // Token 0's second choice and token 1's first both want expert 1, which
  // has one row: token 1 gets it although token 0 comes first.
  const Plan plan = MakePlan({0, 1, 1, 0}, 2, 2, 2, 1);
  EXPECT_EQ(plan.slot, (Ivec{0, -1, 0, -1}));
  EXPECT_EQ(plan.counts, (Counts{1, 1}));
}

TEST_F(MoeTest, DroplessCapacityDropsNothing) {
  const int64_t n = 10, e = 4, k = 2;
  const int64_t c = ExpertCapacity(n, e, k, 0.0);
  // Everything on experts 0 and 1, as unbalanced as top-2 gets.
  Ivec skewed(n * k);
  for (int64_t t = 0; t < n; ++t) {
    skewed[t * k] = static_cast<int32_t>(t % 2);
    skewed[t * k + 1] = static_cast<int32_t>(1 - t % 2);
  }
  const Plan plan = MakePlan(skewed, n, e, k, c);
  EXPECT_EQ(Drops(plan.slot), 0);
  EXPECT_EQ(plan.counts, (Counts{10, 10, 0, 0}));
  EXPECT_EQ(plan.slot, RefPlan(skewed, n, k, c));
  // And random routing.
  const Ivec random = RandomExperts(n, e, k);
  const Plan random_plan = MakePlan(random, n, e, k, c);
  EXPECT_EQ(Drops(random_plan.slot), 0);
  EXPECT_EQ(std::accumulate(random_plan.counts.begin(), random_plan.counts.end(), int64_t{0}),
            n * k);
}

TEST_F(MoeTest, PlanDispatchMatchesDefinitionOnRandomRouting) {
  const int64_t n = 29, e = 5, k = 3;
  const Ivec expert = RandomExperts(n, e, k);
  const int64_t c = ExpertCapacity(n, e, k, 0.8);
  const Plan plan = MakePlan(expert, n, e, k, c);
  ASSERT_GT(Drops(plan.slot), 0);
  EXPECT_EQ(plan.slot, RefPlan(expert, n, k, c));
  for (int64_t i = 0; i < e; ++i) {
    EXPECT_LE(plan.counts[i], c);
    int64_t kept = 0;
    for (int64_t j = 0; j < n * k; ++j) kept += expert[j] == i && plan.slot[j] != kDroppedSlot;
    EXPECT_EQ(plan.counts[i], kept);
  }
}

// ---- permute and combine ----

TEST_F(MoeTest, PermuteThenCombineWithUnitGatesReproducesTheTokens) {
  const Dims d{16, 4, 1, 8, 0};
  const Vec x = Normal(d.n * d.h);
  const Routing r = Route(Normal(d.n * d.e), d.n, d.e, d.k);
  for (float g : r.gate) ASSERT_EQ(g, 1.0f);
  for (int64_t c : {ExpertCapacity(d.n, d.e, d.k, 0.0), int64_t{2}}) {
    SCOPED_TRACE(c);
    const Plan plan = MakePlan(r.expert, d.n, d.e, d.k, c);
    Vec buffer(d.e * c * d.h, kNaN), y(d.n * d.h, kNaN);
    Permute(buffer.data(), x.data(), r.expert.data(), plan.slot.data(), d.n, d.e, d.k, d.h, c);
    // Rows past an expert's count are 0.
    for (int64_t e = 0; e < d.e; ++e) {
      for (int64_t row = plan.counts[e]; row < c; ++row) {
        for (int64_t h = 0; h < d.h; ++h) EXPECT_EQ(buffer[(e * c + row) * d.h + h], 0.0f);
      }
    }
    // Identity experts.
    Combine(y.data(), buffer.data(), r.gate.data(), r.expert.data(), plan.slot.data(), d.n, d.k,
            d.h, c);
    for (int64_t t = 0; t < d.n; ++t) {
      const bool dropped = plan.slot[t] == kDroppedSlot;
      for (int64_t h = 0; h < d.h; ++h) {
        EXPECT_EQ(y[t * d.h + h], dropped ? 0.0f : x[t * d.h + h]) << t << "," << h;
      }
    }
    const int64_t kept = std::accumulate(plan.counts.begin(), plan.counts.end(), int64_t{0});
    EXPECT_EQ(Drops(plan.slot), d.n - kept);
    if (c == 2) {
      EXPECT_GE(Drops(plan.slot), d.n - 2 * d.e);  // 16 tokens, 8 rows
    } else {
      EXPECT_EQ(Drops(plan.slot), 0);
    }
  }
}

TEST_F(MoeTest, PermuteBackwardMatchesFiniteDifferences) {
  Dims d{11, 4, 2, 5, 0};
  d.c = ExpertCapacity(d.n, d.e, d.k, 0.75);  // 5 rows for 22 choices
  const Ivec expert = RandomExperts(d.n, d.e, d.k);
  const Plan plan = MakePlan(expert, d.n, d.e, d.k, d.c);
  ASSERT_GT(Drops(plan.slot), 0);
  const Vec x = Normal(d.n * d.h);
  const Vec w = Normal(d.e * d.c * d.h);  // loss = Σ w ⊙ expert_in

  Vec buffer(w.size(), kNaN);
  Permute(buffer.data(), x.data(), expert.data(), plan.slot.data(), d.n, d.e, d.k, d.h, d.c);
  EXPECT_EQ(ToDouble(buffer), RefPermute(ToDouble(x), expert, plan.slot, d));

  Vec dx(x.size(), kNaN);
  PermuteBackward(dx.data(), w.data(), expert.data(), plan.slot.data(), d.n, d.k, d.h, d.c);
  const Dvec fd = FiniteDifferences(ToDouble(x), [&](const Dvec& xd) {
    return Dot(RefPermute(xd, expert, plan.slot, d), ToDouble(w));
  });
  EXPECT_LE(RelativeL2(dx, fd), kFdTol);
  for (int64_t t = 0; t < d.n; ++t) {
    if (plan.slot[t * d.k] != kDroppedSlot || plan.slot[t * d.k + 1] != kDroppedSlot) continue;
    for (int64_t h = 0; h < d.h; ++h) EXPECT_EQ(dx[t * d.h + h], 0.0f);
  }
}

TEST_F(MoeTest, CombineAndItsBackwardMatchFloat64) {
  Dims d{11, 4, 2, 5, 0};
  d.c = ExpertCapacity(d.n, d.e, d.k, 0.75);
  const Routing r = Route(Normal(d.n * d.e), d.n, d.e, d.k);
  const Plan plan = MakePlan(r.expert, d.n, d.e, d.k, d.c);
  ASSERT_GT(Drops(plan.slot), 0);
  const Vec out = Normal(d.e * d.c * d.h);
  const Vec w = Normal(d.n * d.h);  // loss = Σ w ⊙ y, so dy = w

  Vec y(d.n * d.h, kNaN);
  Combine(y.data(), out.data(), r.gate.data(), r.expert.data(), plan.slot.data(), d.n, d.k, d.h,
          d.c);
  const Dvec y_ref = RefCombine(ToDouble(out), ToDouble(r.gate), r.expert, plan.slot, d);
  for (size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(y[i], y_ref[i], 1e-6) << i;

  Vec dout(out.size(), kNaN), dgate(d.n * d.k, kNaN);
  CombineBackward(dout.data(), dgate.data(), w.data(), out.data(), r.gate.data(), r.expert.data(),
                  plan.slot.data(), d.n, d.e, d.k, d.h, d.c);
  const Dvec fd_out = FiniteDifferences(ToDouble(out), [&](const Dvec& o) {
    return Dot(RefCombine(o, ToDouble(r.gate), r.expert, plan.slot, d), ToDouble(w));
  });
  const Dvec fd_gate = FiniteDifferences(ToDouble(r.gate), [&](const Dvec& g) {
    return Dot(RefCombine(ToDouble(out), g, r.expert, plan.slot, d), ToDouble(w));
  });
  EXPECT_LE(RelativeL2(dout, fd_out), kFdTol);
  EXPECT_LE(RelativeL2(dgate, fd_gate), kFdTol);
  // Exact zeros where nothing is kept.
  for (int64_t i = 0; i < d.n * d.k; ++i) {
    if (plan.slot[i] == kDroppedSlot) {
      EXPECT_EQ(dgate[i], 0.0f) << i;
    }
  }
  for (int64_t e = 0; e < d.e; ++e) {
    for (int64_t row = plan.counts[e]; row < d.c; ++row) {
      for (int64_t h = 0; h < d.h; ++h) EXPECT_EQ(dout[(e * d.c + row) * d.h + h], 0.0f);
    }
  }
}

// ---- a whole MoE layer ----

// y = Σ_j gate · s_e ⊙ x (each expert scales its tokens by its own s_e [H]),
// loss = Σ w ⊙ y + the load-balancing loss.
struct Layer {
  Dims d;
  float coef;
  bool renormalize;
  Vec x, logits, scale, w;  // [N,H], [N,E], [E,H], [N,H]
};

struct LayerRun {
  Routing r;
  Plan plan;
  Vec expert_in, expert_out, y, dlogits, dx;
  double aux;
};

// buffer[e,c,h] *= scale[e,h] for a buffer [E,C,H].
void ScaleByExpert(Vec& buffer, const Layer& l) {
  const int64_t rows = l.d.c * l.d.h;
  for (size_t i = 0; i < buffer.size(); ++i) buffer[i] *= l.scale[(i / rows) * l.d.h + i % l.d.h];
}

LayerRun RunLayer(const Layer& l) {
  const Dims& d = l.d;
  LayerRun run;
  run.r = Route(l.logits, d.n, d.e, d.k, l.renormalize);
  run.plan = MakePlan(run.r.expert, d.n, d.e, d.k, d.c);
  const int32_t* expert = run.r.expert.data();
  const int32_t* slot = run.plan.slot.data();
  run.expert_in.assign(d.e * d.c * d.h, kNaN);
  Permute(run.expert_in.data(), l.x.data(), expert, slot, d.n, d.e, d.k, d.h, d.c);
  run.expert_out = run.expert_in;
  ScaleByExpert(run.expert_out, l);
  run.y.assign(d.n * d.h, kNaN);
  Combine(run.y.data(), run.expert_out.data(), run.r.gate.data(), expert, slot, d.n, d.k, d.h, d.c);

  Vec dexpert(run.expert_out.size(), kNaN), dgate(d.n * d.k, kNaN);
  CombineBackward(dexpert.data(), dgate.data(), l.w.data(), run.expert_out.data(),
                  run.r.gate.data(), expert, slot, d.n, d.e, d.k, d.h, d.c);
  ScaleByExpert(dexpert, l);  // the experts are diagonal: their backward is the same scale
  run.dx.assign(d.n * d.h, kNaN);
  PermuteBackward(run.dx.data(), dexpert.data(), expert, slot, d.n, d.k, d.h, d.c);
  run.dlogits = RouteBackward(run.r, dgate, d.n, d.e, d.k, l.renormalize);
  Vec daux(d.n * d.e, kNaN);
  run.aux = LoadBalancingLoss(daux.data(), run.r.probs.data(), expert, d.n, d.e, d.k, l.coef);
  for (size_t i = 0; i < daux.size(); ++i) run.dlogits[i] += daux[i];
  return run;
}

double RefLayerLoss(const Dvec& x, const Dvec& logits, const Layer& l) {
  const Dims& d = l.d;
  const RefRouting r = RefRouter(logits, d.n, d.e, d.k, l.renormalize);
  const Ivec slot = RefPlan(r.expert, d.n, d.k, d.c);
  double loss = 0;
  for (int64_t i = 0; i < d.n * d.k; ++i) {
    if (slot[i] == kDroppedSlot) continue;
    const int64_t t = i / d.k;
    for (int64_t h = 0; h < d.h; ++h) {
      loss += l.w[t * d.h + h] * r.gate[i] * l.scale[r.expert[i] * d.h + h] * x[t * d.h + h];
    }
  }
  return loss + RefLoadBalancing(logits, r.expert, d.n, d.e, d.k, l.coef);
}

class MoeLayerTest : public MoeTest {
 protected:
  // k = 2: 5 rows for 24 choices; k = 1: 3 rows for 12.
  Layer RandomLayer(int64_t k = 2, bool renormalize = true) {
    Layer l{{12, 4, k, 4, 0}, 0.1f, renormalize, {}, {}, {}, {}};
    l.d.c = ExpertCapacity(l.d.n, l.d.e, l.d.k, 0.75);
    l.x = Normal(l.d.n * l.d.h);
    l.logits = SeparatedLogits(l.d.n, l.d.e);
    l.scale = Normal(l.d.e * l.d.h);
    l.w = Normal(l.d.n * l.d.h);
    return l;
  }
};

TEST_F(MoeLayerTest, LayerGradientMatchesFiniteDifferences) {
  // Mixtral (top-2, renormalised), top-2 with raw gates, Switch (top-1, raw)
  // and top-1 renormalised (gate 1: the router learns from the aux loss only).
  for (const auto& [k, renormalize] :
       {std::pair{2, true}, std::pair{2, false}, std::pair{1, false}, std::pair{1, true}}) {
    SCOPED_TRACE(testing::Message() << "k " << k << (renormalize ? " renormalised" : " raw"));
    const Layer l = RandomLayer(k, renormalize);
    const LayerRun run = RunLayer(l);
    ASSERT_GT(Drops(run.plan.slot), 0);
    const Dvec x = ToDouble(l.x), logits = ToDouble(l.logits);
    const Dvec fd_x =
        FiniteDifferences(x, [&](const Dvec& xd) { return RefLayerLoss(xd, logits, l); });
    const Dvec fd_logits =
        FiniteDifferences(logits, [&](const Dvec& z) { return RefLayerLoss(x, z, l); });
    EXPECT_LE(RelativeL2(run.dx, fd_x), kFdTol);
    EXPECT_LE(RelativeL2(run.dlogits, fd_logits), kFdTol);
  }
}

TEST_F(MoeLayerTest, RunningTwiceGivesIdenticalBits) {
  for (bool renormalize : {true, false}) {
    const Layer l = RandomLayer(2, renormalize);
    const LayerRun a = RunLayer(l), b = RunLayer(l);
    EXPECT_TRUE(SameBits(a.r.probs, b.r.probs));
    EXPECT_TRUE(SameBits(a.r.gate, b.r.gate));
    EXPECT_EQ(a.r.expert, b.r.expert);
    EXPECT_EQ(a.plan.slot, b.plan.slot);
    EXPECT_EQ(a.plan.counts, b.plan.counts);
    EXPECT_TRUE(SameBits(a.expert_in, b.expert_in));
    EXPECT_TRUE(SameBits(a.y, b.y));
    EXPECT_TRUE(SameBits(a.dx, b.dx));
    EXPECT_TRUE(SameBits(a.dlogits, b.dlogits));
    EXPECT_EQ(std::memcmp(&a.aux, &b.aux, sizeof(double)), 0);
  }
}

}  // namespace
}  // namespace baton::kernels::cpu
