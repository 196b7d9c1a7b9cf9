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

}  // namespace
}  // namespace baton::cuda
