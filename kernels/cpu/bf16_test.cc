// The CPU backend's bf16 ops (kernels/backend.h §6), the reference for the
// CUDA backend's: each against a float64 computation on the same
// bf16-rounded inputs, and, where the definition is "the fp32 result rounded
// once", bit for bit against the fp32 op.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/bfloat16.h"
#include "kernels/cpu/gemm.h"
#include "kernels/ops.h"
#include "kernels/tensor.h"

namespace baton::kernels {
namespace {

using Vec = std::vector<double>;

class Bf16OpsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { cpu::SetBlasThreads(1); }

  Tensor Random(Shape shape, double scale = 1.0) {
    Tensor t = Tensor::Zeros(std::move(shape));
    std::normal_distribution<float> dist(0.0f, static_cast<float>(scale));
    for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = dist(rng_);
    return t;
  }
  std::mt19937 rng_{4321};
};

const ExecContext& H() { return ExecContext::Host(); }

Tensor ToBf16(const Tensor& f) {
  Tensor b = Tensor::Zeros(f.shape(), DType::kBFloat16);
  Cast(H(), b, f);
  return b;
}

const uint16_t* Bits(const Tensor& t) { return static_cast<const uint16_t*>(t.raw()); }

// The values of a float32 or bf16 host tensor, as doubles.
Vec Values(const Tensor& t) {
  Vec v(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) {
    v[i] = t.dtype() == DType::kBFloat16 ? Bf16BitsToFloat(Bits(t)[i]) : t.f32()[i];
  }
  return v;
}

double RelativeL2(const Vec& got, const Vec& want) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff += (got[i] - want[i]) * (got[i] - want[i]);
    norm += want[i] * want[i];
  }
  return std::sqrt(diff) / std::max(std::sqrt(norm), 1e-30);
}

// max |got − want| / max |want|.
double MaxNormRelative(const Vec& got, const Vec& want) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff = std::max(diff, std::fabs(got[i] - want[i]));
    norm = std::max(norm, std::fabs(want[i]));
  }
  return diff / std::max(norm, 1e-30);
}

// The largest relative error of one bf16 rounding: half a unit in the last
// place of bf16's 8 significant bits, at most 2^-8 of the value.
constexpr double kBf16Unit = 1.0 / 256;

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

TEST_F(Bf16OpsTest, CastRoundsToNearestEvenAndWidensExactly) {
  const std::vector<float> x = {1.0f,
                                -2.5f,
                                FromBits(0x3f808000u),  // tie → even (down)
                                FromBits(0x3f818000u),  // tie → even (up)
                                FromBits(0x3f808001u),  // above the tie → up
                                std::numeric_limits<float>::max(),
                                std::numeric_limits<float>::infinity(),
                                1e-40f};  // subnormal
  const std::vector<uint16_t> want = {0x3f80, 0xc020, 0x3f80, 0x3f82, 0x3f81, 0x7f80, 0x7f80,
                                      0x0001};
  Tensor f = Tensor::Zeros({static_cast<int64_t>(x.size())});
  std::memcpy(f.f32(), x.data(), x.size() * sizeof(float));
  Tensor b = ToBf16(f);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(Bits(b)[i], want[i]) << "element " << i;

  Tensor nan = Tensor::Zeros({1});
  nan.f32()[0] = std::nanf("");
  EXPECT_TRUE(std::isnan(Bf16BitsToFloat(Bits(ToBf16(nan))[0])));

  // bf16 → fp32 is exact, and fp32 → bf16 → fp32 → bf16 keeps the bits.
  Tensor r = Random({1000});
  Tensor rb = ToBf16(r), back = Tensor::Zeros({1000}), again = Tensor::Zeros({1000},
                                                                             DType::kBFloat16);
  Cast(H(), back, rb);
  Cast(H(), again, back);
  for (int64_t i = 0; i < 1000; ++i) {
    EXPECT_EQ(back.f32()[i], Bf16BitsToFloat(Bits(rb)[i]));
    EXPECT_EQ(Bits(again)[i], Bits(rb)[i]);
    EXPECT_LE(std::fabs(back.f32()[i] - r.f32()[i]), std::fabs(r.f32()[i]) * kBf16Unit);
  }
}

Vec RefLinear(const Vec& x, const Vec& w, const Vec* b, size_t in, size_t out) {
  const size_t n = x.size() / in;
  Vec y(n * out);
  for (size_t r = 0; r < n; ++r) {
    for (size_t o = 0; o < out; ++o) {
      double s = b ? (*b)[o] : 0.0;
      for (size_t i = 0; i < in; ++i) s += x[r * in + i] * w[o * in + i];
      y[r * out + o] = s;
    }
  }
  return y;
}

TEST_F(Bf16OpsTest, LinearTakesBf16InputsAccumulatesInFp32AndRoundsItsOutputOnce) {
  const int64_t n = 9, in = 48, out = 20;
  Tensor x = ToBf16(Random({n, in})), w = ToBf16(Random({out, in})), b = Random({out});
  const Vec xv = Values(x), wv = Values(w), bv = Values(b);
  const Vec want = RefLinear(xv, wv, &bv, in, out);

  Tensor y32 = Tensor::Zeros({n, out});
  Linear(H(), y32, x, w, b);
  EXPECT_LT(MaxNormRelative(Values(y32), want), 1e-5);  // fp32 accumulation

  Tensor y16 = Tensor::Zeros({n, out}, DType::kBFloat16);
  Linear(H(), y16, x, w, b);
  for (int64_t i = 0; i < y16.numel(); ++i) {
    ASSERT_EQ(Bits(y16)[i], FloatToBf16Bits(y32.f32()[i])) << "element " << i;
  }
  EXPECT_LT(MaxNormRelative(Values(y16), want), kBf16Unit);

  // Backward input: dx (fp32 or bf16, accumulating) = dy · W.
  Tensor dy = ToBf16(Random({n, out}));
  const Vec dyv = Values(dy);
  Vec dx_want(n * in, 0.0);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t i = 0; i < in; ++i)
      for (int64_t o = 0; o < out; ++o) dx_want[r * in + i] += dyv[r * out + o] * wv[o * in + i];
  Tensor dx32 = Tensor::Zeros({n, in});
  LinearBackwardInput(H(), dx32, dy, w, /*accumulate=*/false);
  EXPECT_LT(MaxNormRelative(Values(dx32), dx_want), 1e-5);
  Tensor dx16 = ToBf16(Random({n, in}));
  const Vec dx16_before = Values(dx16);
  LinearBackwardInput(H(), dx16, dy, w, /*accumulate=*/true);
  Vec acc_want = dx_want;
  for (size_t i = 0; i < acc_want.size(); ++i) acc_want[i] += dx16_before[i];
  EXPECT_LT(MaxNormRelative(Values(dx16), acc_want), kBf16Unit);
  EXPECT_GT(MaxNormRelative(Values(dx16), dx_want), 10 * kBf16Unit);  // it did accumulate

  // Backward weight: fp32 dW += dyᵀ · x.
  Tensor dw = Random({out, in});
  const Vec dw_before = Values(dw);
  LinearBackwardWeight(H(), dw, dy, x);
  Vec dw_want = dw_before;
  for (int64_t o = 0; o < out; ++o)
    for (int64_t i = 0; i < in; ++i)
      for (int64_t r = 0; r < n; ++r) dw_want[o * in + i] += dyv[r * out + o] * xv[r * in + i];
  EXPECT_LT(MaxNormRelative(Values(dw), dw_want), 1e-5);
}

TEST_F(Bf16OpsTest, LayerNormWithBf16OutputIsTheFp32OutputRounded) {
  const int64_t n = 7, c = 32;
  Tensor x = Random({n, c}, 3.0), w = Random({c}), b = Random({c});
  Tensor y32 = Tensor::Zeros({n, c}), m32 = Tensor::Zeros({n}), r32 = Tensor::Zeros({n});
  LayerNorm(y32, m32, r32, x, w, b);
  Tensor y16 = Tensor::Zeros({n, c}, DType::kBFloat16), m16 = Tensor::Zeros({n}),
         r16 = Tensor::Zeros({n});
  LayerNorm(H(), y16, m16, r16, x, w, b);
  for (int64_t i = 0; i < y16.numel(); ++i) {
    ASSERT_EQ(Bits(y16)[i], FloatToBf16Bits(y32.f32()[i])) << "element " << i;
  }
  // The statistics stay fp32, bit for bit.
  EXPECT_EQ(std::memcmp(m16.f32(), m32.f32(), m32.bytes()), 0);
  EXPECT_EQ(std::memcmp(r16.f32(), r32.f32(), r32.bytes()), 0);
}

double Bf16(double x) { return RoundToBf16(static_cast<float>(x)); }

// Float64 causal attention on bf16 qkv with the CUDA path's bf16 rounding
// points: P and dS rounded to bf16 before the next product.
struct RefAttention {
  Vec out, att, dqkv;
};
RefAttention RefBf16Attention(const Vec& qkv, const Vec& dout, int64_t b_, int64_t t,
                              int64_t c, int64_t heads) {
  const int64_t hd = c / heads, ld = 3 * c;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  RefAttention r{Vec(b_ * t * c, 0.0), Vec(b_ * heads * t * t, 0.0), Vec(b_ * t * ld, 0.0)};
  for (int64_t b = 0; b < b_; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      auto q = [&](int64_t i, int64_t d) { return qkv[(b * t + i) * ld + h * hd + d]; };
      auto k = [&](int64_t i, int64_t d) { return qkv[(b * t + i) * ld + c + h * hd + d]; };
      auto v = [&](int64_t i, int64_t d) { return qkv[(b * t + i) * ld + 2 * c + h * hd + d]; };
      auto dO = [&](int64_t i, int64_t d) { return dout[(b * t + i) * c + h * hd + d]; };
      double* p = &r.att[(b * heads + h) * t * t];
      for (int64_t i = 0; i < t; ++i) {
        Vec s(i + 1);
        double max = -1e300, sum = 0;
        for (int64_t j = 0; j <= i; ++j) {
          for (int64_t d = 0; d < hd; ++d) s[j] += q(i, d) * k(j, d);
          s[j] *= scale;
          max = std::max(max, s[j]);
        }
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(s[j] - max);
        for (int64_t j = 0; j <= i; ++j) p[i * t + j] = Bf16(std::exp(s[j] - max) / sum);
        for (int64_t d = 0; d < hd; ++d) {
          double o = 0;
          for (int64_t j = 0; j <= i; ++j) o += p[i * t + j] * v(j, d);
          r.out[(b * t + i) * c + h * hd + d] = o;
        }
      }
      // Backward.
      Vec ds(t * t, 0.0);
      for (int64_t i = 0; i < t; ++i) {
        Vec dp(i + 1, 0.0);
        double dot = 0;
        for (int64_t j = 0; j <= i; ++j) {
          for (int64_t d = 0; d < hd; ++d) dp[j] += dO(i, d) * v(j, d);
          dot += p[i * t + j] * dp[j];
        }
        for (int64_t j = 0; j <= i; ++j) ds[i * t + j] = Bf16(p[i * t + j] * (dp[j] - dot) * scale);
      }
      for (int64_t i = 0; i < t; ++i) {
        for (int64_t d = 0; d < hd; ++d) {
          double dq = 0, dk = 0, dv = 0;
          for (int64_t j = 0; j < t; ++j) {
            dq += ds[i * t + j] * k(j, d);
            dk += ds[j * t + i] * q(j, d);
            dv += p[j * t + i] * dO(j, d);
          }
          double* row = &r.dqkv[(b * t + i) * ld + h * hd + d];
          row[0] = dq;
          row[c] = dk;
          row[2 * c] = dv;
        }
      }
    }
  }
  return r;
}

TEST_F(Bf16OpsTest, AttentionInBf16FollowsTheCudaRoundingPoints) {
  const int64_t b = 2, t = 12, c = 16, heads = 2;
  Tensor qkv = ToBf16(Random({b, t, 3 * c})), dout = ToBf16(Random({b, t, c}));
  Tensor out = Tensor::Zeros({b, t, c}, DType::kBFloat16);
  Tensor att = Tensor::Zeros({b, heads, t, t}, DType::kBFloat16);
  Attention(H(), out, att, qkv, heads);
  const RefAttention want = RefBf16Attention(Values(qkv), Values(dout), b, t, c, heads);
  // P: fp32 softmax then one rounding (a tie may round the other way after
  // the fp32 steps); out: fp32 sums of bf16 products, rounded once.
  EXPECT_LT(MaxNormRelative(Values(att), want.att), kBf16Unit);
  EXPECT_LT(MaxNormRelative(Values(out), want.out), kBf16Unit);
  for (int64_t i = 0; i < t; ++i) {
    for (int64_t j = i + 1; j < t; ++j) EXPECT_EQ(Bits(att)[i * t + j], 0);  // causal
  }

  Tensor dqkv = Tensor::Zeros({b, t, 3 * c}, DType::kBFloat16), scratch = Tensor::Zeros({t, t});
  AttentionBackward(H(), dqkv, scratch, dout, qkv, att, heads);
  EXPECT_LT(RelativeL2(Values(dqkv), want.dqkv), 1e-2);
}

TEST_F(Bf16OpsTest, AdamWWritesTheUpdatedParametersRoundedIntoTheBf16Copy) {
  const int64_t n = 64;
  Tensor p = Random({n}), g = Random({n}), m = Tensor::Zeros({n}), v = Tensor::Zeros({n});
  Tensor p_ref = Tensor::Zeros({n}), m_ref = Tensor::Zeros({n}), v_ref = Tensor::Zeros({n});
  std::memcpy(p_ref.f32(), p.f32(), p.bytes());
  Tensor copy = Tensor::Zeros({n}, DType::kBFloat16);
  AdamWConfig config;
  config.lr = 0.01f;
  config.weight_decay = 0.1f;
  for (int step = 1; step <= 2; ++step) {
    AdamW(H(), p, g, m, v, config, step, 0.5f, copy);
    AdamW(p_ref, g, m_ref, v_ref, config, step, 0.5f);
  }
  // The fp32 master update is unchanged by the copy; the copy is its rounding.
  EXPECT_EQ(std::memcmp(p.f32(), p_ref.f32(), p.bytes()), 0);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(Bits(copy)[i], FloatToBf16Bits(p.f32()[i]));
}

TEST_F(Bf16OpsTest, Bf16OpsGiveTheSameBitsRunToRun) {
  const int64_t b = 1, t = 8, c = 8, heads = 2;
  Tensor ln_in = Random({b * t, c}), w = Random({c}), bias = Random({c});
  Tensor wq = ToBf16(Random({3 * c, c})), dout = ToBf16(Random({b, t, c}));
  auto run = [&] {
    Tensor ln = Tensor::Zeros({b * t, c}, DType::kBFloat16), mean = Tensor::Zeros({b * t}),
           rstd = Tensor::Zeros({b * t});
    LayerNorm(H(), ln, mean, rstd, ln_in, w, bias);
    Tensor qkv = Tensor::Zeros({b, t, 3 * c}, DType::kBFloat16);
    Linear(H(), qkv, ln, wq, Tensor());
    Tensor out = Tensor::Zeros({b, t, c}, DType::kBFloat16),
           att = Tensor::Zeros({b, heads, t, t}, DType::kBFloat16);
    Attention(H(), out, att, qkv, heads);
    Tensor dqkv = Tensor::Zeros({b, t, 3 * c}, DType::kBFloat16), scratch = Tensor::Zeros({t, t});
    AttentionBackward(H(), dqkv, scratch, dout, qkv, att, heads);
    std::vector<uint16_t> bits(Bits(out), Bits(out) + out.numel());
    bits.insert(bits.end(), Bits(dqkv), Bits(dqkv) + dqkv.numel());
    return bits;
  };
  EXPECT_EQ(run(), run());
}

}  // namespace
}  // namespace baton::kernels
