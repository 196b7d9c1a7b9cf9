// Mixture of Experts in the stage: parameters, layouts (pp, tp, SP,
// vocabulary-parallel) against the single stage, routing counts, learning,
// and what it refuses. The numerics against PyTorch are tests/golden's
// MoE goldens.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "worker/model/gpt_config.h"
#include "worker/model/gpt_stage.h"
#include "worker/model/inproc_model.h"
#include "worker/model/layout_test_fixture.h"
#include "worker/model/model_test_util.h"

namespace baton::model {
namespace {

GptConfig MoeModel(Arch arch, int top_k, double capacity_factor, int every) {
  return SmallMoeModel(arch, /*layers=*/4, /*experts=*/4, top_k, capacity_factor, every);
}

class MoeStageTest : public LayoutTest {
 protected:
  MoeStageTest() : LayoutTest(MoeModel(Arch::kGpt2, 2, 0.0, 1)) {}
};

int64_t Sum(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t{0}); }

TEST_F(MoeStageTest, MoeBlocksHoldARouterAndExpertsInsteadOfTheDenseMlp) {
  for (const Arch arch : {Arch::kGpt2, Arch::kLlama}) {
    model_ = MoeModel(arch, 2, 0.0, /*every=*/2);  // blocks 1 and 3
    double loss = 0;
    auto m = Run(1, 1, &loss);
    ASSERT_NE(m, nullptr);
    const std::vector<std::string> names = m->ParameterNames();
    auto has = [&](const std::string& name) {
      return std::find(names.begin(), names.end(), name) != names.end();
    };
    if (arch == Arch::kGpt2) {
      EXPECT_TRUE(has("h.0.mlp.c_fc.weight"));
      EXPECT_FALSE(has("h.1.mlp.c_fc.weight"));
      EXPECT_FALSE(has("h.1.mlp.c_proj.bias"));
      EXPECT_TRUE(has("h.1.mlp.router.weight"));
      EXPECT_TRUE(has("h.3.mlp.experts.3.c_proj.weight"));
      EXPECT_FALSE(has("h.2.mlp.router.weight"));
      EXPECT_EQ(Full(m->FullValue("h.1.mlp.experts.0.c_fc.weight")).size(), size_t{128 * 32});
    } else {
      EXPECT_TRUE(has("layers.0.mlp.gate_proj.weight"));
      EXPECT_FALSE(has("layers.1.mlp.gate_proj.weight"));
      EXPECT_TRUE(has("layers.1.block_sparse_moe.gate.weight"));
      for (const char* w : {"w1", "w2", "w3"}) {
        EXPECT_TRUE(has(absl::StrCat("layers.3.block_sparse_moe.experts.2.", w, ".weight"))) << w;
      }
      EXPECT_EQ(Full(m->FullValue("layers.1.block_sparse_moe.gate.weight")).size(), size_t{4 * 32});
    }
    // Every expert's weights get a gradient (the batch reaches all of them).
    for (const std::string& name : names) {
      if (!absl::StrContains(name, "expert") && !absl::StrContains(name, "router") &&
          !absl::StrContains(name, "block_sparse_moe.gate")) {
        continue;
      }
      const std::vector<float> g = Full(m->FullGrad(name));
      double sq = 0;
      for (float x : g) sq += double{x} * x;
      EXPECT_GT(sq, 0.0) << name;
    }
  }
}

// Routing depends on the whole tokens only, so every layout gives the single
// stage's loss, load-balancing loss and gradients, and repeats bitwise.
TEST_F(MoeStageTest, LayoutsMatchTheSingleStage) {
  struct Case {
    Arch arch;
    int top_k;
    double capacity_factor;
    int every;
  };
  const Case cases[] = {{Arch::kGpt2, 2, 0.0, 1}, {Arch::kGpt2, 1, 1.0, 2}, {Arch::kLlama, 2, 1.25, 1}};
  const struct {
    int pp, tp;
    bool vocab_parallel, sp;
  } layouts[] = {{2, 1, false, false}, {1, 2, false, false}, {2, 2, true, false}, {2, 2, false, true}};
  for (const Case& c : cases) {
    model_ = MoeModel(c.arch, c.top_k, c.capacity_factor, c.every);
    double base_loss = 0;
    auto base = Run(1, 1, &base_loss);
    ASSERT_NE(base, nullptr);
    const double base_aux = base->LastAuxLoss();
    EXPECT_GT(base_aux, 0.0);
    for (const auto& l : layouts) {
      SCOPED_TRACE(::testing::Message() << (c.arch == Arch::kLlama ? "llama" : "gpt2") << " k=" << c.top_k
                                        << " capacity_factor=" << c.capacity_factor << " pp=" << l.pp
                                        << " tp=" << l.tp << (l.vocab_parallel ? " vocab-parallel" : "")
                                        << (l.sp ? " sp" : ""));
      double loss = 0, again = 0;
      auto m = Run(l.pp, l.tp, &loss, l.vocab_parallel, l.sp);
      auto m2 = Run(l.pp, l.tp, &again, l.vocab_parallel, l.sp);
      ASSERT_NE(m, nullptr);
      ASSERT_NE(m2, nullptr);
      EXPECT_NEAR(loss, base_loss, 1e-5 * base_loss);
      EXPECT_NEAR(m->LastAuxLoss(), base_aux, 1e-5 * base_aux);
      EXPECT_EQ(loss, again);
      EXPECT_EQ(m->LastAuxLoss(), m2->LastAuxLoss());
      for (const std::string& name : base->ParameterNames()) {
        EXPECT_LT(RelError(Full(m->FullGrad(name)), Full(base->FullGrad(name))), 1e-5) << name;
        EXPECT_EQ(Full(m->FullGrad(name)), Full(m2->FullGrad(name))) << name << " not bitwise repeatable";
      }
    }
  }
}

// The stage counts, per expert, the choices routed to it and those kept:
// dropless keeps all; a small capacity drops some, never more than it holds.
TEST_F(MoeStageTest, CountsRoutedAndKeptChoices) {
  const int64_t tokens = 2 * 2 * 12;  // two microbatches of 2 x 12
  model_ = MoeModel(Arch::kGpt2, 2, 0.0, 1);
  double loss = 0;
  auto dropless = Run(1, 1, &loss);
  ASSERT_NE(dropless, nullptr);
  const GptStage& s = dropless->stage(0, 0);
  ASSERT_EQ(s.moe_routed().size(), 4u);
  EXPECT_EQ(Sum(s.moe_routed()), tokens * 2 * 4);  // top-2, four MoE blocks
  EXPECT_EQ(s.moe_kept(), s.moe_routed());

  model_ = MoeModel(Arch::kGpt2, 2, 0.5, 1);  // half of an even share
  auto capped = Run(1, 1, &loss);
  ASSERT_NE(capped, nullptr);
  const GptStage& c = capped->stage(0, 0);
  EXPECT_EQ(Sum(c.moe_routed()), tokens * 2 * 4);
  // Per microbatch and block each expert keeps at most ceil(0.5 · 24 · 2 / 4) = 6.
  for (int e = 0; e < 4; ++e) {
    EXPECT_LE(c.moe_kept()[e], c.moe_routed()[e]);
    EXPECT_LE(c.moe_kept()[e], 6 * 2 * 4);
  }
  EXPECT_LT(Sum(c.moe_kept()), Sum(c.moe_routed()));
  // Dropping changes the model's output.
  double dropless_loss = 0;
  model_ = MoeModel(Arch::kGpt2, 2, 0.0, 1);
  Run(1, 1, &dropless_loss);
  EXPECT_NE(loss, dropless_loss);
}

TEST_F(MoeStageTest, AuxLossCoefficientScalesTheLoadBalancingLoss) {
  model_ = MoeModel(Arch::kGpt2, 2, 0.0, 1);
  double loss = 0;
  auto with = Run(1, 1, &loss);
  ASSERT_NE(with, nullptr);
  model_.moe_aux_coef = 0.0f;
  double loss0 = 0;
  auto without = Run(1, 1, &loss0);
  ASSERT_NE(without, nullptr);
  EXPECT_EQ(without->LastAuxLoss(), 0.0);
  EXPECT_EQ(loss, loss0);  // the aux loss is not in the cross-entropy
  // It reaches the router's gradient and nothing upstream of the MoE's input
  // other than through the router.
  EXPECT_NE(Full(with->FullGrad("h.0.mlp.router.weight")), Full(without->FullGrad("h.0.mlp.router.weight")));
  EXPECT_EQ(Full(with->FullGrad("h.3.mlp.experts.0.c_fc.weight")),
            Full(without->FullGrad("h.3.mlp.experts.0.c_fc.weight")));
}

TEST(MoeStageLearningTest, TinyMoeModelsMemoriseAFixedBatch) {
  for (const Arch arch : {Arch::kGpt2, Arch::kLlama}) {
    SCOPED_TRACE(arch == Arch::kLlama ? "llama" : "gpt2");
    GptConfig tiny = MoeModel(arch, arch == Arch::kLlama ? 2 : 1, 0.0, 1);
    tiny.layers = 2;
    tiny.vocab = 16;
    tiny.seq_len = 8;
    ExpectMemorisesAFixedBatch(tiny);
  }
}

// Context parallelism: each cp rank routes its own tokens (two chunks of
// every sequence); the load-balancing loss counts the whole sequences'
// tokens (the ranks gather the router's probabilities and choices), so a
// dropless MoE at cp 2 and 4, and cp 2 with pp, tp and SP, gives the single
// stage's loss, load-balancing loss and gradients, and repeats bitwise.
TEST_F(MoeStageTest, ContextParallelLayoutsMatchTheSingleStage) {
  std::mt19937 rng(5);
  for (const Arch arch : {Arch::kGpt2, Arch::kLlama}) {
    model_ = MoeModel(arch, 2, 0.0, 1);
    tokens_.clear();
    targets_.clear();
    for (int mb = 0; mb < 2; ++mb) {  // whole sequences: cp splits seq_len
      tokens_.push_back(RandomIds(rng, 2, model_.seq_len, model_.vocab));
      targets_.push_back(RandomIds(rng, 2, model_.seq_len, model_.vocab));
    }
    double base_loss = 0;
    auto base = Run(1, 1, &base_loss);
    ASSERT_NE(base, nullptr);
    const double base_aux = base->LastAuxLoss();
    const struct {
      int pp, tp, cp;
      bool sp;
    } layouts[] = {{1, 1, 2, false}, {1, 1, 4, false}, {2, 2, 2, true}};
    for (const auto& l : layouts) {
      SCOPED_TRACE(::testing::Message() << (arch == Arch::kLlama ? "llama" : "gpt2") << " pp=" << l.pp
                                        << " tp=" << l.tp << " cp=" << l.cp << (l.sp ? " sp" : ""));
      double loss = 0, again = 0;
      auto m = Run(l.pp, l.tp, &loss, false, l.sp, l.cp);
      auto m2 = Run(l.pp, l.tp, &again, false, l.sp, l.cp);
      ASSERT_NE(m, nullptr);
      ASSERT_NE(m2, nullptr);
      EXPECT_NEAR(loss, base_loss, 1e-5 * base_loss);
      EXPECT_NEAR(m->LastAuxLoss(), base_aux, 1e-5 * base_aux);
      EXPECT_EQ(loss, again);
      for (const std::string& name : base->ParameterNames()) {
        EXPECT_LT(RelError(Full(m->FullGrad(name)), Full(base->FullGrad(name))), 1e-5) << name;
        EXPECT_EQ(Full(m->FullGrad(name)), Full(m2->FullGrad(name))) << name << " not bitwise repeatable";
      }
    }
  }
}

TEST(MoeStageRefusalTest, BadFieldsAreRefusedNamingTheField) {
  GptConfig bad = MoeModel(Arch::kGpt2, 2, 0.0, 1);
  bad.moe_top_k = 5;
  const absl::Status status = ValidateGptConfig(bad);
  EXPECT_NE(status.message().find("model.moe.top_k"), std::string::npos) << status;
}

}  // namespace
}  // namespace baton::model
