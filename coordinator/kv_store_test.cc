#include "coordinator/kv_store.h"

#include <thread>

#include "absl/strings/str_cat.h"
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

// The poisoning: a KvSet at INT64_MAX overflowed the next generation.
TEST(KvStoreTest, OnlyTheCurrentAndNextGenerationAreServed) {
  KvStore kv;
  kv.AdvanceGeneration("job", 3);
  EXPECT_EQ(kv.Set({"job", INT64_MAX}, "k", "v").code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(kv.Set({"job", 5}, "k", "v").code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(kv.Get({"job", 5}, "k").status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(kv.Wait({"job", 5}, {"k"}, absl::Milliseconds(1)).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(kv.CurrentGeneration("job"), 3);
  ASSERT_TRUE(kv.Set({"job", 3}, "k", "v").ok());
  ASSERT_TRUE(kv.Set({"job", 4}, "k", "v").ok());  // the next one advances
  EXPECT_EQ(kv.CurrentGeneration("job"), 4);
}

TEST(KvStoreTest, JobsKeysAndBytesAreBounded) {
  KvStore kv;
  for (size_t j = 0; j < KvStore::kMaxJobs; ++j) ASSERT_TRUE(kv.Set({absl::StrCat("j", j), 0}, "k", "v").ok());
  absl::Status s = kv.Set({"one-too-many", 0}, "k", "v");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_TRUE(kv.Set({"j0", 0}, "k2", "v").ok());  // known jobs still work

  for (int64_t k = 1; k < KvStore::kMaxKeysPerJob; ++k) ASSERT_TRUE(kv.Set({"j1", 0}, absl::StrCat(k), "").ok());
  s = kv.Set({"j1", 0}, "last", "");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("keys"), std::string::npos) << s;
  EXPECT_TRUE(kv.Set({"j1", 0}, "1", "overwrite").ok());  // existing keys may change
  EXPECT_EQ(kv.Add({"j1", 0}, "new-counter", 1).status().code(), absl::StatusCode::kResourceExhausted);
  // A new generation frees the old one's keys.
  EXPECT_TRUE(kv.Set({"j1", 1}, "last", "").ok());

  const std::string big(KvStore::kMaxValueBytes, 'x');
  int stored = 0;
  for (; stored < 100; ++stored) {
    s = kv.Set({"j2", 0}, absl::StrCat("big", stored), big);
    if (!s.ok()) break;
  }
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(stored, KvStore::kMaxBytesPerJob / (KvStore::kMaxValueBytes + 8) ) << s;
  EXPECT_TRUE(kv.Set({"j2", 0}, "big0", "small").ok());  // shrinking frees room
  EXPECT_TRUE(kv.Set({"j2", 0}, absl::StrCat("big", stored), big).ok());
}

TEST(KvStoreTest, AddRefusesToOverflow) {
  KvStore kv;
  ASSERT_EQ(*kv.Add({"job", 0}, "n", INT64_MAX - 1), INT64_MAX - 1);
  EXPECT_EQ(*kv.Add({"job", 0}, "n", 1), INT64_MAX);
  absl::StatusOr<int64_t> over = kv.Add({"job", 0}, "n", 1);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kOutOfRange) << over.status();
  EXPECT_EQ(*kv.Get({"job", 0}, "n"), absl::StrCat(INT64_MAX));  // unchanged
  ASSERT_EQ(*kv.Add({"job", 0}, "m", INT64_MIN), INT64_MIN);
  EXPECT_EQ(kv.Add({"job", 0}, "m", -1).status().code(), absl::StatusCode::kOutOfRange);
}

}  // namespace
}  // namespace baton
