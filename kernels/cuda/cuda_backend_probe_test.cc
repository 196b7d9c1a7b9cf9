// Runs everywhere (not tagged gpu): the CUDA backend's availability answers
// agree with the driver. On a machine without a driver or GPU (CI), probing,
// creating a stream or allocating on cuda:0 fails with UNAVAILABLE naming the
// cause, and nothing crashes (backend.h §8: the worker fails Configure with
// this error and stays up). With a GPU, the same calls succeed.
#include <cuda_runtime.h>

#include "gtest/gtest.h"
#include "kernels/backend.h"
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

}  // namespace
}  // namespace baton::cuda
