// Global gradient norm, in pieces: each rank sums the squares of the
// gradients it owns (SumOfSquares, double precision, in index order), the
// coordinator adds the pieces and picks a clip factor (ClipFactor), and every
// rank scales its gradients by it (Scale, or AdamW's grad_scale).
#ifndef BATON_KERNELS_CPU_GRAD_NORM_H_
#define BATON_KERNELS_CPU_GRAD_NORM_H_

#include <cstdint>

namespace baton::kernels::cpu {

double SumOfSquares(const float* x, int64_t n);

// min(1, max_norm / (norm + 1e-6)); 1 when max_norm <= 0 (clipping off).
float ClipFactor(double global_sq_norm, double max_norm);

void Scale(float* x, int64_t n, float factor);

}  // namespace baton::kernels::cpu

#endif  // BATON_KERNELS_CPU_GRAD_NORM_H_
