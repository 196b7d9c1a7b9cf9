// AdamW (decoupled weight decay, bias-corrected moments), PyTorch's update:
//   g = grad · grad_scale            (grad_scale carries gradient clipping)
//   m = β1 m + (1 − β1) g,  v = β2 v + (1 − β2) g²
//   p = p · (1 − lr · wd) − lr · (m / (1 − β1ᵗ)) / (√(v / (1 − β2ᵗ)) + eps)
#ifndef BATON_KERNELS_CPU_ADAMW_H_
#define BATON_KERNELS_CPU_ADAMW_H_

#include <cstdint>

namespace baton::kernels::cpu {

struct AdamWConfig {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
};

// `step` counts from 1.
void AdamWUpdate(float* param, const float* grad, float* m, float* v, int64_t n,
                 const AdamWConfig& config, int64_t step, float grad_scale);

}  // namespace baton::kernels::cpu

#endif  // BATON_KERNELS_CPU_ADAMW_H_
