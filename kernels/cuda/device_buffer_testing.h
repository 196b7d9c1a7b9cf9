// Dev<T>: a device buffer of T for the GPU tests, freed on destruction;
// failures are test failures.
#ifndef BATON_KERNELS_CUDA_DEVICE_BUFFER_TESTING_H_
#define BATON_KERNELS_CUDA_DEVICE_BUFFER_TESTING_H_

#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "gtest/gtest.h"

namespace baton::cuda {

template <typename T>
class Dev {
 public:
  explicit Dev(size_t n) : n_(n) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)), cudaSuccess);
    p_ = static_cast<T*>(p);
  }
  explicit Dev(const std::vector<T>& host) : Dev(host.size()) { Upload(host); }
  ~Dev() { cudaFree(p_); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;

  T* get() const { return p_; }
  void Upload(const std::vector<T>& host) {
    ASSERT_EQ(host.size(), n_);
    ASSERT_EQ(cudaMemcpy(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  // Every byte 0xff (NaN for floats): what a kernel fails to write shows.
  void FillNaN() { ASSERT_EQ(cudaMemset(p_, 0xff, n_ * sizeof(T)), cudaSuccess); }
  std::vector<T> Download() const {
    std::vector<T> host(n_);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(host.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }

 private:
  T* p_ = nullptr;
  size_t n_;
};

}  // namespace baton::cuda

#endif  // BATON_KERNELS_CUDA_DEVICE_BUFFER_TESTING_H_
