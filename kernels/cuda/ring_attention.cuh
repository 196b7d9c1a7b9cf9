// Context-parallel (ring) attention, fp32: the CUDA form of
// kernels/cpu/block_attention.h (the math and layouts are there and in
// kernels/ops.h). Per batch row b and head h (hd = C/heads); query row i at
// global position q_offset + i, key row j at k_offset + j; j visible to i iff
// k_offset + j ≤ q_offset + i, so row i sees the prefix j < n_i of the block.
//   forward    s_ij = (q_i · k_j)·scale,  scale = 1/√hd,  m_i = max_j s_ij,
//              e_ij = exp(s_ij − m_i),  Z_i = Σ_j e_ij  (j in order),
//              o_i = (Σ_j e_ij v_j) · (1/Z_i),  lse_i = m_i + log Z_i;
//              n_i = 0: o_i = 0, lse_i = −∞
//   merge      l'' = hi + log1p(exp(lo − hi)),  o'' = o·e^{l−l''} + o'·e^{l'−l''}
//              (a block row with l' = −∞ is skipped; a running row with
//              l = −∞ takes the block's row)
//   delta      δ_i = Σ_c do_ic · o_ic  (c in order)
//   backward   P_ij = exp(s_ij − lse_i),  dS_ij = P_ij (do_i · v_j − δ_i)·scale,
//              dq_i += Σ_j dS_ij k_j,  dk_j += Σ_i dS_ij q_i,  dv_j += Σ_i P_ij do_i
// q is read in place from qkv [B,Tq,3C] (row stride 3C), k and v from kv
// [B,Tk,2C] (row stride 2C, v = k + C); dq goes into dqkv's first C columns,
// dk and dv into dkv's halves.
//
// Parallelisation: one warp per row, rows ordered (b, h, i) so that the warps
// of a thread block read the same key/value rows (L1). Lane l holds channels
// l, l+32, … of the head (hd ≤ kRingAttentionMaxHeadDim). Scores are
// recomputed, never stored: the forward makes two passes over the visible
// keys (max, then exp/sum/P·V); the backward runs one warp per query row for
// dq and one warp per key row for dk and dv, each recomputing s, P and dS.
// The ops' `scratch` is not used (its Tq·Tk floats hold one (b, h) at a
// time: the CPU's loop, not a parallel one). KvOfQkv and QkvGradOfKv are
// strided copies (cudaMemcpy2DAsync).
//
// Determinism: no atomics; every sum runs in a fixed order (a lane's
// channels in order then the warp's xor butterfly for dot products; keys or
// query rows in index order for the accumulations), with explicitly rounded
// intrinsics, so fixed shapes give fixed bits. Against the CPU: delta, the
// copies and the −∞ cases of merge are the CPU's bits (the same float32
// operations in the same order); merge's exp/log1p are taken in float64 and
// rounded (glibc's float forms agree but for ≤ 1 ulp); forward and backward
// differ from the CPU's GEMMs by accumulation order and expf vs FastExp
// (a few 1e-6 of the max-abs at most; cuda_ops_test's bound is 1e-5).
//
// bf16 inputs (kernels/ops.h): the backend runs a fully visible or diagonal
// block through cuDNN's fused SDPA (sdpa_plan.h RingSdpaPlan, ring_sdpa.h),
// which writes the block's o or dq, dk, dv as bf16 temporaries; the helpers
// below widen those into the fp32 out or add them into the fp32 dqkv / dkv
// (y += float(x), elementwise: fixed bits). Any other block widens its bf16
// inputs into fp32 (exactly) and runs the fp32 kernels above.
#ifndef BATON_KERNELS_CUDA_RING_ATTENTION_CUH_
#define BATON_KERNELS_CUDA_RING_ATTENTION_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace baton::cuda {

// The largest head_dim (C/heads) of BlockAttention and its backward (a
// lane's share of a row lives in registers); larger: cudaErrorInvalidValue.
inline constexpr int64_t kRingAttentionMaxHeadDim = 256;

// One (query block, key/value block) pair: qkv [batch, q_len, 3·channels],
// kv [batch, k_len, 2·channels], heads | channels, offsets ≥ 0.
struct RingBlock {
  int64_t batch = 0;
  int64_t q_len = 0;
  int64_t k_len = 0;
  int64_t channels = 0;
  int64_t heads = 0;
  int64_t q_offset = 0;
  int64_t k_offset = 0;
};

// kv [rows, 2C] = qkv [rows, 3C]'s k and v columns.
cudaError_t LaunchKvOfQkv(float* kv, const float* qkv, int64_t rows, int64_t channels,
                          cudaStream_t stream);
// The same copy of bf16 rows (2-byte elements).
cudaError_t LaunchKvOfQkv(__nv_bfloat16* kv, const __nv_bfloat16* qkv, int64_t rows,
                          int64_t channels, cudaStream_t stream);
// dqkv [rows, 3C]'s k and v columns = dkv [rows, 2C]; its q columns untouched.
cudaError_t LaunchQkvGradOfKv(float* dqkv, const float* dkv, int64_t rows, int64_t channels,
                              cudaStream_t stream);

// Overwrites out [B,Tq,C] and lse [B,heads,Tq].
cudaError_t LaunchBlockAttentionForward(float* out, float* lse, const float* qkv, const float* kv,
                                        const RingBlock& block, cudaStream_t stream);

// Merges (block_out, block_lse) into (out, lse) in place; shapes as above.
cudaError_t LaunchMergeAttentionBlock(float* out, float* lse, const float* block_out,
                                      const float* block_lse, int64_t batch, int64_t q_len,
                                      int64_t channels, int64_t heads, cudaStream_t stream);

// Overwrites delta [B,heads,Tq] from dout and out [B,Tq,C].
cudaError_t LaunchAttentionDelta(float* delta, const float* dout, const float* out, int64_t batch,
                                 int64_t q_len, int64_t channels, int64_t heads,
                                 cudaStream_t stream);

// Adds the block's dq into dqkv [B,Tq,3C] (first C columns) and dk, dv into
// dkv [B,Tk,2C]; rows (of either) that see nothing are left as they are, and
// a block no query row sees launches nothing. lse, delta: the final ones.
cudaError_t LaunchBlockAttentionBackward(float* dqkv, float* dkv, const float* dout,
                                         const float* qkv, const float* kv, const float* lse,
                                         const float* delta, const RingBlock& block,
                                         cudaStream_t stream);

// y[r·y_stride + c] = float(x[r·x_stride + c]) for r < rows, c < width
// (exact): e.g. qkv's q columns widened in place of an fp32 qkv. Strides
// ≥ width, in elements.
cudaError_t LaunchWidenColumns(float* y, int64_t y_stride, const __nv_bfloat16* x,
                               int64_t x_stride, int64_t rows, int64_t width,
                               cudaStream_t stream);

// y[r·y_stride + c] += float(x[r·x_stride + c]) (one fp32 rounding): a cuDNN
// block's bf16 dq into dqkv's q columns, its dk|dv into dkv.
cudaError_t LaunchAddWidenedColumns(float* y, int64_t y_stride, const __nv_bfloat16* x,
                                    int64_t x_stride, int64_t rows, int64_t width,
                                    cudaStream_t stream);

}  // namespace baton::cuda

#endif  // BATON_KERNELS_CUDA_RING_ATTENTION_CUH_
