// Device names and availability, for the worker daemon before any kernel runs.
//
//   ParseDevice("cpu" | "cuda:N")  -> Device
//   ProbeCudaDevice(N)             OK when CUDA device N can be used now, or
//                                  UNAVAILABLE naming the cause: the message of
//                                  cudaGetDeviceCount (no driver, driver too
//                                  old, no device), an ordinal past the visible
//                                  devices, or a build without CUDA.
//   DescribeCudaDevice(N)          its UUID, name, memory and whether its bf16
//                                  attention runs fused (what the worker
//                                  registers), or the probe's error.
//
// The probe only asks the CUDA runtime; whether a kernel backend for CUDA is
// linked is kernels::ProbeDevice's question (backend.h). A worker checks both
// at Configure and fails that job, never the daemon.
#ifndef BATON_KERNELS_DEVICE_H_
#define BATON_KERNELS_DEVICE_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/tensor.h"

namespace baton::kernels {

// "cpu", "cuda:N" or "sim:N" (N a non-negative ordinal; sim is the test-only
// simulated device); INVALID_ARGUMENT otherwise.
absl::StatusOr<Device> ParseDevice(absl::string_view name);

absl::Status ProbeCudaDevice(int index);

// What tells one GPU from another, whatever CUDA_VISIBLE_DEVICES or the
// container calls it.
struct CudaDeviceInfo {
  std::string uuid;  // as nvidia-smi prints it: "GPU-" and 32 hex digits in 8-4-4-4-12 groups
  std::string name;  // "NVIDIA H200"
  int64_t memory_bytes = 0;  // the device's total memory
  // ProbeFusedAttention(cuda:N): bf16 attention keeps the softmax stats and o,
  // not P (RegisterRequest.fused_attention_bf16); when false, why not.
  bool fused_attention_bf16 = false;
  std::string fused_attention_why_not;
};

absl::StatusOr<CudaDeviceInfo> DescribeCudaDevice(int index);

// The 16 bytes of a CUDA UUID (cudaUUID_t) in nvidia-smi's form.
std::string FormatGpuUuid(const unsigned char (&bytes)[16]);

// ProbeCudaDevice for CUDA devices, then ProbeDevice (a backend is linked and
// accepts the device); OK for the CPU.
absl::Status CheckDeviceUsable(Device device);

}  // namespace baton::kernels

#endif  // BATON_KERNELS_DEVICE_H_
