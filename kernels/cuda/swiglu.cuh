// SwiGLU, Llama's MLP gate (kernels/cpu/swiglu.h), elementwise over gate a
// and up u, fp32:
//   y = silu(a) · u,  silu(a) = a · σ(a),  σ(a) = 1 / (1 + e^−a)
//   da = dy · u · silu'(a),  du = dy · silu(a),
//   silu'(a) = σ(a) · (1 + a · (1 − σ(a)))
// The same float32 operations in the same order as the CPU, except e^−a:
// CUDA's expf (≤ 2 ulp) here, the CPU's polynomial FastExp (relative error
// below 3e-7) there, so results agree to ~1e-6 relative (as GELU's do).
#ifndef BATON_KERNELS_CUDA_SWIGLU_CUH_
#define BATON_KERNELS_CUDA_SWIGLU_CUH_

#include <cuda_runtime.h>

#include <cstdint>

namespace baton::cuda {

// `out` may be `gate` or `up`.
cudaError_t LaunchSwiGluForward(float* out, const float* gate, const float* up, int64_t n,
                                cudaStream_t stream);
// Overwrites dgate and dup; either may be `dout` (each element is read
// before it is written), as on the CPU.
cudaError_t LaunchSwiGluBackward(float* dgate, float* dup, const float* dout, const float* gate,
                                 const float* up, int64_t n, cudaStream_t stream);

}  // namespace baton::cuda

#endif  // BATON_KERNELS_CUDA_SWIGLU_CUH_
