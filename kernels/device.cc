#include "kernels/device.h"

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
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

absl::Status CheckDeviceUsable(Device device) {
  if (device.is_cpu()) return absl::OkStatus();
  if (device.type == DeviceType::kCuda) {
    absl::Status s = ProbeCudaDevice(device.index);
    if (!s.ok()) return s;
  }
  return ProbeDevice(device);
}

}  // namespace baton::kernels
