// The Llama architecture in GptStage: its parameters (Hugging Face's names,
// no biases, no position table, an untied head), every TP/PP layout giving
// the unsharded model's loss and gradients, with grouped-query attention and
// a tied head too, gradients that agree with finite differences of the
// loss, bitwise repeatability, and learning. The golden against
// transformers' LlamaForCausalLM is tests/hf/hf_llama_golden_test.
#include <cmath>
#include <random>
#include <string>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "kernels/cpu/gemm.h"
#include "worker/model/gpt_stage.h"
#include "worker/model/inproc_model.h"
#include "worker/model/layout_test_fixture.h"
#include "worker/model/model_test_util.h"

namespace baton::model {
namespace {

using kernels::Tensor;

GptConfig SmallLlama() {
  GptConfig c;
  c.arch = Arch::kLlama;
  c.layers = 4;
  c.d_model = 32;
  c.heads = 4;
  c.kv_heads = 2;
  c.ffn = 48;
  c.vocab = 40;
  c.seq_len = 16;
  c.rope_theta = 10000.0f;
  c.norm_eps = 1e-6f;
  c.tie_embeddings = false;
  return c;
}

class LlamaStageTest : public LayoutTest {
 protected:
  LlamaStageTest() : LayoutTest(SmallLlama()) {}

  void ExpectEveryLayoutMatches(const std::vector<std::pair<int, int>>& layouts, bool vocab_parallel = false,
                                bool sequence_parallel = false, int cp = 1) {
    double base_loss = 0;
    auto base = Run(1, 1, &base_loss);
    ASSERT_NE(base, nullptr);
    EXPECT_NEAR(base_loss, std::log(static_cast<double>(model_.vocab)), 0.5);  // fresh model
    for (const auto& [pp, tp] : layouts) {
      SCOPED_TRACE(::testing::Message() << "pp=" << pp << " tp=" << tp);
      double loss = 0;
      auto m = Run(pp, tp, &loss, vocab_parallel, sequence_parallel, cp);
      ASSERT_NE(m, nullptr);
      EXPECT_NEAR(loss, base_loss, 1e-5 * base_loss);
      EXPECT_NEAR(m->GlobalGradSqNorm(), base->GlobalGradSqNorm(), 1e-5 * base->GlobalGradSqNorm());
      for (const std::string& name : base->ParameterNames()) {
        EXPECT_EQ(Full(m->FullValue(name)), Full(base->FullValue(name))) << name << " initialised differently";
        EXPECT_LT(RelError(Full(m->FullGrad(name)), Full(base->FullGrad(name))), 1e-5) << name;
      }
    }
  }

};

TEST_F(LlamaStageTest, ParametersAreLlamasUnderHuggingFaceNames) {
  auto m = InProcModel::Create(model_, 1, 1, 42, 1, false);
  ASSERT_TRUE(m.ok()) << m.status();
  const std::vector<std::string> names = (*m)->ParameterNames();
  // 1 embedding + 9 per block + final norm + untied head.
  EXPECT_EQ(names.size(), 1 + 9 * 4 + 2);
  for (const std::string& name : names) {
    EXPECT_FALSE(absl::StrContains(name, "bias")) << name;
  }
  const int64_t c = 32, hd = 8;
  const struct {
    const char* name;
    size_t numel;
  } want[] = {
      {"embed_tokens.weight", 40 * c},
      {"layers.0.input_layernorm.weight", c},
      {"layers.0.self_attn.q_proj.weight", 4 * hd * c},
      {"layers.0.self_attn.k_proj.weight", 2 * hd * c},  // kv_heads 2
      {"layers.0.self_attn.v_proj.weight", 2 * hd * c},
      {"layers.0.self_attn.o_proj.weight", c * 4 * hd},
      {"layers.3.post_attention_layernorm.weight", c},
      {"layers.3.mlp.gate_proj.weight", 48 * c},
      {"layers.3.mlp.up_proj.weight", 48 * c},
      {"layers.3.mlp.down_proj.weight", c * 48},
      {"norm.weight", c},
      {"lm_head.weight", 40 * c},
  };
  for (const auto& w : want) {
    const std::vector<float> v = Full((*m)->FullValue(w.name));
    EXPECT_EQ(v.size(), w.numel) << w.name;
  }
  // RMSNorm weights start at 1; the untied head is drawn apart from the embedding.
  EXPECT_EQ(Full((*m)->FullValue("norm.weight")), std::vector<float>(c, 1.0f));
  EXPECT_NE(Full((*m)->FullValue("lm_head.weight")), Full((*m)->FullValue("embed_tokens.weight")));
  EXPECT_EQ((*m)->FullValue("wpe").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(LlamaStageTest, EveryLayoutMatchesTheUnshardedModel) {
  // tp 2 splits the 2 key/value heads one per rank.
  ExpectEveryLayoutMatches({{1, 2}, {2, 1}, {4, 1}, {2, 2}});
}

TEST_F(LlamaStageTest, MultiHeadAndSingleKeyValueHeadLayoutsMatch) {
  model_.kv_heads = 4;  // plain multi-head attention, tp up to 4
  ExpectEveryLayoutMatches({{1, 4}, {2, 2}});
  model_.kv_heads = 1;  // multi-query attention
  ExpectEveryLayoutMatches({{2, 1}});
}

TEST_F(LlamaStageTest, VocabularyParallelLayoutsMatch) {
  ExpectEveryLayoutMatches({{1, 2}, {2, 2}}, /*vocab_parallel=*/true);
}

// RMSNorm weights (no biases) summed over the group; rotary positions and the
// grouped heads see every token, gathered.
TEST_F(LlamaStageTest, SequenceParallelLayoutsMatch) {
  ExpectEveryLayoutMatches({{1, 2}, {2, 2}}, /*vocab_parallel=*/false, /*sequence_parallel=*/true);
  ExpectEveryLayoutMatches({{2, 2}}, /*vocab_parallel=*/true, /*sequence_parallel=*/true);
}

// Context parallelism: each rank's two chunks take RoPE at their global
// offsets; ring attention over grouped key/value heads.
TEST_F(LlamaStageTest, ContextParallelLayoutsMatch) {
  DrawBatches(/*seq=*/model_.seq_len);
  ExpectEveryLayoutMatches({{1, 1}, {2, 2}}, /*vocab_parallel=*/false, /*sequence_parallel=*/false, /*cp=*/2);
  ExpectEveryLayoutMatches({{1, 2}}, /*vocab_parallel=*/false, /*sequence_parallel=*/true, /*cp=*/4);
}

TEST_F(LlamaStageTest, TiedHeadLayoutsMatchAndSumTheirTwoCopies) {
  model_.tie_embeddings = true;
  ExpectEveryLayoutMatches({{2, 1}, {2, 2}});
  auto m = InProcModel::Create(model_, 1, 1, 42, 1, false);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ((*m)->FullValue("lm_head.weight").status().code(), absl::StatusCode::kNotFound);
}

// d loss / d θ against central differences of the loss for a few elements of
// every kind of parameter (embedding, norms, q/k/v/o, gate/up/down, head):
// an independent check of every kernel's backward inside the model.
TEST_F(LlamaStageTest, GradientsAgreeWithFiniteDifferences) {
  model_.layers = 2;
  auto m = InProcModel::Create(model_, 1, 1, 5, 2, false);
  ASSERT_TRUE(m.ok());
  // Norm weights away from 1 so that their gradients are not special.
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> around_one(0.5f, 1.5f);
  for (const std::string& name : (*m)->ParameterNames()) {
    if (!absl::StrContains(name, "norm")) continue;
    std::vector<float> w = Full((*m)->FullValue(name));
    for (float& x : w) x = around_one(rng);
    ASSERT_TRUE((*m)->SetParameter(name, w).ok());
  }
  ASSERT_TRUE((*m)->ForwardBackward(tokens_, targets_).ok());
  const char* names[] = {"embed_tokens.weight", "layers.0.input_layernorm.weight", "layers.0.self_attn.q_proj.weight",
                         "layers.1.self_attn.k_proj.weight", "layers.1.self_attn.v_proj.weight",
                         "layers.0.self_attn.o_proj.weight", "layers.1.post_attention_layernorm.weight",
                         "layers.0.mlp.gate_proj.weight", "layers.1.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
                         "norm.weight", "lm_head.weight"};
  for (const char* name : names) {
    SCOPED_TRACE(name);
    const std::vector<float> grad = Full((*m)->FullGrad(name));
    std::vector<float> w = Full((*m)->FullValue(name));
    ASSERT_EQ(grad.size(), w.size());
    // The element with the largest gradient, and one more.
    size_t top = 0;
    for (size_t i = 0; i < grad.size(); ++i) {
      if (std::fabs(grad[i]) > std::fabs(grad[top])) top = i;
    }
    for (size_t i : {top, (top * 7 + 3) % grad.size()}) {
      const float h = 1e-2f, saved = w[i];
      w[i] = saved + h;
      ASSERT_TRUE((*m)->SetParameter(name, w).ok());
      const double up = *(*m)->ForwardBackward(tokens_, targets_);
      w[i] = saved - h;
      ASSERT_TRUE((*m)->SetParameter(name, w).ok());
      const double down = *(*m)->ForwardBackward(tokens_, targets_);
      w[i] = saved;
      ASSERT_TRUE((*m)->SetParameter(name, w).ok());
      const double numeric = (up - down) / (2 * h);
      EXPECT_NEAR(grad[i], numeric, 2e-3 * std::max(1.0, std::fabs(numeric)) + 2e-4) << "element " << i;
    }
  }
}

TEST_F(LlamaStageTest, SameLayoutTwiceGivesIdenticalBits) {
  double a = 0, b = 0;
  auto m1 = Run(2, 2, &a);
  auto m2 = Run(2, 2, &b);
  ASSERT_NE(m1, nullptr);
  ASSERT_NE(m2, nullptr);
  EXPECT_EQ(a, b);
  for (const std::string& name : m1->ParameterNames()) {
    EXPECT_EQ(Full(m1->FullGrad(name)), Full(m2->FullGrad(name))) << name;
  }
}

TEST_F(LlamaStageTest, TinyLlamaOverfitsAFixedBatch) {
  GptConfig tiny = SmallLlama();
  tiny.layers = 2;
  tiny.vocab = 16;
  tiny.seq_len = 8;
  ExpectMemorisesAFixedBatch(tiny);
}

TEST(LlamaConfigTest, BadConfigsNameTheField) {
  auto error_of = [](GptConfig c, int tp = 1) {
    absl::StatusOr<StageConfig> s = MakeStageConfig(c, 0, 1, 0, tp, 1);
    return s.ok() ? std::string("ok") : std::string(s.status().message());
  };
  GptConfig c = SmallLlama();
  EXPECT_EQ(error_of(c), "ok");
  GptConfig bad = c;
  bad.kv_heads = 3;
  EXPECT_TRUE(absl::StrContains(error_of(bad), "model.kv_heads")) << error_of(bad);
  bad = c;
  bad.rope_theta = 0;
  EXPECT_TRUE(absl::StrContains(error_of(bad), "model.rope_theta")) << error_of(bad);
  bad = c;
  bad.norm_eps = -1;
  EXPECT_TRUE(absl::StrContains(error_of(bad), "model.norm_eps")) << error_of(bad);
  bad = c;
  bad.heads = 8;
  bad.kv_heads = 8;
  bad.d_model = 24;  // head_dim 3: odd
  EXPECT_TRUE(absl::StrContains(error_of(bad), "head_dim")) << error_of(bad);
  // tp must divide kv_heads (2) even where it divides heads (4).
  EXPECT_TRUE(absl::StrContains(error_of(c, 4), "model.kv_heads")) << error_of(c, 4);
  bad = c;
  bad.ffn = 50;  // not divisible by tp 4... nor by 4 heads' tp; by 2 yes
  bad.kv_heads = 4;
  EXPECT_TRUE(absl::StrContains(error_of(bad, 4), "model.ffn_dim")) << error_of(bad, 4);
  // GPT-2 refuses Llama's knobs instead of ignoring them.
  GptConfig gpt;
  gpt.layers = 1;
  gpt.d_model = 32;
  gpt.heads = 4;
  gpt.vocab = 40;
  gpt.seq_len = 8;
  EXPECT_EQ(error_of(gpt), "ok");
  gpt.ffn = 48;
  EXPECT_TRUE(absl::StrContains(error_of(gpt), "model.ffn_dim")) << error_of(gpt);
}

TEST(LlamaConfigTest, ReadsTheJobSpecAndRefusesAnUnknownArch) {
  v1::ModelSpec spec;
  spec.set_arch("llama");
  spec.set_layers(2);
  spec.set_d_model(32);
  spec.set_heads(4);
  spec.set_kv_heads(2);
  spec.set_ffn_dim(48);
  spec.set_vocab(40);
  spec.set_seq_len(16);
  spec.set_rope_theta(500000);
  const GptConfig c = GptConfigFromSpec(spec);
  EXPECT_TRUE(c.llama());
  EXPECT_EQ(c.key_value_heads(), 2);
  EXPECT_EQ(c.ffn_dim(), 48);
  EXPECT_EQ(c.rope_theta, 500000.0f);
  EXPECT_EQ(c.norm_eps, 1e-5f);
  EXPECT_FALSE(c.tie_embeddings);  // Llama's default
  EXPECT_TRUE(ValidateModelSpec(spec).ok()) << ValidateModelSpec(spec);
  spec.set_arch("mamba");
  EXPECT_TRUE(absl::StrContains(ValidateModelSpec(spec).message(), "model.arch")) << ValidateModelSpec(spec);
  spec.set_arch("");
  EXPECT_TRUE(absl::StrContains(ValidateModelSpec(spec).message(), "model.kv_heads")) << ValidateModelSpec(spec);
}

}  // namespace
}  // namespace baton::model
