// LayerNorm over the last dimension (eps 1e-5, biased variance), per row n:
//   mean = Σ x / C,  rstd = 1 / sqrt(Σ (x − mean)² / C + eps)
//   y = (x − mean) · rstd · w + b
// Backward, with x̂ = (x − mean) · rstd and g = dy · w:
//   dx += rstd · (g − mean(g) − x̂ · mean(g · x̂)),  dw += dy · x̂,  db += dy
// Rows are visited in order, so the parameter gradients are deterministic.
#ifndef BATON_KERNELS_CPU_LAYERNORM_H_
#define BATON_KERNELS_CPU_LAYERNORM_H_

#include <cstdint>

namespace baton::kernels::cpu {

inline constexpr float kLayerNormEps = 1e-5f;

// `mean` and `rstd` ([rows]) are saved for the backward pass.
void LayerNormForward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                      const float* bias, int64_t rows, int64_t channels);

// Accumulates into `dinp`, `dweight` and `dbias`.
void LayerNormBackward(float* dinp, float* dweight, float* dbias, const float* dout,
                       const float* inp, const float* weight, const float* mean, const float* rstd,
                       int64_t rows, int64_t channels);

}  // namespace baton::kernels::cpu

#endif  // BATON_KERNELS_CPU_LAYERNORM_H_
