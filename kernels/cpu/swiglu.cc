#include "kernels/cpu/swiglu.h"

#include "kernels/cpu/fast_math.h"

namespace baton::kernels::cpu {

BATON_ELEMENTWISE void SwiGluForward(float* out, const float* gate, const float* up, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float a = gate[i];
    const float sigmoid = 1.0f / (1.0f + FastExp(-a));
    out[i] = a * sigmoid * up[i];
  }
}

BATON_ELEMENTWISE void SwiGluBackward(float* dgate, float* dup, const float* dout,
                                      const float* gate, const float* up, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float a = gate[i], u = up[i], dy = dout[i];
    const float sigmoid = 1.0f / (1.0f + FastExp(-a));
    const float silu = a * sigmoid;
    const float dsilu = sigmoid * (1.0f + a * (1.0f - sigmoid));
    dgate[i] = dy * u * dsilu;
    dup[i] = dy * silu;
  }
}

}  // namespace baton::kernels::cpu
