#include "kernels/cuda/rmsnorm.cuh"

#include "kernels/cuda/column_reduce.cuh"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch_math.h"

namespace baton::cuda {
namespace {

// Warp per row. `out` may alias `inp`: each lane reads its channels before
// it writes them (neither is __restrict__).
template <typename Tout>
__global__ void RmsNormForwardKernel(Tout* out, float* __restrict__ rstd, const float* inp,
                                     const float* __restrict__ weight, int64_t rows, int64_t C,
                                     float eps) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t n = GlobalThread() / 32; n < rows; n += warps) {
    const float* x = inp + n * C;
    double sum = 0.0;
    for (int64_t c = lane; c < C; c += 32) {
      const double v = x[c];
      sum += v * v;  // exact: a float's square fits a double
    }
    const float mean_square = static_cast<float>(WarpSum(sum) / static_cast<double>(C));
    const float s = 1.0f / sqrtf(__fadd_rn(mean_square, eps));  // IEEE div and sqrt
    Tout* o = out + n * C;
    for (int64_t c = lane; c < C; c += 32) {
      o[c] = FromFloat<Tout>(__fmul_rn(__fmul_rn(x[c], s), weight[c]));
    }
    if (lane == 0) rstd[n] = s;
  }
}

__global__ void RmsNormBackwardInputKernel(float* __restrict__ dinp,
                                           const float* __restrict__ dout,
                                           const float* __restrict__ inp,
                                           const float* __restrict__ weight,
                                           const float* __restrict__ rstd, int64_t rows,
                                           int64_t C) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t n = GlobalThread() / 32; n < rows; n += warps) {
    const float* x = inp + n * C;
    const float* dy = dout + n * C;
    float* dx = dinp + n * C;
    const float s = rstd[n];
    double gx_sum = 0.0;
    for (int64_t c = lane; c < C; c += 32) {
      const float xhat = __fmul_rn(x[c], s);
      const float g = __fmul_rn(dy[c], weight[c]);
      gx_sum += static_cast<double>(__fmul_rn(g, xhat));
    }
    const float gx_mean = static_cast<float>(WarpSum(gx_sum) / static_cast<double>(C));
    for (int64_t c = lane; c < C; c += 32) {
      const float xhat = __fmul_rn(x[c], s);
      const float g = __fmul_rn(dy[c], weight[c]);
      dx[c] = __fadd_rn(dx[c], __fmul_rn(s, __fsub_rn(g, __fmul_rn(xhat, gx_mean))));
    }
  }
}

// Chunk partials of Σ dy·x̂ [chunks, C]: block (column block x, chunk y),
// rows of the chunk in order.
__global__ void RmsNormWeightPartialKernel(float* __restrict__ partial,
                                           const float* __restrict__ dout,
                                           const float* __restrict__ inp,
                                           const float* __restrict__ rstd, int64_t rows,
                                           int64_t C, int64_t rows_per_chunk) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int64_t begin = blockIdx.y * rows_per_chunk;
  const int64_t end = begin + rows_per_chunk < rows ? begin + rows_per_chunk : rows;
  float dw = 0.0f;
  for (int64_t n = begin; n < end; ++n) {
    dw = __fadd_rn(dw, __fmul_rn(dout[n * C + c], __fmul_rn(inp[n * C + c], rstd[n])));
  }
  partial[blockIdx.y * C + c] = dw;
}

template <typename Tout>
cudaError_t LaunchForward(Tout* out, float* rstd, const float* inp, const float* weight,
                          int64_t rows, int64_t channels, float eps, cudaStream_t stream) {
  if (rows <= 0 || channels <= 0) return cudaSuccess;
  const LaunchShape s = WarpPerRowLaunch(rows);
  RmsNormForwardKernel<Tout><<<s.blocks, s.threads, 0, stream>>>(out, rstd, inp, weight, rows,
                                                                channels, eps);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchRmsNormForward(float* out, float* rstd, const float* inp, const float* weight,
                                 int64_t rows, int64_t channels, float eps, cudaStream_t stream) {
  return LaunchForward<float>(out, rstd, inp, weight, rows, channels, eps, stream);
}

cudaError_t LaunchRmsNormForward(__nv_bfloat16* out, float* rstd, const float* inp,
                                 const float* weight, int64_t rows, int64_t channels, float eps,
                                 cudaStream_t stream) {
  return LaunchForward<__nv_bfloat16>(out, rstd, inp, weight, rows, channels, eps, stream);
}

cudaError_t LaunchRmsNormBackward(float* dinp, float* dweight, const float* dout, const float* inp,
                                  const float* weight, const float* rstd, int64_t rows,
                                  int64_t channels, float* scratch, cudaStream_t stream) {
  if (rows <= 0 || channels <= 0) return cudaSuccess;
  const LaunchShape s = WarpPerRowLaunch(rows);
  RmsNormBackwardInputKernel<<<s.blocks, s.threads, 0, stream>>>(dinp, dout, inp, weight, rstd,
                                                                 rows, channels);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const ColumnReducePlan p = PlanColumnReduce(rows, channels);
  if (!ColumnReduceCoversColumns(p, channels)) return cudaErrorInvalidValue;
  RmsNormWeightPartialKernel<<<dim3(p.column_blocks, p.chunks), p.threads, 0, stream>>>(
      scratch, dout, inp, rstd, rows, channels, p.rows_per_chunk);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return LaunchAddChunkSums(dweight, scratch, p.chunks, channels, 1, stream);
}

}  // namespace baton::cuda
