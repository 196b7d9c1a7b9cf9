// Every CPU kernel against a float64 reference: forward values directly, and
// backward against central finite differences of the float64 forward.
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/arena.h"
#include "kernels/cpu/fast_math.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/grad_norm.h"
#include "kernels/ops.h"
#include "kernels/tensor.h"

// The allocations below that no host can give must fail as the system's
// allocator fails, not as a sanitizer report (ASAN_OPTIONS and TSAN_OPTIONS,
// when set, add to this).
extern "C" const char* __asan_default_options() { return "allocator_may_return_null=1"; }
extern "C" const char* __tsan_default_options() { return "allocator_may_return_null=1"; }

namespace baton::kernels {
namespace {

using Vec = std::vector<double>;
// A float64 forward: inputs → flat outputs.
using RefFn = std::function<Vec(const std::vector<Vec>&)>;

class KernelsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { cpu::SetBlasThreads(1); }

  Tensor Random(Shape shape, double scale = 1.0) {
    Tensor t = Tensor::Zeros(std::move(shape));
    std::normal_distribution<float> dist(0.0f, static_cast<float>(scale));
    for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = dist(rng_);
    return t;
  }
  std::mt19937 rng_{1234};
};

Vec ToVec(const Tensor& t) { return Vec(t.f32(), t.f32() + t.numel()); }

// d/d inputs[which] of Σ_k w[k] · f(inputs)[k], by central differences.
Vec FiniteDifference(const RefFn& f, std::vector<Vec> inputs, int which, const Vec& w) {
  const double h = 1e-6;
  Vec grad(inputs[which].size());
  for (size_t i = 0; i < grad.size(); ++i) {
    const double saved = inputs[which][i];
    inputs[which][i] = saved + h;
    const Vec plus = f(inputs);
    inputs[which][i] = saved - h;
    const Vec minus = f(inputs);
    inputs[which][i] = saved;
    double d = 0.0;
    for (size_t k = 0; k < w.size(); ++k) d += w[k] * (plus[k] - minus[k]);
    grad[i] = d / (2 * h);
  }
  return grad;
}

double RelativeError(const Vec& got, const Vec& want) {
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff += (got[i] - want[i]) * (got[i] - want[i]);
    norm += want[i] * want[i];
  }
  return std::sqrt(diff) / std::max(std::sqrt(norm), 1e-30);
}

constexpr double kForwardTol = 1e-5;
constexpr double kGradTol = 1e-4;

Vec RefLayerNorm(const Vec& x, const Vec& w, const Vec& b) {
  const size_t c = w.size(), n = x.size() / c;
  Vec y(x.size());
  for (size_t r = 0; r < n; ++r) {
    double mean = 0, var = 0;
    for (size_t j = 0; j < c; ++j) mean += x[r * c + j];
    mean /= c;
    for (size_t j = 0; j < c; ++j) var += (x[r * c + j] - mean) * (x[r * c + j] - mean);
    const double rstd = 1.0 / std::sqrt(var / c + 1e-5);
    for (size_t j = 0; j < c; ++j) y[r * c + j] = (x[r * c + j] - mean) * rstd * w[j] + b[j];
  }
  return y;
}

TEST_F(KernelsTest, LayerNormMatchesFloat64) {
  const int64_t n = 6, c = 10;
  Tensor x = Random({n, c}), w = Random({c}), b = Random({c}), dy = Random({n, c});
  Tensor y = Tensor::Zeros({n, c}), mean = Tensor::Zeros({n}), rstd = Tensor::Zeros({n});
  LayerNorm(y, mean, rstd, x, w, b);
  RefFn f = [](const std::vector<Vec>& in) { return RefLayerNorm(in[0], in[1], in[2]); };
  const std::vector<Vec> in = {ToVec(x), ToVec(w), ToVec(b)};
  EXPECT_LT(RelativeError(ToVec(y), f(in)), kForwardTol);

  Tensor dx = Tensor::Zeros({n, c}), dw = Tensor::Zeros({c}), db = Tensor::Zeros({c});
  LayerNormBackward(dx, dw, db, dy, x, w, mean, rstd);
  EXPECT_LT(RelativeError(ToVec(dx), FiniteDifference(f, in, 0, ToVec(dy))), kGradTol);
  EXPECT_LT(RelativeError(ToVec(dw), FiniteDifference(f, in, 1, ToVec(dy))), kGradTol);
  EXPECT_LT(RelativeError(ToVec(db), FiniteDifference(f, in, 2, ToVec(dy))), kGradTol);
}

Vec RefLinear(const Vec& x, const Vec& w, const Vec& b, size_t in, size_t out) {
  const size_t n = x.size() / in;
  Vec y(n * out);
  for (size_t r = 0; r < n; ++r) {
    for (size_t o = 0; o < out; ++o) {
      double s = b[o];
      for (size_t i = 0; i < in; ++i) s += x[r * in + i] * w[o * in + i];
      y[r * out + o] = s;
    }
  }
  return y;
}

TEST_F(KernelsTest, LinearMatchesFloat64) {
  const int64_t n = 5, in = 7, out = 4;
  Tensor x = Random({n, in}), w = Random({out, in}), b = Random({out}), dy = Random({n, out});
  Tensor y = Tensor::Zeros({n, out});
  Linear(y, x, w, b);
  RefFn f = [&](const std::vector<Vec>& v) { return RefLinear(v[0], v[1], v[2], in, out); };
  const std::vector<Vec> vin = {ToVec(x), ToVec(w), ToVec(b)};
  EXPECT_LT(RelativeError(ToVec(y), f(vin)), kForwardTol);

  // Accumulation: start dx from a known value and check it was added to.
  Tensor dx = Random({n, in});
  const Vec dx0 = ToVec(dx);
  LinearBackwardInput(dx, dy, w, /*accumulate=*/true);
  Vec want = FiniteDifference(f, vin, 0, ToVec(dy));
  for (size_t i = 0; i < want.size(); ++i) want[i] += dx0[i];
  EXPECT_LT(RelativeError(ToVec(dx), want), kGradTol);

  // Bias added separately (after a TP reduction) matches the fused bias.
  Tensor y2 = Tensor::Zeros({n, out});
  Linear(y2, x, w, Tensor());
  AddBias(y2, b);
  EXPECT_LT(RelativeError(ToVec(y2), f(vin)), kForwardTol);

  Tensor dw = Tensor::Zeros({out, in}), db = Tensor::Zeros({out});
  LinearBackwardWeight(dw, dy, x);
  BiasBackward(db, dy);
  EXPECT_LT(RelativeError(ToVec(dw), FiniteDifference(f, vin, 1, ToVec(dy))), kGradTol);
  EXPECT_LT(RelativeError(ToVec(db), FiniteDifference(f, vin, 2, ToVec(dy))), kGradTol);
}

TEST_F(KernelsTest, GeluMatchesFloat64) {
  const int64_t n = 64;
  Tensor x = Random({n}, 2.0), dy = Random({n}), y = Tensor::Zeros({n}), dx = Tensor::Zeros({n});
  Gelu(y, x);
  RefFn f = [](const std::vector<Vec>& in) {
    Vec y(in[0].size());
    for (size_t i = 0; i < y.size(); ++i) {
      const double v = in[0][i];
      y[i] = 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)));
    }
    return y;
  };
  EXPECT_LT(RelativeError(ToVec(y), f({ToVec(x)})), kForwardTol);
  GeluBackward(dx, x, dy);
  EXPECT_LT(RelativeError(ToVec(dx), FiniteDifference(f, {ToVec(x)}, 0, ToVec(dy))), kGradTol);
}

Vec RefAttention(const Vec& qkv, size_t b_n, size_t t_n, size_t c, size_t heads) {
  const size_t hd = c / heads;
  Vec out(b_n * t_n * c, 0.0);
  for (size_t b = 0; b < b_n; ++b) {
    for (size_t h = 0; h < heads; ++h) {
      auto at = [&](size_t t, size_t part, size_t d) {
        return qkv[(b * t_n + t) * 3 * c + part * c + h * hd + d];
      };
      for (size_t i = 0; i < t_n; ++i) {
        Vec s(i + 1);
        double max = -1e300;
        for (size_t j = 0; j <= i; ++j) {
          double dot = 0;
          for (size_t d = 0; d < hd; ++d) dot += at(i, 0, d) * at(j, 1, d);
          s[j] = dot / std::sqrt(static_cast<double>(hd));
          max = std::max(max, s[j]);
        }
        double sum = 0;
        for (size_t j = 0; j <= i; ++j) sum += (s[j] = std::exp(s[j] - max));
        for (size_t d = 0; d < hd; ++d) {
          double o = 0;
          for (size_t j = 0; j <= i; ++j) o += s[j] / sum * at(j, 2, d);
          out[(b * t_n + i) * c + h * hd + d] = o;
        }
      }
    }
  }
  return out;
}

TEST_F(KernelsTest, CausalAttentionMatchesFloat64) {
  const int64_t b = 2, t = 5, c = 8, heads = 2;
  Tensor qkv = Random({b, t, 3 * c}), dy = Random({b, t, c});
  Tensor y = Tensor::Zeros({b, t, c}), att = Tensor::Zeros({b, heads, t, t});
  Attention(y, att, qkv, heads);
  RefFn f = [&](const std::vector<Vec>& in) { return RefAttention(in[0], b, t, c, heads); };
  EXPECT_LT(RelativeError(ToVec(y), f({ToVec(qkv)})), kForwardTol);
  // Causality: no probability mass on future positions.
  for (int64_t i = 0; i < t; ++i) {
    for (int64_t j = i + 1; j < t; ++j) EXPECT_EQ(att.f32()[i * t + j], 0.0f);
  }

  Tensor dqkv = Tensor::Zeros({b, t, 3 * c}), scratch = Tensor::Zeros({t, t});
  AttentionBackward(dqkv, scratch, dy, qkv, att, heads);
  EXPECT_LT(RelativeError(ToVec(dqkv), FiniteDifference(f, {ToVec(qkv)}, 0, ToVec(dy))), kGradTol);
}

TEST_F(KernelsTest, EmbeddingMatchesFloat64WithRepeatedTokens) {
  const int64_t b = 2, t = 3, c = 4, vocab = 5;
  Tensor tokens = Tensor::Zeros({b, t}, DType::kInt32);
  const int32_t ids[] = {1, 4, 1, 0, 1, 3};  // token 1 repeats
  std::memcpy(tokens.i32(), ids, sizeof(ids));
  Tensor wte = Random({vocab, c}), wpe = Random({t, c}), dy = Random({b * t, c});
  Tensor y = Tensor::Zeros({b * t, c});
  Embedding(y, tokens, wte, 0, wpe);
  RefFn f = [&](const std::vector<Vec>& in) {
    Vec out(b * t * c);
    for (int64_t r = 0; r < b * t; ++r) {
      for (int64_t j = 0; j < c; ++j)
        out[r * c + j] = in[0][ids[r] * c + j] + in[1][(r % t) * c + j];
    }
    return out;
  };
  const std::vector<Vec> in = {ToVec(wte), ToVec(wpe)};
  EXPECT_LT(RelativeError(ToVec(y), f(in)), kForwardTol);
  Tensor dwte = Tensor::Zeros({vocab, c}), dwpe = Tensor::Zeros({t, c});
  EmbeddingBackward(dwte, 0, dwpe, dy, tokens);
  EXPECT_LT(RelativeError(ToVec(dwte), FiniteDifference(f, in, 0, ToVec(dy))), kGradTol);
  EXPECT_LT(RelativeError(ToVec(dwpe), FiniteDifference(f, in, 1, ToVec(dy))), kGradTol);
}

TEST_F(KernelsTest, VocabularyShardsSumToTheWholeEmbedding) {
  const int64_t b = 2, t = 3, c = 4, vocab = 6;
  Tensor tokens = Tensor::Zeros({b, t}, DType::kInt32);
  const int32_t ids[] = {5, 0, 2, 3, 5, 1};
  std::memcpy(tokens.i32(), ids, sizeof(ids));
  Tensor wte = Random({vocab, c}), wpe = Random({t, c}), dy = Random({b * t, c});
  Tensor whole = Tensor::Zeros({b * t, c});
  Embedding(whole, tokens, wte, 0, wpe);
  // Two shards of three rows; shard 1 adds the positions; the outputs summed.
  Tensor sum = Tensor::Zeros({b * t, c}), part = Tensor::Zeros({b * t, c});
  Tensor dwte = Tensor::Zeros({vocab, c});
  for (int64_t shard = 0; shard < 2; ++shard) {
    Embedding(part, tokens, wte.Rows(3 * shard, 3 * shard + 3), 3 * shard,
              shard == 1 ? wpe : Tensor());
    for (int64_t i = 0; i < sum.numel(); ++i) sum.f32()[i] += part.f32()[i];
    EmbeddingBackward(dwte.Rows(3 * shard, 3 * shard + 3), 3 * shard, Tensor(), dy, tokens);
  }
  EXPECT_EQ(std::memcmp(sum.raw(), whole.raw(), whole.bytes()), 0);  // exact, not approximate
  Tensor want = Tensor::Zeros({vocab, c});
  EmbeddingBackward(want, 0, Tensor(), dy, tokens);
  EXPECT_EQ(std::memcmp(dwte.raw(), want.raw(), want.bytes()), 0);
}

TEST_F(KernelsTest, ResidualMatchesFloat64) {
  const int64_t n = 12;
  Tensor a = Random({n}), b = Random({n}), dy = Random({n}), y = Tensor::Zeros({n});
  Residual(y, a, b);
  RefFn f = [](const std::vector<Vec>& in) {
    Vec out(in[0].size());
    for (size_t i = 0; i < out.size(); ++i) out[i] = in[0][i] + in[1][i];
    return out;
  };
  const std::vector<Vec> in = {ToVec(a), ToVec(b)};
  EXPECT_LT(RelativeError(ToVec(y), f(in)), kForwardTol);
  Tensor da = Tensor::Zeros({n}), db = Tensor::Zeros({n});
  ResidualBackward(da, db, dy);
  EXPECT_LT(RelativeError(ToVec(da), FiniteDifference(f, in, 0, ToVec(dy))), kGradTol);
  EXPECT_LT(RelativeError(ToVec(db), FiniteDifference(f, in, 1, ToVec(dy))), kGradTol);
}

TEST_F(KernelsTest, SoftmaxCrossEntropyMatchesFloat64) {
  const int64_t n = 4, vocab = 9;
  Tensor logits = Random({n, vocab}, 3.0), targets = Tensor::Zeros({n}, DType::kInt32);
  const int32_t ids[] = {0, 8, 3, 3};
  std::memcpy(targets.i32(), ids, sizeof(ids));
  RefFn f = [&](const std::vector<Vec>& in) {
    double total = 0;
    for (int64_t r = 0; r < n; ++r) {
      double max = -1e300, sum = 0;
      for (int64_t v = 0; v < vocab; ++v) max = std::max(max, in[0][r * vocab + v]);
      for (int64_t v = 0; v < vocab; ++v) sum += std::exp(in[0][r * vocab + v] - max);
      total += std::log(sum) + max - in[0][r * vocab + ids[r]];
    }
    return Vec{total / n};
  };
  const std::vector<Vec> in = {ToVec(logits)};
  const double loss = SoftmaxCrossEntropy(logits, targets, 1.0f / n) / n;
  EXPECT_NEAR(loss, f(in)[0], 1e-5 * f(in)[0]);
  EXPECT_LT(RelativeError(ToVec(logits), FiniteDifference(f, in, 0, Vec{1.0})), kGradTol);
}

TEST_F(KernelsTest, VocabularyParallelCrossEntropyMatchesFloat64) {
  const int64_t n = 4, vocab = 9, shards = 3, cols = vocab / shards;
  Tensor logits = Random({n, vocab}, 3.0), targets = Tensor::Zeros({n}, DType::kInt32);
  const int32_t ids[] = {0, 8, 4, 3};
  std::memcpy(targets.i32(), ids, sizeof(ids));
  RefFn f = [&](const std::vector<Vec>& in) {
    double total = 0;
    for (int64_t r = 0; r < n; ++r) {
      double sum = 0;
      for (int64_t v = 0; v < vocab; ++v) sum += std::exp(in[0][r * vocab + v]);
      total += std::log(sum) - in[0][r * vocab + ids[r]];
    }
    return Vec{total / n};
  };
  const Vec want_grad = FiniteDifference(f, {ToVec(logits)}, 0, Vec{1.0});
  // Each shard's columns as its own [n, cols] tensor; the collectives by hand.
  std::vector<Tensor> part, row_max, lse;
  Tensor lse_all = Tensor::Zeros({shards, n}), target_sum = Tensor::Zeros({n});
  for (int64_t s = 0; s < shards; ++s) {
    part.push_back(Tensor::Zeros({n, cols}));
    row_max.push_back(Tensor::Zeros({n}));
    lse.push_back(Tensor::Zeros({n}));
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t v = 0; v < cols; ++v) {
        part[s].f32()[r * cols + v] = logits.f32()[r * vocab + s * cols + v];
      }
    }
    Tensor target_logit = Tensor::Zeros({n});
    ShardedCrossEntropyStats(part[s], targets, s * cols, row_max[s], lse[s], target_logit);
    std::memcpy(lse_all.f32() + s * n, lse[s].f32(), n * sizeof(float));
    for (int64_t r = 0; r < n; ++r) target_sum.f32()[r] += target_logit.f32()[r];
  }
  Vec grad(n * vocab);
  for (int64_t s = 0; s < shards; ++s) {
    const double loss = ShardedCrossEntropyFinish(part[s], targets, s * cols, row_max[s], lse_all,
                                                  target_sum, 1.0f / n) /
                        n;
    EXPECT_NEAR(loss, f({ToVec(logits)})[0], 1e-5 * loss);  // every shard agrees
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t v = 0; v < cols; ++v) {
        grad[r * vocab + s * cols + v] = part[s].f32()[r * cols + v];
      }
    }
  }
  EXPECT_LT(RelativeError(grad, want_grad), kGradTol);
}

// The float64 mean cross-entropy over the rows whose target is not ignored.
RefFn MaskedCrossEntropy(int64_t n, int64_t vocab, std::vector<int32_t> ids) {
  return [=](const std::vector<Vec>& in) {
    double total = 0;
    int scored = 0;
    for (int64_t r = 0; r < n; ++r) {
      if (ids[r] == kIgnoreTarget) continue;
      double sum = 0;
      for (int64_t v = 0; v < vocab; ++v) sum += std::exp(in[0][r * vocab + v]);
      total += std::log(sum) - in[0][r * vocab + ids[r]];
      ++scored;
    }
    return Vec{total / scored};
  };
}

TEST_F(KernelsTest, IgnoredTargetsAddNoLossAndNoGradient) {
  const int64_t n = 5, vocab = 9, scored = 3;
  const std::vector<int32_t> ids = {0, -1, 3, -1, 8};
  Tensor logits = Random({n, vocab}, 3.0), targets = Tensor::Zeros({n}, DType::kInt32);
  std::memcpy(targets.i32(), ids.data(), n * sizeof(int32_t));
  const RefFn f = MaskedCrossEntropy(n, vocab, ids);
  const std::vector<Vec> in = {ToVec(logits)};
  const double loss = SoftmaxCrossEntropy(logits, targets, 1.0f / scored) / scored;
  EXPECT_NEAR(loss, f(in)[0], 1e-5 * f(in)[0]);
  EXPECT_LT(RelativeError(ToVec(logits), FiniteDifference(f, in, 0, Vec{1.0})), kGradTol);
  for (int64_t v = 0; v < vocab; ++v) {
    EXPECT_EQ(logits.f32()[1 * vocab + v], 0.0f);  // ignored rows: exactly zero
    EXPECT_EQ(logits.f32()[3 * vocab + v], 0.0f);
  }
}

TEST_F(KernelsTest, VocabularyParallelCrossEntropyIgnoresTargets) {
  const int64_t n = 5, vocab = 9, shards = 3, cols = vocab / shards, scored = 3;
  const std::vector<int32_t> ids = {-1, 8, 4, -1, 3};
  Tensor logits = Random({n, vocab}, 3.0), targets = Tensor::Zeros({n}, DType::kInt32);
  std::memcpy(targets.i32(), ids.data(), n * sizeof(int32_t));
  const RefFn f = MaskedCrossEntropy(n, vocab, ids);
  const Vec want_grad = FiniteDifference(f, {ToVec(logits)}, 0, Vec{1.0});
  std::vector<Tensor> part, row_max;
  Tensor lse_all = Tensor::Zeros({shards, n}), target_sum = Tensor::Zeros({n});
  for (int64_t s = 0; s < shards; ++s) {
    part.push_back(Tensor::Zeros({n, cols}));
    row_max.push_back(Tensor::Zeros({n}));
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t v = 0; v < cols; ++v) {
        part[s].f32()[r * cols + v] = logits.f32()[r * vocab + s * cols + v];
      }
    }
    Tensor lse = Tensor::Zeros({n}), target_logit = Tensor::Zeros({n});
    ShardedCrossEntropyStats(part[s], targets, s * cols, row_max[s], lse, target_logit);
    std::memcpy(lse_all.f32() + s * n, lse.f32(), n * sizeof(float));
    for (int64_t r = 0; r < n; ++r) target_sum.f32()[r] += target_logit.f32()[r];
  }
  Vec grad(n * vocab);
  for (int64_t s = 0; s < shards; ++s) {
    const double loss = ShardedCrossEntropyFinish(part[s], targets, s * cols, row_max[s], lse_all,
                                                  target_sum, 1.0f / scored) /
                        scored;
    EXPECT_NEAR(loss, f({ToVec(logits)})[0], 1e-5 * loss);
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t v = 0; v < cols; ++v) {
        grad[r * vocab + s * cols + v] = part[s].f32()[r * cols + v];
      }
    }
  }
  EXPECT_LT(RelativeError(grad, want_grad), kGradTol);
  for (int64_t v = 0; v < vocab; ++v) EXPECT_EQ(grad[0 * vocab + v], 0.0);
}

TEST_F(KernelsTest, ArgmaxHitsTakeTheLowestIndexOnTiesInEveryShardLayout) {
  const int64_t n = 7, vocab = 6;
  const float z[n][vocab] = {
      {1, 5, 5, 0, 0, 0},  // target 1: tie inside a shard, lowest wins → hit
      {1, 5, 5, 0, 0, 0},  // target 2: same tie → miss
      {0, 0, 7, 7, 0, 0},  // target 2: tie across the halves → hit
      {0, 0, 7, 7, 0, 0},  // target 3 → miss
      {0, 0, 0, 0, 0, 9},  // target 5 → hit
      {9, 0, 0, 0, 0, 0},  // ignored (a hit if it counted)
      {0, 1, 0, 0, 0, 2},  // target 1 → miss
  };
  const int32_t ids[n] = {1, 2, 2, 3, 5, -1, 1};
  Tensor targets = Tensor::Zeros({n}, DType::kInt32);
  std::memcpy(targets.i32(), ids, sizeof(ids));
  for (const int64_t shards : {1, 2, 3}) {
    SCOPED_TRACE(::testing::Message() << shards << " shards");
    const int64_t cols = vocab / shards;
    Tensor max_all = Tensor::Zeros({shards, n}), index_all = Tensor::Zeros({shards, n});
    for (int64_t s = 0; s < shards; ++s) {
      Tensor part = Tensor::Zeros({n, cols});
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t v = 0; v < cols; ++v) part.f32()[r * cols + v] = z[r][s * cols + v];
      }
      ShardArgmax(part, s * cols, max_all.Rows(s, s + 1).Reshaped({n}),
                  index_all.Rows(s, s + 1).Reshaped({n}));
    }
    EXPECT_EQ(CountArgmaxHits(max_all, index_all, targets), 3);
  }
}

TEST_F(KernelsTest, CrossEntropyOfAVeryUnlikelyTargetIsExact) {
  // The target's logit is 200 below the others: loss ≈ 200 + log 3.
  Tensor logits = Tensor::Zeros({1, 4}), targets = Tensor::Zeros({1}, DType::kInt32);
  const float z[] = {100.0f, 100.0f, -100.0f, 100.0f};
  std::memcpy(logits.f32(), z, sizeof(z));
  targets.i32()[0] = 2;
  EXPECT_NEAR(SoftmaxCrossEntropy(logits, targets, 1.0f), 200.0 + std::log(3.0), 1e-4);
  EXPECT_NEAR(logits.f32()[2], -1.0f, 1e-6);  // softmax ≈ 0 minus one-hot
}

// Per-row ops divide by their row count: an empty batch is refused by
// name, not a division by zero (SIGFPE).
TEST(KernelsDeathTest, PerRowOpsRefuseAnEmptyBatchByName) {
  Tensor logits = Tensor::Zeros({0, 4}), targets = Tensor::Zeros({0}, DType::kInt32);
  EXPECT_DEATH(SoftmaxCrossEntropy(logits, targets, 1.0f), "SoftmaxCrossEntropy: no rows");
  Tensor max = Tensor::Zeros({0}), index = Tensor::Zeros({0});
  EXPECT_DEATH(ShardArgmax(logits, 0, max, index), "ShardArgmax: no rows");
  EXPECT_DEATH(CountArgmaxHits(max, index, targets), "CountArgmaxHits: no rows");
}

TEST_F(KernelsTest, AdamWMatchesFloat64Reference) {
  const int64_t n = 8;
  Tensor p = Random({n}), m = Tensor::Zeros({n}), v = Tensor::Zeros({n});
  Vec rp = ToVec(p), rm(n, 0.0), rv(n, 0.0);
  AdamWConfig config;
  config.lr = 0.01f;
  config.weight_decay = 0.1f;
  const float clip = 0.5f;
  for (int step = 1; step <= 3; ++step) {
    Tensor g = Random({n});
    AdamW(p, g, m, v, config, step, clip);
    for (int64_t i = 0; i < n; ++i) {
      const double gi = g.f32()[i] * clip;
      rm[i] = 0.9 * rm[i] + 0.1 * gi;
      rv[i] = 0.999 * rv[i] + 0.001 * gi * gi;
      const double mh = rm[i] / (1 - std::pow(0.9, step));
      const double vh = rv[i] / (1 - std::pow(0.999, step));
      rp[i] = rp[i] * (1 - 0.01 * 0.1) - 0.01 * mh / (std::sqrt(vh) + 1e-8);
    }
  }
  EXPECT_LT(RelativeError(ToVec(p), rp), 1e-6);
}

TEST_F(KernelsTest, GradNormAndClipping) {
  Tensor g = Tensor::Zeros({4});
  const float vals[] = {3, 0, 4, 0};
  std::memcpy(g.f32(), vals, sizeof(vals));
  const double sq = SumOfSquares(g);
  EXPECT_DOUBLE_EQ(sq, 25.0);
  const float factor = cpu::ClipFactor(sq, 1.0);
  EXPECT_NEAR(factor, 0.2f, 1e-6);
  EXPECT_EQ(cpu::ClipFactor(sq, 10.0), 1.0f);  // norm 5 is under the limit
  EXPECT_EQ(cpu::ClipFactor(sq, 0.0), 1.0f);   // clipping off
  Scale(g, factor);
  EXPECT_NEAR(std::sqrt(SumOfSquares(g)), 1.0, 1e-5);
}

TEST_F(KernelsTest, SameInputsGiveSameBits) {
  const int64_t b = 2, t = 16, c = 32, heads = 4;
  Tensor qkv = Random({b, t, 3 * c}), dy = Random({b, t, c});
  std::vector<float> first;
  for (int run = 0; run < 2; ++run) {
    Tensor y = Tensor::Zeros({b, t, c}), att = Tensor::Zeros({b, heads, t, t});
    Tensor dqkv = Tensor::Zeros({b, t, 3 * c}), scratch = Tensor::Zeros({t, t});
    Attention(y, att, qkv, heads);
    AttentionBackward(dqkv, scratch, dy, qkv, att, heads);
    std::vector<float> got(dqkv.f32(), dqkv.f32() + dqkv.numel());
    got.insert(got.end(), y.f32(), y.f32() + y.numel());
    if (run == 0) {
      first = got;
    } else {
      EXPECT_EQ(std::memcmp(first.data(), got.data(), got.size() * sizeof(float)), 0);
    }
  }
}

TEST(FastMathTest, ExpAndTanhAreAccurateToFloatPrecision) {
  double worst_exp = 0, worst_tanh = 0;
  for (double x = -80.0; x <= 80.0; x += 0.001) {
    const float xf = static_cast<float>(x);
    worst_exp = std::max(worst_exp, std::abs(cpu::FastExp(xf) / std::exp(double{xf}) - 1.0));
    worst_tanh = std::max(worst_tanh, std::abs(cpu::FastTanh(xf) - std::tanh(double{xf})));
  }
  EXPECT_LT(worst_exp, 3e-7);
  EXPECT_LT(worst_tanh, 3e-7);
  // Far outside the clamp: finite, saturated values rather than garbage.
  EXPECT_LT(cpu::FastExp(-1000.0f), 1e-37f);
  EXPECT_NEAR(cpu::FastTanh(1000.0f), 1.0f, 1e-7);
  EXPECT_NEAR(cpu::FastTanh(-1000.0f), -1.0f, 1e-7);
}

TEST_F(KernelsTest, GemmTimeIsAccounted) {
  cpu::ResetThreadGemmStats();
  Tensor x = Random({8, 16}), w = Random({4, 16}), y = Tensor::Zeros({8, 4});
  Linear(y, x, w, Tensor());
  const cpu::GemmStats stats = cpu::ThreadGemmStats();
  EXPECT_EQ(stats.calls, 1);
  EXPECT_DOUBLE_EQ(stats.flops, 2.0 * 8 * 4 * 16);
  EXPECT_GE(stats.seconds, 0.0);
}

TEST(ArenaTest, SecondCycleReusesMemoryWithoutSystemAllocation) {
  Arena arena;
  auto cycle = [&] {
    for (int i = 0; i < 5; ++i) {
      Tensor t = *arena.Allocate({1 << 17});  // 512 KiB each: spills past one block
      EXPECT_EQ(reinterpret_cast<uintptr_t>(t.raw()) % 64, 0u);
      t.f32()[0] = 1.0f;
    }
  };
  cycle();
  const int64_t first = arena.system_allocations();
  EXPECT_GT(first, 1);
  arena.Reset();
  EXPECT_EQ(arena.used_bytes(), 0u);
  cycle();
  arena.Reset();
  cycle();
  EXPECT_EQ(arena.system_allocations(), first + 1);  // one merge, then none
  Tensor zero = *arena.AllocateZeroed({3});
  EXPECT_EQ(zero.f32()[2], 0.0f);
}

// A shape whose byte count does not fit in size_t fails before anything is
// allocated, and the arena is unchanged.
TEST(ArenaTest, OverflowingOrNegativeShapeIsInvalidArgument) {
  Arena arena;
  ASSERT_TRUE(arena.Allocate({16}).ok());
  const size_t used = arena.used_bytes(), capacity = arena.capacity_bytes();
  const int64_t allocations = arena.system_allocations();
  absl::StatusOr<Tensor> huge = arena.Allocate({int64_t{1} << 40, int64_t{1} << 40});
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(huge.status().message().find("overflows"), std::string::npos) << huge.status();
  absl::StatusOr<Tensor> negative = arena.Allocate({4, -1});
  EXPECT_EQ(negative.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(arena.used_bytes(), used);
  EXPECT_EQ(arena.capacity_bytes(), capacity);
  EXPECT_EQ(arena.system_allocations(), allocations);
  EXPECT_TRUE(arena.Allocate({16}).ok());
}

// 256 TiB, more than any x86-64 address space: the allocation fails whatever
// the overcommit policy, and TryZeros says so instead of aborting.
TEST(TensorTest, AnAllocationTheHostCannotGiveIsAnErrorNotACrash) {
  absl::StatusOr<Tensor> huge = Tensor::TryZeros({int64_t{1} << 46});
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted) << huge.status();
  EXPECT_NE(huge.status().message().find("out of host memory: a tensor of shape [70368744177664] needs "
                                         "281474976710656 bytes"),
            std::string::npos)
      << huge.status();
  absl::StatusOr<Tensor> overflowing = Tensor::TryZeros({int64_t{1} << 40, int64_t{1} << 40});
  EXPECT_EQ(overflowing.status().code(), absl::StatusCode::kInvalidArgument) << overflowing.status();
  EXPECT_NE(overflowing.status().message().find("overflows"), std::string::npos) << overflowing.status();
  EXPECT_EQ(Tensor::TryZeros({4, -1}).status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<Tensor> small = Tensor::TryZeros({3, 5});
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ(small->f32()[14], 0.0f);
}

TEST(TensorTest, ViewsShareStorage) {
  Tensor t = Tensor::Zeros({4, 3});
  EXPECT_TRUE(t.owning());
  Tensor rows = t.Rows(1, 3);
  EXPECT_EQ(rows.shape(), (Shape{2, 3}));
  rows.f32()[0] = 7.0f;
  EXPECT_EQ(t.f32()[3], 7.0f);
  Tensor flat = t.Reshaped({12});
  EXPECT_EQ(flat.f32()[3], 7.0f);
  EXPECT_EQ(ShapeToString(t.shape()), "[4, 3]");
  float buf[2] = {1, 2};
  Tensor view = Tensor::View(buf, {2});
  EXPECT_FALSE(view.owning());
  EXPECT_EQ(view.bytes(), 8u);
}

}  // namespace
}  // namespace baton::kernels
