#include "kernels/cpu/adamw.h"

#include <cmath>

#include "kernels/cpu/fast_math.h"

namespace baton::kernels::cpu {

BATON_ELEMENTWISE void AdamWUpdate(float* param, const float* grad, float* m, float* v, int64_t n,
                                   const AdamWConfig& config, int64_t step, float grad_scale) {
  const float b1 = config.beta1;
  const float b2 = config.beta2;
  const float correction1 = 1.0f - static_cast<float>(std::pow(b1, static_cast<double>(step)));
  const float correction2 = 1.0f - static_cast<float>(std::pow(b2, static_cast<double>(step)));
  const float decay = 1.0f - config.lr * config.weight_decay;
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i] * grad_scale;
    m[i] = b1 * m[i] + (1.0f - b1) * g;
    v[i] = b2 * v[i] + (1.0f - b2) * g * g;
    const float m_hat = m[i] / correction1;
    const float v_hat = v[i] / correction2;
    param[i] = param[i] * decay - config.lr * m_hat / (std::sqrt(v_hat) + config.eps);
  }
}

}  // namespace baton::kernels::cpu
