// The foundation end to end: a real coordinator and three real workers as
// processes on loopback. Killing, freezing and restarting them must show up
// in the registry, in batonctl and in /metrics the way an operator expects.
#include <signal.h>

#include <fstream>
#include <map>
#include <memory>
#include <regex>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "baton/v1/coordinator.grpc.pb.h"
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

constexpr int kLeaseMs = 1500;
constexpr int kHeartbeatMs = 250;

class Cluster {
 public:
  explicit Cluster(const std::string& name) : dir_(TempDir(name)) {}

  void StartCoordinator(int port = 0) {
    std::string port_file = dir_ + "/coordinator.json";
    std::remove(port_file.c_str());
    coordinator_ = std::make_unique<Subprocess>(
        RunfilePath("coordinator/baton-coordinator"),
        Flags({absl::StrCat("--listen=127.0.0.1:", port), "--http_listen=127.0.0.1:0", "--port_file=" + port_file,
               absl::StrCat("--lease_ms=", kLeaseMs), absl::StrCat("--heartbeat_ms=", kHeartbeatMs)}),
        dir_ + "/coordinator.log");
    ASSERT_TRUE(coordinator_->Start().ok());
    auto ports = ReadPortFile(port_file, absl::Seconds(10));
    ASSERT_TRUE(ports.ok()) << coordinator_->Log();
    grpc_port_ = ports->first;
    http_port_ = ports->second;
    stub_ = v1::Coordinator::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", grpc_port_), grpc::InsecureChannelCredentials()));
  }

  void StartWorker(const std::string& name) {
    std::string port_file = dir_ + "/" + name + ".json";
    std::remove(port_file.c_str());
    workers_[name] = std::make_unique<Subprocess>(
        RunfilePath("worker/baton-worker"),
        std::vector<std::string>{absl::StrCat("--coordinator=127.0.0.1:", grpc_port_), "--name=" + name,
                                 "--port_file=" + port_file},
        dir_ + "/" + name + ".log");
    ASSERT_TRUE(workers_[name]->Start().ok());
    auto ports = ReadPortFile(port_file, absl::Seconds(10));
    ASSERT_TRUE(ports.ok()) << workers_[name]->Log();
    worker_grpc_[name] = ports->first;
    worker_http_[name] = ports->second;
  }

  std::map<std::string, v1::WorkerState> States() {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    v1::ListWorkersResponse resp;
    std::map<std::string, v1::WorkerState> out;
    if (!stub_->ListWorkers(&ctx, {}, &resp).ok()) return out;
    for (const auto& w : resp.workers()) out[w.name()] = w.state();
    return out;
  }

  // Seconds until `name` is in `state`, or -1 after `timeout`.
  double AwaitState(const std::string& name, v1::WorkerState state, absl::Duration timeout) {
    const absl::Time start = absl::Now();
    while (absl::Now() - start < timeout) {
      if (States()[name] == state) return absl::ToDoubleSeconds(absl::Now() - start);
      absl::SleepFor(absl::Milliseconds(20));
    }
    return -1;
  }

  bool AwaitAllReady(const std::vector<std::string>& names, absl::Duration timeout) {
    const absl::Time start = absl::Now();
    while (absl::Now() - start < timeout) {
      auto states = States();
      bool all = true;
      for (const auto& n : names) all &= states[n] == v1::READY;
      if (all) return true;
      absl::SleepFor(absl::Milliseconds(20));
    }
    return false;
  }

  std::string Logs() {
    std::string out = "--- coordinator\n" + (coordinator_ ? coordinator_->Log() : "");
    for (auto& [name, w] : workers_) out += "--- " + name + "\n" + w->Log();
    return out;
  }

  std::vector<std::string> Flags(std::vector<std::string> flags) {
    flags.insert(flags.end(), extra_coordinator_flags_.begin(), extra_coordinator_flags_.end());
    return flags;
  }

  std::string dir_;
  std::vector<std::string> extra_coordinator_flags_;
  std::unique_ptr<Subprocess> coordinator_;
  std::map<std::string, std::unique_ptr<Subprocess>> workers_;
  std::map<std::string, int> worker_grpc_, worker_http_;
  int grpc_port_ = 0, http_port_ = 0;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

std::string Scrape(int port) {
  auto r = HttpGet("127.0.0.1", port, "/metrics");
  return r.ok() ? r->body : "";
}

// promtool (from Debian's prometheus package) is the reference parser.
void ExpectPromtoolAccepts(const std::string& metrics) {
  auto r = RunCommand("promtool", {"check", "metrics"}, absl::Seconds(30), metrics);
  ASSERT_NE(r.exit_code, 127) << "promtool not found: run scripts/setup.sh (Debian package 'prometheus')";
  EXPECT_EQ(r.exit_code, 0) << r.output << "\n" << metrics;
}

double MetricValue(const std::string& metrics, const std::string& series) {
  std::regex re("(^|\n)" + std::regex_replace(series, std::regex(R"([{}()\[\].+*?^$|\\])"), R"(\$&)") +
                " ([0-9.e+-]+)");
  std::smatch m;
  if (!std::regex_search(metrics, m, re)) return -1;
  return std::stod(m[2]);
}

// grpc.health.v1 Check on HOST:PORT: the serving status, or UNKNOWN on error.
grpc::health::v1::HealthCheckResponse::ServingStatus HealthOf(int port) {
  auto stub = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::health::v1::HealthCheckResponse resp;
  if (!stub->Check(&ctx, {}, &resp).ok()) return grpc::health::v1::HealthCheckResponse::UNKNOWN;
  return resp.status();
}

TEST(ClusterTest, WorkersComeGoFreezeAndSurviveACoordinatorRestart) {
  Cluster c("lifecycle");
  c.StartCoordinator();
  const std::vector<std::string> names = {"w1", "w2", "w3"};
  for (const auto& n : names) c.StartWorker(n);
  ASSERT_TRUE(c.AwaitAllReady(names, absl::Seconds(10))) << c.Logs();

  // Both daemons serve grpc.health.v1.
  EXPECT_EQ(HealthOf(c.grpc_port_), grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_EQ(HealthOf(c.worker_grpc_["w1"]), grpc::health::v1::HealthCheckResponse::SERVING);

  // Metrics parse (promtool) and count three ready workers.
  std::string metrics = Scrape(c.http_port_);
  EXPECT_EQ(MetricValue(metrics, "baton_workers{state=\"ready\"}"), 3) << metrics;
  EXPECT_EQ(MetricValue(metrics, "baton_build_info{component=\"coordinator\",version=\"0.1.0\"}"), 1) << metrics;
  ExpectPromtoolAccepts(metrics);
  std::string wmetrics = Scrape(c.worker_http_["w1"]);
  EXPECT_GT(MetricValue(wmetrics, "baton_heartbeats_total"), 0) << wmetrics;
  ExpectPromtoolAccepts(wmetrics);

  // batonctl sees the same, as JSON and as a table.
  auto json = RunCommand(RunfilePath("cli/batonctl"),
                         {absl::StrCat("--coordinator=127.0.0.1:", c.grpc_port_), "status", "--json"});
  ASSERT_EQ(json.exit_code, 0) << json.output;
  const std::regex ready_state("\"state\":\"ready\"");
  EXPECT_EQ(std::distance(std::sregex_iterator(json.output.begin(), json.output.end(), ready_state),
                          std::sregex_iterator()),
            3)
      << json.output;
  EXPECT_NE(json.output.find("\"last_heartbeat_age_seconds\":"), std::string::npos);
  auto table = RunCommand(RunfilePath("cli/batonctl"),
                          {"status", absl::StrCat("--coordinator=127.0.0.1:", c.grpc_port_)});
  ASSERT_EQ(table.exit_code, 0) << table.output;
  EXPECT_TRUE(std::regex_search(table.output, std::regex("w2 +ready +cpu"))) << table.output;

  // kill -9: the broken stream makes it lost within a second.
  c.workers_["w1"]->Signal(SIGKILL);
  double lost_after = c.AwaitState("w1", v1::LOST, absl::Seconds(5));
  EXPECT_GE(lost_after, 0) << c.Logs();
  EXPECT_LE(lost_after, 1.0);
  c.workers_["w1"]->Wait(absl::Seconds(5));
  c.StartWorker("w1");
  EXPECT_GE(c.AwaitState("w1", v1::READY, absl::Seconds(10)), 0) << c.Logs();

  // SIGSTOP: silent past its lease, then lost; SIGCONT: it registers again.
  c.workers_["w2"]->Signal(SIGSTOP);
  double frozen_after = c.AwaitState("w2", v1::LOST, absl::Seconds(10));
  EXPECT_GE(frozen_after, 0) << c.Logs();
  EXPECT_LE(frozen_after, kLeaseMs / 1000.0 + 0.5);
  c.workers_["w2"]->Signal(SIGCONT);
  EXPECT_GE(c.AwaitState("w2", v1::READY, absl::Seconds(10)), 0) << c.Logs();

  // Coordinator restart on the same port: every worker re-registers by itself.
  const int port = c.grpc_port_;
  c.coordinator_->Signal(SIGTERM);
  auto code = c.coordinator_->Wait(absl::Seconds(5));
  ASSERT_TRUE(code.has_value()) << "coordinator did not exit within 5 s of SIGTERM\n" << c.Logs();
  EXPECT_EQ(*code, 0);
  c.StartCoordinator(port);
  ASSERT_TRUE(c.AwaitAllReady(names, absl::Seconds(10))) << c.Logs();
  EXPECT_EQ(MetricValue(Scrape(c.http_port_), "baton_workers{state=\"ready\"}"), 3);
  EXPECT_GE(MetricValue(Scrape(c.worker_http_["w3"]), "baton_session_reconnects_total"), 1);

  // SIGTERM a worker: it says goodbye, exits 0 within 5 s, and is shown as left.
  c.workers_["w3"]->Signal(SIGTERM);
  auto wcode = c.workers_["w3"]->Wait(absl::Seconds(5));
  ASSERT_TRUE(wcode.has_value()) << c.Logs();
  EXPECT_EQ(*wcode, 0);
  EXPECT_GE(c.AwaitState("w3", v1::LEFT, absl::Seconds(5)), 0) << c.Logs();
}

TEST(ClusterTest, WorkerWithoutCoordinatorKeepsRetryingAndSaysSoInReadyz) {
  Cluster c("unreachable");
  // Nothing listens on this port: a coordinator that is down.
  c.grpc_port_ = 1;
  c.StartWorker("lonely");
  absl::SleepFor(absl::Milliseconds(1500));
  ASSERT_TRUE(c.workers_["lonely"]->Wait(absl::ZeroDuration()) == std::nullopt) << "worker exited";
  auto ready = HttpGet("127.0.0.1", c.worker_http_["lonely"], "/readyz");
  ASSERT_TRUE(ready.ok());
  EXPECT_EQ(ready->code, 503);
  EXPECT_NE(ready->body.find("coordinator unreachable"), std::string::npos) << ready->body;
  auto health = HttpGet("127.0.0.1", c.worker_http_["lonely"], "/healthz");
  ASSERT_TRUE(health.ok()) << health.status() << "\n" << c.Logs();
  EXPECT_EQ(health->code, 200);
  EXPECT_NE(c.workers_["lonely"]->Log().find("cannot register with coordinator"), std::string::npos);
}

TEST(ClusterTest, AJobNeedingMoreWorkersSaysSoInStatusInsteadOfHanging) {
  Cluster c("shortfall");
  const std::string job = c.dir_ + "/job.textproto";
  std::ofstream(job) << "name: \"big\"\nmodel { layers: 4 d_model: 32 heads: 4 vocab: 16 seq_len: 16 }\n"
                        "parallel { pp: 2 tp: 2 }\nschedule { kind: \"1f1b\" microbatches: 4 }\n"
                        "train { steps: 5 micro_batch_size: 1 }\n";
  // 3 s: the worker must be ready before the shortfall is reported (it loads
  // the CUDA libraries at start where the build links them).
  c.extra_coordinator_flags_ = {"--job=" + job, "--ready_timeout_s=3"};
  c.StartCoordinator();
  c.StartWorker("only");
  ASSERT_GE(c.AwaitState("only", v1::READY, absl::Seconds(10)), 0) << c.Logs();
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  std::string out;
  while (absl::Now() < deadline) {
    auto r = RunCommand(RunfilePath("cli/batonctl"), {"status", absl::StrCat("--coordinator=127.0.0.1:", c.grpc_port_)});
    out = r.output;
    if (out.find("job error") != std::string::npos) break;
    absl::SleepFor(absl::Milliseconds(200));
  }
  EXPECT_NE(out.find("(waiting)"), std::string::npos) << out;
  EXPECT_NE(out.find("needs pp*tp*dp = 4 ready workers, 1 are ready"), std::string::npos) << out;
  EXPECT_NE(out.find("start 3 more"), std::string::npos) << out;
  EXPECT_NE(c.coordinator_->Log().find("start 3 more"), std::string::npos);
}

TEST(ClusterTest, BadFlagsAndJobSpecsExitTwoNamingTheFix) {
  std::string dir = TempDir("badinput");
  std::string job = dir + "/bad.textproto";
  std::ofstream(job) << "name: \"x\"\nmodel { layers: 2 d_model: 64 heads: 3 vocab: 16 seq_len: 8 }\n"
                        "schedule { kind: \"1f1b\" microbatches: 2 }\ntrain { steps: 1 micro_batch_size: 1 }\n";
  auto coordinator = RunfilePath("coordinator/baton-coordinator");
  auto r = RunCommand(coordinator, {"--listen=127.0.0.1:0", "--job=" + job});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("model.heads"), std::string::npos) << r.output;

  std::ofstream(dir + "/unknown.textproto") << "name: \"x\"\nparalel { pp: 2 }\n";
  r = RunCommand(coordinator, {"--listen=127.0.0.1:0", "--job=" + dir + "/unknown.textproto"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("paralel"), std::string::npos) << r.output;

  r = RunCommand(coordinator, {"--listen=127.0.0.1:0", "--lease_ms=100", "--heartbeat_ms=500"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("heartbeat_ms < lease_ms"), std::string::npos) << r.output;

  auto worker = RunfilePath("worker/baton-worker");
  r = RunCommand(worker, {"--coordinator=127.0.0.1:7070", "--device=gpu0"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--device"), std::string::npos) << r.output;
  r = RunCommand(worker, {});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--coordinator"), std::string::npos) << r.output;

  r = RunCommand(RunfilePath("cli/batonctl"), {"status", "--coordinator=127.0.0.1:1", "--timeout_ms=300"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("cannot reach the coordinator"), std::string::npos) << r.output;
  r = RunCommand(RunfilePath("cli/batonctl"), {"status"});
  EXPECT_EQ(r.exit_code, 2) << r.output;
}

}  // namespace
}  // namespace baton
