// Careless operators and a pausing coordinator, with real processes on
// loopback: a second worker with a running worker's name is refused (and
// takes over once the first is gone), a frozen coordinator makes workers not
// ready but does not evict them when it resumes, and a bad --name exits 2.
#include <signal.h>
#include <unistd.h>

#include <map>
#include <memory>
#include <regex>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "baton/v1/coordinator.grpc.pb.h"
#include "common/http_get.h"
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

class LivenessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = TempDir(::testing::UnitTest::GetInstance()->current_test_info()->name());
    coordinator_ = std::make_unique<Subprocess>(
        RunfilePath("coordinator/baton-coordinator"),
        std::vector<std::string>{"--listen=127.0.0.1:0", "--port_file=" + dir_ + "/c.json",
                                 absl::StrCat("--lease_ms=", kLeaseMs), "--heartbeat_ms=250"},
        dir_ + "/coordinator.log");
    ASSERT_TRUE(coordinator_->Start().ok());
    auto ports = ReadPortFile(dir_ + "/c.json", absl::Seconds(10));
    ASSERT_TRUE(ports.ok()) << coordinator_->Log();
    target_ = absl::StrCat("127.0.0.1:", ports->first);
    http_port_ = ports->second;
    stub_ = v1::Coordinator::NewStub(grpc::CreateChannel(target_, grpc::InsecureChannelCredentials()));
  }

  // Starts a worker; returns its HTTP port.
  int StartWorker(const std::string& name, const std::string& instance) {
    const std::string port_file = dir_ + "/" + instance + ".json";
    workers_[instance] = std::make_unique<Subprocess>(
        RunfilePath("worker/baton-worker"),
        std::vector<std::string>{"--coordinator=" + target_, "--name=" + name, "--port_file=" + port_file},
        dir_ + "/" + instance + ".log");
    EXPECT_TRUE(workers_[instance]->Start().ok());
    auto ports = ReadPortFile(port_file, absl::Seconds(10));
    EXPECT_TRUE(ports.ok()) << workers_[instance]->Log();
    return ports.ok() ? ports->second : 0;
  }

  std::map<std::string, v1::WorkerInfo> Workers() {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    v1::ListWorkersResponse resp;
    std::map<std::string, v1::WorkerInfo> out;
    if (!stub_->ListWorkers(&ctx, {}, &resp).ok()) return out;
    for (const auto& w : resp.workers()) out[w.name()] = w;
    return out;
  }

  bool Await(const std::function<bool()>& cond, absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      if (cond()) return true;
      absl::SleepFor(absl::Milliseconds(50));
    }
    return cond();
  }

  std::string Logs() {
    std::string out = "--- coordinator\n" + coordinator_->Log();
    for (auto& [name, w] : workers_) out += "--- " + name + "\n" + w->Log();
    return out;
  }

  std::string dir_, target_;
  int http_port_ = 0;
  std::unique_ptr<Subprocess> coordinator_;
  std::map<std::string, std::unique_ptr<Subprocess>> workers_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

double Metric(const std::string& text, const std::string& series) {
  const size_t at = text.find("\n" + series + " ");
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + series.size() + 2));
}

TEST_F(LivenessTest, ASecondWorkerWithTheSameNameIsRefusedUntilTheFirstIsGone) {
  StartWorker("w1", "first");
  ASSERT_TRUE(Await([&] { return Workers()["w1"].state() == v1::READY; }, absl::Seconds(10))) << Logs();
  const int64_t incarnation = Workers()["w1"].incarnation();

  const int dup_http = StartWorker("w1", "second");
  // For three seconds (two leases) the holder keeps its name and its session.
  std::string readyz;
  for (int i = 0; i < 30; ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    v1::WorkerInfo w = Workers()["w1"];
    ASSERT_EQ(w.incarnation(), incarnation) << Logs();
    ASSERT_EQ(w.state(), v1::READY) << Logs();
  }
  auto ready = HttpGet("127.0.0.1", dup_http, "/readyz");
  ASSERT_TRUE(ready.ok());
  EXPECT_EQ(ready->code, 503);
  EXPECT_NE(ready->body.find(absl::StrCat("pid ", workers_["first"]->pid())), std::string::npos) << ready->body;
  EXPECT_NE(ready->body.find("held by a live worker on host"), std::string::npos) << ready->body;
  auto metrics = HttpGet("127.0.0.1", http_port_, "/metrics");
  ASSERT_TRUE(metrics.ok());
  EXPECT_GE(Metric(metrics->body, "baton_registrations_total{result=\"refused_live\"}"), 1) << metrics->body;
  EXPECT_EQ(Metric(metrics->body, "baton_registrations_total{result=\"accepted\"}"), 1) << metrics->body;

  // The holder dies: the second worker takes the name over by itself.
  workers_["first"]->Signal(SIGKILL);
  ASSERT_TRUE(Await(
      [&] {
        v1::WorkerInfo w = Workers()["w1"];
        return w.state() == v1::READY && w.incarnation() != incarnation;
      },
      absl::Seconds(10)))
      << Logs();
  metrics = HttpGet("127.0.0.1", http_port_, "/metrics");
  ASSERT_TRUE(metrics.ok());
  EXPECT_EQ(Metric(metrics->body, "baton_registrations_total{result=\"replaced\"}"), 1) << metrics->body;
  ready = HttpGet("127.0.0.1", dup_http, "/readyz");
  ASSERT_TRUE(ready.ok());
  EXPECT_EQ(ready->code, 200) << ready->body;
}

TEST_F(LivenessTest, AFrozenCoordinatorMakesWorkersNotReadyAndEvictsNobodyWhenItResumes) {
  const int http_a = StartWorker("a", "a");
  StartWorker("b", "b");
  ASSERT_TRUE(Await(
      [&] {
        auto w = Workers();
        return w["a"].state() == v1::READY && w["b"].state() == v1::READY;
      },
      absl::Seconds(10)))
      << Logs();
  auto before = Workers();

  coordinator_->Signal(SIGSTOP);
  const absl::Time stopped = absl::Now();
  // The worker notices within a lease and a bit (generous: shared CPUs).
  std::string body;
  const bool not_ready = Await(
      [&] {
        auto r = HttpGet("127.0.0.1", http_a, "/readyz");
        if (r.ok()) body = r->body;
        return r.ok() && r->code == 503;
      },
      absl::Seconds(10));
  const absl::Duration noticed = absl::Now() - stopped;
  EXPECT_TRUE(not_ready) << body;
  EXPECT_NE(body.find("has not been heard from"), std::string::npos) << body;
  std::printf("worker /readyz went 503 %.2f s after the coordinator froze (lease %.1f s)\n",
              absl::ToDoubleSeconds(noticed), kLeaseMs / 1000.0);
  // Frozen for more than three leases.
  absl::SleepFor(absl::Milliseconds(3 * kLeaseMs + 500) - (absl::Now() - stopped));
  coordinator_->Signal(SIGCONT);

  // Nobody was evicted: the same incarnations are READY, the workers ready.
  absl::SleepFor(absl::Milliseconds(2 * kLeaseMs));
  auto after = Workers();
  for (const char* n : {"a", "b"}) {
    EXPECT_EQ(after[n].state(), v1::READY) << n << "\n" << Logs();
    EXPECT_EQ(after[n].incarnation(), before[n].incarnation()) << n << " re-registered\n" << Logs();
  }
  EXPECT_NE(coordinator_->Log().find("extended every lease"), std::string::npos) << coordinator_->Log();
  auto ready = HttpGet("127.0.0.1", http_a, "/readyz");
  ASSERT_TRUE(ready.ok());
  EXPECT_EQ(ready->code, 200) << ready->body;
  auto wm = HttpGet("127.0.0.1", http_a, "/metrics");
  ASSERT_TRUE(wm.ok());
  EXPECT_EQ(Metric(wm->body, "baton_coordinator_unresponsive_total"), 1) << wm->body;
  auto cm = HttpGet("127.0.0.1", http_port_, "/metrics");
  ASSERT_TRUE(cm.ok());
  EXPECT_EQ(Metric(cm->body, "baton_workers{state=\"lost\"}"), 0) << cm->body;
  EXPECT_GE(Metric(cm->body, "baton_lease_extensions_total"), 1) << cm->body;
}

// A coordinator that stays silent longer than the worker's keepalive (here a
// long SIGSTOP, as a partition would look) ends the connection on the
// worker's side; the worker registers again once the coordinator is back.
TEST_F(LivenessTest, KeepaliveEndsAConnectionToASilentCoordinator) {
  const std::string port_file = dir_ + "/k.json";
  workers_["k"] = std::make_unique<Subprocess>(
      RunfilePath("worker/baton-worker"),
      std::vector<std::string>{"--coordinator=" + target_, "--name=k", "--port_file=" + port_file,
                               "--keepalive_ms=1000"},
      dir_ + "/k.log");
  ASSERT_TRUE(workers_["k"]->Start().ok());
  ASSERT_TRUE(Await([&] { return Workers()["k"].state() == v1::READY; }, absl::Seconds(10))) << Logs();
  coordinator_->Signal(SIGSTOP);
  const bool ended = Await(
      [&] { return workers_["k"]->Log().find("session with coordinator") != std::string::npos; },
      absl::Seconds(15));
  coordinator_->Signal(SIGCONT);
  EXPECT_TRUE(ended) << "the worker never noticed the silent coordinator\n" << Logs();
  EXPECT_NE(workers_["k"]->Log().find("keepalive"), std::string::npos) << Logs();
  EXPECT_TRUE(Await([&] { return Workers()["k"].state() == v1::READY; }, absl::Seconds(15))) << Logs();
}

TEST(FlagTest, AnInvalidWorkerNameExitsTwoInsteadOfRetryingForever) {
  for (const char* name : {"bad name", "w/1", "é"}) {
    auto r = RunCommand(RunfilePath("worker/baton-worker"), {"--coordinator=127.0.0.1:1", std::string("--name=") + name},
                        absl::Seconds(10));
    EXPECT_EQ(r.exit_code, 2) << name << ": " << r.output;
    EXPECT_NE(r.output.find("--name"), std::string::npos) << r.output;
  }
}

}  // namespace
}  // namespace baton
