// Elementwise kernels of the model, fp32 (kernels/cpu/gelu.h, residual.h,
// matmul.h AddBias, grad_norm.h Scale):
//   GELU (tanh form): y = ½ x (1 + tanh u),  u = √(2/π) (x + 0.044715 x³)
//     dx = dy · (½ (1 + tanh u) + ½ x (1 − tanh² u) √(2/π) (1 + 3·0.044715 x²))
//   residual: y = a + b;  backward da += dy, db += dy (either may be null)
//   add bias: y[n,o] += bias[o]
//   scale:    x[i] *= factor
// The CPU uses a polynomial tanh (fast_math.h, |error| < 3e-7) and the GPU
// tanhf, so GELU agrees to ~1e-6 absolute; the others are bitwise equal.
#ifndef BATON_KERNELS_CUDA_ELEMENTWISE_CUH_
#define BATON_KERNELS_CUDA_ELEMENTWISE_CUH_

#include <cuda_runtime.h>

#include <cstdint>

namespace baton::cuda {

cudaError_t LaunchGeluForward(float* out, const float* inp, int64_t n, cudaStream_t stream);
// `dinp` may be `dout` (in place, as worker/model/gpt_stage.cc calls it).
cudaError_t LaunchGeluBackward(float* dinp, const float* inp, const float* dout, int64_t n,
                               cudaStream_t stream);
cudaError_t LaunchResidualForward(float* out, const float* a, const float* b, int64_t n,
                                  cudaStream_t stream);
cudaError_t LaunchResidualBackward(float* da, float* db, const float* dout, int64_t n,
                                   cudaStream_t stream);
cudaError_t LaunchAddBias(float* out, const float* bias, int64_t rows, int64_t cols,
                          cudaStream_t stream);
cudaError_t LaunchScale(float* x, int64_t n, float factor, cudaStream_t stream);

}  // namespace baton::cuda

#endif  // BATON_KERNELS_CUDA_ELEMENTWISE_CUH_
