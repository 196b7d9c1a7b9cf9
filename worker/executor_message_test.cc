// The step executor's pipeline messages on the wire, on the CPU (host path)
// and on the simulated device (stream-ordered batches):
// - a message is exactly the activations or input gradients, in the dtype the
//   stage model asks for (StageModel::activation_dtype): a bf16 model's
//   messages are half the bytes of an fp32 model's, and arrive bit for bit;
// - the sender's post time travels separately: one int64 message per payload
//   (same peer, tag | bit 62), on the coordinator clock;
// - the receiver splits its wait with it: a receive whose sender posted
//   later (by the sender's clock) is bubble, one whose sender posted earlier
//   is data moving (docs/metrics.md).
#include <map>
#include <vector>

#include "gtest/gtest.h"
#include "worker/comm/inproc_communicator.h"
#include "worker/executor_message_testing.h"

namespace baton {
namespace {

using message_testing::kElements;
using message_testing::kMicrobatches;
using message_testing::kStampBit;
using message_testing::TwoStageRun;
using message_testing::WireOp;

// RunTwoStages over an in-process group, both stages on `device`.
TwoStageRun RunTwoStages(kernels::DType dtype, kernels::Device device, const int64_t clock_offset_us[2]) {
  auto group = comm::InProcCommunicator::CreateGroup(2);
  const kernels::Device devices[2] = {device, device};
  comm::Communicator* const pipeline[2] = {group[0].get(), group[1].get()};
  return message_testing::RunTwoStages(dtype, devices, pipeline, clock_offset_us);
}

class ExecutorMessageTest : public ::testing::TestWithParam<kernels::DeviceType> {
 protected:
  kernels::Device device() const {
    return GetParam() == kernels::DeviceType::kSim ? kernels::Device::Sim(0) : kernels::Device::Cpu();
  }
};

TEST_P(ExecutorMessageTest, Bf16ModelsExchangeBf16MessagesOfHalfTheBytes) {
  const int64_t same_clock[2] = {0, 0};
  const TwoStageRun fp32 = RunTwoStages(kernels::DType::kFloat32, device(), same_clock);
  const TwoStageRun bf16 = RunTwoStages(kernels::DType::kBFloat16, device(), same_clock);
  ASSERT_EQ(fp32.bytes.size(), bf16.bytes.size());
  for (size_t i = 0; i < fp32.bytes.size(); ++i) {
    EXPECT_EQ(fp32.bytes[i], kElements * 4u);
    EXPECT_EQ(bf16.bytes[i], kElements * 2u);
  }
}

// Each payload message is exactly the activation bytes; its post time is one
// int64 message of its own to the same peer (tag | bit 62), sent right after
// it, holding the sender's post time on its coordinator clock.
TEST_P(ExecutorMessageTest, PayloadIsTheActivationsAndThePostTimeTravelsSeparately) {
  for (kernels::DType dtype : {kernels::DType::kFloat32, kernels::DType::kBFloat16}) {
    constexpr int64_t kAhead = 5'000'000;  // rank 1's coordinator clock runs 5 s ahead of its host clock
    const int64_t offsets[2] = {0, kAhead};
    const TwoStageRun run = RunTwoStages(dtype, device(), offsets);
    const size_t payload_bytes = kElements * kernels::DTypeSize(dtype);
    for (int r = 0; r < 2; ++r) {
      std::map<uint64_t, int> payloads, stamps;  // per (send, tag)
      const std::vector<WireOp>& ops = run.wire[r];
      ASSERT_EQ(ops.size(), 4u * kMicrobatches) << "rank " << r;  // mb payloads + stamps each way
      for (size_t i = 0; i < ops.size(); ++i) {
        const WireOp& op = ops[i];
        const uint64_t key = (op.tag & ~kStampBit) * 2 + (op.send ? 1 : 0);
        if ((op.tag & kStampBit) == 0) {
          EXPECT_EQ(op.bytes, payload_bytes) << "rank " << r << " tag " << op.tag;
          ++payloads[key];
          // Its stamp follows it (same direction, same tag plus the bit).
          ASSERT_LT(i + 1, ops.size());
          EXPECT_EQ(ops[i + 1].tag, op.tag | kStampBit) << "rank " << r;
          EXPECT_EQ(ops[i + 1].send, op.send) << "rank " << r;
          continue;
        }
        EXPECT_EQ(op.bytes, sizeof(int64_t)) << "rank " << r;
        EXPECT_EQ(op.dtype, comm::DType::kInt64) << "rank " << r;
        ++stamps[key];
        if (op.send) {
          // Taken when the batch was posted, on the sender's coordinator clock.
          EXPECT_GE(op.stamp, run.before_us + offsets[r]) << "rank " << r;
          EXPECT_LE(op.stamp, run.after_us + offsets[r]) << "rank " << r;
        }
      }
      EXPECT_EQ(payloads.size(), 2u * kMicrobatches) << "rank " << r;
      EXPECT_EQ(payloads, stamps) << "rank " << r << ": one stamp per payload";
    }
  }
}

// The split uses the sender's stamp: against a sender whose clock runs far
// ahead every receive waited for the peer (its batch is all bubble, no data
// moving); against one whose clock runs far behind no receive waited.
TEST_P(ExecutorMessageTest, ReceiverSplitsItsWaitByTheSendersStamp) {
  constexpr int64_t kFar = 3'600'000'000;  // an hour
  auto received_batches = [](const v1::StepDone& d, int64_t* waited, int64_t* moving) {
    *waited = *moving = 0;
    for (const v1::TraceEvent& e : d.events()) {
      if (e.name().find("RECV") == std::string::npos) continue;
      if (e.cat() == "bubble") ++*waited;
      if (e.cat() == "p2p" && e.duration_us() > 0) ++*moving;
    }
  };
  {
    const int64_t sender_ahead[2] = {kFar, 0};  // rank 0 sends rank 1's activations
    const TwoStageRun run = RunTwoStages(kernels::DType::kFloat32, device(), sender_ahead);
    int64_t waited = 0, moving = 0;
    received_batches(run.done[1], &waited, &moving);
    EXPECT_GT(waited, 0) << "rank 1 never waited for a sender that posted an hour later";
    EXPECT_EQ(moving, 0) << "rank 1 counted data moving before its sender posted";
  }
  {
    const int64_t sender_behind[2] = {-kFar, 0};
    const TwoStageRun run = RunTwoStages(kernels::DType::kFloat32, device(), sender_behind);
    int64_t waited = 0, moving = 0;
    received_batches(run.done[1], &waited, &moving);
    EXPECT_EQ(waited, 0) << "rank 1 waited for a sender that had posted an hour before";
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, ExecutorMessageTest,
                         ::testing::Values(kernels::DeviceType::kCpu, kernels::DeviceType::kSim),
                         [](const auto& info) { return info.param == kernels::DeviceType::kSim ? "Sim" : "Cpu"; });

}  // namespace
}  // namespace baton
