// Stream-ordered p2p over a host communicator on the simulated device: a
// batch runs in its stream's order without a host wait (a post-time stamp
// written on the stream travels as its own op of the batch), a failed op is
// kept (naming it) and stops later batches, memory the communicator cannot
// carry from a stream is refused up front, and over a communicator whose ops
// run on streams the batch is one group on the stream with no host function.
#include "worker/comm/stream_p2p.h"

#include <cstring>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "absl/time/clock.h"
#include "kernels/backend.h"
#include "kernels/sim/sim_backend.h"
#include "kernels/ops.h"
#include "worker/comm/fake_stream_communicator.h"
#include "worker/comm/inproc_communicator.h"

namespace baton::comm {
namespace {

const kernels::Device kSim = kernels::Device::Sim(0);
constexpr int64_t kN = 1000;

struct SimBuffer {
  SimBuffer() : p(*kernels::AllocateDevice(kSim, kN * sizeof(float))) {}
  ~SimBuffer() { kernels::FreeDevice(kSim, p, kN * sizeof(float)); }
  float* data() { return static_cast<float*>(p); }
  void* p;
};

std::unique_ptr<kernels::Stream> NewStream() { return *kernels::Stream::Create(kSim); }

TEST(StreamP2PTest, BatchRunsInStreamOrderWithoutAHostWait) {
  auto group = InProcCommunicator::CreateGroup(2);
  auto s0 = NewStream(), s1 = NewStream();
  SimBuffer a, b;
  auto status0 = std::make_shared<StreamCommStatus>(), status1 = std::make_shared<StreamCommStatus>();
  // Rank 0: the stream writes the payload (as a kernel would), then sends it.
  ASSERT_TRUE(s0->LaunchHostFunc([&a] {
                  for (int64_t i = 0; i < kN; ++i) a.data()[i] = static_cast<float>(i) + 0.5f;
                }).ok());
  // The post time, stamped on the stream just before the batch, in device
  // memory, sent as its own op (as the executor frames a message).
  const kernels::Tensor sent_stamp = *kernels::ZerosOn(kSim, {1}, kernels::DType::kInt64);
  const kernels::Tensor got_stamp = *kernels::ZerosOn(kSim, {1}, kernels::DType::kInt64);
  const int64_t syncs = kernels::HostSyncCount();
  const int64_t before = absl::ToUnixMicros(absl::Now());
  kernels::StampTime(kernels::ExecContext::On(s0.get()), sent_stamp, 0);
  ASSERT_TRUE(EnqueueP2P(*group[0],
                         {P2POp{true, Buffer{a.p, kN, DType::kFloat32, -1}, 1, 7, "send"},
                          P2POp{true, Buffer{sent_stamp.address(), 1, DType::kInt64, -1}, 1, 7 | (1ull << 62),
                                "send (post time)"}},
                         *s0, absl::Seconds(30), status0)
                  .ok());
  // Rank 1: receives, then the stream copies the payload and stamp out.
  std::vector<float> got(kN, -1);
  const kernels::Tensor stamp_host = *kernels::PinnedHostZeros(kSim, {1}, kernels::DType::kInt64);
  ASSERT_TRUE(EnqueueP2P(*group[1],
                         {P2POp{false, Buffer{b.p, kN, DType::kFloat32, -1}, 0, 7, "recv"},
                          P2POp{false, Buffer{got_stamp.address(), 1, DType::kInt64, -1}, 0, 7 | (1ull << 62),
                                "recv (post time)"}},
                         *s1, absl::Seconds(30), status1)
                  .ok());
  ASSERT_TRUE(s1->LaunchHostFunc([&] { std::memcpy(got.data(), b.p, kN * sizeof(float)); }).ok());
  kernels::Copy(kernels::ExecContext::On(s1.get()), stamp_host, got_stamp);  // pinned: no host wait
  EXPECT_EQ(kernels::HostSyncCount(), syncs) << "enqueueing waited on the host";
  ASSERT_TRUE(s1->Synchronize().ok());
  ASSERT_TRUE(s0->Synchronize().ok());
  const int64_t after = absl::ToUnixMicros(absl::Now());
  const int64_t stamp = *static_cast<const int64_t*>(stamp_host.address());
  EXPECT_TRUE(status0->status().ok()) << status0->status();
  EXPECT_TRUE(status1->status().ok()) << status1->status();
  // The sender's stream wrote it when it got there, between these host times.
  EXPECT_GE(stamp, before);
  EXPECT_LE(stamp, after);
  for (int64_t i = 0; i < kN; ++i) ASSERT_EQ(got[i], static_cast<float>(i) + 0.5f) << i;
}

TEST(StreamP2PTest, FailedOpIsKeptNamedAndLaterBatchesPostNothing) {
  auto group = InProcCommunicator::CreateGroup(2);
  auto s1 = NewStream();
  SimBuffer b;
  auto status = std::make_shared<StreamCommStatus>();
  // Rank 0 never sends: the receive fails after the op timeout.
  ASSERT_TRUE(EnqueueP2P(*group[1],
                         {P2POp{false, Buffer{b.p, kN, DType::kFloat32, -1}, 0, 1, "RECV_F(stage 1, mb 0)"}}, *s1,
                         absl::Milliseconds(100), status)
                  .ok());
  // A later batch of the same status: its send must not be posted.
  ASSERT_TRUE(EnqueueP2P(*group[1], {P2POp{true, Buffer{b.p, kN, DType::kFloat32, -1}, 0, 2, "SEND_B"}}, *s1,
                         absl::Milliseconds(100), status)
                  .ok());
  ASSERT_TRUE(s1->Synchronize().ok());  // returns: the op timeout bounds the stream's wait
  const absl::Status s = status->status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find("RECV_F(stage 1, mb 0)"), std::string::npos) << s;
  std::vector<float> sink(kN);
  const absl::Status late = group[0]->Recv(Buffer::Host(sink.data(), kN), 1, 2)->Wait(absl::Milliseconds(100));
  EXPECT_EQ(late.code(), absl::StatusCode::kDeadlineExceeded) << "the send after the failure was posted";
  status->Reset();
  EXPECT_TRUE(status->status().ok());
}

TEST(StreamP2PTest, CudaMemoryOverAHostCommunicatorIsRefused) {
  auto group = InProcCommunicator::CreateGroup(2);
  auto s0 = NewStream();
  float x = 0;
  EXPECT_FALSE(CanEnqueueP2P(*group[0], Buffer{&x, 1, DType::kFloat32, 0}));
  EXPECT_TRUE(CanEnqueueP2P(*group[0], Buffer{&x, 1, DType::kFloat32, -1}));
  const absl::Status s = EnqueueP2P(*group[0], {P2POp{true, Buffer{&x, 1, DType::kFloat32, 0}, 1, 0, "SEND_F"}},
                                    *s0, absl::Seconds(1), std::make_shared<StreamCommStatus>());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("needs NCCL"), std::string::npos) << s;
  EXPECT_FALSE(CanEnqueueAllReduce(*group[0], Buffer{&x, 1, DType::kFloat32, 0}));
}

TEST(StreamP2PTest, OverAStreamCommunicatorTheBatchIsOneGroupOnTheStream) {
  FakeStreamCommunicator comm;
  auto s0 = NewStream();
  float payload = 0;
  int64_t stamp = 0;  // device memory as far as the communicator knows (never read)
  const int64_t ops_before = kernels::sim::SimOpsRun();
  auto status = std::make_shared<StreamCommStatus>();
  ASSERT_TRUE(EnqueueP2P(comm,
                         {P2POp{true, Buffer{&payload, 1, DType::kFloat32, 0}, 1, 7, "SEND_F"},
                          P2POp{true, Buffer{&stamp, 1, DType::kInt64, 0}, 1, 7 | (1ull << 62), "SEND_F (post time)"}},
                         *s0, absl::Seconds(1), status)
                  .ok());
  ASSERT_EQ(comm.groups.size(), 1u) << "payload and stamp must go in one group";
  ASSERT_EQ(comm.groups[0].size(), 2u);
  EXPECT_EQ(comm.groups[0][1].buf.dtype, DType::kInt64);
  EXPECT_EQ(comm.streams[0], s0->native());
  EXPECT_EQ(comm.refused, 0);
  ASSERT_TRUE(s0->Synchronize().ok());
  EXPECT_EQ(kernels::sim::SimOpsRun(), ops_before) << "a host function ran on the stream";
  EXPECT_TRUE(status->status().ok()) << status->status();
  // Host memory cannot go into such a group.
  EXPECT_FALSE(CanEnqueueP2P(comm, Buffer{&stamp, 1, DType::kInt64, -1}));
}

TEST(StreamP2PTest, AGroupStillInFlightDoesNotStopTheNextBatch) {
  FakeStreamCommunicator comm;
  comm.in_flight = true;
  auto s0 = NewStream();
  float payload = 0;
  auto status = std::make_shared<StreamCommStatus>();
  for (uint64_t tag : {7, 8}) {
    ASSERT_TRUE(EnqueueP2P(comm, {P2POp{true, Buffer{&payload, 1, DType::kFloat32, 0}, 1, tag, "SEND_F"}}, *s0,
                           absl::Seconds(1), status)
                    .ok());
  }
  // The first group was running when the second was enqueued: the second is
  // posted all the same, and nothing failed.
  EXPECT_EQ(comm.groups.size(), 2u);
  EXPECT_FALSE(status->failed());
  for (auto& work : comm.works) work->done = true;
  ASSERT_TRUE(s0->Synchronize().ok());
  EXPECT_TRUE(status->status().ok()) << status->status();
}

}  // namespace
}  // namespace baton::comm
