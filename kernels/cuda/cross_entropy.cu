#include "kernels/cuda/cross_entropy.cuh"

#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch_math.h"

namespace baton::cuda {
namespace {

__global__ void CrossEntropyKernel(float* __restrict__ z_all, const int32_t* __restrict__ targets,
                                   int64_t rows, int64_t V, float grad_scale,
                                   double* __restrict__ row_loss) {
  __shared__ float shared[32];
  for (int64_t n = blockIdx.x; n < rows; n += gridDim.x) {
    float* z = z_all + n * V;
    const int32_t t = targets[n];
    if (t < 0 || t >= V) {
      for (int64_t v = threadIdx.x; v < V; v += blockDim.x) z[v] = 0.0f;
      if (threadIdx.x == 0) row_loss[n] = 0.0;
      continue;
    }
    const float target_logit = z[t];  // read before any thread overwrites it
    float max = -INFINITY;
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) max = fmaxf(max, z[v]);
    max = BlockMax(max, shared);
    float sum = 0.0f;
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
      const float e = expf(z[v] - max);
      z[v] = e;
      sum += e;
    }
    sum = BlockSum(sum, shared);
    const float inv = grad_scale / sum;
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
      z[v] = z[v] * inv - (v == t ? grad_scale : 0.0f);
    }
    if (threadIdx.x == 0) {
      row_loss[n] = log(static_cast<double>(sum)) - static_cast<double>(target_logit - max);
    }
  }
}

// One block: loss_sum[0] += Σ row_loss in a fixed order.
__global__ void SumLossKernel(const double* __restrict__ row_loss, int64_t rows,
                              double* __restrict__ loss_sum) {
  __shared__ double shared[32];
  double acc = 0.0;
  for (int64_t n = threadIdx.x; n < rows; n += blockDim.x) acc += row_loss[n];
  acc = BlockSum(acc, shared);
  if (threadIdx.x == 0) *loss_sum += acc;
}

__global__ void ShardedStatsKernel(float* __restrict__ z_all, const int32_t* __restrict__ targets,
                                   int64_t rows, int64_t vocab_begin, int64_t cols,
                                   float* __restrict__ row_max, float* __restrict__ lse,
                                   float* __restrict__ target_logit) {
  __shared__ float shared[32];
  for (int64_t n = blockIdx.x; n < rows; n += gridDim.x) {
    float* z = z_all + n * cols;
    const int64_t col = static_cast<int64_t>(targets[n]) - vocab_begin;
    const float tl = col >= 0 && col < cols ? z[col] : 0.0f;
    float max = -INFINITY;
    for (int64_t v = threadIdx.x; v < cols; v += blockDim.x) max = fmaxf(max, z[v]);
    max = BlockMax(max, shared);
    float sum = 0.0f;
    for (int64_t v = threadIdx.x; v < cols; v += blockDim.x) {
      const float e = expf(z[v] - max);
      z[v] = e;
      sum += e;
    }
    sum = BlockSum(sum, shared);
    if (threadIdx.x == 0) {
      target_logit[n] = tl;
      row_max[n] = max;
      lse[n] = max + logf(sum);
    }
  }
}

__global__ void ShardedFinishKernel(float* __restrict__ z_all, const int32_t* __restrict__ targets,
                                    int64_t rows, int64_t vocab_begin, int64_t cols,
                                    const float* __restrict__ row_max,
                                    const float* __restrict__ lse_all, int64_t shards,
                                    const float* __restrict__ target_logit, float grad_scale,
                                    double* __restrict__ row_loss) {
  for (int64_t n = blockIdx.x; n < rows; n += gridDim.x) {
    float* z = z_all + n * cols;
    if (targets[n] < 0) {
      for (int64_t v = threadIdx.x; v < cols; v += blockDim.x) z[v] = 0.0f;
      if (threadIdx.x == 0) row_loss[n] = 0.0;
      continue;
    }
    // Every thread computes the (short, rank-ordered) log-sum-exp itself.
    double m = lse_all[n];
    for (int64_t r = 1; r < shards; ++r) m = fmax(m, static_cast<double>(lse_all[r * rows + n]));
    double s = 0.0;
    for (int64_t r = 0; r < shards; ++r) s += exp(lse_all[r * rows + n] - m);
    const double L = m + log(s);
    const float factor = static_cast<float>(exp(row_max[n] - L)) * grad_scale;
    const int64_t col = static_cast<int64_t>(targets[n]) - vocab_begin;
    for (int64_t v = threadIdx.x; v < cols; v += blockDim.x) {
      z[v] = z[v] * factor - (v == col ? grad_scale : 0.0f);
    }
    if (threadIdx.x == 0) row_loss[n] = L - target_logit[n];
  }
}

__global__ void ArgmaxKernel(const float* __restrict__ z_all, int64_t rows, int64_t cols,
                             int64_t col_begin, float* __restrict__ max_out,
                             float* __restrict__ index_out) {
  __shared__ float s_val[kThreadsPerBlock];
  __shared__ int64_t s_idx[kThreadsPerBlock];
  for (int64_t n = blockIdx.x; n < rows; n += gridDim.x) {
    const float* z = z_all + n * cols;
    float best = -INFINITY;
    int64_t best_idx = cols;  // no column yet
    for (int64_t v = threadIdx.x; v < cols; v += blockDim.x) {
      if (z[v] > best || best_idx == cols) {
        best = z[v];
        best_idx = v;
      }
    }
    s_val[threadIdx.x] = best;
    s_idx[threadIdx.x] = best_idx;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
      if (threadIdx.x < stride) {
        const float ov = s_val[threadIdx.x + stride];
        const int64_t oi = s_idx[threadIdx.x + stride];
        const float mv = s_val[threadIdx.x];
        const int64_t mi = s_idx[threadIdx.x];
        if (oi != cols && (mi == cols || ov > mv || (ov == mv && oi < mi))) {
          s_val[threadIdx.x] = ov;
          s_idx[threadIdx.x] = oi;
        }
      }
      __syncthreads();
    }
    if (threadIdx.x == 0) {
      max_out[n] = s_val[0];
      index_out[n] = static_cast<float>(col_begin + s_idx[0]);
    }
    __syncthreads();
  }
}

__global__ void CountHitsKernel(const float* __restrict__ max_all,
                                const float* __restrict__ index_all, int64_t shards,
                                const int32_t* __restrict__ targets, int64_t rows,
                                int64_t* __restrict__ hits) {
  __shared__ long long shared[32];
  long long count = 0;
  for (int64_t n = threadIdx.x; n < rows; n += blockDim.x) {
    if (targets[n] < 0) continue;
    int64_t best = 0;
    for (int64_t r = 1; r < shards; ++r) {
      if (max_all[r * rows + n] > max_all[best * rows + n]) best = r;
    }
    if (index_all[best * rows + n] == static_cast<float>(targets[n])) ++count;
  }
  count = BlockSum(count, shared);
  if (threadIdx.x == 0) *hits += count;
}

}  // namespace

cudaError_t LaunchSoftmaxCrossEntropy(float* logits_to_grad, const int32_t* targets, int64_t rows,
                                      int64_t vocab, float grad_scale, double* row_loss,
                                      double* loss_sum, cudaStream_t stream) {
  if (rows <= 0 || vocab <= 0) return cudaSuccess;
  const LaunchShape s = BlockPerRowLaunch(rows);
  CrossEntropyKernel<<<s.blocks, s.threads, 0, stream>>>(logits_to_grad, targets, rows, vocab,
                                                         grad_scale, row_loss);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || loss_sum == nullptr) return err;
  SumLossKernel<<<1, kThreadsPerBlock, 0, stream>>>(row_loss, rows, loss_sum);
  return cudaGetLastError();
}

cudaError_t LaunchShardedCrossEntropyStats(float* logits_to_exp, const int32_t* targets,
                                           int64_t rows, int64_t vocab_begin, int64_t vocab_cols,
                                           float* row_max, float* lse, float* target_logit,
                                           cudaStream_t stream) {
  if (rows <= 0 || vocab_cols <= 0) return cudaSuccess;
  const LaunchShape s = BlockPerRowLaunch(rows);
  ShardedStatsKernel<<<s.blocks, s.threads, 0, stream>>>(logits_to_exp, targets, rows, vocab_begin,
                                                         vocab_cols, row_max, lse, target_logit);
  return cudaGetLastError();
}

cudaError_t LaunchShardedCrossEntropyFinish(float* exp_to_grad, const int32_t* targets,
                                            int64_t rows, int64_t vocab_begin, int64_t vocab_cols,
                                            const float* row_max, const float* lse_all,
                                            int64_t shards, const float* target_logit,
                                            float grad_scale, double* row_loss, double* loss_sum,
                                            cudaStream_t stream) {
  if (rows <= 0 || vocab_cols <= 0) return cudaSuccess;
  if (shards <= 0) return cudaErrorInvalidValue;
  const LaunchShape s = BlockPerRowLaunch(rows);
  ShardedFinishKernel<<<s.blocks, s.threads, 0, stream>>>(exp_to_grad, targets, rows, vocab_begin,
                                                          vocab_cols, row_max, lse_all, shards,
                                                          target_logit, grad_scale, row_loss);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || loss_sum == nullptr) return err;
  SumLossKernel<<<1, kThreadsPerBlock, 0, stream>>>(row_loss, rows, loss_sum);
  return cudaGetLastError();
}

cudaError_t LaunchShardArgmax(const float* logits, int64_t rows, int64_t cols, int64_t col_begin,
                              float* max, float* index, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  const LaunchShape s = BlockPerRowLaunch(rows);
  ArgmaxKernel<<<s.blocks, s.threads, 0, stream>>>(logits, rows, cols, col_begin, max, index);
  return cudaGetLastError();
}

cudaError_t LaunchCountArgmaxHits(const float* max_all, const float* index_all, int64_t shards,
                                  const int32_t* targets, int64_t rows, int64_t* hits,
                                  cudaStream_t stream) {
  if (shards <= 0) return cudaErrorInvalidValue;
  CountHitsKernel<<<1, kThreadsPerBlock, 0, stream>>>(max_all, index_all, shards, targets, rows,
                                                       hits);
  return cudaGetLastError();
}

}  // namespace baton::cuda
