// bf16 context-parallel (ring) attention blocks through cuDNN's fused SDPA:
// the CUDA backend's choice, per block, between cuDNN and its fp32 kernels,
// and the calls into cudnn_attention.h — here so that the backend needs no
// cuDNN headers and builds without cuDNN (BATON_HAVE_CUDNN, as attention.h).
//
// The math is kernels/ops.h's "Context-parallel (ring) attention" on the
// inputs' fp32 images; sdpa_plan.h (RingSdpaPlan) has the layouts and which
// blocks cuDNN can take (fully visible, or the diagonal). cuDNN rounds the
// block's o (forward) and dq, dk, dv (backward) to bf16 once; the backend
// then widens o into the fp32 out, and adds dq, dk, dv into the fp32
// accumulators (ring_attention.cuh LaunchAddWidenedColumns).
//
// The choice is a function of (the block's shape and mask, the pointers'
// alignment, the stream's CudnnAttention and its cached verdict for the
// key), so a given block takes the same path at every step.
#ifndef BATON_KERNELS_CUDA_RING_SDPA_H_
#define BATON_KERNELS_CUDA_RING_SDPA_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <initializer_list>
#include <string>

#include "absl/status/status.h"
#include "kernels/cuda/sdpa_plan.h"

namespace baton::cuda {

class CudnnAttention;  // cudnn_attention.h; only in builds with cuDNN

// cuDNN reads and writes its tensors with 16-byte accesses: every base
// pointer must be 16-byte aligned (the plan's offsets and row strides are,
// for a head dimension that is a multiple of 8).
inline constexpr size_t kRingSdpaAlignment = 16;

struct RingSdpaChoice {
  bool cudnn = false;           // true: run plan through cuDNN
  RingSdpaPlan plan;            // when cudnn
  RingSdpaWorkspace workspace;  // when cudnn: cuDNN's workspace bytes
  // Empty when cudnn. Otherwise why not; `expected` is true where the block
  // is not one cuDNN takes at all (partly visible, invisible, one row, a
  // head dimension it refuses, no cuDNN on the stream) and false where it
  // should have run and did not (the build has no cuDNN, a pointer is not
  // aligned, cuDNN refused the shape): an operator should hear of the latter.
  std::string why_not_cudnn;
  bool expected = true;
};

// The path of `block` on a stream whose cuDNN state is `cudnn` (null: none),
// with the block's bf16 and fp32 tensors at `pointers` (checked for
// kRingSdpaAlignment). Builds and caches the block's graphs on first use.
RingSdpaChoice ChooseRingSdpa(CudnnAttention* cudnn, const RingSdpaBlock& block,
                              std::initializer_list<const void*> pointers);

// The cuDNN calls of cudnn_attention.h (CudnnAttention::RingForward,
// RingBackward), for a choice with cudnn = true; INTERNAL in a build without
// cuDNN.
absl::Status RingSdpaForward(CudnnAttention& cudnn, const RingSdpaPlan& plan, void* out,
                             float* stats, const void* qkv, const void* kv, void* workspace,
                             size_t workspace_bytes, cudaStream_t stream);
absl::Status RingSdpaBackward(CudnnAttention& cudnn, const RingSdpaPlan& plan, void* dq,
                              void* dkv, const void* dout, const void* out, const void* qkv,
                              const void* kv, const float* stats, void* workspace,
                              size_t workspace_bytes, cudaStream_t stream);

}  // namespace baton::cuda

#endif  // BATON_KERNELS_CUDA_RING_SDPA_H_
