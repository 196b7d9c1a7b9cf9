// RMSNorm over the last dimension (Llama; kernels/cpu/rmsnorm.h), per row n
// of C channels:
//   rstd = 1 / sqrt(Σ x² / C + eps),  y = (x · rstd) · w
// Backward, with x̂ = x · rstd and g = dy · w:
//   dx += rstd · (g − x̂ · mean(g · x̂))        (warp per row)
//   dw += Σ_n dy · x̂                           (column_reduce.cuh's fixed
//                                              two-pass order, as LayerNorm)
// Σ x² and Σ g·x̂ accumulate in float64 (as the CPU does) by a warp
// butterfly instead of the CPU's channel order; the mean is rounded to float
// and every other operation is the CPU's float32 operation, explicitly
// rounded (no FMA contraction). So rstd, y and dx equal the CPU's unless the
// float64 sums round to different floats (a relative 2⁻⁵³·C perturbation);
// dw differs by the order of its float32 row sums (≈1e-6 relative).
// Identical run to run.
#ifndef BATON_KERNELS_CUDA_RMSNORM_CUH_
#define BATON_KERNELS_CUDA_RMSNORM_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace baton::cuda {

// `out` is fp32 or bf16 (rounded once); rstd [rows]. `out` may be `inp`.
cudaError_t LaunchRmsNormForward(float* out, float* rstd, const float* inp, const float* weight,
                                 int64_t rows, int64_t channels, float eps, cudaStream_t stream);
cudaError_t LaunchRmsNormForward(__nv_bfloat16* out, float* rstd, const float* inp,
                                 const float* weight, int64_t rows, int64_t channels, float eps,
                                 cudaStream_t stream);

// Accumulates into dinp and dweight. `scratch` holds
// ColumnReduceScratchBytes(rows, channels, 1) bytes (plan.h).
cudaError_t LaunchRmsNormBackward(float* dinp, float* dweight, const float* dout, const float* inp,
                                  const float* weight, const float* rstd, int64_t rows,
                                  int64_t channels, float* scratch, cudaStream_t stream);

}  // namespace baton::cuda

#endif  // BATON_KERNELS_CUDA_RMSNORM_CUH_
