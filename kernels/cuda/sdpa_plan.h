// Host-side plan of cuDNN's fused attention (SDPA) over baton's packed qkv
// layout, free of CUDA and cuDNN headers so CI tests it without a GPU
// (kernels/cuda/sdpa_plan_test.cc). kernels/cuda/cudnn_attention.h builds the
// cuDNN graphs from it.
//
// cuDNN's SDPA takes 4-D tensors [B, H, T, D] with arbitrary strides. A
// (tensor-parallel) shard's qkv is [B, T, 3C'] row-major with q | k | v
// thirds of width C' = H'·hd, head h's q at columns h·hd … h·hd+hd−1, so
//   Q: dims [B, H', T, hd], strides [T·3C', hd, 3C', 1], offset 0
//   K: the same strides, offset C';   V: offset 2C'
//   O (and dO): out [B, T, C'] → strides [T·C', hd, C', 1]
//   dQ, dK, dV: in dqkv, as Q, K, V in qkv
//   Stats (softmax log-sum-exp per query row, fp32): [B, H', T, 1] packed,
//     strides [H'·T, T, 1, 1] — what the backward needs in place of P.
// Offsets are in elements from the buffer's base (bf16: 2 bytes each).
//
// What the backward needs besides qkv and dout is the stats and o; the
// backend's attention ops receive neither o nor a stats tensor, only the
// saved-for-backward buffer `att`. So the fused path keeps both in it:
//   bytes [0, B·H'·T·4)                          stats (fp32)
//   bytes [saved_out_offset, + B·T·C'·2)         a copy of o (out's layout)
// SdpaSavedBytes in all. The model allocates `att` of just that size where
// the fused path runs (attention.h AttentionSaved, kernels::
// AttentionBuffersFor), P's size (bf16 [B, H', T, T]) elsewhere; SdpaApplies
// says whether a given `att` can take the fused path.
//
// Context-parallel (ring) attention (kernels/ops.h, ring_attention.cuh) runs
// one (query block, key/value block) pair at a time: q from a bf16 qkv
// [B,Tq,3C'], k and v from a bf16 key/value block kv [B,Tk,2C'] (KvOfQkv's
// layout). PlanRingSdpa lays one pair out for cuDNN:
//   Q: dims [B, H', Tq, hd], strides [Tq·3C', hd, 3C', 1], offset 0 (in qkv)
//   K: dims [B, H', Tk, hd], strides [Tk·2C', hd, 2C', 1], offset 0 (in kv)
//   V: as K, offset C'
//   O, dO: [B,Tq,C'] → strides [Tq·C', hd, C', 1] (bf16; the final merged
//     output and its gradient in the backward)
//   Stats: the op's lse [B,H',Tq] fp32, [B,H',Tq,1] strides [H'·Tq, Tq, 1, 1]
//   dQ: a bf16 [B,Tq,C'] temporary, O's layout
//   dK, dV: a bf16 [B,Tk,2C'] temporary, K's and V's layout
// Query row i sits at global position q_offset + i, key j at k_offset + j,
// and j is visible to i iff k_offset + j ≤ q_offset + i. cuDNN's masks are
// for whole blocks only (RingSdpaApplies):
//   fully visible (k_offset + Tk − 1 ≤ q_offset): no mask;
//   the diagonal (q_offset = k_offset, Tq = Tk): causal, top-left aligned
//     (cuDNN's set_causal_mask: j visible iff j ≤ i);
// any other block (partly visible, or seen by no row) is not cuDNN's: the
// backend runs its fp32 kernels there. cuDNN's Stats is what our lse is:
// the frontend computes it as max_j S_ij + log Σ_j exp(S_ij − max) with
// S = q kᵀ · attn_scale after the mask (natural log; node/softmax.h), and
// its backward recomputes P = exp(S − Stats) — so the backward takes the
// FINAL merged lse and o of the query rows and gives this block's share of
// dq, dk, dv (as kernels/cpu/block_attention.h's backward with the final lse
// and δ = rowsum(dO ⊙ O), which cuDNN forms from O itself).
#ifndef BATON_KERNELS_CUDA_SDPA_PLAN_H_
#define BATON_KERNELS_CUDA_SDPA_PLAN_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cuda/plan.h"

namespace baton::cuda {

// One SDPA tensor as the cuDNN graph is told it.
struct SdpaTensor {
  std::array<int64_t, 4> dim = {};
  std::array<int64_t, 4> stride = {};
  int64_t offset = 0;  // elements from the buffer's base
};

struct SdpaPlan {
  AttentionShard shard;
  float scale = 0;          // 1/√hd
  SdpaTensor q, k, v;       // in qkv; dq, dk, dv the same in dqkv
  SdpaTensor o;             // in out; do the same in dout
  SdpaTensor stats;         // fp32, at byte 0 of the saved buffer
  size_t saved_out_offset = 0;  // bytes: o's copy in the saved buffer (256-aligned)
};

// The largest head dimension and the divisor it needs (cuDNN's bf16 SDPA:
// d ≤ 256, a multiple of 8, i.e. 16-byte rows).
inline constexpr int64_t kSdpaMaxHeadDim = 256;
inline constexpr int64_t kSdpaHeadDimMultiple = 8;
// Refuse a cuDNN workspace above this (the frontend's dP workspace for the
// deterministic backward is B·H'·⌈T/64⌉·64·⌈T/64⌉·64·2 bytes plus its own; a
// request beyond this is a shape bug or a plan we should not pick).
inline constexpr size_t kMaxSdpaWorkspaceBytes = size_t{8} << 30;

// Whether the fused path can take this shard with `saved_bytes` for the
// saved buffer: OK, or INVALID_ARGUMENT/FAILED_PRECONDITION saying why not
// (head dimension, T < 2, stats and o not fitting). The caller then takes the
// GEMM + softmax path.
absl::Status SdpaApplies(const AttentionShard& shard, size_t saved_bytes);

// The plan; fails as SdpaApplies does on a shard it cannot take (with
// saved_bytes unchecked).
absl::StatusOr<SdpaPlan> PlanSdpa(const AttentionShard& shard);

// B·H'·T floats.
size_t SdpaStatsBytes(const AttentionShard& shard);
// The saved buffer the fused path needs: the stats, padding to 256 bytes,
// then o (B·T·C' bf16).
size_t SdpaSavedBytes(const AttentionShard& shard);

// OK when `bytes` (the graph's workspace) is at most kMaxSdpaWorkspaceBytes.
absl::Status CheckSdpaWorkspace(size_t bytes, const AttentionShard& shard);

// Identifies one pair of cuDNN graphs (forward and backward): everything the
// graphs' dims and strides depend on, and the device (plans are per GPU).
struct SdpaKey {
  int64_t batch = 0, seq = 0, channels = 0, heads = 0, head_dim = 0;
  int device = 0;

  bool operator==(const SdpaKey& o) const {
    return batch == o.batch && seq == o.seq && channels == o.channels && heads == o.heads &&
           head_dim == o.head_dim && device == o.device;
  }
  template <typename H>
  friend H AbslHashValue(H h, const SdpaKey& k) {
    return H::combine(std::move(h), k.batch, k.seq, k.channels, k.heads, k.head_dim, k.device);
  }
};
SdpaKey MakeSdpaKey(const AttentionShard& shard, int device);
std::string SdpaKeyToString(const SdpaKey& key);

// ------------------------------------- context-parallel (ring) attention

// One (query block, key/value block) pair, as kernels/ops.h's BlockAttention
// takes it: qkv [batch, q_len, 3·channels], kv [batch, k_len, 2·channels].
struct RingSdpaBlock {
  int64_t batch = 0, q_len = 0, k_len = 0;
  int64_t channels = 0;  // C' (q's width)
  int64_t heads = 0;     // H'
  int64_t q_offset = 0, k_offset = 0;
};

// The pair's visibility, from its offsets and lengths.
enum class RingBlockMask : uint8_t {
  kNone = 0,      // every row sees every key: k_offset + Tk − 1 ≤ q_offset
  kCausal = 1,    // the diagonal: q_offset = k_offset and Tq = Tk
  kPartial = 2,   // some rows see some keys (not cuDNN's)
  kInvisible = 3  // no row sees any key: q_offset + Tq − 1 < k_offset
};
RingBlockMask RingBlockMaskOf(const RingSdpaBlock& block);

// The stream scratch of a cuDNN block (byte offsets, each 256-aligned):
//   forward:  o [B,Tq,C'] bf16 at 0, cuDNN's workspace at forward_workspace
//   backward: dq [B,Tq,C'] bf16 at 0, dk|dv [B,Tk,2C'] bf16 at dkv,
//             cuDNN's workspace at backward_workspace
struct RingSdpaScratch {
  size_t o_bytes = 0;             // = dq's bytes
  size_t dkv_bytes = 0;
  size_t forward_workspace = 0;   // offset
  size_t dkv = 0;                 // offset (backward)
  size_t backward_workspace = 0;  // offset
};

struct RingSdpaPlan {
  RingSdpaBlock block;
  int64_t head_dim = 0;
  bool causal = false;      // the diagonal: cuDNN's top-left causal mask; else no mask
  float scale = 0;          // 1/√hd, the fp32 kernels' bits
  SdpaTensor q;             // in qkv
  SdpaTensor k, v;          // in kv; dk, dv the same in the dkv temporary
  SdpaTensor o;             // in o and dO; dq the same in the dq temporary
  SdpaTensor stats;         // the op's lse, fp32
  RingSdpaScratch scratch;  // the temporaries' place in the stream scratch
};

// cuDNN's workspace bytes for one ring block's graphs (CudnnAttention::
// PrepareRing).
struct RingSdpaWorkspace {
  size_t forward = 0;
  size_t backward = 0;
};

// Whether cuDNN can take the block: OK for a fully visible or diagonal block
// with hd = C'/H' a multiple of kSdpaHeadDimMultiple, at most kSdpaMaxHeadDim,
// and Tq, Tk ≥ 2 (a one-row block is cuDNN's decode mode, with limits of its
// own, and gains nothing); otherwise INVALID_ARGUMENT (not a block, or a
// head dimension cuDNN refuses) or FAILED_PRECONDITION (a partly visible or
// invisible block, or one row), saying why. The caller then runs the fp32
// kernels on the widened inputs.
absl::Status RingSdpaApplies(const RingSdpaBlock& block);

// The plan; fails as RingSdpaApplies does.
absl::StatusOr<RingSdpaPlan> PlanRingSdpa(const RingSdpaBlock& block);

// Stream scratch bytes the forward / backward need with cuDNN's workspace of
// `workspace` bytes: the temporaries, then the workspace.
size_t RingSdpaForwardScratchBytes(const RingSdpaPlan& plan, size_t workspace);
size_t RingSdpaBackwardScratchBytes(const RingSdpaPlan& plan, size_t workspace);

// OK when `bytes` (a ring graph's workspace) is at most kMaxSdpaWorkspaceBytes.
absl::Status CheckRingSdpaWorkspace(size_t bytes, const RingSdpaBlock& block);

// Identifies one pair of ring graphs (forward and backward): the dims and
// strides depend on B, Tq, Tk, C', H' (hd = C'/H'), the mask on `causal`;
// the offsets only choose the mask. Plans are per GPU.
struct RingSdpaKey {
  int64_t batch = 0, q_len = 0, k_len = 0, channels = 0, heads = 0;
  bool causal = false;
  int device = 0;

  bool operator==(const RingSdpaKey& o) const {
    return batch == o.batch && q_len == o.q_len && k_len == o.k_len && channels == o.channels &&
           heads == o.heads && causal == o.causal && device == o.device;
  }
  template <typename H>
  friend H AbslHashValue(H h, const RingSdpaKey& k) {
    return H::combine(std::move(h), k.batch, k.q_len, k.k_len, k.channels, k.heads, k.causal,
                      k.device);
  }
};
RingSdpaKey MakeRingSdpaKey(const RingSdpaPlan& plan, int device);
std::string RingSdpaKeyToString(const RingSdpaKey& key);

}  // namespace baton::cuda

#endif  // BATON_KERNELS_CUDA_SDPA_PLAN_H_
