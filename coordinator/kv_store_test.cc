#include "coordinator/kv_store.h"

#include <thread>

#include "gtest/gtest.h"

namespace baton {
namespace {

TEST(KvStoreTest, SetGetAddWithinOneGeneration) {
  KvStore kv;
  KvScope g0{"job", 0};
  ASSERT_TRUE(kv.Set(g0, "nccl_id", std::string("\x00\x01\x02", 3)).ok());
  auto v = kv.Get(g0, "nccl_id");
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(*v, std::string("\x00\x01\x02", 3));
  EXPECT_EQ(kv.Get(g0, "other").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(*kv.Add(g0, "count", 2), 2);
  EXPECT_EQ(*kv.Add(g0, "count", 3), 5);
  EXPECT_EQ(kv.Add(g0, "nccl_id", 1).status().code(), absl::StatusCode::kInvalidArgument);
  // Jobs are separate namespaces.
  EXPECT_EQ(kv.Get({"other", 0}, "nccl_id").status().code(), absl::StatusCode::kNotFound);
}

TEST(KvStoreTest, NewGenerationDropsOldKeysAndRejectsOldWriters) {
  KvStore kv;
  ASSERT_TRUE(kv.Set({"job", 1}, "rank0", "addr-a").ok());
  ASSERT_TRUE(kv.Set({"job", 2}, "rank0", "addr-b").ok());  // advances the job to 2
  EXPECT_EQ(kv.CurrentGeneration("job"), 2);
  EXPECT_EQ(*kv.Get({"job", 2}, "rank0"), "addr-b");
  absl::Status stale = kv.Set({"job", 1}, "rank1", "late");
  EXPECT_EQ(stale.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(stale.message().find("superseded"), std::string::npos);
  kv.AdvanceGeneration("job", 3);
  EXPECT_EQ(kv.Get({"job", 3}, "rank0").status().code(), absl::StatusCode::kNotFound);
}

TEST(KvStoreTest, WaitReturnsWhenAllKeysArriveAndNamesTheMissingOnTimeout) {
  KvStore kv;
  KvScope g{"job", 0};
  std::thread writer([&] {
    absl::SleepFor(absl::Milliseconds(20));
    ASSERT_TRUE(kv.Set(g, "a", "1").ok());
    ASSERT_TRUE(kv.Set(g, "b", "2").ok());
  });
  EXPECT_TRUE(kv.Wait(g, {"a", "b"}, absl::Seconds(10)).ok());
  writer.join();
  absl::Status s = kv.Wait(g, {"a", "rank3"}, absl::Milliseconds(30));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(s.message().find("rank3"), std::string::npos);
  EXPECT_EQ(s.message().find("a,"), std::string::npos);
}

TEST(KvStoreTest, WaitEndsWhenItsGenerationIsSuperseded) {
  KvStore kv;
  std::thread bump([&] {
    absl::SleepFor(absl::Milliseconds(20));
    kv.AdvanceGeneration("job", 1);
  });
  absl::Status s = kv.Wait({"job", 0}, {"never"}, absl::Seconds(10));
  bump.join();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
}

TEST(KvStoreTest, BadInputIsInvalidArgument) {
  KvStore kv;
  EXPECT_EQ(kv.Set({"", 0}, "k", "v").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(kv.Set({"job", -1}, "k", "v").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(kv.Set({"job", 0}, "", "v").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(kv.Set({"job", 0}, std::string(KvStore::kMaxKeyBytes + 1, 'k'), "v").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(kv.Set({"job", 0}, "k", std::string(KvStore::kMaxValueBytes + 1, 'v')).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace baton
