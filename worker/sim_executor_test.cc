// The step executor driving real GPT chunks (GptStageModel) on the simulated
// device gives the CPU's bits: per step the last stage's loss, hits and the
// grad norm, and after three committed steps every parameter — for 1F1B,
// ZB-H1 and interleaved pipelines of two ranks in one process (threads,
// in-process communicators), and for one rank. Message buffers, stage arenas
// and parameters make no device allocation after the first step.
//
// The worker's other paths that read device memory run here too, through the
// functions baton-worker calls (worker_job.cc): the final weights file
// (StageModel::HostShards + checkpoint::WriteShardFile), the checkpoint
// writer (checkpoint::AsyncWriter), the buddy snapshot (EncodeChunkState of
// CaptureState) and a restore from it (RestoreState) followed by more steps.
// The simulated device aborts on any host access to its memory, so each path
// either copies through the stream or crashes the test.
//
// Host synchronisations (kernels::HostSyncCount, exported by the worker as
// baton_host_syncs_total): a one-rank step (RunStep + Commit) waits for the
// device at most twice (reading the step's results, and the end of the
// optimizer, whose device time counts in the step). With pp > 1 the pipeline's
// sends and receives run on a communication stream, ordered by events (the
// in-process communicator's ops as host functions on the simulated stream),
// so a send waits for nothing on the host, and the tied-embedding gradient
// sum runs on the chunk's stream the same way (GptStageModel): a step waits
// once per chunk (its results) and once per rank (the optimizer's end of
// all its chunks), i.e. twice per rank at 1F1B/ZB-H1 pp=2. A peer that never sends fails the step with
// DEADLINE_EXCEEDED naming the op.
#include <algorithm>
#include <filesystem>
#include <functional>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "coordinator/schedule/builders.h"
#include "coordinator/schedule/lowering.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/sim/sim_backend.h"
#include "worker/checkpoint/async_writer.h"
#include "worker/checkpoint/checkpoint.h"
#include "worker/checkpoint/train_state.h"
#include "worker/comm/inproc_communicator.h"
#include "worker/comm/timed_communicator.h"
#include "worker/executor.h"
#include "worker/gpt_stage_model.h"
#include "worker/model/parameters.h"

namespace baton {
namespace {

constexpr int kMicrobatches = 4;
constexpr int kBatch = 2;
constexpr int kSteps = 3;

model::GptConfig Model() {
  model::GptConfig c;
  c.layers = 4;
  c.d_model = 16;
  c.heads = 2;
  c.vocab = 24;
  c.seq_len = 8;
  return c;
}

absl::Status FillBatch(int64_t step, int mb, MicrobatchData* out) {
  std::mt19937 rng(static_cast<uint32_t>(step * 1000 + mb));
  std::uniform_int_distribution<int> dist(0, Model().vocab - 1);
  out->tokens = kernels::Tensor::Zeros({kBatch, Model().seq_len}, kernels::DType::kInt32);
  out->targets = kernels::Tensor::Zeros({kBatch, Model().seq_len}, kernels::DType::kInt32);
  for (int64_t i = 0; i < out->tokens.numel(); ++i) {
    out->tokens.i32()[i] = dist(rng);
    out->targets.i32()[i] = i % 5 == 4 ? -1 : dist(rng);
  }
  return absl::OkStatus();
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct StepResult {
  double loss = 0, sq_norm = 0;
  int64_t correct = 0;
  int64_t host_syncs = 0;  // during RunStep + Commit, all ranks
  std::vector<v1::StepDone> done;  // per rank
};

// `ranks` pipeline ranks of one schedule, each an executor over its chunks,
// on `device`, driven by one thread per rank.
class Pipeline {
 public:
  // `edit` may change each rank's program; `op_timeout` bounds every
  // pipeline op.
  Pipeline(const std::string& kind, int ranks, int v, kernels::Device device,
           std::function<void(int rank, v1::Program*)> edit = nullptr,
           absl::Duration op_timeout = absl::Seconds(60))
      : ranks_(ranks), stages_(ranks * v), device_(device) {
    schedule::ScheduleSpec spec{kind, ranks, kMicrobatches, v};
    auto compute = schedule::BuildSchedule(spec);
    EXPECT_TRUE(compute.ok()) << compute.status();
    auto lowered = compute.ok() ? schedule::Lower(*compute) : compute.status();
    EXPECT_TRUE(lowered.ok()) << lowered.status();
    if (!lowered.ok()) return;
    programs_ = schedule::ToPrograms(*lowered);
    if (edit) {
      for (int r = 0; r < ranks; ++r) edit(r, &programs_[r]);
    }
    if (ranks > 1) pipeline_ = comm::InProcCommunicator::CreateGroup(ranks);
    // A V holds both ends of the tied embedding on rank 0: summed locally.
    const bool local_tie = lowered->RankOf(0) == lowered->RankOf(stages_ - 1);
    last_rank_ = lowered->RankOf(stages_ - 1);  // it reports the loss
    if (stages_ > 1 && !local_tie) tie_ = comm::InProcCommunicator::CreateGroup(2);
    auto ranges = model::SplitLayers(Model().layers, stages_);
    EXPECT_TRUE(ranges.ok());
    for (int c = 0; c < stages_; ++c) {
      auto config = model::MakeChunkConfig(Model(), c, stages_, (*ranges)[c], 0, 1, 11);
      EXPECT_TRUE(config.ok()) << config.status();
      config->microbatches = kMicrobatches;
      config->device = device;
      config->comm_timeout = op_timeout;  // the tied-embedding sum
      comm::Communicator* t = stages_ == 1 || local_tie ? nullptr
                              : c == 0                  ? tie_[0].get()
                              : c == stages_ - 1        ? tie_[1].get()
                                                        : nullptr;
      kernels::AdamWConfig adamw;
      adamw.lr = 1e-2f;
      adamw.weight_decay = 0.1f;
      auto chunk = GptStageModel::Create(*config, kBatch, nullptr, t, adamw);
      EXPECT_TRUE(chunk.ok()) << chunk.status();
      if (!chunk.ok()) return;
      chunks_.push_back(std::move(*chunk));
    }
    if (stages_ > 1 && local_tie) {
      EXPECT_TRUE(GptStageModel::TieLocally(*chunks_.front(), *chunks_.back()).ok());
    }
    for (int r = 0; r < ranks; ++r) {
      std::map<int, StageModel*> mine;  // the schedule's placement
      for (int s = 0; s < stages_; ++s) {
        if (lowered->RankOf(s) == r) mine[s] = chunks_[s].get();
      }
      ExecutorOptions options;
      options.num_stages = stages_;
      options.microbatches = kMicrobatches;
      options.tokens_per_microbatch = kBatch * Model().seq_len;
      options.op_timeout = op_timeout;
      options.clock_us = [] { return absl::ToUnixMicros(absl::Now()); };
      executors_.push_back(std::make_unique<StepExecutor>(programs_[r], options, mine, FillBatch,
                                                          ranks > 1 ? pipeline_[r].get() : nullptr, nullptr,
                                                          nullptr));
    }
    ok_ = true;
  }

  bool ok() const { return ok_; }
  int stages() const { return stages_; }
  StageModel& chunk(int c) { return *chunks_[c]; }

  // Batches of consecutive communication actions holding a send, over all ranks.
  int64_t SendBatches() const {
    int64_t n = 0;
    for (const v1::Program& p : programs_) {
      bool in_batch = false, sends = false;
      for (const v1::Action& a : p.actions()) {
        const bool comm = a.kind() == v1::Action::SEND_F || a.kind() == v1::Action::SEND_B ||
                          a.kind() == v1::Action::RECV_F || a.kind() == v1::Action::RECV_B;
        if (!comm && in_batch) n += sends;
        if (!comm) in_batch = sends = false;
        if (comm) {
          in_batch = true;
          sends = sends || a.kind() == v1::Action::SEND_F || a.kind() == v1::Action::SEND_B;
        }
      }
      if (in_batch) n += sends;
    }
    return n;
  }

  // RunStep on every rank at once (one thread each).
  std::vector<absl::StatusOr<v1::StepReport>> RunSteps(int64_t step) {
    std::vector<absl::StatusOr<v1::StepReport>> reports(ranks_, absl::UnknownError("not run"));
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks_; ++r) {
      threads.emplace_back([&, r] { reports[r] = executors_[r]->RunStep(step, false); });
    }
    for (auto& t : threads) t.join();
    return reports;
  }

  StepExecutor& executor(int rank) { return *executors_[rank]; }

  StepResult Step(int64_t step) {
    StepResult result;
    const int64_t syncs_before = kernels::HostSyncCount();
    std::vector<absl::StatusOr<v1::StepReport>> reports = RunSteps(step);
    const int last_rank = last_rank_;
    for (int r = 0; r < ranks_; ++r) {
      EXPECT_TRUE(reports[r].ok()) << "rank " << r << ": " << reports[r].status();
      if (!reports[r].ok()) return result;
      result.sq_norm += reports[r]->grad_sq_norm();
    }
    result.loss = reports[last_rank]->loss();
    result.correct = reports[last_rank]->correct();
    for (int r = 0; r < ranks_; ++r) {
      auto done = executors_[r]->Commit(step, 0.5f);
      EXPECT_TRUE(done.ok()) << done.status();
      if (done.ok()) result.done.push_back(*done);
    }
    result.host_syncs = kernels::HostSyncCount() - syncs_before;
    return result;
  }

  // Every parameter ("chunk/name"), through the path of the final weights file.
  std::map<std::string, std::vector<float>> Weights() {
    std::map<std::string, std::vector<float>> weights;
    for (int c = 0; c < stages_; ++c) {
      std::vector<float> storage;
      absl::StatusOr<std::vector<NamedShard>> shards = chunks_[c]->HostShards(&storage);
      EXPECT_TRUE(shards.ok()) << shards.status();
      if (!shards.ok()) return weights;
      for (const NamedShard& s : *shards) {
        EXPECT_TRUE(s.value.device().is_cpu()) << s.name;
        const float* p = s.value.f32();
        weights[absl::StrCat(c, "/", s.name)] = std::vector<float>(p, p + s.value.numel());
      }
    }
    return weights;
  }

 private:
  const int ranks_, stages_;
  int last_rank_ = 0;  // the rank holding the last stage
  const kernels::Device device_;
  bool ok_ = false;
  std::vector<v1::Program> programs_;
  std::vector<std::unique_ptr<comm::InProcCommunicator>> pipeline_, tie_;
  std::vector<std::unique_ptr<GptStageModel>> chunks_;
  std::vector<std::unique_ptr<StepExecutor>> executors_;
};

struct Result {
  std::vector<StepResult> steps;
  std::map<std::string, std::vector<float>> weights;
  int64_t allocations_after_step1 = -1, allocations_at_end = -1;
  int64_t in_use_after_step1 = -1, in_use_at_end = -1;
};

Result RunSteps(const std::string& kind, int ranks, int v, kernels::Device device) {
  Result result;
  Pipeline p(kind, ranks, v, device);
  EXPECT_TRUE(p.ok());
  if (!p.ok()) return result;
  for (int step = 1; step <= kSteps; ++step) {
    result.steps.push_back(p.Step(step));
    if (step == 1) {
      result.allocations_after_step1 = kernels::GetMemoryStats(device).system_allocations;
      result.in_use_after_step1 = kernels::GetMemoryStats(device).in_use_bytes;
    }
  }
  result.weights = p.Weights();
  result.allocations_at_end = kernels::GetMemoryStats(device).system_allocations;
  result.in_use_at_end = kernels::GetMemoryStats(device).in_use_bytes;
  return result;
}

struct Case {
  std::string kind;
  int ranks, v;
};

class SimExecutorTest : public ::testing::TestWithParam<Case> {};

TEST_P(SimExecutorTest, SameBitsAsTheCpuAndNoAllocationAfterTheFirstStep) {
  const Case c = GetParam();
  const Result cpu = RunSteps(c.kind, c.ranks, c.v, kernels::Device::Cpu());
  const Result sim = RunSteps(c.kind, c.ranks, c.v, kernels::Device::Sim(0));
  ASSERT_EQ(cpu.steps.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(sim.steps.size(), static_cast<size_t>(kSteps));
  for (int i = 0; i < kSteps; ++i) {
    EXPECT_EQ(sim.steps[i].loss, cpu.steps[i].loss) << "step " << i + 1;
    EXPECT_EQ(sim.steps[i].correct, cpu.steps[i].correct) << "step " << i + 1;
    EXPECT_EQ(sim.steps[i].sq_norm, cpu.steps[i].sq_norm) << "step " << i + 1;
  }
  EXPECT_GT(cpu.steps[0].loss, 0.0);
  EXPECT_NE(cpu.steps[2].loss, cpu.steps[0].loss);  // the optimizer moved the weights
  ASSERT_EQ(sim.weights.size(), cpu.weights.size());
  for (const auto& [name, values] : cpu.weights) {
    EXPECT_EQ(sim.weights.at(name), values) << name;
  }
  EXPECT_GT(sim.allocations_after_step1, 0);
  EXPECT_EQ(sim.allocations_at_end, sim.allocations_after_step1)
      << "device allocations after the first step";
  EXPECT_EQ(sim.in_use_at_end, sim.in_use_after_step1) << "device memory in use grew after the first step";
}

INSTANTIATE_TEST_SUITE_P(Schedules, SimExecutorTest,
                         ::testing::Values(Case{"1f1b", 1, 1}, Case{"1f1b", 2, 1}, Case{"zb-h1", 2, 1},
                                           Case{"interleaved", 2, 2}, Case{"zb-v", 2, 2}, Case{"dualpipe-v", 2, 2},
                                           Case{"zb-v", 1, 2}),
                         [](const auto& info) {
                           std::string kind = info.param.kind;
                           kind.erase(std::remove(kind.begin(), kind.end(), '-'), kind.end());
                           return kind +
                                  "_pp" + std::to_string(info.param.ranks) + "_v" +
                                  std::to_string(info.param.v);
                         });

// A one-rank step waits for the device at most twice (reading the loss and
// norm, and the optimizer's end); a pp=2 rank three times (the tied-embedding
// sum too) plus once per send batch.
// The first step is not bounded: it allocates (ZerosOn zeroes each new
// message buffer and waits).
TEST(SimExecutorHostSyncs, AtMostTwoPerStepOnOneRank) {
  Pipeline p("1f1b", 1, 1, kernels::Device::Sim(0));
  ASSERT_TRUE(p.ok());
  p.Step(1);
  for (int step = 2; step <= kSteps + 1; ++step) {
    const StepResult r = p.Step(step);
    ::testing::Test::RecordProperty(absl::StrCat("host_syncs_step_", step), static_cast<int>(r.host_syncs));
    EXPECT_GE(r.host_syncs, 1) << "step " << step << ": the loss was read without waiting for the device";
    EXPECT_LE(r.host_syncs, 2) << "step " << step;
  }
}

// At pp = 2 nothing in the step but reading its results and the optimizer's
// end waits on the host: one wait per rank for each, whatever the number of
// chunks it holds, so two per rank (the host-side p2p of before waited once
// per send batch and once for the tied sum: 1F1B pp=2 with 4 microbatches
// took 14 waits over its two ranks, not 4; reading the results once per
// chunk took 3 per rank at v = 2).
class SimExecutorPipelineHostSyncs : public ::testing::TestWithParam<Case> {};

TEST_P(SimExecutorPipelineHostSyncs, NoWaitForSendsOrReceives) {
  const Case c = GetParam();
  Pipeline p(c.kind, c.ranks, c.v, kernels::Device::Sim(0));
  ASSERT_TRUE(p.ok());
  const int64_t sends = p.SendBatches();
  EXPECT_GT(sends, 0);
  // Per rank one wait for all its chunks' results and one for their
  // optimizer ends.
  const int64_t bound = 2 * c.ranks;
  p.Step(1);
  for (int step = 2; step <= kSteps + 1; ++step) {
    const StepResult r = p.Step(step);
    ::testing::Test::RecordProperty(absl::StrCat("host_syncs_step_", step), static_cast<int>(r.host_syncs));
    EXPECT_LE(r.host_syncs, bound) << "step " << step << " (" << sends << " send batches on " << c.ranks
                                   << " ranks)";
  }
}

INSTANTIATE_TEST_SUITE_P(Schedules, SimExecutorPipelineHostSyncs,
                         ::testing::Values(Case{"1f1b", 2, 1}, Case{"zb-h1", 2, 1}, Case{"interleaved", 2, 2}),
                         [](const auto& info) {
                           return (info.param.kind == "zb-h1" ? std::string("zbh1") : info.param.kind) +
                                  "_pp" + std::to_string(info.param.ranks) + "_v" +
                                  std::to_string(info.param.v);
                         });

// A peer that never sends: rank 0's program loses its SEND_F of microbatch 0.
// Rank 1's receive of it fails its step with DEADLINE_EXCEEDED naming the op
// after the op timeout, rank 0's step fails too (rank 1 posts nothing after
// its failure, so rank 0's next op with it times out), nothing hangs, and the
// executors stay usable: the ranks discard the step and are destroyed with
// their communication streams idle.
TEST(SimExecutorStreamComm, PeerThatNeverSendsFailsTheStepWithADeadline) {
  auto drop_first_send = [](int rank, v1::Program* program) {
    if (rank != 0) return;
    auto* actions = program->mutable_actions();
    for (int i = 0; i < actions->size(); ++i) {
      if (actions->Get(i).kind() == v1::Action::SEND_F && actions->Get(i).microbatch() == 0) {
        actions->DeleteSubrange(i, 1);
        return;
      }
    }
    ADD_FAILURE() << "rank 0 has no SEND_F of microbatch 0";
  };
  Pipeline p("1f1b", 2, 1, kernels::Device::Sim(0), drop_first_send, absl::Milliseconds(300));
  ASSERT_TRUE(p.ok());
  const absl::Time start = absl::Now();
  const std::vector<absl::StatusOr<v1::StepReport>> reports = p.RunSteps(1);
  ::testing::Test::RecordProperty("failed_after_ms", static_cast<int>(absl::ToInt64Milliseconds(absl::Now() - start)));
  ASSERT_FALSE(reports[1].ok());
  EXPECT_EQ(reports[1].status().code(), absl::StatusCode::kDeadlineExceeded) << reports[1].status();
  EXPECT_NE(reports[1].status().message().find("RECV_F(stage 1, mb 0) with pipeline rank 0"), std::string::npos)
      << reports[1].status();
  ASSERT_FALSE(reports[0].ok());
  EXPECT_EQ(reports[0].status().code(), absl::StatusCode::kDeadlineExceeded) << reports[0].status();
  for (int r = 0; r < 2; ++r) p.executor(r).Discard(1);
}

// The tied-embedding sum on the stream: when the other end never sums, the
// chunk's next host wait (reading the step's results) fails with
// DEADLINE_EXCEEDED naming the sum, after the op timeout, without a hang;
// SyncTiedGradients itself returned at once (no host wait).
TEST(SimExecutorStreamComm, TiedSumWithoutItsPeerFailsTheResultsRead) {
  Pipeline p("1f1b", 2, 1, kernels::Device::Sim(0), nullptr, absl::Milliseconds(300));
  ASSERT_TRUE(p.ok());
  StageModel& last = p.chunk(1);
  last.ZeroGrad();
  const int64_t syncs = kernels::HostSyncCount();
  ASSERT_TRUE(last.SyncTiedGradients().ok());
  EXPECT_EQ(kernels::HostSyncCount(), syncs) << "the sum waited on the host";
  model::StepScore score;
  double sq = 0;
  const absl::Status s = last.ReadStepResults(&score, &sq);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find("all-reduce of the tied embedding gradient"), std::string::npos) << s;
  // Reported once: the next read is clean.
  EXPECT_TRUE(last.ReadStepResults(&score, &sq).ok());
}

// A step whose activations do not fit in the device's memory fails with
// RESOURCE_EXHAUSTED naming the action and what to lower (the worker reports
// it to the coordinator as the step's error and code) instead of aborting
// the worker. GPipe runs every forward first, so microbatches 0 and 1 are in
// flight when microbatch 2's arena cannot grow. The step fails the same way
// again after a Discard; once the memory is there, the next step (with no
// Discard after the failed one) gives the bits of a pipeline that never failed.
TEST(SimExecutorOutOfMemory, AStepThatDoesNotFitFailsAndALaterStepRuns) {
  const kernels::Device device = kernels::Device::Sim(7);  // no other test uses it
  Pipeline p("gpipe", 1, 1, device);
  Pipeline reference("gpipe", 1, 1, kernels::Device::Cpu());
  ASSERT_TRUE(p.ok());
  ASSERT_TRUE(reference.ok());
  // Two 1 MiB activation arenas fit, with room for the step's small buffers;
  // a third does not.
  kernels::sim::SetSimDeviceMemoryLimitForTesting(kernels::GetMemoryStats(device).reserved_bytes +
                                                  (int64_t{5} << 19));
  for (int64_t step : {1, 2}) {
    const std::vector<absl::StatusOr<v1::StepReport>> reports = p.RunSteps(step);
    ASSERT_FALSE(reports[0].ok()) << "step " << step;
    const absl::Status& s = reports[0].status();
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
    EXPECT_NE(s.message().find("F(stage 0, mb 2): Forward(2): sim:7 is out of memory: an activation arena"),
              std::string::npos)
        << s;
    EXPECT_NE(s.message().find("lower train.micro_batch_size"), std::string::npos) << s;
    if (step == 1) p.executor(0).Discard(step);
  }
  kernels::sim::SetSimDeviceMemoryLimitForTesting(0);
  const StepResult got = p.Step(3);
  const StepResult want = reference.Step(3);
  EXPECT_EQ(got.loss, want.loss);
  EXPECT_EQ(got.sq_norm, want.sq_norm);
  EXPECT_EQ(got.correct, want.correct);
  EXPECT_EQ(p.Weights(), reference.Weights());
}

// Step 2 of a 1F1B pp=2 pipeline on the simulated device, every op sleeping
// 200 us (after a step 1 at full speed).
StepResult SlowOneFOneBStep() {
  Pipeline p("1f1b", 2, 1, kernels::Device::Sim(0));
  EXPECT_TRUE(p.ok());
  if (!p.ok()) return {};
  p.Step(1);
  kernels::sim::SetSimOpDelay(absl::Microseconds(200));
  StepResult r = p.Step(2);
  kernels::sim::SetSimOpDelay(absl::ZeroDuration());
  return r;
}

// With stream-ordered p2p the comm/bubble split still means what
// docs/metrics.md says: each rank waits for the other's activations or
// gradients (every op sleeps 200 us), so its step has p2p time, and compute
// and p2p never add up to more than the step (comm counts only while no chunk
// of the rank computes: a send overlapping the next action is hidden).
TEST(SimExecutorTimeAccounting, PipelineCommIsExposedDataMovement) {
  const StepResult r = SlowOneFOneBStep();
  ASSERT_EQ(r.done.size(), 2u);
  for (int rank = 0; rank < 2; ++rank) {
    const v1::StepDone& d = r.done[rank];
    ::testing::Test::RecordProperty(absl::StrCat("rank", rank, "_p2p_us"), static_cast<int>(d.comm_p2p_seconds() * 1e6));
    ::testing::Test::RecordProperty(absl::StrCat("rank", rank, "_compute_us"), static_cast<int>(d.compute_seconds() * 1e6));
    ::testing::Test::RecordProperty(absl::StrCat("rank", rank, "_bubble_us"), static_cast<int>(d.bubble_seconds() * 1e6));
    ::testing::Test::RecordProperty(absl::StrCat("rank", rank, "_wall_us"), static_cast<int>(d.wall_seconds() * 1e6));
    EXPECT_GT(d.comm_p2p_seconds(), 0.0) << "rank " << rank;
    EXPECT_GT(d.compute_seconds(), 0.0) << "rank " << rank;
    EXPECT_LE(d.compute_seconds() + d.comm_p2p_seconds(), d.wall_seconds()) << "rank " << rank;
  }
}

// The last stage of a 1F1B pipeline reaches the tied embedding's sum long
// before the first stage, whose last backward ends the schedule. That wait is
// bubble (docs/metrics.md: time a rank has nothing to do), not data-parallel
// communication, so both holders of the tie show the sum's own dp time. Every
// op sleeps 200 us, which makes the first stage's last backward about 90 ops
// (~18 ms) long: counted as dp, the last stage's dp time was 18.7 ms against
// the first stage's 0.7 ms (measured before the fix); now both are ~0.7 ms.
TEST(SimExecutorTimeAccounting, TheWaitForTheTiedEmbeddingsPeerIsBubbleNotDp) {
  const StepResult r = SlowOneFOneBStep();
  ASSERT_EQ(r.done.size(), 2u);
  const v1::StepDone &first = r.done[0], &last = r.done[1];
  ::testing::Test::RecordProperty("first_dp_us", static_cast<int>(first.comm_dp_seconds() * 1e6));
  ::testing::Test::RecordProperty("last_dp_us", static_cast<int>(last.comm_dp_seconds() * 1e6));
  ::testing::Test::RecordProperty("last_bubble_us", static_cast<int>(last.bubble_seconds() * 1e6));
  // 5 ms: 25 ops of slack, a quarter of the wait.
  EXPECT_LT(last.comm_dp_seconds(), first.comm_dp_seconds() + 0.005)
      << "the last stage's wait for the first stage's last backward was counted as dp";
  EXPECT_GT(last.bubble_seconds(), 0.005);
}

// Compute time is the device's: every op on a simulated stream sleeps 200 us
// before it runs, and lazy streams run nothing until the host waits, so the
// host spends almost no time inside the actions; the step's compute seconds
// must still hold the ops' time (at least 200 us for each op run inside an
// action), and compute + comm + bubble must still be the step's wall time.
TEST(SimExecutorTimeAccounting, ComputeIsTheDevicesTimeNotTheHostsEnqueueTime) {
  Pipeline p("1f1b", 1, 1, kernels::Device::Sim(0));
  ASSERT_TRUE(p.ok());
  p.Step(1);
  constexpr absl::Duration kDelay = absl::Microseconds(200);
  kernels::sim::SetSimOpDelay(kDelay);
  const int64_t ops_before = kernels::sim::SimOpsRun();
  const StepResult r = p.Step(2);
  const int64_t ops = kernels::sim::SimOpsRun() - ops_before;
  kernels::sim::SetSimOpDelay(absl::ZeroDuration());
  ASSERT_EQ(r.done.size(), 1u);
  const v1::StepDone& d = r.done[0];
  ::testing::Test::RecordProperty("ops", static_cast<int>(ops));
  ::testing::Test::RecordProperty("compute_us", static_cast<int>(d.compute_seconds() * 1e6));
  // Outside the actions only a handful of ops run (zeroing the gradients,
  // copying the step's results out), far fewer than half.
  ASSERT_GT(ops, 100);
  EXPECT_GE(d.compute_seconds(), static_cast<double>(ops / 2) * absl::ToDoubleSeconds(kDelay))
      << ops << " ops of " << kDelay << " each";
  EXPECT_LE(d.compute_seconds(), d.wall_seconds());
  EXPECT_NEAR(d.compute_seconds() + d.comm_p2p_seconds() + d.comm_tp_seconds() + d.comm_dp_seconds() +
                  d.bubble_seconds(),
              d.wall_seconds(), 1e-9);
}

// What baton-worker writes and keeps from a device chunk (worker_job.cc:
// SaveWeights without state, SaveCheckpoint, Snapshot, Restore) is the CPU's,
// byte for byte, and a chunk restored from a snapshot trains on like the
// original.
TEST(SimWorkerPaths, WeightsCheckpointsAndSnapshotsHoldTheCpuBits) {
  const std::string tmp = ::testing::TempDir();
  std::map<std::string, std::string> files[2];            // [cpu, sim]: file name -> bytes
  std::map<int, std::string> snapshots[2];                // chunk -> EncodeChunkState bytes
  std::vector<StepResult> after_restore[2];
  const kernels::Device devices[2] = {kernels::Device::Cpu(), kernels::Device::Sim(0)};
  for (int d = 0; d < 2; ++d) {
    Pipeline p("1f1b", 2, 1, devices[d]);
    ASSERT_TRUE(p.ok());
    for (int step = 1; step <= 2; ++step) p.Step(step);
    const std::string weights_dir = absl::StrCat(tmp, "/weights_", d);
    const std::string ckpt_dir = absl::StrCat(tmp, "/ckpt_", d);
    std::filesystem::create_directories(weights_dir);
    std::filesystem::create_directories(ckpt_dir);
    std::vector<checkpoint::ChunkToSave> to_save;
    for (int c = 0; c < p.stages(); ++c) {
      std::vector<float> storage;
      absl::StatusOr<std::vector<NamedShard>> shards = p.chunk(c).HostShards(&storage);
      ASSERT_TRUE(shards.ok()) << shards.status();
      absl::StatusOr<std::string> file = checkpoint::WriteShardFile(weights_dir, c, 0, 1, *shards);
      ASSERT_TRUE(file.ok()) << file.status();
      files[d]["weights/" + *file] = ReadFile(weights_dir + "/" + *file);
      snapshots[d][c] = EncodeChunkState(p.chunk(c).CaptureState());
      to_save.push_back({c, 0, 1, &p.chunk(c), {}, {}});
    }
    checkpoint::AsyncWriter writer;
    absl::Status saved = absl::UnknownError("not called");
    std::vector<std::string> written;
    auto stall = writer.Save(ckpt_dir, 2, to_save, [&](const checkpoint::SaveResult& r) {
      saved = r.status;
      written = r.files;
    });
    ASSERT_TRUE(stall.ok()) << stall.status();
    writer.Flush();
    ASSERT_TRUE(saved.ok()) << saved;
    ASSERT_EQ(written.size(), 2u);
    for (const std::string& f : written) files[d]["ckpt/" + f] = ReadFile(ckpt_dir + "/" + f);

    // A fresh pipeline (same seed: it starts at step 0's weights) restored
    // from the step-2 snapshot runs step 3 as the original would.
    Pipeline fresh("1f1b", 2, 1, devices[d]);
    ASSERT_TRUE(fresh.ok());
    for (int c = 0; c < fresh.stages(); ++c) {
      absl::StatusOr<ChunkState> state = DecodeChunkState(snapshots[d][c]);
      ASSERT_TRUE(state.ok()) << state.status();
      ASSERT_TRUE(fresh.chunk(c).RestoreState(*state).ok());
    }
    after_restore[d].push_back(fresh.Step(3));
    after_restore[d].push_back(p.Step(3));
  }
  ASSERT_EQ(files[1].size(), files[0].size());
  ASSERT_EQ(files[0].size(), 4u);
  for (const auto& [name, bytes] : files[0]) {
    EXPECT_FALSE(bytes.empty()) << name;
    EXPECT_TRUE(files[1].at(name) == bytes) << name << " differs between the cpu and the simulated device";
  }
  for (int c = 0; c < 2; ++c) EXPECT_TRUE(snapshots[1][c] == snapshots[0][c]) << "snapshot of chunk " << c;
  for (int d = 0; d < 2; ++d) {
    EXPECT_EQ(after_restore[d][0].loss, after_restore[d][1].loss) << "restored vs original, device " << d;
    EXPECT_EQ(after_restore[d][0].sq_norm, after_restore[d][1].sq_norm) << "device " << d;
  }
  EXPECT_EQ(after_restore[1][0].loss, after_restore[0][0].loss);
}


// --- Tensor and data parallelism on streams ---
//
// pp × tp × dp ranks, each an executor over its chunks (one thread per rank),
// all on one device, with in-process communicators: per (dp, tp) rank a
// pipeline group and a tie group, per (dp, pp) rank a TP group (wrapped in a
// TimedCommunicator, as baton-worker does), per (pp, tp) rank a DP group. The
// TP collectives run on each chunk's stream and the DP all-reduce on the
// executor's data-parallel stream (host functions on the simulated device,
// inline on the CPU), so a rank's step waits on the host only for its
// results and its optimizer's end.
class Grid {
 public:
  // `zero`: the AdamW moments sharded over the DP group (ZeRO-1);
  // `sequence_parallel`: StageConfig::sequence_parallel.
  Grid(const std::string& kind, int pp, int v, int tp, int dp, kernels::Device device,
       absl::Duration op_timeout = absl::Seconds(60), bool vocab_parallel = false, bool zero = false,
       bool sequence_parallel = false)
      : pp_(pp), tp_(tp), dp_(dp), stages_(pp * v) {
    auto compute = schedule::BuildSchedule(schedule::ScheduleSpec{kind, pp, kMicrobatches, v});
    EXPECT_TRUE(compute.ok()) << compute.status();
    if (!compute.ok()) return;
    auto lowered = schedule::Lower(*compute);
    EXPECT_TRUE(lowered.ok()) << lowered.status();
    if (!lowered.ok()) return;
    const std::vector<v1::Program> programs = schedule::ToPrograms(*lowered);
    auto ranges = model::SplitLayers(Model().layers, stages_);
    EXPECT_TRUE(ranges.ok());
    if (!ranges.ok()) return;
    const int ranks = pp * tp * dp;
    pipeline_.resize(dp * tp);
    tie_.resize(dp * tp);
    tp_groups_.resize(dp * pp);
    dp_groups_.resize(pp * tp);
    for (int i = 0; i < dp * tp; ++i) {
      if (pp > 1) pipeline_[i] = comm::InProcCommunicator::CreateGroup(pp);
      if (stages_ > 1) tie_[i] = comm::InProcCommunicator::CreateGroup(2);
    }
    for (int i = 0; i < dp * pp; ++i) {
      if (tp > 1) tp_groups_[i] = comm::InProcCommunicator::CreateGroup(tp);
    }
    for (int i = 0; i < pp * tp; ++i) {
      if (dp > 1) dp_groups_[i] = comm::InProcCommunicator::CreateGroup(dp);
    }
    timed_tp_.resize(ranks);
    chunks_.resize(ranks);
    for (int d = 0; d < dp; ++d) {
      for (int t = 0; t < tp; ++t) {
        for (int p = 0; p < pp; ++p) {
          const int rank = Rank(d, t, p);
          if (tp > 1) timed_tp_[rank] = std::make_unique<comm::TimedCommunicator>(tp_groups_[d * pp + p][t].get());
          std::map<int, StageModel*> mine;
          for (int c = p; c < stages_; c += pp) {
            auto config = model::MakeChunkConfig(Model(), c, stages_, (*ranges)[c], t, tp, 11);
            EXPECT_TRUE(config.ok()) << config.status();
            if (!config.ok()) return;
            config->microbatches = kMicrobatches;
            config->device = device;
            config->comm_timeout = op_timeout;
            config->vocab_parallel = vocab_parallel;
            config->sequence_parallel = sequence_parallel;
            if (zero) {
              config->dp_rank = d;
              config->dp_size = dp;
            }
            comm::Communicator* tie = nullptr;
            if (stages_ > 1 && (c == 0 || c == stages_ - 1)) tie = tie_[d * tp + t][c == 0 ? 0 : 1].get();
            kernels::AdamWConfig adamw;
            adamw.lr = 1e-2f;
            adamw.weight_decay = 0.1f;
            auto chunk = GptStageModel::Create(*config, kBatch, timed_tp_[rank].get(), tie, adamw);
            EXPECT_TRUE(chunk.ok()) << chunk.status();
            if (!chunk.ok()) return;
            mine[c] = chunk->get();
            chunks_[rank].push_back(std::move(*chunk));
          }
          ExecutorOptions options;
          options.num_stages = stages_;
          options.microbatches = kMicrobatches;
          options.dp_rank = d;
          options.dp_size = dp;
          options.tokens_per_microbatch = kBatch * Model().seq_len;
          options.op_timeout = op_timeout;
          options.clock_us = [] { return absl::ToUnixMicros(absl::Now()); };
          executors_.push_back(std::make_unique<StepExecutor>(
              programs[p], options, mine, FillBatch, pp > 1 ? pipeline_[d * tp + t][p].get() : nullptr,
              timed_tp_[rank].get(), dp > 1 ? dp_groups_[p * tp + t][d].get() : nullptr));
        }
      }
    }
    ok_ = true;
  }

  bool ok() const { return ok_; }
  int ranks() const { return pp_ * tp_ * dp_; }
  int Rank(int d, int t, int p) const { return (d * tp_ + t) * pp_ + p; }
  StepExecutor& executor(int rank) { return *executors_[rank]; }

  // RunStep on the ranks `run` (all by default) at once, one thread each.
  std::vector<absl::StatusOr<v1::StepReport>> RunSteps(int64_t step, std::vector<int> run = {}) {
    if (run.empty()) {
      for (int r = 0; r < ranks(); ++r) run.push_back(r);
    }
    std::vector<absl::StatusOr<v1::StepReport>> reports(ranks(), absl::UnknownError("not run"));
    std::vector<std::thread> threads;
    for (int r : run) threads.emplace_back([&, r] { reports[r] = executors_[r]->RunStep(step, false); });
    for (auto& t : threads) t.join();
    return reports;
  }

  // Every rank's loss (0 without one) and norm share, the step's host
  // synchronisations, and every rank's StepDone.
  struct Step {
    std::vector<double> loss, sq_norm;
    int64_t host_syncs = 0;
    std::vector<v1::StepDone> done;
  };
  Step RunStep(int64_t step) {
    Step result;
    const int64_t syncs_before = kernels::HostSyncCount();
    const std::vector<absl::StatusOr<v1::StepReport>> reports = RunSteps(step);
    for (int r = 0; r < ranks(); ++r) {
      EXPECT_TRUE(reports[r].ok()) << "rank " << r << ": " << reports[r].status();
      if (!reports[r].ok()) return result;
      result.loss.push_back(reports[r]->has_loss() ? reports[r]->loss() : 0.0);
      result.sq_norm.push_back(reports[r]->grad_sq_norm());
    }
    std::vector<std::thread> threads;
    std::vector<absl::StatusOr<v1::StepDone>> done(ranks(), absl::UnknownError("not run"));
    for (int r = 0; r < ranks(); ++r) threads.emplace_back([&, r] { done[r] = executors_[r]->Commit(step, 0.5f); });
    for (auto& t : threads) t.join();
    for (int r = 0; r < ranks(); ++r) {
      EXPECT_TRUE(done[r].ok()) << "rank " << r << ": " << done[r].status();
      if (done[r].ok()) result.done.push_back(*done[r]);
    }
    result.host_syncs = kernels::HostSyncCount() - syncs_before;
    return result;
  }

  // Every rank's parameters ("rank/chunk/name"), through the final weights' path.
  std::map<std::string, std::vector<float>> Weights() {
    std::map<std::string, std::vector<float>> weights;
    for (int r = 0; r < ranks(); ++r) {
      for (size_t i = 0; i < chunks_[r].size(); ++i) {
        GptStageModel* chunk = chunks_[r][i].get();
        std::vector<float> storage;
        absl::StatusOr<std::vector<NamedShard>> shards = chunk->HostShards(&storage);
        EXPECT_TRUE(shards.ok()) << shards.status();
        if (!shards.ok()) return weights;
        for (const NamedShard& s : *shards) {
          const float* p = s.value.f32();
          weights[absl::StrCat(r, "/", i, "/", s.name)] =
              std::vector<float>(p, p + s.value.numel());
        }
      }
    }
    return weights;
  }

 private:
  const int pp_, tp_, dp_, stages_;
  bool ok_ = false;
  using Group = std::vector<std::unique_ptr<comm::InProcCommunicator>>;
  std::vector<Group> pipeline_, tie_, tp_groups_, dp_groups_;
  std::vector<std::unique_ptr<comm::TimedCommunicator>> timed_tp_;
  std::vector<std::vector<std::unique_ptr<GptStageModel>>> chunks_;  // per rank
  std::vector<std::unique_ptr<StepExecutor>> executors_;
};

struct GridCase {
  std::string kind;
  int pp, v, tp, dp;
  bool vocab_parallel = false;
  bool zero = false;  // ZeRO-1
  bool sequence_parallel = false;
};

std::string GridCaseName(const ::testing::TestParamInfo<GridCase>& info) {
  const GridCase& c = info.param;
  return absl::StrCat(c.kind == "zb-h1" ? std::string("zbh1") : c.kind, "_pp", c.pp, "_v", c.v, "_tp", c.tp, "_dp",
                      c.dp, c.vocab_parallel ? "_vocab" : "", c.zero ? "_zero1" : "", c.sequence_parallel ? "_sp" : "");
}

class SimExecutorParallelTest : public ::testing::TestWithParam<GridCase> {};

// The CPU's bits (every rank's loss and norm share per step, every parameter
// after three committed steps), and at most two host waits per rank per step
// after the first: no TP collective, DP all-reduce, ZeRO-1 reduce-scatter
// or ZeRO-1 all-gather of the updated values waits on the host.
TEST_P(SimExecutorParallelTest, SameBitsAsTheCpuAndAtMostTwoHostSyncsPerRank) {
  const GridCase c = GetParam();
  Grid cpu(c.kind, c.pp, c.v, c.tp, c.dp, kernels::Device::Cpu(), absl::Seconds(60), c.vocab_parallel, c.zero,
           c.sequence_parallel);
  Grid sim(c.kind, c.pp, c.v, c.tp, c.dp, kernels::Device::Sim(0), absl::Seconds(60), c.vocab_parallel, c.zero,
           c.sequence_parallel);
  ASSERT_TRUE(cpu.ok());
  ASSERT_TRUE(sim.ok());
  for (int step = 1; step <= kSteps; ++step) {
    const Grid::Step want = cpu.RunStep(step);
    const Grid::Step got = sim.RunStep(step);
    ASSERT_EQ(want.loss.size(), static_cast<size_t>(cpu.ranks())) << "step " << step;
    ASSERT_EQ(got.loss.size(), static_cast<size_t>(sim.ranks())) << "step " << step;
    EXPECT_EQ(got.loss, want.loss) << "step " << step;
    EXPECT_EQ(got.sq_norm, want.sq_norm) << "step " << step;
    EXPECT_GT(*std::max_element(want.loss.begin(), want.loss.end()), 0.0);
    ::testing::Test::RecordProperty(absl::StrCat("host_syncs_step_", step), static_cast<int>(got.host_syncs));
    // The first step allocates (ZerosOn waits for each new buffer's zeroing).
    if (step > 1) {
      EXPECT_LE(got.host_syncs, 2 * sim.ranks())
          << "step " << step << ", " << sim.ranks() << " ranks";
    }
    if (c.tp > 1 && step > 1) {
      for (const v1::StepDone& d : got.done) EXPECT_GT(d.comm_tp_seconds(), 0.0) << "step " << step;
      // On the CPU the TP collectives are host waits, told apart by kind:
      // SP's all-gathers and reduce-scatters; without SP (or the
      // vocabulary-parallel loss's gather) only all-reduces.
      for (const v1::StepDone& d : want.done) {
        EXPECT_LE(d.comm_tp_all_gather_seconds() + d.comm_tp_reduce_scatter_seconds(), d.comm_tp_seconds());
        if (c.sequence_parallel) {
          EXPECT_GT(d.comm_tp_all_gather_seconds(), 0.0) << "step " << step;
          EXPECT_GT(d.comm_tp_reduce_scatter_seconds(), 0.0) << "step " << step;
        } else {
          EXPECT_EQ(d.comm_tp_reduce_scatter_seconds(), 0.0) << "step " << step;
          if (!c.vocab_parallel) {
            EXPECT_EQ(d.comm_tp_all_gather_seconds(), 0.0) << "step " << step;
          }
        }
      }
    }
    if (c.dp > 1) {
      for (const v1::StepDone& d : got.done) EXPECT_GT(d.comm_dp_seconds(), 0.0) << "step " << step;
    }
  }
  const auto want = cpu.Weights(), got = sim.Weights();
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, values] : want) EXPECT_EQ(got.at(name), values) << name;
}

INSTANTIATE_TEST_SUITE_P(Layouts, SimExecutorParallelTest,
                         ::testing::Values(GridCase{"1f1b", 1, 1, 2, 1}, GridCase{"1f1b", 1, 1, 2, 1, true},
                                           GridCase{"1f1b", 1, 1, 1, 2}, GridCase{"1f1b", 2, 1, 2, 1},
                                           GridCase{"1f1b", 2, 1, 1, 2}, GridCase{"interleaved", 2, 2, 2, 1},
                                           GridCase{"interleaved", 2, 2, 1, 2}, GridCase{"1f1b", 2, 1, 2, 2},
                                           GridCase{"1f1b", 1, 1, 1, 2, false, true},
                                           GridCase{"interleaved", 2, 2, 2, 2, false, true},
                                           GridCase{"1f1b", 2, 1, 2, 1, false, false, true},
                                           GridCase{"interleaved", 2, 2, 2, 2, true, true, true}),
                         GridCaseName);

// A TP peer that never joins: only TP rank 0 of a tp=2 one-stage job runs
// its step. Its first collective (the attention output of block 0) times out
// on the chunk's stream, later ones post nothing, and the step fails at its
// host wait with DEADLINE_EXCEEDED naming that collective, within about one
// op timeout, without a hang; the executor stays usable (Discard).
TEST(SimExecutorStreamComm, TpPeerThatNeverJoinsFailsTheStepWithADeadline) {
  Grid g("1f1b", 1, 1, 2, 1, kernels::Device::Sim(0), absl::Milliseconds(300));
  ASSERT_TRUE(g.ok());
  const absl::Time start = absl::Now();
  const std::vector<absl::StatusOr<v1::StepReport>> reports = g.RunSteps(1, {g.Rank(0, 0, 0)});
  ::testing::Test::RecordProperty("failed_after_ms", static_cast<int>(absl::ToInt64Milliseconds(absl::Now() - start)));
  const absl::StatusOr<v1::StepReport>& r = reports[g.Rank(0, 0, 0)];
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  EXPECT_NE(r.status().message().find("tensor-parallel all-reduce of the attention output in block 0"),
            std::string::npos)
      << r.status();
  g.executor(g.Rank(0, 0, 0)).Discard(1);
}

// The same on the CPU (inline collectives): the step fails where the
// collective is, from the action that runs it.
TEST(CpuExecutorStreamComm, TpPeerThatNeverJoinsFailsTheStepAtTheCollective) {
  Grid g("1f1b", 1, 1, 2, 1, kernels::Device::Cpu(), absl::Milliseconds(300));
  ASSERT_TRUE(g.ok());
  const std::vector<absl::StatusOr<v1::StepReport>> reports = g.RunSteps(1, {g.Rank(0, 0, 0)});
  const absl::StatusOr<v1::StepReport>& r = reports[g.Rank(0, 0, 0)];
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  EXPECT_NE(r.status().message().find("F(stage 0, mb 0)"), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find("tensor-parallel all-reduce of the attention output in block 0"),
            std::string::npos)
      << r.status();
  g.executor(g.Rank(0, 0, 0)).Discard(1);
}

// A DP replica that never reduces: replica 0's gradient all-reduce (on the
// data-parallel stream) times out, and its step fails with
// DEADLINE_EXCEEDED naming it, within about one op timeout.
TEST(SimExecutorStreamComm, DpReplicaThatNeverReducesFailsTheStepWithADeadline) {
  Grid g("1f1b", 1, 1, 1, 2, kernels::Device::Sim(0), absl::Milliseconds(300));
  ASSERT_TRUE(g.ok());
  const std::vector<absl::StatusOr<v1::StepReport>> reports = g.RunSteps(1, {g.Rank(0, 0, 0)});
  const absl::StatusOr<v1::StepReport>& r = reports[g.Rank(0, 0, 0)];
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  EXPECT_NE(r.status().message().find("data-parallel gradient all-reduce of stage 0"), std::string::npos)
      << r.status();
  g.executor(g.Rank(0, 0, 0)).Discard(1);
}


// A middle chunk's DP all-reduce starts right after its last backward, before
// REDUCE_GRADS reduces the chunks of the tied embedding: at interleaved pp=2
// v=2 rank 0 holds chunks 0 and 2, and with no other replica its first
// failing all-reduce is chunk 2's (REDUCE_GRADS alone would post chunk 0's
// first).
TEST(SimExecutorStreamComm, MiddleChunkStartsItsDpReductionAfterItsLastBackward) {
  Grid g("interleaved", 2, 2, 1, 2, kernels::Device::Sim(0), absl::Milliseconds(300));
  ASSERT_TRUE(g.ok());
  const std::vector<absl::StatusOr<v1::StepReport>> reports = g.RunSteps(1, {g.Rank(0, 0, 0), g.Rank(0, 0, 1)});
  for (int p = 0; p < 2; ++p) {
    const absl::StatusOr<v1::StepReport>& r = reports[g.Rank(0, 0, p)];
    ASSERT_FALSE(r.ok()) << "pipeline rank " << p;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
    EXPECT_NE(r.status().message().find(absl::StrCat("data-parallel gradient all-reduce of stage ", p == 0 ? 2 : 1)),
              std::string::npos)
        << r.status();
    g.executor(g.Rank(0, 0, p)).Discard(1);
  }
}

}  // namespace
}  // namespace baton
