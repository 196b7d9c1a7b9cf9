// Causal self-attention in bf16 through cuDNN's fused SDPA (flash attention),
// built with the cuDNN frontend's graph API (third_party/cudnn_frontend).
//
// Math (per batch row b and head h of this rank's shard; sdpa_plan.h has the
// tensor layouts over the packed qkv [B,T,3C']):
//   S = q kᵀ · 1/√hd,  masked causally (key j > query i → −∞)
//   stats_i = log Σ_j exp(S_ij)           (fp32, the softmax's log-sum-exp)
//   o = softmax(S) v                       (fp32 accumulation, bf16 out)
// Backward from q, k, v, o, do and stats (P is recomputed, never stored):
//   D_i = Σ_d do_id·o_id,  P = exp(S − stats),  dP = do vᵀ,
//   dS = P ⊙ (dP − D)·1/√hd,  dq = dS k,  dk = dSᵀ q,  dv = Pᵀ do.
//
// One CudnnAttention per stream: a cuDNN handle and a per-shape cache of the
// forward and backward graphs (SdpaKey: built once, on first use; the
// verdict that cuDNN cannot run a shape is cached too). Execution allocates
// nothing: the graphs' workspace is the caller's (the backend's stream
// scratch), sized by Prepare.
//
// Determinism: the backward graph asks for cuDNN's deterministic algorithm
// (SDPA_backward_attributes::set_deterministic_algorithm: dQ through the dP
// workspace instead of atomic accumulation) and both graphs drop every
// engine configuration with the NONDETERMINISTIC numerical note; the plan
// is the first that builds from heuristics mode A, so a shape on one GPU
// model with one cuDNN version always runs the same kernels.
//
// Context-parallel (ring) blocks (sdpa_plan.h RingSdpaPlan) have graphs of
// their own, cached per RingSdpaKey the same way: q read from qkv, k and v
// from a key/value block kv, no mask (a fully visible block) or the top-left
// causal mask (the diagonal). Forward: o (bf16) and Stats — cuDNN's natural-
// log log-sum-exp of the scaled, masked scores, i.e. the block's lse
// (sdpa_plan.h). Backward: given the query rows' FINAL (merged) Stats and o
// and their do, this block's dq, dk, dv (bf16) — the block's share of the
// full attention's gradient, as kernels/cpu/block_attention.h computes it
// with the final lse and δ (cuDNN forms δ = rowsum(do ⊙ o) itself).
//
// libcudnn.so.9 is opened (dlopen) at the first Create, never at process
// start: see third_party/cudnn_frontend/BUILD.
//
// Not thread-safe: one stream's ops are enqueued by one thread.
#ifndef BATON_KERNELS_CUDA_CUDNN_ATTENTION_H_
#define BATON_KERNELS_CUDA_CUDNN_ATTENTION_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <memory>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cuda/sdpa_plan.h"

struct cudnnContext;

namespace baton::cuda {

// Loads libcudnn.so.9 once per process: OK, or UNAVAILABLE naming the
// library and the loader's error (the same answer on every later call).
absl::Status LoadCudnn();

// cuDNN's fused SDPA runs on compute capability 8.0 (Ampere) and newer
// (cuDNN's support matrix); on older GPUs every graph build fails.
inline constexpr int kSdpaMinComputeCapabilityMajor = 8;

// Whether bf16 attention on `device` can take the fused path at all, before
// any shape: OK when its compute capability is at least
// kSdpaMinComputeCapabilityMajor.0 and libcudnn loads (LoadCudnn); otherwise
// UNAVAILABLE (the GPU cannot be asked, or no libcudnn) or FAILED_PRECONDITION
// (the GPU is too old), saying why. Creates no context and no handle. The CUDA
// backend asks this before it creates a stream's CudnnAttention, and the
// worker registers its answer (RegisterRequest.fused_attention_bf16).
absl::Status ProbeCudnnAttention(int device);

class CudnnAttention {
 public:
  // A handle on `device` (made current by the caller). UNAVAILABLE when
  // libcudnn cannot be loaded or cudnnCreate fails.
  static absl::StatusOr<std::unique_ptr<CudnnAttention>> Create(int device);
  ~CudnnAttention();
  CudnnAttention(const CudnnAttention&) = delete;
  CudnnAttention& operator=(const CudnnAttention&) = delete;

  // Builds the forward and backward graphs of `plan`'s shape (first call per
  // shape) and returns the workspace bytes the larger of the two needs; an
  // error (cached) when cuDNN cannot run that shape on this GPU.
  absl::StatusOr<size_t> Prepare(const SdpaPlan& plan);

  // out [B,T,C'] (o); stats as plan.stats. bf16 except stats (fp32).
  absl::Status Forward(const SdpaPlan& plan, void* out, float* stats, const void* qkv,
                       void* workspace, size_t workspace_bytes, cudaStream_t stream);
  // dqkv [B,T,3C'] (overwritten) from dout, qkv, out (o) and stats.
  absl::Status Backward(const SdpaPlan& plan, void* dqkv, const void* dout, const void* qkv,
                        const void* out, const float* stats, void* workspace,
                        size_t workspace_bytes, cudaStream_t stream);

  size_t cached_shapes() const { return cache_.size(); }

  // ---- context-parallel (ring) blocks ----

  // Builds the forward and backward graphs of `plan`'s key (first call per
  // key) and returns their workspaces; an error (cached) when cuDNN cannot
  // run that block shape on this GPU.
  absl::StatusOr<RingSdpaWorkspace> PrepareRing(const RingSdpaPlan& plan);
  // out: the block's o, [B,Tq,C'] bf16 (plan.o); stats: the block's lse
  // [B,H',Tq] fp32 (plan.stats); qkv [B,Tq,3C'] and kv [B,Tk,2C'] bf16.
  absl::Status RingForward(const RingSdpaPlan& plan, void* out, float* stats, const void* qkv,
                           const void* kv, void* workspace, size_t workspace_bytes,
                           cudaStream_t stream);
  // dq [B,Tq,C'] and dkv [B,Tk,2C'] bf16 (overwritten) from dout and out
  // (the final merged o), [B,Tq,C'] bf16, qkv, kv and stats (the final lse).
  absl::Status RingBackward(const RingSdpaPlan& plan, void* dq, void* dkv, const void* dout,
                            const void* out, const void* qkv, const void* kv, const float* stats,
                            void* workspace, size_t workspace_bytes, cudaStream_t stream);

  size_t cached_ring_shapes() const { return ring_cache_.size(); }

 private:
  struct Graphs;
  CudnnAttention(cudnnContext* handle, int device);
  absl::StatusOr<Graphs*> Find(const SdpaPlan& plan);
  absl::StatusOr<Graphs*> FindRing(const RingSdpaPlan& plan);

  cudnnContext* handle_;
  int device_;
  absl::flat_hash_map<SdpaKey, std::unique_ptr<Graphs>> cache_;
  absl::flat_hash_map<RingSdpaKey, std::unique_ptr<Graphs>> ring_cache_;
};

}  // namespace baton::cuda

#endif  // BATON_KERNELS_CUDA_CUDNN_ATTENTION_H_
