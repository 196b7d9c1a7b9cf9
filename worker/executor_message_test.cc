// The step executor's pipeline messages take the dtype the stage model asks
// for (StageModel::activation_dtype): a bf16 model's activations and input
// gradients travel as bf16 buffers, half the bytes of an fp32 model's, and
// arrive bit for bit.
#include <cstring>
#include <map>
#include <thread>

#include "coordinator/schedule/builders.h"
#include "coordinator/schedule/ir.h"
#include "coordinator/schedule/lowering.h"
#include "gtest/gtest.h"
#include "worker/comm/inproc_communicator.h"
#include "worker/executor.h"

namespace baton {
namespace {

constexpr int64_t kElements = 24;

// Stage 0 writes a known bit pattern into its output; stage 1 checks it and
// writes another into its input gradient, which stage 0 checks. Every
// message buffer seen is recorded.
class RecordingStage : public StageModel {
 public:
  RecordingStage(int stage, kernels::DType dtype) : stage_(stage), dtype_(dtype) {}
  int64_t activation_elements() const override { return kElements; }
  kernels::DType activation_dtype() const override { return dtype_; }
  absl::Status Forward(int mb, const MicrobatchData&, const kernels::Tensor& input,
                       const kernels::Tensor& output) override {
    if (stage_ == 0) {
      Note(output);
      Fill(output, 3 * mb + 1);
    } else {
      Note(input);
      if (!Holds(input, 3 * mb + 1)) return absl::DataLossError("activations changed in transit");
    }
    return absl::OkStatus();
  }
  absl::Status BackwardInput(int mb, const kernels::Tensor& grad_output,
                             const kernels::Tensor& grad_input) override {
    if (stage_ == 1) {
      Note(grad_input);
      Fill(grad_input, 5 * mb + 2);
    } else {
      Note(grad_output);
      if (!Holds(grad_output, 5 * mb + 2)) return absl::DataLossError("gradients changed in transit");
    }
    return absl::OkStatus();
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
  static void Fill(const kernels::Tensor& t, int seed) {
    auto* p = static_cast<unsigned char*>(t.raw());
    for (size_t i = 0; i < t.bytes(); ++i) p[i] = static_cast<unsigned char>(seed * 31 + i);
  }
  static bool Holds(const kernels::Tensor& t, int seed) {
    const auto* p = static_cast<const unsigned char*>(t.raw());
    for (size_t i = 0; i < t.bytes(); ++i) {
      if (p[i] != static_cast<unsigned char>(seed * 31 + i)) return false;
    }
    return true;
  }
  int stage_;
  kernels::DType dtype_;
  float grads_[1] = {0};
};

absl::Status FillBatch(int64_t, int, MicrobatchData* out) {
  out->tokens = kernels::Tensor::Zeros({1, 1}, kernels::DType::kInt32);
  out->targets = kernels::Tensor::Zeros({1, 1}, kernels::DType::kInt32);
  return absl::OkStatus();
}

// Runs one 1F1B step of two stages on two ranks; returns every message
// buffer's bytes as the stages saw them.
std::vector<size_t> RunTwoStages(kernels::DType dtype) {
  constexpr int kMicrobatches = 3;
  auto compute = schedule::BuildSchedule(schedule::ScheduleSpec{"1f1b", 2, kMicrobatches, 1});
  EXPECT_TRUE(compute.ok()) << compute.status();
  auto lowered = schedule::Lower(*compute);
  EXPECT_TRUE(lowered.ok()) << lowered.status();
  std::vector<v1::Program> programs = schedule::ToPrograms(*lowered);
  auto group = comm::InProcCommunicator::CreateGroup(2);
  RecordingStage stages[2] = {RecordingStage(0, dtype), RecordingStage(1, dtype)};
  absl::Status results[2];
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      ExecutorOptions options;
      options.num_stages = 2;
      options.microbatches = kMicrobatches;
      options.tokens_per_microbatch = 1;
      options.op_timeout = absl::Seconds(20);
      options.clock_us = [] { return absl::ToUnixMicros(absl::Now()); };
      StepExecutor exec(programs[r], options, {{r, &stages[r]}}, FillBatch, group[r].get(),
                        nullptr, nullptr);
      auto report = exec.RunStep(1, /*trace=*/false);
      results[r] = report.status();
      if (report.ok()) results[r] = exec.Commit(1, 1.0f).status();
    });
  }
  for (auto& t : threads) t.join();
  std::vector<size_t> bytes;
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(results[r].ok()) << "rank " << r << ": " << results[r];
    for (kernels::DType d : stages[r].dtypes_seen) EXPECT_EQ(d, dtype) << "rank " << r;
    bytes.insert(bytes.end(), stages[r].bytes_seen.begin(), stages[r].bytes_seen.end());
  }
  EXPECT_EQ(bytes.size(), 4u * kMicrobatches);  // act out, act in, grad out, grad in
  return bytes;
}

TEST(ExecutorMessageTest, Bf16ModelsExchangeBf16MessagesOfHalfTheBytes) {
  const std::vector<size_t> fp32 = RunTwoStages(kernels::DType::kFloat32);
  const std::vector<size_t> bf16 = RunTwoStages(kernels::DType::kBFloat16);
  ASSERT_EQ(fp32.size(), bf16.size());
  for (size_t i = 0; i < fp32.size(); ++i) {
    EXPECT_EQ(fp32[i], kElements * 4u);
    EXPECT_EQ(bf16[i], kElements * 2u);
  }
}

}  // namespace
}  // namespace baton
