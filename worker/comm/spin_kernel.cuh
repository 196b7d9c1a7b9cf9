// Test-only: a kernel that holds a CUDA stream until the host releases it,
// so that tests can queue an op behind a long-running kernel (the NCCL
// watchdog test).
//
// SpinUntilReleased: one thread sets *state = kSpinning and spins until
// *release != 0 (then *state = kReleased) or until `max_ns` of the GPU's
// global timer have passed (then *state = kGaveUp, so a test that never
// releases it still ends). `release` and `state` are host memory mapped
// into the device (cudaHostAlloc with cudaHostAllocMapped) so the host can
// read and write them while the kernel runs.
#ifndef BATON_WORKER_COMM_SPIN_KERNEL_CUH_
#define BATON_WORKER_COMM_SPIN_KERNEL_CUH_

#include <cuda_runtime.h>

#include <cstdint>

namespace baton::comm::testing {

inline constexpr int kSpinning = 1;
inline constexpr int kReleased = 2;
inline constexpr int kGaveUp = 3;

// Launches the kernel on `stream`; returns the launch's error.
cudaError_t LaunchSpinUntilReleased(const volatile int* release, volatile int* state,
                                    int64_t max_ns, cudaStream_t stream);

}  // namespace baton::comm::testing

#endif  // BATON_WORKER_COMM_SPIN_KERNEL_CUH_
