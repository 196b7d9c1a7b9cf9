// OpsServer: the small HTTP server every daemon runs for operators.
//
//   /metrics  Prometheus text format (version 0.0.4) of a prometheus-cpp registry
//   /healthz  200 "ok" while the process is alive and serving
//   /readyz   200 "ready" when the readiness probe says so, else 503 with the reason
//
// prometheus-cpp 1.0.1's Exposer cannot serve extra paths, so this is a small
// HTTP/1.1 server of our own: one thread (with a normal-sized stack) accepts
// connections and answers one GET per connection. Scrapes and probes are
// small and rare, so one thread is plenty; a slow client is cut off after 2 s.
// (civetweb was used first; its worker threads have a fixed small stack that
// the large static TLS of CUDA libraries leaves too little of.)
#ifndef BATON_COMMON_OPS_SERVER_H_
#define BATON_COMMON_OPS_SERVER_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "prometheus/registry.h"

namespace baton {

class OpsServer {
 public:
  // Returns OK when ready for work, or a status whose message says why not.
  using ReadinessProbe = std::function<absl::Status()>;
  // Runs before each /metrics scrape (to refresh gauges derived from state).
  using ScrapeHook = std::function<void()>;

  // Binds `listen` ("HOST:PORT", port 0 picks a free one) and starts serving.
  static absl::StatusOr<std::unique_ptr<OpsServer>> Start(
      const std::string& listen, std::shared_ptr<prometheus::Registry> registry,
      ReadinessProbe readiness, ScrapeHook before_scrape = nullptr);
  ~OpsServer();

  int port() const { return port_; }

 private:
  OpsServer() = default;
  void Serve();
  void HandleConnection(int fd);
  // Status code, content type and body for a GET of `path`.
  void Respond(const std::string& path, int* code, std::string* content_type, std::string* body);

  int listen_fd_ = -1;
  int wake_fds_[2] = {-1, -1};  // written to stop the serving thread
  std::thread thread_;
  int port_ = 0;
  std::shared_ptr<prometheus::Registry> registry_;
  ReadinessProbe readiness_;
  ScrapeHook before_scrape_;
};

// Splits "HOST:PORT" (HOST may be "[::1]"); INVALID_ARGUMENT naming `flag`.
absl::Status ParseHostPort(const std::string& value, const std::string& flag, std::string* host,
                           int* port);

// Writes `{"grpc": N, "http": M}` to `path` atomically (temp file + rename).
absl::Status WritePortFile(const std::string& path, int grpc_port, int http_port);

}  // namespace baton

#endif  // BATON_COMMON_OPS_SERVER_H_
