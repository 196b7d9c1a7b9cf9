#include "worker/comm/inproc_communicator.h"

#include <cstdint>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "worker/comm/all_to_all_v_testing.h"

namespace baton::comm {
namespace {

constexpr absl::Duration kWait = absl::Seconds(10);

// Runs fn(rank) on one thread per rank and joins them.
template <typename Fn>
void OnEveryRank(int size, Fn fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) threads.emplace_back(fn, r);
  for (auto& t : threads) t.join();
}

TEST(InProcCommunicatorTest, AllReduceSumsInRankOrderWithIdenticalBitsOnEveryRank) {
  const int n = 4;
  auto group = InProcCommunicator::CreateGroup(n);
  // Values whose float sum depends on the order: 1e8 + 1 − 1e8 + 0.5.
  const float contrib[n] = {1e8f, 1.0f, -1e8f, 0.5f};
  std::vector<std::vector<float>> bufs(n, std::vector<float>(3));
  OnEveryRank(n, [&](int r) {
    for (float& x : bufs[r]) x = contrib[r];
    EXPECT_TRUE(group[r]->AllReduceSum(Buffer::Host(bufs[r].data(), 3))->Wait(kWait).ok());
  });
  const float want = ((1e8f + 1.0f) + -1e8f) + 0.5f;
  for (int r = 0; r < n; ++r) {
    for (float x : bufs[r]) EXPECT_EQ(x, want);
  }
}

TEST(InProcCommunicatorTest, AllGatherReduceScatterBroadcast) {
  const int n = 3;
  auto group = InProcCommunicator::CreateGroup(n);
  std::vector<std::vector<float>> gathered(n, std::vector<float>(2 * n));
  std::vector<std::vector<float>> scattered(n, std::vector<float>(2));
  std::vector<std::vector<float>> bcast(n, std::vector<float>(2, -1.0f));
  OnEveryRank(n, [&](int r) {
    const float mine[2] = {static_cast<float>(r), static_cast<float>(10 * r)};
    EXPECT_TRUE(group[r]
                    ->AllGather(Buffer::Host(mine, 2), Buffer::Host(gathered[r].data(), 2 * n))
                    ->Wait(kWait)
                    .ok());
    std::vector<float> in(2 * n);
    for (int i = 0; i < 2 * n; ++i) in[i] = static_cast<float>(i + r);
    EXPECT_TRUE(
        group[r]
            ->ReduceScatterSum(Buffer::Host(in.data(), 2 * n), Buffer::Host(scattered[r].data(), 2))
            ->Wait(kWait)
            .ok());
    if (r == 2) bcast[r] = {7.0f, 8.0f};
    EXPECT_TRUE(group[r]->Broadcast(Buffer::Host(bcast[r].data(), 2), 2)->Wait(kWait).ok());
    EXPECT_TRUE(group[r]->Barrier()->Wait(kWait).ok());
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(gathered[r], (std::vector<float>{0, 0, 1, 10, 2, 20}));
    // Chunk r of Σ_q (i + q) over q = 0..2: 3i + 3 for i = 2r, 2r+1.
    EXPECT_EQ(scattered[r], (std::vector<float>{6.0f * r + 3, 6.0f * r + 6}));
    EXPECT_EQ(bcast[r], (std::vector<float>{7.0f, 8.0f}));
  }
}

TEST(InProcCommunicatorTest, SendRecvMatchesByTagInEitherOrder) {
  auto group = InProcCommunicator::CreateGroup(2);
  float a[2] = {1, 2}, b[2] = {3, 4}, got_a[2] = {}, got_b[2] = {};
  // Receiver posts first for tag 1; sender posts first for tag 2.
  auto recv1 = group[1]->Recv(Buffer::Host(got_a, 2), 0, 1);
  auto send2 = group[0]->Send(Buffer::Host(b, 2), 1, 2);
  EXPECT_FALSE(recv1->IsCompleted());
  auto send1 = group[0]->Send(Buffer::Host(a, 2), 1, 1);
  auto recv2 = group[1]->Recv(Buffer::Host(got_b, 2), 0, 2);
  for (auto* w : {&recv1, &send1, &send2, &recv2}) EXPECT_TRUE((*w)->Wait(kWait).ok());
  EXPECT_EQ(got_a[1], 2.0f);
  EXPECT_EQ(got_b[0], 3.0f);
}

TEST(InProcCommunicatorTest, SizeMismatchFailsBothSides) {
  auto group = InProcCommunicator::CreateGroup(2);
  float a[2] = {}, b[3] = {};
  auto send = group[0]->Send(Buffer::Host(a, 2), 1, 0);
  auto recv = group[1]->Recv(Buffer::Host(b, 3), 0, 0);
  EXPECT_EQ(send->Wait(kWait).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(recv->Wait(kWait).code(), absl::StatusCode::kInvalidArgument);
}

TEST(InProcCommunicatorTest, WaitTimesOutWhenAPeerNeverArrives) {
  auto group = InProcCommunicator::CreateGroup(2);
  float x[1] = {1};
  auto work = group[0]->AllReduceSum(Buffer::Host(x, 1));
  const absl::Status status = work->Wait(absl::Milliseconds(20));
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(status.message().find("AllReduceSum"), absl::string_view::npos);
  EXPECT_FALSE(work->IsCompleted());
}

TEST(InProcCommunicatorTest, AbortUnblocksPendingOpsAndFailsLaterOnes) {
  auto group = InProcCommunicator::CreateGroup(2);
  float x[1] = {1}, y[1] = {};
  auto pending_collective = group[0]->AllReduceSum(Buffer::Host(x, 1));
  auto pending_recv = group[0]->Recv(Buffer::Host(y, 1), 1, 5);
  absl::Status waited;
  std::thread waiter([&] { waited = pending_recv->Wait(absl::Seconds(30)); });
  group[1]->Abort("stage 1 crashed");
  waiter.join();
  EXPECT_EQ(waited.code(), absl::StatusCode::kAborted);
  EXPECT_NE(waited.message().find("stage 1 crashed"), absl::string_view::npos);
  EXPECT_EQ(pending_collective->Wait(kWait).code(), absl::StatusCode::kAborted);
  // Later ops fail fast instead of hanging.
  EXPECT_EQ(group[0]->Barrier()->Wait(absl::Milliseconds(1)).code(), absl::StatusCode::kAborted);
  EXPECT_EQ(group[0]->Send(Buffer::Host(x, 1), 1, 6)->Wait(absl::Milliseconds(1)).code(),
            absl::StatusCode::kAborted);
}

TEST(InProcCommunicatorTest, BroadcastRootOutsideTheGroupFailsAtOnce) {
  auto group = InProcCommunicator::CreateGroup(2);
  float x[1] = {};
  EXPECT_EQ(group[0]->Broadcast(Buffer::Host(x, 1), 2)->Wait(absl::Milliseconds(1)).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(InProcCommunicatorTest, MismatchedCollectivesFailOnEveryRank) {
  auto group = InProcCommunicator::CreateGroup(2);
  float x[2] = {}, y[4] = {};
  auto a = group[0]->AllReduceSum(Buffer::Host(x, 2));
  auto b = group[1]->AllGather(Buffer::Host(x, 2), Buffer::Host(y, 4));
  EXPECT_EQ(a->Wait(kWait).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b->Wait(kWait).code(), absl::StatusCode::kInvalidArgument);
}

class InProcAllToAllVTest : public ::testing::TestWithParam<int> {};

TEST_P(InProcAllToAllVTest, UnevenChunksIncludingZerosArriveElementForElement) {
  const int n = GetParam();
  auto group = InProcCommunicator::CreateGroup(n);
  OnEveryRank(n, [&](int r) {
    RunUnevenAllToAllV<int32_t>(*group[r], kWait);
    RunUnevenAllToAllV<int64_t>(*group[r], kWait);
    RunUnevenAllToAllV<float>(*group[r], kWait);
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, InProcAllToAllVTest, ::testing::Range(1, 5));

// The checks are shared by every backend (CheckAllToAllVArgs); a refused op
// is never posted, so the group goes on in step.
TEST(InProcAllToAllVTest, BadArgumentsFailAtOnceSayingWhatToFix) {
  auto group = InProcCommunicator::CreateGroup(2);
  std::vector<float> in(5), out(5);
  std::vector<int32_t> out32(5);
  const Buffer in5 = Buffer::Host(in.data(), 5), out5 = Buffer::Host(out.data(), 5);
  auto refused = [&](Buffer i, std::vector<int64_t> send, Buffer o, std::vector<int64_t> recv,
                     const std::string& says) {
    std::shared_ptr<Work> w = group[0]->AllToAllV(i, send, o, recv);
    EXPECT_TRUE(w->IsCompleted()) << says;
    const absl::Status s = w->Wait(absl::ZeroDuration());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(says), absl::string_view::npos) << s;
  };
  refused(in5, {2, 3, 0}, out5, {2, 3}, "send_counts holds 3 value(s); it needs one per rank");
  refused(in5, {2, 3}, out5, {5}, "recv_counts holds 1 value(s)");
  refused(in5, {6, -1}, out5, {2, 3}, "send_counts[1] is -1; counts must be zero or more");
  refused(in5, {2, 2}, out5, {2, 3}, "in has 5 elements, send_counts add up to 4");
  refused(in5, {2, 3}, out5, {2, 2}, "out has 5 elements, recv_counts add up to 4");
  refused(in5, {2, 3}, Buffer{out32.data(), 5, DType::kInt32, -1}, {2, 3},
          "in is float32, out is int32; both buffers must have the same dtype");
  refused(in5, {2, 3}, out5, {3, 2}, "send_counts[0] is 2, recv_counts[0] is 3");
  refused(in5, {std::numeric_limits<int64_t>::max() / 4, 1}, out5, {2, 3}, "the count overflows");
  refused(in5, {std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::max()}, out5,
          {2, 3}, "the count overflows");
  refused(Buffer{nullptr, 5, DType::kFloat32, -1}, {2, 3}, out5, {2, 3}, "in has no data");

  absl::StatusOr<std::vector<int64_t>> counts = ExchangeCounts(*group[0], {1, 2, 3}, kWait);
  EXPECT_EQ(counts.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(counts.status().message().find("send_counts holds 3 value(s)"), absl::string_view::npos)
      << counts.status();
  counts = ExchangeCounts(*group[0], {1, -2}, kWait);
  EXPECT_EQ(counts.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(counts.status().message().find("send_counts[1] is -2"), absl::string_view::npos)
      << counts.status();

  OnEveryRank(2, [&](int r) { RunUnevenAllToAllV<float>(*group[r], kWait); });
}

TEST(InProcAllToAllVTest, RanksThatDisagreeOnCountsBothFailNamingThePair) {
  auto group = InProcCommunicator::CreateGroup(2);
  // Rank 0 sends 3 elements to rank 1, which expects 2.
  std::vector<float> in0(4), out0(3), in1(3), out1(3);
  absl::Status s0, s1;
  OnEveryRank(2, [&](int r) {
    if (r == 0) {
      s0 = group[0]
               ->AllToAllV(Buffer::Host(in0.data(), 4), {1, 3}, Buffer::Host(out0.data(), 3), {1, 2})
               ->Wait(kWait);
    } else {
      s1 = group[1]
               ->AllToAllV(Buffer::Host(in1.data(), 3), {2, 1}, Buffer::Host(out1.data(), 3), {2, 1})
               ->Wait(kWait);
    }
  });
  for (const absl::Status& s : {s0, s1}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("rank 0 sends 3 elements to rank 1, which expects 2"),
              absl::string_view::npos)
        << s;
  }
}

TEST(InProcAllToAllVTest, AbortCompletesAPendingAllToAllVWithAborted) {
  auto group = InProcCommunicator::CreateGroup(2);
  std::vector<float> in(2, 1), out(2);
  auto pending = group[0]->AllToAllV(Buffer::Host(in.data(), 2), {1, 1},
                                     Buffer::Host(out.data(), 2), {1, 1});
  EXPECT_FALSE(pending->IsCompleted()) << "rank 1 has not posted its AllToAllV";
  absl::Status waited;
  std::thread waiter([&] { waited = pending->Wait(kWait); });
  group[0]->Abort("expert rank crashed");
  waiter.join();
  EXPECT_EQ(waited.code(), absl::StatusCode::kAborted) << waited;
  EXPECT_NE(waited.message().find("expert rank crashed"), absl::string_view::npos) << waited;
  // Later ones fail fast, on every rank.
  auto late = group[1]->AllToAllV(Buffer::Host(in.data(), 2), {1, 1}, Buffer::Host(out.data(), 2),
                                  {1, 1});
  EXPECT_TRUE(late->IsCompleted());
  EXPECT_EQ(late->Wait(absl::ZeroDuration()).code(), absl::StatusCode::kAborted);
}

TEST(InProcAllToAllVTest, APeerThatNeverJoinsTimesOutNamingTheOp) {
  auto group = InProcCommunicator::CreateGroup(2);
  std::vector<float> in(2, 1), out(2);
  auto pending = group[0]->AllToAllV(Buffer::Host(in.data(), 2), {1, 1},
                                     Buffer::Host(out.data(), 2), {1, 1});
  const absl::Status s = pending->Wait(absl::Milliseconds(20));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find("AllToAllV"), absl::string_view::npos) << s;
  EXPECT_FALSE(pending->IsCompleted()) << "the op stays posted";

  // ExchangeCounts cannot leave its own buffers posted: it aborts.
  auto fresh = InProcCommunicator::CreateGroup(2);
  absl::StatusOr<std::vector<int64_t>> counts =
      ExchangeCounts(*fresh[0], {1, 1}, absl::Milliseconds(20));
  EXPECT_EQ(counts.status().code(), absl::StatusCode::kDeadlineExceeded) << counts.status();
  EXPECT_NE(counts.status().message().find("ExchangeCounts on rank 0 of 2"), absl::string_view::npos)
      << counts.status();
  EXPECT_NE(counts.status().message().find("AllToAllV"), absl::string_view::npos) << counts.status();
  EXPECT_NE(counts.status().message().find("aborted the communicator"), absl::string_view::npos)
      << counts.status();
  EXPECT_EQ(fresh[1]->Barrier()->Wait(absl::ZeroDuration()).code(), absl::StatusCode::kAborted);
}

}  // namespace
}  // namespace baton::comm
