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
#include <cstring>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "coordinator/schedule/builders.h"
#include "coordinator/schedule/ir.h"
#include "coordinator/schedule/lowering.h"
#include "gtest/gtest.h"
#include "kernels/ops.h"
#include "worker/comm/inproc_communicator.h"
#include "worker/executor.h"

namespace baton {
namespace {

constexpr int64_t kElements = 24;
constexpr int kMicrobatches = 3;
constexpr uint64_t kStampBit = uint64_t{1} << 62;

// Stage 0 writes a known bit pattern into its output; stage 1 checks it and
// writes another into its input gradient, which stage 0 checks. Every
// message buffer seen is recorded. On the simulated device the patterns go
// through kernels::Copy on the stage's stream (a test may wait on the host).
class RecordingStage : public StageModel {
 public:
  RecordingStage(int stage, kernels::DType dtype, kernels::Device device) : stage_(stage), dtype_(dtype) {
    if (!device.is_cpu()) {
      stream_ = *kernels::Stream::Create(device);
      ctx_ = kernels::ExecContext::On(stream_.get());
    }
  }
  int64_t activation_elements() const override { return kElements; }
  kernels::DType activation_dtype() const override { return dtype_; }
  const kernels::ExecContext& context() const override { return ctx_; }
  absl::Status Synchronize() override { return stream_ ? stream_->Synchronize() : absl::OkStatus(); }
  absl::Status Forward(int mb, const MicrobatchData&, const kernels::Tensor& input,
                       const kernels::Tensor& output) override {
    if (stage_ == 0) {
      Note(output);
      return Fill(output, 3 * mb + 1);
    }
    Note(input);
    return Check(input, 3 * mb + 1, "activations changed in transit");
  }
  absl::Status BackwardInput(int mb, const kernels::Tensor& grad_output,
                             const kernels::Tensor& grad_input) override {
    if (stage_ == 1) {
      Note(grad_input);
      return Fill(grad_input, 5 * mb + 2);
    }
    Note(grad_output);
    return Check(grad_output, 5 * mb + 2, "gradients changed in transit");
  }
  absl::Status BackwardWeight(int) override { return absl::OkStatus(); }
  void ZeroGrad() override {}
  void DropInFlight() override {}
  kernels::Tensor Gradients() override { return kernels::Tensor::View(grads_, {1}); }
  double LocalGradSqNorm() const override { return 0; }
  absl::Status SyncTiedGradients() override { return absl::OkStatus(); }
  absl::Status OptimizerStep(float) override { return absl::OkStatus(); }
  model::StepScore score() const override { return {}; }
  std::vector<NamedShard> Shards() override { return {}; }
  ChunkState CaptureState() const override { return {}; }
  absl::Status RestoreState(const ChunkState&) override { return absl::OkStatus(); }

  std::vector<size_t> bytes_seen;
  std::vector<kernels::DType> dtypes_seen;

 private:
  void Note(const kernels::Tensor& t) {
    bytes_seen.push_back(t.bytes());
    dtypes_seen.push_back(t.dtype());
  }
  static std::vector<unsigned char> Pattern(size_t bytes, int seed) {
    std::vector<unsigned char> p(bytes);
    for (size_t i = 0; i < bytes; ++i) p[i] = static_cast<unsigned char>(seed * 31 + i);
    return p;
  }
  // A host view of `bytes` bytes as a tensor of t's shape and dtype.
  static kernels::Tensor HostView(const kernels::Tensor& t, void* p) {
    return kernels::Tensor::View(p, t.shape(), t.dtype());
  }
  absl::Status Fill(const kernels::Tensor& t, int seed) {
    std::vector<unsigned char> p = Pattern(t.bytes(), seed);
    if (stream_ == nullptr) {
      std::memcpy(t.raw(), p.data(), p.size());
      return absl::OkStatus();
    }
    kernels::Copy(ctx_, t, HostView(t, p.data()));
    return stream_->Synchronize();  // p dies here
  }
  absl::Status Check(const kernels::Tensor& t, int seed, const char* what) {
    std::vector<unsigned char> got(t.bytes());
    if (stream_ == nullptr) {
      std::memcpy(got.data(), t.raw(), got.size());
    } else {
      kernels::Copy(ctx_, HostView(t, got.data()), t);
      if (absl::Status s = stream_->Synchronize(); !s.ok()) return s;
    }
    return got == Pattern(t.bytes(), seed) ? absl::OkStatus() : absl::DataLossError(what);
  }
  int stage_;
  kernels::DType dtype_;
  std::unique_ptr<kernels::Stream> stream_;
  kernels::ExecContext ctx_ = kernels::ExecContext::Host();
  float grads_[1] = {0};
};

// What crossed the wire: every op a rank posted, with the stamp values it sent.
struct WireOp {
  bool send;
  uint64_t tag;
  size_t bytes;
  comm::DType dtype;
  int64_t stamp = 0;  // the value of a sent stamp
};

// Forwards to another communicator and records the point-to-point ops.
class RecordingCommunicator : public comm::Communicator {
 public:
  explicit RecordingCommunicator(comm::Communicator* inner) : inner_(inner) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string backend() const override { return inner_->backend(); }
  std::shared_ptr<comm::Work> Send(comm::Buffer buf, int peer, uint64_t tag) override {
    WireOp op{true, tag, buf.bytes(), buf.dtype};
    // Read as the communicator reads it (from the batch's host function on
    // the simulated device).
    if ((tag & kStampBit) != 0 && buf.bytes() == sizeof(int64_t)) std::memcpy(&op.stamp, buf.data, sizeof(int64_t));
    Add(op);
    return inner_->Send(buf, peer, tag);
  }
  std::shared_ptr<comm::Work> Recv(comm::Buffer buf, int peer, uint64_t tag) override {
    Add(WireOp{false, tag, buf.bytes(), buf.dtype});
    return inner_->Recv(buf, peer, tag);
  }
  std::shared_ptr<comm::Work> AllReduceSum(comm::Buffer buf) override { return inner_->AllReduceSum(buf); }
  std::shared_ptr<comm::Work> AllGather(comm::Buffer in, comm::Buffer out) override {
    return inner_->AllGather(in, out);
  }
  std::shared_ptr<comm::Work> ReduceScatterSum(comm::Buffer in, comm::Buffer out) override {
    return inner_->ReduceScatterSum(in, out);
  }
  std::shared_ptr<comm::Work> Broadcast(comm::Buffer buf, int root) override { return inner_->Broadcast(buf, root); }
  std::shared_ptr<comm::Work> Barrier() override { return inner_->Barrier(); }
  void Abort(absl::string_view reason) override { inner_->Abort(reason); }

  std::vector<WireOp> ops() const {
    absl::MutexLock lock(&mu_);
    return ops_;
  }

 private:
  void Add(const WireOp& op) {
    absl::MutexLock lock(&mu_);
    ops_.push_back(op);
  }
  comm::Communicator* inner_;
  mutable absl::Mutex mu_;
  std::vector<WireOp> ops_ ABSL_GUARDED_BY(mu_);
};

absl::Status FillBatch(int64_t, int, MicrobatchData* out) {
  out->tokens = kernels::Tensor::Zeros({1, 1}, kernels::DType::kInt32);
  out->targets = kernels::Tensor::Zeros({1, 1}, kernels::DType::kInt32);
  return absl::OkStatus();
}

struct TwoStageRun {
  std::vector<size_t> bytes;       // message buffers as the stages saw them
  std::vector<WireOp> wire[2];     // per rank
  v1::StepDone done[2];
  int64_t before_us = 0, after_us = 0;  // host clock around the step
};

// One traced 1F1B step of two stages on two ranks; rank r's coordinator clock
// is the host clock plus clock_offset_us[r].
TwoStageRun RunTwoStages(kernels::DType dtype, kernels::Device device, const int64_t clock_offset_us[2]) {
  auto compute = schedule::BuildSchedule(schedule::ScheduleSpec{"1f1b", 2, kMicrobatches, 1});
  EXPECT_TRUE(compute.ok()) << compute.status();
  auto lowered = schedule::Lower(*compute);
  EXPECT_TRUE(lowered.ok()) << lowered.status();
  std::vector<v1::Program> programs = schedule::ToPrograms(*lowered);
  auto group = comm::InProcCommunicator::CreateGroup(2);
  RecordingCommunicator wire[2] = {RecordingCommunicator(group[0].get()), RecordingCommunicator(group[1].get())};
  RecordingStage stages[2] = {RecordingStage(0, dtype, device), RecordingStage(1, dtype, device)};
  absl::Status results[2];
  TwoStageRun run;
  run.before_us = absl::ToUnixMicros(absl::Now());
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      ExecutorOptions options;
      options.num_stages = 2;
      options.microbatches = kMicrobatches;
      options.tokens_per_microbatch = 1;
      options.op_timeout = absl::Seconds(20);
      const int64_t offset = clock_offset_us[r];
      options.clock_us = [offset] { return absl::ToUnixMicros(absl::Now()) + offset; };
      StepExecutor exec(programs[r], options, {{r, &stages[r]}}, FillBatch, &wire[r], nullptr, nullptr);
      auto report = exec.RunStep(1, /*trace=*/true);
      results[r] = report.status();
      if (!report.ok()) return;
      auto done = exec.Commit(1, 1.0f);
      results[r] = done.status();
      if (done.ok()) run.done[r] = *done;
    });
  }
  for (auto& t : threads) t.join();
  run.after_us = absl::ToUnixMicros(absl::Now());
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(results[r].ok()) << "rank " << r << ": " << results[r];
    for (kernels::DType d : stages[r].dtypes_seen) EXPECT_EQ(d, dtype) << "rank " << r;
    run.bytes.insert(run.bytes.end(), stages[r].bytes_seen.begin(), stages[r].bytes_seen.end());
    run.wire[r] = wire[r].ops();
  }
  EXPECT_EQ(run.bytes.size(), 4u * kMicrobatches);  // act out, act in, grad out, grad in
  return run;
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
