#include "common/ops_server.h"

#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
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

constexpr size_t kThreadStackBytes = 8 << 20;   // room for CUDA's / OpenBLAS's static TLS
constexpr size_t kConnectionMemoryBytes = 32 << 10;  // request line + headers; more gets 431

int g_request_marker;  // *req_cls after the first call of a request

enum MHD_Result Queue(MHD_Connection* connection, int code, const std::string& content_type,
                      const std::string& body, const char* allow = nullptr) {
  MHD_Response* response =
      MHD_create_response_from_buffer(body.size(), const_cast<char*>(body.data()), MHD_RESPMEM_MUST_COPY);
  if (response == nullptr) return MHD_NO;
  MHD_add_response_header(response, "Content-Type", content_type.c_str());
  MHD_add_response_header(response, "Cache-Control", "no-store");
  if (allow != nullptr) MHD_add_response_header(response, "Allow", allow);
  enum MHD_Result queued = MHD_queue_response(connection, static_cast<unsigned>(code), response);
  MHD_destroy_response(response);
  return queued;
}

enum MHD_Result HandleRequest(void* cls, MHD_Connection* connection, const char* url, const char* method,
                              const char* /*version*/, const char* /*upload_data*/, size_t* upload_data_size,
                              void** req_cls) {
  if (*req_cls == nullptr) {  // headers are in; answer on the next call
    *req_cls = &g_request_marker;
    return MHD_YES;
  }
  if (*upload_data_size != 0) {  // a body: ignore it
    *upload_data_size = 0;
    return MHD_YES;
  }
  const std::string m = method;
  if (m != MHD_HTTP_METHOD_GET && m != MHD_HTTP_METHOD_HEAD) {
    return Queue(connection, MHD_HTTP_METHOD_NOT_ALLOWED, "text/plain", "only GET and HEAD\n", "GET, HEAD");
  }
  int code = 500;
  std::string content_type = "text/plain", body;
  static_cast<OpsServer*>(cls)->Respond(url, &code, &content_type, &body);
  // libmicrohttpd sends the headers of a HEAD answer without its body.
  return Queue(connection, code, content_type, body);
}

void NotifyConnection(void* cls, MHD_Connection* connection, void** /*socket_context*/,
                      enum MHD_ConnectionNotificationCode code) {
  auto* server = static_cast<OpsServer*>(cls);
  if (code == MHD_CONNECTION_NOTIFY_STARTED) {
    server->ConnectionStarted(connection);
  } else {
    server->ConnectionClosed(connection);
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
                                                             ReadinessProbe readiness, ScrapeHook before_scrape,
                                                             OpsServerLimits limits) {
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
                     ::listen(server->listen_fd_, 1024) == 0;
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
  server->registry_ = std::move(registry);
  server->readiness_ = std::move(readiness);
  server->before_scrape_ = std::move(before_scrape);
  server->limits_ = limits;
  // Each connection is a descriptor: make room for the cap on top of what the
  // process already uses (gRPC, Gloo), within the hard limit.
  struct rlimit files;
  if (getrlimit(RLIMIT_NOFILE, &files) == 0) {
    const rlim_t want = static_cast<rlim_t>(limits.max_connections) + 1024;
    if (files.rlim_cur < want) {
      files.rlim_cur = std::min(want, files.rlim_max);
      setrlimit(RLIMIT_NOFILE, &files);
    }
  }
  if (absl::Status s = server->Serve(addr.ss_family == AF_INET6); !s.ok()) {
    return absl::UnavailableError(absl::StrCat("cannot serve HTTP on ", listen, ": ", s.message()));
  }
  return server;
}

absl::StatusOr<std::unique_ptr<OpsServer>> OpsServer::StartWithoutListener(
    std::shared_ptr<prometheus::Registry> registry, ReadinessProbe readiness, ScrapeHook before_scrape,
    OpsServerLimits limits) {
  std::unique_ptr<OpsServer> server(new OpsServer());
  server->registry_ = std::move(registry);
  server->readiness_ = std::move(readiness);
  server->before_scrape_ = std::move(before_scrape);
  server->limits_ = limits;
  if (absl::Status s = server->Serve(/*ipv6=*/false); !s.ok()) return s;
  return server;
}

absl::Status OpsServer::Serve(bool ipv6) {
  unsigned flags = MHD_USE_EPOLL_INTERNAL_THREAD | (ipv6 ? MHD_USE_IPv6 : 0);
  // The listening socket, or none (then connections come from AddConnection,
  // and the polling threads must be woken for them).
  MHD_OptionItem listen_option[] = {{MHD_OPTION_LISTEN_SOCKET, listen_fd_, nullptr},
                                    {MHD_OPTION_END, 0, nullptr}};
  if (listen_fd_ < 0) {
    flags |= MHD_USE_NO_LISTEN_SOCKET | MHD_USE_ITC;
    listen_option[0] = {MHD_OPTION_END, 0, nullptr};
  }
  daemon_ = MHD_start_daemon(
      flags, 0, nullptr, nullptr, &HandleRequest, this,                                          //
      MHD_OPTION_ARRAY, listen_option,                                                           //
      MHD_OPTION_THREAD_POOL_SIZE, static_cast<unsigned>(std::max(1, limits_.threads)),           //
      MHD_OPTION_THREAD_STACK_SIZE, kThreadStackBytes,                                           //
      MHD_OPTION_CONNECTION_LIMIT, static_cast<unsigned>(std::max(1, limits_.max_connections)),   //
      MHD_OPTION_CONNECTION_TIMEOUT,
      static_cast<unsigned>(std::max<int64_t>(1, absl::ToInt64Seconds(limits_.idle_timeout))),  //
      MHD_OPTION_CONNECTION_MEMORY_LIMIT, kConnectionMemoryBytes,                                //
      MHD_OPTION_NOTIFY_CONNECTION, &NotifyConnection, this,                                     //
      MHD_OPTION_END);
  if (daemon_ == nullptr) {
    return absl::UnavailableError("libmicrohttpd did not start (out of threads or memory?)");
  }
  deadline_thread_ = std::thread([this] { EnforceDeadlines(); });
  return absl::OkStatus();
}

absl::Status OpsServer::AddConnection(int fd) {
  // libmicrohttpd wants the peer's address; a handed-over socket (a
  // socketpair) has none, so it is a loopback client.
  struct sockaddr_in peer = {};
  peer.sin_family = AF_INET;
  peer.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (MHD_add_connection(daemon_, fd, reinterpret_cast<struct sockaddr*>(&peer), sizeof(peer)) != MHD_YES) {
    // libmicrohttpd closes the socket when it refuses it.
    return absl::ResourceExhaustedError("libmicrohttpd refused the connection (at its connection limit?)");
  }
  return absl::OkStatus();
}

OpsServer::~OpsServer() {
  stop_.Notify();
  if (deadline_thread_.joinable()) deadline_thread_.join();
  if (daemon_ != nullptr) {
    MHD_stop_daemon(daemon_);  // closes the listening socket too
  } else if (listen_fd_ >= 0) {
    close(listen_fd_);
  }
}

void OpsServer::ConnectionStarted(MHD_Connection* connection) {
  const MHD_ConnectionInfo* info = MHD_get_connection_info(connection, MHD_CONNECTION_INFO_CONNECTION_FD);
  if (info == nullptr) return;
  absl::MutexLock lock(&mu_);
  open_[connection] = {info->connect_fd, absl::Now()};
}

void OpsServer::ConnectionClosed(MHD_Connection* connection) {
  // Called before libmicrohttpd closes the socket, so under mu_ a listed
  // socket is still this connection's.
  absl::MutexLock lock(&mu_);
  open_.erase(connection);
}

void OpsServer::EnforceDeadlines() {
  const absl::Duration period = std::min(absl::Milliseconds(250), limits_.request_deadline / 4);
  while (!stop_.WaitForNotificationWithTimeout(period)) {
    const absl::Time cutoff = absl::Now() - limits_.request_deadline;
    absl::MutexLock lock(&mu_);
    for (auto& [connection, fd_since] : open_) {
      // The poller sees the connection end and closes it.
      if (fd_since.second < cutoff) shutdown(fd_since.first, SHUT_RDWR);
    }
  }
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
