// Stream-ordered p2p over a host communicator on the simulated device: a
// batch runs in its stream's order without a host wait, a failed op is kept
// (naming it) and stops later batches, and memory the communicator cannot
// carry from a stream is refused up front.
#include "worker/comm/stream_p2p.h"

#include <cstring>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
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
  const int64_t syncs = kernels::HostSyncCount();
  // Rank 0: the stream writes the payload (as a kernel would), then sends it.
  ASSERT_TRUE(s0->LaunchHostFunc([&a] {
                  for (int64_t i = 0; i < kN; ++i) a.data()[i] = static_cast<float>(i) + 0.5f;
                }).ok());
  int64_t stamp = 0;
  ASSERT_TRUE(EnqueueP2P(*group[0], {P2POp{true, Buffer{a.p, kN, DType::kFloat32, -1}, 1, 7, "send"}}, *s0,
                         absl::Seconds(30), status0, [&stamp] { stamp = 42; })
                  .ok());
  // Rank 1: receives, then the stream copies the payload out.
  std::vector<float> got(kN, -1);
  ASSERT_TRUE(EnqueueP2P(*group[1], {P2POp{false, Buffer{b.p, kN, DType::kFloat32, -1}, 0, 7, "recv"}}, *s1,
                         absl::Seconds(30), status1, nullptr)
                  .ok());
  ASSERT_TRUE(s1->LaunchHostFunc([&] { std::memcpy(got.data(), b.p, kN * sizeof(float)); }).ok());
  EXPECT_EQ(kernels::HostSyncCount(), syncs) << "enqueueing waited on the host";
  ASSERT_TRUE(s1->Synchronize().ok());
  ASSERT_TRUE(s0->Synchronize().ok());
  EXPECT_TRUE(status0->status().ok()) << status0->status();
  EXPECT_TRUE(status1->status().ok()) << status1->status();
  EXPECT_EQ(stamp, 42) << "before_post did not run";
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
                         absl::Milliseconds(100), status, nullptr)
                  .ok());
  // A later batch of the same status: its send must not be posted.
  ASSERT_TRUE(EnqueueP2P(*group[1], {P2POp{true, Buffer{b.p, kN, DType::kFloat32, -1}, 0, 2, "SEND_B"}}, *s1,
                         absl::Milliseconds(100), status, nullptr)
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
                                    *s0, absl::Seconds(1), std::make_shared<StreamCommStatus>(), nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("needs NCCL"), std::string::npos) << s;
  EXPECT_FALSE(CanEnqueueAllReduce(*group[0], Buffer{&x, 1, DType::kFloat32, 0}));
}

}  // namespace
}  // namespace baton::comm
