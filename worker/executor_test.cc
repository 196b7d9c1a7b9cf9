// StepExecutor over real schedules (builders + lowering) on an in-process
// pipeline: data must flow stage to stage forward and back in every schedule,
// and the time accounting must add up.
#include "worker/executor.h"

#include <functional>
#include <map>
#include <memory>
#include <thread>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"

#include "coordinator/schedule/builders.h"
#include "coordinator/schedule/ir.h"
#include "coordinator/schedule/lowering.h"
#include "gtest/gtest.h"
#include "worker/comm/inproc_communicator.h"
#include "worker/executor_message_testing.h"

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
    if (moe_experts > 0) CountMoe();
    if (stage_ == num_stages_ - 1) {
      if (data.targets.i32()[0] != mb) return absl::DataLossError("wrong targets");
      forwards_++;
      return absl::OkStatus();
    }
    for (int i = 0; i < kElements; ++i) output.f32()[i] = base + 1;
    forwards_++;
    return absl::OkStatus();
  }
  // Counted per forward, as GptStage's routers do (on the last stage too).
  void CountMoe() {
    for (int e = 0; e < moe_experts; ++e) {
      moe_.routed[e] += stage_ + 1 + e;
      moe_.kept[e] += stage_ + 1;
    }
    moe_.aux_loss += 0.25 * (stage_ + 1);
  }
  absl::Status BackwardInput(int mb, const kernels::Tensor& grad_output, const kernels::Tensor& grad_input) override {
    if (on_backward) on_backward(stage_, mb);
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
  void ZeroGrad() override {
    grads_[0] = 0;
    results_read_ = false;
    moe_ = MoeStats();
    moe_.routed.assign(moe_experts, 0);
    moe_.kept.assign(moe_experts, 0);
  }
  absl::Status ReadStepResults(model::StepScore* score, double* grad_sq_norm) override {
    results_read_ = true;
    return StageModel::ReadStepResults(score, grad_sq_norm);
  }
  // The losses summed over the microbatches, divided by them (GptStageModel).
  MoeStats ReadMoeStats() const override {
    ++moe_reads_;
    if (!results_read_) ++moe_reads_before_results_;
    if (moe_experts == 0) return {};
    MoeStats stats = moe_;
    stats.aux_loss /= moe_microbatches;
    return stats;
  }
  void DropInFlight() override { drops_++; }
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

  std::function<void(int stage, int mb)> on_backward;  // called as the input backward starts
  int moe_experts = 0;       // > 0: counts routing per forward (CountMoe)
  int moe_microbatches = 1;  // what ReadMoeStats divides the loss by
  MoeStats moe_;
  bool results_read_ = false;
  mutable int moe_reads_ = 0, moe_reads_before_results_ = 0;
  int stage_, num_stages_;
  int forwards_ = 0, inputs_ = 0, weights_ = 0, steps_ = 0, drops_ = 0;
  float grads_[1] = {0};
};

absl::Status FillBatch(int64_t, int mb, MicrobatchData* out) {
  out->tokens = kernels::Tensor::Zeros({1, 1}, kernels::DType::kInt32);
  out->targets = kernels::Tensor::Zeros({1, 1}, kernels::DType::kInt32);
  out->tokens.i32()[0] = mb;
  out->targets.i32()[0] = mb;
  return absl::OkStatus();
}

absl::StatusOr<schedule::Schedule> LoweredSchedule(const std::string& kind, int p, int v, int m) {
  absl::StatusOr<schedule::Schedule> compute = schedule::BuildSchedule(schedule::ScheduleSpec{kind, p, m, v});
  if (!compute.ok()) return compute.status();
  return schedule::Lower(*compute);
}

// The stages rank `r` holds under the schedule's placement (a V puts 0 and
// 2p-1 on rank 0).
std::map<int, StageModel*> ChunksOfRank(const schedule::Schedule& s,
                                        const std::vector<std::unique_ptr<FakeStage>>& models, int r) {
  std::map<int, StageModel*> chunks;
  for (int stage = 0; stage < static_cast<int>(models.size()); ++stage) {
    if (s.RankOf(stage) == r) chunks[stage] = models[stage].get();
  }
  return chunks;
}

ExecutorOptions TestOptions(int stages, int m) {
  ExecutorOptions options;
  options.num_stages = stages;
  options.microbatches = m;
  options.tokens_per_microbatch = 1;
  options.op_timeout = absl::Seconds(20);
  options.clock_us = [] { return absl::ToUnixMicros(absl::Now()); };
  return options;
}

// Runs one step of the schedule on p threads. `pipeline_of(r)` (if set)
// wraps rank r's communicator; `models_hook` sees the stages first.
void RunPipeline(const std::string& kind, int p, int v, int m,
                 const std::function<void(const schedule::Schedule&, std::vector<std::unique_ptr<FakeStage>>&,
                                          std::vector<comm::Communicator*>&)>& hook = nullptr) {
  const absl::StatusOr<schedule::Schedule> lowered = LoweredSchedule(kind, p, v, m);
  ASSERT_TRUE(lowered.ok()) << lowered.status();
  std::vector<v1::Program> programs = schedule::ToPrograms(*lowered);
  auto group = comm::InProcCommunicator::CreateGroup(p);
  std::vector<comm::Communicator*> pipeline;
  for (auto& c : group) pipeline.push_back(c.get());
  const int stages = p * v;
  std::vector<std::unique_ptr<FakeStage>> models;
  for (int s = 0; s < stages; ++s) models.push_back(std::make_unique<FakeStage>(s, stages));
  if (hook) hook(*lowered, models, pipeline);
  std::vector<absl::Status> results(p);
  std::vector<v1::StepDone> done(p);
  std::vector<v1::StepReport> reports(p);
  std::vector<std::thread> threads;
  for (int r = 0; r < p; ++r) {
    threads.emplace_back([&, r] {
      const std::map<int, StageModel*> chunks = ChunksOfRank(*lowered, models, r);
      ExecutorOptions options = TestOptions(stages, m);
      StepExecutor exec(programs[r], options, chunks, FillBatch, p > 1 ? pipeline[r] : nullptr, nullptr, nullptr);
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
  const int last_rank = lowered->RankOf(stages - 1);
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
    EXPECT_EQ(d.moe_routed_tokens_size(), 0) << "a dense model reports no experts";
    EXPECT_EQ(d.moe_kept_tokens_size(), 0);
    EXPECT_EQ(d.moe_aux_loss(), 0);
  }
}

TEST(StepExecutorTest, DataFlowsThroughEverySchedule) {
  RunPipeline("gpipe", 3, 1, 4);
  RunPipeline("1f1b", 4, 1, 6);
  RunPipeline("zb-h1", 3, 1, 5);
  RunPipeline("interleaved", 2, 2, 4);
  RunPipeline("1f1b", 1, 1, 3);
  RunPipeline("zb-v", 3, 2, 5);       // V: stages 2 and 3 meet on rank 2 without a message
  RunPipeline("dualpipe-v", 2, 2, 5);  // and overlapped pairs
  RunPipeline("zb-v", 1, 2, 3);
}

// An evaluator (ForwardOnlyProgram, forward_only) runs every microbatch's
// forward through every schedule's placement, with no backward, no gradient
// reduction and no deadlock, drops each microbatch's activations after its
// forward, and the last stage reports the loss.
void RunForwardOnly(const std::string& kind, int p, int v, int m) {
  const absl::StatusOr<schedule::Schedule> lowered = LoweredSchedule(kind, p, v, m);
  ASSERT_TRUE(lowered.ok()) << lowered.status();
  std::vector<v1::Program> programs = schedule::ToPrograms(*lowered);
  auto group = comm::InProcCommunicator::CreateGroup(p);
  const int stages = p * v;
  std::vector<std::unique_ptr<FakeStage>> models;
  for (int s = 0; s < stages; ++s) models.push_back(std::make_unique<FakeStage>(s, stages));
  std::vector<absl::StatusOr<v1::StepReport>> reports(p, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < p; ++r) {
    const v1::Program forward = ForwardOnlyProgram(programs[r]);
    int forwards = 0;
    for (const v1::Action& a : forward.actions()) {
      EXPECT_TRUE(a.kind() == v1::Action::FORWARD || a.kind() == v1::Action::SEND_F ||
                  a.kind() == v1::Action::RECV_F)
          << kind;
      EXPECT_FALSE(a.overlap_with_next()) << kind;
      forwards += a.kind() == v1::Action::FORWARD;
    }
    EXPECT_EQ(forwards, v * m) << kind << " rank " << r;
    threads.emplace_back([&, r, forward] {
      const std::map<int, StageModel*> chunks = ChunksOfRank(*lowered, models, r);
      ExecutorOptions options = TestOptions(stages, m);
      options.forward_only = true;
      StepExecutor exec(forward, options, chunks, FillBatch, p > 1 ? group[r].get() : nullptr, nullptr, nullptr);
      reports[r] = exec.RunStep(1, /*trace=*/false);
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < p; ++r) ASSERT_TRUE(reports[r].ok()) << kind << " rank " << r << ": " << reports[r].status();
  for (int s = 0; s < stages; ++s) {
    EXPECT_EQ(models[s]->forwards_, m) << kind << " stage " << s;
    EXPECT_EQ(models[s]->inputs_, 0) << kind;
    EXPECT_EQ(models[s]->weights_, 0) << kind;
    EXPECT_GE(models[s]->drops_, m) << kind << " stage " << s << ": activations kept after the forward";
  }
  const v1::StepReport& last = *reports[lowered->RankOf(stages - 1)];
  EXPECT_TRUE(last.has_loss()) << kind;
  EXPECT_DOUBLE_EQ(last.loss(), 2.0);
  EXPECT_EQ(last.predicted(), m);
}

TEST(StepExecutorTest, AForwardOnlyEvaluatorRunsEveryScheduleWithoutBackward) {
  RunForwardOnly("gpipe", 3, 1, 4);
  RunForwardOnly("1f1b", 4, 1, 6);
  RunForwardOnly("zb-h1", 3, 1, 5);
  RunForwardOnly("interleaved", 2, 2, 4);
  RunForwardOnly("1f1b", 1, 1, 3);
  RunForwardOnly("zb-v", 3, 2, 5);
  RunForwardOnly("dualpipe-v", 2, 2, 5);
}

// The forward half of an overlapped pair sends its activations before the
// backward half starts, so they move while it computes.
TEST(StepExecutorTest, AnOverlappedPairSendsItsForwardBeforeItsBackwardRuns) {
  std::vector<std::unique_ptr<message_testing::RecordingCommunicator>> recorders;
  int checked = 0;
  absl::Mutex mu;
  std::vector<std::string> missing;
  constexpr int kP = 2, kM = 5;
  RunPipeline("dualpipe-v", kP, 2, kM, [&](const schedule::Schedule& s, auto& models, auto& pipeline) {
    for (int r = 0; r < kP; ++r) {
      recorders.push_back(std::make_unique<message_testing::RecordingCommunicator>(pipeline[r]));
      pipeline[r] = recorders.back().get();
    }
    // (rank, backward stage, backward mb) -> the tag its pair's forward sends with.
    auto pairs = std::make_shared<std::map<std::tuple<int, int, int>, uint64_t>>();
    for (int r = 0; r < kP; ++r) {
      const auto& program = s.ranks[r];
      for (size_t i = 0; i + 2 < program.size(); ++i) {
        const schedule::Action& f = program[i];
        if (!f.overlap_with_next || f.stage == s.num_stages() - 1 || s.RankOf(f.stage + 1) == r) continue;
        (*pairs)[{r, program[i + 1].stage, program[i + 1].microbatch}] =
            static_cast<uint64_t>(f.stage + 1) * kM + f.microbatch;  // the executor's forward tag
      }
    }
    ASSERT_FALSE(pairs->empty());
    for (auto& model : models) {
      model->on_backward = [&, pairs](int stage, int mb) {
        const int r = s.RankOf(stage);
        auto it = pairs->find({r, stage, mb});
        if (it == pairs->end()) return;
        bool sent = false;
        for (const message_testing::WireOp& op : recorders[r]->ops()) sent |= op.send && op.tag == it->second;
        absl::MutexLock lock(&mu);
        ++checked;
        if (!sent) missing.push_back(absl::StrCat("rank ", r, " B(", stage, ",", mb, ")"));
      };
    }
  });
  EXPECT_GT(checked, 0);
  EXPECT_TRUE(missing.empty()) << "backward halves that ran before their pair's send: " << absl::StrJoin(missing, ", ");
}

// MoE: a rank's StepDone carries its chunks' routing counts summed per
// expert and their load-balancing losses summed, read once per chunk and
// step after the step's results (the chunk is idle then); a discarded step
// reports what it ran, and a dense chunk adds nothing.
TEST(StepExecutorTest, MoeCountsAreSummedOverTheRanksChunksOncePerStep) {
  constexpr int kM = 3, kExperts = 4;
  const absl::StatusOr<schedule::Schedule> lowered = LoweredSchedule("zb-v", 1, 2, kM);  // both chunks on rank 0
  ASSERT_TRUE(lowered.ok()) << lowered.status();
  std::vector<std::unique_ptr<FakeStage>> models;
  for (int s = 0; s < 2; ++s) {
    models.push_back(std::make_unique<FakeStage>(s, 2));
    models.back()->moe_experts = kExperts;
    models.back()->moe_microbatches = kM;
  }
  StepExecutor exec(schedule::ToPrograms(*lowered)[0], TestOptions(2, kM), ChunksOfRank(*lowered, models, 0),
                    FillBatch, nullptr, nullptr, nullptr);
  auto expect_counts = [&](const v1::StepDone& d, const std::string& what) {
    ASSERT_EQ(d.moe_routed_tokens_size(), kExperts) << what;
    ASSERT_EQ(d.moe_kept_tokens_size(), kExperts) << what;
    for (int e = 0; e < kExperts; ++e) {
      // Stage s routes s + 1 + e choices to expert e and keeps s + 1, per microbatch.
      EXPECT_EQ(d.moe_routed_tokens(e), kM * ((1 + e) + (2 + e))) << what << " expert " << e;
      EXPECT_EQ(d.moe_kept_tokens(e), kM * 3) << what << " expert " << e;
    }
    EXPECT_DOUBLE_EQ(d.moe_aux_loss(), 0.25 * 1 + 0.25 * 2) << what;  // each chunk's per-microbatch mean
  };
  ASSERT_TRUE(exec.RunStep(1, false).ok());
  absl::StatusOr<v1::StepDone> committed = exec.Commit(1, 1.0f);
  ASSERT_TRUE(committed.ok()) << committed.status();
  expect_counts(*committed, "committed step");
  ASSERT_TRUE(exec.RunStep(2, false).ok());
  expect_counts(exec.Discard(2), "discarded step");  // Discard zeroes the chunks first
  for (const auto& m : models) {
    EXPECT_EQ(m->moe_reads_, 2) << "stage " << m->stage_ << ": once per step";
    EXPECT_EQ(m->moe_reads_before_results_, 0) << "stage " << m->stage_ << ": read before the step's results";
  }
  // A dense chunk beside an MoE one adds nothing (and a failed step's
  // numbers never reach the next StepDone: RunStep starts from none).
  models[1]->moe_experts = 0;
  ASSERT_TRUE(exec.RunStep(3, false).ok());
  const v1::StepDone half = exec.Discard(3);
  ASSERT_EQ(half.moe_routed_tokens_size(), kExperts);
  EXPECT_EQ(half.moe_routed_tokens(0), kM * 1);
  EXPECT_DOUBLE_EQ(half.moe_aux_loss(), 0.25);
}

}  // namespace
}  // namespace baton
