// The CUDA backend of kernels/backend.h: the kernels of this directory behind
// the Backend table, registered for DeviceType::kCuda by linking
// //kernels/cuda:cuda_backend (alwayslink).
//
// Per stream it keeps a cuBLASLt handle with its workspace and algorithm
// cache, one growing scratch buffer for ops' temporaries (column-sum
// partials, per-row losses, embedding links, attention S/dP — reused op
// after op in stream order), and the stream's first error: entries return
// void, so a failed launch or a cuBLASLt error is kept and returned by the
// stream's next Synchronize, Record or StreamWait (backend.h §4). All of it
// is allocated through kernels::AllocateDevice (counted in MemoryStats) on
// the first step; shapes that do not grow allocate nothing later.
//
// Precision (backend.h §6): fp32 GEMMs in true fp32; bf16 tensors as GEMM
// inputs (Linear*, Attention*), LayerNorm output, Cast and AdamW's copy.
// Ops without a bf16 kernel (GELU, residual, losses, ...) abort naming the
// op when handed a bf16 tensor: a model wiring error, not a runtime one.
#ifndef BATON_KERNELS_CUDA_CUDA_BACKEND_H_
#define BATON_KERNELS_CUDA_CUDA_BACKEND_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace baton::cuda {

const kernels::Backend& CudaBackend();

// Counters of one CUDA stream's backend state, for tests and metrics.
struct CudaStreamInfo {
  int64_t gemm_cache_hits = 0;
  int64_t gemm_cache_misses = 0;
  size_t scratch_bytes = 0;  // capacity of the op scratch buffer
};
absl::StatusOr<CudaStreamInfo> GetCudaStreamInfo(const kernels::Stream& stream);

}  // namespace baton::cuda

#endif  // BATON_KERNELS_CUDA_CUDA_BACKEND_H_
