#include "coordinator/worker_registry.h"

#include "gtest/gtest.h"

namespace baton {
namespace {

class FakeSession : public SessionHandle {
 public:
  void Close(const absl::Status& reason) override { closed_with = reason; }
  bool Send(const v1::CoordinatorMessage&) override { return true; }
  absl::Status closed_with = absl::OkStatus();
};

v1::RegisterRequest Request(const std::string& name, const std::string& device = "cpu") {
  v1::RegisterRequest r;
  r.set_name(name);
  r.set_host("h1");
  r.set_device(device);
  return r;
}

class WorkerRegistryTest : public ::testing::Test {
 protected:
  v1::WorkerState StateOf(const std::string& name) {
    for (const v1::WorkerInfo& w : registry_.List()) {
      if (w.name() == name) return w.state();
    }
    return v1::WORKER_STATE_UNSPECIFIED;
  }
  // Registers and opens a session; returns the registration.
  v1::RegisterResponse Join(const std::string& name, std::shared_ptr<FakeSession> session) {
    auto reg = registry_.Register(Request(name), absl::Milliseconds(500));
    EXPECT_TRUE(reg.ok()) << reg.status();
    EXPECT_EQ(StateOf(name), v1::JOINING);
    EXPECT_TRUE(registry_.OpenSession(reg->response.worker_id(), reg->response.incarnation(), session).ok());
    return reg->response;
  }

  FakeClock clock_;
  WorkerRegistry registry_{&clock_, absl::Seconds(3)};
};

TEST_F(WorkerRegistryTest, RegisterThenSessionMakesReady) {
  auto session = std::make_shared<FakeSession>();
  v1::RegisterResponse r = Join("w1", session);
  EXPECT_EQ(r.lease_ms(), 3000);
  EXPECT_EQ(r.heartbeat_ms(), 500);
  EXPECT_EQ(StateOf("w1"), v1::READY);
}

TEST_F(WorkerRegistryTest, HeartbeatsKeepTheLeaseAndSilenceLosesIt) {
  auto session = std::make_shared<FakeSession>();
  v1::RegisterResponse r = Join("w1", session);
  for (int i = 0; i < 10; ++i) {
    clock_.Advance(absl::Seconds(1));
    ASSERT_TRUE(registry_.Heartbeat(r.worker_id(), r.incarnation(), {}).ok());
    EXPECT_TRUE(registry_.ExpireLeases().empty());
  }
  EXPECT_EQ(StateOf("w1"), v1::READY);
  clock_.Advance(absl::Milliseconds(2999));
  EXPECT_TRUE(registry_.ExpireLeases().empty());
  clock_.Advance(absl::Milliseconds(2));
  auto expired = registry_.ExpireLeases();
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_EQ(expired[0].name, "w1");
  EXPECT_EQ(expired[0].session.get(), session.get());
  EXPECT_EQ(StateOf("w1"), v1::LOST);
  // A LOST incarnation is fenced: its heartbeats are refused and it must re-register.
  absl::Status late = registry_.Heartbeat(r.worker_id(), r.incarnation(), {});
  EXPECT_EQ(late.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(late.message().find("register again"), std::string::npos);
}

TEST_F(WorkerRegistryTest, SessionsOfIsInOrderWithNullForNoSession) {
  auto s1 = std::make_shared<FakeSession>(), s2 = std::make_shared<FakeSession>();
  Join("w1", s1);
  v1::RegisterResponse r2 = Join("w2", s2);
  ASSERT_TRUE(registry_.Register(Request("w3"), absl::Milliseconds(500)).ok());  // no session yet
  std::vector<std::shared_ptr<SessionHandle>> got = registry_.SessionsOf({"w2", "nobody", "w1", "w3"});
  ASSERT_EQ(got.size(), 4u);
  EXPECT_EQ(got[0], s2);
  EXPECT_EQ(got[1], nullptr);
  EXPECT_EQ(got[2], s1);
  EXPECT_EQ(got[3], nullptr);
  registry_.SessionEnded(r2.worker_id(), r2.incarnation(), s2.get());
  EXPECT_EQ(registry_.SessionsOf({"w2"})[0], nullptr) << "a lost worker's session is gone";
}

TEST_F(WorkerRegistryTest, BrokenStreamIsLostAndSameNameComesBackReady) {
  auto s1 = std::make_shared<FakeSession>();
  v1::RegisterResponse r1 = Join("w1", s1);
  EXPECT_EQ(registry_.SessionEnded(r1.worker_id(), r1.incarnation(), s1.get()), "w1");
  EXPECT_EQ(StateOf("w1"), v1::LOST);
  EXPECT_EQ(registry_.SessionOf("w1"), nullptr);
  auto s2 = std::make_shared<FakeSession>();
  v1::RegisterResponse r2 = Join("w1", s2);
  EXPECT_NE(r2.incarnation(), r1.incarnation());
  EXPECT_EQ(StateOf("w1"), v1::READY);
  EXPECT_EQ(registry_.List().size(), 1u);
}

TEST_F(WorkerRegistryTest, ANameHeldByALiveWorkerIsNotTakenOver) {
  auto s1 = std::make_shared<FakeSession>();
  v1::RegisterRequest first = Request("w1");
  first.set_pid(4242);
  auto reg1 = registry_.Register(first, absl::Milliseconds(500));
  ASSERT_TRUE(reg1.ok());
  EXPECT_FALSE(reg1->replaced_previous);
  ASSERT_TRUE(registry_.OpenSession(reg1->response.worker_id(), reg1->response.incarnation(), s1).ok());
  v1::RegisterRequest dup = Request("w1");
  dup.set_host("h2");
  dup.set_pid(7);
  for (int i = 0; i < 5; ++i) {  // heartbeating: refused every time
    auto reg = registry_.Register(dup, absl::Milliseconds(500));
    ASSERT_EQ(reg.status().code(), absl::StatusCode::kAlreadyExists) << reg.status();
    EXPECT_NE(reg.status().message().find("host 'h1' pid 4242"), std::string::npos) << reg.status();
    EXPECT_NE(reg.status().message().find("--name"), std::string::npos) << reg.status();
    clock_.Advance(absl::Seconds(2));
    ASSERT_TRUE(registry_.Heartbeat(reg1->response.worker_id(), reg1->response.incarnation(), {}).ok());
    EXPECT_TRUE(registry_.ExpireLeases().empty());
  }
  EXPECT_EQ(StateOf("w1"), v1::READY);
  EXPECT_EQ(s1->closed_with, absl::OkStatus());
  // The holder goes silent: once its lease is over, the replacement gets in.
  clock_.Advance(absl::Seconds(2));
  EXPECT_EQ(registry_.Register(dup, absl::Milliseconds(500)).status().code(), absl::StatusCode::kAlreadyExists);
  clock_.Advance(absl::Milliseconds(1001));
  auto reg = registry_.Register(dup, absl::Milliseconds(500));
  ASSERT_TRUE(reg.ok()) << reg.status();
  EXPECT_TRUE(reg->replaced_previous);
  EXPECT_EQ(reg->replaced.get(), s1.get());  // the caller closes it
}

TEST_F(WorkerRegistryTest, AReplacementAfterTheStreamBrokeIsAccepted) {
  auto s1 = std::make_shared<FakeSession>();
  v1::RegisterResponse r1 = Join("w1", s1);
  registry_.SessionEnded(r1.worker_id(), r1.incarnation(), s1.get());
  auto reg = registry_.Register(Request("w1"), absl::Milliseconds(500));
  ASSERT_TRUE(reg.ok()) << reg.status();
  EXPECT_TRUE(reg->replaced_previous);
  EXPECT_EQ(StateOf("w1"), v1::JOINING);
}

TEST_F(WorkerRegistryTest, AnExpiredButUnsweptHolderIsReplaced) {
  auto s1 = std::make_shared<FakeSession>();
  v1::RegisterResponse r1 = Join("w1", s1);
  clock_.Advance(absl::Milliseconds(3001));  // lease over, sweeper not run yet
  auto reg = registry_.Register(Request("w1"), absl::Milliseconds(500));
  ASSERT_TRUE(reg.ok());
  EXPECT_EQ(reg->replaced.get(), s1.get());  // the caller closes it
  // The old session's end must not mark the new incarnation LOST.
  EXPECT_EQ(registry_.SessionEnded(r1.worker_id(), r1.incarnation(), s1.get()), "");
  EXPECT_EQ(StateOf("w1"), v1::JOINING);
  EXPECT_EQ(registry_.Heartbeat(r1.worker_id(), r1.incarnation(), {}).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(WorkerRegistryTest, UnknownWorkerIsFailedPrecondition) {
  EXPECT_EQ(registry_.Heartbeat(12345, 1, {}).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(registry_.OpenSession(12345, 1, std::make_shared<FakeSession>()).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(WorkerRegistryTest, GoodbyeDrainsThenLeaves) {
  auto s = std::make_shared<FakeSession>();
  v1::RegisterResponse r = Join("w1", s);
  ASSERT_TRUE(registry_.Goodbye(r.worker_id(), r.incarnation()).ok());
  EXPECT_EQ(StateOf("w1"), v1::DRAINING);
  registry_.SessionEnded(r.worker_id(), r.incarnation(), s.get());
  EXPECT_EQ(StateOf("w1"), v1::LEFT);
}

TEST_F(WorkerRegistryTest, JoiningWithoutSessionExpires) {
  ASSERT_TRUE(registry_.Register(Request("w1"), absl::Milliseconds(500)).ok());
  clock_.Advance(absl::Seconds(2));
  EXPECT_TRUE(registry_.ExpireLeases().empty());
  clock_.Advance(absl::Seconds(2));
  auto expired = registry_.ExpireLeases();
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_EQ(expired[0].session, nullptr);  // no session to close
  EXPECT_EQ(StateOf("w1"), v1::LOST);
}

TEST_F(WorkerRegistryTest, MalformedRegistrationsNameTheField) {
  struct Case {
    v1::RegisterRequest req;
    const char* field;
  };
  v1::RegisterRequest bad_port = Request("w1");
  bad_port.set_http_port(70000);
  v1::RegisterRequest bad_mem = Request("w1");
  bad_mem.set_memory_bytes(-1);
  v1::RegisterRequest long_uuid = Request("w1", "cuda:0");
  long_uuid.set_device_uuid(std::string(65, 'a'));
  v1::RegisterRequest odd_uuid = Request("w1", "cuda:0");
  odd_uuid.set_device_uuid("GPU-1\n2");
  v1::RegisterRequest long_host = Request("w1");
  long_host.set_host(std::string(254, 'h'));
  v1::RegisterRequest odd_host = Request("w1");
  odd_host.set_host("node 1");
  v1::RegisterRequest cpu_uuid = Request("w1", "cpu");
  cpu_uuid.set_device_uuid("GPU-1");
  v1::RegisterRequest cpu_fused = Request("w1", "cpu");
  cpu_fused.set_fused_attention_bf16(true);
  const Case cases[] = {{Request(""), "name"},          {Request("a b"), "name"},
                        {Request("w", "gpu0"), "device"}, {Request("w", "cuda:"), "device"},
                        {Request("w", "cuda:x"), "device"}, {bad_port, "http_port"},
                        {bad_mem, "memory_bytes"},        {long_uuid, "device_uuid"},
                        {odd_uuid, "device_uuid"},        {cpu_uuid, "device_uuid"},
                        {long_host, "host"},                {odd_host, "host"},
                        {cpu_fused, "fused_attention_bf16"}};
  for (const Case& c : cases) {
    auto reg = registry_.Register(c.req, absl::Milliseconds(500));
    ASSERT_FALSE(reg.ok()) << c.field;
    EXPECT_EQ(reg.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(reg.status().message().find(c.field), std::string::npos) << reg.status();
  }
  v1::RegisterRequest gpu = Request("w-1.a_b", "cuda:7");
  gpu.set_device_uuid("GPU-5fb0e0a4-5cf0-7c1e-3d31-5b0e6f3e2a19");
  gpu.set_memory_bytes(int64_t{141} << 30);
  gpu.set_fused_attention_bf16(true);
  gpu.set_verdict_in_run_step(true);
  EXPECT_TRUE(registry_.Register(gpu, absl::Milliseconds(500)).ok());
  ASSERT_TRUE(registry_.List().size() == 1);
  EXPECT_TRUE(registry_.List()[0].fused_attention_bf16());
  EXPECT_TRUE(registry_.List()[0].verdict_in_run_step());
  EXPECT_EQ(registry_.List()[0].device_uuid(), "GPU-5fb0e0a4-5cf0-7c1e-3d31-5b0e6f3e2a19");
  EXPECT_EQ(registry_.List()[0].memory_bytes(), int64_t{141} << 30);
}

TEST_F(WorkerRegistryTest, CountByStateCountsEachWorkerOnce) {
  auto a = std::make_shared<FakeSession>(), b = std::make_shared<FakeSession>();
  Join("a", a);
  v1::RegisterResponse rb = Join("b", b);
  ASSERT_TRUE(registry_.Register(Request("c"), absl::Milliseconds(500)).ok());
  registry_.SessionEnded(rb.worker_id(), rb.incarnation(), b.get());
  auto counts = registry_.CountByState();
  EXPECT_EQ(counts[v1::READY], 1);
  EXPECT_EQ(counts[v1::LOST], 1);
  EXPECT_EQ(counts[v1::JOINING], 1);
}

TEST_F(WorkerRegistryTest, ACoordinatorPauseLongerThanTheLeaseExtendsLeasesInsteadOfEvicting) {
  auto a = std::make_shared<FakeSession>(), b = std::make_shared<FakeSession>();
  v1::RegisterResponse ra = Join("a", a);
  Join("b", b);
  clock_.Advance(absl::Milliseconds(100));
  EXPECT_TRUE(registry_.ExpireLeases().empty());
  // The sweeper (the whole coordinator) was stopped for 10 s.
  clock_.Advance(absl::Seconds(10));
  absl::Duration stalled;
  EXPECT_TRUE(registry_.ExpireLeases(&stalled).empty());
  EXPECT_EQ(stalled, absl::Seconds(10));
  EXPECT_EQ(StateOf("a"), v1::READY);
  EXPECT_EQ(StateOf("b"), v1::READY);
  // Leases run from the resume: a worker that still says nothing is lost one
  // lease later; one that heartbeats stays.
  for (int i = 0; i < 31; ++i) {
    clock_.Advance(absl::Milliseconds(100));
    ASSERT_TRUE(registry_.Heartbeat(ra.worker_id(), ra.incarnation(), {}).ok());
    auto expired = registry_.ExpireLeases();
    if (i < 29) {
      EXPECT_TRUE(expired.empty()) << i;
    }
    if (!expired.empty()) {
      ASSERT_EQ(expired.size(), 1u);
      EXPECT_EQ(expired[0].name, "b");
    }
  }
  EXPECT_EQ(StateOf("a"), v1::READY);
  EXPECT_EQ(StateOf("b"), v1::LOST);
}

TEST_F(WorkerRegistryTest, RegistrationsAreCappedAndLostEntriesForgotten) {
  RegistryLimits limits;
  limits.max_workers = 3;
  limits.forget_after = absl::Seconds(60);
  WorkerRegistry registry(&clock_, absl::Seconds(3), 1, limits);
  for (const char* n : {"a", "b", "c"}) ASSERT_TRUE(registry.Register(Request(n), absl::Milliseconds(500)).ok());
  auto full = registry.Register(Request("d"), absl::Milliseconds(500));
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted) << full.status();
  // They never open a session: lost after the lease, forgotten a minute later.
  for (int i = 0; i < 70; ++i) {
    clock_.Advance(absl::Seconds(1));
    registry.ExpireLeases();
  }
  EXPECT_TRUE(registry.List().empty());
  EXPECT_TRUE(registry.Register(Request("d"), absl::Milliseconds(500)).ok());
}

}  // namespace
}  // namespace baton
