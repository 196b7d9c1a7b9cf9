#include "common/sd_notify.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace baton {

absl::Status SdNotify(const std::string& state) {
  const char* path = std::getenv("NOTIFY_SOCKET");
  if (path == nullptr || path[0] == '\0') return absl::OkStatus();
  struct sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  const size_t len = std::strlen(path);
  if ((path[0] != '/' && path[0] != '@') || len >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("NOTIFY_SOCKET='", path, "' is not an absolute or abstract socket path of under ",
                     sizeof(addr.sun_path), " bytes"));
  }
  std::memcpy(addr.sun_path, path, len);
  if (path[0] == '@') addr.sun_path[0] = '\0';  // abstract namespace
  const int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("sd_notify: socket: ", std::strerror(errno)));
  const ssize_t n = sendto(fd, state.data(), state.size(), MSG_NOSIGNAL, reinterpret_cast<struct sockaddr*>(&addr),
                           static_cast<socklen_t>(offsetof(struct sockaddr_un, sun_path) + len));
  const int err = errno;
  close(fd);
  if (n < 0) return absl::UnavailableError(absl::StrCat("sd_notify to ", path, ": ", std::strerror(err)));
  return absl::OkStatus();
}

absl::Duration WatchdogPeriod() {
  const char* usec = std::getenv("WATCHDOG_USEC");
  int64_t us = 0;
  if (usec == nullptr || !absl::SimpleAtoi(usec, &us) || us <= 0) return absl::ZeroDuration();
  if (const char* pid = std::getenv("WATCHDOG_PID"); pid != nullptr && pid[0] != '\0') {
    int64_t p = 0;
    if (!absl::SimpleAtoi(pid, &p) || p != getpid()) return absl::ZeroDuration();
  }
  return absl::Microseconds(us) / 2;
}

}  // namespace baton
