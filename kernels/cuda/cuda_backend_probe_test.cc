// Runs everywhere (not tagged gpu): the CUDA backend's availability answers
// agree with the driver. On a machine without a driver or GPU (CI), probing,
// creating a stream or allocating on cuda:0 fails with UNAVAILABLE naming the
// cause, and nothing crashes (backend.h §8: the worker fails Configure with
// this error and stays up). With a GPU, the same calls succeed.
#include <cuda_runtime.h>

#include <fstream>
#include <string>
#include <utility>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/ops.h"
#include "kernels/cuda/cuda_backend.h"

namespace baton::cuda {
namespace {

using kernels::Device;

TEST(CudaBackendProbeTest, IsRegisteredForCudaDevices) {
  EXPECT_EQ(kernels::FindBackend(kernels::DeviceType::kCuda), &CudaBackend());
  EXPECT_STREQ(CudaBackend().name, "cuda");
}

TEST(CudaBackendProbeTest, ProbeStreamAndAllocationAgreeWithTheDriver) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  const absl::Status probe = kernels::ProbeDevice(Device::Cuda(0));
  absl::StatusOr<std::unique_ptr<kernels::Stream>> stream = kernels::Stream::Create(Device::Cuda(0));
  absl::StatusOr<kernels::Tensor> zeros = kernels::ZerosOn(Device::Cuda(0), {4});
  if (err != cudaSuccess || count == 0) {
    EXPECT_EQ(probe.code(), absl::StatusCode::kUnavailable) << probe;
    if (err != cudaSuccess) {
      EXPECT_NE(probe.message().find(cudaGetErrorName(err)), absl::string_view::npos) << probe;
    }
    EXPECT_EQ(stream.status().code(), absl::StatusCode::kUnavailable) << stream.status();
    EXPECT_FALSE(zeros.ok());
  } else {
    EXPECT_TRUE(probe.ok()) << probe;
    EXPECT_TRUE(stream.ok()) << stream.status();
    EXPECT_TRUE(zeros.ok()) << zeros.status();
  }
  // An ordinal past the visible devices is never usable.
  const absl::Status far = kernels::ProbeDevice(Device::Cuda(count + 7));
  EXPECT_EQ(far.code(), absl::StatusCode::kUnavailable) << far;
}

// What a worker registers as RegisterRequest.fused_attention_bf16 is the
// backend's own check. Without a driver: UNAVAILABLE, without loading cuDNN.
// With a GPU: OK exactly when a bf16 stream sizes attention's saved buffer
// for the fused path (AttentionBuffersFor: a flat buffer of stats and o, not
// P [B,H,T,T]) for a shape that path takes (GPT-2 small's heads of 64).
TEST(CudaBackendProbeTest, FusedAttentionIsTheBackendsOwnChoice) {
  EXPECT_EQ(kernels::ProbeFusedAttention(Device::Cpu()).code(), absl::StatusCode::kUnimplemented);
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  const absl::Status fused = kernels::ProbeFusedAttention(Device::Cuda(0));
  if (err != cudaSuccess || count == 0) {
    EXPECT_EQ(fused.code(), absl::StatusCode::kUnavailable) << fused;
    std::ifstream maps("/proc/self/maps");
    ASSERT_TRUE(maps.good());
    std::string line;
    while (std::getline(maps, line)) {
      EXPECT_EQ(line.find("libcudnn.so"), std::string::npos) << "the probe loaded cuDNN: " << line;
    }
    return;
  }
  std::printf("cuda:0 fused attention: %s\n", fused.ok() ? "yes" : std::string(fused.message()).c_str());
  absl::StatusOr<std::unique_ptr<kernels::Stream>> stream = kernels::Stream::Create(Device::Cuda(0));
  ASSERT_TRUE(stream.ok()) << stream.status();
  const kernels::ExecContext ctx = kernels::ExecContext::On(stream->get());
  const kernels::AttentionBuffers b =
      kernels::AttentionBuffersFor(ctx, 2, 128, 768, 12, kernels::DType::kBFloat16);
  EXPECT_EQ(b.saved.size() == 1, fused.ok()) << "saved rank " << b.saved.size() << "; probe: " << fused;
  EXPECT_EQ(kernels::ProbeFusedAttention(Device::Cuda(count + 7)).code(), absl::StatusCode::kUnavailable);
}

// Context-parallel attention has CUDA kernels: the backend's six entries are
// set, so ops.cc no longer aborts for want of a kernel. Without a CUDA stream
// in the context (no GPU is needed here: the tensors are views of a host
// buffer tagged cuda:0, never dereferenced) each entry aborts naming its op
// and the missing stream, before any device memory is touched.
TEST(CudaBackendProbeTest, ContextParallelAttentionHasCudaEntries) {
  ::testing::GTEST_FLAG(death_test_style) = "threadsafe";
  EXPECT_NE(CudaBackend().kv_of_qkv, nullptr);
  EXPECT_NE(CudaBackend().block_attention, nullptr);
  EXPECT_NE(CudaBackend().merge_attention_block, nullptr);
  EXPECT_NE(CudaBackend().attention_delta, nullptr);
  EXPECT_NE(CudaBackend().block_attention_backward, nullptr);
  EXPECT_NE(CudaBackend().qkv_grad_of_kv, nullptr);
  kernels::ExecContext ctx;
  ctx.device = Device::Cuda(0);
  ctx.backend = &CudaBackend();
  static float memory[64];
  auto on_gpu = [](kernels::Shape shape) {
    return kernels::Tensor::View(memory, std::move(shape), kernels::DType::kFloat32,
                                 Device::Cuda(0));
  };
  const kernels::Tensor qkv = on_gpu({1, 2, 6}), kv = on_gpu({1, 2, 4}), out = on_gpu({1, 2, 2}),
                        lse = on_gpu({1, 1, 2}), scratch = on_gpu({8});
  EXPECT_DEATH(kernels::BlockAttention(ctx, out, lse, qkv, kv, 1, 0, 0, scratch),
               "BlockAttention \\(cuda\\): the execution context has no CUDA stream");
  EXPECT_DEATH(kernels::KvOfQkv(ctx, kv, qkv),
               "KvOfQkv \\(cuda\\): the execution context has no CUDA stream");
  EXPECT_DEATH(kernels::MergeAttentionBlock(ctx, out, lse, out, lse, 1),
               "MergeAttentionBlock \\(cuda\\): the execution context has no CUDA stream");
  EXPECT_DEATH(kernels::AttentionDelta(ctx, lse, out, out, 1),
               "AttentionDelta \\(cuda\\): the execution context has no CUDA stream");
  EXPECT_DEATH(kernels::BlockAttentionBackward(ctx, qkv, kv, out, out, qkv, kv, lse, lse, 1, 0, 0,
                                               scratch),
               "BlockAttentionBackward \\(cuda\\): the execution context has no CUDA stream");
  EXPECT_DEATH(kernels::QkvGradOfKv(ctx, qkv, kv),
               "QkvGradOfKv \\(cuda\\): the execution context has no CUDA stream");
}

// Mixture-of-Experts routing has CUDA kernels: the nine entries are set, so
// ops.cc no longer aborts for want of a kernel (and GptStage::Create accepts
// model.moe on a CUDA device). Without a CUDA stream in the context each
// entry aborts naming its op and the missing stream, before any device
// memory is touched (no GPU needed: the tensors are views of a host buffer
// tagged cuda:0, never dereferenced).
TEST(CudaBackendProbeTest, MoeRoutingHasCudaEntries) {
  ::testing::GTEST_FLAG(death_test_style) = "threadsafe";
  EXPECT_NE(CudaBackend().router_top_k, nullptr);
  EXPECT_NE(CudaBackend().router_top_k_backward, nullptr);
  EXPECT_NE(CudaBackend().plan_dispatch, nullptr);
  EXPECT_NE(CudaBackend().expert_token_counts, nullptr);
  EXPECT_NE(CudaBackend().permute, nullptr);
  EXPECT_NE(CudaBackend().permute_backward, nullptr);
  EXPECT_NE(CudaBackend().combine, nullptr);
  EXPECT_NE(CudaBackend().combine_backward, nullptr);
  EXPECT_NE(CudaBackend().load_balancing_loss, nullptr);
  kernels::ExecContext ctx;
  ctx.device = Device::Cuda(0);
  ctx.backend = &CudaBackend();
  alignas(8) static float memory[64];
  auto on_gpu = [](kernels::Shape shape, kernels::DType dtype) {
    return kernels::Tensor::View(memory, std::move(shape), dtype, Device::Cuda(0));
  };
  // N = 2 tokens, E = 4 experts, K = 1, H = 2, Cap = 1.
  const kernels::Tensor logits = on_gpu({2, 4}, kernels::DType::kFloat32),
                        probs = on_gpu({2, 4}, kernels::DType::kFloat32),
                        gate = on_gpu({2, 1}, kernels::DType::kFloat32),
                        expert = on_gpu({2, 1}, kernels::DType::kInt32),
                        slot = on_gpu({2, 1}, kernels::DType::kInt32),
                        counts = on_gpu({4}, kernels::DType::kInt64),
                        x = on_gpu({2, 2}, kernels::DType::kFloat32),
                        buffer = on_gpu({4, 1, 2}, kernels::DType::kFloat32),
                        loss = on_gpu({1}, kernels::DType::kFloat32);
  EXPECT_DEATH(kernels::RouterTopK(ctx, probs, expert, gate, logits, false),
               "RouterTopK \\(cuda\\): the execution context has no CUDA stream");
  EXPECT_DEATH(kernels::RouterTopKBackward(ctx, logits, gate, expert, gate, probs, false),
               "RouterTopKBackward \\(cuda\\): the execution context has no CUDA stream");
  EXPECT_DEATH(kernels::PlanDispatch(ctx, slot, counts, expert, 1),
               "PlanDispatch \\(cuda\\): the execution context has no CUDA stream");
  EXPECT_DEATH(kernels::ExpertTokenCounts(ctx, counts, expert),
               "ExpertTokenCounts \\(cuda\\): the execution context has no CUDA stream");
  EXPECT_DEATH(kernels::Permute(ctx, buffer, x, expert, slot),
               "Permute \\(cuda\\): the execution context has no CUDA stream");
  EXPECT_DEATH(kernels::PermuteBackward(ctx, x, buffer, expert, slot),
               "PermuteBackward \\(cuda\\): the execution context has no CUDA stream");
  EXPECT_DEATH(kernels::Combine(ctx, x, buffer, gate, expert, slot),
               "Combine \\(cuda\\): the execution context has no CUDA stream");
  EXPECT_DEATH(kernels::CombineBackward(ctx, buffer, gate, x, buffer, gate, expert, slot),
               "CombineBackward \\(cuda\\): the execution context has no CUDA stream");
  EXPECT_DEATH(kernels::LoadBalancingLoss(ctx, loss, logits, probs, expert, 0.01f, 1.0f),
               "LoadBalancingLoss \\(cuda\\): the execution context has no CUDA stream");
}

}  // namespace
}  // namespace baton::cuda
