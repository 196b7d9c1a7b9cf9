// EpochShuffle: the order in which one epoch visits n items (token windows),
// a pseudo-random permutation of [0, n) that is a pure function of
// (seed, epoch, n) and is evaluated one position at a time in O(1) time and
// memory — no table of n entries, nothing cached, nothing to save in a
// checkpoint. A resumed or replayed step recomputes exactly the order the
// first run used.
//
// Construction: a balanced Feistel network over the smallest even power of
// two 2^(2h) >= n (six rounds, round function SplitMix64 keyed by
// SampleRng({seed, epoch, round})), restricted to [0, n) by cycle walking:
// apply it again while the image is >= n. The network is a bijection of
// [0, 2^(2h)), so the walk ends, and At is a bijection of [0, n); since
// 2^(2h) < 4n the expected number of applications is below 4.
//
// Immutable; thread-safe.
#ifndef BATON_WORKER_DATA_EPOCH_SHUFFLE_H_
#define BATON_WORKER_DATA_EPOCH_SHUFFLE_H_

#include <array>
#include <cstdint>

namespace baton::data {

class EpochShuffle {
 public:
  // n >= 1 items; n < 2^62.
  EpochShuffle(uint64_t seed, uint64_t epoch, uint64_t n);

  // The item visited at position `pos` (< n) of the epoch.
  uint64_t At(uint64_t pos) const;

  uint64_t size() const { return n_; }

 private:
  static constexpr int kRounds = 6;

  uint64_t Permute(uint64_t x) const;  // the Feistel network on [0, 2^(2h))

  uint64_t n_;
  int half_bits_;  // h
  uint64_t half_mask_;
  std::array<uint64_t, kRounds> keys_;
};

}  // namespace baton::data

#endif  // BATON_WORKER_DATA_EPOCH_SHUFFLE_H_
