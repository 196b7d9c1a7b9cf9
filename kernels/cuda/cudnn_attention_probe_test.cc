// Runs everywhere (not tagged gpu): the cuDNN attention path is chosen only
// where it can run. libcudnn loads by dlopen; without a driver creating its
// handle fails with UNAVAILABLE (no crash, no exception escaping), and
// ChooseAttention then sends bf16 to the GEMM path with the GEMM path's
// scratch; fp32 always takes the GEMM path.
#include <cuda_runtime.h>

#include "gtest/gtest.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/cudnn_attention.h"
#include "kernels/cuda/plan.h"
#include "kernels/cuda/sdpa_plan.h"

namespace baton::cuda {
namespace {

TEST(CudnnAttentionProbeTest, LoadsCudnnAndCreatesAHandleOnlyWithADriver) {
  const absl::Status load = LoadCudnn();
  ASSERT_TRUE(load.ok()) << load;  // this toolkit ships libcudnn next to cudnn.h
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  absl::StatusOr<CudnnAttentionPtr> a = CreateCudnnAttention(0);
  if (err != cudaSuccess || count == 0) {
    EXPECT_EQ(a.status().code(), absl::StatusCode::kUnavailable) << a.status();
    EXPECT_NE(a.status().message().find("cudnnCreate on cuda:0"), absl::string_view::npos)
        << a.status();
  } else {
    EXPECT_TRUE(a.ok()) << a.status();
  }
}

TEST(CudnnAttentionProbeTest, WithoutCudnnBf16AndFp32TakeTheGemmPath) {
  absl::StatusOr<AttentionShard> s = ShardAttention(8, 1024, 768, 12, 1);
  ASSERT_TRUE(s.ok());
  const size_t att_bytes = size_t{8} * 12 * 1024 * 1024 * 2;
  for (GemmDType dtype : {GemmDType::kBF16, GemmDType::kF32}) {
    absl::StatusOr<AttentionChoice> c = ChooseAttention(nullptr, *s, dtype, att_bytes);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->path, AttentionPath::kGemmSoftmax);
    EXPECT_FALSE(c->why_not_cudnn.empty());
    EXPECT_EQ(c->scratch_bytes, *AttentionScratchBytes(*s, dtype));
  }
  // A shard the GEMM path refuses is an error, not a silent choice.
  AttentionShard bad = *s;
  bad.seq = 1 << 20;  // H'·T·T floats beyond kMaxScratchBytes
  EXPECT_FALSE(ChooseAttention(nullptr, bad, GemmDType::kBF16, att_bytes).ok());
}

// What the model allocates for attention's saved state (att) follows the
// path: cuDNN's fused bf16 SDPA keeps the softmax stats and a copy of o, never
// the T×T probabilities; the GEMM path keeps P. GPT-2 small's shape.
TEST(CudnnAttentionProbeTest, TheFusedPathSavesStatsAndOutputNotTheProbabilities) {
  const int64_t b = 8, t = 1024, c = 768, h = 12;
  absl::StatusOr<AttentionShard> s = ShardAttention(b, t, c, h, 1);
  ASSERT_TRUE(s.ok());
  const size_t p_bytes = static_cast<size_t>(b * h * t * t) * 2;

  const AttentionSavedShape fused = AttentionSaved(AttentionPath::kCudnnSdpa, *s, GemmDType::kBF16);
  EXPECT_EQ(fused.dtype, GemmDType::kBF16);
  ASSERT_EQ(fused.dims.size(), 1u);  // a flat buffer, not [B,H,T,T]
  const size_t stats = static_cast<size_t>(b * h * t) * 4, o = static_cast<size_t>(b * t * c) * 2;
  EXPECT_EQ(fused.bytes(), SdpaSavedBytes(*s));
  EXPECT_GE(fused.bytes(), stats + o);
  EXPECT_LE(fused.bytes(), stats + o + 256);
  EXPECT_LT(fused.bytes() * 10, p_bytes);  // 12.4 MiB vs 192 MiB for 8 sequences
  // A forward and backward given this buffer can take the fused path.
  EXPECT_TRUE(SdpaApplies(*s, fused.bytes()).ok()) << SdpaApplies(*s, fused.bytes());

  for (GemmDType dtype : {GemmDType::kBF16, GemmDType::kF32}) {
    const AttentionSavedShape p = AttentionSaved(AttentionPath::kGemmSoftmax, *s, dtype);
    EXPECT_EQ(p.dims, (std::vector<int64_t>{b, h, t, t}));
    EXPECT_EQ(p.dtype, dtype);
  }
}

// Without cuDNN on the stream (here: no driver) the choice the model sizes
// att by is the GEMM path, so it allocates P and the forward, given P's
// bytes, takes the GEMM path too.
TEST(CudnnAttentionProbeTest, WithoutCudnnTheSavedBufferIsP) {
  absl::StatusOr<AttentionShard> s = ShardAttention(2, 128, 256, 4, 1);
  ASSERT_TRUE(s.ok());
  for (GemmDType dtype : {GemmDType::kBF16, GemmDType::kF32}) {
    absl::StatusOr<AttentionChoice> c = ChooseAttentionToSave(nullptr, *s, dtype);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->path, AttentionPath::kGemmSoftmax);
    const AttentionSavedShape saved = AttentionSaved(c->path, *s, dtype);
    EXPECT_EQ(saved.dims, (std::vector<int64_t>{2, 4, 128, 128}));
    absl::StatusOr<AttentionChoice> again = ChooseAttention(nullptr, *s, dtype, saved.bytes());
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(again->path, c->path);
  }
}

}  // namespace
}  // namespace baton::cuda
