#include "common/session_fragments.h"

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "baton/v1/coordinator.pb.h"
#include "gtest/gtest.h"

namespace baton {
namespace {

std::string Bytes(size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 131 + i / 7) & 0xff);
  return s;
}

// Feeds every fragment; returns the joined message (or the first error).
absl::StatusOr<std::string> Join(FragmentAssembler& a, std::vector<v1::Fragment> fragments) {
  for (size_t i = 0; i < fragments.size(); ++i) {
    auto got = a.Add(std::move(fragments[i]));
    if (!got.ok()) return got.status();
    if (got->has_value() != (i + 1 == fragments.size())) return absl::InternalError("done at the wrong fragment");
    if (got->has_value()) return std::move(**got);
  }
  return absl::InternalError("no fragments");
}

void ExpectError(const absl::StatusOr<std::optional<std::string>>& got, const std::string& says) {
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(got.status().message(), says)) << got.status();
}

TEST(SessionFragmentsTest, TheThresholdIsThePayload) {
  EXPECT_FALSE(NeedsFragments(kFragmentPayloadBytes));
  EXPECT_TRUE(NeedsFragments(kFragmentPayloadBytes + 1));
  EXPECT_EQ(FragmentCount(kFragmentPayloadBytes + 1), 2);
  EXPECT_EQ(FragmentCount(2 * kFragmentPayloadBytes), 2);
  EXPECT_EQ(FragmentCount(2 * kFragmentPayloadBytes + 1), 3);
  // A fragment of a full payload stays under gRPC's 4 MiB with its envelope.
  v1::WorkerMessage m;
  m.set_worker_id(INT64_MAX);
  m.set_incarnation(INT64_MAX);
  *m.mutable_fragment() = FragmentOf(Bytes(2 * kFragmentPayloadBytes + 5), 1);
  EXPECT_LT(m.ByteSizeLong(), size_t{4} << 20);
}

TEST(SessionFragmentsTest, RoundTripsOneByteOverTheThreshold) {
  const std::string msg = Bytes(kFragmentPayloadBytes + 1);
  std::vector<v1::Fragment> f = SplitIntoFragments(msg);
  ASSERT_EQ(f.size(), 2u);
  EXPECT_EQ(f[0].data().size(), kFragmentPayloadBytes);
  EXPECT_EQ(f[1].data().size(), 1u);
  FragmentAssembler a;
  auto joined = Join(a, f);
  ASSERT_TRUE(joined.ok()) << joined.status();
  EXPECT_EQ(*joined, msg);
  EXPECT_FALSE(a.in_progress());
}

TEST(SessionFragmentsTest, RoundTripsExactMultiplesAndSeveralMessagesInARow) {
  FragmentAssembler a;
  for (size_t n : {2 * kFragmentPayloadBytes, 3 * kFragmentPayloadBytes + 17, kFragmentPayloadBytes + 1}) {
    const std::string msg = Bytes(n);
    std::vector<v1::Fragment> f = SplitIntoFragments(msg);
    EXPECT_EQ(static_cast<int64_t>(f.size()), FragmentCount(static_cast<int64_t>(n)));
    for (const v1::Fragment& x : f) EXPECT_EQ(x.count(), static_cast<int32_t>(f.size()));
    auto joined = Join(a, f);
    ASSERT_TRUE(joined.ok()) << joined.status();
    EXPECT_EQ(*joined, msg);
  }
}

TEST(SessionFragmentsTest, RoundTripsAWorkerMessage) {
  v1::WorkerMessage m;
  m.set_worker_id(3);
  m.set_incarnation(4);
  m.mutable_snapshot()->set_owner("w");
  m.mutable_snapshot()->set_data(Bytes(7 << 20));
  FragmentAssembler a;
  auto joined = Join(a, SplitIntoFragments(m.SerializeAsString()));
  ASSERT_TRUE(joined.ok()) << joined.status();
  v1::WorkerMessage back;
  ASSERT_TRUE(back.ParseFromString(*joined));
  EXPECT_EQ(back.snapshot().data(), m.snapshot().data());
}

// The bounds, with a 10-byte payload.
TEST(SessionFragmentsTest, AMessageOfAtMostOnePayloadIsRefused) {
  FragmentAssembler a(1000, 10);
  v1::Fragment f = FragmentOf(Bytes(10), 0, 10);
  ExpectError(a.Add(f), "not over the 10-byte fragment payload");
  f.set_total_bytes(0);
  ExpectError(a.Add(f), "not over");
}

TEST(SessionFragmentsTest, TotalOverTheBoundIsRefusedBeforeAnythingIsKept) {
  FragmentAssembler a(100, 10);
  auto ok = Join(a, SplitIntoFragments(Bytes(100), 10));
  EXPECT_TRUE(ok.ok()) << ok.status();
  v1::Fragment f = FragmentOf(Bytes(101), 0, 10);
  ExpectError(a.Add(f), "over this receiver's bound of 100 bytes");
  EXPECT_EQ(a.buffered_bytes(), 0);
  // A claim near 2 GiB with a small first fragment: refused, nothing allocated.
  FragmentAssembler b(1000, 10);
  f.set_total_bytes(int64_t{1} << 40);
  f.set_count(INT32_MAX);
  ExpectError(b.Add(f), "over this receiver's bound");
  EXPECT_FALSE(b.in_progress());
}

TEST(SessionFragmentsTest, CountMustMatchTotal) {
  FragmentAssembler a(1000, 10);
  v1::Fragment f = FragmentOf(Bytes(25), 0, 10);
  EXPECT_EQ(f.count(), 3);
  f.set_count(2);
  ExpectError(a.Add(f), "count 2 does not match total_bytes 25 (3 fragments of 10 bytes)");
  f.set_count(-1);
  ExpectError(a.Add(f), "count -1");
}

TEST(SessionFragmentsTest, IndexMustStartAtZeroAndGoUpByOne) {
  const std::string msg = Bytes(35);
  std::vector<v1::Fragment> f = SplitIntoFragments(msg, 10);
  {
    FragmentAssembler a(1000, 10);
    ExpectError(a.Add(f[1]), "fragment 1 of 4 arrived with no message in assembly");
  }
  {
    FragmentAssembler a(1000, 10);
    ASSERT_TRUE(a.Add(f[0]).ok());
    ExpectError(a.Add(f[2]), "expected fragment 1 of 4");
    EXPECT_FALSE(a.in_progress());
  }
  {
    FragmentAssembler a(1000, 10);
    ASSERT_TRUE(a.Add(f[0]).ok());
    ExpectError(a.Add(f[0]), "expected fragment 1 of 4");  // a repeat
  }
  {
    FragmentAssembler a(1000, 10);
    ASSERT_TRUE(a.Add(f[0]).ok());
    v1::Fragment neg = f[1];
    neg.set_index(-1);
    ExpectError(a.Add(neg), "got fragment -1");
  }
}

TEST(SessionFragmentsTest, OnlyOneMessageAtATime) {
  std::vector<v1::Fragment> one = SplitIntoFragments(Bytes(35), 10);
  std::vector<v1::Fragment> two = SplitIntoFragments(Bytes(45), 10);
  FragmentAssembler a(1000, 10);
  ASSERT_TRUE(a.Add(one[0]).ok());
  ASSERT_TRUE(a.Add(one[1]).ok());
  ExpectError(a.Add(two[0]), "another message may not start");
  // After the error the stream is to end; a fresh start is accepted again.
  auto joined = Join(a, two);
  EXPECT_TRUE(joined.ok()) << joined.status();
  // The same index with another total is refused too.
  ASSERT_TRUE(a.Add(one[0]).ok());
  v1::Fragment other = two[1];
  ExpectError(a.Add(other), "(45 bytes)");
}

TEST(SessionFragmentsTest, EachFragmentMustCarryItsSize) {
  std::vector<v1::Fragment> f = SplitIntoFragments(Bytes(25), 10);
  {
    FragmentAssembler a(1000, 10);
    v1::Fragment shortf = f[0];
    shortf.mutable_data()->pop_back();
    ExpectError(a.Add(shortf), "fragment 0 of 3 carries 9 bytes, not 10");
  }
  {
    FragmentAssembler a(1000, 10);
    ASSERT_TRUE(a.Add(f[0]).ok());
    ASSERT_TRUE(a.Add(f[1]).ok());
    v1::Fragment last = f[2];
    last.mutable_data()->append("x");
    ExpectError(a.Add(last), "fragment 2 of 3 carries 6 bytes, not 5");
  }
  {
    FragmentAssembler a(1000, 10);
    v1::Fragment big = f[0];
    big.mutable_data()->append(std::string(1 << 20, 'x'));
    ExpectError(a.Add(big), "not 10");
    EXPECT_EQ(a.buffered_bytes(), 0);
  }
}

TEST(SessionFragmentsTest, ResetDropsAMessageInProgress) {
  std::vector<v1::Fragment> f = SplitIntoFragments(Bytes(25), 10);
  FragmentAssembler a(1000, 10);
  ASSERT_TRUE(a.Add(f[0]).ok());
  EXPECT_TRUE(a.in_progress());
  EXPECT_EQ(a.buffered_bytes(), 10);
  a.Reset();
  EXPECT_FALSE(a.in_progress());
  auto joined = Join(a, f);
  EXPECT_TRUE(joined.ok()) << joined.status();
}

TEST(SessionFragmentsTest, TheDefaultBoundIsWhatProtobufCanHold) {
  FragmentAssembler a;
  EXPECT_EQ(a.max_total_bytes(), INT32_MAX);
  v1::Fragment f;
  f.set_index(0);
  f.set_total_bytes(int64_t{INT32_MAX} + 1);
  f.set_count(static_cast<int32_t>(FragmentCount(f.total_bytes())));
  f.set_data(std::string(kFragmentPayloadBytes, 'x'));
  ExpectError(a.Add(f), "over this receiver's bound of 2147483647 bytes");
}

}  // namespace
}  // namespace baton
