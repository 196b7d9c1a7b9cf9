// Fuzzes the ops HTTP server (common/ops_server.h) with real request bytes
// through the real server: libmicrohttpd, the request handler, the
// connection bookkeeping. Each input is written into one end of a
// socketpair whose other end was handed to the server (AddConnection, as if
// accepted); the writer then half-closes and reads the reply. The reply must
// be empty (the server closed the connection) or start with a well-formed
// HTTP status line, and the server must close the connection within a
// bounded time. libmicrohttpd and the handler run in the server's own
// threads, as in the daemons.
#include <fcntl.h>
#include <linux/sockios.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "common/ops_server.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"

namespace {

// Far above what the server needs for any request (it answers from memory);
// reaching it means the server neither answered nor closed: a hang.
constexpr auto kReplyDeadline = std::chrono::seconds(8);

baton::OpsServer* Server() {
  static baton::OpsServer* server = [] {
    auto registry = std::make_shared<prometheus::Registry>();
    prometheus::BuildCounter().Name("fuzz_requests_total").Help("h").Register(*registry).Add({{"a", "b"}}).Increment();
    prometheus::BuildGauge().Name("fuzz_gauge").Help("h").Register(*registry).Add({}).Set(1.5);
    baton::OpsServerLimits limits;
    limits.threads = 2;
    limits.max_connections = 64;
    limits.idle_timeout = absl::Seconds(1);
    limits.request_deadline = absl::Seconds(4);
    static int calls = 0;
    absl::StatusOr<std::unique_ptr<baton::OpsServer>> s = baton::OpsServer::StartWithoutListener(
        registry, [] { return ++calls % 2 ? absl::OkStatus() : absl::UnavailableError("fuzz: every other probe"); });
    if (!s.ok()) {
      std::fprintf(stderr, "ops_server_fuzz: %s\n", s.status().ToString().c_str());
      abort();
    }
    return s->release();
  }();
  return server;
}

[[noreturn]] void Fail(const char* what, const std::string& request, const std::string& reply) {
  std::fprintf(stderr, "ops_server_fuzz: %s\n--- request (%zu bytes)\n%.2000s\n--- reply (%zu bytes)\n%.2000s\n", what,
               request.size(), request.c_str(), reply.size(), reply.c_str());
  abort();
}

// "HTTP/1.x NNN " with NNN in 100..599.
bool IsStatusLine(const std::string& reply) {
  if (reply.size() < 13 || reply.compare(0, 7, "HTTP/1.") != 0 || (reply[7] != '0' && reply[7] != '1') ||
      reply[8] != ' ' || reply[12] != ' ') {
    return false;
  }
  for (int i = 9; i < 12; ++i) {
    if (!std::isdigit(static_cast<unsigned char>(reply[i]))) return false;
  }
  return reply[9] >= '1' && reply[9] <= '5';
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  baton::OpsServer* server = Server();
  const std::string request(reinterpret_cast<const char*>(data), size);
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    std::perror("socketpair");
    abort();
  }
  if (absl::Status s = server->AddConnection(sv[1]); !s.ok()) {
    std::fprintf(stderr, "ops_server_fuzz: %s\n", s.ToString().c_str());
    abort();
  }
  fcntl(sv[0], F_SETFL, fcntl(sv[0], F_GETFL) | O_NONBLOCK);
  const auto deadline = std::chrono::steady_clock::now() + kReplyDeadline;
  size_t written = 0;
  bool write_closed = false;
  std::string reply;
  char buf[16384];
  int unread = -1;  // request bytes the server has not read yet
  auto unread_since = std::chrono::steady_clock::now();
  for (;;) {
    if (!write_closed && written == request.size()) {
      // Half-close once the server has read everything: libmicrohttpd polls
      // edge-triggered, and an end of stream that arrives together with the
      // last bytes is only noticed at the idle timeout (seconds per input).
      // A server that stops reading for 100 ms gets the end anyway.
      int queued = 0;
      if (ioctl(sv[0], SIOCOUTQ, &queued) != 0) queued = 0;
      if (queued != unread) {
        unread = queued;
        unread_since = std::chrono::steady_clock::now();
      }
      if (queued == 0 || std::chrono::steady_clock::now() - unread_since > std::chrono::milliseconds(100)) {
        shutdown(sv[0], SHUT_WR);
        write_closed = true;
      }
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) Fail("the server neither answered nor closed the connection in time", request, reply);
    const bool draining = !write_closed && written == request.size();  // waiting for the server to read
    pollfd p = {sv[0], static_cast<short>(POLLIN | (write_closed || draining ? 0 : POLLOUT)), 0};
    if (poll(&p, 1, draining ? 1 : static_cast<int>(left.count())) < 0 && errno != EINTR) {
      std::perror("poll");
      abort();
    }
    if (!write_closed && (p.revents & (POLLOUT | POLLERR | POLLHUP))) {
      const ssize_t n = send(sv[0], request.data() + written, request.size() - written, MSG_NOSIGNAL);
      if (n > 0) {
        written += static_cast<size_t>(n);
      } else if (n < 0 && errno != EAGAIN && errno != EINTR) {
        written = request.size();  // the server closed its end early (e.g. 431): read what it said
      }
    }
    if (p.revents & (POLLIN | POLLHUP | POLLERR)) {
      const ssize_t n = recv(sv[0], buf, sizeof(buf), 0);
      if (n > 0) {
        reply.append(buf, static_cast<size_t>(n));
      } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
        break;  // closed by the server
      }
    }
  }
  close(sv[0]);
  static const bool verbose = getenv("OPS_SERVER_FUZZ_VERBOSE") != nullptr;  // to look at replies
  if (verbose) std::fprintf(stderr, "--- reply (%zu bytes)\n%.600s\n", reply.size(), reply.c_str());
  if (!reply.empty() && !IsStatusLine(reply)) Fail("the reply does not start with an HTTP status line", request, reply);
  return 0;
}
