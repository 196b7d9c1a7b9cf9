// GPT stages with train.precision = bf16 (StageConfig::precision) on the CPU
// backend's bf16 reference ops: the loss and gradients stay close to fp32's
// in every layout (one stage, a two-stage pipeline exchanging bf16
// activations, TP 2, both), runs are bitwise repeatable, the bf16 weight
// copies follow the fp32 masters through AdamW, the model learns, and a
// stage refuses fp32 messages.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>

#include "gtest/gtest.h"
#include "kernels/bfloat16.h"
#include "kernels/cpu/gemm.h"
#include "worker/model/gpt_stage.h"
#include "worker/model/inproc_model.h"
#include "worker/model/model_test_util.h"

namespace baton::model {
namespace {

using kernels::Precision;
using kernels::Tensor;

GptConfig SmallModel() {
  GptConfig c;
  c.layers = 4;
  c.d_model = 32;
  c.heads = 4;
  c.vocab = 40;
  c.seq_len = 16;
  return c;
}

class GptStageBf16Test : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { kernels::cpu::SetBlasThreads(1); }

  void SetUp() override {
    std::mt19937 rng(11);
    for (int mb = 0; mb < 2; ++mb) {
      tokens_.push_back(RandomIds(rng, 2, 12, model_.vocab));
      targets_.push_back(RandomIds(rng, 2, 12, model_.vocab));
    }
  }

  std::unique_ptr<InProcModel> Run(int pp, int tp, Precision precision, double* loss,
                                   bool vocab_parallel = false, bool sequence_parallel = false, int cp = 1) {
    auto m = InProcModel::Create(model_, pp, tp, /*seed=*/42, /*microbatches=*/2, vocab_parallel,
                                 kernels::Device::Cpu(), precision, sequence_parallel, cp);
    EXPECT_TRUE(m.ok()) << m.status();
    auto l = (*m)->ForwardBackward(tokens_, targets_);
    EXPECT_TRUE(l.ok()) << l.status();
    *loss = *l;
    return std::move(*m);
  }

  GptConfig model_ = SmallModel();
  std::vector<Tensor> tokens_, targets_;
};

struct Layout {
  int pp, tp;
  bool vocab_parallel;
  bool sequence_parallel = false;
};

TEST_F(GptStageBf16Test, LossAndGradientsStayCloseToFp32InEveryLayout) {
  double fp32_loss = 0;
  auto fp32 = Run(1, 1, Precision::kFloat32, &fp32_loss);
  const Layout layouts[] = {{1, 1, false}, {2, 1, false}, {1, 2, false}, {2, 2, false},
                            {2, 2, true},  {2, 2, false, true}, {2, 2, true, true}};
  double worst_loss = 0, worst_grad = 0;
  for (const Layout& l : layouts) {
    SCOPED_TRACE(::testing::Message() << "pp=" << l.pp << " tp=" << l.tp
                                      << (l.vocab_parallel ? " vocab-parallel" : "")
                                      << (l.sequence_parallel ? " sequence-parallel" : ""));
    double loss = 0;
    auto m = Run(l.pp, l.tp, Precision::kBFloat16, &loss, l.vocab_parallel, l.sequence_parallel);
    EXPECT_NEAR(loss, fp32_loss, 1e-2 * fp32_loss);
    EXPECT_NE(loss, fp32_loss);  // the bf16 path really ran
    worst_loss = std::max(worst_loss, std::fabs(loss - fp32_loss) / fp32_loss);
    EXPECT_NEAR(m->GlobalGradSqNorm(), fp32->GlobalGradSqNorm(), 1e-1 * fp32->GlobalGradSqNorm());
    for (const std::string& name : fp32->ParameterNames()) {
      EXPECT_EQ(Full(m->FullValue(name)), Full(fp32->FullValue(name))) << name << " initialised differently";
      const double e = RelError(Full(m->FullGrad(name)), Full(fp32->FullGrad(name)));
      EXPECT_LT(e, 5e-2) << name;
      worst_grad = std::max(worst_grad, e);
    }
  }
  std::printf("bf16 vs fp32: worst loss relative difference %.3g, worst gradient relative L2 %.3g\n",
              worst_loss, worst_grad);
}

// Llama (RMSNorm, RopePack into bf16 qkv, SwiGLU, untied head) in bf16:
// close to its fp32 run, bitwise repeatable, and every GEMM weight (q, k,
// v, o, gate, up, down, the head) has its bf16 copy.
TEST_F(GptStageBf16Test, LlamaStaysCloseToFp32AndRepeatsBitwise) {
  model_.arch = Arch::kLlama;
  model_.kv_heads = 2;
  model_.ffn = 48;
  model_.tie_embeddings = false;
  double fp32_loss = 0;
  auto fp32 = Run(1, 1, Precision::kFloat32, &fp32_loss);
  for (const Layout& l : {Layout{1, 1, false}, Layout{2, 2, false}, Layout{2, 2, true}}) {
    SCOPED_TRACE(::testing::Message() << "pp=" << l.pp << " tp=" << l.tp
                                      << (l.vocab_parallel ? " vocab-parallel" : ""));
    double loss = 0, again = 0;
    auto m = Run(l.pp, l.tp, Precision::kBFloat16, &loss, l.vocab_parallel);
    auto m2 = Run(l.pp, l.tp, Precision::kBFloat16, &again, l.vocab_parallel);
    EXPECT_NEAR(loss, fp32_loss, 1e-2 * fp32_loss);
    EXPECT_NE(loss, fp32_loss);  // the bf16 path really ran
    EXPECT_EQ(loss, again);
    for (const std::string& name : fp32->ParameterNames()) {
      EXPECT_LT(RelError(Full(m->FullGrad(name)), Full(fp32->FullGrad(name))), 5e-2) << name;
      EXPECT_EQ(Full(m->FullGrad(name)), Full(m2->FullGrad(name))) << name;
    }
  }
  auto m = InProcModel::Create(model_, 2, 1, 42, 2, false, kernels::Device::Cpu(), Precision::kBFloat16);
  ASSERT_TRUE(m.ok()) << m.status();
  for (int s = 0; s < 2; ++s) {
    int copies = 0;
    for (const Parameter& p : (*m)->stage(s, 0).parameters().parameters()) copies += p.value_bf16.defined();
    EXPECT_EQ(copies, 7 * 2 + (s == 1 ? 1 : 0)) << "stage " << s;  // 7 matrices a block, + lm_head
  }
}

// Context parallelism in bf16: the ring runs on the fp32 image of the bf16
// qkv, so GPT-2 and Llama stay as close to fp32 as bf16 without cp does,
// with pp, tp and sequence parallelism, and repeat bitwise.
TEST_F(GptStageBf16Test, ContextParallelStaysCloseToFp32AndRepeatsBitwise) {
  std::mt19937 rng(5);
  tokens_.clear();
  targets_.clear();
  for (int mb = 0; mb < 2; ++mb) {  // whole sequences: cp splits seq_len
    tokens_.push_back(RandomIds(rng, 2, model_.seq_len, model_.vocab));
    targets_.push_back(RandomIds(rng, 2, model_.seq_len, model_.vocab));
  }
  for (const Arch arch : {Arch::kGpt2, Arch::kLlama}) {
    if (arch == Arch::kLlama) {
      model_.arch = Arch::kLlama;
      model_.kv_heads = 2;
      model_.ffn = 48;
      model_.tie_embeddings = false;
    }
    double fp32_loss = 0, bf16_loss = 0;
    auto fp32 = Run(1, 1, Precision::kFloat32, &fp32_loss);
    auto bf16 = Run(1, 1, Precision::kBFloat16, &bf16_loss);
    const struct { int pp, tp, cp; bool sp; } layouts[] = {{1, 1, 2, false}, {2, 2, 2, true}, {1, 1, 4, false}};
    for (const auto& l : layouts) {
      SCOPED_TRACE(::testing::Message() << (arch == Arch::kLlama ? "llama" : "gpt2") << " pp=" << l.pp
                                        << " tp=" << l.tp << " cp=" << l.cp << (l.sp ? " sp" : ""));
      double loss = 0, again = 0;
      auto m = Run(l.pp, l.tp, Precision::kBFloat16, &loss, false, l.sp, l.cp);
      auto m2 = Run(l.pp, l.tp, Precision::kBFloat16, &again, false, l.sp, l.cp);
      ASSERT_NE(m, nullptr);
      EXPECT_NE(loss, fp32_loss);  // the bf16 path really ran
      EXPECT_NEAR(loss, fp32_loss, 1e-2 * fp32_loss);
      EXPECT_NEAR(loss, bf16_loss, 1e-2 * bf16_loss);
      EXPECT_EQ(loss, again);
      for (const std::string& name : fp32->ParameterNames()) {
        EXPECT_LT(RelError(Full(m->FullGrad(name)), Full(fp32->FullGrad(name))), 5e-2) << name;
        EXPECT_EQ(Full(m->FullGrad(name)), Full(m2->FullGrad(name))) << name << " not bitwise repeatable";
      }
    }
  }
}

// Mixture of Experts in bf16 (every block MoE, dropless): the router and
// the token exchange run on the fp32 image of the bf16 MLP input, the
// experts' GEMMs on bf16 rows and weight copies. Every token takes all four
// experts (top_k = experts), so no choice can flip on bf16's rounding (a
// flipped token moves an expert's gradient by far more than rounding does;
// the top-2 case checks the loss only): GPT-2 and Llama stay as close to
// fp32 as the dense model does, with pp, tp and SP, and repeat bitwise;
// every expert matrix has its bf16 copy.
TEST_F(GptStageBf16Test, MixtureOfExpertsStaysCloseToFp32AndRepeatsBitwise) {
  for (const Arch arch : {Arch::kGpt2, Arch::kLlama}) {
    model_ = SmallModel();
    model_.moe_experts = 4;
    model_.moe_top_k = 2;
    model_.moe_every = 1;
    model_.moe_capacity_factor = 0.0;
    if (arch == Arch::kLlama) {
      model_.arch = Arch::kLlama;
      model_.kv_heads = 2;
      model_.ffn = 48;
      model_.tie_embeddings = false;
    }
    double top2_fp32 = 0, top2_bf16 = 0, top2_again = 0;
    Run(1, 1, Precision::kFloat32, &top2_fp32);
    Run(1, 1, Precision::kBFloat16, &top2_bf16);
    Run(1, 1, Precision::kBFloat16, &top2_again);
    EXPECT_NEAR(top2_bf16, top2_fp32, 1e-2 * top2_fp32);
    EXPECT_NE(top2_bf16, top2_fp32);
    EXPECT_EQ(top2_bf16, top2_again);
    model_.moe_top_k = 4;
    double fp32_loss = 0;
    auto fp32 = Run(1, 1, Precision::kFloat32, &fp32_loss);
    for (const Layout& l : {Layout{1, 1, false}, Layout{2, 2, false, true}}) {
      SCOPED_TRACE(::testing::Message() << (arch == Arch::kLlama ? "llama" : "gpt2") << " pp=" << l.pp
                                        << " tp=" << l.tp << (l.sequence_parallel ? " sp" : ""));
      double loss = 0, again = 0;
      auto m = Run(l.pp, l.tp, Precision::kBFloat16, &loss, false, l.sequence_parallel);
      auto m2 = Run(l.pp, l.tp, Precision::kBFloat16, &again, false, l.sequence_parallel);
      ASSERT_NE(m, nullptr);
      EXPECT_NE(loss, fp32_loss);  // the bf16 path really ran
      EXPECT_NEAR(loss, fp32_loss, 1e-2 * fp32_loss);
      EXPECT_EQ(loss, again);
      for (const std::string& name : fp32->ParameterNames()) {
        EXPECT_LT(RelError(Full(m->FullGrad(name)), Full(fp32->FullGrad(name))), 5e-2) << name;
        EXPECT_EQ(Full(m->FullGrad(name)), Full(m2->FullGrad(name))) << name << " not bitwise repeatable";
      }
      for (const Parameter& p : m->stage(0, 0).parameters().parameters()) {
        const bool expert = p.spec.name.find("experts.") != std::string::npos;
        const bool router = p.spec.name.find("router") != std::string::npos ||
                            p.spec.name.find("block_sparse_moe.gate") != std::string::npos;
        if (expert) EXPECT_TRUE(p.value_bf16.defined()) << p.spec.name;
        if (router) EXPECT_TRUE(p.value.defined()) << p.spec.name;
      }
    }
  }
}

TEST_F(GptStageBf16Test, SameLayoutTwiceGivesIdenticalBits) {
  for (const Layout& l : {Layout{1, 1, false}, Layout{2, 2, false}}) {
    SCOPED_TRACE(::testing::Message() << "pp=" << l.pp << " tp=" << l.tp);
    double a = 0, b = 0;
    auto m1 = Run(l.pp, l.tp, Precision::kBFloat16, &a);
    auto m2 = Run(l.pp, l.tp, Precision::kBFloat16, &b);
    EXPECT_EQ(a, b);
    EXPECT_EQ(m1->GlobalGradSqNorm(), m2->GlobalGradSqNorm());
    for (const std::string& name : m1->ParameterNames()) {
      EXPECT_EQ(Full(m1->FullGrad(name)), Full(m2->FullGrad(name))) << name;
    }
  }
}

TEST_F(GptStageBf16Test, PipelineMessagesAreBf16AndHalfTheBytes) {
  auto bf16 = InProcModel::Create(model_, 2, 1, 42, 1, false, kernels::Device::Cpu(),
                                  Precision::kBFloat16);
  auto fp32 = InProcModel::Create(model_, 2, 1, 42, 1, false);
  ASSERT_TRUE(bf16.ok() && fp32.ok());
  EXPECT_EQ((*bf16)->stage(0, 0).activation_dtype(), kernels::DType::kBFloat16);
  EXPECT_EQ((*bf16)->stage(1, 0).activation_dtype(), kernels::DType::kBFloat16);
  EXPECT_EQ((*fp32)->stage(0, 0).activation_dtype(), kernels::DType::kFloat32);
  EXPECT_EQ(kernels::DTypeSize((*bf16)->stage(0, 0).activation_dtype()) * 2,
            kernels::DTypeSize((*fp32)->stage(0, 0).activation_dtype()));
}

TEST_F(GptStageBf16Test, Bf16CopiesAreTheRoundedMasterWeightsAfterEveryStep) {
  auto m = InProcModel::Create(model_, 2, 1, 42, 2, false, kernels::Device::Cpu(),
                               Precision::kBFloat16);
  ASSERT_TRUE(m.ok()) << m.status();
  kernels::AdamWConfig adamw;
  adamw.lr = 1e-2f;
  auto check = [&](const char* when) {
    for (int s = 0; s < 2; ++s) {
      int copies = 0;
      for (const Parameter& p : (*m)->stage(s, 0).parameters().parameters()) {
        if (!p.spec.gemm_weight) {
          EXPECT_FALSE(p.value_bf16.defined()) << p.spec.name;
          continue;
        }
        ++copies;
        ASSERT_TRUE(p.value_bf16.defined()) << p.spec.name;
        const auto* bits = static_cast<const uint16_t*>(p.value_bf16.raw());
        for (int64_t i = 0; i < p.value.numel(); ++i) {
          ASSERT_EQ(bits[i], kernels::FloatToBf16Bits(p.value.f32()[i]))
              << p.spec.name << "[" << i << "] " << when;
        }
      }
      // Four matrices per block, plus the LM head on the last stage.
      EXPECT_EQ(copies, 4 * 2 + (s == 1 ? 1 : 0));
    }
  };
  check("at init");
  for (int step = 0; step < 2; ++step) {
    ASSERT_TRUE((*m)->ForwardBackward(tokens_, targets_).ok());
    ASSERT_TRUE((*m)->OptimizerStep(adamw, 1.0).ok());
  }
  check("after two AdamW steps");
  std::vector<float> ones(static_cast<size_t>(model_.d_model) * 3 * model_.d_model, 0.5f);
  ASSERT_TRUE((*m)->SetParameter("h.0.attn.c_attn.weight", ones).ok());
  check("after SetParameter");
}

TEST_F(GptStageBf16Test, TinyBf16ModelOverfitsAFixedBatch) {
  model_.layers = 2;
  auto m = InProcModel::Create(model_, 2, 1, 3, 2, false, kernels::Device::Cpu(),
                               Precision::kBFloat16);
  ASSERT_TRUE(m.ok()) << m.status();
  kernels::AdamWConfig adamw;
  adamw.lr = 1e-2f;
  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    auto loss = (*m)->ForwardBackward(tokens_, targets_);
    ASSERT_TRUE(loss.ok()) << loss.status();
    if (step == 0) first = *loss;
    last = *loss;
    ASSERT_TRUE((*m)->OptimizerStep(adamw, 1.0).ok());
  }
  EXPECT_LT(last, 0.5 * first) << "first " << first << " last " << last;
}

TEST_F(GptStageBf16Test, ABf16StageRefusesFp32Messages) {
  auto config = MakeStageConfig(model_, 1, 2, 0, 1, 0);
  ASSERT_TRUE(config.ok());
  config->precision = Precision::kBFloat16;
  auto stage = GptStage::Create(*config, nullptr);
  ASSERT_TRUE(stage.ok()) << stage.status();
  std::mt19937 rng(1);
  StageInputs in;
  in.activations = Tensor::Zeros({1, 4, model_.d_model});  // fp32
  in.targets = RandomIds(rng, 1, 4, model_.vocab);
  absl::Status st = (*stage)->Forward(0, in, Tensor());
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("want bf16"), absl::string_view::npos) << st;
}

TEST(PrecisionFromSpecTest, AcceptsFp32AndBf16AndNamesTheFieldOtherwise) {
  v1::TrainSpec train;
  EXPECT_EQ(*PrecisionFromSpec(train), Precision::kFloat32);
  train.set_precision("fp32");
  EXPECT_EQ(*PrecisionFromSpec(train), Precision::kFloat32);
  train.set_precision("bf16");
  EXPECT_EQ(*PrecisionFromSpec(train), Precision::kBFloat16);
  train.set_precision("fp16");
  auto bad = PrecisionFromSpec(train);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("train.precision"), absl::string_view::npos);
  EXPECT_NE(bad.status().message().find("\"bf16\""), absl::string_view::npos);
}

}  // namespace
}  // namespace baton::model
