#include "kernels/cuda/ring_sdpa.h"

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

#ifdef BATON_HAVE_CUDNN
#include "kernels/cuda/cudnn_attention.h"
#endif

namespace baton::cuda {

RingSdpaChoice ChooseRingSdpa(CudnnAttention* cudnn, const RingSdpaBlock& block,
                              std::initializer_list<const void*> pointers) {
  RingSdpaChoice c;
  if (absl::Status s = RingSdpaApplies(block); !s.ok()) {
    c.why_not_cudnn = std::string(s.message());
    return c;
  }
  if (cudnn == nullptr) {
    c.why_not_cudnn = "no cuDNN on this stream";
    return c;
  }
  c.expected = false;
  for (const void* p : pointers) {
    if (reinterpret_cast<uintptr_t>(p) % kRingSdpaAlignment != 0) {
      c.why_not_cudnn = absl::StrCat("a tensor of the block is not ", kRingSdpaAlignment,
                                     "-byte aligned (allocate whole rows of 8 channels)");
      return c;
    }
  }
#ifdef BATON_HAVE_CUDNN
  absl::StatusOr<RingSdpaPlan> plan = PlanRingSdpa(block);
  absl::StatusOr<RingSdpaWorkspace> ws = plan.ok() ? cudnn->PrepareRing(*plan) : plan.status();
  if (!ws.ok()) {
    c.why_not_cudnn = std::string(ws.status().message());
    return c;
  }
  c.cudnn = true;
  c.plan = *plan;
  c.workspace = *ws;
  c.why_not_cudnn.clear();
  c.expected = true;
#else
  c.why_not_cudnn = "no cuDNN in this build";
#endif
  return c;
}

#ifdef BATON_HAVE_CUDNN

absl::Status RingSdpaForward(CudnnAttention& cudnn, const RingSdpaPlan& plan, void* out,
                             float* stats, const void* qkv, const void* kv, void* workspace,
                             size_t workspace_bytes, cudaStream_t stream) {
  return cudnn.RingForward(plan, out, stats, qkv, kv, workspace, workspace_bytes, stream);
}

absl::Status RingSdpaBackward(CudnnAttention& cudnn, const RingSdpaPlan& plan, void* dq,
                              void* dkv, const void* dout, const void* out, const void* qkv,
                              const void* kv, const float* stats, void* workspace,
                              size_t workspace_bytes, cudaStream_t stream) {
  return cudnn.RingBackward(plan, dq, dkv, dout, out, qkv, kv, stats, workspace,
                            workspace_bytes, stream);
}

#else

absl::Status RingSdpaForward(CudnnAttention&, const RingSdpaPlan&, void*, float*, const void*,
                             const void*, void*, size_t, cudaStream_t) {
  return absl::InternalError("cuDNN ring path chosen in a build without cuDNN");
}

absl::Status RingSdpaBackward(CudnnAttention&, const RingSdpaPlan&, void*, void*, const void*,
                              const void*, const void*, const void*, const float*, void*, size_t,
                              cudaStream_t) {
  return absl::InternalError("cuDNN ring path chosen in a build without cuDNN");
}

#endif

}  // namespace baton::cuda
