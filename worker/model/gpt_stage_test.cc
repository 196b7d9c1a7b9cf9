// GPT stage behaviour: every TP/PP layout computes the unsharded model's loss
// and gradients, runs are bitwise repeatable, the model can learn, and bad
// configs or inputs come back as errors naming the field.
#include "worker/model/gpt_stage.h"

#include <cmath>
#include <cstring>
#include <random>

#include "common/status_macros.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/gemm.h"
#include "worker/model/inproc_model.h"
#include "worker/model/layout_test_fixture.h"
#include "worker/model/model_test_util.h"

// The allocations below that no host can give must fail as the system's
// allocator fails, not as a sanitizer report (ASAN_OPTIONS and TSAN_OPTIONS,
// when set, add to this).
extern "C" const char* __asan_default_options() { return "allocator_may_return_null=1"; }
extern "C" const char* __tsan_default_options() { return "allocator_may_return_null=1"; }

namespace baton::model {
namespace {

using kernels::Tensor;

GptConfig SmallModel() {
  GptConfig c;
  c.layers = 4;
  c.d_model = 32;
  c.heads = 4;
  c.vocab = 37;
  c.seq_len = 16;
  return c;
}

class GptStageTest : public LayoutTest {
 protected:
  GptStageTest() : LayoutTest(SmallModel()) {}
};

TEST_F(GptStageTest, EveryLayoutMatchesTheUnshardedModel) {
  double base_loss = 0;
  auto base = Run(1, 1, &base_loss);
  EXPECT_NEAR(base_loss, std::log(static_cast<double>(model_.vocab)), 0.5);  // fresh model
  const struct { int pp, tp; } layouts[] = {{1, 2}, {1, 4}, {2, 1}, {3, 1}, {2, 2}, {4, 4}};
  for (const auto& layout : layouts) {
    SCOPED_TRACE(::testing::Message() << "pp=" << layout.pp << " tp=" << layout.tp);
    double loss = 0;
    auto m = Run(layout.pp, layout.tp, &loss);
    EXPECT_NEAR(loss, base_loss, 1e-5 * base_loss);
    // Every gradient counted once in the global norm, whatever the layout.
    EXPECT_NEAR(m->GlobalGradSqNorm(), base->GlobalGradSqNorm(), 1e-5 * base->GlobalGradSqNorm());
    for (const std::string& name : base->ParameterNames()) {
      EXPECT_EQ(Full(m->FullValue(name)), Full(base->FullValue(name))) << name << " initialised differently";
      EXPECT_LT(RelError(Full(m->FullGrad(name)), Full(base->FullGrad(name))), 1e-5) << name;
    }
  }
  // A name no stage holds is NOT_FOUND, naming it (not an empty tensor).
  const absl::StatusOr<std::vector<float>> missing = base->FullGrad("h.99.attn.c_attn.weight");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("h.99.attn.c_attn.weight"), std::string::npos)
      << missing.status();
}

TEST_F(GptStageTest, VocabularyParallelLayoutsMatchTheUnshardedModel) {
  model_.vocab = 40;  // divisible by 2 and 4
  DrawBatches();
  double base_loss = 0;
  auto base = Run(1, 1, &base_loss);
  const struct { int pp, tp; } layouts[] = {{1, 2}, {2, 4}};
  for (const auto& layout : layouts) {
    SCOPED_TRACE(::testing::Message() << "pp=" << layout.pp << " tp=" << layout.tp);
    double loss = 0, again = 0;
    auto m = Run(layout.pp, layout.tp, &loss, /*vocab_parallel=*/true);
    EXPECT_NEAR(loss, base_loss, 1e-5 * base_loss);
    EXPECT_NEAR(m->GlobalGradSqNorm(), base->GlobalGradSqNorm(), 1e-5 * base->GlobalGradSqNorm());
    for (const std::string& name : base->ParameterNames()) {
      EXPECT_EQ(Full(m->FullValue(name)), Full(base->FullValue(name))) << name << " initialised differently";
      EXPECT_LT(RelError(Full(m->FullGrad(name)), Full(base->FullGrad(name))), 1e-5) << name;
    }
    auto m2 = Run(layout.pp, layout.tp, &again, /*vocab_parallel=*/true);
    EXPECT_EQ(loss, again);
    EXPECT_EQ(Full(m->FullGrad("wte")), Full(m2->FullGrad("wte")));  // bitwise repeatable
  }
  // A vocabulary the group cannot split is an error naming the field.
  model_.vocab = 37;
  auto bad = InProcModel::Create(model_, 1, 2, 42, 1, /*vocab_parallel=*/true);
  EXPECT_NE(bad.status().message().find("model.vocab"), absl::string_view::npos) << bad.status();
}

// Megatron sequence parallelism: each TP rank holds a quarter or half of the
// tokens in the norms and the residual stream, yet every layout gives the
// unsharded model's loss and gradients (the norm weights' gradients summed
// over the group), repeatably, and holds less activation memory than TP alone.
TEST_F(GptStageTest, SequenceParallelLayoutsMatchTheUnshardedModel) {
  model_.vocab = 40;  // divisible by 2 and 4, for the vocabulary-parallel case
  DrawBatches();
  double base_loss = 0;
  auto base = Run(1, 1, &base_loss);
  const struct { int pp, tp; bool vocab_parallel; } layouts[] = {{1, 2, false}, {1, 4, false}, {2, 2, false},
                                                                 {2, 4, true}, {3, 2, true}};
  for (const auto& layout : layouts) {
    SCOPED_TRACE(::testing::Message() << "pp=" << layout.pp << " tp=" << layout.tp
                                      << " vocab_parallel=" << layout.vocab_parallel);
    double loss = 0, again = 0, tp_only = 0;
    auto m = Run(layout.pp, layout.tp, &loss, layout.vocab_parallel, /*sequence_parallel=*/true);
    EXPECT_NEAR(loss, base_loss, 1e-5 * base_loss);
    EXPECT_NEAR(m->GlobalGradSqNorm(), base->GlobalGradSqNorm(), 1e-5 * base->GlobalGradSqNorm());
    for (const std::string& name : base->ParameterNames()) {
      EXPECT_LT(RelError(Full(m->FullGrad(name)), Full(base->FullGrad(name))), 1e-5) << name;
    }
    auto m2 = Run(layout.pp, layout.tp, &again, layout.vocab_parallel, /*sequence_parallel=*/true);
    EXPECT_EQ(loss, again);
    for (const std::string& name : {"h.0.ln_1.weight", "h.3.ln_2.bias", "ln_f.weight", "wte"}) {
      EXPECT_EQ(Full(m->FullGrad(name)), Full(m2->FullGrad(name))) << name << " not bitwise repeatable";
    }
    // Every TP rank ends with the same (summed) norm gradients.
    for (int r = 1; r < layout.tp; ++r) {
      const auto rank0 = ParameterStore::ToHost(m->stage(0, 0).parameters().Find("h.0.ln_1.weight")->grad);
      const auto rank = ParameterStore::ToHost(m->stage(0, r).parameters().Find("h.0.ln_1.weight")->grad);
      ASSERT_TRUE(rank0.ok() && rank.ok());
      EXPECT_EQ(*rank0, *rank) << "TP rank " << r;
    }
    // The first stage's microbatch stashes shrink: the residual stream and
    // the norms keep 1/tp of the tokens.
    auto plain = Run(layout.pp, layout.tp, &tp_only, layout.vocab_parallel);
    EXPECT_LT(m->stage(0, 0).activation_bytes(), plain->stage(0, 0).activation_bytes());
    std::printf("pp=%d tp=%d%s: first stage's activation high-water with SP / without: %.3f\n", layout.pp,
                layout.tp, layout.vocab_parallel ? " vocab-parallel" : "",
                static_cast<double>(m->stage(0, 0).activation_bytes()) /
                    static_cast<double>(plain->stage(0, 0).activation_bytes()));
  }
}

TEST_F(GptStageTest, SequenceParallelRefusesWhatItCannotSplit) {
  // Without a TP group there is nothing to split over.
  auto alone = InProcModel::Create(model_, 1, 1, 42, 1, false, kernels::Device::Cpu(), kernels::Precision::kFloat32,
                                   /*sequence_parallel=*/true);
  ASSERT_FALSE(alone.ok());
  EXPECT_NE(alone.status().message().find("parallel.sequence_parallel"), std::string::npos) << alone.status();
  // 1 x 7 tokens do not split over 2 ranks: an error, not a crash.
  auto m = InProcModel::Create(model_, 1, 2, 42, 1, false, kernels::Device::Cpu(), kernels::Precision::kFloat32,
                               /*sequence_parallel=*/true);
  ASSERT_TRUE(m.ok()) << m.status();
  std::mt19937 rng(3);
  const absl::StatusOr<double> loss =
      (*m)->ForwardBackward({RandomIds(rng, 1, 7, model_.vocab)}, {RandomIds(rng, 1, 7, model_.vocab)});
  ASSERT_FALSE(loss.ok());
  EXPECT_NE(loss.status().message().find("parallel.sequence_parallel"), std::string::npos) << loss.status();
  EXPECT_NE(loss.status().message().find("train.micro_batch_size"), std::string::npos) << loss.status();
}

// Context parallelism: every sequence split into 2·cp chunks over cp ranks,
// attention run as ring attention, gradients averaged over the cp ranks;
// every layout gives the serial model's loss and gradients, repeatably, and
// each rank stashes a fraction of the activations.
TEST_F(GptStageTest, ContextParallelLayoutsMatchTheSerialModel) {
  model_.vocab = 40;  // divisible by 2, for the vocabulary-parallel case
  DrawBatches(/*seq=*/model_.seq_len);
  double base_loss = 0;
  auto base = Run(1, 1, &base_loss);
  const struct { int pp, tp, cp; bool vocab_parallel, sp; } layouts[] = {
      {1, 1, 2, false, false}, {1, 1, 4, false, false}, {2, 1, 2, false, false},
      {1, 2, 2, true, false},  {2, 2, 2, false, true},  {1, 2, 4, false, true}};
  for (const auto& layout : layouts) {
    SCOPED_TRACE(::testing::Message() << "pp=" << layout.pp << " tp=" << layout.tp << " cp=" << layout.cp
                                      << " vocab_parallel=" << layout.vocab_parallel << " sp=" << layout.sp);
    double loss = 0, again = 0;
    auto m = Run(layout.pp, layout.tp, &loss, layout.vocab_parallel, layout.sp, layout.cp);
    ASSERT_NE(m, nullptr);
    EXPECT_NEAR(loss, base_loss, 1e-5 * base_loss);
    EXPECT_NEAR(m->GlobalGradSqNorm(), base->GlobalGradSqNorm(), 1e-5 * base->GlobalGradSqNorm());
    for (const std::string& name : base->ParameterNames()) {
      EXPECT_LT(RelError(Full(m->FullGrad(name)), Full(base->FullGrad(name))), 1e-5) << name;
    }
    auto m2 = Run(layout.pp, layout.tp, &again, layout.vocab_parallel, layout.sp, layout.cp);
    EXPECT_EQ(loss, again);
    for (const std::string& name : {"h.0.attn.c_attn.weight", "wpe", "wte", "ln_f.weight"}) {
      EXPECT_EQ(Full(m->FullGrad(name)), Full(m2->FullGrad(name))) << name << " not bitwise repeatable";
    }
    // Each rank's first stage stashes its 1/cp of the tokens (and no P).
    double unsplit = 0;
    auto whole = Run(layout.pp, layout.tp, &unsplit, layout.vocab_parallel, layout.sp);
    EXPECT_LT(m->stage(0, 0).activation_bytes(), whole->stage(0, 0).activation_bytes());
    std::printf("pp=%d tp=%d cp=%d: first stage's activation high-water with CP / without: %.3f\n", layout.pp,
                layout.tp, layout.cp,
                static_cast<double>(m->stage(0, 0).activation_bytes()) /
                    static_cast<double>(whole->stage(0, 0).activation_bytes()));
  }
}

// Ignored targets need not fall evenly on the cp ranks (here they crowd the
// sequences' ends): the microbatch's scored tokens are counted over the ring,
// so the loss and the gradients are still the serial model's.
TEST_F(GptStageTest, ContextParallelWithUnevenlyIgnoredTargetsMatchesTheSerialModel) {
  DrawBatches(/*seq=*/model_.seq_len);
  for (Tensor& t : targets_) {
    for (int64_t i = 0; i < t.numel(); ++i) {
      if (i % model_.seq_len >= 10 || i % 5 == 0) t.i32()[i] = -1;
    }
  }
  double base_loss = 0;
  auto base = Run(1, 1, &base_loss);
  for (int cp : {2, 4}) {
    SCOPED_TRACE(::testing::Message() << "cp=" << cp);
    double loss = 0;
    auto m = Run(2, 1, &loss, false, false, cp);
    ASSERT_NE(m, nullptr);
    EXPECT_NEAR(loss, base_loss, 1e-5 * base_loss);
    for (const std::string& name : base->ParameterNames()) {
      EXPECT_LT(RelError(Full(m->FullGrad(name)), Full(base->FullGrad(name))), 1e-5) << name;
    }
  }
}

TEST_F(GptStageTest, ContextParallelRefusesWhatItCannotSplit) {
  // model.seq_len 16 does not split into 2·cp = 6 chunks.
  auto three = InProcModel::Create(model_, 1, 1, 42, 1, false, kernels::Device::Cpu(), kernels::Precision::kFloat32,
                                   false, /*cp=*/3);
  ASSERT_FALSE(three.ok());
  EXPECT_NE(three.status().message().find("model.seq_len"), std::string::npos) << three.status();
  EXPECT_NE(three.status().message().find("parallel.cp"), std::string::npos) << three.status();
  // Sequences of 6 tokens do not split into 4 chunks: an error, not a crash.
  auto m = InProcModel::Create(model_, 1, 1, 42, 1, false, kernels::Device::Cpu(), kernels::Precision::kFloat32,
                               false, /*cp=*/2);
  ASSERT_TRUE(m.ok()) << m.status();
  std::mt19937 rng(3);
  const absl::StatusOr<double> loss =
      (*m)->ForwardBackward({RandomIds(rng, 1, 6, model_.vocab)}, {RandomIds(rng, 1, 6, model_.vocab)});
  EXPECT_FALSE(loss.ok());
}

// Marks about a third of the targets ignored (-1).
void IgnoreSomeTargets(std::vector<Tensor>& targets) {
  for (Tensor& t : targets) {
    for (int64_t i = 0; i < t.numel(); ++i) {
      if (i % 3 == 1) t.i32()[i] = -1;
    }
  }
}

TEST_F(GptStageTest, IgnoredTargetsGiveTheUnshardedModelInEveryLayout) {
  model_.vocab = 40;  // divisible by 2 for the vocabulary-parallel head
  DrawBatches();
  IgnoreSomeTargets(targets_);
  double base_loss = 0;
  auto base = Run(1, 1, &base_loss);
  const StepScore want = base->stage(0, 0).score();
  EXPECT_EQ(want.tokens, 2 * 2 * 8);  // 2 microbatches of [2, 12], 8 of 12 scored per row
  const struct { int pp, tp; bool vocab_parallel; } layouts[] = {
      {1, 2, false}, {2, 1, false}, {2, 2, false}, {1, 2, true}, {2, 2, true}};
  for (const auto& layout : layouts) {
    SCOPED_TRACE(::testing::Message() << "pp=" << layout.pp << " tp=" << layout.tp
                                      << " vocab_parallel=" << layout.vocab_parallel);
    double loss = 0;
    auto m = Run(layout.pp, layout.tp, &loss, layout.vocab_parallel);
    EXPECT_NEAR(loss, base_loss, 1e-5 * base_loss);
    EXPECT_NEAR(m->GlobalGradSqNorm(), base->GlobalGradSqNorm(), 1e-5 * base->GlobalGradSqNorm());
    for (const std::string& name : base->ParameterNames()) {
      EXPECT_LT(RelError(Full(m->FullGrad(name)), Full(base->FullGrad(name))), 1e-5) << name;
    }
    for (int r = 0; r < layout.tp; ++r) {
      const StepScore got = m->stage(layout.pp - 1, r).score();
      EXPECT_EQ(got.tokens, want.tokens);
      EXPECT_EQ(got.correct, want.correct);
      EXPECT_NEAR(got.loss_sum, want.loss_sum, 1e-5 * want.loss_sum);
    }
  }
}

TEST_F(GptStageTest, IgnoredTrailingTargetsEqualAShorterSequence) {
  // Attention is causal, so ignoring the last 4 of 12 targets must give the
  // loss and gradients of the 8-token prefix (the wpe rows past it get none).
  auto prefix = [](const std::vector<Tensor>& full, int64_t t) {
    std::vector<Tensor> out;
    for (const Tensor& f : full) {
      Tensor p = Tensor::Zeros({f.dim(0), t}, kernels::DType::kInt32);
      for (int64_t b = 0; b < f.dim(0); ++b) {
        std::memcpy(p.i32() + b * t, f.i32() + b * f.dim(1), t * sizeof(int32_t));
      }
      out.push_back(p);
    }
    return out;
  };
  const std::vector<Tensor> short_tokens = prefix(tokens_, 8), short_targets = prefix(targets_, 8);
  for (Tensor& t : targets_) {
    for (int64_t b = 0; b < t.dim(0); ++b) {
      for (int64_t i = 8; i < 12; ++i) t.i32()[b * 12 + i] = -1;
    }
  }
  double masked_loss = 0;
  auto masked = Run(2, 2, &masked_loss);
  auto shorter = InProcModel::Create(model_, 1, 1, /*seed=*/42, /*microbatches=*/2, false);
  ASSERT_TRUE(shorter.ok());
  auto short_loss = (*shorter)->ForwardBackward(short_tokens, short_targets);
  ASSERT_TRUE(short_loss.ok());
  EXPECT_NEAR(masked_loss, *short_loss, 1e-5 * *short_loss);
  EXPECT_EQ(masked->stage(1, 0).score().tokens, (*shorter)->stage(0, 0).score().tokens);
  EXPECT_EQ(masked->stage(1, 0).score().correct, (*shorter)->stage(0, 0).score().correct);
  for (const std::string& name : masked->ParameterNames()) {
    EXPECT_LT(RelError(Full(masked->FullGrad(name)), Full((*shorter)->FullGrad(name))), 1e-5) << name;
  }
}

TEST_F(GptStageTest, AccuracyCountsTheLowestIndexOfTiedLogits) {
  // A zero final LayerNorm makes every logit 0: each scored position is then
  // "predicted" as token 0 (ties go to the lowest id), in every layout, and
  // the loss is exactly log(vocab) per scored token.
  model_.vocab = 40;
  std::mt19937 rng(5);
  std::vector<Tensor> targets;
  int64_t zeros = 0, scored = 0;
  for (int mb = 0; mb < 2; ++mb) {
    targets.push_back(RandomIds(rng, 2, 12, 3));  // ids 0, 1, 2
    Tensor& t = targets.back();
    for (int64_t i = 0; i < t.numel(); ++i) {
      if (i % 4 == 3) t.i32()[i] = -1;
      scored += t.i32()[i] >= 0;
      zeros += t.i32()[i] == 0;
    }
  }
  ASSERT_GT(zeros, 0);
  ASSERT_LT(zeros, scored);
  const std::vector<float> zero(model_.d_model, 0.0f);
  const struct { int pp, tp; bool vocab_parallel; } layouts[] = {
      {1, 1, false}, {2, 2, false}, {1, 4, true}};
  for (const auto& layout : layouts) {
    SCOPED_TRACE(::testing::Message() << "pp=" << layout.pp << " tp=" << layout.tp
                                      << " vocab_parallel=" << layout.vocab_parallel);
    auto m = InProcModel::Create(model_, layout.pp, layout.tp, 42, 2, layout.vocab_parallel);
    ASSERT_TRUE(m.ok());
    ASSERT_TRUE((*m)->SetParameter("ln_f.weight", zero).ok());
    auto loss = (*m)->ForwardBackward(tokens_, targets);
    ASSERT_TRUE(loss.ok()) << loss.status();
    EXPECT_NEAR(*loss, std::log(40.0), 1e-6);
    const StepScore got = (*m)->stage(layout.pp - 1, 0).score();
    EXPECT_EQ(got.tokens, scored);
    EXPECT_EQ(got.correct, zeros);
  }
}

TEST_F(GptStageTest, SameLayoutTwiceGivesIdenticalBits) {
  std::vector<std::vector<float>> first;
  for (int run = 0; run < 2; ++run) {
    double loss = 0;
    auto m = Run(2, 2, &loss);
    ASSERT_TRUE(m->OptimizerStep(kernels::AdamWConfig{}, 1.0).ok());
    ASSERT_TRUE(m->ForwardBackward(tokens_, targets_).ok());
    std::vector<std::vector<float>> got;
    for (const std::string& name : m->ParameterNames()) {
      got.push_back(Full(m->FullValue(name)));
      got.push_back(Full(m->FullGrad(name)));
    }
    if (run == 0) {
      first = got;
    } else {
      ASSERT_EQ(first.size(), got.size());
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_EQ(std::memcmp(first[i].data(), got[i].data(), got[i].size() * sizeof(float)), 0);
      }
    }
  }
}

TEST_F(GptStageTest, TwoMicrobatchesAccumulateLikeOneBatch) {
  auto split = InProcModel::Create(model_, 1, 1, 42, /*microbatches=*/2, false);
  auto whole = InProcModel::Create(model_, 1, 1, 42, /*microbatches=*/1, false);
  ASSERT_TRUE(split.ok() && whole.ok());
  // The two [2, 12] microbatches stacked into one [4, 12] batch.
  auto stack = [](const std::vector<Tensor>& parts) {
    Tensor out = Tensor::Zeros({4, 12}, kernels::DType::kInt32);
    std::memcpy(out.i32(), parts[0].i32(), parts[0].bytes());
    std::memcpy(out.i32() + parts[0].numel(), parts[1].i32(), parts[1].bytes());
    return out;
  };
  auto split_loss = (*split)->ForwardBackward(tokens_, targets_);
  auto whole_loss = (*whole)->ForwardBackward({stack(tokens_)}, {stack(targets_)});
  ASSERT_TRUE(split_loss.ok() && whole_loss.ok());
  EXPECT_NEAR(*split_loss, *whole_loss, 1e-6);
  for (const std::string& name : (*whole)->ParameterNames()) {
    EXPECT_LT(RelError(Full((*split)->FullGrad(name)), Full((*whole)->FullGrad(name))), 1e-5) << name;
  }
}

TEST_F(GptStageTest, InterleavedOrderGivesTheSameBitsAsAllForwardsFirst) {
  // Three microbatches on a two-stage pipeline, with forwards and backwards
  // interleaved (F0 B0 F1 B1 F2 B2: one microbatch alive at a time) and as
  // GPipe runs them (all forwards, then all backwards).
  std::mt19937 rng(3);
  std::vector<Tensor> tokens, targets;
  for (int mb = 0; mb < 3; ++mb) {
    tokens.push_back(RandomIds(rng, 2, 12, model_.vocab));
    targets.push_back(RandomIds(rng, 2, 12, model_.vocab));
  }
  auto run = [&](bool one_f_one_b) {
    std::vector<std::unique_ptr<GptStage>> stages;
    for (int s = 0; s < 2; ++s) {
      auto config = MakeStageConfig(model_, s, 2, 0, 1, /*seed=*/9);
      EXPECT_TRUE(config.ok());
      config->microbatches = 3;
      stages.push_back(*GptStage::Create(*config, nullptr));
    }
    std::vector<Tensor> acts, grads;
    for (int mb = 0; mb < 3; ++mb) {
      acts.push_back(Tensor::Zeros({2, 12, model_.d_model}));
      grads.push_back(Tensor::Zeros({2, 12, model_.d_model}));
    }
    auto forward = [&](int mb) {
      StageInputs first, last;
      first.tokens = tokens[mb];
      last.activations = acts[mb];
      last.targets = targets[mb];
      EXPECT_TRUE(stages[0]->Forward(mb, first, acts[mb]).ok());
      EXPECT_TRUE(stages[1]->Forward(mb, last, Tensor()).ok());
    };
    auto backward = [&](int mb) {
      EXPECT_TRUE(stages[1]->Backward(mb, Tensor(), grads[mb]).ok());
      EXPECT_TRUE(stages[0]->Backward(mb, grads[mb], Tensor()).ok());
    };
    for (int mb = 0; mb < 3; ++mb) {
      forward(mb);
      if (one_f_one_b) backward(mb);
    }
    EXPECT_EQ(stages[1]->microbatches_in_flight(), one_f_one_b ? 0 : 3);
    if (!one_f_one_b) {
      for (int mb = 0; mb < 3; ++mb) backward(mb);
    }
    std::vector<float> out;
    for (auto& stage : stages) {
      const Tensor& g = stage->parameters().grads();
      out.insert(out.end(), g.f32(), g.f32() + g.numel());
    }
    out.push_back(static_cast<float>(stages[1]->MeanLoss()));
    return out;
  };
  const std::vector<float> gpipe = run(false), one_f_one_b = run(true);
  ASSERT_EQ(gpipe.size(), one_f_one_b.size());
  EXPECT_EQ(std::memcmp(gpipe.data(), one_f_one_b.data(), gpipe.size() * sizeof(float)), 0);
}

TEST_F(GptStageTest, TinyModelOverfitsAFixedBatch) {
  GptConfig tiny;
  tiny.layers = 2;
  tiny.d_model = 32;
  tiny.heads = 2;
  tiny.vocab = 16;
  tiny.seq_len = 8;
  ExpectMemorisesAFixedBatch(tiny);
}

TEST_F(GptStageTest, ActivationsAreFreedAndArenaMemoryReused) {
  auto m = InProcModel::Create(model_, 1, 1, 42, 2, false);
  ASSERT_TRUE(m.ok());
  GptStage& stage = (*m)->stage(0, 0);
  ASSERT_TRUE((*m)->ForwardBackward(tokens_, targets_).ok());
  EXPECT_EQ(stage.microbatches_in_flight(), 0);
  const int64_t after_first = stage.activation_system_allocations();
  ASSERT_TRUE((*m)->ForwardBackward(tokens_, targets_).ok());
  ASSERT_TRUE((*m)->ForwardBackward(tokens_, targets_).ok());
  EXPECT_EQ(stage.activation_system_allocations(), after_first);
}

TEST(GptConfigTest, ReadsTheJobSpecModel) {
  baton::v1::ModelSpec spec;
  spec.set_layers(4);
  spec.set_d_model(32);
  spec.set_heads(4);
  spec.set_vocab(37);
  spec.set_seq_len(16);
  const GptConfig c = GptConfigFromSpec(spec);
  EXPECT_TRUE(ValidateGptConfig(c).ok());
  EXPECT_EQ(c.head_dim(), 8);
  EXPECT_EQ(c.ffn_dim(), 128);
  auto ranges = SplitLayers(c.layers, 3);  // 2 + 1 + 1
  ASSERT_TRUE(ranges.ok());
  EXPECT_EQ((*ranges)[0].count, 2);
  EXPECT_EQ((*ranges)[2].first, 3);
}

TEST(GptConfigTest, BadConfigsNameTheField) {
  GptConfig c = SmallModel();
  c.heads = 5;  // does not divide 32
  auto s = MakeStageConfig(c, 0, 1, 0, 1, 0);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("model.heads"), absl::string_view::npos) << s.status();

  c = SmallModel();
  s = MakeStageConfig(c, 0, 1, 0, /*tp_size=*/3, 0);  // 3 does not divide 4 heads
  EXPECT_NE(s.status().message().find("parallel.tp"), absl::string_view::npos) << s.status();

  s = MakeStageConfig(c, 0, /*pp_size=*/5, 0, 1, 0);  // 5 stages for 4 layers
  EXPECT_NE(s.status().message().find("parallel.pp"), absl::string_view::npos) << s.status();

  c.vocab = 0;
  s = MakeStageConfig(c, 0, 1, 0, 1, 0);
  EXPECT_NE(s.status().message().find("model.vocab"), absl::string_view::npos) << s.status();

  auto stage_config = MakeStageConfig(SmallModel(), 0, 1, 0, 2, 0);
  ASSERT_TRUE(stage_config.ok());
  auto stage = GptStage::Create(*stage_config, /*tp_group=*/nullptr);
  EXPECT_NE(stage.status().message().find("parallel.tp"), absl::string_view::npos);
}

TEST_F(GptStageTest, BadInputsAreErrorsNotCrashes) {
  auto config = MakeStageConfig(model_, 0, 1, 0, 1, 0);
  ASSERT_TRUE(config.ok());
  auto stage = GptStage::Create(*config, nullptr);
  ASSERT_TRUE(stage.ok());
  std::mt19937 rng(1);
  StageInputs in;
  in.tokens = RandomIds(rng, 1, 4, model_.vocab);
  in.targets = RandomIds(rng, 1, 4, model_.vocab);

  in.tokens.i32()[2] = model_.vocab;  // one past the vocabulary
  absl::Status st = (*stage)->Forward(0, in, Tensor());
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("tokens[2]"), absl::string_view::npos) << st;
  in.tokens.i32()[2] = 0;

  in.targets.i32()[0] = -2;  // -1 means "ignored"; other negative ids are errors
  st = (*stage)->Forward(0, in, Tensor());
  EXPECT_NE(st.message().find("targets[0]"), absl::string_view::npos) << st;
  in.targets.i32()[0] = 0;

  StageInputs longer;
  longer.tokens = RandomIds(rng, 1, model_.seq_len + 1, model_.vocab);
  longer.targets = RandomIds(rng, 1, model_.seq_len + 1, model_.vocab);
  st = (*stage)->Forward(0, longer, Tensor());
  EXPECT_NE(st.message().find("model.seq_len"), absl::string_view::npos) << st;

  EXPECT_EQ((*stage)->BackwardWeight(0).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE((*stage)->Forward(0, in, Tensor()).ok());
  EXPECT_EQ((*stage)->Forward(0, in, Tensor()).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*stage)->BackwardWeight(0).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*stage)->OptimizerStep({}, 1.0f).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE((*stage)->Backward(0, Tensor(), Tensor()).ok());
  EXPECT_TRUE((*stage)->OptimizerStep({}, 1.0f).ok());
}

// Out-of-memory advice goes on memory errors only, once: a communicator's
// bound on early messages or a workspace bound says what to change itself.
TEST(OutOfMemoryAdviceTest, NamesWhatToLowerForMemoryOnlyAndOnce) {
  const absl::Status device = WithOutOfMemoryAdvice(
      WithContext(kernels::OutOfMemoryError("cudaMalloc of 8 bytes on cuda:0: out of device memory"), "Forward(0)"));
  EXPECT_TRUE(kernels::IsOutOfMemory(device)) << device;
  EXPECT_NE(device.message().find("Forward(0): cudaMalloc of 8 bytes on cuda:0: out of device memory; lower "
                                  "train.micro_batch_size"),
            std::string::npos)
      << device;
  EXPECT_EQ(WithOutOfMemoryAdvice(device), device);
  const absl::Status early = absl::ResourceExhaustedError(
      "connection to rank 1: a 9-byte message (tag 3) arrived before its receive was posted, over the limit of 8 "
      "bytes held for receives not yet posted");
  EXPECT_EQ(WithOutOfMemoryAdvice(early), early);
  const absl::Status other = absl::InternalError("out of device memory");
  EXPECT_EQ(WithOutOfMemoryAdvice(other), other);
}

// A stage whose parameters the host cannot hold (256 TiB of values, more
// than any x86-64 address space) is an out-of-memory error naming the bytes,
// never an abort: the worker fails Configure and stays up.
TEST(ParameterStoreTest, ParametersTheHostCannotHoldAreOutOfMemoryNotACrash) {
  ParameterSpec spec;
  spec.name = "huge";
  spec.full_shape = {int64_t{1} << 46};
  spec.shard = ShardSpec::Replicated(int64_t{1} << 46);
  absl::StatusOr<ParameterStore> store = ParameterStore::Create({spec}, 0, 1);
  ASSERT_FALSE(store.ok());
  EXPECT_TRUE(kernels::IsOutOfMemory(store.status())) << store.status();
  EXPECT_NE(store.status().message().find("the parameter values (281474976710656 bytes): out of host memory"),
            std::string::npos)
      << store.status();
}

// The gradients and AdamW moments are allocated on the store's device when it
// is placed, not first on the host; before that only the values exist.
TEST(ParameterStoreTest, GradientsAndMomentsComeWithPlace) {
  ParameterSpec spec;
  spec.name = "w";
  spec.full_shape = {2, 3};
  spec.shard = ShardSpec::Replicated(6);
  absl::StatusOr<ParameterStore> store = ParameterStore::Create({spec}, 0, 1);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_TRUE(store->values().defined());
  EXPECT_FALSE(store->grads().defined());
  EXPECT_FALSE(store->Find("w")->grad.defined());
  ASSERT_TRUE(store->Place(kernels::Device::Cpu()).ok());
  ASSERT_TRUE(store->grads().defined());
  EXPECT_EQ(store->Find("w")->grad.shape(), (kernels::Shape{2, 3}));
  EXPECT_EQ(store->Find("w")->adam_v.address(), store->adam_v().address());
  EXPECT_TRUE(store->Place(kernels::Device::Cpu()).ok()) << "placing it again where it is changes nothing";
}

// ZeRO-1: each DP rank owns an aligned, padded shard of the flat buffer; the
// moments shrink to it, the values and gradients are padded to the whole
// group's shards (padding zero), and the values survive the placement.
TEST(ParameterStoreTest, ShardingOverDpKeepsTheMomentsOfTheRanksShardOnly) {
  const DpShard whole = DpShard::Of(100, 0, 1);
  EXPECT_FALSE(whole.sharded());
  EXPECT_EQ(whole.count, 100);
  const DpShard last = DpShard::Of(100, 2, 3);  // ceil(100 / 3) = 34, aligned to 48
  EXPECT_TRUE(last.sharded());
  EXPECT_EQ(last.count, 48);
  EXPECT_EQ(last.begin, 96);
  EXPECT_EQ(last.padded(), 144);

  ParameterSpec a, b;
  a.name = "a";
  a.full_shape = {10, 7};
  a.shard = ShardSpec::Replicated(70);
  a.init = InitKind::kOnes;
  b.name = "b";
  b.full_shape = {30};
  b.shard = ShardSpec::Replicated(30);
  absl::StatusOr<ParameterStore> plain = ParameterStore::Create({a, b}, 0, 1);
  absl::StatusOr<ParameterStore> store = ParameterStore::Create({a, b}, 0, 1);
  ASSERT_TRUE(plain.ok() && store.ok());
  EXPECT_EQ(store->ShardOverDp(3, 3).code(), absl::StatusCode::kInvalidArgument) << "rank outside the group";
  ASSERT_TRUE(store->ShardOverDp(2, 3).ok());
  store->Initialize(1);
  ASSERT_TRUE(plain->Place(kernels::Device::Cpu()).ok());
  ASSERT_TRUE(store->Place(kernels::Device::Cpu()).ok());
  EXPECT_EQ(store->ShardOverDp(0, 3).code(), absl::StatusCode::kFailedPrecondition) << "after Place";
  EXPECT_EQ(store->values().numel(), 100);
  EXPECT_EQ(store->padded_values().numel(), 144);
  EXPECT_EQ(store->padded_grads().numel(), 144);
  EXPECT_EQ(store->adam_m().numel(), 48);
  EXPECT_EQ(store->shard_grads().numel(), 48);
  EXPECT_EQ(store->shard_values().address(), store->padded_values().f32() + 96);
  EXPECT_FALSE(store->Find("a")->adam_m.defined()) << "a parameter's moments may be cut by the shard";
  EXPECT_EQ(store->Find("b")->offset, 70);
  EXPECT_EQ(store->Find("a")->value.f32()[69], 1.0f) << "the values moved into the padded buffer";
  EXPECT_EQ(store->padded_values().f32()[100], 0.0f);
  const ParameterStore::MemoryBytes p = plain->memory_bytes(), z = store->memory_bytes();
  EXPECT_EQ(z.optimizer, 2 * 48 * 4);
  EXPECT_LT(z.optimizer, p.optimizer);
  EXPECT_EQ(z.weights, 144 * 4);
  EXPECT_EQ(z.grads, (144 + 48) * 4);
}

}  // namespace
}  // namespace baton::model
