#include "worker/comm/store.h"

#include <thread>

#include "gtest/gtest.h"

namespace baton::comm {
namespace {

TEST(InMemoryStoreTest, GetWaitsForALaterSet) {
  InMemoryStore store;
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(50));
    ASSERT_TRUE(store.Set("k", "v").ok());
  });
  absl::StatusOr<std::string> v = store.Get("k", absl::Seconds(10));
  setter.join();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "v");
}

TEST(InMemoryStoreTest, WaitTimeoutNamesOnlyTheMissingKeys) {
  InMemoryStore store;
  ASSERT_TRUE(store.Set("a", "1").ok());
  absl::Status s = store.Wait({"a", "b", "c"}, absl::Milliseconds(20));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(s.message().find("[b, c]"), absl::string_view::npos) << s;
}

TEST(InMemoryStoreTest, AddCountsFromZeroAndRejectsNonIntegers) {
  InMemoryStore store;
  EXPECT_EQ(*store.Add("n", 2), 2);
  EXPECT_EQ(*store.Add("n", -5), -3);
  ASSERT_TRUE(store.Set("s", "text").ok());
  EXPECT_EQ(store.Add("s", 1).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(PrefixStoreTest, ScopesEveryOperation) {
  InMemoryStore base;
  PrefixStore gen1(&base, "g/1");
  PrefixStore gen2(&base, "g/2");
  ASSERT_TRUE(gen1.Set("x", "one").ok());
  ASSERT_TRUE(gen1.Add("n", 1).ok());
  EXPECT_EQ(*gen1.Get("x", absl::ZeroDuration()), "one");
  EXPECT_EQ(gen2.Get("x", absl::Milliseconds(5)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(base.Keys(), (std::vector<std::string>{"g/1/n", "g/1/x"}));
}

}  // namespace
}  // namespace baton::comm
