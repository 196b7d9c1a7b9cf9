#include "kernels/cuda/sdpa_plan.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace baton::cuda {
namespace {

absl::Status CheckShard(const AttentionShard& s) {
  if (s.batch <= 0 || s.seq <= 0 || s.heads <= 0 || s.head_dim <= 0 ||
      s.channels != s.heads * s.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "not an attention shard: B=", s.batch, " T=", s.seq, " C'=", s.channels, " H'=", s.heads,
        " hd=", s.head_dim, " (C' must be H'·hd)"));
  }
  if (s.head_dim % kSdpaHeadDimMultiple != 0 || s.head_dim > kSdpaMaxHeadDim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuDNN SDPA needs a head dimension that is a multiple of ", kSdpaHeadDimMultiple,
        " and at most ", kSdpaMaxHeadDim, "; this one is ", s.head_dim));
  }
  if (s.seq < 2) {
    return absl::InvalidArgumentError(
        "cuDNN SDPA is not used for T = 1: the saved buffer [B,H',1,1] bf16 cannot hold the "
        "fp32 stats");
  }
  return absl::OkStatus();
}

}  // namespace

size_t SdpaStatsBytes(const AttentionShard& s) {
  return static_cast<size_t>(s.batch) * static_cast<size_t>(s.heads) *
         static_cast<size_t>(s.seq) * sizeof(float);
}

namespace {
size_t SavedOutOffset(const AttentionShard& s) {
  return (SdpaStatsBytes(s) + 255) / 256 * 256;
}
}  // namespace

size_t SdpaSavedBytes(const AttentionShard& s) {
  return SavedOutOffset(s) + static_cast<size_t>(s.batch) * static_cast<size_t>(s.seq) *
                                 static_cast<size_t>(s.channels) * 2;
}

absl::Status SdpaApplies(const AttentionShard& shard, size_t saved_bytes) {
  if (absl::Status s = CheckShard(shard); !s.ok()) return s;
  if (saved_bytes < SdpaSavedBytes(shard)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the saved-for-backward buffer has ", saved_bytes, " bytes; the SDPA stats and output "
        "need ", SdpaSavedBytes(shard)));
  }
  return absl::OkStatus();
}

absl::StatusOr<SdpaPlan> PlanSdpa(const AttentionShard& s) {
  if (absl::Status st = CheckShard(s); !st.ok()) return st;
  SdpaPlan p;
  p.shard = s;
  p.scale = PlanAttention(s).scale;  // the GEMM path's 1/√hd, bit for bit
  const int64_t c = s.channels, hd = s.head_dim, t = s.seq, h = s.heads;
  SdpaTensor qkv;
  qkv.dim = {s.batch, h, t, hd};
  qkv.stride = {t * 3 * c, hd, 3 * c, 1};
  p.q = p.k = p.v = qkv;
  p.k.offset = c;
  p.v.offset = 2 * c;
  p.o.dim = {s.batch, h, t, hd};
  p.o.stride = {t * c, hd, c, 1};
  p.stats.dim = {s.batch, h, t, 1};
  p.stats.stride = {h * t, t, 1, 1};
  p.saved_out_offset = SavedOutOffset(s);
  return p;
}

absl::Status CheckSdpaWorkspace(size_t bytes, const AttentionShard& s) {
  if (bytes <= kMaxSdpaWorkspaceBytes) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "cuDNN SDPA asks for a ", bytes, "-byte workspace (over the ", kMaxSdpaWorkspaceBytes,
      "-byte bound) for B=", s.batch, " T=", s.seq, " H'=", s.heads, " hd=", s.head_dim,
      "; use fewer sequences per microbatch"));
}

SdpaKey MakeSdpaKey(const AttentionShard& s, int device) {
  SdpaKey k;
  k.batch = s.batch;
  k.seq = s.seq;
  k.channels = s.channels;
  k.heads = s.heads;
  k.head_dim = s.head_dim;
  k.device = device;
  return k;
}

std::string SdpaKeyToString(const SdpaKey& k) {
  return absl::StrCat("sdpa B=", k.batch, " T=", k.seq, " C'=", k.channels, " H'=", k.heads,
                      " hd=", k.head_dim, " cuda:", k.device);
}

// ------------------------------------- context-parallel (ring) attention

namespace {

size_t Round256(size_t bytes) { return (bytes + 255) / 256 * 256; }

std::string BlockToString(const RingSdpaBlock& b) {
  return absl::StrCat("B=", b.batch, " Tq=", b.q_len, " Tk=", b.k_len, " C'=", b.channels,
                      " H'=", b.heads, " q_offset=", b.q_offset, " k_offset=", b.k_offset);
}

const char* MaskName(RingBlockMask m) {
  switch (m) {
    case RingBlockMask::kNone: return "fully visible";
    case RingBlockMask::kCausal: return "diagonal";
    case RingBlockMask::kPartial: return "partly visible";
    case RingBlockMask::kInvisible: return "invisible";
  }
  return "?";
}

}  // namespace

RingBlockMask RingBlockMaskOf(const RingSdpaBlock& b) {
  if (b.k_offset + b.k_len - 1 <= b.q_offset) return RingBlockMask::kNone;
  if (b.q_offset + b.q_len - 1 < b.k_offset) return RingBlockMask::kInvisible;
  if (b.q_offset == b.k_offset && b.q_len == b.k_len) return RingBlockMask::kCausal;
  return RingBlockMask::kPartial;
}

absl::Status RingSdpaApplies(const RingSdpaBlock& b) {
  if (b.batch <= 0 || b.q_len <= 0 || b.k_len <= 0 || b.heads <= 0 || b.channels <= 0 ||
      b.channels % b.heads != 0 || b.q_offset < 0 || b.k_offset < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "not a context-parallel attention block: ", BlockToString(b),
        " (lengths and H' positive, H' dividing C', offsets ≥ 0)"));
  }
  const int64_t hd = b.channels / b.heads;
  if (hd % kSdpaHeadDimMultiple != 0 || hd > kSdpaMaxHeadDim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuDNN SDPA needs a head dimension that is a multiple of ", kSdpaHeadDimMultiple,
        " and at most ", kSdpaMaxHeadDim, "; this one is ", hd));
  }
  const RingBlockMask mask = RingBlockMaskOf(b);
  if (mask != RingBlockMask::kNone && mask != RingBlockMask::kCausal) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cuDNN SDPA takes a fully visible or a diagonal block; this one is ", MaskName(mask),
        " (", BlockToString(b), ")"));
  }
  if (b.q_len < 2 || b.k_len < 2) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cuDNN SDPA is not used for a one-row block (", BlockToString(b), ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<RingSdpaPlan> PlanRingSdpa(const RingSdpaBlock& b) {
  if (absl::Status st = RingSdpaApplies(b); !st.ok()) return st;
  RingSdpaPlan p;
  p.block = b;
  const int64_t c = b.channels, h = b.heads, hd = c / h, tq = b.q_len, tk = b.k_len;
  p.head_dim = hd;
  p.causal = RingBlockMaskOf(b) == RingBlockMask::kCausal;
  p.scale = 1.0f / std::sqrt(static_cast<float>(hd));  // ring_attention.cu's and the CPU's
  p.q.dim = {b.batch, h, tq, hd};
  p.q.stride = {tq * 3 * c, hd, 3 * c, 1};
  p.k.dim = {b.batch, h, tk, hd};
  p.k.stride = {tk * 2 * c, hd, 2 * c, 1};
  p.v = p.k;
  p.v.offset = c;
  p.o.dim = {b.batch, h, tq, hd};
  p.o.stride = {tq * c, hd, c, 1};
  p.stats.dim = {b.batch, h, tq, 1};
  p.stats.stride = {h * tq, tq, 1, 1};
  const size_t o_bytes = static_cast<size_t>(b.batch) * static_cast<size_t>(tq) *
                         static_cast<size_t>(c) * 2;
  const size_t dkv_bytes = static_cast<size_t>(b.batch) * static_cast<size_t>(tk) *
                           static_cast<size_t>(2 * c) * 2;
  p.scratch.o_bytes = o_bytes;
  p.scratch.dkv_bytes = dkv_bytes;
  p.scratch.forward_workspace = Round256(o_bytes);
  p.scratch.dkv = Round256(o_bytes);
  p.scratch.backward_workspace = p.scratch.dkv + Round256(dkv_bytes);
  return p;
}

size_t RingSdpaForwardScratchBytes(const RingSdpaPlan& p, size_t workspace) {
  return p.scratch.forward_workspace + workspace;
}

size_t RingSdpaBackwardScratchBytes(const RingSdpaPlan& p, size_t workspace) {
  return p.scratch.backward_workspace + workspace;
}

absl::Status CheckRingSdpaWorkspace(size_t bytes, const RingSdpaBlock& b) {
  if (bytes <= kMaxSdpaWorkspaceBytes) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "cuDNN SDPA asks for a ", bytes, "-byte workspace (over the ", kMaxSdpaWorkspaceBytes,
      "-byte bound) for the context-parallel block ", BlockToString(b),
      "; use fewer sequences per microbatch or a larger cp"));
}

RingSdpaKey MakeRingSdpaKey(const RingSdpaPlan& p, int device) {
  RingSdpaKey k;
  k.batch = p.block.batch;
  k.q_len = p.block.q_len;
  k.k_len = p.block.k_len;
  k.channels = p.block.channels;
  k.heads = p.block.heads;
  k.causal = p.causal;
  k.device = device;
  return k;
}

std::string RingSdpaKeyToString(const RingSdpaKey& k) {
  return absl::StrCat("ring sdpa B=", k.batch, " Tq=", k.q_len, " Tk=", k.k_len, " C'=",
                      k.channels, " H'=", k.heads, k.causal ? " causal" : " unmasked", " cuda:",
                      k.device);
}

}  // namespace baton::cuda
