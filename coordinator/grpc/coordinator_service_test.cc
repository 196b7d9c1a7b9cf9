// CoordinatorService through an in-process gRPC channel (no ports).
#include "coordinator/grpc/coordinator_service.h"

#include <grpcpp/grpcpp.h>

#include <thread>

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

}  // namespace
}  // namespace baton
