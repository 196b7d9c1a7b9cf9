// EncodeChunkState / DecodeChunkState: a state round-trips bit for bit
// (including NaN payloads and signed zeros); every truncation, padding,
// flipped byte, foreign header or absurd count is an INVALID_ARGUMENT that
// says what is wrong, and never a crash or a huge allocation.
#include "worker/checkpoint/train_state.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>

#include "gtest/gtest.h"

namespace baton {
namespace {

ChunkState Sample(size_t n, bool moments, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  ChunkState s;
  s.optimizer_step = 1234567890123;
  for (size_t i = 0; i < n; ++i) s.values.push_back(normal(rng));
  if (moments) {
    for (size_t i = 0; i < n; ++i) s.adam_m.push_back(normal(rng));
    for (size_t i = 0; i < n; ++i) s.adam_v.push_back(std::abs(normal(rng)));
  }
  return s;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), sizeof(float) * a.size()) == 0);
}

void ExpectSame(const ChunkState& a, const ChunkState& b) {
  EXPECT_EQ(a.optimizer_step, b.optimizer_step);
  EXPECT_TRUE(SameBits(a.values, b.values));
  EXPECT_TRUE(SameBits(a.adam_m, b.adam_m));
  EXPECT_TRUE(SameBits(a.adam_v, b.adam_v));
}

void PutU64At(std::string& bytes, size_t offset, uint64_t v) {
  for (int i = 0; i < 8; ++i) bytes[offset + i] = static_cast<char>((v >> (8 * i)) & 0xff);
}

// Rewrites the trailing checksum so that only the header tampering is tested.
void Reseal(std::string& bytes) {
  const uint32_t crc = Crc32(absl::string_view(bytes).substr(0, bytes.size() - 4));
  for (int i = 0; i < 4; ++i) bytes[bytes.size() - 4 + i] = static_cast<char>((crc >> (8 * i)) & 0xff);
}

TEST(TrainStateTest, RoundTripsBitForBit) {
  ChunkState s = Sample(1000, true, 1);
  s.values[0] = -0.0f;
  s.values[1] = std::numeric_limits<float>::quiet_NaN();
  s.values[2] = std::numeric_limits<float>::infinity();
  s.values[3] = std::numeric_limits<float>::denorm_min();
  uint32_t nan_payload = 0x7fc01234;
  std::memcpy(&s.adam_m[5], &nan_payload, 4);
  const std::string bytes = EncodeChunkState(s);
  EXPECT_EQ(bytes.size(), kChunkStateHeaderBytes + 4 * 3000 + 4);
  absl::StatusOr<ChunkState> back = DecodeChunkState(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  ExpectSame(s, *back);
}

TEST(TrainStateTest, EmptyMomentsAndEmptyStateRoundTrip) {
  const ChunkState synthetic = Sample(1024, false, 2);
  absl::StatusOr<ChunkState> back = DecodeChunkState(EncodeChunkState(synthetic));
  ASSERT_TRUE(back.ok()) << back.status();
  ExpectSame(synthetic, *back);
  EXPECT_TRUE(back->adam_m.empty());

  absl::StatusOr<ChunkState> empty = DecodeChunkState(EncodeChunkState(ChunkState()));
  ASSERT_TRUE(empty.ok()) << empty.status();
  ExpectSame(ChunkState(), *empty);
}

TEST(TrainStateTest, EveryTruncationAndPaddingIsAnError) {
  const std::string bytes = EncodeChunkState(Sample(20, true, 3));
  for (size_t len = 0; len < bytes.size(); ++len) {
    absl::StatusOr<ChunkState> s = DecodeChunkState(absl::string_view(bytes).substr(0, len));
    ASSERT_FALSE(s.ok()) << "length " << len;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.status().message().find("chunk state"), absl::string_view::npos);
  }
  absl::StatusOr<ChunkState> padded = DecodeChunkState(bytes + std::string(4, '\0'));
  ASSERT_FALSE(padded.ok());
  EXPECT_NE(padded.status().message().find("payload"), absl::string_view::npos)
      << padded.status();
}

TEST(TrainStateTest, EveryFlippedByteIsDetected) {
  const std::string bytes = EncodeChunkState(Sample(16, true, 4));
  for (size_t i = 0; i < bytes.size(); ++i) {
    std::string bad = bytes;
    bad[i] = static_cast<char>(bad[i] ^ 0x10);
    absl::StatusOr<ChunkState> s = DecodeChunkState(bad);
    EXPECT_FALSE(s.ok()) << "byte " << i;
  }
  std::string payload_flip = bytes;
  payload_flip[kChunkStateHeaderBytes + 7] ^= 1;
  absl::StatusOr<ChunkState> s = DecodeChunkState(payload_flip);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("checksum mismatch"), absl::string_view::npos)
      << s.status();
}

TEST(TrainStateTest, ForeignAndHostileHeadersSayWhy) {
  const std::string good = EncodeChunkState(Sample(8, true, 5));

  std::string other = good;
  other[0] = 'X';
  EXPECT_NE(DecodeChunkState(other).status().message().find("not a baton chunk state"),
            absl::string_view::npos);

  std::string version = good;
  version[8] = 9;
  Reseal(version);
  EXPECT_NE(DecodeChunkState(version).status().message().find("version 9"),
            absl::string_view::npos);

  // Counts that would need exabytes, or overflow when summed: refused
  // before any allocation, even with a valid checksum.
  for (uint64_t huge : {uint64_t{1} << 62, ~uint64_t{0}, ~uint64_t{0} / 4 + 1}) {
    std::string bad = good;
    PutU64At(bad, 32, huge);
    Reseal(bad);
    absl::StatusOr<ChunkState> s = DecodeChunkState(bad);
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.status().message().find("more than the"), absl::string_view::npos) << s.status();
  }
  // Counts that move floats between parts but keep the total: the checksum
  // catches them.
  std::string moved = good;
  PutU64At(moved, 24, 7);
  PutU64At(moved, 32, 9);
  EXPECT_NE(DecodeChunkState(moved).status().message().find("checksum"), absl::string_view::npos);

  std::string negative = good;
  PutU64At(negative, 16, ~uint64_t{0});
  Reseal(negative);
  EXPECT_NE(DecodeChunkState(negative).status().message().find("negative"),
            absl::string_view::npos);
}

TEST(TrainStateTest, RandomlyCorruptedInputNeverCrashes) {
  std::mt19937 rng(42);
  const std::string good = EncodeChunkState(Sample(64, true, 6));
  int refused = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    std::string bytes = good;
    switch (trial % 3) {
      case 0: {  // a few random bytes changed
        const int flips = 1 + static_cast<int>(rng() % 4);
        for (int f = 0; f < flips; ++f) bytes[rng() % bytes.size()] = static_cast<char>(rng());
        break;
      }
      case 1:  // cut at a random point, then random bytes appended
        bytes.resize(rng() % bytes.size());
        for (int n = static_cast<int>(rng() % 64); n > 0; --n) bytes.push_back(static_cast<char>(rng()));
        break;
      default:  // random bytes behind a valid magic and version
        bytes.resize(12 + rng() % 200);
        for (size_t i = 12; i < bytes.size(); ++i) bytes[i] = static_cast<char>(rng());
        break;
    }
    if (bytes == good) continue;
    absl::StatusOr<ChunkState> s = DecodeChunkState(bytes);
    if (!s.ok()) {
      ++refused;
      EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    }
  }
  // A random change passes a CRC-32 with probability 2^-32.
  EXPECT_GE(refused, 2990);
}

}  // namespace
}  // namespace baton
