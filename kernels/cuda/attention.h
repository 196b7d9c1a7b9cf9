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
//   `scratch`, dS bf16 after them.
// The full T×T scores are materialised (O(T²) memory per head) — the price of
// the unfused path. Heads go through the GEMMs in groups as large as
// `scratch` allows (all heads of a batch row with AttentionScratchBytes; one
// head with T·T floats, the CPU kernel's scratch).
//
// Two paths, one API (the overloads taking a CudnnAttention*, which the CUDA
// backend calls): bf16 runs cuDNN's fused SDPA (cudnn_attention.h: no T×T
// tensor, P recomputed in the backward from the softmax stats) when the
// build has cuDNN, libcudnn loads, the shape suits it and `att` can hold the
// stats and a copy of o (sdpa_plan.h); everything else — fp32 always — runs
// the GEMM + softmax path above. The model sizes `att` for the path it will
// take (ChooseAttentionToSave, AttentionSaved; kernels::AttentionBuffersFor),
// so the fused path never allocates the T×T probabilities. The choice is a function of (shape, dtype,
// att's size, cuDNN's cached verdict for the shape), so a backward always
// takes its forward's path. The CPU backend is unaffected: it stays the bf16
// reference with P rounded; the fused path is held to it within the bf16
// attention bound, 3e-2 (cudnn_attention_test).
#ifndef BATON_KERNELS_CUDA_ATTENTION_H_
#define BATON_KERNELS_CUDA_ATTENTION_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
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

// The GEMM + softmax path:
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

// ------------------------------------------------- the path chosen per shape

class CudnnAttention;  // cudnn_attention.h; only in builds with cuDNN
struct CudnnAttentionDeleter {
  void operator()(CudnnAttention* p) const;
};
using CudnnAttentionPtr = std::unique_ptr<CudnnAttention, CudnnAttentionDeleter>;

// cuDNN state for one stream on `device` (current): UNAVAILABLE when this
// build has no cuDNN or libcudnn cannot be loaded (the caller then passes
// null below and every shape takes the GEMM path).
absl::StatusOr<CudnnAttentionPtr> CreateCudnnAttention(int device);

// The device-level half of the choice, for every shape at once:
// ProbeCudnnAttention (compute capability, libcudnn loads) in builds with
// cuDNN, UNAVAILABLE otherwise. The CUDA backend creates a stream's
// CudnnAttention only where this is OK (and reports it as
// kernels::ProbeFusedAttention).
absl::Status ProbeCudnnAttentionOn(int device);

enum class AttentionPath : uint8_t { kGemmSoftmax = 0, kCudnnSdpa = 1 };
struct AttentionChoice {
  AttentionPath path = AttentionPath::kGemmSoftmax;
  size_t scratch_bytes = 0;  // for that path: AttentionScratchBytes, or cuDNN's workspace
  std::string why_not_cudnn;  // empty when cuDNN runs it
};

// The path for (shard, dtype) with a saved buffer `att` of `att_bytes`:
// cuDNN SDPA for bf16 when `cudnn` is non-null, SdpaApplies and cuDNN builds
// both graphs for the shape (first call per shape: built and cached); the
// GEMM path otherwise. Errors only for a shard the GEMM path refuses too.
absl::StatusOr<AttentionChoice> ChooseAttention(CudnnAttention* cudnn, const AttentionShard& shard,
                                                GemmDType dtype, size_t att_bytes);

// The saved buffer (`att`) as the model allocates it for `path`: dims and
// element type. The GEMM path keeps P, [B,H',T,T] of dtype; cuDNN SDPA keeps
// the softmax stats and a copy of o (SdpaSavedBytes: B·H'·T·4 bytes, padding
// to 256, B·T·C'·2 bytes) as one flat bf16 buffer of SdpaSavedBytes/2
// elements — for GPT-2 small (T 1024, 12 heads of 64) 1.5 MiB per sequence
// and layer instead of P's 24 MiB.
struct AttentionSavedShape {
  std::vector<int64_t> dims;
  GemmDType dtype = GemmDType::kF32;
  size_t bytes() const;
};
AttentionSavedShape AttentionSaved(AttentionPath path, const AttentionShard& shard,
                                   GemmDType dtype);

// The path for (shard, dtype) on `cudnn`'s stream when the saved buffer is
// exactly what that path needs: ChooseAttention with SdpaSavedBytes(shard)
// (the fused path's need). Forward and backward given an att of
// AttentionSaved(path) bytes choose the same path again: the verdict is a
// function of (cudnn, shard, dtype) and cuDNN's cached verdict per shape.
absl::StatusOr<AttentionChoice> ChooseAttentionToSave(CudnnAttention* cudnn,
                                                      const AttentionShard& shard,
                                                      GemmDType dtype);

// Forward / backward on ChooseAttention's path; `scratch` holds at least its
// scratch_bytes. With the fused path `att` holds the stats and o's copy
// instead of P.
absl::Status AttentionForward(CublasLtGemm& gemm, CudnnAttention* cudnn, const AttentionPlan& plan,
                              GemmDType dtype, void* out, void* att, size_t att_bytes,
                              const void* qkv, void* scratch, size_t scratch_bytes,
                              cudaStream_t stream);
absl::Status AttentionBackward(CublasLtGemm& gemm, CudnnAttention* cudnn,
                               const AttentionPlan& plan, GemmDType dtype, void* dqkv,
                               void* scratch, size_t scratch_bytes, const void* dout,
                               const void* qkv, const void* att, size_t att_bytes,
                               cudaStream_t stream);

}  // namespace baton::cuda

#endif  // BATON_KERNELS_CUDA_ATTENTION_H_
