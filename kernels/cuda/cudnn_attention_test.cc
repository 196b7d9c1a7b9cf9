// cuDNN's fused bf16 attention (through attention.h, as the CUDA backend calls
// it) against the CPU's bf16 reference, on a GPU (tag gpu: fails without one).
//
// The reference is kernels/cpu's AttentionForwardBf16Rounded /
// AttentionBackwardBf16Rounded (the CPU backend's bf16 attention: bf16
// operands, fp32 math, P and dS rounded to bf16) on the same bf16-rounded
// inputs. Bound: max-norm relative error ≤ 3e-2 for out and dqkv, the bound
// the GEMM path's bf16 attention is held to in cuda_ops_test (cuDNN also
// rounds P to bf16 before P·V and dS before its GEMMs, but sums in another
// order and recomputes P from the fp32 stats). Run to run: bitwise (the
// deterministic backward; the same plan from the per-shape cache).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/attention.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/cudnn_attention.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/device_buffer_testing.h"
#include "kernels/cuda/plan.h"
#include "kernels/cuda/sdpa_plan.h"

namespace baton::cuda {
namespace {

namespace cpu = ::baton::kernels::cpu;

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

std::vector<uint16_t> ToBf16(const std::vector<float>& x) {
  std::vector<uint16_t> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = FloatToBf16Bits(x[i]);
  return y;
}
std::vector<float> FromBf16(const std::vector<uint16_t>& x) {
  std::vector<float> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = Bf16BitsToFloat(x[i]);
  return y;
}
std::vector<float> RoundBf16(const std::vector<float>& x) { return FromBf16(ToBf16(x)); }

double MaxRelError(const std::vector<float>& got, const std::vector<float>& want) {
  EXPECT_EQ(got.size(), want.size());
  double diff = 0, norm = 0;
  for (size_t i = 0; i < want.size() && i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    diff = std::max(diff, std::fabs(static_cast<double>(got[i]) - want[i]));
    norm = std::max(norm, std::fabs(static_cast<double>(want[i])));
  }
  return norm == 0 ? diff : diff / norm;
}

class CudnnAttentionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    absl::Status s = CudaDeviceCount(&count);
    ASSERT_TRUE(s.ok()) << "this test needs a GPU: " << s;
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
    absl::StatusOr<std::unique_ptr<CublasLtGemm>> g = CublasLtGemm::Create();
    ASSERT_TRUE(g.ok()) << g.status();
    gemm_ = std::move(*g);
    absl::StatusOr<CudnnAttentionPtr> c = CreateCudnnAttention(0);
    ASSERT_TRUE(c.ok()) << "cuDNN must load on a GPU host: " << c.status();
    cudnn_ = std::move(*c);
  }
  void TearDown() override {
    cudnn_.reset();
    gemm_.reset();
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  cudaStream_t stream_ = nullptr;
  std::unique_ptr<CublasLtGemm> gemm_;
  CudnnAttentionPtr cudnn_;
};

struct Result {
  std::vector<float> out, dqkv;
};

// Rank `rank` of a tp split of a B×T attention with `heads` heads of width
// C/heads: the fused path through attention.h on that rank's packed qkv, with
// the saved buffer the model allocates ([B,H',T,T] bf16).
Result RunShard(CublasLtGemm& gemm, CudnnAttention* cudnn, cudaStream_t stream,
                const std::vector<float>& qkv, const std::vector<float>& dout, int64_t B, int64_t T,
                int64_t C, int64_t heads, int64_t tp, int64_t rank) {
  absl::StatusOr<AttentionShard> shard = ShardAttention(B, T, C, heads, tp);
  EXPECT_TRUE(shard.ok()) << shard.status();
  const int64_t lc = shard->channels;
  std::vector<float> lqkv(B * T * 3 * lc), ldout(B * T * lc);
  for (int64_t r = 0; r < B * T; ++r) {
    for (int64_t part = 0; part < 3; ++part) {
      for (int64_t c = 0; c < lc; ++c) {
        lqkv[r * 3 * lc + part * lc + c] = qkv[r * 3 * C + part * C + rank * lc + c];
      }
    }
    for (int64_t c = 0; c < lc; ++c) ldout[r * lc + c] = dout[r * C + rank * lc + c];
  }
  const AttentionPlan plan = PlanAttention(*shard);
  const size_t att_elems = static_cast<size_t>(B * shard->heads * T * T);
  absl::StatusOr<AttentionChoice> choice =
      ChooseAttention(cudnn, *shard, GemmDType::kBF16, att_elems * 2);
  if (!choice.ok() || choice->path != AttentionPath::kCudnnSdpa) {
    ADD_FAILURE() << "cuDNN was not chosen: "
                  << (choice.ok() ? choice->why_not_cudnn : choice.status().ToString());
    return {};
  }
  std::printf("cuDNN SDPA B=%ld T=%ld H'=%ld hd=%ld: workspace %zu bytes\n", long(B), long(T),
              long(shard->heads), long(shard->head_dim), choice->scratch_bytes);
  Dev<uint16_t> d_qkv(lqkv.size()), d_dout(ldout.size()), d_out(ldout.size()), d_att(att_elems),
      d_dqkv(lqkv.size());
  Dev<char> d_ws(choice->scratch_bytes);
  d_qkv.Upload(ToBf16(lqkv));
  d_dout.Upload(ToBf16(ldout));
  d_out.FillNaN();
  d_dqkv.FillNaN();  // every element must be written
  absl::Status s = AttentionForward(gemm, cudnn, plan, GemmDType::kBF16, d_out.get(), d_att.get(),
                                    att_elems * 2, d_qkv.get(), d_ws.get(), choice->scratch_bytes,
                                    stream);
  EXPECT_TRUE(s.ok()) << s;
  s = AttentionBackward(gemm, cudnn, plan, GemmDType::kBF16, d_dqkv.get(), d_ws.get(),
                        choice->scratch_bytes, d_dout.get(), d_qkv.get(), d_att.get(),
                        att_elems * 2, stream);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  return Result{FromBf16(d_out.Download()), FromBf16(d_dqkv.Download())};
}

TEST_F(CudnnAttentionTest, Bf16TensorParallelShardMatchesTheCpuReferenceAndRepeatsBitwise) {
  const int64_t B = 2, T = 256, C = 512, heads = 8, tp = 2;  // hd 64, H' 4
  const std::vector<float> qkv = RoundBf16(Random(B * T * 3 * C, 60));
  const std::vector<float> dout = RoundBf16(Random(B * T * C, 61));
  std::vector<float> out(B * T * C), att(B * heads * T * T), dqkv(qkv.size()), scratch(T * T);
  cpu::AttentionForwardBf16Rounded(out.data(), att.data(), qkv.data(), B, T, C, heads);
  cpu::AttentionBackwardBf16Rounded(dqkv.data(), scratch.data(), dout.data(), qkv.data(),
                                    att.data(), B, T, C, heads);
  const int64_t lc = C / tp;
  for (int64_t rank = 0; rank < tp; ++rank) {
    SCOPED_TRACE(::testing::Message() << "rank " << rank);
    const Result first =
        RunShard(*gemm_, cudnn_.get(), stream_, qkv, dout, B, T, C, heads, tp, rank);
    std::vector<float> want_out(B * T * lc), want_dqkv(B * T * 3 * lc);
    for (int64_t r = 0; r < B * T; ++r) {
      for (int64_t c = 0; c < lc; ++c) want_out[r * lc + c] = out[r * C + rank * lc + c];
      for (int64_t part = 0; part < 3; ++part) {
        for (int64_t c = 0; c < lc; ++c) {
          want_dqkv[r * 3 * lc + part * lc + c] = dqkv[r * 3 * C + part * C + rank * lc + c];
        }
      }
    }
    const double e_out = MaxRelError(first.out, want_out);
    const double e_dqkv = MaxRelError(first.dqkv, want_dqkv);
    std::printf("rank %ld: out max rel error %.3g, dqkv %.3g\n", long(rank), e_out, e_dqkv);
    EXPECT_LE(e_out, 3e-2);
    EXPECT_LE(e_dqkv, 3e-2);
    const Result second =
        RunShard(*gemm_, cudnn_.get(), stream_, qkv, dout, B, T, C, heads, tp, rank);
    EXPECT_EQ(std::memcmp(first.out.data(), second.out.data(), first.out.size() * 4), 0);
    EXPECT_EQ(std::memcmp(first.dqkv.data(), second.dqkv.data(), first.dqkv.size() * 4), 0);
  }
  // Both ranks' shards have the same shape: one pair of graphs, built once.
  EXPECT_EQ(cudnn_->cached_shapes(), 1u);
}

TEST_F(CudnnAttentionTest, Gpt2SmallShapeBuildsWithinTheWorkspaceBound) {
  absl::StatusOr<AttentionShard> s = ShardAttention(8, 1024, 768, 12, 1);
  ASSERT_TRUE(s.ok());
  absl::StatusOr<AttentionChoice> c =
      ChooseAttention(cudnn_.get(), *s, GemmDType::kBF16, size_t{8} * 12 * 1024 * 1024 * 2);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->path, AttentionPath::kCudnnSdpa) << c->why_not_cudnn;
  EXPECT_LE(c->scratch_bytes, kMaxSdpaWorkspaceBytes);
  std::printf("GPT-2 small (B=8, T=1024, 12 heads of 64): cuDNN workspace %zu bytes\n",
              c->scratch_bytes);
}

TEST_F(CudnnAttentionTest, Fp32AndShapesThatDoNotFitTakeTheGemmPath) {
  absl::StatusOr<AttentionShard> s = ShardAttention(2, 256, 512, 8, 1);
  ASSERT_TRUE(s.ok());
  const size_t att_bytes = size_t{2} * 8 * 256 * 256 * 2;
  absl::StatusOr<AttentionChoice> f32 = ChooseAttention(cudnn_.get(), *s, GemmDType::kF32, att_bytes * 2);
  ASSERT_TRUE(f32.ok());
  EXPECT_EQ(f32->path, AttentionPath::kGemmSoftmax);
  // T ≤ hd: the saved buffer cannot hold the stats and o.
  absl::StatusOr<AttentionShard> small = ShardAttention(2, 32, 512, 8, 1);
  ASSERT_TRUE(small.ok());
  absl::StatusOr<AttentionChoice> c =
      ChooseAttention(cudnn_.get(), *small, GemmDType::kBF16, size_t{2} * 8 * 32 * 32 * 2);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->path, AttentionPath::kGemmSoftmax);
  EXPECT_NE(c->why_not_cudnn.find("saved-for-backward"), std::string::npos) << c->why_not_cudnn;
}

}  // namespace
}  // namespace baton::cuda
