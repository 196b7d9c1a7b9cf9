// SwiGLU (Llama's MLP gate), elementwise over gate a and up u:
//   y = silu(a) · u,  silu(a) = a · σ(a),  σ(a) = 1 / (1 + e^−a)
//   da = dy · u · silu'(a),  du = dy · silu(a),
//   silu'(a) = σ(a) · (1 + a · (1 − σ(a)))
// e^−a is FastExp (kernels/cpu/fast_math.h, relative error below 3e-7), so
// the loops vectorize as GELU's do.
#ifndef BATON_KERNELS_CPU_SWIGLU_H_
#define BATON_KERNELS_CPU_SWIGLU_H_

#include <cstdint>

namespace baton::kernels::cpu {

void SwiGluForward(float* out, const float* gate, const float* up, int64_t n);

// Writes (overwrites) dgate and dup. Each element is read before it is
// written, so dgate or dup may be dout itself.
void SwiGluBackward(float* dgate, float* dup, const float* dout, const float* gate, const float* up,
                    int64_t n);

}  // namespace baton::kernels::cpu

#endif  // BATON_KERNELS_CPU_SWIGLU_H_
