// Time stamps in stream order from the GPU's global nanosecond timer
// (kernels::StampTime on CUDA):
//   out[0] = %globaltimer / 1000 + offset_us
// One thread reads %globaltimer (PTX ISA: "a predefined, 64-bit global
// nanosecond timer") when the stream reaches the kernel, so the stamp is the
// time the stream got there, with no host round trip. The timer's epoch is
// not specified, so the backend adds the offset from the timer to the host's
// Unix clock that MeasureGlobalTimerOffset measured once per device.
#ifndef BATON_KERNELS_CUDA_STAMP_CUH_
#define BATON_KERNELS_CUDA_STAMP_CUH_

#include <cuda_runtime.h>

#include <cstdint>

namespace baton::cuda {

// out: one int64 in device memory of the current device.
cudaError_t LaunchStampGlobalTimer(int64_t* out, int64_t offset_us, cudaStream_t stream);

// On the current device: host Unix clock (std::chrono::system_clock, the
// clock absl::Now reads) minus %globaltimer, in microseconds. Reads the host
// clock around a one-thread kernel that reads the timer into mapped pinned
// memory on a private stream, `tries` times, and keeps the tightest round
// trip (the offset is its midpoint; `*uncertainty_us` is half that trip).
// A host wait on its own stream: call it once per device, not per step.
cudaError_t MeasureGlobalTimerOffset(int64_t* host_minus_timer_us, int64_t* uncertainty_us,
                                     int tries = 8);

}  // namespace baton::cuda

#endif  // BATON_KERNELS_CUDA_STAMP_CUH_
