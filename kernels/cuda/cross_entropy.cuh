// Fused softmax + cross-entropy over the vocabulary (kernels/cpu/cross_entropy.h),
// block per row n:
//   loss[n] = log Σ_v exp(z[n,v] − max) − (z[n,target] − max)      (in double)
//   dz[n,v] = (softmax(z[n])[v] − [v = target]) · grad_scale        (in place)
// Rows whose target is kIgnoreTarget (−1) get no loss and a zero gradient.
// Per-row losses go to `row_loss` [rows] (double, 0 for ignored rows); their
// sum in a fixed order (one block, fixed tree) is ADDED to `loss_sum` [1]
// (when not null), so a step accumulates its loss on the device and the host
// fetches one double per step.
//
// Vocabulary-parallel form, around an all-gather of lse and an all-reduce of
// target_logit between the two steps (see the CPU header for the algebra):
//   Stats:  z ← exp(z − m), row_max = m, lse = m + log Σ, target_logit = z[t]
//           (0 where this shard does not hold the target)
//   Finish: L = M + log Σ_r exp(lse_all[r] − M) (double, rank order),
//           loss = L − target_logit, dz = (exp_z · exp(row_max − L) − [v = t]) · s
// Argmax: per row the largest logit and the first column holding it (ties →
// lowest index, as the CPU), and the count of scored rows whose overall first
// maximum is the target.
#ifndef BATON_KERNELS_CUDA_CROSS_ENTROPY_CUH_
#define BATON_KERNELS_CUDA_CROSS_ENTROPY_CUH_

#include <cuda_runtime.h>

#include <cstdint>

namespace baton::cuda {

// Targets must be in [0, vocab) or −1 (the caller checks them on the host
// when the batch is built; an out-of-range target here is treated as ignored).
cudaError_t LaunchSoftmaxCrossEntropy(float* logits_to_grad, const int32_t* targets, int64_t rows,
                                      int64_t vocab, float grad_scale, double* row_loss,
                                      double* loss_sum, cudaStream_t stream);

cudaError_t LaunchShardedCrossEntropyStats(float* logits_to_exp, const int32_t* targets,
                                           int64_t rows, int64_t vocab_begin, int64_t vocab_cols,
                                           float* row_max, float* lse, float* target_logit,
                                           cudaStream_t stream);

cudaError_t LaunchShardedCrossEntropyFinish(float* exp_to_grad, const int32_t* targets,
                                            int64_t rows, int64_t vocab_begin, int64_t vocab_cols,
                                            const float* row_max, const float* lse_all,
                                            int64_t shards, const float* target_logit,
                                            float grad_scale, double* row_loss, double* loss_sum,
                                            cudaStream_t stream);

cudaError_t LaunchShardArgmax(const float* logits, int64_t rows, int64_t cols, int64_t col_begin,
                              float* max, float* index, cudaStream_t stream);

// hits[0] += number of scored rows whose first maximum over shards is the target.
cudaError_t LaunchCountArgmaxHits(const float* max_all, const float* index_all, int64_t shards,
                                  const int32_t* targets, int64_t rows, int64_t* hits,
                                  cudaStream_t stream);

}  // namespace baton::cuda

#endif  // BATON_KERNELS_CUDA_CROSS_ENTROPY_CUH_
