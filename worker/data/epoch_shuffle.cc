#include "worker/data/epoch_shuffle.h"

#include "absl/base/internal/raw_logging.h"
#include "worker/data/data_source.h"

namespace baton::data {
namespace {

// Keeps the shuffle's draws apart from the rows' SampleRng({seed, step, ...}).
constexpr uint64_t kShuffleDomain = 0x5368756666ull;  // "Shuff"

uint64_t Mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace

EpochShuffle::EpochShuffle(uint64_t seed, uint64_t epoch, uint64_t n) : n_(n) {
  ABSL_RAW_CHECK(n >= 1 && n < (uint64_t{1} << 62), "EpochShuffle: n outside [1, 2^62)");
  int bits = 0;
  while ((uint64_t{1} << bits) < n) ++bits;
  half_bits_ = (bits + 1) / 2;
  half_mask_ = (uint64_t{1} << half_bits_) - 1;
  for (int r = 0; r < kRounds; ++r) {
    keys_[r] = SampleRng({kShuffleDomain, seed, epoch, static_cast<uint64_t>(r)}).Next();
  }
}

uint64_t EpochShuffle::Permute(uint64_t x) const {
  uint64_t left = x >> half_bits_, right = x & half_mask_;
  for (int r = 0; r < kRounds; ++r) {
    const uint64_t next = left ^ (Mix(right ^ keys_[r]) & half_mask_);
    left = right;
    right = next;
  }
  return (left << half_bits_) | right;
}

uint64_t EpochShuffle::At(uint64_t pos) const {
  ABSL_RAW_CHECK(pos < n_, "EpochShuffle::At: position past the epoch");
  uint64_t x = Permute(pos);
  while (x >= n_) x = Permute(x);
  return x;
}

}  // namespace baton::data
