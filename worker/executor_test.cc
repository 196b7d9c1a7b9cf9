// StepExecutor over real schedules (builders + lowering) on an in-process
// pipeline: data must flow stage to stage forward and back in every schedule,
// and the time accounting must add up.
#include "worker/executor.h"

#include <thread>

#include "coordinator/schedule/builders.h"
#include "coordinator/schedule/ir.h"
#include "coordinator/schedule/lowering.h"
#include "gtest/gtest.h"
#include "worker/comm/inproc_communicator.h"

namespace baton {
namespace {

constexpr int64_t kElements = 8;

// Forward adds 1 to every element (stage 0 starts from the microbatch's first
// token); backward passes 10 * (stage + 1) + mb upstream. Each stage checks
// what it receives, so a misrouted message fails the step.
class FakeStage : public StageModel {
 public:
  FakeStage(int stage, int num_stages) : stage_(stage), num_stages_(num_stages) {}
  int64_t activation_elements() const override { return kElements; }
  absl::Status Forward(int mb, const MicrobatchData& data, const kernels::Tensor& input,
                       const kernels::Tensor& output) override {
    float base = stage_ == 0 ? static_cast<float>(data.tokens.i32()[0]) : input.f32()[0];
    if (stage_ > 0 && base != static_cast<float>(mb + stage_)) {
      return absl::DataLossError("stage " + std::to_string(stage_) + " got activations of the wrong microbatch");
    }
    if (stage_ == num_stages_ - 1) {
      if (data.targets.i32()[0] != mb) return absl::DataLossError("wrong targets");
      forwards_++;
      return absl::OkStatus();
    }
    for (int i = 0; i < kElements; ++i) output.f32()[i] = base + 1;
    forwards_++;
    return absl::OkStatus();
  }
  absl::Status BackwardInput(int mb, const kernels::Tensor& grad_output, const kernels::Tensor& grad_input) override {
    if (stage_ < num_stages_ - 1 && grad_output.f32()[0] != 10.0f * (stage_ + 2) + mb) {
      return absl::DataLossError("stage " + std::to_string(stage_) + " got the wrong gradient");
    }
    if (stage_ > 0) {
      for (int i = 0; i < kElements; ++i) grad_input.f32()[i] = 10.0f * (stage_ + 1) + mb;
    }
    inputs_++;
    return absl::OkStatus();
  }
  absl::Status BackwardWeight(int) override {
    grads_[0] += 1;
    weights_++;
    return absl::OkStatus();
  }
  void ZeroGrad() override { grads_[0] = 0; }
  void DropInFlight() override {}
  kernels::Tensor Gradients() override { return kernels::Tensor::View(grads_, {1}); }
  double LocalGradSqNorm() const override { return grads_[0] * grads_[0]; }
  absl::Status SyncTiedGradients() override { return absl::OkStatus(); }
  absl::Status OptimizerStep(float) override {
    steps_++;
    return absl::OkStatus();
  }
  model::StepScore score() const override {
    return stage_ == num_stages_ - 1 ? model::StepScore{2.0 * forwards_, forwards_, forwards_} : model::StepScore{};
  }
  std::vector<NamedShard> Shards() override { return {}; }
  ChunkState CaptureState() const override { return {}; }
  absl::Status RestoreState(const ChunkState&) override { return absl::OkStatus(); }

  int stage_, num_stages_;
  int forwards_ = 0, inputs_ = 0, weights_ = 0, steps_ = 0;
  float grads_[1] = {0};
};

absl::Status FillBatch(int64_t, int mb, MicrobatchData* out) {
  out->tokens = kernels::Tensor::Zeros({1, 1}, kernels::DType::kInt32);
  out->targets = kernels::Tensor::Zeros({1, 1}, kernels::DType::kInt32);
  out->tokens.i32()[0] = mb;
  out->targets.i32()[0] = mb;
  return absl::OkStatus();
}

void RunPipeline(const std::string& kind, int p, int v, int m) {
  schedule::ScheduleSpec spec{kind, p, m, v};
  auto compute = schedule::BuildSchedule(spec);
  ASSERT_TRUE(compute.ok()) << compute.status();
  auto lowered = schedule::Lower(*compute);
  ASSERT_TRUE(lowered.ok()) << lowered.status();
  std::vector<v1::Program> programs = schedule::ToPrograms(*lowered);
  auto group = comm::InProcCommunicator::CreateGroup(p);
  const int stages = p * v;
  std::vector<std::unique_ptr<FakeStage>> models;
  for (int s = 0; s < stages; ++s) models.push_back(std::make_unique<FakeStage>(s, stages));
  std::vector<absl::Status> results(p);
  std::vector<v1::StepDone> done(p);
  std::vector<v1::StepReport> reports(p);
  std::vector<std::thread> threads;
  for (int r = 0; r < p; ++r) {
    threads.emplace_back([&, r] {
      std::map<int, StageModel*> chunks;
      for (int s = r; s < stages; s += p) chunks[s] = models[s].get();
      ExecutorOptions options;
      options.num_stages = stages;
      options.microbatches = m;
      options.tokens_per_microbatch = 1;
      options.op_timeout = absl::Seconds(20);
      options.clock_us = [] { return absl::ToUnixMicros(absl::Now()); };
      StepExecutor exec(programs[r], options, chunks, FillBatch, p > 1 ? group[r].get() : nullptr, nullptr,
                        nullptr);
      auto report = exec.RunStep(1, /*trace=*/true);
      if (!report.ok()) {
        results[r] = report.status();
        return;
      }
      reports[r] = *report;
      auto d = exec.Commit(1, 1.0f);
      results[r] = d.status();
      if (d.ok()) done[r] = *d;
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < p; ++r) ASSERT_TRUE(results[r].ok()) << kind << " rank " << r << ": " << results[r];
  for (int s = 0; s < stages; ++s) {
    EXPECT_EQ(models[s]->forwards_, m) << kind << " stage " << s;
    EXPECT_EQ(models[s]->inputs_, m);
    EXPECT_EQ(models[s]->weights_, m);
    EXPECT_EQ(models[s]->steps_, 1);
  }
  const int last_rank = (stages - 1) % p;
  EXPECT_TRUE(reports[last_rank].has_loss());
  EXPECT_DOUBLE_EQ(reports[last_rank].loss(), 2.0);
  EXPECT_EQ(reports[last_rank].predicted(), m);
  for (int r = 0; r < p; ++r) {
    const v1::StepDone& d = done[r];
    EXPECT_TRUE(d.committed());
    const double accounted = d.compute_seconds() + d.comm_p2p_seconds() + d.comm_tp_seconds() +
                             d.comm_dp_seconds() + d.bubble_seconds();
    EXPECT_NEAR(accounted, d.wall_seconds(), 1e-6) << "rank " << r;
    EXPECT_GT(d.events_size(), 0);
  }
}

TEST(StepExecutorTest, DataFlowsThroughEverySchedule) {
  RunPipeline("gpipe", 3, 1, 4);
  RunPipeline("1f1b", 4, 1, 6);
  RunPipeline("zb-h1", 3, 1, 5);
  RunPipeline("interleaved", 2, 2, 4);
  RunPipeline("1f1b", 1, 1, 3);
}

}  // namespace
}  // namespace baton
