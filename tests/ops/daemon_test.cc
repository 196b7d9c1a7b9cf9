// What systemd and Kubernetes see of the daemons, on real processes:
//  - sd_notify (Type=notify): the coordinator says READY=1 once serving, the
//    worker only once registered with its coordinator; both feed the
//    watchdog (WATCHDOG=1) when $WATCHDOG_USEC asks, and say STOPPING=1.
//  - The worker's grpc.health.v1 status follows readiness: NOT_SERVING while
//    it cannot reach its coordinator, SERVING once registered, NOT_SERVING
//    again when the coordinator goes away; --health_listen (plaintext, for
//    Kubernetes probes) mirrors it.
//  - Bad listen addresses, port offsets and limits exit 2 (the units' RestartPreventExitStatus).
#include <signal.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/http_get.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "tests/testing/process.h"

namespace baton {
namespace {

using testing::ReadPortFile;
using testing::RunCommand;
using testing::RunfilePath;
using testing::Subprocess;
using testing::TempDir;

// A NOTIFY_SOCKET in the abstract namespace (no path length limits).
class NotifySocket {
 public:
  explicit NotifySocket(const std::string& tag) {
    name_ = absl::StrCat("@baton-ops-test-", getpid(), "-", tag);
    fd_ = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un addr = {};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path + 1, name_.data() + 1, name_.size() - 1);
    bound_ = bind(fd_, reinterpret_cast<struct sockaddr*>(&addr),
                  static_cast<socklen_t>(offsetof(struct sockaddr_un, sun_path) + name_.size())) == 0;
  }
  ~NotifySocket() { close(fd_); }
  bool bound() const { return bound_; }
  const std::string& name() const { return name_; }

  // Messages received within `timeout` until one contains `want` (returned
  // last); all of them if none does.
  std::vector<std::string> Until(const std::string& want, absl::Duration timeout) {
    std::vector<std::string> got;
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      struct timeval tv = {0, 50000};
      setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
      char buf[4096];
      const ssize_t n = recv(fd_, buf, sizeof(buf), 0);
      if (n <= 0) continue;
      got.emplace_back(buf, static_cast<size_t>(n));
      if (absl::StrContains(got.back(), want)) return got;
    }
    return got;
  }

 private:
  std::string name_;
  int fd_ = -1;
  bool bound_ = false;
};

bool Contains(const std::vector<std::string>& messages, const std::string& want) {
  for (const auto& m : messages) {
    if (absl::StrContains(m, want)) return true;
  }
  return false;
}

grpc::health::v1::HealthCheckResponse::ServingStatus HealthOf(int port, const std::string& service = "") {
  auto stub = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  if (!stub->Check(&ctx, req, &resp).ok()) return grpc::health::v1::HealthCheckResponse::UNKNOWN;
  return resp.status();
}

bool AwaitHealth(int port, grpc::health::v1::HealthCheckResponse::ServingStatus want, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (HealthOf(port) == want) return true;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return false;
}

int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<struct sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<struct sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

TEST(DaemonTest, CoordinatorNotifiesReadyAndFeedsTheWatchdog) {
  NotifySocket notify("coordinator");
  ASSERT_TRUE(notify.bound());
  const std::string dir = TempDir("coordinator_notify");
  setenv("NOTIFY_SOCKET", notify.name().c_str(), 1);
  setenv("WATCHDOG_USEC", "200000", 1);  // fed every 100 ms
  Subprocess coordinator(RunfilePath("coordinator/baton-coordinator"),
                         {"--listen=127.0.0.1:0", "--http_listen=127.0.0.1:0", "--port_file=" + dir + "/c.json"},
                         dir + "/coordinator.log");
  ASSERT_TRUE(coordinator.Start().ok());
  unsetenv("NOTIFY_SOCKET");
  unsetenv("WATCHDOG_USEC");
  auto ready = notify.Until("READY=1", absl::Seconds(20));
  ASSERT_TRUE(Contains(ready, "READY=1")) << coordinator.Log();
  EXPECT_TRUE(Contains(ready, "STATUS=serving gRPC on port"));
  // Serving by then: the port file is written before READY.
  ASSERT_TRUE(ReadPortFile(dir + "/c.json", absl::Seconds(1)).ok());
  int watchdogs = 0;
  for (const auto& m : notify.Until("never", absl::Seconds(1))) watchdogs += m == "WATCHDOG=1";
  EXPECT_GE(watchdogs, 3) << "WATCHDOG=1 every 100 ms asked for";
  // Stopped (SIGSTOP: as wedged as it gets), nothing feeds it.
  coordinator.Signal(SIGSTOP);
  notify.Until("never", absl::Milliseconds(200));  // drain what was in flight
  EXPECT_FALSE(Contains(notify.Until("never", absl::Milliseconds(500)), "WATCHDOG=1"));
  coordinator.Signal(SIGCONT);
  coordinator.Signal(SIGTERM);
  EXPECT_TRUE(Contains(notify.Until("STOPPING=1", absl::Seconds(10)), "STOPPING=1"));
  EXPECT_EQ(coordinator.Wait(absl::Seconds(10)), 0) << coordinator.Log();
}

TEST(DaemonTest, WorkerIsReadyAndServingOnlyWhileRegistered) {
  NotifySocket notify("worker");
  ASSERT_TRUE(notify.bound());
  const std::string dir = TempDir("worker_notify");
  const int coordinator_port = FreePort();  // nothing listens there yet
  setenv("NOTIFY_SOCKET", notify.name().c_str(), 1);
  setenv("WATCHDOG_USEC", "400000", 1);
  const int health_port = FreePort();  // plaintext health for probes, mirroring the main port
  Subprocess worker(RunfilePath("worker/baton-worker"),
                    {absl::StrCat("--coordinator=127.0.0.1:", coordinator_port), "--name=w0",
                     "--listen=127.0.0.1:0", "--http_listen=127.0.0.1:0", "--port_file=" + dir + "/w.json",
                     absl::StrCat("--health_listen=127.0.0.1:", health_port)},
                    dir + "/worker.log");
  ASSERT_TRUE(worker.Start().ok());
  unsetenv("NOTIFY_SOCKET");
  unsetenv("WATCHDOG_USEC");
  auto ports = ReadPortFile(dir + "/w.json", absl::Seconds(20));
  ASSERT_TRUE(ports.ok()) << worker.Log();

  // No coordinator: alive (watchdog fed), not ready, health NOT_SERVING, /readyz 503.
  auto before = notify.Until("READY=1", absl::Seconds(2));
  EXPECT_FALSE(Contains(before, "READY=1"));
  EXPECT_TRUE(Contains(before, "WATCHDOG=1")) << worker.Log();
  EXPECT_EQ(HealthOf(ports->first), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  // The liveness probe's service stays SERVING: a coordinator outage must not restart workers.
  EXPECT_EQ(HealthOf(ports->first, "liveness"), grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_EQ(HealthOf(health_port), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(HealthOf(health_port, "liveness"), grpc::health::v1::HealthCheckResponse::SERVING);
  auto readyz = HttpGet("127.0.0.1", ports->second, "/readyz");
  ASSERT_TRUE(readyz.ok());
  EXPECT_EQ(readyz->code, 503);

  // The coordinator comes up: READY=1, SERVING.
  auto coordinator = std::make_unique<Subprocess>(
      RunfilePath("coordinator/baton-coordinator"),
      std::vector<std::string>{absl::StrCat("--listen=127.0.0.1:", coordinator_port), "--http_listen=127.0.0.1:0",
                               "--heartbeat_ms=200", "--lease_ms=1500"},
      dir + "/coordinator.log");
  ASSERT_TRUE(coordinator->Start().ok());
  auto registered = notify.Until("READY=1", absl::Seconds(20));
  ASSERT_TRUE(Contains(registered, "READY=1")) << worker.Log() << coordinator->Log();
  EXPECT_TRUE(Contains(registered, "STATUS=registered with"));
  EXPECT_TRUE(AwaitHealth(ports->first, grpc::health::v1::HealthCheckResponse::SERVING, absl::Seconds(5)));
  EXPECT_TRUE(AwaitHealth(health_port, grpc::health::v1::HealthCheckResponse::SERVING, absl::Seconds(5)));

  // The coordinator goes away: NOT_SERVING again (the process lives on).
  coordinator->Signal(SIGTERM);
  EXPECT_EQ(coordinator->Wait(absl::Seconds(10)), 0);
  EXPECT_TRUE(AwaitHealth(ports->first, grpc::health::v1::HealthCheckResponse::NOT_SERVING, absl::Seconds(10)))
      << worker.Log();
  EXPECT_TRUE(AwaitHealth(health_port, grpc::health::v1::HealthCheckResponse::NOT_SERVING, absl::Seconds(5)));
  EXPECT_TRUE(Contains(notify.Until("STATUS=cannot reach", absl::Seconds(5)), "STATUS=cannot reach"));
  worker.Signal(SIGTERM);
  EXPECT_EQ(worker.Wait(absl::Seconds(10)), 0) << worker.Log();
}

TEST(DaemonTest, PortOffsetMovesBothPorts) {
  const std::string dir = TempDir("port_offset");
  const int grpc_target = FreePort(), http_target = FreePort();
  Subprocess worker(RunfilePath("worker/baton-worker"),
                    {"--coordinator=127.0.0.1:1", "--name=w0", absl::StrCat("--listen=127.0.0.1:", grpc_target - 3),
                     absl::StrCat("--http_listen=127.0.0.1:", http_target - 3), "--port_offset=3",
                     "--port_file=" + dir + "/w.json"},
                    dir + "/worker.log");
  ASSERT_TRUE(worker.Start().ok());
  auto ports = ReadPortFile(dir + "/w.json", absl::Seconds(20));
  ASSERT_TRUE(ports.ok()) << worker.Log();
  EXPECT_EQ(ports->first, grpc_target);
  EXPECT_EQ(ports->second, http_target);
  worker.Signal(SIGTERM);
  EXPECT_EQ(worker.Wait(absl::Seconds(10)), 0);
}

TEST(DaemonTest, BadAddressesAndLimitsExitTwoWithTheFix) {
  const std::string big_job = TempDir("big_job") + "/job.textproto";
  {
    std::ofstream f(big_job);
    f << "name: \"big\"\nmodel { layers: 2 synthetic { forward_ms: 0 backward_input_ms: 0 backward_weight_ms: 0 "
         "activation_bytes: 4 } }\nparallel { pp: 2 dp: 64 }\nschedule { kind: \"1f1b\" microbatches: 2 }\n"
         "train { steps: 1 micro_batch_size: 1 lr: 0.001 }\n";
  }
  struct Case {
    std::string binary;
    std::vector<std::string> args;
    std::string says;
  };
  const std::vector<Case> cases = {
      // The old unit's "91%i0" for GPU 10.
      {"worker/baton-worker", {"--coordinator=127.0.0.1:7070", "--http_listen=0.0.0.0:91100"}, "port must be 0..65535"},
      {"worker/baton-worker",
       {"--coordinator=127.0.0.1:7070", "--http_listen=0.0.0.0:65530", "--port_offset=10"},
       "gives port 65540, outside 1..65535"},
      {"worker/baton-worker", {"--coordinator=127.0.0.1:7070", "--port_offset=-1"}, "--port_offset must be >= 0"},
      {"worker/baton-worker", {"--coordinator=127.0.0.1:7070", "--listen=nonsense"}, "must be HOST:PORT"},
      {"worker/baton-worker", {"--coordinator=127.0.0.1:7070", "--host=node 7"}, "a DNS name"},
      {"worker/baton-worker", {"--coordinator=127.0.0.1:7070", "--host=" + std::string(254, 'h')}, "1..253"},
      {"coordinator/baton-coordinator", {"--http_listen=0.0.0.0:99999"}, "port must be 0..65535"},
      {"coordinator/baton-coordinator", {"--max_workers=0"}, "--max_workers=0 must be in 1..131072"},
      // A job larger than the coordinator holds would wait for workers forever.
      {"coordinator/baton-coordinator", {"--job=" + big_job, "--max_workers=64"},
       "needs pp*tp*dp = 128 workers; this coordinator holds at most 64 (--max_workers)"},
  };
  for (const Case& c : cases) {
    auto r = RunCommand(RunfilePath(c.binary), c.args, absl::Seconds(30));
    EXPECT_EQ(r.exit_code, 2) << c.binary << " " << c.args.back() << ": " << r.output;
    EXPECT_TRUE(absl::StrContains(r.output, c.says)) << r.output;
  }
}

}  // namespace
}  // namespace baton
