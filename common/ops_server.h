// OpsServer: the small HTTP server every daemon runs for operators.
//
//   /metrics  Prometheus text format (version 0.0.4) of a prometheus-cpp registry
//   /healthz  200 "ok" while the process is alive and serving
//   /readyz   200 "ready" when the readiness probe says so, else 503 with the reason
//
// Served by Debian's libmicrohttpd: event-driven (epoll) on a small thread
// pool, so idle or slow clients hold a connection slot each but never delay
// others; at most `max_connections` at once; a connection idle for
// `idle_timeout` is closed, and one still without a complete answer after
// `request_deadline` is cut off; headers larger than 32 KiB get 431; HEAD is
// answered without a body; other methods get 405. The worker threads get an
// 8 MiB stack, which leaves room for the large static TLS of CUDA and
// OpenBLAS (civetweb's fixed small stacks did not).
#ifndef BATON_COMMON_OPS_SERVER_H_
#define BATON_COMMON_OPS_SERVER_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "prometheus/registry.h"

struct MHD_Daemon;
struct MHD_Connection;

namespace baton {

struct OpsServerLimits {
  int max_connections = 1100;
  absl::Duration idle_timeout = absl::Seconds(2);
  absl::Duration request_deadline = absl::Seconds(10);
  int threads = 4;
};

class OpsServer {
 public:
  // Returns OK when ready for work, or a status whose message says why not.
  using ReadinessProbe = std::function<absl::Status()>;
  // Runs before each /metrics scrape (to refresh gauges derived from state).
  using ScrapeHook = std::function<void()>;

  // Binds `listen` ("HOST:PORT", port 0 picks a free one) and starts serving.
  static absl::StatusOr<std::unique_ptr<OpsServer>> Start(
      const std::string& listen, std::shared_ptr<prometheus::Registry> registry,
      ReadinessProbe readiness, ScrapeHook before_scrape = nullptr,
      OpsServerLimits limits = OpsServerLimits());
  ~OpsServer();

  // For the HTTP fuzzer (common/ops_server_fuzz.cc): the same server with no
  // listening socket; connections are handed to it with AddConnection.
  static absl::StatusOr<std::unique_ptr<OpsServer>> StartWithoutListener(
      std::shared_ptr<prometheus::Registry> registry, ReadinessProbe readiness,
      ScrapeHook before_scrape = nullptr, OpsServerLimits limits = OpsServerLimits());
  // Serves the connected stream socket `fd` as if it had been accepted; the
  // server owns `fd` from the call on (it is closed on failure too).
  absl::Status AddConnection(int fd);

  int port() const { return port_; }

  // Status code, content type and body for a GET of `path` (public for the
  // request handler; not part of the interface).
  void Respond(const std::string& path, int* code, std::string* content_type, std::string* body);
  // Connection bookkeeping for the request deadline (called by libmicrohttpd).
  void ConnectionStarted(MHD_Connection* connection);
  void ConnectionClosed(MHD_Connection* connection);

 private:
  OpsServer() = default;
  // Starts libmicrohttpd on listen_fd_ (none when negative) and the deadline
  // thread; `ipv6` when listen_fd_ is an IPv6 socket.
  absl::Status Serve(bool ipv6);
  // Cuts off connections older than the request deadline.
  void EnforceDeadlines();

  int listen_fd_ = -1;
  MHD_Daemon* daemon_ = nullptr;
  int port_ = 0;
  OpsServerLimits limits_;
  std::shared_ptr<prometheus::Registry> registry_;
  ReadinessProbe readiness_;
  ScrapeHook before_scrape_;

  absl::Mutex mu_;
  // Open connections: their socket and when they were accepted.
  std::map<MHD_Connection*, std::pair<int, absl::Time>> open_ ABSL_GUARDED_BY(mu_);
  absl::Notification stop_;
  std::thread deadline_thread_;
};

// Splits "HOST:PORT" (HOST may be "[::1]"); INVALID_ARGUMENT naming `flag`.
absl::Status ParseHostPort(const std::string& value, const std::string& flag, std::string* host,
                           int* port);

// Writes `{"grpc": N, "http": M}` to `path` atomically (temp file + rename).
absl::Status WritePortFile(const std::string& path, int grpc_port, int http_port);

}  // namespace baton

#endif  // BATON_COMMON_OPS_SERVER_H_
