// Vectorised element-wise kernels on the GPU.
//
//   Fill:  y[i] = value
//   Axpy:  y[i] = a * x[i] + y[i]
//
// Launchers run on an explicit stream and return the launch's cudaError_t;
// callers convert it with CudaStatus (cuda_status.h). Pointers must be
// 16-byte aligned for the float4 path; a scalar tail handles n % 4.
#ifndef BATON_KERNELS_CUDA_VECTOR_OPS_CUH_
#define BATON_KERNELS_CUDA_VECTOR_OPS_CUH_

#include <cstdint>

#include <cuda_runtime.h>

namespace baton::cuda {

cudaError_t LaunchFill(float* y, float value, int64_t n, cudaStream_t stream);
cudaError_t LaunchAxpy(float a, const float* x, float* y, int64_t n, cudaStream_t stream);

}  // namespace baton::cuda

#endif  // BATON_KERNELS_CUDA_VECTOR_OPS_CUH_
