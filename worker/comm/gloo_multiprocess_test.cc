// Gloo backend with ranks in separate processes (comm_test_peer), rendezvous
// through CoordinatorStore and a FakeCoordinatorKv on a loopback port.
#include <signal.h>
#include <unistd.h>

#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "worker/comm/communicator_factory.h"
#include "worker/comm/coordinator_store.h"
#include "tests/testing/process.h"
#include "worker/comm/fake_coordinator_kv.h"

namespace baton::comm {
namespace {

// Starts comm_test_peer with `args` (its output goes to a log under TEST_TMPDIR).
std::unique_ptr<testing::Subprocess> Spawn(const std::vector<std::string>& args) {
  static int spawned = 0;
  auto peer = std::make_unique<testing::Subprocess>(
      testing::RunfilePath("worker/comm/comm_test_peer"), args,
      absl::StrCat(testing::TempDir("peers"), "/peer", ++spawned, ".log"));
  EXPECT_TRUE(peer->Start().ok());
  return peer;
}

class GlooMultiProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(access(testing::RunfilePath("worker/comm/comm_test_peer").c_str(), X_OK), 0)
        << "missing helper comm_test_peer";
    auto server = FakeCoordinatorKvServer::Start();
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
  }

  CommunicatorSpec Spec(const std::string& group, int rank, int size) {
    CommunicatorSpec spec;
    spec.group = group;
    spec.generation = 1;
    spec.rank = rank;
    spec.size = size;
    spec.rendezvous_timeout = absl::Seconds(20);
    return spec;
  }

  // Streams 16 MiB messages from a peer process, kills it mid-stream and
  // checks that every op of the survivor ends within the timeout.
  void KillPeerMidStream(const std::string& group);

  std::unique_ptr<FakeCoordinatorKvServer> server_;
};

TEST_F(GlooMultiProcessTest, ThreeProcessesAllReduceThroughTheCoordinatorKv) {
  const int n = 3;
  std::vector<std::unique_ptr<testing::Subprocess>> peers;
  for (int r = 1; r < n; ++r) {
    peers.push_back(Spawn({server_->address(), "job", "1", "mp", absl::StrCat(r),
                           absl::StrCat(n), "allreduce"}));
  }
  CoordinatorStore store(ConnectCoordinator(server_->address()), "job", 1);
  auto comm = CreateCommunicator(store, Spec("mp", 0, n));
  ASSERT_TRUE(comm.ok()) << comm.status();
  const int64_t count = 4099;
  std::vector<float> x(count);
  for (int64_t i = 0; i < count; ++i) x[i] = static_cast<float>(100 + i % 13);
  ASSERT_TRUE((*comm)->AllReduceSum(Buffer::Host(x.data(), count))->Wait(absl::Seconds(20)).ok());
  for (int64_t i = 0; i < count; i += 101) {
    EXPECT_EQ(x[i], static_cast<float>(600 + 3 * (i % 13))) << i;
  }
  for (auto& peer : peers) EXPECT_EQ(peer->Wait(absl::Seconds(20)), 0) << "a peer saw a wrong sum: " << peer->Log();
  bool saw_address_keys = false;
  for (const std::string& k : server_->service().Keys()) {
    saw_address_keys |= k.rfind("job/1/comm/mp/gen1/gloo/", 0) == 0;
  }
  EXPECT_TRUE(saw_address_keys) << "Gloo's addresses go through the coordinator KV";
}

// Three rounds: the kill lands at a different point of the stream each time.
TEST_F(GlooMultiProcessTest, PeerKilledMidTransferFailsTheSurvivorWithinTheTimeout) {
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    KillPeerMidStream(absl::StrCat("kill", round));
  }
}

void GlooMultiProcessTest::KillPeerMidStream(const std::string& group) {
  // Killed by its destructor also when an ASSERT returns early.
  std::unique_ptr<testing::Subprocess> peer =
      Spawn({server_->address(), "job", "1", group, "1", "2", "stream"});
  CoordinatorStore store(ConnectCoordinator(server_->address()), "job", 1);
  auto comm = CreateCommunicator(store, Spec(group, 0, 2));
  ASSERT_TRUE(comm.ok()) << comm.status();
  const int64_t bytes = 16 << 20;
  std::vector<std::vector<uint8_t>> in(6, std::vector<uint8_t>(bytes));
  for (int t = 0; t < 2; ++t) {  // the stream is flowing
    ASSERT_TRUE((*comm)->Recv(Buffer{in[t].data(), bytes, DType::kUInt8, -1}, 1, t)
                    ->Wait(absl::Seconds(20)).ok());
    EXPECT_EQ(in[t][bytes - 1], 0x5a);
  }
  std::vector<std::shared_ptr<Work>> posted;
  for (int t = 2; t < 6; ++t) {
    posted.push_back((*comm)->Recv(Buffer{in[t].data(), bytes, DType::kUInt8, -1}, 1, t));
  }
  std::vector<uint8_t> never(64);
  auto orphan = (*comm)->Recv(Buffer{never.data(), 64, DType::kUInt8, -1}, 1, 999);
  peer->Signal(SIGKILL);
  const absl::Time killed_at = absl::Now();
  absl::Status s = orphan->Wait(absl::Seconds(5));
  EXPECT_LT(absl::Now() - killed_at, absl::Seconds(5));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("rank 1"), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("connection broke"), absl::string_view::npos) << "says why: " << s;
  for (auto& w : posted) {  // each ends (delivered before the kill, or failed); none hangs
    absl::Status ws = w->Wait(absl::Seconds(5));
    EXPECT_TRUE(ws.ok() || absl::IsUnavailable(ws)) << ws;
  }
  EXPECT_LT(absl::Now() - killed_at, absl::Seconds(5));
  // The group is broken: later ops fail fast (ABORTED once the broken
  // connection has aborted the communicator, UNAVAILABLE from Gloo if first).
  const absl::Time before = absl::Now();
  absl::Status later = (*comm)->Barrier()->Wait(absl::Seconds(5));
  EXPECT_TRUE(absl::IsAborted(later) || absl::IsUnavailable(later)) << later;
  EXPECT_LT(absl::Now() - before, absl::Seconds(1));
  EXPECT_EQ(peer->Wait(absl::Seconds(5)), 128 + SIGKILL) << "peer died by signal";
}

// A send larger than both socket buffers to a peer that stops reading (its
// process is stopped) blocks the thread that waits for it in the write; the
// peer then dies: the send fails at once, naming the peer, not at its
// deadline.
TEST_F(GlooMultiProcessTest, ASendBlockedOnAStoppedPeerFailsWhenThePeerDies) {
  std::unique_ptr<testing::Subprocess> peer =
      Spawn({server_->address(), "job", "1", "stopped", "1", "2", "idle"});
  CoordinatorStore store(ConnectCoordinator(server_->address()), "job", 1);
  auto comm = CreateCommunicator(store, Spec("stopped", 0, 2));
  ASSERT_TRUE(comm.ok()) << comm.status();
  peer->Signal(SIGSTOP);
  const int64_t bytes = int64_t{256} << 20;  // far beyond both socket buffers
  std::vector<uint8_t> out(bytes, 0x33);
  auto send = (*comm)->Send(Buffer{out.data(), bytes, DType::kUInt8, -1}, 1, 7);
  // The waiting thread writes until the socket is full, then the op stays
  // pending past a short wait.
  absl::Status early = send->Wait(absl::Milliseconds(300));
  ASSERT_EQ(early.code(), absl::StatusCode::kDeadlineExceeded) << early;
  EXPECT_NE(early.message().find("waiting for rank 1"), absl::string_view::npos) << early;
  std::thread killer([&] {
    absl::SleepFor(absl::Milliseconds(300));  // the main thread is back in the write
    peer->Signal(SIGKILL);
  });
  const absl::Time start = absl::Now();
  absl::Status s = send->Wait(absl::Seconds(60));
  const absl::Duration took = absl::Now() - start;
  killer.join();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("rank 1"), absl::string_view::npos) << s;
  EXPECT_LT(took, absl::Seconds(20)) << "the break ends the write, not the 60 s wait";
  EXPECT_EQ(peer->Wait(absl::Seconds(5)), 128 + SIGKILL);
}

// The same blocked send with nobody waiting for it (the I/O thread writes)
// and a short op timeout: the watchdog fails it with DEADLINE_EXCEEDED
// naming the peer, and aborts the communicator; it never hangs.
TEST_F(GlooMultiProcessTest, ASendToAPeerThatNeverReadsFailsAtTheOpTimeout) {
  std::unique_ptr<testing::Subprocess> peer =
      Spawn({server_->address(), "job", "1", "never", "1", "2", "idle"});
  CoordinatorStore store(ConnectCoordinator(server_->address()), "job", 1);
  CommunicatorSpec spec = Spec("never", 0, 2);
  spec.op_timeout = absl::Seconds(2);
  auto comm = CreateCommunicator(store, spec);
  ASSERT_TRUE(comm.ok()) << comm.status();
  peer->Signal(SIGSTOP);
  const int64_t bytes = int64_t{256} << 20;
  std::vector<uint8_t> out(bytes, 0x44);
  const absl::Time start = absl::Now();
  auto send = (*comm)->Send(Buffer{out.data(), bytes, DType::kUInt8, -1}, 1, 8);
  while (!send->IsCompleted() && absl::Now() - start < absl::Seconds(30)) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE(send->IsCompleted()) << "still pending 30 s after a 2 s op timeout";
  absl::Status s = send->Wait(absl::ZeroDuration());
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find("op_timeout"), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("waiting for rank 1"), absl::string_view::npos) << s;
  EXPECT_GE(absl::Now() - start, absl::Seconds(2));
  peer->Signal(SIGKILL);
  EXPECT_EQ(peer->Wait(absl::Seconds(5)), 128 + SIGKILL);
}

TEST_F(GlooMultiProcessTest, StragglerOfAnOlderGenerationIsRejectedByTheKv) {
  CoordinatorStore current(ConnectCoordinator(server_->address()), "job", 2);
  CommunicatorSpec spec = Spec("dp", 0, 1);
  spec.generation = 2;
  ASSERT_TRUE(CreateCommunicator(current, spec).ok());
  CoordinatorStore stale(ConnectCoordinator(server_->address()), "job", 1);
  spec.generation = 1;
  auto straggler = CreateCommunicator(stale, spec);
  ASSERT_FALSE(straggler.ok());
  EXPECT_EQ(straggler.status().code(), absl::StatusCode::kFailedPrecondition) << straggler.status();
  EXPECT_NE(straggler.status().message().find("older than the current generation 2"),
            absl::string_view::npos)
      << straggler.status();
}

TEST_F(GlooMultiProcessTest, RankMissingFromTheCoordinatorKvIsNamed) {
  CoordinatorStore store(ConnectCoordinator(server_->address()), "job", 1);
  CommunicatorSpec spec = Spec("lonely", 0, 2);
  spec.rendezvous_timeout = absl::Milliseconds(500);
  auto comm = CreateCommunicator(store, spec);
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(comm.status().message().find("rank(s) 1 of 2 did not arrive"), absl::string_view::npos)
      << comm.status();
}

}  // namespace
}  // namespace baton::comm
