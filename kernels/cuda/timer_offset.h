// TimerOffsetTracker: the offset from a GPU's %globaltimer to the host's Unix
// clock (kernels/cuda/stamp.cuh) over a long job. Host-only logic: which
// measurement to keep, and when to measure again.
//
// The two clocks run from different oscillators (and NTP slews the host's),
// so they drift apart: a single measurement at start-up is off by about
// drift * age, e.g. 180 ms after an hour at 50 ppm, against pipeline
// transfers of microseconds whose comm/bubble split compares stamps of two
// ranks. The CUDA backend therefore measures again at a host wait it makes
// anyway once Due(), and keeps the measurement whose error bound is smaller:
//   bound(kept)  = its uncertainty + age * kMaxDriftPpm
//   bound(fresh) = its uncertainty (half its tightest round trip)
// A busy device stretches the round trip, so a fresh measurement can be
// worse than a recent one; against an old one it wins.
#ifndef BATON_KERNELS_CUDA_TIMER_OFFSET_H_
#define BATON_KERNELS_CUDA_TIMER_OFFSET_H_

#include <cstdint>

#include "absl/time/time.h"

namespace baton::cuda {

class TimerOffsetTracker {
 public:
  // Measure again this long after the kept measurement...
  static constexpr absl::Duration kRefreshEvery = absl::Seconds(10);
  // ... and no more often than this after a try (failed or not kept).
  static constexpr absl::Duration kRetryEvery = absl::Seconds(1);
  // Bound on how fast the two clocks drift apart, parts per million.
  static constexpr int64_t kMaxDriftPpm = 100;

  bool has_offset() const { return has_offset_; }
  // Host clock minus timer, microseconds (0 before the first measurement).
  int64_t offset_us() const { return offset_us_; }
  // The kept measurement's error bound at `now`, microseconds.
  int64_t ErrorBoundUs(absl::Time now) const;
  // Whether a measurement at `now` is wanted.
  bool Due(absl::Time now) const;
  // A measurement taken at `now`; true when it is kept.
  bool Offer(int64_t offset_us, int64_t uncertainty_us, absl::Time now);
  // A measurement tried at `now` failed.
  void Failed(absl::Time now) { tried_at_ = now; }

 private:
  bool has_offset_ = false;
  int64_t offset_us_ = 0;
  int64_t uncertainty_us_ = 0;
  absl::Time kept_at_ = absl::InfinitePast();
  absl::Time tried_at_ = absl::InfinitePast();
};

}  // namespace baton::cuda

#endif  // BATON_KERNELS_CUDA_TIMER_OFFSET_H_
