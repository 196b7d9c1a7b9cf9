// Converts CUDA runtime errors to absl::Status with file:line and CUDA's own
// message. Use BATON_CUDA_RETURN_IF_ERROR(cudaMalloc(...)).
#ifndef BATON_KERNELS_CUDA_CUDA_STATUS_H_
#define BATON_KERNELS_CUDA_CUDA_STATUS_H_

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace baton::cuda {

inline absl::Status CudaStatus(cudaError_t err, const char* expr, const char* file, int line) {
  if (err == cudaSuccess) return absl::OkStatus();
  absl::StatusCode code = err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver
                              ? absl::StatusCode::kUnavailable
                              : absl::StatusCode::kInternal;
  return absl::Status(code, absl::StrCat(file, ":", line, ": ", expr, " failed: ",
                                         cudaGetErrorName(err), ": ", cudaGetErrorString(err)));
}

// Number of visible GPUs, or UNAVAILABLE naming why there are none.
inline absl::Status CudaDeviceCount(int* count) {
  *count = 0;
  cudaError_t err = cudaGetDeviceCount(count);
  if (err != cudaSuccess) {
    *count = 0;
    return CudaStatus(err, "cudaGetDeviceCount", __FILE__, __LINE__);
  }
  if (*count == 0) return absl::UnavailableError("no CUDA device is visible");
  return absl::OkStatus();
}

}  // namespace baton::cuda

#define BATON_CUDA_RETURN_IF_ERROR(expr)                                          \
  do {                                                                            \
    cudaError_t baton_cuda_err_ = (expr);                                         \
    if (baton_cuda_err_ != cudaSuccess)                                           \
      return ::baton::cuda::CudaStatus(baton_cuda_err_, #expr, __FILE__, __LINE__); \
  } while (0)

#endif  // BATON_KERNELS_CUDA_CUDA_STATUS_H_
