// OpsServer: the small HTTP server every daemon runs for operators.
//
//   /metrics  Prometheus text format (version 0.0.4) of a prometheus-cpp registry
//   /healthz  200 "ok" while the process is alive and serving
//   /readyz   200 "ready" when the readiness probe says so, else 503 with the reason
//
// prometheus-cpp 1.0.1's Exposer cannot serve extra paths, hence civetweb here.
// Thread-safe: handlers run on civetweb's threads.
#ifndef BATON_COMMON_OPS_SERVER_H_
#define BATON_COMMON_OPS_SERVER_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "prometheus/registry.h"

struct mg_context;
struct mg_connection;

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
  static int HandleMetrics(::mg_connection* conn, void* self);
  static int HandleHealthz(::mg_connection* conn, void* self);
  static int HandleReadyz(::mg_connection* conn, void* self);

  mg_context* ctx_ = nullptr;
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
