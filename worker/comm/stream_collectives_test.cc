// Collectives on a stream over a host communicator, on the simulated device
// (streams on threads) and the CPU (inline): the sum lands in stream order
// without a host wait, a peer that never joins fails the op with
// DEADLINE_EXCEEDED naming it (and later ops post nothing), two streams
// sharing one communicator keep the call order, and the CPU reports a failure
// at once.
#include "worker/comm/stream_collectives.h"

#include <cstring>
#include <memory>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "worker/comm/fake_stream_communicator.h"
#include "worker/comm/inproc_communicator.h"

namespace baton::comm {
namespace {

const kernels::Device kSim = kernels::Device::Sim(0);

struct SimBuffer {
  explicit SimBuffer(int64_t n) : n(n), p(*kernels::AllocateDevice(kSim, n * sizeof(float))) {}
  ~SimBuffer() { kernels::FreeDevice(kSim, p, n * sizeof(float)); }
  Buffer buf() const { return Buffer{p, n, DType::kFloat32, -1}; }
  float* data() { return static_cast<float*>(p); }
  int64_t n;
  void* p;
};

std::unique_ptr<kernels::Stream> NewStream(kernels::Device d = kSim) { return *kernels::Stream::Create(d); }

// The stream fills `b` with `value` (as a kernel would).
void Fill(kernels::Stream& s, SimBuffer& b, float value) {
  ASSERT_TRUE(s.LaunchHostFunc([&b, value] {
                 for (int64_t i = 0; i < b.n; ++i) b.data()[i] = value + static_cast<float>(i);
               }).ok());
}

// The stream copies `b` out to `out`.
void Read(kernels::Stream& s, SimBuffer& b, std::vector<float>* out) {
  out->assign(b.n, -1);
  ASSERT_TRUE(s.LaunchHostFunc([&b, out] { std::memcpy(out->data(), b.p, b.n * sizeof(float)); }).ok());
}

TEST(StreamCollectivesTest, AllReduceAllGatherAndReduceScatterRunInStreamOrderWithoutAHostWait) {
  auto group = InProcCommunicator::CreateGroup(2);
  std::unique_ptr<kernels::Stream> s[2] = {NewStream(), NewStream()};
  std::unique_ptr<SimBuffer> sum[2], in[2], all[2], whole[2], part[2];
  auto status = std::make_shared<StreamCommStatus>();
  const int64_t syncs = kernels::HostSyncCount();
  std::vector<float> got_sum[2], got_all[2], got_part[2];
  for (int r = 0; r < 2; ++r) {
    sum[r] = std::make_unique<SimBuffer>(100);
    in[r] = std::make_unique<SimBuffer>(3);
    all[r] = std::make_unique<SimBuffer>(6);
    whole[r] = std::make_unique<SimBuffer>(8);
    part[r] = std::make_unique<SimBuffer>(4);
    auto coll = StreamCollectives::For(*group[r]);
    Fill(*s[r], *sum[r], 10.0f * (r + 1));
    Fill(*s[r], *in[r], 100.0f * r);
    Fill(*s[r], *whole[r], 1000.0f * (r + 1));
    ASSERT_TRUE(coll->AllReduceSum(sum[r]->buf(), "sum", *s[r], absl::Seconds(30), status).ok());
    ASSERT_TRUE(coll->AllGather(in[r]->buf(), all[r]->buf(), "gather", *s[r], absl::Seconds(30), status).ok());
    ASSERT_TRUE(
        coll->ReduceScatterSum(whole[r]->buf(), part[r]->buf(), "scatter", *s[r], absl::Seconds(30), status).ok());
    Read(*s[r], *sum[r], &got_sum[r]);
    Read(*s[r], *all[r], &got_all[r]);
    Read(*s[r], *part[r], &got_part[r]);
  }
  EXPECT_EQ(kernels::HostSyncCount(), syncs) << "enqueueing waited on the host";
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(s[r]->Synchronize().ok());
  EXPECT_TRUE(status->status().ok()) << status->status();
  for (int r = 0; r < 2; ++r) {
    for (int64_t i = 0; i < 100; ++i) ASSERT_EQ(got_sum[r][i], 30.0f + 2.0f * i) << "rank " << r << " " << i;
    EXPECT_EQ(got_all[r], (std::vector<float>{0, 1, 2, 100, 101, 102})) << "rank " << r;
    // Element i of the sum is 3000 + 2i; rank r holds elements [4r, 4r + 4).
    for (int64_t i = 0; i < 4; ++i) ASSERT_EQ(got_part[r][i], 3000.0f + 2.0f * (4 * r + i)) << "rank " << r;
  }
}

TEST(StreamCollectivesTest, PeerThatNeverJoinsFailsWithADeadlineNamingTheOp) {
  auto group = InProcCommunicator::CreateGroup(2);
  auto s = NewStream();
  SimBuffer b(10);
  auto status = std::make_shared<StreamCommStatus>();
  auto coll = StreamCollectives::For(*group[0]);
  ASSERT_TRUE(coll->AllReduceSum(b.buf(), "the attention output", *s, absl::Milliseconds(100), status).ok());
  // A later op of the same status posts nothing.
  ASSERT_TRUE(coll->AllReduceSum(b.buf(), "the MLP output", *s, absl::Milliseconds(100), status).ok());
  ASSERT_TRUE(s->Synchronize().ok());  // returns: the op timeout bounds the stream's wait
  const absl::Status st = status->status();
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << st;
  EXPECT_NE(st.message().find("the attention output"), std::string::npos) << st;
  // Rank 1 now joins one all-reduce: it finds only rank 0's first (timed-out)
  // op or nothing, never a second one.
  std::vector<float> x(10, 1.0f);
  (void)group[1]->AllReduceSum(Buffer::Host(x.data(), 10))->Wait(absl::Milliseconds(100));
  const absl::Status second = group[1]->AllReduceSum(Buffer::Host(x.data(), 10))->Wait(absl::Milliseconds(100));
  EXPECT_EQ(second.code(), absl::StatusCode::kDeadlineExceeded) << "the op after the failure was posted";
}

// Rank 0 enqueues op A on stream a (held back 200 ms) and op B, of another
// size, on stream b; rank 1 both on one stream. Without the hand-off B would
// reach the communicator first on rank 0 and pair with A.
TEST(StreamCollectivesTest, TwoStreamsOnOneCommunicatorKeepTheCallOrder) {
  auto group = InProcCommunicator::CreateGroup(2);
  auto a0 = NewStream(), b0 = NewStream(), s1 = NewStream();
  SimBuffer x0(10), y0(20), x1(10), y1(20);
  auto status = std::make_shared<StreamCommStatus>();
  auto c0 = StreamCollectives::For(*group[0]);
  EXPECT_EQ(StreamCollectives::For(*group[0]), c0) << "one instance per communicator";
  auto c1 = StreamCollectives::For(*group[1]);
  Fill(*a0, x0, 1);
  Fill(*b0, y0, 2);
  Fill(*s1, x1, 3);
  Fill(*s1, y1, 4);
  ASSERT_TRUE(a0->LaunchHostFunc([] { absl::SleepFor(absl::Milliseconds(200)); }).ok());
  ASSERT_TRUE(c0->AllReduceSum(x0.buf(), "A", *a0, absl::Seconds(30), status).ok());
  ASSERT_TRUE(c0->AllReduceSum(y0.buf(), "B", *b0, absl::Seconds(30), status).ok());
  ASSERT_TRUE(c1->AllReduceSum(x1.buf(), "A", *s1, absl::Seconds(30), status).ok());
  ASSERT_TRUE(c1->AllReduceSum(y1.buf(), "B", *s1, absl::Seconds(30), status).ok());
  std::vector<float> got_y;
  Read(*b0, y0, &got_y);
  ASSERT_TRUE(b0->Synchronize().ok());
  ASSERT_TRUE(a0->Synchronize().ok());
  ASSERT_TRUE(s1->Synchronize().ok());
  ASSERT_TRUE(status->status().ok()) << status->status();
  for (int64_t i = 0; i < 20; ++i) ASSERT_EQ(got_y[i], 6.0f + 2.0f * i) << i;
}

// The CPU runs the op inline: a failure comes back from the call itself.
TEST(StreamCollectivesTest, OnTheCpuAFailureReturnsAtOnce) {
  auto group = InProcCommunicator::CreateGroup(2);
  auto s = NewStream(kernels::Device::Cpu());
  std::vector<float> x(4, 1.0f);
  auto status = std::make_shared<StreamCommStatus>();
  const absl::Status st = StreamCollectives::For(*group[0])->AllReduceSum(
      Buffer::Host(x.data(), 4), "the target logits", *s, absl::Milliseconds(50), status);
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << st;
  EXPECT_NE(st.message().find("the target logits"), std::string::npos) << st;
  EXPECT_EQ(status->status(), st);
}

TEST(StreamCollectivesTest, RefusesDeviceMemoryOverAHostCommunicator) {
  auto group = InProcCommunicator::CreateGroup(2);
  auto s = NewStream();
  float x = 0;
  auto status = std::make_shared<StreamCommStatus>();
  auto coll = StreamCollectives::For(*group[0]);
  const Buffer cuda{&x, 1, DType::kFloat32, 0};
  EXPECT_FALSE(coll->CanEnqueue(cuda));
  EXPECT_EQ(coll->AllReduceSum(cuda, "x", *s, absl::Seconds(1), status).code(), absl::StatusCode::kInvalidArgument);
}

// Over NCCL no host wait sees a collective's time: events around it on its
// stream do, and the host path's ops are left to the communicator's clock.
TEST(StreamCollectivesTest, OpsOnCudaStreamsAreTimedByEventsAndTheHostPathIsNot) {
  auto s = NewStream();
  FakeStreamCommunicator comm;
  comm.kernel_stream = s.get();
  comm.op_time = absl::Milliseconds(30);
  SimBuffer x(4);
  const Buffer dev{x.p, 4, DType::kFloat32, 0};
  auto status = std::make_shared<StreamCommStatus>();
  auto coll = StreamCollectives::For(comm);
  coll->TimeOpsOnStreams();
  ASSERT_TRUE(coll->AllReduceSum(dev, "the attention output", *s, absl::Seconds(1), status).ok());
  ASSERT_TRUE(coll->AllReduceSum(dev, "the MLP output", *s, absl::Seconds(1), status).ok());
  ASSERT_TRUE(s->Synchronize().ok());
  absl::StatusOr<double> seconds = coll->TakeStreamSeconds();
  ASSERT_TRUE(seconds.ok()) << seconds.status();
  EXPECT_GE(*seconds, 0.060) << "two ops of at least 30 ms each";
  // Taken: the next read starts from nothing; a forgotten op is not counted.
  EXPECT_EQ(*coll->TakeStreamSeconds(), 0.0);
  ASSERT_TRUE(coll->AllReduceSum(dev, "the MLP output", *s, absl::Seconds(1), status).ok());
  ASSERT_TRUE(s->Synchronize().ok());
  coll->ForgetStreamSeconds();
  EXPECT_EQ(*coll->TakeStreamSeconds(), 0.0);
  EXPECT_EQ(StreamCollectives::Find(comm), coll);
  EXPECT_EQ(coll->event_pairs(), 2u) << "the pairs of the first step, reused";

  // The host path: an in-process group's sum is not timed here.
  auto group = InProcCommunicator::CreateGroup(1);
  auto host = StreamCollectives::For(*group[0]);
  SimBuffer y(4);
  ASSERT_TRUE(host->AllReduceSum(y.buf(), "x", *s, absl::Seconds(1), status).ok());
  ASSERT_TRUE(s->Synchronize().ok());
  EXPECT_EQ(*host->TakeStreamSeconds(), 0.0);
  EXPECT_TRUE(status->status().ok()) << status->status();
}

// A group nobody times (the DP all-reduce, the tied-embedding sum) creates no
// event, however many steps run; a timed one holds the pairs of its busiest
// step, reused from step to step (no device object created after step 1).
TEST(StreamCollectivesTest, OnlyATimedGroupHoldsEventsAndNeverMoreThanOneStepsWorth) {
  auto s = NewStream();
  FakeStreamCommunicator comm;
  comm.kernel_stream = s.get();
  SimBuffer x(4);
  const Buffer dev{x.p, 4, DType::kFloat32, 0};
  auto status = std::make_shared<StreamCommStatus>();
  StreamCollectives untimed(comm);
  for (int step = 0; step < 50; ++step) {
    ASSERT_TRUE(untimed.AllReduceSum(dev, "dp", *s, absl::Seconds(1), status).ok());
  }
  ASSERT_TRUE(s->Synchronize().ok());
  EXPECT_EQ(untimed.event_pairs(), 0u);
  EXPECT_EQ(*untimed.TakeStreamSeconds(), 0.0);

  FakeStreamCommunicator tp_comm;
  tp_comm.kernel_stream = s.get();
  StreamCollectives timed(tp_comm);
  timed.TimeOpsOnStreams();
  for (int step = 0; step < 20; ++step) {
    for (int op = 0; op < 3; ++op) ASSERT_TRUE(timed.AllReduceSum(dev, "tp", *s, absl::Seconds(1), status).ok());
    ASSERT_TRUE(s->Synchronize().ok());
    ASSERT_TRUE(timed.TakeStreamSeconds().ok());
  }
  EXPECT_EQ(timed.event_pairs(), 3u);
  EXPECT_TRUE(status->status().ok()) << status->status();
}

}  // namespace
}  // namespace baton::comm
