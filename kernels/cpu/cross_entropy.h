// Fused softmax + cross-entropy over the vocabulary, per row n:
//   loss[n] = log Σ_v exp(z[n,v]) − z[n, target[n]]
//   dz[n,v] = (softmax(z[n])[v] − [v = target[n]]) · grad_scale
// The logits are overwritten by their gradient, so a training step keeps one
// [N,V] buffer. `grad_scale` is d(total loss)/d(loss[n]), e.g. 1/N for a mean.
#ifndef BATON_KERNELS_CPU_CROSS_ENTROPY_H_
#define BATON_KERNELS_CPU_CROSS_ENTROPY_H_

#include <cstdint>

namespace baton::kernels::cpu {

// Returns Σ_n loss[n], summed in row order in double precision. Targets must
// be in [0, vocab).
double SoftmaxCrossEntropy(float* logits_to_grad, const int32_t* targets, int64_t rows,
                           int64_t vocab, float grad_scale);

// Vocabulary-parallel form: each of `shards` ranks holds the logits of vocab
// columns [vocab_begin, vocab_begin + vocab_cols).
//
// Step 1 (every rank): z ← exp(z − m) with m the row's local maximum;
// row_max[n] = m, lse[n] = m + log Σ exp(z − m) (the shard's log-sum-exp),
// target_logit[n] = z[target] if this shard holds the target, else 0.
void ShardedCrossEntropyStats(float* logits_to_exp, const int32_t* targets, int64_t rows,
                              int64_t vocab_begin, int64_t vocab_cols, float* row_max, float* lse,
                              float* target_logit);

// Between the steps the ranks all-gather `lse` into lse_all [shards, rows]
// (rank-major) and all-reduce-sum `target_logit` (one rank holds each).
//
// Step 2 (every rank, identical results): the full log-sum-exp
// L[n] = M + log Σ_r exp(lse_all[r,n] − M), M = max_r lse_all[r,n], in rank
// order and double precision; loss[n] = L[n] − target_logit[n]; the gradient
// dz = (exp_z · exp(row_max − L) − [v = target]) · grad_scale replaces exp_z.
// Returns Σ_n loss[n] in row order.
double ShardedCrossEntropyFinish(float* exp_to_grad, const int32_t* targets, int64_t rows,
                                 int64_t vocab_begin, int64_t vocab_cols, const float* row_max,
                                 const float* lse_all, int64_t shards, const float* target_logit,
                                 float grad_scale);

}  // namespace baton::kernels::cpu

#endif  // BATON_KERNELS_CPU_CROSS_ENTROPY_H_
