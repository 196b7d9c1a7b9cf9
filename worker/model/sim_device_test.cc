// The GPT stages on the simulated device (kernels/sim) give exactly the CPU's
// bits — loss, scored tokens, hits, every gradient, and the weights after two
// optimizer steps — in every layout: one stage, PP 2 and 3 (activations and
// gradients handed between stage streams by events), TP 2 (collectives after
// a stream sync), PP 2 × TP 2 and the vocabulary-parallel head, in fp32 and
// in bf16 (train.precision = bf16: the CPU backend's bf16 reference ops, bf16
// pipeline messages). Reading the score waits for the device once. The simulated
// streams are lazy and its memory aborts on host access, so a missing wait or
// a leftover host access in the model fails here.
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/sim/sim_backend.h"
#include "worker/model/gpt_stage.h"
#include "worker/model/inproc_model.h"
#include "worker/model/model_test_util.h"

namespace baton::model {
namespace {

using kernels::Tensor;

GptConfig SmallModel() {
  GptConfig c;
  c.layers = 3;
  c.d_model = 16;
  c.heads = 4;
  c.vocab = 32;
  c.seq_len = 12;
  return c;
}

struct Batch {
  std::vector<Tensor> tokens, targets;
};

Batch MakeBatch(uint32_t seed, int microbatches, int vocab, int64_t seq = 10) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> dist(0, vocab - 1);
  Batch b;
  for (int mb = 0; mb < microbatches; ++mb) {
    Tensor tok = Tensor::Zeros({2, seq}, kernels::DType::kInt32);
    Tensor tgt = Tensor::Zeros({2, seq}, kernels::DType::kInt32);
    for (int64_t i = 0; i < tok.numel(); ++i) {
      tok.i32()[i] = dist(rng);
      tgt.i32()[i] = i % 4 == 3 ? -1 : dist(rng);  // some positions ignored
    }
    b.tokens.push_back(tok);
    b.targets.push_back(tgt);
  }
  return b;
}

struct Layout {
  int pp, tp;
  bool vocab_parallel;
  bool bf16;
  bool sequence_parallel = false;
  int cp = 1;  // context parallelism: whole sequences of seq_len (2·cp chunks)
  bool moe = false;  // every block's MLP 4 experts, top-2, capacity 1.0 (drops)
};

class SimDeviceTest : public ::testing::TestWithParam<Layout> {};

TEST_P(SimDeviceTest, SameBitsAsTheCpu) {
  const Layout l = GetParam();
  GptConfig model = SmallModel();
  if (l.moe) {
    model.moe_experts = 4;
    model.moe_top_k = 2;
    model.moe_capacity_factor = 1.0;
  }
  constexpr int kMicrobatches = 2;
  const kernels::Precision precision =
      l.bf16 ? kernels::Precision::kBFloat16 : kernels::Precision::kFloat32;
  auto cpu = InProcModel::Create(model, l.pp, l.tp, 5, kMicrobatches, l.vocab_parallel,
                                 kernels::Device::Cpu(), precision, l.sequence_parallel, l.cp);
  auto sim = InProcModel::Create(model, l.pp, l.tp, 5, kMicrobatches, l.vocab_parallel,
                                 kernels::Device::Sim(0), precision, l.sequence_parallel, l.cp);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  ASSERT_TRUE(sim.ok()) << sim.status();
  EXPECT_EQ((*sim)->stage(0, 0).parameters().device(), kernels::Device::Sim(0));
  kernels::AdamWConfig adamw;
  adamw.lr = 1e-2f;
  adamw.weight_decay = 0.1f;
  const int64_t ops_before = kernels::sim::SimOpsRun();
  for (int step = 0; step < 3; ++step) {
    const Batch batch = MakeBatch(100 + step, kMicrobatches, model.vocab, l.cp > 1 ? model.seq_len : 10);
    auto cpu_loss = (*cpu)->ForwardBackward(batch.tokens, batch.targets);
    auto sim_loss = (*sim)->ForwardBackward(batch.tokens, batch.targets);
    ASSERT_TRUE(cpu_loss.ok()) << cpu_loss.status();
    ASSERT_TRUE(sim_loss.ok()) << sim_loss.status();
    EXPECT_EQ(*sim_loss, *cpu_loss) << "step " << step;
    const StepScore want = (*cpu)->stage(l.pp - 1, 0).score();
    const int64_t syncs = kernels::HostSyncCount();
    const StepScore got = (*sim)->stage(l.pp - 1, 0).score();
    EXPECT_EQ(kernels::HostSyncCount() - syncs, 1) << "reading the loss and the hits waits once";
    EXPECT_EQ(got.loss_sum, want.loss_sum);
    EXPECT_EQ(got.tokens, want.tokens);
    EXPECT_EQ(got.correct, want.correct);
    EXPECT_EQ((*sim)->GlobalGradSqNorm(), (*cpu)->GlobalGradSqNorm());
    for (const std::string& name : (*cpu)->ParameterNames()) {
      ASSERT_EQ(Full((*sim)->FullGrad(name)), Full((*cpu)->FullGrad(name))) << name << " at step " << step;
    }
    ASSERT_TRUE((*cpu)->OptimizerStep(adamw, 1.0).ok());
    ASSERT_TRUE((*sim)->OptimizerStep(adamw, 1.0).ok());
    for (const std::string& name : (*cpu)->ParameterNames()) {
      ASSERT_EQ(Full((*sim)->FullValue(name)), Full((*cpu)->FullValue(name))) << name << " at step " << step;
    }
  }
  // The work really ran on the simulated streams.
  EXPECT_GT(kernels::sim::SimOpsRun() - ops_before, 100);
}

// Tokens and targets [batch, 12] of a microbatch (host int32).
StageInputs Microbatch(int64_t batch, uint32_t seed, int vocab) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> dist(0, vocab - 1);
  StageInputs in;
  in.tokens = Tensor::Zeros({batch, 12}, kernels::DType::kInt32);
  in.targets = Tensor::Zeros({batch, 12}, kernels::DType::kInt32);
  for (int64_t i = 0; i < in.tokens.numel(); ++i) {
    in.tokens.i32()[i] = dist(rng);
    in.targets.i32()[i] = dist(rng);
  }
  return in;
}

// Lifts the simulated memory limit however the test ends.
struct SimMemoryLimit {
  explicit SimMemoryLimit(int64_t bytes) { kernels::sim::SetSimDeviceMemoryLimitForTesting(bytes); }
  ~SimMemoryLimit() { kernels::sim::SetSimDeviceMemoryLimitForTesting(0); }
};

// A stage whose parameters, gradients and AdamW moments do not fit in the
// device's memory fails Create with RESOURCE_EXHAUSTED naming what did not
// fit and what to change, holds no device memory afterwards, and the same
// stage is created once the memory is there.
TEST(SimDeviceOutOfMemoryTest, ParametersThatDoNotFitFailCreateAndHoldNothing) {
  const kernels::Device device = kernels::Device::Sim(7);  // no other test uses it
  auto config = MakeStageConfig(SmallModel(), 0, 1, 0, 1, /*seed=*/5);
  ASSERT_TRUE(config.ok()) << config.status();
  config->device = device;
  const kernels::MemoryStats before = kernels::GetMemoryStats(device);
  {
    SimMemoryLimit limit(before.reserved_bytes + 1024);  // not even the values
    absl::StatusOr<std::unique_ptr<GptStage>> stage = GptStage::Create(*config, nullptr);
    ASSERT_EQ(stage.status().code(), absl::StatusCode::kResourceExhausted) << stage.status();
    const std::string message(stage.status().message());
    EXPECT_NE(message.find("placing stage 0 (tp rank 0) on sim:7: the parameter values ("), std::string::npos)
        << message;
    EXPECT_NE(message.find("use more pipeline stages (parallel.pp)"), std::string::npos) << message;
    EXPECT_EQ(message.find("micro_batch_size"), std::string::npos) << "activations are not the cause: " << message;
    EXPECT_EQ(kernels::GetMemoryStats(device).in_use_bytes, before.in_use_bytes);
    EXPECT_EQ(kernels::GetMemoryStats(device).reserved_bytes, before.reserved_bytes);
  }
  config->device = kernels::Device::Cpu();
  absl::StatusOr<std::unique_ptr<GptStage>> on_cpu = GptStage::Create(*config, nullptr);
  ASSERT_TRUE(on_cpu.ok()) << on_cpu.status();
  const int64_t values_bytes = static_cast<int64_t>((*on_cpu)->parameters().values().bytes());
  config->device = device;
  {
    SimMemoryLimit limit(before.reserved_bytes + values_bytes + 1024);  // the values, not the gradients
    absl::StatusOr<std::unique_ptr<GptStage>> stage = GptStage::Create(*config, nullptr);
    ASSERT_EQ(stage.status().code(), absl::StatusCode::kResourceExhausted) << stage.status();
    EXPECT_NE(stage.status().message().find(absl::StrCat("the gradients (", values_bytes, " bytes)")),
              std::string::npos)
        << stage.status();
    EXPECT_EQ(kernels::GetMemoryStats(device).reserved_bytes, before.reserved_bytes) << "the values went back too";
  }
  absl::StatusOr<std::unique_ptr<GptStage>> stage = GptStage::Create(*config, nullptr);
  ASSERT_TRUE(stage.ok()) << stage.status();
  EXPECT_EQ((*stage)->parameters().grads().device(), device);
}

// A microbatch whose activations do not fit in the device's memory fails the
// stage's Forward (or BackwardInput) with RESOURCE_EXHAUSTED saying what to
// lower, instead of aborting the process; the stage stays consistent: no
// microbatch left in flight after DropInFlight, the device's in-use bytes
// back where they were, and the next step, smaller or with memory freed,
// gives the bits of a stage that never failed.
TEST(SimDeviceOutOfMemoryTest, ForwardAndBackwardFailAndTheStageRecovers) {
  const kernels::Device device = kernels::Device::Sim(6);  // no other test uses it
  const GptConfig model = SmallModel();
  auto config = MakeStageConfig(model, 0, 1, 0, 1, /*seed=*/5);
  ASSERT_TRUE(config.ok()) << config.status();
  config->device = device;
  auto stage = GptStage::Create(*config, nullptr);
  ASSERT_TRUE(stage.ok()) << stage.status();
  config->device = kernels::Device::Cpu();
  auto reference = GptStage::Create(*config, nullptr);
  ASSERT_TRUE(reference.ok()) << reference.status();

  const StageInputs big = Microbatch(64, 1, model.vocab);   // ~3 MiB of activations
  const StageInputs small = Microbatch(2, 2, model.vocab);  // fits in one 1 MiB block
  const kernels::MemoryStats before = kernels::GetMemoryStats(device);
  {
    SimMemoryLimit limit(before.reserved_bytes + (int64_t{2} << 20));
    (*stage)->ZeroGrad();
    absl::Status forward = (*stage)->Forward(0, big, Tensor());
    ASSERT_EQ(forward.code(), absl::StatusCode::kResourceExhausted) << forward;
    const std::string message(forward.message());
    EXPECT_NE(message.find("Forward(0): block "), std::string::npos) << message;
    EXPECT_NE(message.find("sim:6 is out of memory: an activation arena needs"), std::string::npos)
        << message;
    EXPECT_NE(message.find("lower train.micro_batch_size"), std::string::npos) << message;
    EXPECT_EQ((*stage)->microbatches_in_flight(), 0);
    EXPECT_EQ(kernels::GetMemoryStats(device).in_use_bytes, before.in_use_bytes);

    // The next step's smaller microbatch fits, with the reference's bits.
    (*stage)->ZeroGrad();
    (*reference)->ZeroGrad();
    ASSERT_TRUE((*stage)->Forward(0, small, Tensor()).ok());
    ASSERT_TRUE((*stage)->Backward(0, Tensor(), Tensor()).ok());
    ASSERT_TRUE((*reference)->Forward(0, small, Tensor()).ok());
    ASSERT_TRUE((*reference)->Backward(0, Tensor(), Tensor()).ok());
    EXPECT_EQ((*stage)->score().loss_sum, (*reference)->score().loss_sum);
    EXPECT_EQ((*stage)->LocalGradSqNorm(), (*reference)->LocalGradSqNorm());
  }

  // Without the limit the big microbatch's forward fits; with the device then
  // full, its backward fails, and DropInFlight leaves the stage clean.
  (*stage)->ZeroGrad();
  ASSERT_TRUE((*stage)->Forward(0, big, Tensor()).ok());
  {
    SimMemoryLimit limit(kernels::GetMemoryStats(device).reserved_bytes);
    absl::Status backward = (*stage)->BackwardInput(0, Tensor(), Tensor());
    ASSERT_EQ(backward.code(), absl::StatusCode::kResourceExhausted) << backward;
    EXPECT_NE(backward.message().find("BackwardInput(0): "), std::string::npos) << backward;
    EXPECT_NE(backward.message().find("sim:6 is out of memory"), std::string::npos) << backward;
    ASSERT_TRUE((*stage)->stream().Synchronize().ok());
    (*stage)->DropInFlight();
    EXPECT_EQ((*stage)->microbatches_in_flight(), 0);
    EXPECT_EQ(kernels::GetMemoryStats(device).in_use_bytes, before.in_use_bytes);

    // Still under the limit: a step that fits in the arenas' memory runs.
    (*stage)->ZeroGrad();
    (*reference)->ZeroGrad();
    ASSERT_TRUE((*stage)->Forward(1, small, Tensor()).ok());
    ASSERT_TRUE((*stage)->Backward(1, Tensor(), Tensor()).ok());
    ASSERT_TRUE((*reference)->Forward(1, small, Tensor()).ok());
    ASSERT_TRUE((*reference)->Backward(1, Tensor(), Tensor()).ok());
    EXPECT_EQ((*stage)->score().loss_sum, (*reference)->score().loss_sum);
    EXPECT_EQ((*stage)->LocalGradSqNorm(), (*reference)->LocalGradSqNorm());
    EXPECT_TRUE(std::isfinite((*stage)->score().loss_sum));
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, SimDeviceTest,
                         ::testing::Values(Layout{1, 1, false, false}, Layout{2, 1, false, false},
                                           Layout{3, 1, false, false}, Layout{1, 2, false, false},
                                           Layout{2, 2, false, false}, Layout{2, 2, true, false},
                                           Layout{1, 1, false, true}, Layout{2, 2, false, true},
                                           Layout{2, 2, true, true}, Layout{2, 2, false, false, true},
                                           Layout{2, 2, true, true, true}, Layout{2, 2, false, false, false, 2},
                                           Layout{1, 1, false, false, false, 3},
                                           Layout{2, 2, false, false, true, 3},
                                           Layout{1, 1, false, true, false, 2},
                                           Layout{2, 2, true, true, true, 2},
                                           Layout{1, 1, false, false, false, 1, true},
                                           Layout{2, 2, false, false, true, 1, true}),
                         [](const ::testing::TestParamInfo<Layout>& info) {
                           return "pp" + std::to_string(info.param.pp) + "_tp" +
                                  std::to_string(info.param.tp) +
                                  (info.param.vocab_parallel ? "_vocab" : "") +
                                  (info.param.bf16 ? "_bf16" : "") +
                                  (info.param.sequence_parallel ? "_sp" : "") +
                                  (info.param.cp > 1 ? "_cp" + std::to_string(info.param.cp) : "") +
                                  (info.param.moe ? "_moe" : "");
                         });

}  // namespace
}  // namespace baton::model
