#include "kernels/cpu/cross_entropy.h"

#include <algorithm>
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
    const int32_t target = targets[n];
    if (target == kIgnoreTarget) {
      std::fill(z, z + vocab, 0.0f);
      continue;
    }
    float max = z[0];
    for (int64_t v = 1; v < vocab; ++v) max = z[v] > max ? z[v] : max;
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

void ShardedCrossEntropyStats(float* logits_to_exp, const int32_t* targets, int64_t rows,
                              int64_t vocab_begin, int64_t vocab_cols, float* row_max, float* lse,
                              float* target_logit) {
  for (int64_t n = 0; n < rows; ++n) {
    float* z = logits_to_exp + n * vocab_cols;
    const int64_t col = targets[n] - vocab_begin;
    target_logit[n] = col >= 0 && col < vocab_cols ? z[col] : 0.0f;
    float max = z[0];
    for (int64_t v = 1; v < vocab_cols; ++v) max = z[v] > max ? z[v] : max;
    const float sum = ExpShifted(z, vocab_cols, max);
    row_max[n] = max;
    lse[n] = max + std::log(sum);
  }
}

double ShardedCrossEntropyFinish(float* exp_to_grad, const int32_t* targets, int64_t rows,
                                 int64_t vocab_begin, int64_t vocab_cols, const float* row_max,
                                 const float* lse_all, int64_t shards, const float* target_logit,
                                 float grad_scale) {
  double total = 0.0;
  for (int64_t n = 0; n < rows; ++n) {
    float* z = exp_to_grad + n * vocab_cols;
    if (targets[n] == kIgnoreTarget) {
      std::fill(z, z + vocab_cols, 0.0f);
      continue;
    }
    double max = lse_all[n];
    for (int64_t r = 1; r < shards; ++r) max = std::max(max, double{lse_all[r * rows + n]});
    double sum = 0.0;
    for (int64_t r = 0; r < shards; ++r) sum += std::exp(lse_all[r * rows + n] - max);
    const double lse = max + std::log(sum);
    total += lse - target_logit[n];
    const float factor = static_cast<float>(std::exp(row_max[n] - lse)) * grad_scale;
    for (int64_t v = 0; v < vocab_cols; ++v) z[v] *= factor;
    const int64_t col = targets[n] - vocab_begin;
    if (col >= 0 && col < vocab_cols) z[col] -= grad_scale;
  }
  return total;
}

void ShardArgmax(const float* logits, int64_t rows, int64_t cols, int64_t col_begin, float* max,
                 float* index) {
  for (int64_t n = 0; n < rows; ++n) {
    const float* z = logits + n * cols;
    int64_t best = 0;
    for (int64_t v = 1; v < cols; ++v) {
      if (z[v] > z[best]) best = v;
    }
    max[n] = z[best];
    index[n] = static_cast<float>(col_begin + best);
  }
}

int64_t CountArgmaxHits(const float* max_all, const float* index_all, int64_t shards,
                        const int32_t* targets, int64_t rows) {
  int64_t hits = 0;
  for (int64_t n = 0; n < rows; ++n) {
    if (targets[n] == kIgnoreTarget) continue;
    int64_t best = 0;  // the lowest shard holding the largest value
    for (int64_t r = 1; r < shards; ++r) {
      if (max_all[r * rows + n] > max_all[best * rows + n]) best = r;
    }
    if (index_all[best * rows + n] == static_cast<float>(targets[n])) ++hits;
  }
  return hits;
}

}  // namespace baton::kernels::cpu
