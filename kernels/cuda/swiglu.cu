#include "kernels/cuda/swiglu.cuh"

#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch_math.h"

namespace baton::cuda {
namespace {

__device__ __forceinline__ float Sigmoid(float a) {
  return 1.0f / __fadd_rn(1.0f, expf(-a));  // e^−a = +inf for a < −88: σ = 0
}

// Outputs may alias inputs (the CPU allows it): nothing is __restrict__.
__global__ void SwiGluForwardKernel(float* out, const float* gate, const float* up, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const float a = gate[i];
    out[i] = __fmul_rn(__fmul_rn(a, Sigmoid(a)), up[i]);
  }
}

__global__ void SwiGluBackwardKernel(float* dgate, float* dup, const float* dout,
                                     const float* gate, const float* up, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const float a = gate[i], u = up[i], dy = dout[i];
    const float sigmoid = Sigmoid(a);
    const float silu = __fmul_rn(a, sigmoid);
    const float dsilu =
        __fmul_rn(sigmoid, __fadd_rn(1.0f, __fmul_rn(a, __fsub_rn(1.0f, sigmoid))));
    dgate[i] = __fmul_rn(__fmul_rn(dy, u), dsilu);
    dup[i] = __fmul_rn(dy, silu);
  }
}

}  // namespace

cudaError_t LaunchSwiGluForward(float* out, const float* gate, const float* up, int64_t n,
                                cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const LaunchShape s = ElementwiseLaunch(n, 1);
  SwiGluForwardKernel<<<s.blocks, s.threads, 0, stream>>>(out, gate, up, n);
  return cudaGetLastError();
}

cudaError_t LaunchSwiGluBackward(float* dgate, float* dup, const float* dout, const float* gate,
                                 const float* up, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const LaunchShape s = ElementwiseLaunch(n, 1);
  SwiGluBackwardKernel<<<s.blocks, s.threads, 0, stream>>>(dgate, dup, dout, gate, up, n);
  return cudaGetLastError();
}

}  // namespace baton::cuda
