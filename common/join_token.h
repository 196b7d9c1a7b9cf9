// The join token: a shared secret that workers present to the coordinator on
// every worker RPC (docs/security.md). Both daemons read it from a file given
// by --join_token_file, never from the command line (which `ps` shows to
// every user); this is the one reader of that file.
#ifndef BATON_COMMON_JOIN_TOKEN_H_
#define BATON_COMMON_JOIN_TOKEN_H_

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"

namespace baton {

inline constexpr size_t kMaxJoinTokenFileBytes = 4096;
inline constexpr size_t kMinJoinTokenLength = 16;
inline constexpr size_t kMaxJoinTokenLength = 1024;

// Reads a join token file. The file holds the token on one line (16..1024
// printable ASCII characters without spaces, e.g. `openssl rand -hex 32`);
// whitespace around it, such as the trailing newline, is not part of it.
// Refused with INVALID_ARGUMENT and a message naming --join_token_file and
// what to fix: a missing or unreadable path, a directory, FIFO or device, a
// file over 4 KiB, an empty file, a second non-blank line (a certificate or
// key given by mistake), a token too short, too long or with non-printable
// characters. Never reads more than kMaxJoinTokenFileBytes + 1 bytes.
// A file readable by group or others is accepted, with a warning in *warning.
absl::StatusOr<std::string> ReadJoinTokenFile(const std::string& path, std::string* warning = nullptr);

// For the daemons' --join_token_file flag: "" (no token) when `path` is
// empty, else ReadJoinTokenFile(path) with its warning logged.
absl::StatusOr<std::string> LoadJoinTokenFlag(const std::string& path);

}  // namespace baton

#endif  // BATON_COMMON_JOIN_TOKEN_H_
