// CoordinatorService through an in-process gRPC channel (no ports).
#include "coordinator/grpc/coordinator_service.h"

#include <grpcpp/grpcpp.h>

#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/session_fragments.h"
#include "gtest/gtest.h"

namespace baton {
namespace {

class CoordinatorServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    stub_ = v1::Coordinator::NewStub(server_->InProcessChannel(grpc::ChannelArguments()));
  }
  void TearDown() override { server_->Shutdown(std::chrono::system_clock::now()); }

  v1::RegisterResponse Register(const std::string& name) {
    grpc::ClientContext ctx;
    v1::RegisterRequest req;
    req.set_name(name);
    req.set_device("cpu");
    v1::RegisterResponse resp;
    EXPECT_TRUE(stub_->Register(&ctx, req, &resp).ok());
    return resp;
  }
  v1::WorkerState StateOf(const std::string& name) {
    grpc::ClientContext ctx;
    v1::ListWorkersResponse resp;
    EXPECT_TRUE(stub_->ListWorkers(&ctx, {}, &resp).ok());
    for (const auto& w : resp.workers()) {
      if (w.name() == name) return w.state();
    }
    return v1::WORKER_STATE_UNSPECIFIED;
  }
  // Polls until `name` is in `state` or ~5 s pass.
  bool AwaitState(const std::string& name, v1::WorkerState state) {
    for (int i = 0; i < 500; ++i) {
      if (StateOf(name) == state) return true;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return false;
  }
  static v1::WorkerMessage Beat(const v1::RegisterResponse& r) {
    v1::WorkerMessage m;
    m.set_worker_id(r.worker_id());
    m.set_incarnation(r.incarnation());
    m.mutable_heartbeat()->set_send_time_us(42);
    return m;
  }

  FakeClock clock_;
  WorkerRegistry registry_{&clock_, absl::Seconds(3)};
  KvStore kv_;
  CoordinatorService service_{&registry_, &kv_, {}};
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

TEST_F(CoordinatorServiceTest, SessionHeartbeatsAreAckedAndStreamEndMeansLost) {
  v1::RegisterResponse r = Register("w1");
  EXPECT_EQ(StateOf("w1"), v1::JOINING);
  grpc::ClientContext ctx;
  auto stream = stub_->Session(&ctx);
  ASSERT_TRUE(stream->Write(Beat(r)));
  v1::CoordinatorMessage ack;
  ASSERT_TRUE(stream->Read(&ack));
  ASSERT_TRUE(ack.has_ack());
  EXPECT_EQ(ack.ack().worker_send_time_us(), 42);
  EXPECT_GT(ack.ack().coordinator_time_us(), 0);
  EXPECT_EQ(StateOf("w1"), v1::READY);
  ctx.TryCancel();  // the worker dies
  EXPECT_TRUE(AwaitState("w1", v1::LOST));
}

// A worker leaves heartbeats out while it sends other messages (worker/
// agent.h): any message on the session renews its lease, and a report
// carries the worker's step.
TEST_F(CoordinatorServiceTest, AnyMessageRenewsTheLeaseAndAReportCarriesTheStep) {
  v1::RegisterResponse r = Register("w1");
  EXPECT_TRUE(r.any_message_renews_lease()) << "the worker leaves heartbeats out only when told so";
  grpc::ClientContext ctx;
  auto stream = stub_->Session(&ctx);
  ASSERT_TRUE(stream->Write(Beat(r)));
  v1::CoordinatorMessage ack;
  ASSERT_TRUE(stream->Read(&ack));
  for (int64_t step = 1; step <= 5; ++step) {
    clock_.Advance(absl::Seconds(2));  // under the 3 s lease since the last message, over it since the heartbeat
    v1::WorkerMessage report;
    report.set_worker_id(r.worker_id());
    report.set_incarnation(r.incarnation());
    report.mutable_report()->set_step(step);
    ASSERT_TRUE(stream->Write(report));
    // Handled once ListWorkers shows its step (one stream: in order).
    bool seen = false;
    for (int i = 0; i < 500 && !seen; ++i) {
      grpc::ClientContext list_ctx;
      v1::ListWorkersResponse list;
      ASSERT_TRUE(stub_->ListWorkers(&list_ctx, {}, &list).ok());
      seen = list.workers_size() == 1 && list.workers(0).step() == step;
      if (!seen) absl::SleepFor(absl::Milliseconds(10));
    }
    ASSERT_TRUE(seen) << "step " << step;
    EXPECT_TRUE(registry_.ExpireLeases().empty()) << "step " << step;
  }
  EXPECT_EQ(StateOf("w1"), v1::READY);
  clock_.Advance(absl::Seconds(2));  // then silence: lost once a lease passed
  EXPECT_TRUE(registry_.ExpireLeases().empty());
  clock_.Advance(absl::Milliseconds(1001));
  EXPECT_EQ(registry_.ExpireLeases().size(), 1u);
  EXPECT_EQ(StateOf("w1"), v1::LOST);
}

TEST_F(CoordinatorServiceTest, GoodbyeThenCloseIsLeftNotLost) {
  v1::RegisterResponse r = Register("w1");
  grpc::ClientContext ctx;
  auto stream = stub_->Session(&ctx);
  ASSERT_TRUE(stream->Write(Beat(r)));
  v1::CoordinatorMessage ack;  // the in-process transport hands messages over only to a waiting reader
  ASSERT_TRUE(stream->Read(&ack));
  v1::WorkerMessage bye;
  bye.set_worker_id(r.worker_id());
  bye.set_incarnation(r.incarnation());
  bye.mutable_goodbye()->set_reason("SIGTERM");
  ASSERT_TRUE(stream->Write(bye));
  stream->WritesDone();
  v1::CoordinatorMessage msg;
  while (stream->Read(&msg)) {
  }
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(StateOf("w1"), v1::LEFT);
}

TEST_F(CoordinatorServiceTest, SessionForUnknownOrStaleIncarnationIsFailedPrecondition) {
  v1::RegisterResponse old = Register("w1");
  clock_.Advance(absl::Seconds(4));  // `old` never opened a session: its lease is over
  Register("w1");  // replaces `old`
  grpc::ClientContext ctx;
  auto stream = stub_->Session(&ctx);
  ASSERT_TRUE(stream->Write(Beat(old)));
  v1::CoordinatorMessage msg;
  EXPECT_FALSE(stream->Read(&msg));
  grpc::Status s = stream->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(s.error_message().find("register again"), std::string::npos);
}

TEST_F(CoordinatorServiceTest, MissingFieldsAreInvalidArgument) {
  {
    grpc::ClientContext ctx;
    v1::RegisterResponse resp;
    EXPECT_EQ(stub_->Register(&ctx, {}, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  {
    grpc::ClientContext ctx;
    auto stream = stub_->Session(&ctx);
    ASSERT_TRUE(stream->Write(v1::WorkerMessage()));
    v1::CoordinatorMessage msg;
    EXPECT_FALSE(stream->Read(&msg));
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  {
    grpc::ClientContext ctx;
    v1::KvSetResponse resp;
    EXPECT_EQ(stub_->KvSet(&ctx, {}, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  {
    grpc::ClientContext ctx;
    v1::KvWaitResponse resp;
    EXPECT_EQ(stub_->KvWait(&ctx, {}, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
}

TEST_F(CoordinatorServiceTest, KvRoundTripAndWaitTimesOutNamingTheKey) {
  v1::KvKey key;
  key.set_job("j");
  key.set_generation(1);
  key.set_key("rank0");
  {
    grpc::ClientContext ctx;
    v1::KvSetRequest req;
    *req.mutable_key() = key;
    req.set_value("tcp://127.0.0.1:1");
    v1::KvSetResponse resp;
    ASSERT_TRUE(stub_->KvSet(&ctx, req, &resp).ok());
  }
  {
    grpc::ClientContext ctx;
    v1::KvGetRequest req;
    *req.mutable_key() = key;
    v1::KvGetResponse resp;
    ASSERT_TRUE(stub_->KvGet(&ctx, req, &resp).ok());
    EXPECT_EQ(resp.value(), "tcp://127.0.0.1:1");
  }
  {
    grpc::ClientContext ctx;
    v1::KvAddRequest req;
    *req.mutable_key() = key;
    req.mutable_key()->set_key("arrived");
    req.set_delta(1);
    v1::KvAddResponse resp;
    ASSERT_TRUE(stub_->KvAdd(&ctx, req, &resp).ok());
    EXPECT_EQ(resp.value(), 1);
  }
  {
    grpc::ClientContext ctx;
    v1::KvWaitRequest req;
    *req.add_keys() = key;
    *req.add_keys() = key;
    req.mutable_keys(1)->set_key("rank1");
    req.set_timeout_ms(50);
    v1::KvWaitResponse resp;
    grpc::Status s = stub_->KvWait(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
    EXPECT_NE(s.error_message().find("rank1"), std::string::npos);
  }
  {
    grpc::ClientContext ctx;
    v1::GetStatusResponse resp;
    ASSERT_TRUE(stub_->GetStatus(&ctx, {}, &resp).ok());
    EXPECT_FALSE(resp.version().empty());
  }
}

// A service with non-default options, on its own in-process server.
class ServiceWith {
 public:
  explicit ServiceWith(CoordinatorService::Options options) : service_(&registry_, &kv_, options) {
    grpc::ServerBuilder builder;
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    stub_ = v1::Coordinator::NewStub(server_->InProcessChannel(grpc::ChannelArguments()));
  }
  ~ServiceWith() { server_->Shutdown(std::chrono::system_clock::now()); }

  grpc::Status Register(const std::string& name, const std::string& token, int64_t pid = 1) {
    grpc::ClientContext ctx;
    if (!token.empty()) ctx.AddMetadata("baton-join-token", token);
    v1::RegisterRequest req;
    req.set_name(name);
    req.set_device("cpu");
    req.set_host("host-a");
    req.set_pid(pid);
    v1::RegisterResponse resp;
    return stub_->Register(&ctx, req, &resp);
  }

  FakeClock clock_;
  WorkerRegistry registry_{&clock_, absl::Seconds(3)};
  KvStore kv_;
  CoordinatorService service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

// Roles and the join token: rpc_authorization_test.cc.

TEST(CoordinatorServiceAuthTest, ADuplicateNameIsAlreadyExistsAndCounted) {
  auto metrics = std::make_shared<prometheus::Registry>();
  CoordinatorService::Options options;
  options.metrics = metrics.get();
  ServiceWith s(options);
  ASSERT_TRUE(s.Register("w1", "", 111).ok());
  grpc::Status dup = s.Register("w1", "", 222);
  EXPECT_EQ(dup.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_NE(dup.error_message().find("host 'host-a' pid 111"), std::string::npos) << dup.error_message();
  s.clock_.Advance(absl::Seconds(4));
  EXPECT_TRUE(s.Register("w1", "", 222).ok());
  std::map<std::string, double> counts;
  for (const auto& family : metrics->Collect()) {
    if (family.name != "baton_registrations_total") continue;
    for (const auto& m : family.metric) counts[m.label.at(0).value] = m.counter.value;
  }
  EXPECT_EQ(counts["accepted"], 1);
  EXPECT_EQ(counts["refused_live"], 1);
  EXPECT_EQ(counts["replaced"], 1);
}

TEST(CoordinatorServiceAuthTest, KvOfAnotherJobIsRefusedAndWaitsAreCapped) {
  CoordinatorService::Options options;
  options.job_name = "mine";
  options.max_pending_kv_waits = 2;
  ServiceWith s(options);
  {
    grpc::ClientContext ctx;
    v1::KvSetRequest set;
    set.mutable_key()->set_job("junk");
    set.mutable_key()->set_key("k");
    v1::KvSetResponse resp;
    grpc::Status st = s.stub_->KvSet(&ctx, set, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(st.error_message().find("not this coordinator's job 'mine'"), std::string::npos) << st.error_message();
  }
  auto wait = [&](int64_t timeout_ms) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::KvWaitRequest req;
    v1::KvKey* key = req.add_keys();
    key->set_job("mine");
    key->set_key("never");
    req.set_timeout_ms(timeout_ms);
    v1::KvWaitResponse resp;
    return s.stub_->KvWait(&ctx, req, &resp);
  };
  std::thread w1([&] { EXPECT_EQ(wait(3000).error_code(), grpc::StatusCode::DEADLINE_EXCEEDED); });
  std::thread w2([&] { EXPECT_EQ(wait(3000).error_code(), grpc::StatusCode::DEADLINE_EXCEEDED); });
  absl::SleepFor(absl::Milliseconds(500));  // both are pending (they wait 3 s)
  grpc::Status third = wait(10);
  EXPECT_EQ(third.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << third.error_message();
  w1.join();
  w2.join();
  EXPECT_EQ(wait(10).error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);  // room again
}

// A job whose trace takes until released.
class SlowTraceJob : public JobObserver {
 public:
  void OnWorkerMessage(const std::string&, v1::WorkerMessage) override {}
  void OnWorkerLost(const std::string&, const std::string&, bool) override {}
  void FillStatus(v1::GetStatusResponse*) const override {}
  std::string TraceJson(int, absl::Duration) override {
    release_.WaitForNotificationWithTimeout(absl::Seconds(20));
    return "{}";
  }
  absl::Notification release_;
};

TEST(CoordinatorServiceAuthTest, PendingTracesAreCapped) {
  SlowTraceJob job;
  CoordinatorService::Options options;
  options.job_name = "j";
  options.job = &job;
  options.max_pending_traces = 1;
  ServiceWith s(options);
  auto trace = [&](int steps) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::GetTraceRequest req;
    req.set_steps(steps);
    v1::GetTraceResponse resp;
    return s.stub_->GetTrace(&ctx, req, &resp);
  };
  EXPECT_EQ(trace(1001).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  std::thread first([&] { EXPECT_TRUE(trace(1).ok()); });
  absl::SleepFor(absl::Milliseconds(500));  // `first` is being traced
  grpc::Status second = trace(1);
  EXPECT_EQ(second.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << second.error_message();
  job.release_.Notify();
  first.join();
  EXPECT_TRUE(trace(1).ok());  // room again
}


// Records what the service tells the job.
class RecordingObserver final : public JobObserver {
 public:
  void OnWorkerMessage(const std::string&, v1::WorkerMessage message) override {
    absl::MutexLock lock(&mu_);
    messages_.push_back(std::move(message));
  }
  // The job messages handed over so far, once there are at least `n` (~5 s).
  std::vector<v1::WorkerMessage> AwaitMessages(size_t n) {
    absl::MutexLock lock(&mu_);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return messages_.size() >= n; };
    mu_.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(5));
    return messages_;
  }
  void OnWorkerLost(const std::string& worker, const std::string& why, bool) override {
    absl::MutexLock lock(&mu_);
    lost_[worker] = why;
  }
  void FillStatus(v1::GetStatusResponse*) const override {}
  std::string TraceJson(int, absl::Duration) override { return "{}"; }
  // Why `worker` was lost; "" if it was not within ~5 s.
  std::string AwaitLost(const std::string& worker) {
    absl::MutexLock lock(&mu_);
    auto lost = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return lost_.count(worker) > 0; };
    mu_.AwaitWithTimeout(absl::Condition(&lost), absl::Seconds(5));
    return lost_.count(worker) ? lost_[worker] : "";
  }

 private:
  absl::Mutex mu_;
  std::map<std::string, std::string> lost_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::WorkerMessage> messages_ ABSL_GUARDED_BY(mu_);
};

v1::CoordinatorMessage BigCommand(size_t bytes) {
  v1::CoordinatorMessage m;
  m.mutable_hold_snapshot()->set_owner("w0");
  m.mutable_hold_snapshot()->set_data(std::string(bytes, 'x'));
  return m;
}

using SessionStream = grpc::ClientReaderWriter<v1::WorkerMessage, v1::CoordinatorMessage>;

// Registers w1, opens its Session with one heartbeat, reads the ack and
// returns the coordinator's handle of the session (null, with a failure
// recorded, if any of it failed). The stream stays open in *stream.
std::shared_ptr<SessionHandle> OpenW1Session(ServiceWith& s, grpc::ClientContext* ctx,
                                             std::unique_ptr<SessionStream>* stream) {
  if (!s.Register("w1", "").ok()) {
    ADD_FAILURE() << "Register failed";
    return nullptr;
  }
  const int64_t id = s.registry_.List()[0].worker_id();
  *stream = s.stub_->Session(ctx);
  v1::WorkerMessage beat;
  beat.set_worker_id(id);
  beat.set_incarnation(id);
  beat.mutable_heartbeat()->set_send_time_us(1);
  v1::CoordinatorMessage ack;
  if (!(*stream)->Write(beat) || !(*stream)->Read(&ack) || !ack.has_ack()) {
    ADD_FAILURE() << "the first heartbeat was not acknowledged";
    return nullptr;
  }
  return s.registry_.SessionOf("w1");
}

// A worker whose stream stops reading: Send keeps returning at once, the
// coordinator holds at most the configured queue for it, then ends its
// session with the reason (the worker is lost) and Send is false.
TEST(CoordinatorServiceSessionTest, AWorkerThatStopsReadingIsEndedNotBuffered) {
  RecordingObserver job;
  CoordinatorService::Options options;
  options.job = &job;
  options.max_session_queue_messages = 8;
  options.max_session_queue_bytes = size_t{1} << 20;
  ServiceWith s(options);
  grpc::ClientContext ctx;
  std::unique_ptr<SessionStream> stream;
  std::shared_ptr<SessionHandle> session = OpenW1Session(s, &ctx, &stream);
  ASSERT_NE(session, nullptr);

  // The worker reads nothing more. 256 KiB commands: the 1 MiB bound holds 4.
  int accepted = 0;
  for (int i = 0; i < 10000 && session->Send(BigCommand(256 << 10)); ++i) ++accepted;
  EXPECT_LT(accepted, 10000) << "every command was queued: the queue grows without bound";
  EXPECT_LE(accepted, 1 + 4 + 1) << "more than the in-flight write, the queue's 4 and one the transport took";
  EXPECT_FALSE(session->Send(BigCommand(1))) << "a session ended for not reading takes no more commands";

  const std::string why = job.AwaitLost("w1");
  EXPECT_NE(why.find("does not read its session"), std::string::npos) << why;
  EXPECT_NE(why.find("1048576 bytes"), std::string::npos) << "the reason names the limit: " << why;
  v1::CoordinatorMessage msg;
  while (stream->Read(&msg)) {
  }
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(s.registry_.List()[0].state(), v1::LOST);
  EXPECT_FALSE(session->Send(BigCommand(1)));
}

// Too many small messages count like too many bytes.
TEST(CoordinatorServiceSessionTest, TheMessageBoundEndsASessionToo) {
  RecordingObserver job;
  CoordinatorService::Options options;
  options.job = &job;
  options.max_session_queue_messages = 16;
  ServiceWith s(options);
  grpc::ClientContext ctx;
  std::unique_ptr<SessionStream> stream;
  std::shared_ptr<SessionHandle> session = OpenW1Session(s, &ctx, &stream);
  ASSERT_NE(session, nullptr);
  int accepted = 0;
  for (int i = 0; i < 10000 && session->Send(BigCommand(10)); ++i) ++accepted;
  EXPECT_LE(accepted, 1 + 16 + 1);
  EXPECT_NE(job.AwaitLost("w1").find("16 messages"), std::string::npos) << job.AwaitLost("w1");
}

// Close ends the stream (the worker sees CANCELLED), the worker is lost, and
// Send on the closed session is false at once, also while the worker is
// not reading.
TEST(CoordinatorServiceSessionTest, SendOnAClosedSessionIsFalse) {
  RecordingObserver job;
  CoordinatorService::Options options;
  options.job = &job;
  ServiceWith s(options);
  grpc::ClientContext ctx;
  std::unique_ptr<SessionStream> stream;
  std::shared_ptr<SessionHandle> session = OpenW1Session(s, &ctx, &stream);
  ASSERT_NE(session, nullptr);
  EXPECT_TRUE(session->Send(BigCommand(10)));  // in flight: nobody reads it
  session->Close(absl::AbortedError("test closes it"));
  EXPECT_FALSE(session->Send(BigCommand(10)));
  EXPECT_EQ(job.AwaitLost("w1"), "its session ended");
  v1::CoordinatorMessage msg;
  while (stream->Read(&msg)) {
  }
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(s.registry_.List()[0].state(), v1::LOST);
  EXPECT_FALSE(session->Send(BigCommand(10)));
  session->Close(absl::AbortedError("again"));  // harmless
  EXPECT_TRUE(s.service_.AwaitSessionsDone(absl::Seconds(5)));
}

// A snapshot over gRPC's 4 MiB limit comes as fragments: the job gets it
// whole, and every fragment renews the lease (a long transfer is not a hung
// worker).
TEST(CoordinatorServiceFragmentTest, AFragmentedMessageIsJoinedAndHandledWhole) {
  RecordingObserver job;
  CoordinatorService::Options options;
  options.job = &job;
  ServiceWith s(options);
  grpc::ClientContext ctx;
  std::unique_ptr<SessionStream> stream;
  std::shared_ptr<SessionHandle> session = OpenW1Session(s, &ctx, &stream);
  ASSERT_NE(session, nullptr);
  const int64_t id = s.registry_.List()[0].worker_id();
  v1::WorkerMessage snap;
  snap.set_worker_id(id);
  snap.set_incarnation(id);
  snap.mutable_snapshot()->set_owner("w1");
  snap.mutable_snapshot()->set_step(7);
  std::string data(9 << 20, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 7);
  snap.mutable_snapshot()->set_data(data);
  std::vector<v1::Fragment> fragments = SplitIntoFragments(snap.SerializeAsString());
  ASSERT_EQ(fragments.size(), 4u);
  for (size_t i = 0; i < fragments.size(); ++i) {
    v1::WorkerMessage piece;
    piece.set_worker_id(id);
    piece.set_incarnation(id);
    *piece.mutable_fragment() = std::move(fragments[i]);
    if (i + 1 == fragments.size()) {
      // 6 s since the heartbeat, but the fragments renewed the 3 s lease.
      EXPECT_TRUE(s.registry_.ExpireLeases().empty()) << "a fragment did not renew the lease";
      EXPECT_TRUE(job.AwaitMessages(0).empty()) << "handed over before its last fragment";
    }
    s.clock_.Advance(absl::Seconds(2));
    ASSERT_TRUE(stream->Write(piece));
    if (i + 1 == fragments.size()) break;
    // Handled: it renewed the lease at the advanced clock (bounded wait).
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (s.registry_.List()[0].last_heartbeat_age_seconds() != 0 && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    ASSERT_EQ(s.registry_.List()[0].last_heartbeat_age_seconds(), 0) << "fragment " << i << " did not renew the lease";
  }
  std::vector<v1::WorkerMessage> got = job.AwaitMessages(1);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].snapshot().step(), 7);
  EXPECT_TRUE(got[0].snapshot().data() == data);
  EXPECT_EQ(s.registry_.List()[0].state(), v1::READY) << "a fragment did not renew the lease";
  // Then whole messages again.
  v1::WorkerMessage report;
  report.set_worker_id(id);
  report.set_incarnation(id);
  report.mutable_report()->set_step(8);
  ASSERT_TRUE(stream->Write(report));
  EXPECT_EQ(job.AwaitMessages(2).size(), 2u);
}

// Each violation of the fragment rules ends the session, with a status that
// says what was wrong.
TEST(CoordinatorServiceFragmentTest, ABadFragmentStreamEndsTheSession) {
  struct Case {
    std::string name;
    std::function<std::vector<v1::Fragment>(const std::vector<v1::Fragment>&)> make;
    std::string says;
  };
  const std::vector<Case> cases = {
      {"starts past 0", [](const std::vector<v1::Fragment>& f) { return std::vector<v1::Fragment>{f[1]}; },
       "arrived with no message in assembly"},
      {"skips one", [](const std::vector<v1::Fragment>& f) { return std::vector<v1::Fragment>{f[0], f[2]}; },
       "expected fragment 1 of 3"},
      {"wrong count",
       [](const std::vector<v1::Fragment>& f) {
         v1::Fragment x = f[0];
         x.set_count(5);
         return std::vector<v1::Fragment>{x};
       },
       "count 5 does not match"},
      {"over the bound",
       [](const std::vector<v1::Fragment>& f) {
         v1::Fragment x = f[0];
         x.set_total_bytes(int64_t{3} << 30);
         x.set_count(1024);
         return std::vector<v1::Fragment>{x};
       },
       "over this receiver's bound"},
      {"short fragment",
       [](const std::vector<v1::Fragment>& f) {
         v1::Fragment x = f[0];
         x.mutable_data()->resize(100);
         return std::vector<v1::Fragment>{x};
       },
       "carries 100 bytes"},
      {"not a message",
       [](const std::vector<v1::Fragment>&) {
         return SplitIntoFragments(std::string(kFragmentPayloadBytes + 10, '\xff'));
       },
       "are not a WorkerMessage"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    RecordingObserver job;
    CoordinatorService::Options options;
    options.job = &job;
    ServiceWith s(options);
    grpc::ClientContext ctx;
    std::unique_ptr<SessionStream> stream;
    std::shared_ptr<SessionHandle> session = OpenW1Session(s, &ctx, &stream);
    ASSERT_NE(session, nullptr);
    const int64_t id = s.registry_.List()[0].worker_id();
    v1::WorkerMessage snap;
    snap.set_worker_id(id);
    snap.set_incarnation(id);
    snap.mutable_snapshot()->set_data(std::string(7 << 20, 'x'));
    for (v1::Fragment& f : c.make(SplitIntoFragments(snap.SerializeAsString()))) {
      v1::WorkerMessage piece;
      piece.set_worker_id(id);
      piece.set_incarnation(id);
      *piece.mutable_fragment() = std::move(f);
      if (!stream->Write(piece)) break;
    }
    v1::CoordinatorMessage msg;
    while (stream->Read(&msg)) {
    }
    const grpc::Status status = stream->Finish();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
    EXPECT_NE(status.error_message().find(c.says), std::string::npos) << status.error_message();
    EXPECT_EQ(job.AwaitLost("w1"), "its session ended");
    EXPECT_TRUE(job.AwaitMessages(0).empty());
  }
}

// A whole message in the middle of a fragmented one is refused too.
TEST(CoordinatorServiceFragmentTest, AWholeMessageBetweenFragmentsEndsTheSession) {
  RecordingObserver job;
  CoordinatorService::Options options;
  options.job = &job;
  ServiceWith s(options);
  grpc::ClientContext ctx;
  std::unique_ptr<SessionStream> stream;
  std::shared_ptr<SessionHandle> session = OpenW1Session(s, &ctx, &stream);
  ASSERT_NE(session, nullptr);
  const int64_t id = s.registry_.List()[0].worker_id();
  v1::WorkerMessage piece;
  piece.set_worker_id(id);
  piece.set_incarnation(id);
  *piece.mutable_fragment() = FragmentOf(std::string(kFragmentPayloadBytes + 1, 'x'), 0);
  ASSERT_TRUE(stream->Write(piece));
  v1::WorkerMessage report;
  report.set_worker_id(id);
  report.set_incarnation(id);
  report.mutable_report()->set_step(1);
  stream->Write(report);
  v1::CoordinatorMessage msg;
  while (stream->Read(&msg)) {
  }
  const grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("a whole message arrived while"), std::string::npos) << status.error_message();
}

// A command over 3 MiB goes as its fragments in a row, before the next
// queued command; the worker joins them.
TEST(CoordinatorServiceFragmentTest, ABigCommandIsSentAsFragmentsInARow) {
  RecordingObserver job;
  CoordinatorService::Options options;
  options.job = &job;
  ServiceWith s(options);
  grpc::ClientContext ctx;
  std::unique_ptr<SessionStream> stream;
  std::shared_ptr<SessionHandle> session = OpenW1Session(s, &ctx, &stream);
  ASSERT_NE(session, nullptr);
  v1::CoordinatorMessage big = BigCommand(8 << 20);
  ASSERT_TRUE(session->Send(big));
  ASSERT_TRUE(session->Send(BigCommand(10)));
  ASSERT_TRUE(session->Send(big));
  FragmentAssembler assembler;
  std::vector<v1::CoordinatorMessage> got;
  while (got.size() < 3) {
    v1::CoordinatorMessage msg;
    ASSERT_TRUE(stream->Read(&msg));
    if (msg.has_ack()) continue;
    if (!msg.has_fragment()) {
      EXPECT_FALSE(assembler.in_progress()) << "a message went between the fragments of another";
      got.push_back(msg);
      continue;
    }
    EXPECT_LT(msg.ByteSizeLong(), size_t{4} << 20);
    auto joined = assembler.Add(std::move(*msg.mutable_fragment()));
    ASSERT_TRUE(joined.ok()) << joined.status();
    if (!joined->has_value()) continue;
    v1::CoordinatorMessage whole;
    ASSERT_TRUE(whole.ParseFromString(**joined));
    got.push_back(std::move(whole));
  }
  EXPECT_TRUE(got[0].hold_snapshot().data() == big.hold_snapshot().data());
  EXPECT_EQ(got[1].hold_snapshot().data().size(), 10u);
  EXPECT_TRUE(got[2].hold_snapshot().data() == big.hold_snapshot().data());
}

// The queue bound: messages up to max_session_queue_bytes count against it;
// one larger message may wait beyond it, a second one ends the session.
TEST(CoordinatorServiceFragmentTest, OneMessageOverTheQueueBoundMayWaitNotTwo) {
  RecordingObserver job;
  CoordinatorService::Options options;
  options.job = &job;
  options.max_session_queue_bytes = size_t{1} << 20;
  ServiceWith s(options);
  grpc::ClientContext ctx;
  std::unique_ptr<SessionStream> stream;
  std::shared_ptr<SessionHandle> session = OpenW1Session(s, &ctx, &stream);
  ASSERT_NE(session, nullptr);
  // The worker reads nothing more.
  int accepted = 0;
  for (int i = 0; i < 100 && session->Send(BigCommand(8 << 20)); ++i) ++accepted;
  EXPECT_GE(accepted, 2) << "the one in flight and one over the bound";
  EXPECT_LE(accepted, 3) << "more than the one in flight, the one over the bound and one the transport took";
  const std::string why = job.AwaitLost("w1");
  EXPECT_NE(why.find("plus one larger message"), std::string::npos) << why;
}

}  // namespace
}  // namespace baton
