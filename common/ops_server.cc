#include "common/ops_server.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/file_io.h"
#include "prometheus/text_serializer.h"

namespace baton {
namespace {

const char* Reason(int code) {
  switch (code) {
    case 200: return "OK";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 503: return "Service Unavailable";
    default: return "Bad Request";
  }
}

void WriteAll(int fd, const std::string& data) {
  size_t off = 0;
  while (off < data.size()) {
    ssize_t n = send(fd, data.data() + off, data.size() - off, MSG_NOSIGNAL);
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      return;
    }
    off += static_cast<size_t>(n);
  }
}

}  // namespace

absl::Status ParseHostPort(const std::string& value, const std::string& flag, std::string* host,
                           int* port) {
  size_t colon = value.rfind(':');
  if (colon == std::string::npos || colon + 1 == value.size()) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, "='", value,
                                                   "' must be HOST:PORT, e.g. 127.0.0.1:0"));
  }
  *host = value.substr(0, colon);
  if (!absl::SimpleAtoi(value.substr(colon + 1), port) || *port < 0 || *port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, "='", value, "': port must be 0..65535 (0 picks a free port)"));
  }
  if (host->empty()) *host = "0.0.0.0";
  if (host->size() > 2 && host->front() == '[' && host->back() == ']') *host = host->substr(1, host->size() - 2);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<OpsServer>> OpsServer::Start(const std::string& listen,
                                                             std::shared_ptr<prometheus::Registry> registry,
                                                             ReadinessProbe readiness,
                                                             ScrapeHook before_scrape) {
  std::string host;
  int port = 0;
  if (absl::Status s = ParseHostPort(listen, "http_listen", &host, &port); !s.ok()) return s;
  struct addrinfo hints = {}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || res == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("--http_listen='", listen, "': cannot resolve host '", host, "'"));
  }
  std::unique_ptr<OpsServer> server(new OpsServer());
  server->listen_fd_ = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  setsockopt(server->listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  const bool bound = server->listen_fd_ >= 0 && bind(server->listen_fd_, res->ai_addr, res->ai_addrlen) == 0 &&
                     ::listen(server->listen_fd_, 64) == 0;
  const int err = errno;
  freeaddrinfo(res);
  if (!bound) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve HTTP on ", listen, ": ", std::strerror(err), "; pick another --http_listen"));
  }
  struct sockaddr_storage addr = {};
  socklen_t len = sizeof(addr);
  getsockname(server->listen_fd_, reinterpret_cast<struct sockaddr*>(&addr), &len);
  server->port_ = addr.ss_family == AF_INET6 ? ntohs(reinterpret_cast<struct sockaddr_in6*>(&addr)->sin6_port)
                                             : ntohs(reinterpret_cast<struct sockaddr_in*>(&addr)->sin_port);
  if (pipe2(server->wake_fds_, O_CLOEXEC) != 0) return absl::InternalError("pipe2 failed");
  server->registry_ = std::move(registry);
  server->readiness_ = std::move(readiness);
  server->before_scrape_ = std::move(before_scrape);
  server->thread_ = std::thread([s = server.get()] { s->Serve(); });
  return server;
}

OpsServer::~OpsServer() {
  if (thread_.joinable()) {
    const char byte = 1;
    [[maybe_unused]] ssize_t n = write(wake_fds_[1], &byte, 1);
    thread_.join();
  }
  for (int fd : {listen_fd_, wake_fds_[0], wake_fds_[1]}) {
    if (fd >= 0) close(fd);
  }
}

void OpsServer::Serve() {
  for (;;) {
    struct pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_fds_[0], POLLIN, 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    if (fds[0].revents & POLLIN) {
      int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) continue;
      HandleConnection(fd);
      close(fd);
    }
  }
}

void OpsServer::HandleConnection(int fd) {
  struct timeval tv = {2, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  std::string request;
  char buf[2048];
  while (request.find("\r\n\r\n") == std::string::npos && request.find("\n\n") == std::string::npos) {
    ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // closed or too slow
    request.append(buf, static_cast<size_t>(n));
    if (request.size() > 16384) break;  // no legitimate probe sends this much
  }
  int code = 400;
  std::string content_type = "text/plain", body = "bad request\n";
  const size_t sp1 = request.find(' '), sp2 = sp1 == std::string::npos ? sp1 : request.find(' ', sp1 + 1);
  if (sp2 != std::string::npos) {
    const std::string method = request.substr(0, sp1);
    std::string path = request.substr(sp1 + 1, sp2 - sp1 - 1);
    path = path.substr(0, path.find('?'));
    if (method != "GET" && method != "HEAD") {
      code = 405;
      body = "only GET\n";
    } else {
      Respond(path, &code, &content_type, &body);
    }
  }
  WriteAll(fd, absl::StrCat("HTTP/1.1 ", code, " ", Reason(code), "\r\nContent-Type: ", content_type,
                            "\r\nContent-Length: ", body.size(), "\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n",
                            body));
}

void OpsServer::Respond(const std::string& path, int* code, std::string* content_type, std::string* body) {
  if (path == "/metrics") {
    if (before_scrape_) before_scrape_();
    std::ostringstream out;
    prometheus::TextSerializer().Serialize(out, registry_->Collect());
    *code = 200;
    *content_type = "text/plain; version=0.0.4; charset=utf-8";
    *body = out.str();
  } else if (path == "/healthz") {
    *code = 200;
    *body = "ok\n";
  } else if (path == "/readyz") {
    absl::Status ready = readiness_ ? readiness_() : absl::OkStatus();
    *code = ready.ok() ? 200 : 503;
    *body = ready.ok() ? "ready\n" : absl::StrCat("not ready: ", ready.message(), "\n");
  } else {
    *code = 404;
    *body = "not found; try /metrics, /healthz or /readyz\n";
  }
}

absl::Status WritePortFile(const std::string& path, int grpc_port, int http_port) {
  absl::Status s =
      WriteFileAtomically(path, absl::StrCat("{\"grpc\": ", grpc_port, ", \"http\": ", http_port, "}\n"));
  if (!s.ok()) return absl::UnavailableError(absl::StrCat("cannot write --port_file: ", s.message()));
  return absl::OkStatus();
}

}  // namespace baton
