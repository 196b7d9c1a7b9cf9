#include "kernels/cuda/layernorm.cuh"

#include "kernels/cuda/column_reduce.cuh"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch_math.h"

namespace baton::cuda {
namespace {

constexpr float kEps = 1e-5f;

// Warp per row. With `b` non-null, x = a + b is formed and stored to `residual`.
template <typename Tout>
__global__ void LayerNormForwardKernel(float* residual, Tout* __restrict__ out,
                                       float* __restrict__ mean, float* __restrict__ rstd,
                                       const float* a, const float* b,
                                       const float* __restrict__ weight,
                                       const float* __restrict__ bias, int64_t rows, int64_t C) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const float inv_c = 1.0f / static_cast<float>(C);
  for (int64_t n = GlobalThread() / 32; n < rows; n += warps) {
    const float* x = a + n * C;
    if (b != nullptr) {
      const float* y = b + n * C;
      float* r = residual + n * C;
      for (int64_t c = lane; c < C; c += 32) r[c] = x[c] + y[c];
      x = r;  // each lane re-reads only what it wrote
    }
    float sum = 0.0f;
    for (int64_t c = lane; c < C; c += 32) sum += x[c];
    const float m = WarpSum(sum) * inv_c;
    float var = 0.0f;
    for (int64_t c = lane; c < C; c += 32) {
      const float d = x[c] - m;
      var += d * d;
    }
    const float s = 1.0f / sqrtf(WarpSum(var) * inv_c + kEps);
    Tout* o = out + n * C;
    for (int64_t c = lane; c < C; c += 32) {
      o[c] = FromFloat<Tout>((x[c] - m) * s * weight[c] + bias[c]);
    }
    if (lane == 0) {
      mean[n] = m;
      rstd[n] = s;
    }
  }
}

__global__ void LayerNormBackwardInputKernel(float* __restrict__ dinp,
                                             const float* __restrict__ dout,
                                             const float* __restrict__ inp,
                                             const float* __restrict__ weight,
                                             const float* __restrict__ mean,
                                             const float* __restrict__ rstd, int64_t rows,
                                             int64_t C) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const float inv_c = 1.0f / static_cast<float>(C);
  for (int64_t n = GlobalThread() / 32; n < rows; n += warps) {
    const float* x = inp + n * C;
    const float* dy = dout + n * C;
    float* dx = dinp + n * C;
    const float m = mean[n], s = rstd[n];
    float g_sum = 0.0f, gx_sum = 0.0f;
    for (int64_t c = lane; c < C; c += 32) {
      const float xhat = (x[c] - m) * s;
      const float g = dy[c] * weight[c];
      g_sum += g;
      gx_sum += g * xhat;
    }
    const float g_mean = WarpSum(g_sum) * inv_c;
    const float gx_mean = WarpSum(gx_sum) * inv_c;
    for (int64_t c = lane; c < C; c += 32) {
      const float xhat = (x[c] - m) * s;
      const float g = dy[c] * weight[c];
      dx[c] += s * (g - g_mean - xhat * gx_mean);
    }
  }
}

// Chunk partials of Σ dy·x̂ (into partial[0]) and Σ dy (into partial[1]).
__global__ void LayerNormParamPartialKernel(float* __restrict__ partial,
                                            const float* __restrict__ dout,
                                            const float* __restrict__ inp,
                                            const float* __restrict__ mean,
                                            const float* __restrict__ rstd, int64_t rows,
                                            int64_t C, int64_t rows_per_chunk, int chunks) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int64_t begin = blockIdx.y * rows_per_chunk;
  const int64_t end = begin + rows_per_chunk < rows ? begin + rows_per_chunk : rows;
  float dw = 0.0f, db = 0.0f;
  for (int64_t n = begin; n < end; ++n) {
    const float dy = dout[n * C + c];
    dw += dy * ((inp[n * C + c] - mean[n]) * rstd[n]);
    db += dy;
  }
  partial[blockIdx.y * C + c] = dw;
  partial[(static_cast<int64_t>(chunks) + blockIdx.y) * C + c] = db;
}

template <typename Tout>
cudaError_t LaunchForward(float* residual, Tout* out, float* mean, float* rstd, const float* a,
                          const float* b, const float* weight, const float* bias, int64_t rows,
                          int64_t channels, cudaStream_t stream) {
  if (rows <= 0 || channels <= 0) return cudaSuccess;
  const LaunchShape s = WarpPerRowLaunch(rows);
  LayerNormForwardKernel<Tout><<<s.blocks, s.threads, 0, stream>>>(residual, out, mean, rstd, a, b,
                                                                  weight, bias, rows, channels);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchLayerNormForward(float* out, float* mean, float* rstd, const float* inp,
                                   const float* weight, const float* bias, int64_t rows,
                                   int64_t channels, cudaStream_t stream) {
  return LaunchForward<float>(nullptr, out, mean, rstd, inp, nullptr, weight, bias, rows, channels,
                              stream);
}

cudaError_t LaunchLayerNormForward(__nv_bfloat16* out, float* mean, float* rstd, const float* inp,
                                   const float* weight, const float* bias, int64_t rows,
                                   int64_t channels, cudaStream_t stream) {
  return LaunchForward<__nv_bfloat16>(nullptr, out, mean, rstd, inp, nullptr, weight, bias, rows,
                                      channels, stream);
}

cudaError_t LaunchResidualLayerNormForward(float* residual, float* out, float* mean, float* rstd,
                                           const float* a, const float* b, const float* weight,
                                           const float* bias, int64_t rows, int64_t channels,
                                           cudaStream_t stream) {
  if (b == nullptr || residual == nullptr) return cudaErrorInvalidValue;
  return LaunchForward<float>(residual, out, mean, rstd, a, b, weight, bias, rows, channels,
                              stream);
}

cudaError_t LaunchResidualLayerNormForward(float* residual, __nv_bfloat16* out, float* mean,
                                           float* rstd, const float* a, const float* b,
                                           const float* weight, const float* bias, int64_t rows,
                                           int64_t channels, cudaStream_t stream) {
  if (b == nullptr || residual == nullptr) return cudaErrorInvalidValue;
  return LaunchForward<__nv_bfloat16>(residual, out, mean, rstd, a, b, weight, bias, rows,
                                      channels, stream);
}

cudaError_t LaunchLayerNormBackward(float* dinp, float* dweight, float* dbias, const float* dout,
                                    const float* inp, const float* weight, const float* mean,
                                    const float* rstd, int64_t rows, int64_t channels,
                                    float* scratch, cudaStream_t stream) {
  if (rows <= 0 || channels <= 0) return cudaSuccess;
  const LaunchShape s = WarpPerRowLaunch(rows);
  LayerNormBackwardInputKernel<<<s.blocks, s.threads, 0, stream>>>(dinp, dout, inp, weight, mean,
                                                                   rstd, rows, channels);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const ColumnReducePlan p = PlanColumnReduce(rows, channels);
  if (!ColumnReduceCoversColumns(p, channels)) return cudaErrorInvalidValue;
  LayerNormParamPartialKernel<<<dim3(p.column_blocks, p.chunks), p.threads, 0, stream>>>(
      scratch, dout, inp, mean, rstd, rows, channels, p.rows_per_chunk, p.chunks);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  // One finishing pass when dweight and dbias are adjacent, two otherwise.
  if (dweight + channels == dbias) {
    return LaunchAddChunkSums(dweight, scratch, p.chunks, channels, 2, stream);
  }
  err = LaunchAddChunkSums(dweight, scratch, p.chunks, channels, 1, stream);
  if (err != cudaSuccess) return err;
  return LaunchAddChunkSums(dbias, scratch + static_cast<int64_t>(p.chunks) * channels, p.chunks,
                            channels, 1, stream);
}

}  // namespace baton::cuda
