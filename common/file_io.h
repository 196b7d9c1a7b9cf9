// Whole-file reads and crash-safe writes: WriteFileAtomically writes a
// temporary file beside the target, fsyncs it and renames it over the target,
// so readers see the old file or the new one, never a partial one, even when
// several processes write the same path at once.
#ifndef BATON_COMMON_FILE_IO_H_
#define BATON_COMMON_FILE_IO_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace baton {

// NOT_FOUND when the file does not exist; errors name the path and errno text.
absl::StatusOr<std::string> ReadFile(const std::string& path);

absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents);

// mkdir -p: creates `path` and its missing parents (0755); an error names
// the part that could not be created, or a part that is not a directory.
absl::Status MakeDirectories(const std::string& path);

}  // namespace baton

#endif  // BATON_COMMON_FILE_IO_H_
