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

cudaError_t MeasureGlobalTimerOffset(int64_t* host_minus_timer_us, int64_t* uncertainty_us, int tries) {
  int64_t* host = nullptr;
  int64_t* device = nullptr;
  cudaStream_t stream = nullptr;
  cudaError_t err = cudaHostAlloc(&host, sizeof(int64_t), cudaHostAllocMapped);
  if (err == cudaSuccess) err = cudaHostGetDevicePointer(reinterpret_cast<void**>(&device), host, 0);
  if (err == cudaSuccess) err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  int64_t best_trip = -1;
  for (int i = 0; i < tries && err == cudaSuccess; ++i) {
    const int64_t before = HostMicros();
    StampKernel<<<1, 1, 0, stream>>>(device, 0);
    err = cudaGetLastError();
    if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
    const int64_t after = HostMicros();
    if (err != cudaSuccess) break;
    const int64_t trip = after - before;
    if (best_trip < 0 || trip < best_trip) {
      best_trip = trip;
      *host_minus_timer_us = before + trip / 2 - *host;
      *uncertainty_us = (trip + 1) / 2;
    }
  }
  if (stream != nullptr) cudaStreamDestroy(stream);
  if (host != nullptr) cudaFreeHost(host);
  return err;
}

}  // namespace baton::cuda
