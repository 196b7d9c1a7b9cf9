// The step executor driving real GPT chunks (GptStageModel) on the simulated
// device gives the CPU's bits: per step the last stage's loss, hits and the
// grad norm, and after three committed steps every parameter — for 1F1B,
// ZB-H1 and interleaved pipelines of two ranks in one process (threads,
// in-process communicators). Message buffers, stage arenas and parameters make
// no device allocation after the first step.
#include <map>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "coordinator/schedule/builders.h"
#include "coordinator/schedule/lowering.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/sim/sim_backend.h"
#include "worker/comm/inproc_communicator.h"
#include "worker/executor.h"
#include "worker/gpt_stage_model.h"
#include "worker/model/parameters.h"

namespace baton {
namespace {

constexpr int kRanks = 2;
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

struct Result {
  std::vector<double> loss, sq_norm;
  std::vector<int64_t> correct;
  std::map<std::string, std::vector<float>> weights;  // "chunk/name"
  int64_t allocations_after_step1 = -1, allocations_at_end = -1;
};

Result RunSteps(const std::string& kind, int v, kernels::Device device) {
  Result result;
  schedule::ScheduleSpec spec{kind, kRanks, kMicrobatches, v};
  auto compute = schedule::BuildSchedule(spec);
  EXPECT_TRUE(compute.ok()) << compute.status();
  auto lowered = schedule::Lower(*compute);
  EXPECT_TRUE(lowered.ok()) << lowered.status();
  if (!compute.ok() || !lowered.ok()) return result;
  const std::vector<v1::Program> programs = schedule::ToPrograms(*lowered);
  const int stages = kRanks * v;
  auto pipeline = comm::InProcCommunicator::CreateGroup(kRanks);
  auto tie = comm::InProcCommunicator::CreateGroup(2);
  auto ranges = model::SplitLayers(Model().layers, stages);
  EXPECT_TRUE(ranges.ok());
  std::vector<std::unique_ptr<GptStageModel>> chunks;
  for (int c = 0; c < stages; ++c) {
    auto config = model::MakeChunkConfig(Model(), c, stages, (*ranges)[c], 0, 1, 11);
    EXPECT_TRUE(config.ok()) << config.status();
    config->microbatches = kMicrobatches;
    config->device = device;
    comm::Communicator* t = c == 0 ? tie[0].get() : c == stages - 1 ? tie[1].get() : nullptr;
    kernels::AdamWConfig adamw;
    adamw.lr = 1e-2f;
    adamw.weight_decay = 0.1f;
    auto chunk = GptStageModel::Create(*config, kBatch, nullptr, t, adamw);
    EXPECT_TRUE(chunk.ok()) << chunk.status();
    if (!chunk.ok()) return result;
    chunks.push_back(std::move(*chunk));
  }
  std::vector<std::unique_ptr<StepExecutor>> executors;
  for (int r = 0; r < kRanks; ++r) {
    std::map<int, StageModel*> mine;
    for (int s = r; s < stages; s += kRanks) mine[s] = chunks[s].get();
    ExecutorOptions options;
    options.num_stages = stages;
    options.microbatches = kMicrobatches;
    options.tokens_per_microbatch = kBatch * Model().seq_len;
    options.op_timeout = absl::Seconds(60);
    options.clock_us = [] { return absl::ToUnixMicros(absl::Now()); };
    executors.push_back(std::make_unique<StepExecutor>(programs[r], options, mine, FillBatch,
                                                       pipeline[r].get(), nullptr, nullptr));
  }
  const int last_rank = (stages - 1) % kRanks;
  for (int step = 1; step <= kSteps; ++step) {
    std::vector<absl::StatusOr<v1::StepReport>> reports(kRanks, absl::UnknownError("not run"));
    std::vector<std::thread> threads;
    for (int r = 0; r < kRanks; ++r) {
      threads.emplace_back([&, r] { reports[r] = executors[r]->RunStep(step, false); });
    }
    for (auto& t : threads) t.join();
    double sq = 0;
    for (int r = 0; r < kRanks; ++r) {
      EXPECT_TRUE(reports[r].ok()) << kind << " rank " << r << ": " << reports[r].status();
      if (!reports[r].ok()) return result;
      sq += reports[r]->grad_sq_norm();
    }
    result.loss.push_back(reports[last_rank]->loss());
    result.correct.push_back(reports[last_rank]->correct());
    result.sq_norm.push_back(sq);
    for (int r = 0; r < kRanks; ++r) {
      auto done = executors[r]->Commit(step, 0.5f);
      EXPECT_TRUE(done.ok()) << done.status();
    }
    if (step == 1) result.allocations_after_step1 = kernels::GetMemoryStats(device).system_allocations;
  }
  for (int c = 0; c < stages; ++c) {
    EXPECT_TRUE(chunks[c]->Synchronize().ok());
    for (const NamedShard& s : chunks[c]->Shards()) {
      result.weights[absl::StrCat(c, "/", s.name)] = model::ParameterStore::ToHost(s.value);
    }
  }
  result.allocations_at_end = kernels::GetMemoryStats(device).system_allocations;
  return result;
}

class SimExecutorTest : public ::testing::TestWithParam<std::pair<std::string, int>> {};

TEST_P(SimExecutorTest, SameBitsAsTheCpuAndNoAllocationAfterTheFirstStep) {
  const auto [kind, v] = GetParam();
  const Result cpu = RunSteps(kind, v, kernels::Device::Cpu());
  const Result sim = RunSteps(kind, v, kernels::Device::Sim(0));
  ASSERT_EQ(cpu.loss.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(sim.loss.size(), static_cast<size_t>(kSteps));
  EXPECT_EQ(sim.loss, cpu.loss);
  EXPECT_EQ(sim.correct, cpu.correct);
  EXPECT_EQ(sim.sq_norm, cpu.sq_norm);
  EXPECT_GT(cpu.loss[0], 0.0);
  EXPECT_NE(cpu.loss[2], cpu.loss[0]);  // the optimizer moved the weights
  ASSERT_EQ(sim.weights.size(), cpu.weights.size());
  for (const auto& [name, values] : cpu.weights) {
    EXPECT_EQ(sim.weights.at(name), values) << name;
  }
  EXPECT_GT(sim.allocations_after_step1, 0);
  EXPECT_EQ(sim.allocations_at_end, sim.allocations_after_step1)
      << "device allocations after the first step";
}

INSTANTIATE_TEST_SUITE_P(Schedules, SimExecutorTest,
                         ::testing::Values(std::make_pair(std::string("1f1b"), 1),
                                           std::make_pair(std::string("zb-h1"), 1),
                                           std::make_pair(std::string("interleaved"), 2)),
                         [](const auto& info) {
                           return (info.param.first == "zb-h1" ? std::string("zbh1")
                                                               : info.param.first) +
                                  "_v" + std::to_string(info.param.second);
                         });

}  // namespace
}  // namespace baton
