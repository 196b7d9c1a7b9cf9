#include "kernels/cuda/sdpa_plan.h"

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

}  // namespace baton::cuda
