#include "kernels/cuda/grad_norm.cuh"

#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch_math.h"

namespace baton::cuda {
namespace {

__global__ void PartialKernel(const float* __restrict__ x, int64_t n, double* __restrict__ partial) {
  __shared__ double shared[32];
  double acc = 0.0;
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const double v = x[i];
    acc += v * v;
  }
  acc = BlockSum(acc, shared);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

__global__ void FinishKernel(const double* __restrict__ partial, double* __restrict__ out,
                             bool accumulate) {
  __shared__ double shared[32];
  double acc = 0.0;
  for (int b = threadIdx.x; b < kNormBlocks; b += blockDim.x) acc += partial[b];
  acc = BlockSum(acc, shared);
  if (threadIdx.x == 0) *out = accumulate ? *out + acc : acc;
}

}  // namespace

cudaError_t LaunchSumOfSquares(const float* x, int64_t n, double* partial, double* out,
                               bool accumulate, cudaStream_t stream) {
  if (n < 0) return cudaErrorInvalidValue;
  PartialKernel<<<kNormBlocks, kThreadsPerBlock, 0, stream>>>(x, n, partial);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  FinishKernel<<<1, kThreadsPerBlock, 0, stream>>>(partial, out, accumulate);
  return cudaGetLastError();
}

}  // namespace baton::cuda
