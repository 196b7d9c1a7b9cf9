#include "kernels/cpu/cross_entropy.h"

#include <cmath>

namespace baton::kernels::cpu {

double SoftmaxCrossEntropy(float* logits_to_grad, const int32_t* targets, int64_t rows,
                           int64_t vocab, float grad_scale) {
  double total = 0.0;
  for (int64_t n = 0; n < rows; ++n) {
    float* z = logits_to_grad + n * vocab;
    float max = z[0];
    for (int64_t v = 1; v < vocab; ++v) max = z[v] > max ? z[v] : max;
    float sum = 0.0f;
    for (int64_t v = 0; v < vocab; ++v) {
      z[v] = std::exp(z[v] - max);
      sum += z[v];
    }
    const int32_t target = targets[n];
    // loss = log(sum) + max − z[target] = −log(exp(z[target] − max) / sum).
    total += -std::log(static_cast<double>(z[target]) / static_cast<double>(sum));
    const float inv = grad_scale / sum;
    for (int64_t v = 0; v < vocab; ++v) z[v] *= inv;
    z[target] -= grad_scale;
  }
  return total;
}

}  // namespace baton::kernels::cpu
