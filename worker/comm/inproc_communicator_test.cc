#include "worker/comm/inproc_communicator.h"

#include <thread>
#include <vector>

#include "absl/time/time.h"
#include "gtest/gtest.h"

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

}  // namespace
}  // namespace baton::comm
