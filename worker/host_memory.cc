#include "worker/host_memory.h"

#include <algorithm>
#include <fstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"

namespace baton {

std::optional<int64_t> ParseCgroupMemoryLimit(absl::string_view text) {
  text = absl::StripAsciiWhitespace(text);
  int64_t bytes = 0;
  if (text == "max" || !absl::SimpleAtoi(text, &bytes) || bytes <= 0) return std::nullopt;
  // cgroup v1 says "no limit" with the largest page-aligned int64.
  if (bytes >= (int64_t{1} << 62)) return std::nullopt;
  return bytes;
}

std::vector<std::string> DefaultCgroupMemoryLimitFiles() {
  return {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"};
}

int64_t UsableHostMemory(int64_t physical, const std::vector<std::string>& limit_files) {
  for (const std::string& path : limit_files) {
    std::ifstream in(path);
    if (!in) continue;
    char buf[64] = {};
    in.read(buf, sizeof(buf) - 1);  // a number or "max": bounded
    const std::optional<int64_t> limit = ParseCgroupMemoryLimit(absl::string_view(buf, in.gcount()));
    if (limit.has_value()) return physical > 0 ? std::min(physical, *limit) : *limit;
    return physical;  // this cgroup has no limit
  }
  return physical;
}

}  // namespace baton
