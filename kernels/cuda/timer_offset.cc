#include "kernels/cuda/timer_offset.h"

#include <algorithm>

namespace baton::cuda {

int64_t TimerOffsetTracker::ErrorBoundUs(absl::Time now) const {
  const int64_t age_us = std::max<int64_t>(0, absl::ToInt64Microseconds(now - kept_at_));
  return uncertainty_us_ + age_us / 1'000'000 * kMaxDriftPpm + age_us % 1'000'000 * kMaxDriftPpm / 1'000'000;
}

bool TimerOffsetTracker::Due(absl::Time now) const {
  if (now - tried_at_ < kRetryEvery) return false;
  return !has_offset_ || now - kept_at_ >= kRefreshEvery;
}

bool TimerOffsetTracker::Offer(int64_t offset_us, int64_t uncertainty_us, absl::Time now) {
  tried_at_ = now;
  if (uncertainty_us < 0) return false;
  if (has_offset_ && uncertainty_us > ErrorBoundUs(now)) return false;
  has_offset_ = true;
  offset_us_ = offset_us;
  uncertainty_us_ = uncertainty_us;
  kept_at_ = now;
  return true;
}

}  // namespace baton::cuda
