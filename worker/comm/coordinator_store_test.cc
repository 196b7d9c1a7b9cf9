// CoordinatorStore against FakeCoordinatorKv served on a loopback port.
#include "worker/comm/coordinator_store.h"

#include <thread>

#include "gtest/gtest.h"
#include "worker/comm/fake_coordinator_kv.h"

namespace baton::comm {
namespace {

class CoordinatorStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = FakeCoordinatorKvServer::Start();
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    stub_ = ConnectCoordinator(server_->address());
  }

  std::unique_ptr<FakeCoordinatorKvServer> server_;
  std::shared_ptr<baton::v1::Coordinator::StubInterface> stub_;
};

TEST_F(CoordinatorStoreTest, SetGetAddRoundTripScopedByJobAndGeneration) {
  CoordinatorStore store(stub_, "job-a", 3);
  ASSERT_TRUE(store.Set("k", std::string("v\0w", 3)).ok());
  absl::StatusOr<std::string> v = store.Get("k", absl::Seconds(5));
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, std::string("v\0w", 3)) << "values are bytes";
  EXPECT_EQ(*store.Add("n", 5), 5);
  EXPECT_EQ(*store.Add("n", 2), 7);
  EXPECT_EQ(server_->service().Keys(), (std::vector<std::string>{"job-a/3/k", "job-a/3/n"}));
  CoordinatorStore other_job(stub_, "job-b", 3);
  EXPECT_EQ(other_job.Get("k", absl::Milliseconds(50)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
}

TEST_F(CoordinatorStoreTest, GetWaitsForAKeySetByAnotherClient) {
  CoordinatorStore reader(stub_, "job", 1);
  std::thread writer([&] {
    absl::SleepFor(absl::Milliseconds(100));
    CoordinatorStore store(ConnectCoordinator(server_->address()), "job", 1);
    ASSERT_TRUE(store.Set("late", "here").ok());
  });
  absl::StatusOr<std::string> v = reader.Get("late", absl::Seconds(10));
  writer.join();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "here");
}

TEST_F(CoordinatorStoreTest, WaitTimeoutNamesTheKeysAndTheGeneration) {
  CoordinatorStore store(stub_, "job", 7);
  ASSERT_TRUE(store.Set("a", "1").ok());
  const absl::Time start = absl::Now();
  absl::Status s = store.Wait({"a", "b"}, absl::Milliseconds(200));
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(s.message().find("generation 7"), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("job/7/b"), absl::string_view::npos) << s;
}

TEST_F(CoordinatorStoreTest, OlderGenerationIsRejected) {
  CoordinatorStore newer(stub_, "job", 5);
  ASSERT_TRUE(newer.Set("x", "1").ok());
  CoordinatorStore older(stub_, "job", 4);
  absl::Status s = older.Set("x", "stale");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("older than the current generation 5"), absl::string_view::npos) << s;
  EXPECT_EQ(*newer.Get("x", absl::Seconds(1)), "1");
}

TEST_F(CoordinatorStoreTest, UnreachableCoordinatorFailsWithinTheRpcDeadline) {
  const std::string address = server_->address();
  server_->Shutdown();
  CoordinatorStore store(ConnectCoordinator(address), "job", 1, absl::Milliseconds(300));
  const absl::Time start = absl::Now();
  absl::Status s = store.Set("k", "v");
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s)) << s;
  EXPECT_NE(s.message().find("coordinator KvSet"), absl::string_view::npos) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
}

}  // namespace
}  // namespace baton::comm
