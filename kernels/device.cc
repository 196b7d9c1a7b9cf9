#include "kernels/device.h"

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/backend.h"

#ifdef BATON_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace baton::kernels {

absl::StatusOr<Device> ParseDevice(absl::string_view name) {
  if (name == "cpu") return Device::Cpu();
  int index = -1;
  if (absl::StartsWith(name, "cuda:") && absl::SimpleAtoi(name.substr(5), &index) && index >= 0) {
    return Device::Cuda(index);
  }
  if (absl::StartsWith(name, "sim:") && absl::SimpleAtoi(name.substr(4), &index) && index >= 0) {
    return Device::Sim(index);  // the test-only simulated device (kernels/sim)
  }
  return absl::InvalidArgumentError(
      absl::StrCat("device '", name, "': want \"cpu\" or \"cuda:N\" (e.g. cuda:0)"));
}

absl::Status ProbeCudaDevice(int index) {
#ifdef BATON_WITH_CUDA
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    return absl::UnavailableError(absl::StrCat("cuda:", index, " is unavailable: cudaGetDeviceCount failed: ",
                                               cudaGetErrorName(err), ": ", cudaGetErrorString(err)));
  }
  if (index >= count) {
    return absl::UnavailableError(absl::StrCat("cuda:", index, " is unavailable: ", count,
                                               " CUDA device(s) visible"));
  }
  return absl::OkStatus();
#else
  return absl::UnavailableError(
      absl::StrCat("cuda:", index, " is unavailable: this build of baton has no CUDA support"));
#endif
}

std::string FormatGpuUuid(const unsigned char (&bytes)[16]) {
  std::string out = "GPU-";
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) out += '-';
    absl::StrAppendFormat(&out, "%02x", bytes[i]);
  }
  return out;
}

absl::StatusOr<CudaDeviceInfo> DescribeCudaDevice(int index) {
  if (absl::Status s = ProbeCudaDevice(index); !s.ok()) return s;
#ifdef BATON_WITH_CUDA
  cudaDeviceProp prop{};
  const cudaError_t err = cudaGetDeviceProperties(&prop, index);
  if (err != cudaSuccess) {
    return absl::UnavailableError(absl::StrCat("cuda:", index, " is unavailable: cudaGetDeviceProperties failed: ",
                                               cudaGetErrorName(err), ": ", cudaGetErrorString(err)));
  }
  unsigned char uuid[16];
  for (int i = 0; i < 16; ++i) uuid[i] = static_cast<unsigned char>(prop.uuid.bytes[i]);
  CudaDeviceInfo info;
  info.uuid = FormatGpuUuid(uuid);
  info.name = prop.name;
  info.memory_bytes = static_cast<int64_t>(prop.totalGlobalMem);
  // Asked of the backend that will run the worker's attention (the CUDA
  // backend's own check; UNAVAILABLE where none is linked).
  const absl::Status fused = ProbeFusedAttention(Device::Cuda(index));
  info.fused_attention_bf16 = fused.ok();
  if (!fused.ok()) info.fused_attention_why_not = std::string(fused.message());
  return info;
#else
  return absl::InternalError("unreachable: the probe fails without CUDA");
#endif
}

absl::Status CheckDeviceUsable(Device device) {
  if (device.is_cpu()) return absl::OkStatus();
  if (device.type == DeviceType::kCuda) {
    absl::Status s = ProbeCudaDevice(device.index);
    if (!s.ok()) return s;
  }
  return ProbeDevice(device);
}

}  // namespace baton::kernels
