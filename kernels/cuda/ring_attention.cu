#include "kernels/cuda/ring_attention.cuh"

#include <math.h>

#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch_math.h"

namespace baton::cuda {
namespace {

// Keys of the block that query row i sees: the prefix j < n, clamped to [0, k_len].
__device__ __forceinline__ int64_t VisibleKeys(int64_t i, const RingBlock& blk) {
  const int64_t n = blk.q_offset + i - blk.k_offset + 1;
  return n < 0 ? 0 : (n > blk.k_len ? blk.k_len : n);
}

// The first query row that sees key j (q_len when none does).
__device__ __forceinline__ int64_t FirstQueryRow(int64_t j, const RingBlock& blk) {
  const int64_t i = blk.k_offset + j - blk.q_offset;
  return i < 0 ? 0 : (i > blk.q_len ? blk.q_len : i);
}

// A lane's channels d = lane + 32·m of a head row (0 past hd).
template <int kPerLane>
__device__ __forceinline__ void LoadRow(float (&x)[kPerLane], const float* __restrict__ row,
                                        int64_t hd, int lane) {
#pragma unroll
  for (int m = 0; m < kPerLane; ++m) {
    const int64_t d = lane + 32 * m;
    x[m] = d < hd ? row[d] : 0.0f;
  }
}

// a · row over the head: each lane's channels in order, then the butterfly
// (every lane gets the same bits, in every call with the same operands).
template <int kPerLane>
__device__ __forceinline__ float Dot(const float (&a)[kPerLane], const float* __restrict__ row,
                                     int64_t hd, int lane) {
  float s = 0.0f;
#pragma unroll
  for (int m = 0; m < kPerLane; ++m) {
    const int64_t d = lane + 32 * m;
    if (d < hd) s = __fmaf_rn(a[m], row[d], s);
  }
  return WarpSum(s);
}

// acc += w · row (a lane's channels).
template <int kPerLane>
__device__ __forceinline__ void Axpy(float (&acc)[kPerLane], float w,
                                     const float* __restrict__ row, int64_t hd, int lane) {
#pragma unroll
  for (int m = 0; m < kPerLane; ++m) {
    const int64_t d = lane + 32 * m;
    if (d < hd) acc[m] = __fmaf_rn(w, row[d], acc[m]);
  }
}

// The float functions of the CPU's merge (glibc expf, log1pf), from float64.
__device__ __forceinline__ float ExpOf(float x) {
  return __double2float_rn(exp(static_cast<double>(x)));
}
__device__ __forceinline__ float Log1pOf(float x) {
  return __double2float_rn(log1p(static_cast<double>(x)));
}

// Warp per query row r = (b·heads + h)·Tq + i (lse's index).
template <int kPerLane>
__global__ void BlockAttentionForwardKernel(float* __restrict__ out, float* __restrict__ lse,
                                            const float* __restrict__ qkv,
                                            const float* __restrict__ kv, RingBlock blk,
                                            int64_t hd, float scale) {
  const int lane = threadIdx.x % 32;
  const int64_t C = blk.channels, rows = blk.batch * blk.heads * blk.q_len;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = GlobalThread() / 32; r < rows; r += warps) {
    const int64_t i = r % blk.q_len, h = (r / blk.q_len) % blk.heads;
    const int64_t b = r / (blk.q_len * blk.heads);
    float* o = out + (b * blk.q_len + i) * C + h * hd;
    const int64_t n = VisibleKeys(i, blk);
    if (n == 0) {
      for (int64_t d = lane; d < hd; d += 32) o[d] = 0.0f;
      if (lane == 0) lse[r] = -INFINITY;
      continue;
    }
    float q[kPerLane];
    LoadRow(q, qkv + (b * blk.q_len + i) * 3 * C + h * hd, hd, lane);
    const float* k = kv + b * blk.k_len * 2 * C + h * hd;  // key j at k + j·2C, value at + C
    float max = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
      max = fmaxf(max, __fmul_rn(Dot(q, k + j * 2 * C, hd, lane), scale));
    }
    float sum = 0.0f, acc[kPerLane] = {};
    for (int64_t j = 0; j < n; ++j) {
      const float e = expf(__fsub_rn(__fmul_rn(Dot(q, k + j * 2 * C, hd, lane), scale), max));
      sum = __fadd_rn(sum, e);
      Axpy(acc, e, k + j * 2 * C + C, hd, lane);
    }
    const float inv = __fdiv_rn(1.0f, sum);
#pragma unroll
    for (int m = 0; m < kPerLane; ++m) {
      const int64_t d = lane + 32 * m;
      if (d < hd) o[d] = __fmul_rn(acc[m], inv);
    }
    if (lane == 0) lse[r] = __fadd_rn(max, __double2float_rn(log(static_cast<double>(sum))));
  }
}

// dS_ij and P_ij (through *p) of query row i (q, dout in registers or
// memory: the products are symmetric) and key j.
template <int kPerLane>
__device__ __forceinline__ float Ds(float* p, const float (&a)[kPerLane],
                                    const float* __restrict__ a_row, const float (&g)[kPerLane],
                                    const float* __restrict__ g_row, int64_t hd, int lane,
                                    float scale, float lse, float delta) {
  *p = expf(__fsub_rn(__fmul_rn(Dot(a, a_row, hd, lane), scale), lse));
  return __fmul_rn(__fmul_rn(*p, __fsub_rn(Dot(g, g_row, hd, lane), delta)), scale);
}

// Warp per query row r (as the forward's): dq_i += Σ_j dS_ij k_j, keys in order.
template <int kPerLane>
__global__ void BlockAttentionDqKernel(float* __restrict__ dqkv, const float* __restrict__ dout,
                                       const float* __restrict__ qkv, const float* __restrict__ kv,
                                       const float* __restrict__ lse,
                                       const float* __restrict__ delta, RingBlock blk, int64_t hd,
                                       float scale) {
  const int lane = threadIdx.x % 32;
  const int64_t C = blk.channels, rows = blk.batch * blk.heads * blk.q_len;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = GlobalThread() / 32; r < rows; r += warps) {
    const int64_t i = r % blk.q_len, h = (r / blk.q_len) % blk.heads;
    const int64_t b = r / (blk.q_len * blk.heads);
    const int64_t n = VisibleKeys(i, blk);
    if (n == 0) continue;
    float q[kPerLane], g[kPerLane], acc[kPerLane] = {};
    LoadRow(q, qkv + (b * blk.q_len + i) * 3 * C + h * hd, hd, lane);
    LoadRow(g, dout + (b * blk.q_len + i) * C + h * hd, hd, lane);
    const float l = lse[r], dl = delta[r];
    const float* k = kv + b * blk.k_len * 2 * C + h * hd;
    for (int64_t j = 0; j < n; ++j) {
      float p;
      const float ds = Ds(&p, q, k + j * 2 * C, g, k + j * 2 * C + C, hd, lane, scale, l, dl);
      Axpy(acc, ds, k + j * 2 * C, hd, lane);
    }
    float* dq = dqkv + (b * blk.q_len + i) * 3 * C + h * hd;
#pragma unroll
    for (int m = 0; m < kPerLane; ++m) {
      const int64_t d = lane + 32 * m;
      if (d < hd) dq[d] = __fadd_rn(dq[d], acc[m]);
    }
  }
}

// Warp per key row r = (b·heads + h)·Tk + j: dk_j += Σ_i dS_ij q_i and
// dv_j += Σ_i P_ij do_i, query rows in order.
template <int kPerLane>
__global__ void BlockAttentionDkvKernel(float* __restrict__ dkv, const float* __restrict__ dout,
                                        const float* __restrict__ qkv,
                                        const float* __restrict__ kv,
                                        const float* __restrict__ lse,
                                        const float* __restrict__ delta, RingBlock blk,
                                        int64_t hd, float scale) {
  const int lane = threadIdx.x % 32;
  const int64_t C = blk.channels, rows = blk.batch * blk.heads * blk.k_len;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = GlobalThread() / 32; r < rows; r += warps) {
    const int64_t j = r % blk.k_len, bh = r / blk.k_len, h = bh % blk.heads;
    const int64_t b = bh / blk.heads;
    const int64_t first = FirstQueryRow(j, blk);
    if (first == blk.q_len) continue;
    float k[kPerLane], v[kPerLane], dk[kPerLane] = {}, dv[kPerLane] = {};
    LoadRow(k, kv + (b * blk.k_len + j) * 2 * C + h * hd, hd, lane);
    LoadRow(v, kv + (b * blk.k_len + j) * 2 * C + C + h * hd, hd, lane);
    const float* q = qkv + b * blk.q_len * 3 * C + h * hd;  // row i at q + i·3C
    const float* g = dout + b * blk.q_len * C + h * hd;     // row i at g + i·C
    for (int64_t i = first; i < blk.q_len; ++i) {
      float p;
      const float ds = Ds(&p, k, q + i * 3 * C, v, g + i * C, hd, lane, scale,
                          lse[bh * blk.q_len + i], delta[bh * blk.q_len + i]);
      Axpy(dk, ds, q + i * 3 * C, hd, lane);
      Axpy(dv, p, g + i * C, hd, lane);
    }
    float* dkr = dkv + (b * blk.k_len + j) * 2 * C + h * hd;
#pragma unroll
    for (int m = 0; m < kPerLane; ++m) {
      const int64_t d = lane + 32 * m;
      if (d < hd) {
        dkr[d] = __fadd_rn(dkr[d], dk[m]);
        dkr[C + d] = __fadd_rn(dkr[C + d], dv[m]);
      }
    }
  }
}

// Warp per row r = (b·heads + h)·Tq + i; the CPU's float operations.
__global__ void MergeAttentionBlockKernel(float* __restrict__ out, float* __restrict__ lse,
                                          const float* __restrict__ block_out,
                                          const float* __restrict__ block_lse, int64_t rows,
                                          int64_t q_len, int64_t C, int64_t heads, int64_t hd) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = GlobalThread() / 32; r < rows; r += warps) {
    const int64_t i = r % q_len, h = (r / q_len) % heads, b = r / (q_len * heads);
    float* o = out + (b * q_len + i) * C + h * hd;
    const float* bo = block_out + (b * q_len + i) * C + h * hd;
    const float a = lse[r], c = block_lse[r];
    if (c == -INFINITY) continue;
    float merged = c;
    if (a == -INFINITY) {
      for (int64_t d = lane; d < hd; d += 32) o[d] = bo[d];
    } else {
      const float hi = a > c ? a : c, lo = a > c ? c : a;
      merged = __fadd_rn(hi, Log1pOf(ExpOf(__fsub_rn(lo, hi))));
      const float wa = ExpOf(__fsub_rn(a, merged)), wc = ExpOf(__fsub_rn(c, merged));
      for (int64_t d = lane; d < hd; d += 32) {
        o[d] = __fadd_rn(__fmul_rn(o[d], wa), __fmul_rn(bo[d], wc));
      }
    }
    __syncwarp();  // every lane has read lse[r]
    if (lane == 0) lse[r] = merged;
  }
}

// Thread per row r = (b·heads + h)·Tq + i: channels in order, as the CPU.
__global__ void AttentionDeltaKernel(float* __restrict__ delta, const float* __restrict__ dout,
                                     const float* __restrict__ out, int64_t rows, int64_t q_len,
                                     int64_t C, int64_t heads, int64_t hd) {
  for (int64_t r = GlobalThread(); r < rows; r += GridThreads()) {
    const int64_t i = r % q_len, h = (r / q_len) % heads, b = r / (q_len * heads);
    const int64_t at = (b * q_len + i) * C + h * hd;
    float sum = 0.0f;
    for (int64_t d = 0; d < hd; ++d) sum = __fadd_rn(sum, __fmul_rn(dout[at + d], out[at + d]));
    delta[r] = sum;
  }
}

bool ValidBlock(const RingBlock& b) {
  return b.batch > 0 && b.q_len > 0 && b.k_len > 0 && b.heads > 0 && b.channels > 0 &&
         b.channels % b.heads == 0 && b.channels / b.heads <= kRingAttentionMaxHeadDim &&
         b.q_offset >= 0 && b.k_offset >= 0;
}

// Launches Kernel<kPerLane> with the smallest kPerLane ≥ hd/32 on one warp
// per row of `rows`.
template <template <int> class Launch, typename... Args>
cudaError_t ByHeadDim(int64_t hd, int64_t rows, cudaStream_t stream, Args... args) {
  const LaunchShape s = WarpPerRowLaunch(rows);
  if (hd <= 32) return Launch<1>::Run(s, stream, args...);
  if (hd <= 64) return Launch<2>::Run(s, stream, args...);
  if (hd <= 128) return Launch<4>::Run(s, stream, args...);
  return Launch<8>::Run(s, stream, args...);
}

template <int kPerLane>
struct Forward {
  static cudaError_t Run(const LaunchShape& s, cudaStream_t stream, float* out, float* lse,
                         const float* qkv, const float* kv, RingBlock blk, int64_t hd,
                         float scale) {
    BlockAttentionForwardKernel<kPerLane>
        <<<s.blocks, s.threads, 0, stream>>>(out, lse, qkv, kv, blk, hd, scale);
    return cudaGetLastError();
  }
};

template <int kPerLane>
struct Dq {
  static cudaError_t Run(const LaunchShape& s, cudaStream_t stream, float* dqkv, const float* dout,
                         const float* qkv, const float* kv, const float* lse, const float* delta,
                         RingBlock blk, int64_t hd, float scale) {
    BlockAttentionDqKernel<kPerLane>
        <<<s.blocks, s.threads, 0, stream>>>(dqkv, dout, qkv, kv, lse, delta, blk, hd, scale);
    return cudaGetLastError();
  }
};

template <int kPerLane>
struct Dkv {
  static cudaError_t Run(const LaunchShape& s, cudaStream_t stream, float* dkv, const float* dout,
                         const float* qkv, const float* kv, const float* lse, const float* delta,
                         RingBlock blk, int64_t hd, float scale) {
    BlockAttentionDkvKernel<kPerLane>
        <<<s.blocks, s.threads, 0, stream>>>(dkv, dout, qkv, kv, lse, delta, blk, hd, scale);
    return cudaGetLastError();
  }
};

// The CPU's scale: 1/√hd in float.
float ScaleOf(int64_t hd) { return 1.0f / sqrtf(static_cast<float>(hd)); }

// Copies `rows` rows of `width` elements between row strides (in elements).
template <typename T>
cudaError_t CopyColumns(T* dst, int64_t dst_stride, const T* src, int64_t src_stride,
                        int64_t rows, int64_t width, cudaStream_t stream) {
  if (rows < 0 || width < 0) return cudaErrorInvalidValue;
  if (rows == 0 || width == 0) return cudaSuccess;
  return cudaMemcpy2DAsync(dst, dst_stride * sizeof(T), src, src_stride * sizeof(T),
                           width * sizeof(T), rows, cudaMemcpyDeviceToDevice, stream);
}

// Thread per element e = r·width + c.
template <bool kAdd>
__global__ void WidenColumnsKernel(float* __restrict__ y, int64_t y_stride,
                                   const __nv_bfloat16* __restrict__ x, int64_t x_stride,
                                   int64_t n, int64_t width) {
  for (int64_t e = GlobalThread(); e < n; e += GridThreads()) {
    const int64_t r = e / width, c = e % width;
    const float v = __bfloat162float(x[r * x_stride + c]);
    float* at = y + r * y_stride + c;
    *at = kAdd ? __fadd_rn(*at, v) : v;
  }
}

template <bool kAdd>
cudaError_t WidenColumns(float* y, int64_t y_stride, const __nv_bfloat16* x, int64_t x_stride,
                         int64_t rows, int64_t width, cudaStream_t stream) {
  if (rows < 0 || width < 0 || y_stride < width || x_stride < width) {
    return cudaErrorInvalidValue;
  }
  const int64_t n = rows * width;
  if (n == 0) return cudaSuccess;
  const LaunchShape s = ElementwiseLaunch(n, 1);
  WidenColumnsKernel<kAdd><<<s.blocks, s.threads, 0, stream>>>(y, y_stride, x, x_stride, n, width);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchKvOfQkv(float* kv, const float* qkv, int64_t rows, int64_t channels,
                          cudaStream_t stream) {
  return CopyColumns(kv, 2 * channels, qkv + channels, 3 * channels, rows, 2 * channels, stream);
}

cudaError_t LaunchKvOfQkv(__nv_bfloat16* kv, const __nv_bfloat16* qkv, int64_t rows,
                          int64_t channels, cudaStream_t stream) {
  return CopyColumns(kv, 2 * channels, qkv + channels, 3 * channels, rows, 2 * channels, stream);
}

cudaError_t LaunchWidenColumns(float* y, int64_t y_stride, const __nv_bfloat16* x,
                               int64_t x_stride, int64_t rows, int64_t width,
                               cudaStream_t stream) {
  return WidenColumns<false>(y, y_stride, x, x_stride, rows, width, stream);
}

cudaError_t LaunchAddWidenedColumns(float* y, int64_t y_stride, const __nv_bfloat16* x,
                                    int64_t x_stride, int64_t rows, int64_t width,
                                    cudaStream_t stream) {
  return WidenColumns<true>(y, y_stride, x, x_stride, rows, width, stream);
}

cudaError_t LaunchQkvGradOfKv(float* dqkv, const float* dkv, int64_t rows, int64_t channels,
                              cudaStream_t stream) {
  return CopyColumns(dqkv + channels, 3 * channels, dkv, 2 * channels, rows, 2 * channels, stream);
}

cudaError_t LaunchBlockAttentionForward(float* out, float* lse, const float* qkv, const float* kv,
                                        const RingBlock& block, cudaStream_t stream) {
  if (!ValidBlock(block)) return cudaErrorInvalidValue;
  const int64_t hd = block.channels / block.heads;
  return ByHeadDim<Forward>(hd, block.batch * block.heads * block.q_len, stream, out, lse, qkv, kv,
                            block, hd, ScaleOf(hd));
}

cudaError_t LaunchMergeAttentionBlock(float* out, float* lse, const float* block_out,
                                      const float* block_lse, int64_t batch, int64_t q_len,
                                      int64_t channels, int64_t heads, cudaStream_t stream) {
  if (batch < 0 || q_len < 0 || heads <= 0 || channels <= 0 || channels % heads != 0) {
    return cudaErrorInvalidValue;
  }
  const int64_t rows = batch * heads * q_len;
  if (rows == 0) return cudaSuccess;
  const LaunchShape s = WarpPerRowLaunch(rows);
  MergeAttentionBlockKernel<<<s.blocks, s.threads, 0, stream>>>(
      out, lse, block_out, block_lse, rows, q_len, channels, heads, channels / heads);
  return cudaGetLastError();
}

cudaError_t LaunchAttentionDelta(float* delta, const float* dout, const float* out, int64_t batch,
                                 int64_t q_len, int64_t channels, int64_t heads,
                                 cudaStream_t stream) {
  if (batch < 0 || q_len < 0 || heads <= 0 || channels <= 0 || channels % heads != 0) {
    return cudaErrorInvalidValue;
  }
  const int64_t rows = batch * heads * q_len;
  if (rows == 0) return cudaSuccess;
  const LaunchShape s = ElementwiseLaunch(rows, 1);
  AttentionDeltaKernel<<<s.blocks, s.threads, 0, stream>>>(delta, dout, out, rows, q_len,
                                                           channels, heads, channels / heads);
  return cudaGetLastError();
}

cudaError_t LaunchBlockAttentionBackward(float* dqkv, float* dkv, const float* dout,
                                         const float* qkv, const float* kv, const float* lse,
                                         const float* delta, const RingBlock& block,
                                         cudaStream_t stream) {
  if (!ValidBlock(block)) return cudaErrorInvalidValue;
  // The last query row sees the most keys; if it sees none, no row does.
  if (block.q_offset + block.q_len - 1 < block.k_offset) return cudaSuccess;
  const int64_t hd = block.channels / block.heads;
  const float scale = ScaleOf(hd);
  const cudaError_t err =
      ByHeadDim<Dq>(hd, block.batch * block.heads * block.q_len, stream, dqkv, dout, qkv, kv, lse,
                    delta, block, hd, scale);
  if (err != cudaSuccess) return err;
  return ByHeadDim<Dkv>(hd, block.batch * block.heads * block.k_len, stream, dkv, dout, qkv, kv,
                        lse, delta, block, hd, scale);
}

}  // namespace baton::cuda
