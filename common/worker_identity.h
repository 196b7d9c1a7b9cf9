// What names a worker: its --name and --device, checked the same way by the
// worker's flags and the coordinator's Register (shared by both binaries).
#ifndef BATON_COMMON_WORKER_IDENTITY_H_
#define BATON_COMMON_WORKER_IDENTITY_H_

#include <string>

#include "absl/status/status.h"

namespace baton {

// "cpu", "cuda:N" or "sim:N" (the test-only simulated device).
bool IsValidDevice(const std::string& device);

// 1..128 of [A-Za-z0-9._-]; INVALID_ARGUMENT saying so otherwise.
absl::Status ValidateWorkerName(const std::string& name);

}  // namespace baton

#endif  // BATON_COMMON_WORKER_IDENTITY_H_
