// Keeping file paths that come from elsewhere (a job spec, the coordinator)
// inside directories this process was configured with: the worker's
// --data_dir (inputs) and --output_dir (weights and checkpoints).
//
// Paths are compared after resolving symlinks, "." and ".." with realpath(3),
// so neither "../" nor a symlink inside a root leads out of it. The check is
// made when the path is used, not atomically with the open that follows: a
// process that can rename or replace directories inside a root between the
// two can still redirect a write; the roots must be writable only by baton.
#ifndef BATON_COMMON_PATH_CONFINEMENT_H_
#define BATON_COMMON_PATH_CONFINEMENT_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace baton {

// realpath(3): the absolute path of an existing file or directory with
// symlinks, "." and ".." resolved; the errno as a status otherwise.
absl::StatusOr<std::string> RealPath(const std::string& path);

// Whether the canonical path `path` is `root` or lies below it (both
// canonical, as RealPath returns them).
bool IsUnder(const std::string& path, const std::string& root);

// The canonical form of `path`, which need not exist yet (a directory about
// to be created): its longest existing prefix is resolved with RealPath and
// the rest appended; that rest may not contain "." or ".." components. A
// relative path is taken relative to the working directory. INVALID_ARGUMENT
// for an empty path or a "." or ".." in the rest.
absl::StatusOr<std::string> CanonicalPathForWrite(const std::string& path);

// OK when `path` (existing or not, see CanonicalPathForWrite) lies under one
// of `roots`, the directories given by command-line flag `flag`; returns its
// canonical form. FAILED_PRECONDITION when `roots` is empty (the process
// writes nothing), PERMISSION_DENIED naming the path, where it resolves to and
// the flag otherwise. `what` names the path for the message ("the checkpoint
// directory").
absl::StatusOr<std::string> ConfineWritePath(const std::string& path, const std::vector<std::string>& roots,
                                             const std::string& flag, const std::string& what);

}  // namespace baton

#endif  // BATON_COMMON_PATH_CONFINEMENT_H_
