// Fused softmax + cross-entropy over the vocabulary, per row n:
//   loss[n] = log Σ_v exp(z[n,v]) − z[n, target[n]]
//   dz[n,v] = (softmax(z[n])[v] − [v = target[n]]) · grad_scale
// The logits are overwritten by their gradient, so a training step keeps one
// [N,V] buffer. `grad_scale` is d(total loss)/d(loss[n]), e.g. 1/N for a mean.
// A row whose target is kIgnoreTarget is not scored: no loss, zero gradient.
#ifndef BATON_KERNELS_CPU_CROSS_ENTROPY_H_
#define BATON_KERNELS_CPU_CROSS_ENTROPY_H_

#include <cstdint>

namespace baton::kernels::cpu {

// The target of a position that is not scored (padding, prompt tokens).
inline constexpr int32_t kIgnoreTarget = -1;

// Returns Σ_n loss[n] over scored rows, summed in row order in double
// precision. Targets must be in [0, vocab) or kIgnoreTarget.
double SoftmaxCrossEntropy(float* logits_to_grad, const int32_t* targets, int64_t rows,
                           int64_t vocab, float grad_scale);

// Vocabulary-parallel form: each of `shards` ranks holds the logits of vocab
// columns [vocab_begin, vocab_begin + vocab_cols).
//
// Step 1 (every rank): z ← exp(z − m) with m the row's local maximum;
// row_max[n] = m, lse[n] = m + log Σ exp(z − m) (the shard's log-sum-exp),
// target_logit[n] = z[target] if this shard holds the target, else 0 (also
// for an ignored target).
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
// Returns Σ_n loss[n] over scored rows in row order; ignored rows get a zero
// gradient.
double ShardedCrossEntropyFinish(float* exp_to_grad, const int32_t* targets, int64_t rows,
                                 int64_t vocab_begin, int64_t vocab_cols, const float* row_max,
                                 const float* lse_all, int64_t shards, const float* target_logit,
                                 float grad_scale);

// Accuracy: a scored row is a hit when its first (lowest-index) maximum logit
// is the target. With the vocabulary split over shards, each shard reports
// per row its largest logit and the vocabulary index of its first occurrence
// (as a float: exact since vocab ≤ kMaxArgmaxVocab); the row's first maximum
// is that of the lowest shard holding the overall largest value.
inline constexpr int64_t kMaxArgmaxVocab = int64_t{1} << 24;

// Per row of logits [rows, cols] holding vocabulary columns from col_begin:
// max[n] = the largest logit, index[n] = col_begin + its first column. Run
// before the cross-entropy, which overwrites the logits.
void ShardArgmax(const float* logits, int64_t rows, int64_t cols, int64_t col_begin, float* max,
                 float* index);

// Counts scored rows whose first maximum over all shards is the target, from
// every shard's max and index, rank-major [shards, rows].
int64_t CountArgmaxHits(const float* max_all, const float* index_all, int64_t shards,
                        const int32_t* targets, int64_t rows);

}  // namespace baton::kernels::cpu

#endif  // BATON_KERNELS_CPU_CROSS_ENTROPY_H_
