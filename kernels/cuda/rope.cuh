// Rotary position embedding with the grouped-query expansion into the packed
// qkv that attention reads (Llama; kernels/cpu/rope.h, kernels/ops.h RopePack).
//
// q [B·T, H·D], k and v [B·T, KV·D] fp32, rows batch-major (row = b·T + t);
// qkv [B, T, 3·H·D]: H query heads, then H key heads, then H value heads,
// each D wide; query head h reads key/value head h / (H / KV). For i < D/2:
//   inv_freq_i = fl(1 / powf(theta, fl(2i / D)))      (on the host, below)
//   angle = fl(pos · inv_freq_i),  c = fl(cos(angle)), s = fl(sin(angle))
//   pos = position_offset + t (t: the row's index in its sequence)
//                                                     (cos, sin in float64)
//   (x_i, x_{i+D/2}) → (x_i·c − x_{i+D/2}·s,  x_{i+D/2}·c + x_i·s)
// q and k are rotated, v is copied. Backward (the adjoint): per key/value
// head the gradients of its query heads' copies are summed in float32 in
// increasing head order (one thread per output element walks the group),
// then q and k are rotated back:
//   (g_i, g_{i+D/2}) → (g_i·c + g_{i+D/2}·s,  g_{i+D/2}·c − g_i·s).
//
// Precision against the CPU: inv_freq is computed by the launcher on the
// host with the same powf expression as the CPU (so the same bits) and passed
// by value; the angle is one explicitly rounded float multiply; every product
// and sum is an explicitly rounded float32 operation in the CPU's order (no
// FMA contraction). The only difference is cos/sin in float64 (CUDA's ≤ 2
// ulp vs glibc's), which after rounding to float agree except within ~2⁻²⁸
// relative of a float rounding boundary, and then by 1 ulp. So the outputs
// are the CPU's bits wherever c and s are (all but about one value in 10⁸),
// and v / dv are always bitwise. No atomics: identical run to run.
//
// bf16: qkv (forward), dqkv (backward input, widened exactly) and each of
// dq, dk, dv may be bf16, the fp32 result rounded once to nearest even.
#ifndef BATON_KERNELS_CUDA_ROPE_CUH_
#define BATON_KERNELS_CUDA_ROPE_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace baton::cuda {

// The largest head_dim the kernels take (inv_freq travels as a kernel
// argument of kRopeMaxHeadDim / 2 floats); larger: cudaErrorInvalidValue.
inline constexpr int64_t kRopeMaxHeadDim = 1024;

// An output of RopePackBackward: fp32 or bf16 memory.
struct RopeGradOut {
  void* data = nullptr;
  bool bf16 = false;
  static RopeGradOut F32(float* p) { return RopeGradOut{p, false}; }
  static RopeGradOut Bf16(__nv_bfloat16* p) { return RopeGradOut{p, true}; }
};

// Writes every element of qkv. head_dim even, in [2, kRopeMaxHeadDim];
// kv_heads divides heads; position_offset ≥ 0 (the position of each
// sequence's row 0; 0 gives the bits of the launchers before the offset).
cudaError_t LaunchRopePackForward(float* qkv, const float* q, const float* k, const float* v,
                                  int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads,
                                  int64_t head_dim, float theta, cudaStream_t stream,
                                  int64_t position_offset = 0);
cudaError_t LaunchRopePackForward(__nv_bfloat16* qkv, const float* q, const float* k,
                                  const float* v, int64_t batch, int64_t seq, int64_t heads,
                                  int64_t kv_heads, int64_t head_dim, float theta,
                                  cudaStream_t stream, int64_t position_offset = 0);

// Writes (overwrites) every element of dq, dk and dv (position_offset as above).
cudaError_t LaunchRopePackBackward(RopeGradOut dq, RopeGradOut dk, RopeGradOut dv,
                                   const float* dqkv, int64_t batch, int64_t seq, int64_t heads,
                                   int64_t kv_heads, int64_t head_dim, float theta,
                                   cudaStream_t stream, int64_t position_offset = 0);
cudaError_t LaunchRopePackBackward(RopeGradOut dq, RopeGradOut dk, RopeGradOut dv,
                                   const __nv_bfloat16* dqkv, int64_t batch, int64_t seq,
                                   int64_t heads, int64_t kv_heads, int64_t head_dim, float theta,
                                   cudaStream_t stream, int64_t position_offset = 0);

}  // namespace baton::cuda

#endif  // BATON_KERNELS_CUDA_ROPE_CUH_
