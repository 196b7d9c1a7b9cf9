// The Llama blocks of kernels/ops.h (RmsNorm, SwiGlu, RopePack and their
// backwards) on the CPU, through ExecContext::Host(): forwards against
// float64 references written from the formulas, backwards against central
// finite differences of the float64 forward (or, for RopePack, the adjoint
// identity), bf16 outputs against the fp32 result rounded once, and bitwise
// determinism run to run.
#include <math.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/bfloat16.h"
#include "kernels/ops.h"
#include "kernels/tensor.h"

namespace baton::kernels {
namespace {

using Vec = std::vector<double>;
// A float64 forward: inputs → flat outputs.
using RefFn = std::function<Vec(const std::vector<Vec>&)>;

const ExecContext& Cpu() { return ExecContext::Host(); }

Tensor Random(Shape shape, uint32_t seed, double scale = 1.0) {
  Tensor t = Tensor::Zeros(std::move(shape));
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, static_cast<float>(scale));
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = dist(gen);
  return t;
}

Tensor Copied(const Tensor& t) {
  Tensor c = Tensor::Zeros(t.shape(), t.dtype());
  std::memcpy(c.raw(), t.raw(), t.bytes());
  return c;
}

Vec ToVec(const Tensor& t) { return Vec(t.f32(), t.f32() + t.numel()); }

std::vector<uint16_t> Bits16(const Tensor& t) {
  const auto* p = static_cast<const uint16_t*>(t.raw());
  return std::vector<uint16_t>(p, p + t.numel());
}

// The fp32 values of `t` rounded once to bf16, as bits.
std::vector<uint16_t> RoundedBits(const Tensor& t) {
  std::vector<uint16_t> bits(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) bits[i] = FloatToBf16Bits(t.f32()[i]);
  return bits;
}

bool SameBits(const Tensor& a, const Tensor& b) {
  return a.bytes() == b.bytes() && std::memcmp(a.raw(), b.raw(), a.bytes()) == 0;
}

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

Vec Plus(Vec a, const Vec& b) {
  for (size_t i = 0; i < a.size(); ++i) a[i] += b[i];
  return a;
}

constexpr double kForwardTol = 1e-5;
constexpr double kGradTol = 1e-4;

// ---- RMSNorm ----

Vec RefRmsNorm(const Vec& x, const Vec& w, double eps, Vec* rstd = nullptr) {
  const size_t c = w.size(), n = x.size() / c;
  Vec y(x.size());
  if (rstd != nullptr) rstd->assign(n, 0.0);
  for (size_t r = 0; r < n; ++r) {
    double sq = 0;
    for (size_t j = 0; j < c; ++j) sq += x[r * c + j] * x[r * c + j];
    const double s = 1.0 / std::sqrt(sq / c + eps);
    for (size_t j = 0; j < c; ++j) y[r * c + j] = x[r * c + j] * s * w[j];
    if (rstd != nullptr) (*rstd)[r] = s;
  }
  return y;
}

// eps is large against the mean square of x (scale 0.1 → about 0.01), so a
// kernel that dropped it or used another would miss by far more than kForwardTol.
TEST(LlamaKernelsTest, RmsNormMatchesFloat64AndItsBackwardAccumulatesTheGradients) {
  const int64_t n = 6, c = 12;
  const float eps = 1e-2f;
  Tensor x = Random({n, c}, 1, 0.1), w = Random({c}, 2), dy = Random({n, c}, 3);
  Tensor y = Tensor::Zeros({n, c}), rstd = Tensor::Zeros({n});
  RmsNorm(Cpu(), y, rstd, x, w, eps);
  RefFn f = [eps](const std::vector<Vec>& in) { return RefRmsNorm(in[0], in[1], eps); };
  const std::vector<Vec> in = {ToVec(x), ToVec(w)};
  Vec want_rstd;
  EXPECT_LT(RelativeError(ToVec(y), RefRmsNorm(in[0], in[1], eps, &want_rstd)), kForwardTol);
  EXPECT_LT(RelativeError(ToVec(rstd), want_rstd), kForwardTol);
  EXPECT_GT(RelativeError(ToVec(y), RefRmsNorm(in[0], in[1], 1e-6)), 100 * kForwardTol);

  // dx and dweight add to what they held.
  Tensor dx = Random({n, c}, 4), dw = Random({c}, 5);
  const Vec dx0 = ToVec(dx), dw0 = ToVec(dw);
  RmsNormBackward(Cpu(), dx, dw, dy, x, w, rstd);
  EXPECT_LT(RelativeError(ToVec(dx), Plus(dx0, FiniteDifference(f, in, 0, ToVec(dy)))), kGradTol);
  EXPECT_LT(RelativeError(ToVec(dw), Plus(dw0, FiniteDifference(f, in, 1, ToVec(dy)))), kGradTol);

  // From zero: the gradients themselves (not only their sum with dx0, dw0).
  Tensor dx_zero = Tensor::Zeros({n, c}), dw_zero = Tensor::Zeros({c});
  RmsNormBackward(Cpu(), dx_zero, dw_zero, dy, x, w, rstd);
  EXPECT_LT(RelativeError(ToVec(dx_zero), FiniteDifference(f, in, 0, ToVec(dy))), kGradTol);
  EXPECT_LT(RelativeError(ToVec(dw_zero), FiniteDifference(f, in, 1, ToVec(dy))), kGradTol);
}

// ---- SwiGLU ----

Vec RefSwiGlu(const Vec& gate, const Vec& up) {
  Vec y(gate.size());
  for (size_t i = 0; i < y.size(); ++i) y[i] = gate[i] / (1.0 + std::exp(-gate[i])) * up[i];
  return y;
}

TEST(LlamaKernelsTest, SwiGluMatchesFloat64AndItsBackwardOverwritesTheGradients) {
  const int64_t n = 4, f = 33;  // not a multiple of the vector width
  Tensor gate = Random({n, f}, 11, 3.0), up = Random({n, f}, 12), dy = Random({n, f}, 13);
  Tensor y = Tensor::Zeros({n, f});
  SwiGlu(Cpu(), y, gate, up);
  RefFn ref = [](const std::vector<Vec>& in) { return RefSwiGlu(in[0], in[1]); };
  const std::vector<Vec> in = {ToVec(gate), ToVec(up)};
  EXPECT_LT(RelativeError(ToVec(y), ref(in)), kForwardTol);

  // Overwritten, not accumulated: what dgate and dup held does not matter.
  Tensor dgate = Random({n, f}, 14), dup = Random({n, f}, 15);
  SwiGluBackward(Cpu(), dgate, dup, dy, gate, up);
  EXPECT_LT(RelativeError(ToVec(dgate), FiniteDifference(ref, in, 0, ToVec(dy))), kGradTol);
  EXPECT_LT(RelativeError(ToVec(dup), FiniteDifference(ref, in, 1, ToVec(dy))), kGradTol);
}

// ---- RoPE ----

struct RopeShape {
  int64_t batch, seq;
  int heads, kv_heads;
  int64_t head_dim;
};

// cos and sin at position t, frequency i, by ops.h's recipe: inv_freq and the
// angle in float32, cos and sin of the float angle in float64, rounded.
void RefAngle(int64_t t, int64_t i, int64_t head_dim, float theta, float* c, float* s) {
  const float inv_freq =
      1.0f / powf(theta, static_cast<float>(2 * i) / static_cast<float>(head_dim));
  const float angle = static_cast<float>(t) * inv_freq;
  *c = static_cast<float>(std::cos(static_cast<double>(angle)));
  *s = static_cast<float>(std::sin(static_cast<double>(angle)));
}

// RopePack written from the formula element by element (rotation in float64).
Vec RefRopePack(const Vec& q, const Vec& k, const Vec& v, const RopeShape& r, float theta) {
  const int64_t d = r.head_dim, half = d / 2, hd = r.heads * d, kvd = r.kv_heads * d;
  const int64_t rows = r.batch * r.seq;
  Vec qkv(static_cast<size_t>(rows * 3 * hd));
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t t = row % r.seq;
    for (int h = 0; h < r.heads; ++h) {
      const int kvh = h / (r.heads / r.kv_heads);
      for (int64_t j = 0; j < d; ++j) {
        const int64_t i = j % half;
        float c, s;
        RefAngle(t, i, d, theta, &c, &s);
        auto rotated = [&](const Vec& x, int64_t base) {
          const double x1 = x[base + i], x2 = x[base + i + half];
          return j < half ? x1 * c - x2 * s : x2 * c + x1 * s;
        };
        double* out = &qkv[row * 3 * hd];
        out[h * d + j] = rotated(q, row * hd + h * d);
        out[hd + h * d + j] = rotated(k, row * kvd + kvh * d);
        out[2 * hd + h * d + j] = v[row * kvd + kvh * d + j];
      }
    }
  }
  return qkv;
}

struct RopeInputs {
  Tensor q, k, v;
};

RopeInputs RandomRopeInputs(const RopeShape& r, uint32_t seed) {
  const int64_t rows = r.batch * r.seq;
  return {Random({rows, r.heads * r.head_dim}, seed),
          Random({rows, r.kv_heads * r.head_dim}, seed + 1),
          Random({rows, r.kv_heads * r.head_dim}, seed + 2)};
}

Tensor Packed(const RopeShape& r, DType dtype = DType::kFloat32) {
  return Tensor::Zeros({r.batch, r.seq, 3 * r.heads * r.head_dim}, dtype);
}

double MaxAbsDiff(const Vec& a, const Vec& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

// Grouped heads (3 query heads per key/value head), two sequences, two
// thetas: every element as the formula gives it, v copied, position 0 the
// identity.
TEST(LlamaKernelsTest, RopePackMatchesTheFormula) {
  const RopeShape r{2, 7, 6, 2, 8};
  const RopeInputs in = RandomRopeInputs(r, 21);
  const int64_t hd = r.heads * r.head_dim, kvd = r.kv_heads * r.head_dim;
  std::vector<Vec> results;
  for (float theta : {10000.0f, 500000.0f}) {
    Tensor qkv = Packed(r);
    RopePack(Cpu(), qkv, in.q, in.k, in.v, r.heads, r.kv_heads, theta);
    const Vec want = RefRopePack(ToVec(in.q), ToVec(in.k), ToVec(in.v), r, theta);
    EXPECT_LT(MaxAbsDiff(ToVec(qkv), want), 2e-6) << "theta " << theta;
    EXPECT_LT(RelativeError(ToVec(qkv), want), 1e-6) << "theta " << theta;
    for (int64_t row = 0; row < r.batch * r.seq; ++row) {
      const float* out = qkv.f32() + row * 3 * hd;
      for (int h = 0; h < r.heads; ++h) {
        const int kvh = h / (r.heads / r.kv_heads);
        // v: the key/value head's values, bit for bit.
        EXPECT_EQ(
            std::memcmp(out + 2 * hd + h * r.head_dim, in.v.f32() + row * kvd + kvh * r.head_dim,
                        sizeof(float) * r.head_dim),
            0)
            << "row " << row << " head " << h;
        if (row % r.seq != 0) continue;
        // Position 0 (the first row of each sequence): q and k unrotated.
        EXPECT_EQ(std::memcmp(out + h * r.head_dim, in.q.f32() + row * hd + h * r.head_dim,
                              sizeof(float) * r.head_dim),
                  0);
        EXPECT_EQ(std::memcmp(out + hd + h * r.head_dim, in.k.f32() + row * kvd + kvh * r.head_dim,
                              sizeof(float) * r.head_dim),
                  0);
      }
    }
    results.push_back(ToVec(qkv));
  }
  // rope_theta is honoured: the two thetas rotate differently past position 0.
  EXPECT_GT(MaxAbsDiff(results[0], results[1]), 1e-2);
}

// With q = (1, …, 1, 0, …, 0) every query head's output is the cos table
// then the sin table, so the recipe (float32 inv_freq and angle, float64
// cos/sin rounded) shows bit for bit; at long positions a float64 angle
// would give other values.
TEST(LlamaKernelsTest, RopePackUsesTheFloat32AngleRecipe) {
  const RopeShape r{1, 4096, 2, 1, 16};
  const float theta = 500000.0f;
  const int64_t half = r.head_dim / 2, hd = r.heads * r.head_dim;
  RopeInputs in = RandomRopeInputs(r, 31);
  for (int64_t row = 0; row < r.seq; ++row) {
    for (int h = 0; h < r.heads; ++h) {
      for (int64_t j = 0; j < r.head_dim; ++j) in.q.f32()[row * hd + h * r.head_dim + j] = j < half;
    }
  }
  Tensor qkv = Packed(r);
  RopePack(Cpu(), qkv, in.q, in.k, in.v, r.heads, r.kv_heads, theta);
  int64_t mismatches = 0, differs_from_float64_angle = 0;
  for (int64_t t = 0; t < r.seq; ++t) {
    for (int h = 0; h < r.heads; ++h) {
      const float* out = qkv.f32() + t * 3 * hd + h * r.head_dim;
      for (int64_t i = 0; i < half; ++i) {
        float c, s;
        RefAngle(t, i, r.head_dim, theta, &c, &s);
        mismatches += out[i] != c || out[i + half] != s;
        const double exact_angle =
            static_cast<double>(t) /
            std::pow(static_cast<double>(theta), 2.0 * i / static_cast<double>(r.head_dim));
        differs_from_float64_angle += out[i] != static_cast<float>(std::cos(exact_angle));
      }
    }
  }
  EXPECT_EQ(mismatches, 0);
  EXPECT_GT(differs_from_float64_angle, 0) << "the test cannot tell the recipes apart";
}

double Dot(const Tensor& a, const Tensor& b) {
  double sum = 0;
  for (int64_t i = 0; i < a.numel(); ++i) sum += static_cast<double>(a.f32()[i]) * b.f32()[i];
  return sum;
}

// <RopePack(q, k, v), G> = <(q, k, v), RopePackBackward(G)>: the backward
// rotates back and sums each key/value head's query heads.
TEST(LlamaKernelsTest, RopePackBackwardIsTheAdjoint) {
  for (const RopeShape& r :
       {RopeShape{2, 5, 6, 2, 8}, RopeShape{1, 9, 4, 1, 16}, RopeShape{2, 3, 4, 4, 6}}) {
    const RopeInputs in = RandomRopeInputs(r, 41);
    const float theta = 10000.0f;
    Tensor qkv = Packed(r);
    RopePack(Cpu(), qkv, in.q, in.k, in.v, r.heads, r.kv_heads, theta);
    Tensor g = Random(qkv.shape(), 44);
    // Garbage in the outputs: they are overwritten.
    RopeInputs grad = RandomRopeInputs(r, 45);
    RopePackBackward(Cpu(), grad.q, grad.k, grad.v, g, r.heads, r.kv_heads, theta);
    const double lhs = Dot(qkv, g);
    const double rhs = Dot(in.q, grad.q) + Dot(in.k, grad.k) + Dot(in.v, grad.v);
    EXPECT_NEAR(lhs, rhs, 1e-5 * std::fabs(lhs)) << "heads " << r.heads << " kv " << r.kv_heads;
    // Each part on its own (a mistake in one could hide in the sum).
    Tensor only_v = Packed(r), only_qk = Packed(r);
    RopePack(Cpu(), only_v, Tensor::Zeros(in.q.shape()), Tensor::Zeros(in.k.shape()), in.v, r.heads,
             r.kv_heads, theta);
    RopePack(Cpu(), only_qk, in.q, in.k, Tensor::Zeros(in.v.shape()), r.heads, r.kv_heads, theta);
    EXPECT_NEAR(Dot(only_v, g), Dot(in.v, grad.v), 1e-5 * std::fabs(Dot(in.v, grad.v)));
    const double qk = Dot(in.q, grad.q) + Dot(in.k, grad.k);
    EXPECT_NEAR(Dot(only_qk, g), qk, 1e-5 * std::fabs(qk));
  }
}

// ---- bf16 ----

// A bf16 output is the fp32 result rounded once; the fp32 side outputs are
// unchanged by it.
TEST(LlamaKernelsTest, Bf16OutputsAreTheFloat32ResultRoundedOnce) {
  const int64_t n = 5, c = 24;
  Tensor x = Random({n, c}, 51), w = Random({c}, 52);
  Tensor y32 = Tensor::Zeros({n, c}), rstd32 = Tensor::Zeros({n});
  Tensor y16 = Tensor::Zeros({n, c}, DType::kBFloat16), rstd16 = Tensor::Zeros({n});
  RmsNorm(Cpu(), y32, rstd32, x, w, 1e-5f);
  RmsNorm(Cpu(), y16, rstd16, x, w, 1e-5f);
  EXPECT_EQ(Bits16(y16), RoundedBits(y32));
  EXPECT_TRUE(SameBits(rstd16, rstd32));

  const RopeShape r{2, 6, 4, 2, 8};
  const float theta = 10000.0f;
  const RopeInputs in = RandomRopeInputs(r, 53);
  Tensor qkv32 = Packed(r), qkv16 = Packed(r, DType::kBFloat16);
  RopePack(Cpu(), qkv32, in.q, in.k, in.v, r.heads, r.kv_heads, theta);
  RopePack(Cpu(), qkv16, in.q, in.k, in.v, r.heads, r.kv_heads, theta);
  EXPECT_EQ(Bits16(qkv16), RoundedBits(qkv32));

  // Backward from a bf16 dqkv: its exact fp32 widening gives the fp32
  // gradients; bf16 gradients are those rounded once (any mix of dtypes).
  Tensor g32 = Random(qkv32.shape(), 54), g16 = Packed(r, DType::kBFloat16);
  for (int64_t i = 0; i < g32.numel(); ++i) {
    static_cast<uint16_t*>(g16.raw())[i] = FloatToBf16Bits(g32.f32()[i]);
    g32.f32()[i] = RoundToBf16(g32.f32()[i]);
  }
  RopeInputs want = RandomRopeInputs(r, 55);
  RopePackBackward(Cpu(), want.q, want.k, want.v, g32, r.heads, r.kv_heads, theta);
  RopeInputs from16 = RandomRopeInputs(r, 56);
  RopePackBackward(Cpu(), from16.q, from16.k, from16.v, g16, r.heads, r.kv_heads, theta);
  EXPECT_TRUE(SameBits(from16.q, want.q));
  EXPECT_TRUE(SameBits(from16.k, want.k));
  EXPECT_TRUE(SameBits(from16.v, want.v));
  Tensor dq16 = Tensor::Zeros(want.q.shape(), DType::kBFloat16),
         dk16 = Tensor::Zeros(want.k.shape(), DType::kBFloat16);
  Tensor dv32 = Tensor::Zeros(want.v.shape());
  RopePackBackward(Cpu(), dq16, dk16, dv32, g16, r.heads, r.kv_heads, theta);
  EXPECT_EQ(Bits16(dq16), RoundedBits(want.q));
  EXPECT_EQ(Bits16(dk16), RoundedBits(want.k));
  EXPECT_TRUE(SameBits(dv32, want.v));
}

// ---- Determinism ----

TEST(LlamaKernelsTest, EveryOpGivesTheSameBitsRunToRun) {
  const int64_t n = 8, c = 64;
  Tensor x = Random({n, c}, 61), w = Random({c}, 62), dy = Random({n, c}, 63);
  Tensor dx0 = Random({n, c}, 64), dw0 = Random({c}, 65);
  const RopeShape r{2, 16, 8, 2, 8};
  const RopeInputs in = RandomRopeInputs(r, 66);
  Tensor g = Random(Packed(r).shape(), 67);
  std::vector<std::vector<Tensor>> runs;
  for (int run = 0; run < 2; ++run) {
    Tensor y = Tensor::Zeros({n, c}), rstd = Tensor::Zeros({n});
    RmsNorm(Cpu(), y, rstd, x, w, 1e-6f);
    Tensor dx = Copied(dx0), dw = Copied(dw0);
    RmsNormBackward(Cpu(), dx, dw, dy, x, w, rstd);
    Tensor s = Tensor::Zeros({n, c}), dgate = Tensor::Zeros({n, c}), dup = Tensor::Zeros({n, c});
    SwiGlu(Cpu(), s, x, dy);
    SwiGluBackward(Cpu(), dgate, dup, dx0, x, dy);
    Tensor qkv = Packed(r);
    RopePack(Cpu(), qkv, in.q, in.k, in.v, r.heads, r.kv_heads, 10000.0f);
    RopeInputs grad = RandomRopeInputs(r, 68 + run);  // different garbage each run
    RopePackBackward(Cpu(), grad.q, grad.k, grad.v, g, r.heads, r.kv_heads, 10000.0f);
    runs.push_back({y, rstd, dx, dw, s, dgate, dup, qkv, grad.q, grad.k, grad.v});
  }
  for (size_t i = 0; i < runs[0].size(); ++i) {
    EXPECT_TRUE(SameBits(runs[0][i], runs[1][i])) << "output " << i;
  }
}

// ---- Checks ----

TEST(LlamaKernelsDeathTest, ShapeAndDtypeMistakesAbortNamingTheOp) {
  const RopeShape r{1, 3, 4, 2, 8};
  const RopeInputs in = RandomRopeInputs(r, 71);
  EXPECT_DEATH(RopePack(Cpu(), Packed(r), in.q, in.k, in.v, 4, 3, 1e4f),
               "RopePack: heads must be a positive multiple of kv_heads");
  Tensor odd = Tensor::Zeros({1, 3, 3 * 4 * 5});
  EXPECT_DEATH(RopePack(Cpu(), odd, Tensor::Zeros({3, 20}), Tensor::Zeros({3, 10}),
                        Tensor::Zeros({3, 10}), 4, 2, 1e4f),
               "RopePack: head_dim must be even");
  EXPECT_DEATH(RopePack(Cpu(), Packed(r), in.q, in.v, in.q, r.heads, r.kv_heads, 1e4f),
               "RopePack: shape mismatch");
  EXPECT_DEATH(RopePack(Cpu(), Packed(r), Tensor::Zeros(in.q.shape(), DType::kBFloat16), in.k, in.v,
                        r.heads, r.kv_heads, 1e4f),
               "RopePack: q, k and v must be float32");
  EXPECT_DEATH(RopePackBackward(Cpu(), in.q, in.k, in.v, Packed(r, DType::kInt32), r.heads,
                                r.kv_heads, 1e4f),
               "RopePackBackward: dqkv, dq, dk and dv must be float32 or bfloat16");
  Tensor x = Random({2, 4}, 72), w = Random({4}, 73);
  EXPECT_DEATH(RmsNorm(Cpu(), Tensor::Zeros({2, 4}), Tensor::Zeros({3}), x, w, 1e-5f),
               "RmsNorm: shape mismatch");
  EXPECT_DEATH(
      RmsNorm(Cpu(), Tensor::Zeros({2, 4}), Tensor::Zeros({2}, DType::kBFloat16), x, w, 1e-5f),
      "RmsNorm: x, weight and rstd must be float32");
  EXPECT_DEATH(RmsNormBackward(Cpu(), Tensor::Zeros({2, 4}, DType::kBFloat16), Tensor::Zeros({4}),
                               x, x, w, Tensor::Zeros({2})),
               "RmsNormBackward: every tensor must be float32");
  EXPECT_DEATH(SwiGlu(Cpu(), Tensor::Zeros({2, 4}), x, w), "SwiGlu: shape mismatch");
}

}  // namespace
}  // namespace baton::kernels
