#include "kernels/cpu/cross_entropy.h"

#include <cmath>

#include "kernels/cpu/fast_math.h"

namespace baton::kernels::cpu {
namespace {

// z = exp(z − max) (vectorizable), returning Σ z in index order.
BATON_ELEMENTWISE float ExpShifted(float* z, int64_t n, float max) {
  for (int64_t v = 0; v < n; ++v) z[v] = FastExp(z[v] - max);
  float sum = 0.0f;
  for (int64_t v = 0; v < n; ++v) sum += z[v];
  return sum;
}

}  // namespace

double SoftmaxCrossEntropy(float* logits_to_grad, const int32_t* targets, int64_t rows,
                           int64_t vocab, float grad_scale) {
  double total = 0.0;
  for (int64_t n = 0; n < rows; ++n) {
    float* z = logits_to_grad + n * vocab;
    float max = z[0];
    for (int64_t v = 1; v < vocab; ++v) max = z[v] > max ? z[v] : max;
    const int32_t target = targets[n];
    // loss = log Σ exp(z − max) − (z[target] − max), from the logit itself so
    // that a target far below the maximum keeps its exact loss.
    const float shifted_target = z[target] - max;
    const float sum = ExpShifted(z, vocab, max);
    total += std::log(static_cast<double>(sum)) - static_cast<double>(shifted_target);
    const float inv = grad_scale / sum;
    for (int64_t v = 0; v < vocab; ++v) z[v] *= inv;
    z[target] -= grad_scale;
  }
  return total;
}

}  // namespace baton::kernels::cpu
