#include "coordinator/fan_out.h"

#include <atomic>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace baton {
namespace {

TEST(FanOutTest, CallsEveryIndexExactlyOnceAndReturnsWhenAllAreDone) {
  FanOut pool(4);
  for (size_t n : {0, 1, 3, 1000}) {
    std::vector<std::atomic<int>> calls(n);
    pool.Run(n, [&](size_t i) { calls[i].fetch_add(1); });
    for (size_t i = 0; i < n; ++i) EXPECT_EQ(calls[i].load(), 1) << "index " << i << " of " << n;
  }
}

TEST(FanOutTest, BlockingCallsOverlap) {
  // Eight calls that each wait until all eight have started finish only if
  // they run at the same time (4 threads + the caller would not be enough
  // without overlap; 8 threads are).
  FanOut pool(8);
  std::atomic<int> started{0};
  absl::Notification all;
  pool.Run(8, [&](size_t) {
    if (started.fetch_add(1) + 1 == 8) all.Notify();
    EXPECT_TRUE(all.WaitForNotificationWithTimeout(absl::Seconds(30)));
  });
  EXPECT_EQ(started.load(), 8);
}

}  // namespace
}  // namespace baton
