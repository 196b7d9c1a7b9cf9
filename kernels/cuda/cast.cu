#include "kernels/cuda/cast.cuh"

#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch_math.h"

namespace baton::cuda {
namespace {

template <typename Tout, typename Tin>
__global__ void CastKernel(Tout* __restrict__ y, const Tin* __restrict__ x, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) y[i] = FromFloat<Tout>(ToFloat(x[i]));
}

template <typename Tout, typename Tin>
cudaError_t Launch(Tout* y, const Tin* x, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const LaunchShape s = ElementwiseLaunch(n, 1);
  CastKernel<<<s.blocks, s.threads, 0, stream>>>(y, x, n);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchCastF32ToBf16(__nv_bfloat16* y, const float* x, int64_t n, cudaStream_t stream) {
  return Launch(y, x, n, stream);
}

cudaError_t LaunchCastBf16ToF32(float* y, const __nv_bfloat16* x, int64_t n, cudaStream_t stream) {
  return Launch(y, x, n, stream);
}

}  // namespace baton::cuda
