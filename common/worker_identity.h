// What names a worker: its --name, --host and --device, checked the same way by the
// worker's flags and the coordinator's Register (shared by both binaries).
#ifndef BATON_COMMON_WORKER_IDENTITY_H_
#define BATON_COMMON_WORKER_IDENTITY_H_

#include <string>

#include "absl/status/status.h"

namespace baton {

// "cpu", "cuda:N" or "sim:N" (the test-only simulated device).
bool IsValidDevice(const std::string& device);

// A GPU's UUID as a worker registers it ("GPU-" and hex in 8-4-4-4-12 groups,
// kernels::FormatGpuUuid): 1..64 of [A-Za-z0-9-]; empty (unknown, or not a
// GPU) is valid too. Only its equality matters to the coordinator.
bool IsValidGpuUuid(const std::string& uuid);

// 1..128 of [A-Za-z0-9._-]; INVALID_ARGUMENT saying so otherwise.
absl::Status ValidateWorkerName(const std::string& name);

// The machine a worker registers (--host; its hostname by default): 1..253
// of [A-Za-z0-9._-] (a DNS name, e.g. a Kubernetes node name);
// INVALID_ARGUMENT saying so otherwise.
absl::Status ValidateHostName(const std::string& host);

}  // namespace baton

#endif  // BATON_COMMON_WORKER_IDENTITY_H_
