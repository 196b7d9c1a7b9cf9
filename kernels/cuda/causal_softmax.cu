#include "kernels/cuda/causal_softmax.cuh"

#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch_math.h"

namespace baton::cuda {
namespace {

template <typename Tp>
__global__ void SoftmaxForwardKernel(Tp* probs, const float* scores, int64_t rows, int64_t T) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = GlobalThread() / 32; r < rows; r += warps) {
    const int64_t i = r % T;  // valid columns: 0..i
    const float* s = scores + r * T;
    Tp* p = probs + r * T;
    float max = -INFINITY;
    for (int64_t j = lane; j <= i; j += 32) max = fmaxf(max, s[j]);
    max = WarpMax(max);
    float sum = 0.0f;
    for (int64_t j = lane; j <= i; j += 32) sum += expf(s[j] - max);
    const float inv = 1.0f / WarpSum(sum);
    for (int64_t j = lane; j < T; j += 32) {
      p[j] = FromFloat<Tp>(j <= i ? expf(s[j] - max) * inv : 0.0f);
    }
  }
}

template <typename Tds, typename Tp>
__global__ void SoftmaxBackwardKernel(Tds* dscores, const float* dprobs, const Tp* probs,
                                      int64_t rows, int64_t T, float scale) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = GlobalThread() / 32; r < rows; r += warps) {
    const int64_t i = r % T;
    const float* dp = dprobs + r * T;
    const Tp* p = probs + r * T;
    Tds* ds = dscores + r * T;
    float dot = 0.0f;
    for (int64_t j = lane; j <= i; j += 32) dot += ToFloat(p[j]) * dp[j];
    dot = WarpSum(dot);
    for (int64_t j = lane; j < T; j += 32) {
      ds[j] = FromFloat<Tds>(j <= i ? ToFloat(p[j]) * (dp[j] - dot) * scale : 0.0f);
    }
  }
}

template <typename Tp>
cudaError_t Forward(Tp* probs, const float* scores, int64_t rows, int64_t seq,
                    cudaStream_t stream) {
  if (rows <= 0 || seq <= 0) return cudaSuccess;
  const LaunchShape s = WarpPerRowLaunch(rows);
  SoftmaxForwardKernel<Tp><<<s.blocks, s.threads, 0, stream>>>(probs, scores, rows, seq);
  return cudaGetLastError();
}

template <typename Tds, typename Tp>
cudaError_t Backward(Tds* dscores, const float* dprobs, const Tp* probs, int64_t rows,
                     int64_t seq, float scale, cudaStream_t stream) {
  if (rows <= 0 || seq <= 0) return cudaSuccess;
  const LaunchShape s = WarpPerRowLaunch(rows);
  SoftmaxBackwardKernel<Tds, Tp>
      <<<s.blocks, s.threads, 0, stream>>>(dscores, dprobs, probs, rows, seq, scale);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchCausalSoftmaxForward(float* probs, const float* scores, int64_t rows,
                                       int64_t seq, cudaStream_t stream) {
  return Forward(probs, scores, rows, seq, stream);
}
cudaError_t LaunchCausalSoftmaxForward(__nv_bfloat16* probs, const float* scores, int64_t rows,
                                       int64_t seq, cudaStream_t stream) {
  return Forward(probs, scores, rows, seq, stream);
}
cudaError_t LaunchCausalSoftmaxBackward(float* dscores, const float* dprobs, const float* probs,
                                        int64_t rows, int64_t seq, float scale,
                                        cudaStream_t stream) {
  return Backward(dscores, dprobs, probs, rows, seq, scale, stream);
}
cudaError_t LaunchCausalSoftmaxBackward(__nv_bfloat16* dscores, const float* dprobs,
                                        const __nv_bfloat16* probs, int64_t rows, int64_t seq,
                                        float scale, cudaStream_t stream) {
  return Backward(dscores, dprobs, probs, rows, seq, scale, stream);
}

}  // namespace baton::cuda
