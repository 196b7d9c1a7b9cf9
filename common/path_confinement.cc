#include "common/path_confinement.h"

#include <cerrno>
#include <climits>
#include <cstdlib>

#include <unistd.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace baton {

absl::StatusOr<std::string> RealPath(const std::string& path) {
  char buffer[PATH_MAX];
  if (realpath(path.c_str(), buffer) == nullptr) return absl::ErrnoToStatus(errno, path);
  return std::string(buffer);
}

bool IsUnder(const std::string& path, const std::string& root) {
  if (path == root) return true;
  const std::string prefix = root == "/" ? "/" : root + "/";
  return path.compare(0, prefix.size(), prefix) == 0;
}

absl::StatusOr<std::string> CanonicalPathForWrite(const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError("the path is empty");
  std::string absolute = path;
  if (path.front() != '/') {  // relative to the working directory, where it would be written
    char cwd[PATH_MAX];
    if (getcwd(cwd, sizeof(cwd)) == nullptr) return absl::ErrnoToStatus(errno, "getcwd");
    absolute = absl::StrCat(cwd, "/", path);
  }
  std::vector<std::string> parts = absl::StrSplit(absolute, '/', absl::SkipEmpty());
  // The longest prefix that exists; what follows it is created later.
  for (size_t existing = parts.size() + 1; existing-- > 0;) {
    const std::string prefix = absl::StrCat("/", absl::StrJoin(parts.begin(), parts.begin() + existing, "/"));
    absl::StatusOr<std::string> real = RealPath(prefix);
    if (!real.ok()) continue;
    std::string result = *real;
    for (size_t i = existing; i < parts.size(); ++i) {
      if (parts[i] == "." || parts[i] == "..") {
        return absl::InvalidArgumentError(
            absl::StrCat("'", path, "' has a '", parts[i], "' component below its existing part ", *real));
      }
      absl::StrAppend(&result, result == "/" ? "" : "/", parts[i]);
    }
    return result;
  }
  return absl::InvalidArgumentError(absl::StrCat("'", path, "' cannot be resolved"));
}

absl::StatusOr<std::string> ConfineWritePath(const std::string& path, const std::vector<std::string>& roots,
                                             const std::string& flag, const std::string& what) {
  if (roots.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(what, " '", path, "': this worker writes no outputs; start it with --",
                                                      flag, "=DIR with a DIR that holds that path"));
  }
  absl::StatusOr<std::string> canonical = CanonicalPathForWrite(path);
  if (!canonical.ok()) {
    return absl::PermissionDeniedError(absl::StrCat(what, " ", canonical.status().message(),
                                                    ": refused; outputs go only under --", flag, "=",
                                                    absl::StrJoin(roots, ",")));
  }
  std::vector<std::string> resolved;
  for (const std::string& root : roots) {
    absl::StatusOr<std::string> real = RealPath(root);
    if (!real.ok()) {
      resolved.push_back(absl::StrCat(root, " (cannot be resolved: ", real.status().message(), ")"));
      continue;
    }
    if (IsUnder(*canonical, *real)) return *canonical;
    resolved.push_back(*real);
  }
  return absl::PermissionDeniedError(absl::StrCat(what, " '", path, "' resolves to ", *canonical,
                                                  ", outside this worker's --", flag, "=",
                                                  absl::StrJoin(resolved, ","),
                                                  ": refused; give the coordinator an output path under it or "
                                                  "start the worker with a --", flag, " that holds it"));
}

}  // namespace baton
