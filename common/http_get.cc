#include "common/http_get.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace baton {

absl::StatusOr<HttpResponse> HttpGet(const std::string& host, int port, const std::string& path,
                                     absl::Duration timeout) {
  struct addrinfo hints = {}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || res == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("cannot resolve ", host));
  }
  int fd = socket(res->ai_family, SOCK_STREAM, 0);
  struct timeval tv = absl::ToTimeval(timeout);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  int rc = connect(fd, res->ai_addr, res->ai_addrlen);
  freeaddrinfo(res);
  if (rc != 0) {
    int err = errno;
    close(fd);
    return absl::UnavailableError(absl::StrCat("connect to ", host, ":", port, ": ", std::strerror(err)));
  }
  std::string req = absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: ", host, "\r\nConnection: close\r\n\r\n");
  if (send(fd, req.data(), req.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(req.size())) {
    close(fd);
    return absl::UnavailableError("send failed");
  }
  std::string raw;
  char buf[8192];
  for (;;) {
    ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n < 0) {
      close(fd);
      return absl::DeadlineExceededError(absl::StrCat("no complete response from ", host, ":", port, path));
    }
    if (n == 0) break;
    raw.append(buf, n);
  }
  close(fd);
  size_t sp = raw.find(' ');
  size_t hdr_end = raw.find("\r\n\r\n");
  HttpResponse out;
  if (sp == std::string::npos || hdr_end == std::string::npos ||
      !absl::SimpleAtoi(raw.substr(sp + 1, 3), &out.code)) {
    return absl::DataLossError(absl::StrCat("malformed HTTP response from ", host, ":", port, path));
  }
  out.body = raw.substr(hdr_end + 4);
  return out;
}

}  // namespace baton
