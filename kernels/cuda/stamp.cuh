// Time stamps in stream order from the GPU's global nanosecond timer
// (kernels::StampTime on CUDA):
//   out[0] = %globaltimer / 1000 + offset_us
// One thread reads %globaltimer (PTX ISA: "a predefined, 64-bit global
// nanosecond timer") when the stream reaches the kernel, so the stamp is the
// time the stream got there, with no host round trip. The timer's epoch is
// not specified, so the backend adds the offset from the timer to the host's
// Unix clock that MeasureGlobalTimerOffset measured for the device, and
// measures it again as the two clocks drift apart (timer_offset.h).
#ifndef BATON_KERNELS_CUDA_STAMP_CUH_
#define BATON_KERNELS_CUDA_STAMP_CUH_

#include <cuda_runtime.h>

#include <cstdint>

namespace baton::cuda {

// out: one int64 in device memory of the current device.
cudaError_t LaunchStampGlobalTimer(int64_t* out, int64_t offset_us, cudaStream_t stream);

// What measurements of one device reuse: a word of mapped pinned memory and
// a private stream. Creating it (cudaHostAlloc, cudaStreamCreate) may wait
// for the whole device, so create it before any step; measuring with it
// waits only for its own stream. On the current device; on failure nothing
// is left allocated.
struct GlobalTimerProbe {
  int64_t* host = nullptr;    // mapped pinned memory
  int64_t* device = nullptr;  // its device address
  cudaStream_t stream = nullptr;
};
cudaError_t CreateGlobalTimerProbe(GlobalTimerProbe* probe);
void DestroyGlobalTimerProbe(GlobalTimerProbe* probe);

// On the probe's device (current): host Unix clock (std::chrono::system_clock,
// the clock absl::Now reads) minus %globaltimer, in microseconds. Reads the
// host clock around a one-thread kernel that reads the timer into the
// probe's mapped memory on its stream, `tries` times, and keeps the tightest
// round trip (the offset is its midpoint; `*uncertainty_us` is half that
// trip). A host wait on the probe's stream, a few microseconds each try on
// an idle device.
cudaError_t MeasureGlobalTimerOffset(const GlobalTimerProbe& probe, int64_t* host_minus_timer_us,
                                     int64_t* uncertainty_us, int tries = 8);
// The same with a probe of its own, created and destroyed (waits for the
// whole device).
cudaError_t MeasureGlobalTimerOffset(int64_t* host_minus_timer_us, int64_t* uncertainty_us,
                                     int tries = 8);

}  // namespace baton::cuda

#endif  // BATON_KERNELS_CUDA_STAMP_CUH_
