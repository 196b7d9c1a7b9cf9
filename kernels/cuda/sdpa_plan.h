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

}  // namespace baton::cuda

#endif  // BATON_KERNELS_CUDA_SDPA_PLAN_H_
