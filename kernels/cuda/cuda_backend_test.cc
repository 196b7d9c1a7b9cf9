// GPU test (tag `gpu`; fails without a GPU): the CUDA backend through the
// ops of kernels/ops.h, against the CPU backend on the same inputs — the
// wiring from tensors to launchers (shapes, dtypes, accumulators), the
// stream's sticky error, and no device allocation after the first step.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/ops.h"

namespace baton::cuda {
namespace {

using kernels::Device;
using kernels::DType;
using kernels::ExecContext;
using kernels::Shape;
using kernels::Tensor;

Tensor HostRandom(Shape shape, uint32_t seed, float scale = 1.0f) {
  Tensor t = Tensor::Zeros(std::move(shape));
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = dist(rng);
  return t;
}

double MaxRel(const Tensor& got, const Tensor& want) {
  double diff = 0, norm = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    diff = std::max(diff, std::fabs(double{got.f32()[i]} - want.f32()[i]));
    norm = std::max(norm, std::fabs(double{want.f32()[i]}));
  }
  return norm == 0 ? diff : diff / norm;
}

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::Status probe = kernels::ProbeDevice(Device::Cuda(0));
    ASSERT_TRUE(probe.ok()) << "this test needs a GPU: " << probe;
    absl::StatusOr<std::unique_ptr<kernels::Stream>> s = kernels::Stream::Create(Device::Cuda(0));
    ASSERT_TRUE(s.ok()) << s.status();
    stream_ = std::move(*s);
    ctx_ = ExecContext::On(stream_.get());
  }

  // A device copy of a host tensor (same shape and dtype).
  Tensor Up(const Tensor& host) {
    absl::StatusOr<Tensor> t = kernels::ZerosOn(Device::Cuda(0), host.shape(), host.dtype());
    EXPECT_TRUE(t.ok()) << t.status();
    kernels::Copy(ctx_, *t, host);
    return *t;
  }
  Tensor Down(const Tensor& dev) {
    Tensor host = Tensor::Zeros(dev.shape(), dev.dtype());
    kernels::Copy(ctx_, host, dev);
    EXPECT_TRUE(stream_->Synchronize().ok());
    return host;
  }

  std::unique_ptr<kernels::Stream> stream_;
  ExecContext ctx_;
};

// One transformer block's worth of ops, forward and backward, on the GPU and
// on the CPU backend; every result compared, twice (the second run bitwise
// the first, reusing the cached GEMM algorithms).
TEST_F(CudaBackendTest, ABlockOfOpsMatchesTheCpuBackendAndRepeatsBitwise) {
  const int64_t B = 2, T = 16, C = 32, H = 4, V = 56, N = B * T;
  Tensor tokens = Tensor::Zeros({B, T}, DType::kInt32);
  Tensor targets = Tensor::Zeros({N}, DType::kInt32);
  for (int64_t i = 0; i < N; ++i) {
    tokens.i32()[i] = static_cast<int32_t>((i * 7) % V);
    targets.i32()[i] = i % 5 == 0 ? kernels::kIgnoreTarget : static_cast<int32_t>((i * 3) % V);
  }
  const Tensor wte = HostRandom({V, C}, 1, 0.1f), wpe = HostRandom({T, C}, 2, 0.1f);
  const Tensor ln_w = HostRandom({C}, 3), ln_b = HostRandom({C}, 4);
  const Tensor w_qkv = HostRandom({3 * C, C}, 5, 0.2f), b_qkv = HostRandom({3 * C}, 6);

  // The step on any backend; returns the tensors to compare (on that device).
  auto step = [&](const ExecContext& ctx, auto up) {
    std::vector<Tensor> keep;
    auto make = [&](Shape shape, DType dtype = DType::kFloat32) {
      Tensor host = Tensor::Zeros(shape, dtype);
      return ctx.on_host() ? host : up(host);
    };
    Tensor d_tokens = ctx.on_host() ? tokens : up(tokens);
    Tensor d_targets = ctx.on_host() ? targets : up(targets);
    Tensor d_wte = ctx.on_host() ? wte : up(wte);
    Tensor d_wpe = ctx.on_host() ? wpe : up(wpe);
    Tensor d_lnw = ctx.on_host() ? ln_w : up(ln_w);
    Tensor d_lnb = ctx.on_host() ? ln_b : up(ln_b);
    Tensor d_wqkv = ctx.on_host() ? w_qkv : up(w_qkv);
    Tensor d_bqkv = ctx.on_host() ? b_qkv : up(b_qkv);
    Tensor x = make({N, C}), ln = make({N, C}), mean = make({N}), rstd = make({N});
    Tensor qkv = make({B, T, 3 * C}), att = make({B, H, T, T}), y = make({B, T, C});
    Tensor logits = make({N, V}), loss = make({1}, DType::kFloat64);
    kernels::Embedding(ctx, x, d_tokens, d_wte, 0, d_wpe);
    kernels::LayerNorm(ctx, ln, mean, rstd, x, d_lnw, d_lnb);
    kernels::Linear(ctx, qkv.Reshaped({N, 3 * C}), ln, d_wqkv, d_bqkv);
    kernels::Attention(ctx, y, att, qkv, static_cast<int>(H));
    kernels::Residual(ctx, y.Reshaped({N, C}), y.Reshaped({N, C}), x);
    kernels::Linear(ctx, logits, y.Reshaped({N, C}), d_wte, Tensor());  // tied head
    kernels::SoftmaxCrossEntropy(ctx, logits, d_targets, 1.0f / N, loss);
    // Backward.
    Tensor dy = make({N, C}), dwte = make({V, C}), dwpe = make({T, C}), dqkv = make({B, T, 3 * C});
    Tensor scratch = make({T, T}), dln = make({N, C}), dx = make({N, C});
    Tensor dlnw = make({C}), dlnb = make({C}), dwqkv = make({3 * C, C}), dbqkv = make({3 * C});
    Tensor norm = make({1}, DType::kFloat64);
    kernels::LinearBackwardInput(ctx, dy, logits, d_wte, false);
    kernels::LinearBackwardWeight(ctx, dwte, logits, y.Reshaped({N, C}));
    kernels::AttentionBackward(ctx, dqkv, scratch, dy.Reshaped({B, T, C}), qkv, att,
                               static_cast<int>(H));
    kernels::LinearBackwardInput(ctx, dln, dqkv.Reshaped({N, 3 * C}), d_wqkv, false);
    kernels::LinearBackwardWeight(ctx, dwqkv, dqkv.Reshaped({N, 3 * C}), ln);
    kernels::BiasBackward(ctx, dbqkv, dqkv.Reshaped({N, 3 * C}));
    kernels::LayerNormBackward(ctx, dx, dlnw, dlnb, dln, x, d_lnw, mean, rstd);
    kernels::ResidualBackward(ctx, dx, Tensor(), dy);
    kernels::EmbeddingBackward(ctx, dwte, 0, dwpe, dx, d_tokens);
    kernels::SumOfSquares(ctx, dwte, norm);
    kernels::SumOfSquares(ctx, dwqkv, norm);
    Tensor m = make({V, C}), v = make({V, C});
    Tensor p = make({V, C});
    kernels::Copy(ctx, p, d_wte);
    kernels::AdamW(ctx, p, dwte, m, v, kernels::AdamWConfig(), 1, 0.5f);
    return std::vector<Tensor>{x, ln, qkv, att, y, logits, loss, dqkv, dln, dx, dlnw,
                               dlnb, dwqkv, dbqkv, dwte, dwpe, norm, p};
  };
  const char* names[] = {"x",    "ln",   "qkv",   "att",   "y",    "dlogits", "loss", "dqkv", "dln",
                         "dx",   "dlnw", "dlnb",  "dwqkv", "dbqkv", "dwte",   "dwpe", "norm", "adamw"};

  const std::vector<Tensor> want = step(ExecContext::Host(), [](const Tensor& t) { return t; });
  std::vector<std::vector<float>> first;
  for (int run = 0; run < 2; ++run) {
    std::vector<Tensor> got = step(ctx_, [&](const Tensor& t) { return Up(t); });
    ASSERT_TRUE(stream_->Synchronize().ok());
    absl::StatusOr<CudaStreamInfo> info = GetCudaStreamInfo(*stream_);
    ASSERT_TRUE(info.ok());
    if (run == 0) {
      EXPECT_GT(info->scratch_bytes, 0u);
    } else {
      EXPECT_GT(info->gemm_cache_hits, 0) << "second run reuses the GEMM algorithms";
    }
    for (size_t i = 0; i < want.size(); ++i) {
      Tensor host = Down(got[i]);
      std::vector<float> values;
      if (host.dtype() == DType::kFloat64) {
        const double g = *static_cast<double*>(host.raw());
        const double w = *static_cast<double*>(want[i].raw());
        EXPECT_NEAR(g, w, 1e-5 * std::fabs(w)) << names[i];
        values.push_back(static_cast<float>(g));
      } else {
        EXPECT_LE(MaxRel(host, want[i]), 1e-5) << names[i];
        values.assign(host.f32(), host.f32() + host.numel());
      }
      if (run == 0) {
        first.push_back(values);
      } else {
        EXPECT_EQ(std::memcmp(values.data(), first[i].data(), values.size() * sizeof(float)), 0)
            << names[i] << " differs run to run";
      }
    }
  }
}

TEST_F(CudaBackendTest, NoBackendAllocationOnceShapesRepeat) {
  const int64_t N = 64, C = 128;
  Tensor x = Up(HostRandom({N, C}, 7)), dout = Up(HostRandom({N, C}, 8));
  Tensor w = Up(HostRandom({C}, 9)), b = Up(HostRandom({C}, 10));
  Tensor out = Up(Tensor::Zeros({N, C})), mean = Up(Tensor::Zeros({N})), rstd = Up(Tensor::Zeros({N}));
  Tensor dx = Up(Tensor::Zeros({N, C})), dw = Up(Tensor::Zeros({C})), db = Up(Tensor::Zeros({C}));
  Tensor weight = Up(HostRandom({C, C}, 11)), y = Up(Tensor::Zeros({N, C}));
  auto once = [&] {
    kernels::LayerNorm(ctx_, out, mean, rstd, x, w, b);
    kernels::Linear(ctx_, y, out, weight, b);
    kernels::LinearBackwardWeight(ctx_, weight, dout, out);
    kernels::LayerNormBackward(ctx_, dx, dw, db, dout, x, w, mean, rstd);
    kernels::BiasBackward(ctx_, db, dout);
    ASSERT_TRUE(stream_->Synchronize().ok());
  };
  once();
  const int64_t before = kernels::GetMemoryStats(Device::Cuda(0)).system_allocations;
  for (int i = 0; i < 3; ++i) once();
  EXPECT_EQ(kernels::GetMemoryStats(Device::Cuda(0)).system_allocations, before);
}

TEST_F(CudaBackendTest, AFailedOpIsReturnedByTheStreamsNextSynchronize) {
  Tensor x = Up(HostRandom({8, 8}, 12)), w = Up(HostRandom({8, 8}, 13));
  absl::StatusOr<Tensor> out16 = kernels::ZerosOn(Device::Cuda(0), {8, 8}, DType::kBFloat16);
  ASSERT_TRUE(out16.ok());
  kernels::Linear(ctx_, *out16, x, w, Tensor());  // fp32 inputs, bf16 output: refused
  absl::Status s = stream_->Synchronize();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("Linear"), absl::string_view::npos) << s;
  EXPECT_FALSE(stream_->Synchronize().ok()) << "the error stays with the stream";
}

TEST_F(CudaBackendTest, Bf16LinearThroughCastsStaysWithinBf16Rounding) {
  const int64_t N = 64, I = 96, O = 128;
  const Tensor x = HostRandom({N, I}, 14), w = HostRandom({O, I}, 15, 0.2f);
  Tensor want = Tensor::Zeros({N, O});
  kernels::Linear(want, x, w, Tensor());
  Tensor dx32 = Up(x), dw32 = Up(w);
  absl::StatusOr<Tensor> x16 = kernels::ZerosOn(Device::Cuda(0), {N, I}, DType::kBFloat16);
  absl::StatusOr<Tensor> w16 = kernels::ZerosOn(Device::Cuda(0), {O, I}, DType::kBFloat16);
  absl::StatusOr<Tensor> y16 = kernels::ZerosOn(Device::Cuda(0), {N, O}, DType::kBFloat16);
  ASSERT_TRUE(x16.ok() && w16.ok() && y16.ok());
  kernels::Cast(ctx_, *x16, dx32);
  kernels::Cast(ctx_, *w16, dw32);
  kernels::Linear(ctx_, *y16, *x16, *w16, Tensor());
  Tensor y32 = Up(Tensor::Zeros({N, O}));
  kernels::Cast(ctx_, y32, *y16);
  // Inputs rounded to 8 significant bits each and the output once more.
  EXPECT_LE(MaxRel(Down(y32), want), 2e-2);
}

// The qkv projection in bf16: bf16 x and W, the fp32 master bias, a bf16
// output; against the CPU backend's bf16 reference (fp32 sum with the bias,
// one rounding), whichever way cuBLASLt runs it (fused bias, or the fp32
// output form and a cast).
TEST_F(CudaBackendTest, Bf16LinearWithAnFp32BiasIntoBf16MatchesTheCpuBackend) {
  const int64_t N = 64, I = 96, O = 3 * 96;
  const Tensor x = HostRandom({N, I}, 17), w = HostRandom({O, I}, 18, 0.2f);
  const Tensor bias = HostRandom({O}, 19);
  Tensor x16 = Tensor::Zeros({N, I}, DType::kBFloat16), w16 = Tensor::Zeros({O, I}, DType::kBFloat16);
  kernels::Cast(ExecContext::Host(), x16, x);
  kernels::Cast(ExecContext::Host(), w16, w);
  Tensor want16 = Tensor::Zeros({N, O}, DType::kBFloat16), want = Tensor::Zeros({N, O});
  kernels::Linear(want16, x16, w16, bias);
  kernels::Cast(ExecContext::Host(), want, want16);
  Tensor d_x16 = Up(x16), d_w16 = Up(w16), d_bias = Up(bias);
  for (int run = 0; run < 2; ++run) {  // the second run takes the remembered path
    absl::StatusOr<Tensor> y16 = kernels::ZerosOn(Device::Cuda(0), {N, O}, DType::kBFloat16);
    ASSERT_TRUE(y16.ok());
    kernels::Linear(ctx_, *y16, d_x16, d_w16, d_bias);
    Tensor y32 = Up(Tensor::Zeros({N, O}));
    kernels::Cast(ctx_, y32, *y16);
    const absl::Status synced = stream_->Synchronize();
    ASSERT_TRUE(synced.ok()) << synced;
    // Both round the same fp32 sums once; only the summation order differs.
    EXPECT_LE(MaxRel(Down(y32), want), 8e-3) << "run " << run;
  }
}

TEST_F(CudaBackendTest, EventsTimeTheStreamsWork) {
  absl::StatusOr<std::unique_ptr<kernels::Event>> start = kernels::Event::Create(Device::Cuda(0));
  absl::StatusOr<std::unique_ptr<kernels::Event>> end = kernels::Event::Create(Device::Cuda(0));
  ASSERT_TRUE(start.ok() && end.ok());
  Tensor a = Up(HostRandom({512, 512}, 16)), c = Up(Tensor::Zeros({512, 512}));
  ASSERT_TRUE((*start)->Record(*stream_).ok());
  for (int i = 0; i < 10; ++i) kernels::Linear(ctx_, c, a, a, Tensor());
  ASSERT_TRUE((*end)->Record(*stream_).ok());
  ASSERT_TRUE((*end)->Synchronize().ok());
  absl::StatusOr<double> seconds = (*end)->SecondsSince(**start);
  ASSERT_TRUE(seconds.ok()) << seconds.status();
  EXPECT_GT(*seconds, 0.0);
}

}  // namespace
}  // namespace baton::cuda
