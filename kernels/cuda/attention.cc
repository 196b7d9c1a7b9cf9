#include "kernels/cuda/attention.h"

#include <cuda_bf16.h>

#include "common/status_macros.h"
#include "kernels/cuda/causal_softmax.cuh"
#include "kernels/cuda/cuda_status.h"

namespace baton::cuda {
namespace {

size_t ElemSize(GemmDType t) { return t == GemmDType::kBF16 ? 2 : 4; }

const char* Offset(const void* base, int64_t elements, GemmDType t) {
  return static_cast<const char*>(base) + elements * static_cast<int64_t>(ElemSize(t));
}
char* Offset(void* base, int64_t elements, GemmDType t) {
  return static_cast<char*>(base) + elements * static_cast<int64_t>(ElemSize(t));
}

GemmArgs Args(const RowMajorGemm& shape, GemmDType ab, GemmDType c, const void* a, const void* b,
              void* out, float alpha) {
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

}  // namespace

absl::StatusOr<size_t> AttentionScratchBytes(const AttentionShard& shard, GemmDType dtype) {
  absl::StatusOr<size_t> floats = AttentionBackwardScratchBytes(shard);
  if (!floats.ok() || dtype == GemmDType::kF32) return floats;
  return *floats + *floats / 2;
}

absl::Status AttentionForward(CublasLtGemm& gemm, const AttentionPlan& plan, GemmDType dtype,
                              void* out, void* att, const void* qkv, void* scratch,
                              cudaStream_t stream) {
  const AttentionShard& s = plan.shard;
  const int64_t rows = s.heads * s.seq;
  const bool bf16 = dtype == GemmDType::kBF16;
  for (int64_t b = 0; b < s.batch; ++b) {
    const void* base = Offset(qkv, b * plan.qkv_batch_stride, dtype);
    void* p = Offset(att, b * plan.att_batch_stride, dtype);
    float* scores = bf16 ? static_cast<float*>(scratch) : static_cast<float*>(p);
    BATON_RETURN_IF_ERROR_CTX(
        gemm.Run(Args(plan.scores, dtype, GemmDType::kF32, Offset(base, plan.q_offset, dtype),
                      Offset(base, plan.k_offset, dtype), scores, plan.scale),
                 stream),
        "attention scores, batch row ", b);
    if (bf16) {
      BATON_CUDA_RETURN_IF_ERROR(LaunchCausalSoftmaxForward(static_cast<__nv_bfloat16*>(p), scores,
                                                            rows, s.seq, stream));
    } else {
      BATON_CUDA_RETURN_IF_ERROR(
          LaunchCausalSoftmaxForward(static_cast<float*>(p), scores, rows, s.seq, stream));
    }
    BATON_RETURN_IF_ERROR_CTX(
        gemm.Run(Args(plan.context, dtype, dtype, p, Offset(base, plan.v_offset, dtype),
                      Offset(out, b * plan.out_batch_stride, dtype), 1.0f),
                 stream),
        "attention context, batch row ", b);
  }
  return absl::OkStatus();
}

absl::Status AttentionBackward(CublasLtGemm& gemm, const AttentionPlan& plan, GemmDType dtype,
                               void* dqkv, void* scratch, const void* dout, const void* qkv,
                               const void* att, cudaStream_t stream) {
  const AttentionShard& s = plan.shard;
  const int64_t rows = s.heads * s.seq;
  const bool bf16 = dtype == GemmDType::kBF16;
  float* dp = static_cast<float*>(scratch);
  // dS: in place over dP (fp32) or bf16 after it.
  void* ds = bf16 ? static_cast<void*>(dp + plan.att_batch_stride) : static_cast<void*>(dp);
  for (int64_t b = 0; b < s.batch; ++b) {
    const void* base = Offset(qkv, b * plan.qkv_batch_stride, dtype);
    void* dbase = Offset(dqkv, b * plan.qkv_batch_stride, dtype);
    const void* p = Offset(att, b * plan.att_batch_stride, dtype);
    const void* d_o = Offset(dout, b * plan.out_batch_stride, dtype);
    BATON_RETURN_IF_ERROR_CTX(
        gemm.Run(Args(plan.grad_probs, dtype, GemmDType::kF32, d_o,
                      Offset(base, plan.v_offset, dtype), dp, 1.0f),
                 stream),
        "attention dP, batch row ", b);
    BATON_RETURN_IF_ERROR_CTX(
        gemm.Run(Args(plan.grad_v, dtype, dtype, p, d_o, Offset(dbase, plan.v_offset, dtype), 1.0f),
                 stream),
        "attention dv, batch row ", b);
    if (bf16) {
      BATON_CUDA_RETURN_IF_ERROR(LaunchCausalSoftmaxBackward(
          static_cast<__nv_bfloat16*>(ds), dp, static_cast<const __nv_bfloat16*>(p), rows, s.seq,
          plan.scale, stream));
    } else {
      BATON_CUDA_RETURN_IF_ERROR(LaunchCausalSoftmaxBackward(
          static_cast<float*>(ds), dp, static_cast<const float*>(p), rows, s.seq, plan.scale,
          stream));
    }
    BATON_RETURN_IF_ERROR_CTX(
        gemm.Run(Args(plan.grad_q, dtype, dtype, ds, Offset(base, plan.k_offset, dtype),
                      Offset(dbase, plan.q_offset, dtype), 1.0f),
                 stream),
        "attention dq, batch row ", b);
    BATON_RETURN_IF_ERROR_CTX(
        gemm.Run(Args(plan.grad_k, dtype, dtype, ds, Offset(base, plan.q_offset, dtype),
                      Offset(dbase, plan.k_offset, dtype), 1.0f),
                 stream),
        "attention dk, batch row ", b);
  }
  return absl::OkStatus();
}

}  // namespace baton::cuda
