// RMSNorm over the last dimension (Hugging Face's LlamaRMSNorm, in fp32),
// per row n of C channels:
//   rstd = 1 / sqrt(Σ x² / C + eps),  y = (x · rstd) · w
// Σ x² accumulates in float64 in channel order; the mean, the rsqrt and
// every product are float32 (torch.rsqrt of the float32 mean).
// Backward, with x̂ = x · rstd and g = dy · w:
//   dx += rstd · (g − x̂ · mean(g · x̂)),  dw += Σ_rows dy · x̂
// mean(g · x̂) accumulates in float64 in channel order; rows are visited in
// order, so dw is deterministic.
#ifndef BATON_KERNELS_CPU_RMSNORM_H_
#define BATON_KERNELS_CPU_RMSNORM_H_

#include <cstdint>

namespace baton::kernels::cpu {

// `rstd` ([rows]) is saved for the backward pass.
void RmsNormForward(float* out, float* rstd, const float* inp, const float* weight, int64_t rows,
                    int64_t channels, float eps);

// Accumulates into `dinp` and `dweight`.
void RmsNormBackward(float* dinp, float* dweight, const float* dout, const float* inp,
                     const float* weight, const float* rstd, int64_t rows, int64_t channels);

}  // namespace baton::kernels::cpu

#endif  // BATON_KERNELS_CPU_RMSNORM_H_
