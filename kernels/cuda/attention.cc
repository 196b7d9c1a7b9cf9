#include "kernels/cuda/attention.h"

#include <cuda_bf16.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/causal_softmax.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/sdpa_plan.h"

#ifdef BATON_HAVE_CUDNN
#include "kernels/cuda/cudnn_attention.h"
#endif

namespace baton::cuda {
namespace {

size_t ElemSize(GemmDType t) { return t == GemmDType::kBF16 ? 2 : 4; }

const char* Offset(const void* base, int64_t elements, GemmDType t) {
  return static_cast<const char*>(base) + elements * static_cast<int64_t>(ElemSize(t));
}
char* Offset(void* base, int64_t elements, GemmDType t) {
  return static_cast<char*>(base) + elements * static_cast<int64_t>(ElemSize(t));
}

// The plan's GEMM over `heads` heads starting at head h0 (pointers are offset
// by the caller).
GemmArgs Args(RowMajorGemm shape, int64_t heads, GemmDType ab, GemmDType c, const void* a,
              const void* b, void* out, float alpha) {
  shape.batch = heads;
  GemmArgs g;
  g.shape = shape;
  g.ab_type = ab;
  g.c_type = c;
  g.a = a;
  g.b = b;
  g.c = out;
  g.alpha = alpha;
  return g;
}

size_t BytesPerHead(const AttentionShard& s, GemmDType dtype) {
  const size_t tt = static_cast<size_t>(s.seq) * static_cast<size_t>(s.seq);
  return tt * (dtype == GemmDType::kBF16 ? 6 : 4);
}

absl::StatusOr<int64_t> Group(const AttentionShard& s, GemmDType dtype, bool backward,
                              size_t scratch_bytes) {
  const int64_t group = AttentionHeadsPerLaunch(s, dtype, backward, scratch_bytes);
  if (group > 0) return group;
  return absl::InvalidArgumentError(absl::StrCat(
      "attention scratch of ", scratch_bytes, " bytes holds less than one head (", BytesPerHead(s, dtype),
      " bytes for T=", s.seq, "); give AttentionScratchBytes for one launch per batch row"));
}

}  // namespace

absl::StatusOr<size_t> AttentionScratchBytes(const AttentionShard& shard, GemmDType dtype) {
  absl::StatusOr<size_t> floats = AttentionBackwardScratchBytes(shard);
  if (!floats.ok() || dtype == GemmDType::kF32) return floats;
  return *floats + *floats / 2;
}

int64_t AttentionHeadsPerLaunch(const AttentionShard& s, GemmDType dtype, bool backward,
                                size_t scratch_bytes) {
  if (!backward && dtype == GemmDType::kF32) return s.heads;
  const size_t per_head = BytesPerHead(s, dtype);
  return std::min<int64_t>(s.heads, static_cast<int64_t>(scratch_bytes / per_head));
}

absl::Status AttentionForward(CublasLtGemm& gemm, const AttentionPlan& plan, GemmDType dtype,
                              void* out, void* att, const void* qkv, void* scratch,
                              size_t scratch_bytes, cudaStream_t stream) {
  const AttentionShard& s = plan.shard;
  const bool bf16 = dtype == GemmDType::kBF16;
  BATON_ASSIGN_OR_RETURN(const int64_t group, Group(s, dtype, false, scratch_bytes));
  const int64_t hd = s.head_dim;
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h0 = 0; h0 < s.heads; h0 += group) {
      const int64_t g = std::min(group, s.heads - h0);
      const void* base = Offset(qkv, b * plan.qkv_batch_stride + h0 * hd, dtype);
      void* p = Offset(att, b * plan.att_batch_stride + h0 * plan.att_head_stride, dtype);
      float* scores = bf16 ? static_cast<float*>(scratch) : static_cast<float*>(p);
      BATON_RETURN_IF_ERROR_CTX(
          gemm.Run(Args(plan.scores, g, dtype, GemmDType::kF32, Offset(base, plan.q_offset, dtype),
                        Offset(base, plan.k_offset, dtype), scores, plan.scale),
                   stream),
          "attention scores, batch row ", b, " head ", h0);
      if (bf16) {
        BATON_CUDA_RETURN_IF_ERROR(LaunchCausalSoftmaxForward(
            static_cast<__nv_bfloat16*>(p), scores, g * s.seq, s.seq, stream));
      } else {
        BATON_CUDA_RETURN_IF_ERROR(
            LaunchCausalSoftmaxForward(static_cast<float*>(p), scores, g * s.seq, s.seq, stream));
      }
      BATON_RETURN_IF_ERROR_CTX(
          gemm.Run(Args(plan.context, g, dtype, dtype, p, Offset(base, plan.v_offset, dtype),
                        Offset(out, b * plan.out_batch_stride + h0 * hd, dtype), 1.0f),
                   stream),
          "attention context, batch row ", b, " head ", h0);
    }
  }
  return absl::OkStatus();
}

absl::Status AttentionBackward(CublasLtGemm& gemm, const AttentionPlan& plan, GemmDType dtype,
                               void* dqkv, void* scratch, size_t scratch_bytes, const void* dout,
                               const void* qkv, const void* att, cudaStream_t stream) {
  const AttentionShard& s = plan.shard;
  const bool bf16 = dtype == GemmDType::kBF16;
  BATON_ASSIGN_OR_RETURN(const int64_t group, Group(s, dtype, true, scratch_bytes));
  const int64_t hd = s.head_dim;
  float* dp = static_cast<float*>(scratch);
  // dS: in place over dP (fp32) or bf16 after the group's dP.
  void* ds = bf16 ? static_cast<void*>(dp + group * plan.att_head_stride) : static_cast<void*>(dp);
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h0 = 0; h0 < s.heads; h0 += group) {
      const int64_t g = std::min(group, s.heads - h0);
      const void* base = Offset(qkv, b * plan.qkv_batch_stride + h0 * hd, dtype);
      void* dbase = Offset(dqkv, b * plan.qkv_batch_stride + h0 * hd, dtype);
      const void* p = Offset(att, b * plan.att_batch_stride + h0 * plan.att_head_stride, dtype);
      const void* d_o = Offset(dout, b * plan.out_batch_stride + h0 * hd, dtype);
      BATON_RETURN_IF_ERROR_CTX(
          gemm.Run(Args(plan.grad_probs, g, dtype, GemmDType::kF32, d_o,
                        Offset(base, plan.v_offset, dtype), dp, 1.0f),
                   stream),
          "attention dP, batch row ", b, " head ", h0);
      BATON_RETURN_IF_ERROR_CTX(
          gemm.Run(Args(plan.grad_v, g, dtype, dtype, p, d_o, Offset(dbase, plan.v_offset, dtype),
                        1.0f),
                   stream),
          "attention dv, batch row ", b, " head ", h0);
      if (bf16) {
        BATON_CUDA_RETURN_IF_ERROR(LaunchCausalSoftmaxBackward(
            static_cast<__nv_bfloat16*>(ds), dp, static_cast<const __nv_bfloat16*>(p), g * s.seq,
            s.seq, plan.scale, stream));
      } else {
        BATON_CUDA_RETURN_IF_ERROR(LaunchCausalSoftmaxBackward(
            static_cast<float*>(ds), dp, static_cast<const float*>(p), g * s.seq, s.seq,
            plan.scale, stream));
      }
      BATON_RETURN_IF_ERROR_CTX(
          gemm.Run(Args(plan.grad_q, g, dtype, dtype, ds, Offset(base, plan.k_offset, dtype),
                        Offset(dbase, plan.q_offset, dtype), 1.0f),
                   stream),
          "attention dq, batch row ", b, " head ", h0);
      BATON_RETURN_IF_ERROR_CTX(
          gemm.Run(Args(plan.grad_k, g, dtype, dtype, ds, Offset(base, plan.q_offset, dtype),
                        Offset(dbase, plan.k_offset, dtype), 1.0f),
                   stream),
          "attention dk, batch row ", b, " head ", h0);
    }
  }
  return absl::OkStatus();
}

// ------------------------------------------------- the path chosen per shape

#ifdef BATON_HAVE_CUDNN

void CudnnAttentionDeleter::operator()(CudnnAttention* p) const { delete p; }

absl::StatusOr<CudnnAttentionPtr> CreateCudnnAttention(int device) {
  BATON_ASSIGN_OR_RETURN(std::unique_ptr<CudnnAttention> a, CudnnAttention::Create(device));
  return CudnnAttentionPtr(a.release());
}

absl::Status ProbeCudnnAttentionOn(int device) { return ProbeCudnnAttention(device); }

#else

void CudnnAttentionDeleter::operator()(CudnnAttention*) const {}

absl::StatusOr<CudnnAttentionPtr> CreateCudnnAttention(int) {
  return absl::UnavailableError(
      "this build has no cuDNN (no cudnn.h in the CUDA toolkit it was built with); bf16 "
      "attention runs as GEMMs + softmax");
}

absl::Status ProbeCudnnAttentionOn(int) { return CreateCudnnAttention(0).status(); }

#endif

absl::StatusOr<AttentionChoice> ChooseAttention(CudnnAttention* cudnn, const AttentionShard& shard,
                                                GemmDType dtype, size_t att_bytes) {
  AttentionChoice c;
  if (dtype != GemmDType::kBF16) {
    c.why_not_cudnn = "fp32 attention runs as true-fp32 GEMMs + softmax";
  } else if (cudnn == nullptr) {
    c.why_not_cudnn = "no cuDNN on this stream";
  } else if (absl::Status s = SdpaApplies(shard, att_bytes); !s.ok()) {
    c.why_not_cudnn = std::string(s.message());
  } else {
#ifdef BATON_HAVE_CUDNN
    absl::StatusOr<SdpaPlan> plan = PlanSdpa(shard);
    absl::StatusOr<size_t> ws = plan.ok() ? cudnn->Prepare(*plan) : plan.status();
    if (ws.ok()) {
      c.path = AttentionPath::kCudnnSdpa;
      c.scratch_bytes = *ws;
      return c;
    }
    c.why_not_cudnn = std::string(ws.status().message());
#else
    c.why_not_cudnn = "no cuDNN in this build";
#endif
  }
  BATON_ASSIGN_OR_RETURN(c.scratch_bytes, AttentionScratchBytes(shard, dtype));
  return c;
}

size_t AttentionSavedShape::bytes() const {
  size_t n = ElemSize(dtype);
  for (int64_t d : dims) n *= static_cast<size_t>(d);
  return n;
}

AttentionSavedShape AttentionSaved(AttentionPath path, const AttentionShard& shard,
                                   GemmDType dtype) {
  AttentionSavedShape saved;
  if (path == AttentionPath::kCudnnSdpa) {
    saved.dtype = GemmDType::kBF16;
    saved.dims = {static_cast<int64_t>((SdpaSavedBytes(shard) + 1) / 2)};
  } else {
    saved.dtype = dtype;
    saved.dims = {shard.batch, shard.heads, shard.seq, shard.seq};
  }
  return saved;
}

absl::StatusOr<AttentionChoice> ChooseAttentionToSave(CudnnAttention* cudnn,
                                                      const AttentionShard& shard,
                                                      GemmDType dtype) {
  return ChooseAttention(cudnn, shard, dtype, SdpaSavedBytes(shard));
}

absl::Status AttentionForward(CublasLtGemm& gemm, CudnnAttention* cudnn, const AttentionPlan& plan,
                              GemmDType dtype, void* out, void* att, size_t att_bytes,
                              const void* qkv, void* scratch, size_t scratch_bytes,
                              cudaStream_t stream) {
  BATON_ASSIGN_OR_RETURN(const AttentionChoice c,
                         ChooseAttention(cudnn, plan.shard, dtype, att_bytes));
  if (c.path == AttentionPath::kGemmSoftmax) {
    return AttentionForward(gemm, plan, dtype, out, att, qkv, scratch, scratch_bytes, stream);
  }
#ifdef BATON_HAVE_CUDNN
  BATON_ASSIGN_OR_RETURN(const SdpaPlan sdpa, PlanSdpa(plan.shard));
  BATON_RETURN_IF_ERROR(cudnn->Forward(sdpa, out, static_cast<float*>(att), qkv, scratch,
                                       scratch_bytes, stream));
  // o's copy for the backward (it receives att, not out).
  const size_t o_bytes = static_cast<size_t>(plan.shard.batch * plan.shard.seq *
                                             plan.shard.channels) * 2;
  BATON_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(static_cast<char*>(att) + sdpa.saved_out_offset,
                                             out, o_bytes, cudaMemcpyDeviceToDevice, stream));
  return absl::OkStatus();
#else
  return absl::InternalError("cuDNN path chosen in a build without cuDNN");
#endif
}

absl::Status AttentionBackward(CublasLtGemm& gemm, CudnnAttention* cudnn,
                               const AttentionPlan& plan, GemmDType dtype, void* dqkv,
                               void* scratch, size_t scratch_bytes, const void* dout,
                               const void* qkv, const void* att, size_t att_bytes,
                               cudaStream_t stream) {
  BATON_ASSIGN_OR_RETURN(const AttentionChoice c,
                         ChooseAttention(cudnn, plan.shard, dtype, att_bytes));
  if (c.path == AttentionPath::kGemmSoftmax) {
    return AttentionBackward(gemm, plan, dtype, dqkv, scratch, scratch_bytes, dout, qkv, att,
                             stream);
  }
#ifdef BATON_HAVE_CUDNN
  BATON_ASSIGN_OR_RETURN(const SdpaPlan sdpa, PlanSdpa(plan.shard));
  return cudnn->Backward(sdpa, dqkv, dout, qkv,
                         static_cast<const char*>(att) + sdpa.saved_out_offset,
                         static_cast<const float*>(att), scratch, scratch_bytes, stream);
#else
  return absl::InternalError("cuDNN path chosen in a build without cuDNN");
#endif
}

}  // namespace baton::cuda
