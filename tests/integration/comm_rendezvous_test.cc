// The data plane's rendezvous through the real coordinator process: Gloo ranks
// in separate processes find each other through baton-coordinator's KV
// (CoordinatorStore over gRPC), all-reduce, and a straggler of an older
// generation is turned away by the coordinator, not by a test double.
#include <fstream>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/testing/process.h"
#include "worker/comm/communicator_factory.h"
#include "worker/comm/coordinator_store.h"
#include "worker/comm/fake_coordinator_kv.h"

namespace baton {
namespace {

using testing::ReadPortFile;
using testing::RunfilePath;
using testing::Subprocess;
using testing::TempDir;

class CommRendezvousTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = TempDir(::testing::UnitTest::GetInstance()->current_test_info()->name());
    coordinator_ = std::make_unique<Subprocess>(
        RunfilePath("coordinator/baton-coordinator"),
        std::vector<std::string>{"--listen=127.0.0.1:0", "--http_listen=127.0.0.1:0",
                                 "--port_file=" + dir_ + "/coordinator.json"},
        dir_ + "/coordinator.log");
    ASSERT_TRUE(coordinator_->Start().ok());
    auto ports = ReadPortFile(dir_ + "/coordinator.json", absl::Seconds(10));
    ASSERT_TRUE(ports.ok()) << coordinator_->Log();
    address_ = absl::StrCat("127.0.0.1:", ports->first);
  }

  comm::CommunicatorSpec Spec(const std::string& group, int64_t generation, int rank, int size) {
    comm::CommunicatorSpec spec;
    spec.group = group;
    spec.generation = generation;
    spec.rank = rank;
    spec.size = size;
    spec.rendezvous_timeout = absl::Seconds(20);
    return spec;
  }

  std::string dir_, address_;
  std::unique_ptr<Subprocess> coordinator_;
};

TEST_F(CommRendezvousTest, FourProcessesAllReduceThroughTheRealCoordinator) {
  const int n = 4;
  std::vector<std::unique_ptr<Subprocess>> peers;
  for (int r = 1; r < n; ++r) {
    peers.push_back(std::make_unique<Subprocess>(
        RunfilePath("worker/comm/comm_test_peer"),
        std::vector<std::string>{address_, "job", "1", "dp", absl::StrCat(r), absl::StrCat(n), "allreduce"},
        absl::StrCat(dir_, "/peer", r, ".log")));
    ASSERT_TRUE(peers.back()->Start().ok());
  }
  comm::CoordinatorStore store(comm::ConnectCoordinator(address_), "job", 1);
  auto comm = comm::CreateCommunicator(store, Spec("dp", 1, 0, n));
  ASSERT_TRUE(comm.ok()) << comm.status() << "\n" << coordinator_->Log();
  const int64_t count = 4099;  // comm_test_peer's size
  std::vector<float> x(count);
  for (int64_t i = 0; i < count; ++i) x[i] = static_cast<float>(100 + i % 13);  // rank 0's pattern
  absl::Status reduced = (*comm)->AllReduceSum(comm::Buffer::Host(x.data(), count))->Wait(absl::Seconds(20));
  ASSERT_TRUE(reduced.ok()) << reduced << "\n" << peers[0]->Log();
  for (int64_t i = 0; i < count; i += 97) {
    // Rank r contributes (r + 1) * 100 + i % 13.
    EXPECT_EQ(x[i], static_cast<float>(1000 + 4 * (i % 13))) << i;
  }
  for (auto& p : peers) {
    auto code = p->Wait(absl::Seconds(20));
    ASSERT_TRUE(code.has_value()) << p->Log();
    EXPECT_EQ(*code, 0) << "a peer saw a wrong sum: " << p->Log();
  }
}

TEST_F(CommRendezvousTest, TheCoordinatorRejectsAStragglerOfAnOlderGeneration) {
  // Generations move one at a time (the coordinator serves only the current
  // and the next one): 1, then 2.
  comm::CoordinatorStore first(comm::ConnectCoordinator(address_), "job", 1);
  ASSERT_TRUE(comm::CreateCommunicator(first, Spec("tp", 1, 0, 1)).ok());
  comm::CoordinatorStore current(comm::ConnectCoordinator(address_), "job", 2);
  ASSERT_TRUE(comm::CreateCommunicator(current, Spec("tp", 2, 0, 1)).ok());
  comm::CoordinatorStore stale(comm::ConnectCoordinator(address_), "job", 1);
  auto straggler = comm::CreateCommunicator(stale, Spec("tp", 1, 0, 1));
  ASSERT_FALSE(straggler.ok());
  EXPECT_EQ(straggler.status().code(), absl::StatusCode::kFailedPrecondition) << straggler.status();
  EXPECT_NE(straggler.status().message().find("superseded by generation 2"), std::string::npos)
      << straggler.status();
}

TEST_F(CommRendezvousTest, AMissingRankIsNamedWithinTheTimeout) {
  comm::CoordinatorStore store(comm::ConnectCoordinator(address_), "job", 1);
  comm::CommunicatorSpec spec = Spec("pp", 1, 0, 3);
  spec.rendezvous_timeout = absl::Seconds(1);
  const absl::Time start = absl::Now();
  auto comm = comm::CreateCommunicator(store, spec);
  ASSERT_FALSE(comm.ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_NE(comm.status().message().find("1, 2"), std::string::npos) << comm.status();
}

}  // namespace
}  // namespace baton
