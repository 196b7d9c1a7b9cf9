// Causal self-attention on the GPU as GEMMs + a causal softmax
// (kernels/cpu/attention.h has the math), per batch row b, strided-batched
// over this rank's heads (plan.h PlanAttention, including a tensor-parallel
// shard of the heads):
//   S = q kᵀ · 1/√hd   (cuBLASLt, α = 1/√hd)
//   P = causal softmax(S)                    (causal_softmax.cuh)
//   o = P v
// Backward: dP = do vᵀ, dv = Pᵀ do, dS = P ⊙ (dP − rowsum(P ⊙ dP))/√hd,
//           dq = dS k, dk = dSᵀ q.
// fp32: every GEMM in true fp32; S and P share the att buffer [B,H',T,T].
// bf16: qkv, out, P (att), dout and dqkv are bf16; S and dP are fp32 in
//   `scratch`, dS bf16 after them. (cuDNN's fused flash attention is not used
//   yet: the cuDNN frontend is not part of this build; see docs/gpu.md.)
// The full T×T scores are materialised (O(T²) memory per head) — the price of
// the unfused path. Heads go through the GEMMs in groups as large as
// `scratch` allows (all heads of a batch row with AttentionScratchBytes; one
// head with T·T floats, the CPU kernel's scratch).
#ifndef BATON_KERNELS_CUDA_ATTENTION_H_
#define BATON_KERNELS_CUDA_ATTENTION_H_

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/plan.h"

namespace baton::cuda {

// Bytes of `scratch` for both passes to run all heads of a batch row at once:
// H'·T·T floats (S or dP), plus H'·T·T bf16 (dS) for bf16.
absl::StatusOr<size_t> AttentionScratchBytes(const AttentionShard& shard, GemmDType dtype);

// Heads per GEMM launch that `scratch_bytes` holds (≤ H'); 0 when not even
// one head fits. The fp32 forward needs no scratch (S lives in att).
int64_t AttentionHeadsPerLaunch(const AttentionShard& shard, GemmDType dtype, bool backward,
                                size_t scratch_bytes);

// qkv [B,T,3C'] → out [B,T,C'], att [B,H',T,T] keeps P. Pointers of `dtype`
// (att: fp32 or bf16 likewise).
absl::Status AttentionForward(CublasLtGemm& gemm, const AttentionPlan& plan, GemmDType dtype,
                              void* out, void* att, const void* qkv, void* scratch,
                              size_t scratch_bytes, cudaStream_t stream);

// Writes dqkv [B,T,3C'] (overwrites).
absl::Status AttentionBackward(CublasLtGemm& gemm, const AttentionPlan& plan, GemmDType dtype,
                               void* dqkv, void* scratch, size_t scratch_bytes,
                               const void* dout, const void* qkv, const void* att,
                               cudaStream_t stream);

}  // namespace baton::cuda

#endif  // BATON_KERNELS_CUDA_ATTENTION_H_
