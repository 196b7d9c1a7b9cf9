// Gloo backend, ranks as threads of this process over loopback TCP, through
// the factory and an InMemoryStore. Multi-process cases (a killed peer, the
// coordinator KV) are in gloo_multiprocess_test.cc.
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "worker/comm/all_to_all_v_testing.h"
#include "worker/comm/communicator_factory.h"
#include "worker/comm/store.h"

namespace baton::comm {
namespace {

using ::testing::TestWithParam;

constexpr absl::Duration kWait = absl::Seconds(60);

CommunicatorSpec Spec(const std::string& group, int64_t generation, int rank, int size) {
  CommunicatorSpec spec;
  spec.group = group;
  spec.generation = generation;
  spec.rank = rank;
  spec.size = size;
  spec.rendezvous_timeout = absl::Seconds(30);
  return spec;
}

// Creates `size` communicators concurrently (one thread per rank).
std::vector<std::unique_ptr<Communicator>> Group(Store& store, const std::string& group,
                                                 int size, int64_t generation = 1) {
  std::vector<std::unique_ptr<Communicator>> comms(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      auto c = CreateCommunicator(store, Spec(group, generation, r, size));
      ASSERT_TRUE(c.ok()) << c.status();
      comms[r] = std::move(*c);
    });
  }
  for (auto& t : threads) t.join();
  return comms;
}

// Runs fn(rank) on one thread per rank.
void OnEachRank(int size, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) threads.emplace_back(fn, r);
  for (auto& t : threads) t.join();
}

uint8_t Pattern(int sender, size_t i) { return static_cast<uint8_t>(sender * 131 + i * 7 + i / 251); }

TEST(GlooRingTest, SendRecvAroundARingFromOneByteToAMebibyteIncludingOddSizes) {
  InMemoryStore store;
  const int n = 4;
  auto comms = Group(store, "ring", n);
  ASSERT_EQ(comms.size(), 4u);
  const std::vector<size_t> sizes = {1, 3, 8, 4093, 65536 + 5, (1 << 20) + 3};
  OnEachRank(n, [&](int r) {
    Communicator& c = *comms[r];
    EXPECT_EQ(c.backend(), "gloo");
    const int next = (r + 1) % n, prev = (r + n - 1) % n;
    std::vector<std::vector<uint8_t>> out(sizes.size()), in(sizes.size());
    std::vector<std::shared_ptr<Work>> works;
    for (size_t k = 0; k < sizes.size(); ++k) {
      out[k].resize(sizes[k]);
      in[k].assign(sizes[k], 0);
      for (size_t i = 0; i < sizes[k]; ++i) out[k][i] = Pattern(r, i + k);
      works.push_back(c.Recv(Buffer{in[k].data(), static_cast<int64_t>(sizes[k]), DType::kUInt8, -1},
                             prev, k));
      works.push_back(c.Send(Buffer{out[k].data(), static_cast<int64_t>(sizes[k]), DType::kUInt8, -1},
                             next, k));
    }
    for (auto& w : works) ASSERT_TRUE(w->Wait(kWait).ok()) << w->Wait(absl::ZeroDuration());
    for (size_t k = 0; k < sizes.size(); ++k) {
      for (size_t i = 0; i < sizes[k]; ++i) {
        ASSERT_EQ(in[k][i], Pattern(prev, i + k)) << "rank " << r << " size " << sizes[k] << " byte " << i;
      }
    }
  });
}

TEST(GlooRingTest, SixtyFourMebibytesBothWaysArriveIntact) {
  InMemoryStore store;
  auto comms = Group(store, "big", 2);
  const size_t bytes = size_t{64} << 20;
  OnEachRank(2, [&](int r) {
    std::vector<uint8_t> out(bytes), in(bytes, 0);
    for (size_t i = 0; i < bytes; ++i) out[i] = Pattern(r, i);
    auto recv = comms[r]->Recv(Buffer{in.data(), static_cast<int64_t>(bytes), DType::kUInt8, -1}, 1 - r, 9);
    auto send = comms[r]->Send(Buffer{out.data(), static_cast<int64_t>(bytes), DType::kUInt8, -1}, 1 - r, 9);
    ASSERT_TRUE(send->Wait(kWait).ok());
    ASSERT_TRUE(recv->Wait(kWait).ok());
    for (size_t i = 0; i < bytes; i += 4099) ASSERT_EQ(in[i], Pattern(1 - r, i)) << i;
    EXPECT_EQ(in[bytes - 1], Pattern(1 - r, bytes - 1));
  });
}

TEST(GlooRingTest, ManyConcurrentTagsMatchByTagNotByOrder) {
  InMemoryStore store;
  auto comms = Group(store, "tags", 2);
  const int kTags = 64;
  const int64_t count = 1001;
  std::vector<std::vector<float>> out(kTags, std::vector<float>(count));
  std::vector<std::vector<float>> in(kTags, std::vector<float>(count, -1));
  std::vector<std::shared_ptr<Work>> works;
  // Receiver posts in reverse tag order, sender in forward order.
  for (int t = kTags - 1; t >= 0; --t) {
    works.push_back(comms[1]->Recv(Buffer::Host(in[t].data(), count), 0, 1000 + t));
  }
  for (int t = 0; t < kTags; ++t) {
    std::iota(out[t].begin(), out[t].end(), static_cast<float>(t * 10000));
    works.push_back(comms[0]->Send(Buffer::Host(out[t].data(), count), 1, 1000 + t));
  }
  for (auto& w : works) ASSERT_TRUE(w->Wait(kWait).ok());
  for (int t = 0; t < kTags; ++t) {
    EXPECT_EQ(in[t].front(), t * 10000.0f) << "tag " << t;
    EXPECT_EQ(in[t].back(), t * 10000.0f + count - 1) << "tag " << t;
  }
}

TEST(GlooRingTest, PolledOpsCompleteWithoutAnyoneWaiting) {
  InMemoryStore store;
  auto comms = Group(store, "poll", 2);
  std::vector<int64_t> out(333, 77), in(333, 0);
  auto recv = comms[1]->Recv(Buffer{in.data(), 333, DType::kInt64, -1}, 0, 4);
  auto send = comms[0]->Send(Buffer{out.data(), 333, DType::kInt64, -1}, 1, 4);
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (!(recv->IsCompleted() && send->IsCompleted()) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_TRUE(recv->IsCompleted());
  ASSERT_TRUE(send->IsCompleted());
  EXPECT_TRUE(recv->Wait(absl::ZeroDuration()).ok());
  EXPECT_EQ(in[332], 77);
}

TEST(GlooRingTest, MessagesSentBeforeTheirReceiveIsPostedArriveInAnyPostingOrder) {
  InMemoryStore store;
  auto comms = Group(store, "early", 2);
  constexpr int kMessages = 20;
  std::vector<std::vector<int32_t>> out(kMessages), in(kMessages);
  std::vector<std::shared_ptr<Work>> sends;
  for (int i = 0; i < kMessages; ++i) {
    const int64_t n = 1 + i * 997;  // 4 B .. 76 KB
    out[i].assign(n, 1000 + i);
    in[i].assign(n, 0);
    sends.push_back(comms[0]->Send(Buffer{out[i].data(), n, DType::kInt32, -1}, 1, 50 + i));
  }
  for (auto& s : sends) ASSERT_TRUE(s->Wait(kWait).ok());
  absl::SleepFor(absl::Milliseconds(50));  // everything is on rank 1's side before it posts
  for (int i = kMessages - 1; i >= 0; --i) {  // posted last-sent first
    const int64_t n = static_cast<int64_t>(in[i].size());
    ASSERT_TRUE(comms[1]->Recv(Buffer{in[i].data(), n, DType::kInt32, -1}, 0, 50 + i)
                    ->Wait(kWait).ok());
    EXPECT_EQ(in[i].front(), 1000 + i);
    EXPECT_EQ(in[i].back(), 1000 + i);
  }
}

TEST(GlooRingTest, ASizeMismatchFailsTheReceiveNamingBothSizesAndTheLinkGoesOn) {
  InMemoryStore store;
  auto comms = Group(store, "mismatch", 2);
  std::vector<float> big(100, 1), small(10, 0), ok_in(4, 0), ok_out(4, 2);
  auto recv = comms[1]->Recv(Buffer::Host(small.data(), small.size()), 0, 1);
  ASSERT_TRUE(comms[0]->Send(Buffer::Host(big.data(), big.size()), 1, 1)->Wait(kWait).ok());
  absl::Status s = recv->Wait(kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("sent 400 bytes"), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("takes 40"), absl::string_view::npos) << s;
  // The next message on the same connection is intact.
  auto next = comms[1]->Recv(Buffer::Host(ok_in.data(), 4), 0, 2);
  ASSERT_TRUE(comms[0]->Send(Buffer::Host(ok_out.data(), 4), 1, 2)->Wait(kWait).ok());
  ASSERT_TRUE(next->Wait(kWait).ok());
  EXPECT_EQ(ok_in[3], 2.0f);
}

// Large sends that do not fit the socket, each finished by the thread that
// waits for it, while the receiver posts and reads one message at a time
// with pauses between.
TEST(GlooRingTest, LargeSendsFinishWhileThePeerReadsSlowly) {
  InMemoryStore store;
  auto comms = Group(store, "slow", 2);
  constexpr int kMessages = 6;
  const int64_t bytes = int64_t{8} << 20;
  std::vector<std::vector<uint8_t>> out(kMessages, std::vector<uint8_t>(bytes));
  std::vector<std::vector<uint8_t>> in(kMessages, std::vector<uint8_t>(bytes, 0));
  for (int k = 0; k < kMessages; ++k) {
    for (int64_t i = 0; i < bytes; i += 4093) out[k][i] = Pattern(k, i);
    out[k][bytes - 1] = static_cast<uint8_t>(k + 1);
  }
  OnEachRank(2, [&](int r) {
    if (r == 0) {
      std::vector<std::shared_ptr<Work>> sends;
      for (int k = 0; k < kMessages; ++k) {
        sends.push_back(comms[0]->Send(Buffer{out[k].data(), bytes, DType::kUInt8, -1}, 1, 300 + k));
      }
      for (auto& w : sends) ASSERT_TRUE(w->Wait(kWait).ok()) << w->Wait(absl::ZeroDuration());
      return;
    }
    for (int k = 0; k < kMessages; ++k) {
      absl::SleepFor(absl::Milliseconds(30));
      ASSERT_TRUE(comms[1]->Recv(Buffer{in[k].data(), bytes, DType::kUInt8, -1}, 0, 300 + k)
                      ->Wait(kWait).ok());
    }
  });
  for (int k = 0; k < kMessages; ++k) {
    for (int64_t i = 0; i < bytes; i += 4093) ASSERT_EQ(in[k][i], Pattern(k, i)) << k << " " << i;
    EXPECT_EQ(in[k][bytes - 1], k + 1);
  }
}

// The thread that waited for the first send leaves the rest queued (the
// socket is full) while the receiver drains the connection; nobody waits
// for the other sends, yet they reach the receiver.
TEST(GlooRingTest, QueuedSendsNobodyWaitsForStillGoOut) {
  InMemoryStore store;
  auto comms = Group(store, "queued", 2);
  constexpr int kMessages = 6;
  const int64_t bytes = int64_t{16} << 20;
  std::vector<std::vector<uint8_t>> out(kMessages), in(kMessages);
  std::vector<std::shared_ptr<Work>> sends;
  for (int k = 0; k < kMessages; ++k) {
    out[k].assign(bytes, static_cast<uint8_t>(10 + k));
    in[k].assign(bytes, 0);
  }
  OnEachRank(2, [&](int r) {
    if (r == 0) {
      for (int k = 0; k < kMessages; ++k) {
        sends.push_back(comms[0]->Send(Buffer{out[k].data(), bytes, DType::kUInt8, -1}, 1, k));
      }
      ASSERT_TRUE(sends[0]->Wait(kWait).ok());
      return;  // only the receiver waits from here on
    }
    std::vector<std::shared_ptr<Work>> recvs;
    for (int k = 0; k < kMessages; ++k) {
      recvs.push_back(comms[1]->Recv(Buffer{in[k].data(), bytes, DType::kUInt8, -1}, 0, k));
    }
    for (int k = 0; k < kMessages; ++k) {
      ASSERT_TRUE(recvs[k]->Wait(kWait).ok()) << k;
      EXPECT_EQ(in[k][0], 10 + k);
      EXPECT_EQ(in[k][bytes - 1], 10 + k);
    }
  });
  for (auto& w : sends) EXPECT_TRUE(w->Wait(kWait).ok());
}

// A stream with 4 receives posted ahead (each next one posted after the
// oldest completes), message sizes from 3 B to 70 KB mixed: frames arrive
// both for posted receives and before theirs is posted, several small
// frames share one read, and each waiter stops at its own frame's end.
TEST(GlooRingTest, AWindowedStreamOfMixedSizesArrivesIntact) {
  InMemoryStore store;
  auto comms = Group(store, "window", 2);
  constexpr int kMessages = 400, kWindow = 4;
  const int64_t sizes[] = {17, 5000, 70001, 3, 4080, 4096, 65536, 1};
  auto size_of = [&](int k) { return sizes[k % 8]; };
  OnEachRank(2, [&](int r) {
    std::vector<std::vector<uint8_t>> bufs(kMessages);
    for (int k = 0; k < kMessages; ++k) {
      bufs[k].assign(size_of(k), 0);
      if (r == 0) {
        for (int64_t i = 0; i < size_of(k); ++i) bufs[k][i] = Pattern(k, i);
      }
    }
    std::vector<std::shared_ptr<Work>> inflight;
    for (int k = 0; k < kMessages; ++k) {
      if (inflight.size() == kWindow) {
        ASSERT_TRUE(inflight.front()->Wait(kWait).ok()) << inflight.front()->Wait(absl::ZeroDuration());
        inflight.erase(inflight.begin());
      }
      Buffer b{bufs[k].data(), size_of(k), DType::kUInt8, -1};
      inflight.push_back(r == 0 ? comms[0]->Send(b, 1, 7000 + k) : comms[1]->Recv(b, 0, 7000 + k));
    }
    for (auto& w : inflight) ASSERT_TRUE(w->Wait(kWait).ok());
    if (r == 1) {
      for (int k = 0; k < kMessages; ++k) {
        for (int64_t i = 0; i < size_of(k); ++i) {
          ASSERT_EQ(bufs[k][i], Pattern(k, i)) << "message " << k << " byte " << i;
        }
      }
    }
  });
}

class GlooCollectivesTest : public TestWithParam<int> {};

TEST_P(GlooCollectivesTest, MatchASequentialReference) {
  const int n = GetParam();
  InMemoryStore store;
  auto comms = Group(store, absl::StrCat("coll", n), n);
  const int64_t count = 1000 + 3 * n + 1;  // not a multiple of n
  auto value = [](int rank, int64_t i) { return static_cast<float>((rank + 1) * 1000 + i % 97); };
  auto big = [](int rank, int64_t i) { return (int64_t{1} << 40) * (rank + 1) + i; };
  // Sequential references.
  std::vector<float> sum(count, 0);
  std::vector<int64_t> sum64(count, 0);
  for (int r = 0; r < n; ++r) {
    for (int64_t i = 0; i < count; ++i) {
      sum[i] += value(r, i);
      sum64[i] += big(r, i);
    }
  }
  OnEachRank(n, [&](int r) {
    Communicator& c = *comms[r];
    std::vector<float> x(count);
    for (int64_t i = 0; i < count; ++i) x[i] = value(r, i);
    ASSERT_TRUE(c.AllReduceSum(Buffer::Host(x.data(), count))->Wait(kWait).ok());
    EXPECT_EQ(x, sum) << "all-reduce on rank " << r;

    std::vector<int64_t> y(count);
    for (int64_t i = 0; i < count; ++i) y[i] = big(r, i);
    ASSERT_TRUE(c.AllReduceSum(Buffer{y.data(), count, DType::kInt64, -1})->Wait(kWait).ok());
    EXPECT_EQ(y, sum64) << "int64 all-reduce on rank " << r;

    std::vector<float> mine(count), all(count * n, -1);
    for (int64_t i = 0; i < count; ++i) mine[i] = value(r, i);
    ASSERT_TRUE(c.AllGather(Buffer::Host(mine.data(), count), Buffer::Host(all.data(), count * n))
                    ->Wait(kWait).ok());
    for (int q = 0; q < n; ++q) {
      for (int64_t i = 0; i < count; i += 37) {
        ASSERT_EQ(all[q * count + i], value(q, i)) << "all-gather on rank " << r;
      }
    }

    std::vector<float> full(count * n), part(count, -1);
    for (int64_t i = 0; i < count * n; ++i) full[i] = value(r, i);
    ASSERT_TRUE(c.ReduceScatterSum(Buffer::Host(full.data(), count * n), Buffer::Host(part.data(), count))
                    ->Wait(kWait).ok());
    for (int64_t i = 0; i < count; ++i) {
      float want = 0;
      for (int q = 0; q < n; ++q) want += value(q, r * count + i);
      ASSERT_EQ(part[i], want) << "reduce-scatter on rank " << r << " element " << i;
    }
    EXPECT_EQ(full[5], value(r, 5)) << "reduce-scatter must leave its input alone";

    const int root = n - 1;
    std::vector<float> b(count, r == root ? 0.0f : -7.0f);
    if (r == root) std::iota(b.begin(), b.end(), 0.5f);
    ASSERT_TRUE(c.Broadcast(Buffer::Host(b.data(), count), root)->Wait(kWait).ok());
    EXPECT_EQ(b[0], 0.5f);
    EXPECT_EQ(b[count - 1], count - 0.5f);

    EXPECT_TRUE(c.Barrier()->Wait(kWait).ok());
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, GlooCollectivesTest, ::testing::Range(2, 9));

// collective_bytes_sent is what the rings sent: an all-reduce of S bytes
// 2(n-1)/n S (chunks of an S not divisible by n as they fall), reduce-scatter
// and all-gather (n-1)/n S, so ZeRO's pair moves what the all-reduce moves;
// Send/Recv are not counted.
TEST(GlooCollectivesTest, BytesSentByEachCollectiveAreTheRingVolume) {
  const int n = 4;
  InMemoryStore store;
  auto comms = Group(store, "bytes", n);
  const int64_t shard = 1024;  // floats per rank
  const int64_t s = shard * n * 4;  // the whole buffer, in bytes
  OnEachRank(n, [&](int r) {
    Communicator& c = *comms[r];
    EXPECT_EQ(c.collective_bytes_sent(), 0);
    std::vector<float> full(shard * n, 1.0f), part(shard);
    ASSERT_TRUE(c.AllReduceSum(Buffer::Host(full.data(), shard * n))->Wait(kWait).ok());
    const int64_t after_all_reduce = c.collective_bytes_sent();
    EXPECT_EQ(after_all_reduce, 2 * (n - 1) * s / n) << "rank " << r;
    ASSERT_TRUE(c.ReduceScatterSum(Buffer::Host(full.data(), shard * n), Buffer::Host(part.data(), shard))
                    ->Wait(kWait).ok());
    ASSERT_TRUE(c.AllGather(Buffer::Host(part.data(), shard), Buffer::Host(full.data(), shard * n))
                    ->Wait(kWait).ok());
    EXPECT_EQ(c.collective_bytes_sent() - after_all_reduce, after_all_reduce)
        << "rank " << r << ": reduce-scatter + all-gather should move what the all-reduce moved";
    const int64_t before_p2p = c.collective_bytes_sent();
    float x = 1;
    const int peer = r ^ 1;
    auto send = c.Send(Buffer::Host(&x, 1), peer, 5);
    float y = 0;
    ASSERT_TRUE(c.Recv(Buffer::Host(&y, 1), peer, 5)->Wait(kWait).ok());
    ASSERT_TRUE(send->Wait(kWait).ok());
    EXPECT_EQ(c.collective_bytes_sent(), before_p2p) << "point-to-point is not a collective";
  });
}

TEST(GlooCollectivesTest, BarrierHoldsEveryRankUntilTheLastArrives) {
  InMemoryStore store;
  const int n = 3;
  auto comms = Group(store, "barrier", n);
  std::atomic<int> arrived{0};
  OnEachRank(n, [&](int r) {
    if (r == 2) absl::SleepFor(absl::Milliseconds(300));
    arrived.fetch_add(1);
    ASSERT_TRUE(comms[r]->Barrier()->Wait(kWait).ok());
    EXPECT_EQ(arrived.load(), n) << "rank " << r << " left the barrier early";
  });
}

TEST(GlooFailureTest, PeerThatNeverArrivesIsNamedWithinTheTimeout) {
  InMemoryStore store;
  const absl::Duration timeout = absl::Milliseconds(800);
  OnEachRank(2, [&](int r) {  // ranks 0 and 1 of 3; rank 2 never comes
    CommunicatorSpec spec = Spec("absent", 1, r, 3);
    spec.rendezvous_timeout = timeout;
    const absl::Time start = absl::Now();
    auto c = CreateCommunicator(store, spec);
    const absl::Duration took = absl::Now() - start;
    ASSERT_FALSE(c.ok());
    EXPECT_EQ(c.status().code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_NE(c.status().message().find("rank(s) 2 of 3 did not arrive"), absl::string_view::npos)
        << c.status();
    EXPECT_LT(took, timeout + absl::Seconds(2));
  });
}

TEST(GlooFailureTest, WaitTimeoutNamesOpAndPeerAndTheOpStaysPending) {
  InMemoryStore store;
  auto comms = Group(store, "slow", 2);
  std::vector<int32_t> in(10, 0), out(10, 42);
  auto recv = comms[0]->Recv(Buffer{in.data(), 10, DType::kInt32, -1}, 1, 5);
  absl::Status s = recv->Wait(absl::Milliseconds(100));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(s.message().find("Recv from rank 1 (tag 5"), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("waiting for rank 1"), absl::string_view::npos) << s;
  EXPECT_FALSE(recv->IsCompleted());
  ASSERT_TRUE(comms[1]->Send(Buffer{out.data(), 10, DType::kInt32, -1}, 0, 5)->Wait(kWait).ok());
  ASSERT_TRUE(recv->Wait(kWait).ok());
  EXPECT_EQ(in[9], 42);
}

TEST(GlooFailureTest, AbortFromAnotherThreadReleasesABlockedRecvAtOnce) {
  InMemoryStore store;
  auto comms = Group(store, "abort", 2);
  std::vector<float> in(1 << 16), peer_in(1 << 16);
  auto blocked = comms[0]->Recv(Buffer::Host(in.data(), in.size()), 1, 1);
  auto peer_blocked = comms[1]->Recv(Buffer::Host(peer_in.data(), peer_in.size()), 0, 2);
  absl::Time aborted_at;
  std::thread aborter([&] {
    absl::SleepFor(absl::Milliseconds(200));
    aborted_at = absl::Now();
    comms[0]->Abort("test says stop");
  });
  absl::Status s = blocked->Wait(absl::Seconds(30));
  const absl::Time released_at = absl::Now();
  aborter.join();
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_NE(s.message().find("test says stop"), absl::string_view::npos) << s;
  EXPECT_LT(released_at - aborted_at, absl::Milliseconds(500));

  // Later ops fail fast.
  const absl::Time before = absl::Now();
  auto late = comms[0]->Send(Buffer::Host(in.data(), 4), 1, 3);
  EXPECT_TRUE(late->IsCompleted());
  EXPECT_EQ(late->Wait(absl::ZeroDuration()).code(), absl::StatusCode::kAborted);
  EXPECT_EQ(comms[0]->AllReduceSum(Buffer::Host(in.data(), 4))->Wait(absl::Seconds(1)).code(),
            absl::StatusCode::kAborted);
  EXPECT_LT(absl::Now() - before, absl::Milliseconds(500));

  // The peer's pending op fails too (its connection was reset), not hangs.
  absl::Status peer = peer_blocked->Wait(absl::Seconds(10));
  EXPECT_EQ(peer.code(), absl::StatusCode::kUnavailable) << peer;
  EXPECT_NE(peer.message().find("rank 0"), absl::string_view::npos) << peer;
}

TEST(GlooFailureTest, WatchdogFailsAHungCollectiveNamingThePeerAndAbortsTheGroup) {
  InMemoryStore store;
  std::vector<std::unique_ptr<Communicator>> comms(2);
  OnEachRank(2, [&](int r) {
    CommunicatorSpec spec = Spec("hung", 1, r, 2);
    spec.op_timeout = absl::Milliseconds(300);
    auto c = CreateCommunicator(store, spec);
    ASSERT_TRUE(c.ok()) << c.status();
    comms[r] = std::move(*c);
  });
  std::vector<float> x(100, 1);
  const absl::Time start = absl::Now();
  auto w = comms[0]->AllReduceSum(Buffer::Host(x.data(), x.size()));  // rank 1 never joins
  absl::Status s = w->Wait(absl::Seconds(30));
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find("AllReduceSum"), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("waiting for rank 1"), absl::string_view::npos) << s;
  EXPECT_EQ(comms[0]->Barrier()->Wait(absl::Seconds(1)).code(), absl::StatusCode::kAborted);
}

TEST(GlooFailureTest, DestroyingACommunicatorAbortsItsPendingOps) {
  InMemoryStore store;
  auto comms = Group(store, "destroy", 2);
  std::vector<float> in(8);
  auto pending = comms[0]->Recv(Buffer::Host(in.data(), in.size()), 1, 1);
  comms[0].reset();
  EXPECT_EQ(pending->Wait(absl::Seconds(5)).code(), absl::StatusCode::kAborted);
}

TEST(GlooFailureTest, DestroyingAnIdleCommunicatorStillDeliversWhatItSent) {
  InMemoryStore store;
  auto comms = Group(store, "linger", 2);
  const int64_t bytes = 16 << 20;
  std::vector<uint8_t> out(bytes, 0xab), in(bytes, 0);
  auto recv = comms[1]->Recv(Buffer{in.data(), bytes, DType::kUInt8, -1}, 0, 1);
  {
    auto send = comms[0]->Send(Buffer{out.data(), bytes, DType::kUInt8, -1}, 1, 1);
    ASSERT_TRUE(send->Wait(kWait).ok());
  }
  comms[0].reset();  // right after the send completed locally
  ASSERT_TRUE(recv->Wait(kWait).ok()) << recv->Wait(absl::ZeroDuration());
  EXPECT_EQ(in[bytes - 1], 0xab);
  // The departed rank is noticed: the survivor's next op fails fast.
  EXPECT_FALSE(comms[1]->Send(Buffer{out.data(), 8, DType::kUInt8, -1}, 0, 2)
                   ->Wait(absl::Seconds(5)).ok());
}

TEST(GlooFailureTest, APeerThatLeavesFailsOnlyWhatNeedsIt) {
  InMemoryStore store;
  auto comms = Group(store, "leave", 3);
  std::vector<float> x(64, 1), y(64, 0);
  auto from_leaver = comms[0]->Recv(Buffer::Host(y.data(), 64), 2, 1);
  comms[2].reset();  // rank 2 leaves
  absl::Status s = from_leaver->Wait(absl::Seconds(10));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("rank 2"), absl::string_view::npos) << s;
  // Ranks 0 and 1 still talk to each other.
  auto recv = comms[1]->Recv(Buffer::Host(y.data(), 64), 0, 7);
  ASSERT_TRUE(comms[0]->Send(Buffer::Host(x.data(), 64), 1, 7)->Wait(kWait).ok());
  ASSERT_TRUE(recv->Wait(kWait).ok());
  EXPECT_EQ(y[63], 1.0f);
  // Anything that needs rank 2 fails fast and says so.
  absl::Status to_leaver = comms[0]->Send(Buffer::Host(x.data(), 64), 2, 8)->Wait(absl::Seconds(1));
  EXPECT_EQ(to_leaver.code(), absl::StatusCode::kUnavailable) << to_leaver;
  absl::Status coll = comms[0]->AllReduceSum(Buffer::Host(x.data(), 64))->Wait(absl::Seconds(1));
  EXPECT_EQ(coll.code(), absl::StatusCode::kUnavailable) << coll;
  EXPECT_NE(coll.message().find("rank 2"), absl::string_view::npos) << coll;
}

TEST(GlooFailureTest, DeviceBuffersAndBadPeersAreRejectedUpFront) {
  InMemoryStore store;
  auto comms = Group(store, "reject", 2);
  float x = 0;
  absl::Status dev = comms[0]->AllReduceSum(Buffer{&x, 1, DType::kFloat32, 0})->Wait(absl::ZeroDuration());
  EXPECT_EQ(dev.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(dev.message().find("CUDA device 0"), absl::string_view::npos) << dev;
  EXPECT_EQ(comms[0]->Send(Buffer::Host(&x, 1), 0, 1)->Wait(absl::ZeroDuration()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(comms[0]->Recv(Buffer::Host(&x, 1), 7, 1)->Wait(absl::ZeroDuration()).code(),
            absl::StatusCode::kInvalidArgument);
}

class GlooAllToAllVTest : public TestWithParam<int> {};

TEST_P(GlooAllToAllVTest, UnevenChunksIncludingZerosArriveElementForElement) {
  const int n = GetParam();
  InMemoryStore store;
  auto comms = Group(store, absl::StrCat("a2av", n), n);
  OnEachRank(n, [&](int r) {
    RunUnevenAllToAllV<int32_t>(*comms[r], kWait);
    RunUnevenAllToAllV<int64_t>(*comms[r], kWait);
    RunUnevenAllToAllV<float>(*comms[r], kWait);
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, GlooAllToAllVTest, ::testing::Range(1, 5));

TEST(GlooAllToAllVTest, MebibyteChunksOfUnevenSizesArriveIntact) {
  InMemoryStore store;
  const int n = 3;
  auto comms = Group(store, "a2av-big", n);
  auto count = [](int from, int to) -> int64_t {
    return from == to ? 1000 : (int64_t{1} << 18) + 17 * from + 5 * to;
  };
  auto value = [](int from, int to, int64_t i) {
    return static_cast<int32_t>((from * 4 + to) * 1000000 + i);
  };
  OnEachRank(n, [&](int r) {
    std::vector<int64_t> send(n), recv(n);
    std::vector<int32_t> in;
    for (int j = 0; j < n; ++j) {
      send[j] = count(r, j);
      recv[j] = count(j, r);
      for (int64_t i = 0; i < send[j]; ++i) in.push_back(value(r, j, i));
    }
    std::vector<int32_t> out(std::accumulate(recv.begin(), recv.end(), int64_t{0}), -1);
    absl::Status s = comms[r]
                         ->AllToAllV(Buffer{in.data(), static_cast<int64_t>(in.size()), DType::kInt32, -1},
                                     send, Buffer{out.data(), static_cast<int64_t>(out.size()), DType::kInt32, -1},
                                     recv)
                         ->Wait(kWait);
    ASSERT_TRUE(s.ok()) << s;
    int64_t k = 0;
    for (int j = 0; j < n; ++j) {
      for (int64_t i = 0; i < recv[j]; ++i, ++k) {
        ASSERT_EQ(out[k], value(j, r, i)) << "rank " << r << ", element " << i << " from rank " << j;
      }
    }
  });
}

// The checks are CheckAllToAllVArgs (shared; inproc_communicator_test has
// every case) plus Gloo's own: host memory only. A refused op is never
// posted, so the group goes on in step.
TEST(GlooAllToAllVTest, BadArgumentsAndDeviceBuffersAreRefusedUpFront) {
  InMemoryStore store;
  auto comms = Group(store, "a2av-bad", 2);
  std::vector<float> x(4), y(4);
  absl::Status sum = comms[0]
                         ->AllToAllV(Buffer::Host(x.data(), 4), {2, 1}, Buffer::Host(y.data(), 4), {2, 2})
                         ->Wait(absl::ZeroDuration());
  EXPECT_EQ(sum.code(), absl::StatusCode::kInvalidArgument) << sum;
  EXPECT_NE(sum.message().find("AllToAllV(4 elements out, 4 elements in): in has 4 elements, "
                               "send_counts add up to 3"),
            absl::string_view::npos)
      << sum;
  absl::Status size = comms[1]
                          ->AllToAllV(Buffer::Host(x.data(), 4), {4}, Buffer::Host(y.data(), 4), {4})
                          ->Wait(absl::ZeroDuration());
  EXPECT_EQ(size.code(), absl::StatusCode::kInvalidArgument) << size;
  EXPECT_NE(size.message().find("send_counts holds 1 value(s)"), absl::string_view::npos) << size;
  absl::Status dev = comms[0]
                         ->AllToAllV(Buffer{x.data(), 4, DType::kFloat32, 0}, {2, 2},
                                     Buffer::Host(y.data(), 4), {2, 2})
                         ->Wait(absl::ZeroDuration());
  EXPECT_EQ(dev.code(), absl::StatusCode::kInvalidArgument) << dev;
  EXPECT_NE(dev.message().find("CUDA device 0"), absl::string_view::npos) << dev;
  OnEachRank(2, [&](int r) { RunUnevenAllToAllV<float>(*comms[r], kWait); });
}

// Rank 0 sends rank 1 three elements, rank 1 expects two; rank 2 agrees
// with both. The pair that disagrees fails on both sides saying so, before
// any payload moves, and the group is aborted (it is out of step).
TEST(GlooAllToAllVTest, RanksThatDisagreeOnCountsBothFailNamingThePeer) {
  InMemoryStore store;
  const int n = 3;
  auto comms = Group(store, "a2av-disagree", n);
  const std::vector<std::vector<int64_t>> send = {{1, 3, 1}, {2, 1, 1}, {1, 1, 1}};
  const std::vector<std::vector<int64_t>> recv = {{1, 2, 1}, {2, 1, 1}, {1, 1, 1}};
  std::vector<absl::Status> status(n);
  OnEachRank(n, [&](int r) {
    std::vector<float> in(std::accumulate(send[r].begin(), send[r].end(), int64_t{0}), 1.0f);
    std::vector<float> out(std::accumulate(recv[r].begin(), recv[r].end(), int64_t{0}));
    status[r] = comms[r]
                    ->AllToAllV(Buffer::Host(in.data(), in.size()), send[r],
                                Buffer::Host(out.data(), out.size()), recv[r])
                    ->Wait(kWait);
  });
  EXPECT_EQ(status[0].code(), absl::StatusCode::kInvalidArgument) << status[0];
  EXPECT_NE(status[0].message().find("rank 1 sends 2 elements to this rank and expects 2 from it; "
                                     "this rank expects 2 (recv_counts[1]) and sends 3 "
                                     "(send_counts[1])"),
            absl::string_view::npos)
      << status[0];
  EXPECT_EQ(status[1].code(), absl::StatusCode::kInvalidArgument) << status[1];
  EXPECT_NE(status[1].message().find("rank 0 sends 3 elements to this rank and expects 2 from it"),
            absl::string_view::npos)
      << status[1];
  EXPECT_FALSE(status[2].ok()) << "rank 2 never gets the chunks of ranks 0 and 1";
  std::vector<float> x(3);
  EXPECT_EQ(comms[0]
                ->AllToAllV(Buffer::Host(x.data(), 3), {1, 1, 1}, Buffer::Host(x.data(), 3), {1, 1, 1})
                ->Wait(absl::ZeroDuration())
                .code(),
            absl::StatusCode::kAborted);
}

TEST(GlooAllToAllVTest, AbortCompletesAPendingAllToAllVWithAbortedAndItsPeersFail) {
  InMemoryStore store;
  const int n = 3;
  auto comms = Group(store, "a2av-abort", n);
  std::vector<std::vector<float>> in(n, std::vector<float>(3, 1.0f)), out(n, std::vector<float>(3));
  auto post = [&](int r) {
    return comms[r]->AllToAllV(Buffer::Host(in[r].data(), 3), {1, 1, 1},
                               Buffer::Host(out[r].data(), 3), {1, 1, 1});
  };
  auto pending0 = post(0), pending1 = post(1);  // rank 2 never posts
  EXPECT_FALSE(pending0->IsCompleted());
  absl::Status waited;
  std::thread waiter([&] { waited = pending0->Wait(kWait); });
  comms[0]->Abort("test says stop");
  waiter.join();
  EXPECT_EQ(waited.code(), absl::StatusCode::kAborted) << waited;
  EXPECT_NE(waited.message().find("test says stop"), absl::string_view::npos) << waited;
  EXPECT_NE(waited.message().find("AllToAllV"), absl::string_view::npos) << waited;
  // Rank 0's connections were reset: rank 1's op fails too rather than hang.
  absl::Status peer = pending1->Wait(kWait);
  EXPECT_EQ(peer.code(), absl::StatusCode::kUnavailable) << peer;
  // Later ops fail fast.
  auto late = post(0);
  EXPECT_TRUE(late->IsCompleted());
  EXPECT_EQ(late->Wait(absl::ZeroDuration()).code(), absl::StatusCode::kAborted);
}

TEST(GlooAllToAllVTest, WaitTimeoutNamesTheOpAndThePeerAndTheOpStaysPending) {
  InMemoryStore store;
  auto comms = Group(store, "a2av-slow", 2);
  // One element more than each op writes: it must stay as it is.
  std::vector<int64_t> in0 = {10, 11, 12}, in1 = {20, 21}, out0(3, -1), out1(4, -1);
  // Rank 0 keeps 10 and sends {11, 12}; rank 1 keeps 21 and sends {20}.
  auto w0 = comms[0]->AllToAllV(Buffer{in0.data(), 3, DType::kInt64, -1}, {1, 2},
                                Buffer{out0.data(), 2, DType::kInt64, -1}, {1, 1});
  absl::Status s = w0->Wait(absl::Milliseconds(100));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find("AllToAllV(3 elements out, 2 elements in) on rank 0"),
            absl::string_view::npos)
      << s;
  EXPECT_NE(s.message().find("waiting for rank 1"), absl::string_view::npos) << s;
  EXPECT_FALSE(w0->IsCompleted());
  auto w1 = comms[1]->AllToAllV(Buffer{in1.data(), 2, DType::kInt64, -1}, {1, 1},
                                Buffer{out1.data(), 3, DType::kInt64, -1}, {2, 1});
  ASSERT_TRUE(w0->Wait(kWait).ok());
  ASSERT_TRUE(w1->Wait(kWait).ok());
  EXPECT_EQ(out0, (std::vector<int64_t>{10, 20, -1}));
  EXPECT_EQ(out1, (std::vector<int64_t>{11, 12, 21, -1}));
}

TEST(GlooAllToAllVTest, WatchdogFailsAnAllToAllVWhosePeerNeverJoinsAndAbortsTheGroup) {
  InMemoryStore store;
  std::vector<std::unique_ptr<Communicator>> comms(2);
  OnEachRank(2, [&](int r) {
    CommunicatorSpec spec = Spec("a2av-hung", 1, r, 2);
    spec.op_timeout = absl::Milliseconds(300);
    auto c = CreateCommunicator(store, spec);
    ASSERT_TRUE(c.ok()) << c.status();
    comms[r] = std::move(*c);
  });
  std::vector<float> x(4, 1), y(4);
  auto w = comms[0]->AllToAllV(Buffer::Host(x.data(), 4), {2, 2}, Buffer::Host(y.data(), 4), {2, 2});
  absl::Status s = w->Wait(kWait);  // rank 1 never joins
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find("AllToAllV"), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("did not complete within op_timeout"), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("waiting for rank 1"), absl::string_view::npos) << s;
  EXPECT_EQ(comms[0]->Barrier()->Wait(absl::ZeroDuration()).code(), absl::StatusCode::kAborted);
}

TEST(GlooAllToAllVTest, ExchangeCountsThatTimesOutAbortsAndNamesThePeer) {
  InMemoryStore store;
  auto comms = Group(store, "a2av-counts", 2);
  absl::StatusOr<std::vector<int64_t>> counts =
      ExchangeCounts(*comms[0], {3, 4}, absl::Milliseconds(100));  // rank 1 never joins
  EXPECT_EQ(counts.status().code(), absl::StatusCode::kDeadlineExceeded) << counts.status();
  EXPECT_NE(counts.status().message().find("ExchangeCounts on rank 0 of 2"), absl::string_view::npos)
      << counts.status();
  EXPECT_NE(counts.status().message().find("AllToAllV"), absl::string_view::npos) << counts.status();
  EXPECT_NE(counts.status().message().find("waiting for rank 1"), absl::string_view::npos)
      << counts.status();
  EXPECT_EQ(comms[0]->Barrier()->Wait(absl::ZeroDuration()).code(), absl::StatusCode::kAborted);
}

TEST(GlooAllToAllVTest, APeerThatLeavesFailsThePendingAllToAllVNamingIt) {
  InMemoryStore store;
  auto comms = Group(store, "a2av-leave", 2);
  std::vector<float> x(4, 1), y(4);
  auto w = comms[1]->AllToAllV(Buffer::Host(x.data(), 4), {2, 2}, Buffer::Host(y.data(), 4), {2, 2});
  comms[0].reset();  // rank 0 leaves
  absl::Status s = w->Wait(kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("AllToAllV"), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("rank 0"), absl::string_view::npos) << s;
}

TEST(GlooGenerationTest, NewGenerationAfterAbortRendezvousesWithoutOldKeys) {
  InMemoryStore store;
  {
    auto gen1 = Group(store, "dp0", 2, /*generation=*/1);
    std::vector<float> a(16, 1), b(16, 2);
    auto w0 = gen1[0]->AllReduceSum(Buffer::Host(a.data(), 16));
    auto w1 = gen1[1]->AllReduceSum(Buffer::Host(b.data(), 16));
    ASSERT_TRUE(w0->Wait(kWait).ok());
    ASSERT_TRUE(w1->Wait(kWait).ok());
    gen1[0]->Abort("membership change");
    gen1[1]->Abort("membership change");
  }
  // Generation 2: a complete group works.
  auto gen2 = Group(store, "dp0", 2, /*generation=*/2);
  std::vector<float> a(16, 3), b(16, 4);
  auto w0 = gen2[0]->AllReduceSum(Buffer::Host(a.data(), 16));
  auto w1 = gen2[1]->AllReduceSum(Buffer::Host(b.data(), 16));
  ASSERT_TRUE(w0->Wait(kWait).ok());
  ASSERT_TRUE(w1->Wait(kWait).ok());
  EXPECT_EQ(a[0], 7.0f);
  // Generation 3 with rank 1 missing must not pick up rank 1's keys (and
  // stale addresses) of generations 1 and 2: it times out naming rank 1.
  CommunicatorSpec spec = Spec("dp0", 3, 0, 2);
  spec.rendezvous_timeout = absl::Milliseconds(300);
  auto alone = CreateCommunicator(store, spec);
  ASSERT_FALSE(alone.ok());
  EXPECT_NE(alone.status().message().find("rank(s) 1 of 2"), absl::string_view::npos)
      << alone.status();
  int gen1_keys = 0, gen2_keys = 0;
  for (const std::string& k : store.Keys()) {
    gen1_keys += k.rfind("comm/dp0/gen1/", 0) == 0;
    gen2_keys += k.rfind("comm/dp0/gen2/", 0) == 0;
  }
  EXPECT_GT(gen1_keys, 0);
  EXPECT_EQ(gen1_keys, gen2_keys) << "each generation writes its own full set of keys";
}

}  // namespace
}  // namespace baton::comm
