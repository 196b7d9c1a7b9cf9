#include "worker/comm/spin_kernel.cuh"

namespace baton::comm::testing {
namespace {

__device__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void SpinUntilReleased(const volatile int* release, volatile int* state, int64_t max_ns) {
  const uint64_t start = GlobalTimerNs();
  *state = kSpinning;
  __threadfence_system();
  while (*release == 0) {
    if (static_cast<int64_t>(GlobalTimerNs() - start) > max_ns) {
      *state = kGaveUp;
      __threadfence_system();
      return;
    }
    __nanosleep(1000);
  }
  *state = kReleased;
  __threadfence_system();
}

}  // namespace

cudaError_t LaunchSpinUntilReleased(const volatile int* release, volatile int* state,
                                    int64_t max_ns, cudaStream_t stream) {
  SpinUntilReleased<<<1, 1, 0, stream>>>(release, state, max_ns);
  return cudaGetLastError();
}

}  // namespace baton::comm::testing
