// Expert parallelism in the stage: ep ranks (threads over an inproc group),
// each with its own microbatch and E/ep experts, against one stage holding
// every expert run on each rank's microbatch alone. The dense parameters'
// gradients are each rank's own; an expert's gradient on its rank is the
// sum over every rank's tokens; losses, load-balancing losses and routing
// counts are each rank's own; and everything repeats bitwise.
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cpu/gemm.h"
#include "worker/comm/inproc_communicator.h"
#include "worker/model/gpt_config.h"
#include "worker/model/gpt_stage.h"
#include "worker/model/model_test_util.h"
#include "worker/model/parameters.h"

namespace baton::model {
namespace {

using kernels::Tensor;

GptConfig MoeModel(Arch arch, int experts, int top_k, double capacity_factor) {
  return SmallMoeModel(arch, /*layers=*/2, experts, top_k, capacity_factor);
}

struct Batch {
  Tensor tokens, targets;
};

std::unique_ptr<GptStage> MakeStage(const GptConfig& model, int ep_rank, int ep, comm::Communicator* group) {
  auto config = MakeStageConfig(model, 0, 1, 0, 1, /*seed=*/42);
  EXPECT_TRUE(config.ok()) << config.status();
  if (!config.ok()) return nullptr;
  config->ep_rank = ep_rank;
  config->ep_size = ep;
  auto stage = GptStage::Create(*config, nullptr, nullptr, group);
  EXPECT_TRUE(stage.ok()) << stage.status();
  return stage.ok() ? *std::move(stage) : nullptr;
}

absl::Status Step(GptStage& stage, const Batch& batch) {
  stage.ZeroGrad();
  StageInputs in;
  in.tokens = batch.tokens;
  in.targets = batch.targets;
  if (absl::Status s = stage.Forward(0, in, Tensor()); !s.ok()) return s;
  return stage.Backward(0, Tensor(), Tensor());
}

std::vector<float> Grad(GptStage& stage, const std::string& name) {
  const Parameter* p = stage.parameters().Find(name);
  EXPECT_NE(p, nullptr) << name;
  if (p == nullptr) return {};
  return Full(ParameterStore::ToHost(p->grad));
}

// ep stages, one thread each, one forward and backward of batches[r].
std::vector<std::unique_ptr<GptStage>> RunExpertParallel(const GptConfig& model, int ep,
                                                         const std::vector<Batch>& batches) {
  std::vector<std::unique_ptr<comm::InProcCommunicator>> group = comm::InProcCommunicator::CreateGroup(ep);
  std::vector<std::unique_ptr<GptStage>> stages(ep);
  std::vector<absl::Status> status(ep);
  std::vector<std::thread> threads;
  for (int r = 0; r < ep; ++r) {
    threads.emplace_back([&, r] {
      stages[r] = MakeStage(model, r, ep, group[r].get());
      status[r] = stages[r] == nullptr ? absl::InternalError("no stage") : Step(*stages[r], batches[r]);
      if (!status[r].ok()) group[r]->Abort(status[r].message());
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < ep; ++r) EXPECT_TRUE(status[r].ok()) << "ep rank " << r << ": " << status[r];
  return stages;
}

class MoeExpertParallelTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { kernels::cpu::SetBlasThreads(1); }
};

TEST_F(MoeExpertParallelTest, EveryEpRankTrainsLikeOneStageHoldingEveryExpert) {
  struct Case {
    Arch arch;
    int experts, top_k, ep;
    double capacity_factor;
  };
  const Case cases[] = {{Arch::kGpt2, 4, 2, 2, 1.25}, {Arch::kGpt2, 8, 2, 4, 0.0}, {Arch::kGpt2, 4, 1, 4, 1.0},
                        {Arch::kLlama, 4, 2, 2, 0.0}};
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << (c.arch == Arch::kLlama ? "llama" : "gpt2") << " E=" << c.experts
                                      << " k=" << c.top_k << " ep=" << c.ep << " capacity_factor=" << c.capacity_factor);
    const GptConfig model = MoeModel(c.arch, c.experts, c.top_k, c.capacity_factor);
    std::mt19937 rng(21);
    std::vector<Batch> batches(c.ep);
    for (Batch& b : batches) {
      b.tokens = RandomIds(rng, 2, 12, model.vocab);
      b.targets = RandomIds(rng, 2, 12, model.vocab);
    }
    std::vector<std::unique_ptr<GptStage>> ep = RunExpertParallel(model, c.ep, batches);
    std::vector<std::unique_ptr<GptStage>> again = RunExpertParallel(model, c.ep, batches);
    std::vector<std::unique_ptr<GptStage>> ref(c.ep);
    for (int r = 0; r < c.ep; ++r) {
      ref[r] = MakeStage(model, 0, 1, nullptr);
      ASSERT_NE(ref[r], nullptr);
      ASSERT_TRUE(Step(*ref[r], batches[r]).ok());
    }
    for (int r = 0; r < c.ep; ++r) {
      ASSERT_NE(ep[r], nullptr);
      ASSERT_NE(again[r], nullptr);
      SCOPED_TRACE(::testing::Message() << "ep rank " << r);
      const StepScore got = ep[r]->score(), want = ref[r]->score();
      EXPECT_NEAR(got.loss_sum, want.loss_sum, 1e-6 * std::abs(want.loss_sum));
      EXPECT_EQ(got.tokens, want.tokens);
      EXPECT_EQ(got.loss_sum, again[r]->score().loss_sum);
      EXPECT_NEAR(ep[r]->MoeAuxLossSum(), ref[r]->MoeAuxLossSum(), 1e-6 * ref[r]->MoeAuxLossSum());
      EXPECT_EQ(ep[r]->moe_routed(), ref[r]->moe_routed());
      EXPECT_EQ(ep[r]->moe_kept(), ref[r]->moe_kept());
      int experts_held = 0;
      for (const Parameter& p : ep[r]->parameters().parameters()) {
        const std::string& name = p.spec.name;
        const std::vector<float> grad = Grad(*ep[r], name);
        EXPECT_EQ(grad, Grad(*again[r], name)) << name << " not bitwise repeatable";
        if (!absl::StrContains(name, ".experts.")) {
          EXPECT_LT(RelError(grad, Grad(*ref[r], name)), 1e-5) << name;
          continue;
        }
        // An expert's gradient: every rank's tokens' share.
        ++experts_held;
        std::vector<float> sum = Grad(*ref[0], name);
        for (int s = 1; s < c.ep; ++s) {
          const std::vector<float> g = Grad(*ref[s], name);
          for (size_t i = 0; i < sum.size(); ++i) sum[i] += g[i];
        }
        EXPECT_LT(RelError(grad, sum), 1e-5) << name;
      }
      // This rank's E/ep experts of each block, and no other.
      const int matrices = c.arch == Arch::kLlama ? 3 : 2;
      EXPECT_EQ(experts_held, model.layers * (c.experts / c.ep) * matrices);
      EXPECT_NE(ep[r]->parameters().Find(absl::StrCat(c.arch == Arch::kLlama ? "layers.0.block_sparse_moe.experts."
                                                                            : "h.0.mlp.experts.",
                                                      r * (c.experts / c.ep),
                                                      c.arch == Arch::kLlama ? ".w1.weight" : ".c_fc.weight")),
                nullptr);
    }
  }
}

TEST_F(MoeExpertParallelTest, BadExpertParallelConfigsAreRefusedNamingTheField) {
  GptConfig model = MoeModel(Arch::kGpt2, 4, 2, 0.0);
  auto config = MakeStageConfig(model, 0, 1, 0, 1, 42);
  ASSERT_TRUE(config.ok());
  config->ep_size = 3;  // does not divide 4 experts
  absl::Status s = ValidateStageConfig(*config);
  EXPECT_NE(s.message().find("parallel.ep"), std::string::npos) << s;
  EXPECT_NE(s.message().find("model.moe.experts"), std::string::npos) << s;
  config->ep_size = 2;
  EXPECT_TRUE(ValidateStageConfig(*config).ok());
  auto stage = GptStage::Create(*config, nullptr, nullptr, nullptr);  // no ep group
  ASSERT_FALSE(stage.ok());
  EXPECT_NE(stage.status().message().find("expert-parallel communicator"), std::string::npos) << stage.status();
  model.moe_experts = 0;
  config->model = model;
  s = ValidateStageConfig(*config);
  EXPECT_NE(s.message().find("model.moe"), std::string::npos) << s;
}

}  // namespace
}  // namespace baton::model
