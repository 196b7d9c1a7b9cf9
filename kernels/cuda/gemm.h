// GEMMs through cuBLASLt, in the row-major convention of the CPU kernels
// (plan.h maps each problem to cuBLASLt's column-major view):
//   C = α op(A) op(B) + β C   (+ epilogue), strided-batched when batch > 1
// The model's three linear GEMMs come from plan.h's Linear*Gemm:
//   forward          out = x · Wᵀ (+ bias, or GELU with the pre-activation
//                    saved to `aux`)
//   backward input   dx = dy · W  (⊙ GELU'(aux) with kDGelu)
//   backward weight  dW += dyᵀ · x  (β = 1; the bias gradient is
//                    column_reduce.cuh's deterministic sum, since cuBLASLt's
//                    BGRAD epilogues overwrite rather than accumulate)
// Precision: fp32 problems use CUBLAS_COMPUTE_32F (true fp32, never TF32);
// bf16 problems take bf16 A and B, accumulate in fp32 and write bf16 or fp32
// C (fp32 for gradients that accumulate). Split-K partials, when cuBLASLt
// chooses them, are reduced in fp32 in the workspace
// (CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE only), never in a 16-bit output.
// The chosen algorithm is cached per GemmKey, so a shape always runs the same
// algorithm: same inputs, same bits, run to run.
//
// Thread-safety: a CublasLtGemm is used from one thread (one per compute
// stream); it owns its workspace.
#ifndef BATON_KERNELS_CUDA_GEMM_H_
#define BATON_KERNELS_CUDA_GEMM_H_

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cuda/plan.h"

namespace baton::cuda {

class CublasLtGemm {
 public:
  // Creates the handle and allocates the workspace on the current device.
  static absl::StatusOr<std::unique_ptr<CublasLtGemm>> Create(
      size_t workspace_bytes = kLtWorkspaceBytes);
  // Uses `workspace` (device memory of `workspace_bytes`, owned by the
  // caller and outliving this object) instead of allocating one.
  static absl::StatusOr<std::unique_ptr<CublasLtGemm>> CreateWithWorkspace(void* workspace,
                                                                           size_t workspace_bytes);
  ~CublasLtGemm();
  CublasLtGemm(const CublasLtGemm&) = delete;
  CublasLtGemm& operator=(const CublasLtGemm&) = delete;

  // Enqueues the GEMM on `stream`. Errors name the problem (GemmKeyToString);
  // UNIMPLEMENTED when cuBLASLt has no algorithm for it (a verdict kept per
  // key: later calls answer at once).
  absl::Status Run(const GemmArgs& args, cudaStream_t stream);

  int64_t cache_hits() const { return cache_.hits(); }
  int64_t cache_misses() const { return cache_.misses(); }

 private:
  CublasLtGemm(cublasLtHandle_t handle, void* workspace, size_t workspace_bytes)
      : handle_(handle), workspace_(workspace), workspace_bytes_(workspace_bytes) {}

  cublasLtHandle_t handle_;
  void* workspace_;
  size_t workspace_bytes_;
  bool owns_workspace_ = true;
  GemmAlgoCache<cublasLtMatmulAlgo_t> cache_;
};

}  // namespace baton::cuda

#endif  // BATON_KERNELS_CUDA_GEMM_H_
