#include "kernels/cuda/rope.cuh"

#include <math.h>

#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch_math.h"

namespace baton::cuda {
namespace {

// inv_freq by value (2 KiB of kernel parameters, under CUDA's 4 KiB).
struct RopeFreqs {
  float inv_freq[kRopeMaxHeadDim / 2];
};

// The CPU's expression (kernels/cpu/rope.cc RopeTable), on the host, with
// the same libm powf: the same bits.
bool MakeFreqs(RopeFreqs* f, int64_t head_dim, float theta) {
  if (head_dim < 2 || head_dim % 2 != 0 || head_dim > kRopeMaxHeadDim || !(theta > 0.0f)) {
    return false;
  }
  for (int64_t i = 0; i < head_dim / 2; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    f->inv_freq[i] = 1.0f / powf(theta, exponent);
  }
  return true;
}

bool ValidHeads(int64_t heads, int64_t kv_heads) {
  return heads > 0 && kv_heads > 0 && heads % kv_heads == 0;
}

// c, s of frequency i at position `pos` (position_offset + t, converted to
// float whole, as the CPU does).
__device__ __forceinline__ void CosSin(const RopeFreqs& f, int64_t pos, int64_t i, float* c,
                                       float* s) {
  const float angle = __fmul_rn(static_cast<float>(pos), f.inv_freq[i]);
  double sd, cd;
  sincos(static_cast<double>(angle), &sd, &cd);
  *c = __double2float_rn(cd);
  *s = __double2float_rn(sd);
}

__device__ __forceinline__ void Store(const RopeGradOut& o, int64_t i, float v) {
  if (o.bf16) {
    static_cast<__nv_bfloat16*>(o.data)[i] = __float2bfloat16_rn(v);
  } else {
    static_cast<float*>(o.data)[i] = v;
  }
}

// Thread per (row, query head h, i < D/2): the rotated pair of q head h, of
// key head h / group, and the copied pair of value head h / group.
template <typename Tout>
__global__ void RopePackForwardKernel(Tout* __restrict__ qkv, const float* __restrict__ q,
                                      const float* __restrict__ k, const float* __restrict__ v,
                                      int64_t rows, int64_t seq, int64_t H, int64_t group,
                                      int64_t D, RopeFreqs f, int64_t position_offset) {
  const int64_t half = D / 2, kvc = (H / group) * D;
  const int64_t n = rows * H * half;
  for (int64_t p = GlobalThread(); p < n; p += GridThreads()) {
    const int64_t i = p % half, h = (p / half) % H, row = p / (half * H);
    float c, s;
    CosSin(f, position_offset + row % seq, i, &c, &s);
    Tout* out = qkv + row * 3 * H * D + h * D;
    const float* xq = q + row * H * D + h * D;
    const float* xk = k + row * kvc + (h / group) * D;
    const float* xv = v + row * kvc + (h / group) * D;
    float x1 = xq[i], x2 = xq[i + half];
    out[i] = FromFloat<Tout>(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
    out[i + half] = FromFloat<Tout>(__fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
    x1 = xk[i];
    x2 = xk[i + half];
    out[H * D + i] = FromFloat<Tout>(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
    out[H * D + i + half] = FromFloat<Tout>(__fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
    out[2 * H * D + i] = FromFloat<Tout>(xv[i]);
    out[2 * H * D + i + half] = FromFloat<Tout>(xv[i + half]);
  }
}

// Items [0, rows·H·half): thread per (row, query head, i): dq's pair.
// Items [rows·H·half, + rows·KV·half): thread per (row, kv head j, i): dk's
// and dv's pairs, summing the group's query heads in increasing order.
template <typename Tin>
__global__ void RopePackBackwardKernel(RopeGradOut dq, RopeGradOut dk, RopeGradOut dv,
                                       const Tin* __restrict__ dqkv, int64_t rows, int64_t seq,
                                       int64_t H, int64_t group, int64_t D, RopeFreqs f,
                                       int64_t position_offset) {
  const int64_t half = D / 2, KV = H / group;
  const int64_t nq = rows * H * half, n = nq + rows * KV * half;
  for (int64_t p = GlobalThread(); p < n; p += GridThreads()) {
    const bool is_q = p < nq;
    const int64_t e = is_q ? p : p - nq, heads = is_q ? H : KV;
    const int64_t i = e % half, h = (e / half) % heads, row = e / (half * heads);
    float c, s;
    CosSin(f, position_offset + row % seq, i, &c, &s);
    const Tin* g = dqkv + row * 3 * H * D;
    if (is_q) {
      const float g1 = ToFloat(g[h * D + i]), g2 = ToFloat(g[h * D + i + half]);
      const int64_t o = row * H * D + h * D;
      Store(dq, o + i, __fadd_rn(__fmul_rn(g1, c), __fmul_rn(g2, s)));
      Store(dq, o + i + half, __fsub_rn(__fmul_rn(g2, c), __fmul_rn(g1, s)));
      continue;
    }
    const Tin* gk = g + H * D + h * group * D;
    const Tin* gv = g + 2 * H * D + h * group * D;
    float k1 = ToFloat(gk[i]), k2 = ToFloat(gk[i + half]);
    float v1 = ToFloat(gv[i]), v2 = ToFloat(gv[i + half]);
    for (int64_t m = 1; m < group; ++m) {
      k1 = __fadd_rn(k1, ToFloat(gk[m * D + i]));
      k2 = __fadd_rn(k2, ToFloat(gk[m * D + i + half]));
      v1 = __fadd_rn(v1, ToFloat(gv[m * D + i]));
      v2 = __fadd_rn(v2, ToFloat(gv[m * D + i + half]));
    }
    const int64_t o = row * KV * D + h * D;
    Store(dk, o + i, __fadd_rn(__fmul_rn(k1, c), __fmul_rn(k2, s)));
    Store(dk, o + i + half, __fsub_rn(__fmul_rn(k2, c), __fmul_rn(k1, s)));
    Store(dv, o + i, v1);
    Store(dv, o + i + half, v2);
  }
}

template <typename Tout>
cudaError_t Forward(Tout* qkv, const float* q, const float* k, const float* v, int64_t batch,
                    int64_t seq, int64_t heads, int64_t kv_heads, int64_t head_dim, float theta,
                    cudaStream_t stream, int64_t position_offset) {
  RopeFreqs f;
  if (!MakeFreqs(&f, head_dim, theta) || !ValidHeads(heads, kv_heads) || position_offset < 0) {
    return cudaErrorInvalidValue;
  }
  const int64_t rows = batch * seq;
  if (rows <= 0) return cudaSuccess;
  const LaunchShape s = ElementwiseLaunch(rows * heads * (head_dim / 2), 1);
  RopePackForwardKernel<Tout><<<s.blocks, s.threads, 0, stream>>>(
      qkv, q, k, v, rows, seq, heads, heads / kv_heads, head_dim, f, position_offset);
  return cudaGetLastError();
}

template <typename Tin>
cudaError_t Backward(RopeGradOut dq, RopeGradOut dk, RopeGradOut dv, const Tin* dqkv,
                     int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads, int64_t head_dim,
                     float theta, cudaStream_t stream, int64_t position_offset) {
  RopeFreqs f;
  if (!MakeFreqs(&f, head_dim, theta) || !ValidHeads(heads, kv_heads) || position_offset < 0) {
    return cudaErrorInvalidValue;
  }
  const int64_t rows = batch * seq;
  if (rows <= 0) return cudaSuccess;
  const LaunchShape s = ElementwiseLaunch(rows * (heads + kv_heads) * (head_dim / 2), 1);
  RopePackBackwardKernel<Tin><<<s.blocks, s.threads, 0, stream>>>(
      dq, dk, dv, dqkv, rows, seq, heads, heads / kv_heads, head_dim, f, position_offset);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchRopePackForward(float* qkv, const float* q, const float* k, const float* v,
                                  int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads,
                                  int64_t head_dim, float theta, cudaStream_t stream,
                                  int64_t position_offset) {
  return Forward<float>(qkv, q, k, v, batch, seq, heads, kv_heads, head_dim, theta, stream,
                        position_offset);
}

cudaError_t LaunchRopePackForward(__nv_bfloat16* qkv, const float* q, const float* k,
                                  const float* v, int64_t batch, int64_t seq, int64_t heads,
                                  int64_t kv_heads, int64_t head_dim, float theta,
                                  cudaStream_t stream, int64_t position_offset) {
  return Forward<__nv_bfloat16>(qkv, q, k, v, batch, seq, heads, kv_heads, head_dim, theta,
                                stream, position_offset);
}

cudaError_t LaunchRopePackBackward(RopeGradOut dq, RopeGradOut dk, RopeGradOut dv,
                                   const float* dqkv, int64_t batch, int64_t seq, int64_t heads,
                                   int64_t kv_heads, int64_t head_dim, float theta,
                                   cudaStream_t stream, int64_t position_offset) {
  return Backward<float>(dq, dk, dv, dqkv, batch, seq, heads, kv_heads, head_dim, theta, stream,
                         position_offset);
}

cudaError_t LaunchRopePackBackward(RopeGradOut dq, RopeGradOut dk, RopeGradOut dv,
                                   const __nv_bfloat16* dqkv, int64_t batch, int64_t seq,
                                   int64_t heads, int64_t kv_heads, int64_t head_dim, float theta,
                                   cudaStream_t stream, int64_t position_offset) {
  return Backward<__nv_bfloat16>(dq, dk, dv, dqkv, batch, seq, heads, kv_heads, head_dim, theta,
                                 stream, position_offset);
}

}  // namespace baton::cuda
