// LayerNorm over the last dimension (eps 1e-5, biased variance), per row n
// (kernels/cpu/layernorm.h):
//   mean = Σ x / C,  rstd = 1 / sqrt(Σ (x − mean)² / C + eps)
//   y = (x − mean) · rstd · w + b
// Fused residual form (pre-LN blocks): x = a + b is written to `residual`
// and normalized in the same pass, saving one read of x.
// Backward, with x̂ = (x − mean) · rstd and g = dy · w:
//   dx += rstd · (g − mean(g) − x̂ · mean(g · x̂))        (warp per row)
//   dw += Σ_n dy · x̂,  db += Σ_n dy                       (column_reduce.cuh's
//                                                          fixed two-pass order)
// Row sums use a warp butterfly: not the CPU's sequential order, so results
// agree to rounding (≈1e-6 relative), and are identical run to run.
#ifndef BATON_KERNELS_CUDA_LAYERNORM_CUH_
#define BATON_KERNELS_CUDA_LAYERNORM_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace baton::cuda {

// `out` is fp32 or bf16 (the input of a bf16 GEMM); mean, rstd [rows].
cudaError_t LaunchLayerNormForward(float* out, float* mean, float* rstd, const float* inp,
                                   const float* weight, const float* bias, int64_t rows,
                                   int64_t channels, cudaStream_t stream);
cudaError_t LaunchLayerNormForward(__nv_bfloat16* out, float* mean, float* rstd, const float* inp,
                                   const float* weight, const float* bias, int64_t rows,
                                   int64_t channels, cudaStream_t stream);

// residual = a + b (may alias a), then LayerNorm(residual) into `out`.
cudaError_t LaunchResidualLayerNormForward(float* residual, float* out, float* mean, float* rstd,
                                           const float* a, const float* b, const float* weight,
                                           const float* bias, int64_t rows, int64_t channels,
                                           cudaStream_t stream);
cudaError_t LaunchResidualLayerNormForward(float* residual, __nv_bfloat16* out, float* mean,
                                           float* rstd, const float* a, const float* b,
                                           const float* weight, const float* bias, int64_t rows,
                                           int64_t channels, cudaStream_t stream);

// Accumulates into dinp, dweight, dbias. `scratch` holds
// ColumnReduceScratchBytes(rows, channels, 2) bytes.
cudaError_t LaunchLayerNormBackward(float* dinp, float* dweight, float* dbias, const float* dout,
                                    const float* inp, const float* weight, const float* mean,
                                    const float* rstd, int64_t rows, int64_t channels,
                                    float* scratch, cudaStream_t stream);

}  // namespace baton::cuda

#endif  // BATON_KERNELS_CUDA_LAYERNORM_CUH_
