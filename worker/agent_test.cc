// WorkerAgent's session logic against a fake coordinator served on loopback
// (real gRPC): registration, readiness, heartbeats, commands and replies,
// registering again after a session ends (with what the worker holds), a
// refused registration as the readiness error, and a coordinator that stops
// answering heartbeats. Every wait is bounded; nothing asserts a duration.
#include "worker/agent.h"

#include <atomic>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/session_fragments.h"
#include "gtest/gtest.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"

namespace baton {
namespace {

constexpr absl::Duration kWait = absl::Seconds(30);  // a bound, not a timing assertion

class FakeCoordinator : public v1::Coordinator::Service {
 public:
  grpc::Status Register(grpc::ServerContext*, const v1::RegisterRequest* req, v1::RegisterResponse* resp) override {
    absl::MutexLock lock(&mu_);
    registrations_.push_back(*req);
    if (!refuse_.ok()) return grpc::Status(static_cast<grpc::StatusCode>(refuse_.code()), std::string(refuse_.message()));
    resp->set_worker_id(7);
    resp->set_incarnation(static_cast<int64_t>(registrations_.size()));
    resp->set_lease_ms(lease_ms_);
    resp->set_heartbeat_ms(20);
    resp->set_any_message_renews_lease(any_message_renews_lease_);
    return grpc::Status::OK;
  }

  grpc::Status Session(grpc::ServerContext* ctx,
                       grpc::ServerReaderWriter<v1::CoordinatorMessage, v1::WorkerMessage>* stream) override {
    int64_t session;
    {
      absl::MutexLock lock(&mu_);
      session = ++sessions_;
    }
    // Reader: heartbeats are acked (unless silent), everything else kept.
    std::thread reader([&] {
      v1::WorkerMessage m;
      while (stream->Read(&m)) {
        absl::MutexLock lock(&mu_);
        if (m.has_heartbeat()) {
          ++heartbeats_;
          last_heartbeat_ = m;
          if (silent_) continue;
          v1::CoordinatorMessage ack;
          ack.mutable_ack()->set_worker_send_time_us(m.heartbeat().send_time_us());
          ack.mutable_ack()->set_coordinator_time_us(absl::ToUnixMicros(absl::Now()));
          outbox_.push_back(ack);
        } else {
          received_.push_back(m);
        }
      }
      absl::MutexLock lock(&mu_);
      reader_done_ = session;
    });
    for (;;) {
      std::deque<v1::CoordinatorMessage> out;
      bool end = false;
      {
        absl::MutexLock lock(&mu_);
        auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return !outbox_.empty() || drop_ || reader_done_ == session || ctx->IsCancelled();
        };
        mu_.AwaitWithTimeout(absl::Condition(&ready), absl::Milliseconds(50));
        out.swap(outbox_);
        if (drop_ || reader_done_ == session || ctx->IsCancelled()) {
          drop_ = false;
          end = true;
        }
      }
      for (const auto& m : out) stream->Write(m);
      if (end) break;
    }
    ctx->TryCancel();  // ends the reader's Read
    reader.join();
    return grpc::Status::OK;
  }

  // Controls.
  void Push(const v1::CoordinatorMessage& m) { PushInARow({m}); }
  // Queues `ms` with nothing between them (a fragmented message's pieces
  // go out in a row, as the coordinator sends them).
  void PushInARow(const std::vector<v1::CoordinatorMessage>& ms) {
    absl::MutexLock lock(&mu_);
    outbox_.insert(outbox_.end(), ms.begin(), ms.end());
  }
  void DropSession() {
    absl::MutexLock lock(&mu_);
    drop_ = true;
  }
  void Refuse(absl::Status s) {
    absl::MutexLock lock(&mu_);
    refuse_ = std::move(s);
  }
  void SetSilent(bool silent) {
    absl::MutexLock lock(&mu_);
    silent_ = silent;
  }
  // False plays a coordinator from before the lease rule (heartbeats only).
  void SetAnyMessageRenewsLease(bool renews) {
    absl::MutexLock lock(&mu_);
    any_message_renews_lease_ = renews;
  }
  void SetLeaseMs(int64_t ms) {
    absl::MutexLock lock(&mu_);
    lease_ms_ = ms;
  }
  // Waits (bounded) until `cond` holds on this fake's state.
  bool WaitFor(const std::function<bool(FakeCoordinator*)>& cond) {
    const absl::Time deadline = absl::Now() + kWait;
    while (absl::Now() < deadline) {
      if (cond(this)) return true;
      absl::SleepFor(absl::Milliseconds(5));
    }
    return false;
  }
  std::vector<v1::RegisterRequest> registrations() {
    absl::MutexLock lock(&mu_);
    return registrations_;
  }
  std::vector<v1::WorkerMessage> received() {
    absl::MutexLock lock(&mu_);
    return received_;
  }
  int heartbeats() {
    absl::MutexLock lock(&mu_);
    return heartbeats_;
  }
  v1::WorkerMessage last_heartbeat() {
    absl::MutexLock lock(&mu_);
    return last_heartbeat_;
  }
  int64_t sessions() {
    absl::MutexLock lock(&mu_);
    return sessions_;
  }

 private:
  absl::Mutex mu_;
  std::vector<v1::RegisterRequest> registrations_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::WorkerMessage> received_ ABSL_GUARDED_BY(mu_);
  std::deque<v1::CoordinatorMessage> outbox_ ABSL_GUARDED_BY(mu_);
  v1::WorkerMessage last_heartbeat_ ABSL_GUARDED_BY(mu_);
  absl::Status refuse_ ABSL_GUARDED_BY(mu_);
  int64_t lease_ms_ ABSL_GUARDED_BY(mu_) = 60000;
  bool any_message_renews_lease_ ABSL_GUARDED_BY(mu_) = true;
  bool drop_ ABSL_GUARDED_BY(mu_) = false;
  bool silent_ ABSL_GUARDED_BY(mu_) = false;
  int heartbeats_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t sessions_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t reader_done_ ABSL_GUARDED_BY(mu_) = 0;
};

class AgentTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&fake_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
  }
  void TearDown() override {
    if (agent_) agent_->Stop(absl::Seconds(2));
    if (run_.joinable()) run_.join();
    server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
  }

  void StartAgent() {
    WorkerAgent::Options o;
    o.coordinator = absl::StrCat("127.0.0.1:", port_);
    o.name = "w0";
    o.host = "host-a";
    o.device = "cpu";
    o.backoff_min = absl::Milliseconds(10);
    o.backoff_max = absl::Milliseconds(50);
    o.describe = [this](v1::RegisterRequest* req) {
      absl::MutexLock lock(&mu_);
      if (!held_job_.empty()) req->mutable_held()->set_job(held_job_);
    };
    agent_ = std::make_unique<WorkerAgent>(
        o, grpc::CreateChannel(o.coordinator, grpc::InsecureChannelCredentials()), metrics_,
        [this](const v1::CoordinatorMessage& m) {
          absl::MutexLock lock(&mu_);
          commands_.push_back(m);
        },
        [this] {
          absl::MutexLock lock(&mu_);
          ++sessions_ended_;
        });
    run_ = std::thread([this] { agent_->Run(); });
  }
  bool WaitReady() {
    const absl::Time deadline = absl::Now() + kWait;
    while (absl::Now() < deadline) {
      if (agent_->Readiness().ok()) return true;
      absl::SleepFor(absl::Milliseconds(5));
    }
    return false;
  }
  bool WaitNotReady() {
    const absl::Time deadline = absl::Now() + kWait;
    while (absl::Now() < deadline) {
      if (!agent_->Readiness().ok()) return true;
      absl::SleepFor(absl::Milliseconds(5));
    }
    return false;
  }
  std::string Metrics() {
    prometheus::TextSerializer text;
    return text.Serialize(metrics_.Collect());
  }
  // The value of the unlabelled counter `name` (-1 when absent).
  double MetricValue(const std::string& name) {
    for (const prometheus::MetricFamily& f : metrics_.Collect()) {
      if (f.name == name && f.metric.size() == 1) return f.metric[0].counter.value;
    }
    return -1;
  }

  FakeCoordinator fake_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  prometheus::Registry metrics_;
  std::unique_ptr<WorkerAgent> agent_;
  std::thread run_;
  absl::Mutex mu_;
  std::vector<v1::CoordinatorMessage> commands_ ABSL_GUARDED_BY(mu_);
  int sessions_ended_ ABSL_GUARDED_BY(mu_) = 0;
  std::string held_job_ ABSL_GUARDED_BY(mu_);
};

TEST_F(AgentTest, RegistersOpensASessionAndCarriesCommandsAndReplies) {
  StartAgent();
  ASSERT_TRUE(WaitReady()) << agent_->Readiness();
  const std::vector<v1::RegisterRequest> regs = fake_.registrations();
  ASSERT_EQ(regs.size(), 1u);
  EXPECT_EQ(regs[0].name(), "w0");
  EXPECT_EQ(regs[0].host(), "host-a");
  EXPECT_EQ(regs[0].device(), "cpu");
  EXPECT_GT(regs[0].pid(), 0);
  EXPECT_FALSE(regs[0].version().empty());
  EXPECT_TRUE(regs[0].verdict_in_run_step()) << "WorkerJob takes a verdict inside RunStep";
  EXPECT_FALSE(regs[0].has_held()) << "holds nothing yet";
  // Heartbeats carry the ids the registration gave and the step it ran.
  agent_->SetStep(42);
  ASSERT_TRUE(fake_.WaitFor([](FakeCoordinator* f) { return f->last_heartbeat().heartbeat().step() == 42; }));
  EXPECT_EQ(fake_.last_heartbeat().worker_id(), 7);
  EXPECT_EQ(fake_.last_heartbeat().incarnation(), 1);
  // A pushed command reaches the handler; a reply goes back with the ids.
  v1::CoordinatorMessage run;
  run.mutable_run_step()->set_step(3);
  fake_.Push(run);
  const absl::Time deadline = absl::Now() + kWait;
  for (;;) {
    absl::MutexLock lock(&mu_);
    if (!commands_.empty() || absl::Now() > deadline) break;
    mu_.AwaitWithTimeout(absl::Condition(+[](std::vector<v1::CoordinatorMessage>* c) { return !c->empty(); },
                                         &commands_),
                         absl::Milliseconds(10));
  }
  {
    absl::MutexLock lock(&mu_);
    ASSERT_EQ(commands_.size(), 1u);
    EXPECT_EQ(commands_[0].run_step().step(), 3);
  }
  v1::WorkerMessage reply;
  reply.mutable_report()->set_step(3);
  ASSERT_TRUE(agent_->Send(reply));
  ASSERT_TRUE(fake_.WaitFor([](FakeCoordinator* f) { return !f->received().empty(); }));
  EXPECT_EQ(fake_.received()[0].report().step(), 3);
  EXPECT_EQ(fake_.received()[0].worker_id(), 7);
  EXPECT_EQ(fake_.received()[0].incarnation(), 1);
  EXPECT_NE(Metrics().find("baton_coordinator_connected 1"), std::string::npos) << Metrics();
}

TEST(HeartbeatDueTest, OnlyWhenNothingElseWentOutForAPeriodOrAfterTheMostSkipped) {
  const absl::Duration period = absl::Milliseconds(500);
  EXPECT_TRUE(WorkerAgent::HeartbeatDue(true, absl::InfiniteDuration(), period, 0)) << "nothing sent yet";
  EXPECT_TRUE(WorkerAgent::HeartbeatDue(true, period, period, 0));
  EXPECT_FALSE(WorkerAgent::HeartbeatDue(true, absl::Milliseconds(499), period, 0)) << "a report renewed the lease";
  EXPECT_FALSE(WorkerAgent::HeartbeatDue(true, absl::ZeroDuration(), period, WorkerAgent::kMaxSkippedHeartbeats - 1));
  EXPECT_TRUE(WorkerAgent::HeartbeatDue(true, absl::ZeroDuration(), period, WorkerAgent::kMaxSkippedHeartbeats))
      << "the clock offset needs an ack now and then";
}

TEST(HeartbeatDueTest, EveryPeriodForACoordinatorThatRenewsOnHeartbeatsOnly) {
  const absl::Duration period = absl::Milliseconds(500);
  EXPECT_TRUE(WorkerAgent::HeartbeatDue(false, absl::ZeroDuration(), period, 0)) << "a report renews nothing there";
  EXPECT_TRUE(WorkerAgent::HeartbeatDue(false, absl::Milliseconds(499), period, 0));
}

// Reports every 2 ms on a session whose heartbeats come every 20 ms.
class BusySender {
 public:
  explicit BusySender(WorkerAgent* agent)
      : thread_([this, agent] {
          v1::WorkerMessage report;
          report.mutable_report()->set_step(1);
          while (!stop_.load()) {
            agent->Send(report);
            absl::SleepFor(absl::Milliseconds(2));
          }
        }) {}
  ~BusySender() {
    stop_ = true;
    thread_.join();
  }

 private:
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// A worker busy sending still heartbeats now and then (at least every 10
// periods), and stays ready; the heartbeats it leaves out are counted.
TEST_F(AgentTest, AWorkerBusySendingStillHeartbeatsNowAndThen) {
  StartAgent();
  ASSERT_TRUE(WaitReady()) << agent_->Readiness();
  BusySender sender(agent_.get());
  const int before = fake_.heartbeats();
  EXPECT_TRUE(fake_.WaitFor([before](FakeCoordinator* f) { return f->heartbeats() >= before + 2; }));
  EXPECT_TRUE(fake_.WaitFor([this](FakeCoordinator*) { return MetricValue("baton_heartbeats_left_out_total") > 0; }))
      << Metrics();
  EXPECT_TRUE(agent_->Readiness().ok()) << agent_->Readiness();
}

// A coordinator from before the lease rule does not say it renews on any
// message: there a busy worker heartbeats every period and leaves none out,
// or that coordinator would take it for lost.
TEST_F(AgentTest, ACoordinatorThatRenewsOnHeartbeatsOnlyGetsEveryHeartbeat) {
  fake_.SetAnyMessageRenewsLease(false);
  StartAgent();
  ASSERT_TRUE(WaitReady()) << agent_->Readiness();
  BusySender sender(agent_.get());
  const int before = fake_.heartbeats();
  ASSERT_TRUE(fake_.WaitFor([before](FakeCoordinator* f) { return f->heartbeats() >= before + 15; }));
  EXPECT_GT(fake_.received().size(), 0u) << "the reports went out meanwhile";
  EXPECT_EQ(MetricValue("baton_heartbeats_left_out_total"), 0) << Metrics();
}

TEST_F(AgentTest, BeforeRegisteringItIsNotReadyAndSendsNothing) {
  fake_.Refuse(absl::UnavailableError("starting"));
  StartAgent();
  ASSERT_TRUE(fake_.WaitFor([](FakeCoordinator* f) { return f->registrations().size() >= 2; }))
      << "it retries with backoff";
  const absl::Status not_ready = agent_->Readiness();
  EXPECT_EQ(not_ready.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(not_ready.message().find("coordinator unreachable"), std::string::npos) << not_ready;
  v1::WorkerMessage reply;
  reply.mutable_report()->set_step(1);
  EXPECT_FALSE(agent_->Send(reply)) << "no session is open";
  fake_.Refuse(absl::OkStatus());
  EXPECT_TRUE(WaitReady()) << agent_->Readiness();
}

TEST_F(AgentTest, ARefusedRegistrationIsTheReadinessErrorUntilAccepted) {
  fake_.Refuse(absl::AlreadyExistsError("worker name 'w0' is held by a live worker on host-b (pid 9)"));
  StartAgent();
  ASSERT_TRUE(fake_.WaitFor([](FakeCoordinator* f) { return f->registrations().size() >= 2; }));
  const absl::Status not_ready = agent_->Readiness();
  EXPECT_EQ(not_ready.code(), absl::StatusCode::kAlreadyExists) << not_ready;
  EXPECT_NE(not_ready.message().find("held by a live worker on host-b"), std::string::npos) << not_ready;
  fake_.Refuse(absl::OkStatus());
  EXPECT_TRUE(WaitReady()) << agent_->Readiness();
}

TEST_F(AgentTest, ItRegistersAgainWhenTheSessionEndsReportingWhatItHolds) {
  StartAgent();
  ASSERT_TRUE(WaitReady()) << agent_->Readiness();
  {
    absl::MutexLock lock(&mu_);
    held_job_ = "demo";  // a job's snapshots survive the session
  }
  fake_.DropSession();
  ASSERT_TRUE(fake_.WaitFor([](FakeCoordinator* f) { return f->sessions() >= 2; }));
  ASSERT_TRUE(WaitReady()) << agent_->Readiness();
  const std::vector<v1::RegisterRequest> regs = fake_.registrations();
  ASSERT_GE(regs.size(), 2u);
  EXPECT_EQ(regs.back().held().job(), "demo");
  {
    absl::MutexLock lock(&mu_);
    EXPECT_GE(sessions_ended_, 1) << "the job was told its session ended";
  }
  // The new incarnation's ids go on the heartbeats.
  const int64_t incarnation = static_cast<int64_t>(regs.size());
  EXPECT_TRUE(fake_.WaitFor([incarnation](FakeCoordinator* f) {
    return f->last_heartbeat().incarnation() == incarnation;
  }));
  EXPECT_NE(Metrics().find("baton_session_reconnects_total 1"), std::string::npos) << Metrics();
}

TEST_F(AgentTest, ACoordinatorThatStopsAnsweringMakesItNotReadyUntilItAnswersAgain) {
  fake_.SetLeaseMs(300);
  StartAgent();
  ASSERT_TRUE(WaitReady()) << agent_->Readiness();
  fake_.SetSilent(true);
  ASSERT_TRUE(WaitNotReady());
  const absl::Status not_ready = agent_->Readiness();
  EXPECT_EQ(not_ready.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(not_ready.message().find("has not been heard from"), std::string::npos) << not_ready;
  EXPECT_EQ(fake_.sessions(), 1) << "the stream is kept";
  fake_.SetSilent(false);
  EXPECT_TRUE(WaitReady()) << agent_->Readiness();
  EXPECT_EQ(fake_.sessions(), 1);
}

// Messages over 3 MiB cross as fragments both ways (docs/protocol.md,
// "Fragments"): the agent sends a big snapshot as its fragments in a row
// with its ids, and joins a fragmented command before the handler sees it.
TEST_F(AgentTest, BigMessagesCrossAsFragmentsBothWays) {
  StartAgent();
  ASSERT_TRUE(WaitReady()) << agent_->Readiness();
  std::string data(7 << 20, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 13);
  v1::WorkerMessage snap;
  snap.mutable_snapshot()->set_owner("w0");
  snap.mutable_snapshot()->set_data(data);
  ASSERT_TRUE(agent_->Send(snap));
  ASSERT_TRUE(fake_.WaitFor([](FakeCoordinator* f) { return f->received().size() >= 3; }));
  std::vector<v1::WorkerMessage> got = fake_.received();
  ASSERT_EQ(got.size(), 3u);
  FragmentAssembler assembler;
  std::optional<std::string> whole;
  for (v1::WorkerMessage& m : got) {
    ASSERT_TRUE(m.has_fragment());
    EXPECT_EQ(m.worker_id(), 7);
    EXPECT_EQ(m.incarnation(), 1);
    auto r = assembler.Add(std::move(*m.mutable_fragment()));
    ASSERT_TRUE(r.ok()) << r.status();
    whole = std::move(*r);
  }
  ASSERT_TRUE(whole.has_value());
  v1::WorkerMessage back;
  ASSERT_TRUE(back.ParseFromString(*whole));
  EXPECT_TRUE(back.snapshot().data() == data);
  EXPECT_EQ(back.worker_id(), 7);

  v1::CoordinatorMessage hold;
  hold.mutable_hold_snapshot()->set_owner("w1");
  hold.mutable_hold_snapshot()->set_data(data);
  std::vector<v1::CoordinatorMessage> pieces;
  for (v1::Fragment& f : SplitIntoFragments(hold.SerializeAsString())) {
    *pieces.emplace_back().mutable_fragment() = std::move(f);
  }
  fake_.PushInARow(pieces);
  const absl::Time deadline = absl::Now() + kWait;
  absl::MutexLock lock(&mu_);
  auto one = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !commands_.empty(); };
  mu_.AwaitWithTimeout(absl::Condition(&one), deadline - absl::Now());
  ASSERT_EQ(commands_.size(), 1u) << "the handler sees the joined command only";
  EXPECT_EQ(commands_[0].hold_snapshot().owner(), "w1");
  EXPECT_TRUE(commands_[0].hold_snapshot().data() == data);
}

// A bad fragment stream from the coordinator ends the session like a broken
// stream: the agent registers again.
TEST_F(AgentTest, ABadFragmentStreamEndsTheSessionAndItRegistersAgain) {
  StartAgent();
  ASSERT_TRUE(WaitReady()) << agent_->Readiness();
  std::vector<v1::Fragment> f = SplitIntoFragments(std::string(kFragmentPayloadBytes * 2 + 1, 'x'));
  v1::CoordinatorMessage piece;
  *piece.mutable_fragment() = f[1];  // no message starts at index 1
  fake_.Push(piece);
  ASSERT_TRUE(fake_.WaitFor([](FakeCoordinator* c) { return c->registrations().size() >= 2; }))
      << "the session was not ended";
  ASSERT_TRUE(WaitReady()) << agent_->Readiness();
  absl::MutexLock lock(&mu_);
  EXPECT_TRUE(commands_.empty());
  EXPECT_GE(sessions_ended_, 1);
}

}  // namespace
}  // namespace baton
