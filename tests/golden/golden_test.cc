#include "tests/golden/golden.h"

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "common/safetensors.h"
#include "gtest/gtest.h"
#include "kernels/cpu/gemm.h"
#include "worker/model/gpt_config.h"

namespace baton::golden {
namespace {

class GoldenTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { kernels::cpu::SetBlasThreads(1); }

  Golden Load(const std::string& name = "gpt_a") {
    auto file = SafetensorsFile::Read("tests/golden/" + name + ".safetensors");
    EXPECT_TRUE(file.ok()) << file.status();
    auto golden = LoadGolden(*file);
    EXPECT_TRUE(golden.ok()) << golden.status();
    return *golden;
  }
};

TEST_F(GoldenTest, AWrongGradientIsReportedAgainstItsName) {
  Golden golden = Load();
  golden.grads["h.1.mlp.c_fc.weight"][5] += 1e-3;
  auto result = CompareWithGolden(golden, /*tp=*/2, /*pp=*/2, /*vocab_parallel=*/true);
  ASSERT_TRUE(result.ok()) << result.status();
  for (const Comparison& c : *result) {
    if (c.name == "h.1.mlp.c_fc.weight") {
      EXPECT_GT(c.rel_error, 1e-4);
    } else {
      EXPECT_LT(c.rel_error, 1e-4) << c.name;
    }
  }
}

TEST_F(GoldenTest, AGoldenForAnotherModelIsAnError) {
  Golden golden = Load();
  golden.params.erase("ln_f.bias");
  EXPECT_EQ(CompareWithGolden(golden, 1, 1, false).status().code(),
            absl::StatusCode::kInvalidArgument);
  golden = Load();
  // 4 heads cannot be split over 3 ranks.
  auto result = CompareWithGolden(golden, /*tp=*/3, 1, false);
  EXPECT_NE(result.status().message().find("parallel.tp"), absl::string_view::npos)
      << result.status();
}

TEST_F(GoldenTest, MoeGoldensCarryTheirConfigAndAuxLoss) {
  const Golden dense = Load();
  EXPECT_FALSE(dense.config.moe());
  EXPECT_EQ(dense.aux_loss, 0);

  const Golden gpt2 = Load("moe_gpt2_top1_cap");
  EXPECT_EQ(gpt2.config.arch, model::Arch::kGpt2);
  EXPECT_EQ(gpt2.config.moe_experts, 4);
  EXPECT_EQ(gpt2.config.moe_top_k, 1);
  EXPECT_EQ(gpt2.config.moe_every, 2);
  EXPECT_FALSE(gpt2.config.moe_block(0));
  EXPECT_TRUE(gpt2.config.moe_block(1));
  EXPECT_EQ(gpt2.config.moe_capacity_factor, 1.0);
  EXPECT_EQ(gpt2.config.moe_aux_coef, 0.05f);
  EXPECT_GT(gpt2.aux_loss, 0);
  EXPECT_EQ(gpt2.params.count("h.1.mlp.experts.3.c_proj.weight"), 1u);
  EXPECT_EQ(gpt2.params.count("h.0.mlp.c_fc.bias"), 1u);

  const Golden llama = Load("moe_llama_top2_cap");
  EXPECT_EQ(llama.config.arch, model::Arch::kLlama);
  EXPECT_EQ(llama.config.kv_heads, 2);
  EXPECT_EQ(llama.config.ffn_dim(), 32);
  EXPECT_EQ(llama.config.rope_theta, 500000.0f);
  EXPECT_EQ(llama.config.norm_eps, 1e-6f);
  EXPECT_FALSE(llama.config.tie_embeddings);
  EXPECT_EQ(llama.config.moe_experts, 4);
  EXPECT_EQ(llama.config.moe_top_k, 2);
  EXPECT_EQ(llama.config.moe_every, 1);
  EXPECT_EQ(llama.config.moe_capacity_factor, 1.25);
  EXPECT_EQ(llama.config.moe_aux_coef, 0.02f);
  EXPECT_GT(llama.aux_loss, 0);
  EXPECT_EQ(llama.params.count("layers.0.block_sparse_moe.experts.2.w3.weight"), 1u);
  EXPECT_EQ(llama.params.count("lm_head.weight"), 1u);
}

TEST(LoadGoldenTest, AnMoeGoldenWithoutItsAuxLossIsAnError) {
  SafetensorsWriter writer;
  for (const auto& [key, value] : std::map<std::string, std::string>{
           {"layers", "2"}, {"d_model", "16"}, {"heads", "4"}, {"vocab", "64"}, {"seq_len", "4"},
           {"batch", "1"}, {"moe_experts", "4"}, {"moe_top_k", "2"}, {"moe_every_n_layers", "1"},
           {"moe_capacity_factor", "0.0"}, {"moe_aux_loss_coef", "0.01"}}) {
    writer.SetMetadata(key, value);
  }
  const std::vector<int32_t> tokens = {1, 2, 3, 4};
  ASSERT_TRUE(writer.AddInt32("tokens", {1, 4}, tokens).ok());
  ASSERT_TRUE(writer.AddInt32("targets", {1, 4}, tokens).ok());
  ASSERT_TRUE(writer.AddFloat32("loss", {1}, std::vector<float>{4.0f}).ok());
  auto file = SafetensorsFile::Parse(writer.Serialize());
  ASSERT_TRUE(file.ok()) << file.status();
  auto golden = LoadGolden(*file);
  EXPECT_EQ(golden.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(golden.status().message().find("aux_loss"), absl::string_view::npos) << golden.status();

  writer.SetMetadata("moe_top_k", "5");  // more than the 4 experts
  file = SafetensorsFile::Parse(writer.Serialize());
  ASSERT_TRUE(file.ok()) << file.status();
  golden = LoadGolden(*file);
  EXPECT_NE(golden.status().message().find("model.moe.top_k"), absl::string_view::npos) << golden.status();
}

}  // namespace
}  // namespace baton::golden
