#include "common/join_token.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "common/log.h"

namespace baton {
namespace {

absl::Status Bad(const std::string& path, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("--join_token_file='", path, "' ", what));
}

}  // namespace

absl::StatusOr<std::string> ReadJoinTokenFile(const std::string& path, std::string* warning) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer; fstat on the open
  // descriptor, so the file checked is the file read.
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) return Bad(path, "does not exist; create it with `openssl rand -hex 32 > FILE; chmod 600 FILE`");
    return Bad(path, absl::StrCat("cannot be opened: ", strerror(err)));
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return Bad(path, "is not a regular file; it must be a file holding the token");
  }
  if (static_cast<size_t>(st.st_size) > kMaxJoinTokenFileBytes) {
    close(fd);
    return Bad(path, absl::StrFormat("is %d bytes; a join token file holds one token of at most %d characters",
                                     static_cast<long long>(st.st_size), kMaxJoinTokenLength));
  }
  // The file may grow between fstat and read: read at most one byte more
  // than allowed and refuse if that byte arrives.
  std::string text(kMaxJoinTokenFileBytes + 1, '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = read(fd, text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      close(fd);
      return Bad(path, absl::StrCat("cannot be read: ", strerror(err)));
    }
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  close(fd);
  if (got > kMaxJoinTokenFileBytes) {
    return Bad(path, absl::StrFormat("is larger than %d bytes", kMaxJoinTokenFileBytes));
  }
  text.resize(got);
  const absl::string_view content = absl::StripAsciiWhitespace(text);
  if (content.empty()) {
    return Bad(path, "is empty; put the token in it, e.g. `openssl rand -hex 32 > FILE`");
  }
  if (content.find_first_of("\r\n") != absl::string_view::npos) {
    return Bad(path, "holds more than one line; it must hold only the token (is it a certificate or key?)");
  }
  if (content.size() < kMinJoinTokenLength || content.size() > kMaxJoinTokenLength) {
    return Bad(path, absl::StrFormat("holds a %d-character token; it must be %d..%d characters, e.g. the output of "
                                     "`openssl rand -hex 32`",
                                     content.size(), kMinJoinTokenLength, kMaxJoinTokenLength));
  }
  for (char c : content) {
    if (!absl::ascii_isgraph(static_cast<unsigned char>(c))) {
      return Bad(path, "holds a token with spaces or non-printable characters; it must be printable ASCII");
    }
  }
  if (warning != nullptr && (st.st_mode & 077) != 0) {
    *warning = absl::StrFormat("--join_token_file='%s' is readable by group or others (mode %03o); chmod 600 it",
                               path, st.st_mode & 0777);
  }
  return std::string(content);
}

absl::StatusOr<std::string> LoadJoinTokenFlag(const std::string& path) {
  if (path.empty()) return std::string();
  std::string warning;
  absl::StatusOr<std::string> token = ReadJoinTokenFile(path, &warning);
  if (token.ok() && !warning.empty()) BATON_LOG(WARNING) << warning;
  return token;
}

}  // namespace baton
