// TimerOffsetTracker (host-only, runs in CI): when the CUDA backend measures
// the %globaltimer offset again and which measurement it keeps.
#include "kernels/cuda/timer_offset.h"

#include "gtest/gtest.h"

namespace baton::cuda {
namespace {

const absl::Time kStart = absl::FromUnixSeconds(1'800'000'000);

TEST(TimerOffsetTrackerTest, TheFirstMeasurementIsKeptWhateverItsUncertainty) {
  TimerOffsetTracker t;
  EXPECT_FALSE(t.has_offset());
  EXPECT_TRUE(t.Due(kStart));
  EXPECT_TRUE(t.Offer(-5000, 900, kStart));
  EXPECT_TRUE(t.has_offset());
  EXPECT_EQ(t.offset_us(), -5000);
  EXPECT_EQ(t.ErrorBoundUs(kStart), 900);
}

TEST(TimerOffsetTrackerTest, DueEveryTenSecondsAfterTheKeptOne) {
  TimerOffsetTracker t;
  ASSERT_TRUE(t.Offer(100, 3, kStart));
  EXPECT_FALSE(t.Due(kStart + absl::Seconds(9)));
  EXPECT_TRUE(t.Due(kStart + TimerOffsetTracker::kRefreshEvery));
  // A long job keeps following the clocks: every refresh restarts the wait.
  ASSERT_TRUE(t.Offer(140, 3, kStart + absl::Seconds(10)));
  EXPECT_FALSE(t.Due(kStart + absl::Seconds(19)));
  EXPECT_TRUE(t.Due(kStart + absl::Seconds(20)));
}

TEST(TimerOffsetTrackerTest, TheBoundGrowsWithAgeAtTheDriftLimit) {
  TimerOffsetTracker t;
  ASSERT_TRUE(t.Offer(0, 4, kStart));
  // 100 ppm: 1 ms after 10 s, 360 ms after an hour.
  EXPECT_EQ(t.ErrorBoundUs(kStart + absl::Seconds(10)), 4 + 1000);
  EXPECT_EQ(t.ErrorBoundUs(kStart + absl::Hours(1)), 4 + 360'000);
  EXPECT_EQ(t.ErrorBoundUs(kStart + absl::Microseconds(15'000'000)), 4 + 1500);
}

TEST(TimerOffsetTrackerTest, AFreshMeasurementReplacesAnOldOneUnlessItIsWorse) {
  TimerOffsetTracker t;
  ASSERT_TRUE(t.Offer(0, 4, kStart));
  const absl::Time later = kStart + absl::Seconds(10);  // bound 1004 us
  // A busy device stretched this one's round trip past the old bound.
  EXPECT_FALSE(t.Offer(777, 2000, later));
  EXPECT_EQ(t.offset_us(), 0);
  // Retried no sooner than a second later, still due.
  EXPECT_FALSE(t.Due(later + absl::Milliseconds(500)));
  EXPECT_TRUE(t.Due(later + TimerOffsetTracker::kRetryEvery));
  // Worse than a fresh one but better than the aged bound: kept.
  EXPECT_TRUE(t.Offer(250, 600, later + absl::Seconds(1)));
  EXPECT_EQ(t.offset_us(), 250);
  EXPECT_EQ(t.ErrorBoundUs(later + absl::Seconds(1)), 600);
}

TEST(TimerOffsetTrackerTest, AFailedTryWaitsASecondAndKeepsTheOffset) {
  TimerOffsetTracker t;
  t.Failed(kStart);  // e.g. the probe could not be created
  EXPECT_FALSE(t.has_offset());
  EXPECT_FALSE(t.Due(kStart + absl::Milliseconds(10)));
  EXPECT_TRUE(t.Due(kStart + absl::Seconds(1)));
  ASSERT_TRUE(t.Offer(42, 5, kStart + absl::Seconds(1)));
  t.Failed(kStart + absl::Seconds(11));
  EXPECT_EQ(t.offset_us(), 42);
  EXPECT_FALSE(t.Due(kStart + absl::Seconds(11) + absl::Milliseconds(999)));
  EXPECT_TRUE(t.Due(kStart + absl::Seconds(12)));
}

TEST(TimerOffsetTrackerTest, ANegativeUncertaintyIsNotAMeasurement) {
  TimerOffsetTracker t;
  EXPECT_FALSE(t.Offer(1, -1, kStart));
  EXPECT_FALSE(t.has_offset());
}

}  // namespace
}  // namespace baton::cuda
