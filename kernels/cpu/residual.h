// Residual connection: y = a + b; backward da += dy, db += dy.
#ifndef BATON_KERNELS_CPU_RESIDUAL_H_
#define BATON_KERNELS_CPU_RESIDUAL_H_

#include <cstdint>

namespace baton::kernels::cpu {

void ResidualForward(float* out, const float* a, const float* b, int64_t n);

// Either gradient pointer may be null.
void ResidualBackward(float* da, float* db, const float* dout, int64_t n);

}  // namespace baton::kernels::cpu

#endif  // BATON_KERNELS_CPU_RESIDUAL_H_
