#include "kernels/cuda/stamp.cuh"

#include <chrono>

namespace baton::cuda {
namespace {

__device__ __forceinline__ int64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return static_cast<int64_t>(t);
}

__global__ void StampKernel(int64_t* out, int64_t offset_us) {
  if (threadIdx.x == 0 && blockIdx.x == 0) *out = GlobalTimerNs() / 1000 + offset_us;
}

int64_t HostMicros() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

cudaError_t LaunchStampGlobalTimer(int64_t* out, int64_t offset_us, cudaStream_t stream) {
  StampKernel<<<1, 1, 0, stream>>>(out, offset_us);
  return cudaGetLastError();
}

cudaError_t CreateGlobalTimerProbe(GlobalTimerProbe* probe) {
  *probe = GlobalTimerProbe{};
  cudaError_t err = cudaHostAlloc(&probe->host, sizeof(int64_t), cudaHostAllocMapped);
  if (err == cudaSuccess) err = cudaHostGetDevicePointer(reinterpret_cast<void**>(&probe->device), probe->host, 0);
  if (err == cudaSuccess) err = cudaStreamCreateWithFlags(&probe->stream, cudaStreamNonBlocking);
  if (err != cudaSuccess) DestroyGlobalTimerProbe(probe);
  return err;
}

void DestroyGlobalTimerProbe(GlobalTimerProbe* probe) {
  if (probe->stream != nullptr) cudaStreamDestroy(probe->stream);
  if (probe->host != nullptr) cudaFreeHost(probe->host);
  *probe = GlobalTimerProbe{};
}

cudaError_t MeasureGlobalTimerOffset(const GlobalTimerProbe& probe, int64_t* host_minus_timer_us,
                                     int64_t* uncertainty_us, int tries) {
  if (probe.stream == nullptr || probe.host == nullptr) return cudaErrorInvalidValue;
  cudaError_t err = cudaSuccess;
  int64_t best_trip = -1;
  for (int i = 0; i < tries && err == cudaSuccess; ++i) {
    const int64_t before = HostMicros();
    StampKernel<<<1, 1, 0, probe.stream>>>(probe.device, 0);
    err = cudaGetLastError();
    if (err == cudaSuccess) err = cudaStreamSynchronize(probe.stream);
    const int64_t after = HostMicros();
    if (err != cudaSuccess) break;
    const int64_t trip = after - before;
    if (best_trip < 0 || trip < best_trip) {
      best_trip = trip;
      *host_minus_timer_us = before + trip / 2 - *probe.host;
      *uncertainty_us = (trip + 1) / 2;
    }
  }
  return err;
}

cudaError_t MeasureGlobalTimerOffset(int64_t* host_minus_timer_us, int64_t* uncertainty_us, int tries) {
  GlobalTimerProbe probe;
  cudaError_t err = CreateGlobalTimerProbe(&probe);
  if (err == cudaSuccess) err = MeasureGlobalTimerOffset(probe, host_minus_timer_us, uncertainty_us, tries);
  DestroyGlobalTimerProbe(&probe);
  return err;
}

}  // namespace baton::cuda
