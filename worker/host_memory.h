// The host memory a CPU worker registers (RegisterRequest.memory_bytes): the
// machine's RAM, or its memory cgroup's limit when that is lower — in a
// container (a Kubernetes pod's resources.limits.memory, a systemd unit's
// MemoryMax) sysconf reports the node's RAM, and a plan sized to that would
// be killed for memory instead of refused with the numbers.
//
//   UsableHostMemory(physical, files)  min(physical, the first limit found)
//   ParseCgroupMemoryLimit(text)       cgroup v2 memory.max or v1
//                                      memory.limit_in_bytes: a byte count;
//                                      nullopt for "max", v1's "unlimited"
//                                      (a page-rounded INT64_MAX) or text that
//                                      is not a number
#ifndef BATON_WORKER_HOST_MEMORY_H_
#define BATON_WORKER_HOST_MEMORY_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace baton {

std::optional<int64_t> ParseCgroupMemoryLimit(absl::string_view text);

// Where a process finds its memory cgroup's limit: v2, then v1.
std::vector<std::string> DefaultCgroupMemoryLimitFiles();

int64_t UsableHostMemory(int64_t physical, const std::vector<std::string>& limit_files);

}  // namespace baton

#endif  // BATON_WORKER_HOST_MEMORY_H_
