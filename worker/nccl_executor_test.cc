// GPU test (tags gpu, multi_gpu: fails without two GPUs): the step executor's
// pipeline over NCCL between two GPUs. Every batch is one NCCL group on the
// communication stream (no host-side Send/Recv, no host function), a payload
// message is exactly the activation bytes and its post time is its own int64
// message of the same group in device memory, the data arrives bit for bit,
// and the receiver splits its wait by the sender's stamp (written on the
// sender's GPU from %globaltimer, shifted onto its coordinator clock).
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "worker/comm/communicator_factory.h"
#include "worker/comm/store.h"
#include "worker/executor_message_testing.h"

namespace baton {
namespace {

using message_testing::kElements;
using message_testing::kMicrobatches;
using message_testing::kStampBit;
using message_testing::TwoStageRun;
using message_testing::WireOp;

TEST(NcclExecutorTest, TwoGpusBatchesAreNcclGroupsWithDeviceStamps) {
  for (int gpu = 0; gpu < 2; ++gpu) {
    const absl::Status probe = kernels::ProbeDevice(kernels::Device::Cuda(gpu));
    ASSERT_TRUE(probe.ok()) << "this test needs two GPUs (bazel test --test_tag_filters=multi_gpu on such a "
                               "machine): cuda:" << gpu << ": " << probe;
  }
  comm::InMemoryStore store;
  std::unique_ptr<comm::Communicator> comms[2];
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      comm::CommunicatorSpec spec;
      spec.group = "pp";
      spec.backend = comm::Backend::kNccl;
      spec.rank = r;
      spec.size = 2;
      spec.device = r;
      spec.op_timeout = absl::Seconds(60);
      auto c = comm::CreateCommunicator(store, spec);
      ASSERT_TRUE(c.ok()) << c.status();
      comms[r] = std::move(*c);
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_TRUE(comms[0] != nullptr && comms[1] != nullptr);
  const kernels::Device devices[2] = {kernels::Device::Cuda(0), kernels::Device::Cuda(1)};
  comm::Communicator* const pipeline[2] = {comms[0].get(), comms[1].get()};

  constexpr int64_t kFar = 3'600'000'000;  // an hour
  const int64_t sender_ahead[2] = {kFar, 0}, sender_behind[2] = {-kFar, 0};
  for (const int64_t* offsets : {sender_ahead, sender_behind}) {
    const TwoStageRun run = message_testing::RunTwoStages(kernels::DType::kFloat32, devices, pipeline, offsets);
    for (int r = 0; r < 2; ++r) {
      std::map<uint64_t, int> payloads, stamps;
      ASSERT_EQ(run.wire[r].size(), 4u * kMicrobatches) << "rank " << r;
      for (const WireOp& op : run.wire[r]) {
        EXPECT_TRUE(op.group) << "rank " << r << ": tag " << op.tag << " went through a host Send/Recv";
        const uint64_t key = (op.tag & ~kStampBit) * 2 + (op.send ? 1 : 0);
        if ((op.tag & kStampBit) == 0) {
          EXPECT_EQ(op.bytes, kElements * sizeof(float)) << "rank " << r;
          ++payloads[key];
        } else {
          EXPECT_EQ(op.bytes, sizeof(int64_t)) << "rank " << r;
          EXPECT_EQ(op.dtype, comm::DType::kInt64) << "rank " << r;
          ++stamps[key];
        }
      }
      EXPECT_EQ(payloads, stamps) << "rank " << r << ": one stamp per payload";
    }
    // Rank 1 receives rank 0's activations: with rank 0's clock an hour
    // ahead it waited for every one of them (all bubble); an hour behind,
    // never.
    int64_t waited = 0, moving = 0;
    for (const v1::TraceEvent& e : run.done[1].events()) {
      if (e.name().find("RECV") == std::string::npos) continue;
      if (e.cat() == "bubble") ++waited;
      if (e.cat() == "p2p" && e.duration_us() > 0) ++moving;
    }
    if (offsets == sender_ahead) {
      EXPECT_GT(waited, 0);
      EXPECT_EQ(moving, 0);
    } else {
      EXPECT_EQ(waited, 0);
    }
  }
}

}  // namespace
}  // namespace baton
