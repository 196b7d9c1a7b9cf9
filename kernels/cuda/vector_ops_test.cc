// GPU test (tag `gpu`): needs a CUDA device; CI builds it but only runs it
// where a GPU is present (bazel test --config=gpu ...).
#include "kernels/cuda/vector_ops.cuh"

#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/cuda_status.h"

namespace baton::cuda {
namespace {

class VectorOpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    absl::Status s = CudaDeviceCount(&count);
    ASSERT_TRUE(s.ok()) << "this test needs a GPU: " << s;
  }
};

TEST_F(VectorOpsTest, AxpyMatchesCpuReferenceIncludingTail) {
  for (int64_t n : {1, 3, 4, 1000, 1 << 20, (1 << 20) + 3}) {
    std::vector<float> x(n), y(n), want(n);
    for (int64_t i = 0; i < n; ++i) {
      x[i] = 0.001f * static_cast<float>(i % 977);
      y[i] = 1.0f - 0.002f * static_cast<float>(i % 131);
      want[i] = std::fma(2.5f, x[i], y[i]);
    }
    float *dx = nullptr, *dy = nullptr;
    ASSERT_EQ(cudaMalloc(&dx, n * sizeof(float)), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&dy, n * sizeof(float)), cudaSuccess);
    cudaMemcpy(dx, x.data(), n * sizeof(float), cudaMemcpyHostToDevice);
    cudaMemcpy(dy, y.data(), n * sizeof(float), cudaMemcpyHostToDevice);
    ASSERT_EQ(LaunchAxpy(2.5f, dx, dy, n, nullptr), cudaSuccess);
    std::vector<float> got(n);
    ASSERT_EQ(cudaMemcpy(got.data(), dy, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    cudaFree(dx);
    cudaFree(dy);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[i], want[i]) << "n=" << n << " i=" << i;
  }
}

TEST_F(VectorOpsTest, FillWritesEveryElementAndRejectsMisalignedPointers) {
  const int64_t n = 12345;
  float* dy = nullptr;
  ASSERT_EQ(cudaMalloc(&dy, (n + 1) * sizeof(float)), cudaSuccess);
  ASSERT_EQ(LaunchFill(dy, 7.0f, n, nullptr), cudaSuccess);
  std::vector<float> got(n);
  ASSERT_EQ(cudaMemcpy(got.data(), dy, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[i], 7.0f) << i;
  EXPECT_EQ(LaunchFill(dy + 1, 1.0f, n, nullptr), cudaErrorMisalignedAddress);
  cudaFree(dy);
}

}  // namespace
}  // namespace baton::cuda
