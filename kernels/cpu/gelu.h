// GELU, tanh form (GPT-2's):
//   y = ½ x (1 + tanh u),  u = √(2/π) (x + 0.044715 x³)
//   dy/dx = ½ (1 + tanh u) + ½ x (1 − tanh² u) √(2/π) (1 + 3·0.044715 x²)
#ifndef BATON_KERNELS_CPU_GELU_H_
#define BATON_KERNELS_CPU_GELU_H_

#include <cstdint>

namespace baton::kernels::cpu {

void GeluForward(float* out, const float* inp, int64_t n);

// Writes dinp = dout · GELU'(inp).
void GeluBackward(float* dinp, const float* inp, const float* dout, int64_t n);

}  // namespace baton::kernels::cpu

#endif  // BATON_KERNELS_CPU_GELU_H_
