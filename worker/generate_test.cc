// Tests of worker/generate.h: the sampler on hand-made logits, GptStage::
// ForwardLogits against the training path's own loss and argmax, a model
// built so that its greedy continuation is known, and `baton-worker
// generate`'s command line on a checkpoint written to disk.
#include "worker/generate.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/checkpoint_manifest.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/tensor.h"
#include "worker/model/gpt_config.h"
#include "worker/model/gpt_stage.h"
#include "worker/checkpoint/checkpoint.h"
#include "worker/model/inproc_model.h"
#include "worker/model/parameters.h"

namespace baton::generate {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using kernels::Tensor;

std::string Message(const absl::Status& s) { return std::string(s.message()); }

TEST(ArgmaxTokenTest, IsTheLargestLogitAndTheLowestIdOnTies) {
  EXPECT_EQ(*ArgmaxToken(std::vector<float>{0.5f, 2.0f, -1.0f}), 1);
  EXPECT_EQ(*ArgmaxToken(std::vector<float>{1.0f, 3.0f, 3.0f, 2.0f}), 1);
  EXPECT_EQ(*ArgmaxToken(std::vector<float>{7.0f, 7.0f, 7.0f}), 0);
  EXPECT_EQ(*ArgmaxToken(std::vector<float>{-5.0f}), 0);
  EXPECT_THAT(Message(ArgmaxToken(std::vector<float>{0.0f, NAN}).status()), HasSubstr("token 1 is nan"));
  EXPECT_FALSE(ArgmaxToken(std::vector<float>{}).ok());
}

TEST(TokenSamplerTest, TemperatureZeroIsGreedyWhateverTheSeed) {
  for (uint64_t seed : {0, 1, 99}) {
    TokenSampler sampler({/*temperature=*/0, /*top_k=*/0, seed});
    EXPECT_EQ(*sampler.Next(std::vector<float>{1.0f, 4.0f, 4.0f, 0.0f}), 1);
    EXPECT_EQ(*sampler.Next(std::vector<float>{9.0f, 4.0f}), 0);
  }
  // top_k = 1 keeps the argmax only, so sampling is greedy too (ties: lowest id).
  TokenSampler top1({/*temperature=*/1.0, /*top_k=*/1, /*seed=*/5});
  for (int i = 0; i < 20; ++i) EXPECT_EQ(*top1.Next(std::vector<float>{1.0f, 4.0f, 4.0f, 0.0f}), 1);
}

std::vector<int32_t> Draw(const SamplingOptions& options, const std::vector<float>& logits, int n) {
  TokenSampler sampler(options);
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) out.push_back(*sampler.Next(logits));
  return out;
}

TEST(TokenSamplerTest, TheSameSeedGivesTheSameTokensAndAnotherSeedOthers) {
  const std::vector<float> flat(64, 0.0f);  // uniform over 64 tokens
  const std::vector<int32_t> a = Draw({1.0, 0, 7}, flat, 32);
  EXPECT_EQ(Draw({1.0, 0, 7}, flat, 32), a);
  EXPECT_NE(Draw({1.0, 0, 8}, flat, 32), a);
  EXPECT_NE(Draw({1.0, 0, 0}, flat, 32), a);
}

TEST(TokenSamplerTest, DrawsFollowSoftmaxOfLogitsOverTemperature) {
  const std::vector<float> logits = {0.0f, static_cast<float>(std::log(3.0))};  // p = 1/4, 3/4 at T = 1
  const int n = 20000;
  auto share_of_one = [&](double temperature) {
    int ones = 0;
    for (int32_t t : Draw({temperature, 0, 3}, logits, n)) ones += t == 1;
    return static_cast<double>(ones) / n;
  };
  EXPECT_NEAR(share_of_one(1.0), 0.75, 0.015);
  EXPECT_NEAR(share_of_one(2.0), std::sqrt(3.0) / (1 + std::sqrt(3.0)), 0.015);  // weights 1 : 3^(1/2)
  EXPECT_NEAR(share_of_one(1e-3), 1.0, 1e-9);  // a tiny temperature is greedy in effect
}

TEST(TokenSamplerTest, TopKKeepsTheKLargestCuttingTiesByLowestId) {
  const std::vector<float> logits = {5.0f, 1.0f, 5.0f, 5.0f, 4.0f};
  std::vector<int> seen(logits.size());
  for (int32_t t : Draw({/*temperature=*/50.0, /*top_k=*/2, /*seed=*/11}, logits, 2000)) ++seen[t];
  EXPECT_GT(seen[0], 0);
  EXPECT_GT(seen[2], 0);
  EXPECT_EQ(seen[1] + seen[3] + seen[4], 0);  // 3 ties with 0 and 2 but has the higher id
  // k at or beyond the vocabulary keeps every token.
  std::vector<int> all(logits.size());
  for (int32_t t : Draw({50.0, 99, 11}, logits, 2000)) ++all[t];
  for (int count : all) EXPECT_GT(count, 0);
}

TEST(SamplingOptionsTest, BadValuesNameTheFlag) {
  EXPECT_TRUE(ValidateSamplingOptions({0, 0, 0}).ok());
  EXPECT_TRUE(ValidateSamplingOptions({0.7, 40, 1}).ok());
  EXPECT_THAT(Message(ValidateSamplingOptions({-1, 0, 0})), HasSubstr("--temperature=-1"));
  EXPECT_THAT(Message(ValidateSamplingOptions({NAN, 0, 0})), HasSubstr("--temperature"));
  EXPECT_THAT(Message(ValidateSamplingOptions({std::numeric_limits<double>::infinity(), 0, 0})),
              HasSubstr("--temperature"));
  EXPECT_THAT(Message(ValidateSamplingOptions({1, -3, 0})), HasSubstr("--top_k=-3"));
  const std::vector<float> nan = {0.0f, NAN};
  TokenSampler sampler({1.0, 0, 0});
  EXPECT_THAT(Message(sampler.Next(nan).status()), HasSubstr("not finite"));
}

TEST(ContextWindowTest, IsTheLastSeqLenTokens) {
  const std::vector<int32_t> tokens = {1, 2, 3, 4, 5};
  EXPECT_THAT(ContextWindow(tokens, 3), ElementsAre(3, 4, 5));
  EXPECT_THAT(ContextWindow(tokens, 5), ElementsAre(1, 2, 3, 4, 5));
  EXPECT_THAT(ContextWindow(tokens, 8), ElementsAre(1, 2, 3, 4, 5));
}

// ---- On a real GPT ----

model::GptConfig SmallConfig() {
  model::GptConfig c;
  c.layers = 2;
  c.d_model = 16;
  c.heads = 2;
  c.vocab = 32;
  c.seq_len = 8;
  return c;
}

std::unique_ptr<model::GptStage> WholeModel(const model::GptConfig& config, uint64_t seed) {
  auto stage_config = model::MakeStageConfig(config, 0, 1, 0, 1, seed);
  EXPECT_TRUE(stage_config.ok()) << stage_config.status();
  auto stage = model::GptStage::Create(*stage_config, nullptr);
  EXPECT_TRUE(stage.ok()) << stage.status();
  return *std::move(stage);
}

// The full tensors of a whole-model stage (tp = 1: its shards are whole).
std::map<std::string, checkpoint::FullTensor> WeightsOf(const model::GptStage& stage) {
  std::map<std::string, checkpoint::FullTensor> out;
  for (const model::Parameter& p : stage.parameters().parameters()) {
    checkpoint::FullTensor& t = out[p.spec.name];
    t.shape.assign(p.spec.full_shape.begin(), p.spec.full_shape.end());
    t.values = *model::ParameterStore::ToHost(p.value);
  }
  return out;
}

Tensor Ids(const std::vector<int32_t>& ids) {
  Tensor t = Tensor::Zeros({1, static_cast<int64_t>(ids.size())}, kernels::DType::kInt32);
  std::copy(ids.begin(), ids.end(), t.i32());
  return t;
}

TEST(ForwardLogitsTest, GivesTheLogitsTheTrainingLossIsComputedFrom) {
  const model::GptConfig config = SmallConfig();
  auto stage = WholeModel(config, 7);
  const std::vector<int32_t> tokens = {3, 9, 1, 30, 4, 4, 17, 2};
  const std::vector<int32_t> targets = {9, 1, 30, 4, 4, 17, 2, 11};
  const int64_t t = 8, v = config.vocab;
  Tensor logits = Tensor::Zeros({1, t, v});
  model::StageInputs in;
  in.tokens = Ids(tokens);
  ASSERT_TRUE(stage->ForwardLogits(in, logits).ok());
  ASSERT_TRUE(stage->stream().Synchronize().ok());
  EXPECT_EQ(stage->microbatches_in_flight(), 0);
  EXPECT_EQ(stage->score().tokens, 0);  // no loss was scored
  // Mean cross-entropy and argmax hits from our logits, in double.
  double loss = 0;
  int64_t hits = 0;
  for (int64_t i = 0; i < t; ++i) {
    const float* row = logits.f32() + i * v;
    double max = row[0], sum = 0;
    for (int64_t j = 0; j < v; ++j) max = std::max<double>(max, row[j]);
    for (int64_t j = 0; j < v; ++j) sum += std::exp(row[j] - max);
    loss += max + std::log(sum) - row[targets[i]];
    hits += *ArgmaxToken(absl::MakeConstSpan(row, v)) == targets[i];
  }
  loss /= t;
  // The training forward of the same tokens and targets.
  stage->ZeroGrad();
  in.targets = Ids(targets);
  ASSERT_TRUE(stage->Forward(0, in, Tensor()).ok());
  const model::StepScore score = stage->score();
  EXPECT_NEAR(loss, score.loss_sum / score.tokens, 1e-5);
  EXPECT_EQ(hits, score.correct);
  // Between steps only.
  EXPECT_EQ(stage->ForwardLogits(in, logits).code(), absl::StatusCode::kFailedPrecondition);
  stage->DropInFlight();
  EXPECT_THAT(Message(stage->ForwardLogits(in, Tensor::Zeros({1, t, v + 1}))),
              HasSubstr("logits: want float [1, 8, 32]"));
}

TEST(GeneratorTest, GreedyIsTheModelsOwnArgmaxThroughTheSlidingWindow) {
  const model::GptConfig config = SmallConfig();
  auto reference = WholeModel(config, 7);
  auto generator = Generator::Create(config, WeightsOf(*reference), kernels::Device::Cpu());
  ASSERT_TRUE(generator.ok()) << generator.status();
  const std::vector<int32_t> prompt = {5, 6, 7};
  const int64_t n = 12;  // runs past seq_len = 8: the window slides
  auto tokens = (*generator)->Generate(prompt, n, {});
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  ASSERT_EQ(tokens->size(), static_cast<size_t>(n));
  // Each token is what the training path's argmax scores a hit for at the
  // last position of the window before it (seed-7 weights, set independently).
  std::vector<int32_t> all = prompt;
  for (int32_t next : *tokens) {
    const absl::Span<const int32_t> window = ContextWindow(all, config.seq_len);
    std::vector<int32_t> targets(window.size(), -1);
    targets.back() = next;
    reference->ZeroGrad();
    model::StageInputs in;
    in.tokens = Ids({window.begin(), window.end()});
    in.targets = Ids(targets);
    ASSERT_TRUE(reference->Forward(0, in, Tensor()).ok());
    EXPECT_EQ(reference->score().correct, 1) << "token " << all.size() << " = " << next;
    reference->DropInFlight();
    all.push_back(next);
  }
  // A prompt longer than seq_len is its last seq_len tokens.
  const std::vector<int32_t> long_prompt = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
  const std::vector<int32_t> tail = {4, 5, 6, 7, 8, 9, 10, 11};
  EXPECT_EQ(*(*generator)->Generate(long_prompt, 10, {}), *(*generator)->Generate(tail, 10, {}));
}

TEST(GeneratorTest, SamplingIsSeeded) {
  const model::GptConfig config = SmallConfig();
  auto generator = Generator::Create(config, WeightsOf(*WholeModel(config, 3)), kernels::Device::Cpu());
  ASSERT_TRUE(generator.ok()) << generator.status();
  const std::vector<int32_t> prompt = {1};
  auto a = (*generator)->Generate(prompt, 16, {1.0, 0, 42});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(*(*generator)->Generate(prompt, 16, {1.0, 0, 42}), *a);
  EXPECT_NE(*(*generator)->Generate(prompt, 16, {1.0, 0, 43}), *a);
  EXPECT_TRUE((*generator)->Generate(prompt, 0, {})->empty());
}

TEST(GeneratorTest, BadInputsAreErrorsNamingTheFlag) {
  const model::GptConfig config = SmallConfig();
  auto weights = WeightsOf(*WholeModel(config, 3));
  auto generator = Generator::Create(config, weights, kernels::Device::Cpu());
  ASSERT_TRUE(generator.ok()) << generator.status();
  Generator& g = **generator;
  EXPECT_THAT(Message(g.Generate({}, 4, {}).status()), HasSubstr("--prompt_tokens is empty"));
  EXPECT_THAT(Message(g.Generate(std::vector<int32_t>{1, 32}, 4, {}).status()),
              HasSubstr("--prompt_tokens: token 32 (position 1) is outside [0, vocab = 32)"));
  EXPECT_THAT(Message(g.Generate(std::vector<int32_t>{1}, kMaxNewTokens + 1, {}).status()),
              HasSubstr("--max_new_tokens=1048577"));
  EXPECT_THAT(Message(g.Generate(std::vector<int32_t>{1}, -1, {}).status()), HasSubstr("--max_new_tokens=-1"));
  EXPECT_THAT(Message(g.Generate(std::vector<int32_t>{1}, 1, {-0.5, 0, 0}).status()), HasSubstr("--temperature"));

  auto missing = weights;
  missing.erase("h.1.mlp.c_fc.bias");
  EXPECT_THAT(Message(Generator::Create(config, missing, kernels::Device::Cpu()).status()),
              HasSubstr("no tensor h.1.mlp.c_fc.bias"));
  auto reshaped = weights;
  reshaped["wpe"].shape = {4, 32};
  EXPECT_THAT(Message(Generator::Create(config, reshaped, kernels::Device::Cpu()).status()),
              HasSubstr("tensor wpe has shape [4,32], its model wants [8,16]"));
  auto extra = weights;
  extra["h.2.ln_1.weight"] = weights["h.1.ln_1.weight"];
  EXPECT_THAT(Message(Generator::Create(config, extra, kernels::Device::Cpu()).status()),
              HasSubstr("holds tensor h.2.ln_1.weight"));
}

// ---- A model whose greedy continuation is known: token i → i + 1 ----
//
// One block; every weight zero but: wte = 4·one-hot rows (d_model = vocab),
// the LayerNorm gains 1, the MLP's c_fc the identity on its first d_model
// units and its c_proj 10 × the shift permutation (unit i → row i + 1 mod V).
// Attention contributes nothing (zero QKV and projection), so the residual
// after the block is 4·e_i + 10·gelu(LN(4·e_i)) shifted, whose largest entry
// is at i + 1; the tied head then puts the largest logit on token i + 1.
std::map<std::string, checkpoint::FullTensor> ShiftWeights(const model::GptConfig& c) {
  auto stage_config = model::MakeStageConfig(c, 0, 1, 0, 1, 0);
  std::map<std::string, checkpoint::FullTensor> out;
  for (const model::ParameterSpec& spec : model::StageParameterSpecs(*stage_config)) {
    checkpoint::FullTensor& t = out[spec.name];
    t.shape.assign(spec.full_shape.begin(), spec.full_shape.end());
    t.values.assign(checkpoint::NumElements(t.shape), 0.0f);
  }
  const int64_t d = c.d_model, f = c.ffn_dim();
  for (int64_t i = 0; i < c.vocab; ++i) out["wte"].values[i * d + i] = 4.0f;
  for (const char* ln : {"h.0.ln_1.weight", "h.0.ln_2.weight", "ln_f.weight"}) {
    std::fill(out[ln].values.begin(), out[ln].values.end(), 1.0f);
  }
  for (int64_t i = 0; i < d; ++i) out["h.0.mlp.c_fc.weight"].values[i * d + i] = 1.0f;  // [f, d]
  for (int64_t i = 0; i < d; ++i) out["h.0.mlp.c_proj.weight"].values[((i + 1) % d) * f + i] = 10.0f;  // [d, f]
  return out;
}

model::GptConfig ShiftConfig() {
  model::GptConfig c;
  c.layers = 1;
  c.d_model = 16;
  c.heads = 2;
  c.vocab = 16;
  c.seq_len = 4;
  return c;
}

TEST(GeneratorTest, AModelBuiltToCountGeneratesTheNextIds) {
  auto generator = Generator::Create(ShiftConfig(), ShiftWeights(ShiftConfig()), kernels::Device::Cpu());
  ASSERT_TRUE(generator.ok()) << generator.status();
  EXPECT_THAT(*(*generator)->Generate(std::vector<int32_t>{3}, 6, {}), ElementsAre(4, 5, 6, 7, 8, 9));
  EXPECT_THAT(*(*generator)->Generate(std::vector<int32_t>{9, 2, 14}, 3, {}), ElementsAre(15, 0, 1));
  // Low-temperature sampling is (nearly surely) the same.
  EXPECT_THAT(*(*generator)->Generate(std::vector<int32_t>{3}, 3, {0.01, 0, 5}), ElementsAre(4, 5, 6));
}

TEST(GeneratorTest, OnADeviceTheTokensAreTheCpusBits) {
  // The simulated device aborts on host access to its memory: the logits
  // must come back through a device copy.
  const model::GptConfig config = SmallConfig();
  const auto weights = WeightsOf(*WholeModel(config, 5));
  auto cpu = Generator::Create(config, weights, kernels::Device::Cpu());
  auto sim = Generator::Create(config, weights, kernels::Device::Sim(3));
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  ASSERT_TRUE(sim.ok()) << sim.status();
  const std::vector<int32_t> prompt = {2, 4, 6};
  EXPECT_EQ(*(*sim)->NextLogits(prompt), *(*cpu)->NextLogits(prompt));
  EXPECT_EQ(*(*sim)->Generate(prompt, 10, {}), *(*cpu)->Generate(prompt, 10, {}));
  EXPECT_EQ(*(*sim)->Generate(prompt, 10, {0.8, 5, 1}), *(*cpu)->Generate(prompt, 10, {0.8, 5, 1}));
}

// Writes `weights` as a one-shard v2 checkpoint (weights only, no moments).
std::string WriteCheckpoint(const std::string& name, const model::GptConfig& c,
                            const std::map<std::string, checkpoint::FullTensor>& weights) {
  const std::string dir = absl::StrCat(::testing::TempDir(), "/", name);
  mkdir(dir.c_str(), 0755);
  std::vector<checkpoint::StateShardTensor> tensors;
  for (const auto& [tensor_name, t] : weights) {
    checkpoint::StateShardTensor s;
    s.name = tensor_name;
    s.layout.full_shape = t.shape;
    s.values = t.values;
    tensors.push_back(s);
  }
  auto file = checkpoint::WriteStateShardFile(dir, 0, 0, 1, /*optimizer_step=*/0, /*moments=*/false, tensors);
  EXPECT_TRUE(file.ok()) << file.status();
  checkpoint::ManifestInfo info;
  info.job = "generate-test";
  info.model.layers = c.layers;
  info.model.d_model = c.d_model;
  info.model.heads = c.heads;
  info.model.vocab = c.vocab;
  info.model.seq_len = c.seq_len;
  info.files = {*file};
  EXPECT_TRUE(checkpoint::WriteManifest(dir, info).ok());
  return dir;
}

TEST(GeneratorTest, ACheckpointOfAnyLayoutGivesTheSameTokens) {
  // The seed-7 model as pp = 2 × tp = 2 shards (QKV split by heads, MLP and
  // projections split by rows and columns), gathered again by FromCheckpoint.
  const model::GptConfig config = SmallConfig();
  auto sharded = model::InProcModel::Create(config, /*pp=*/2, /*tp=*/2, /*seed=*/7, /*microbatches=*/1,
                                            /*vocab_parallel=*/false);
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  const std::string dir = absl::StrCat(::testing::TempDir(), "/pp2tp2");
  mkdir(dir.c_str(), 0755);
  checkpoint::ManifestInfo info;
  info.job = "generate-test";
  info.model = {false, config.layers, config.d_model, config.heads, config.vocab, config.seq_len, 0};
  info.layout.pp = info.layout.tp = 2;
  for (int pp = 0; pp < 2; ++pp) {
    for (int tp = 0; tp < 2; ++tp) {
      auto shards = checkpoint::ShardsOf((*sharded)->stage(pp, tp).parameters());
      ASSERT_TRUE(shards.ok()) << shards.status();
      std::vector<checkpoint::StateShardTensor> tensors;
      for (const baton::NamedShard& shard : *shards) {
        checkpoint::StateShardTensor t;
        t.name = shard.name;
        t.layout.full_shape.assign(shard.full_shape.begin(), shard.full_shape.end());
        t.layout.split_dim = shard.split_dim;
        t.layout.qkv = shard.qkv;
        t.layout.tp_rank = tp;
        t.layout.tp_size = 2;
        t.values = absl::MakeConstSpan(shard.value.f32(), shard.value.numel());
        tensors.push_back(t);
      }
      auto file = checkpoint::WriteStateShardFile(dir, pp, tp, 2, 0, /*moments=*/false, tensors);
      ASSERT_TRUE(file.ok()) << file.status();
      info.files.push_back(*file);
    }
  }
  ASSERT_TRUE(checkpoint::WriteManifest(dir, info).ok());
  auto from_checkpoint = Generator::FromCheckpoint(dir, kernels::Device::Cpu());
  ASSERT_TRUE(from_checkpoint.ok()) << from_checkpoint.status();
  auto whole = Generator::Create(config, WeightsOf(*WholeModel(config, 7)), kernels::Device::Cpu());
  ASSERT_TRUE(whole.ok()) << whole.status();
  const std::vector<int32_t> prompt = {8, 1, 31};
  EXPECT_EQ(*(*from_checkpoint)->NextLogits(prompt), *(*whole)->NextLogits(prompt));
  EXPECT_EQ(*(*from_checkpoint)->Generate(prompt, 12, {}), *(*whole)->Generate(prompt, 12, {}));
}

struct CommandRun {
  int code;
  std::string out, err;
};

CommandRun Generate(const std::vector<std::string>& args) {
  std::ostringstream out, err;
  const int code = RunGenerate(args, out, err);
  return {code, out.str(), err.str()};
}

TEST(RunGenerateTest, PrintsPromptAndTokensFromACheckpoint) {
  const std::string dir = WriteCheckpoint("shift", ShiftConfig(), ShiftWeights(ShiftConfig()));
  CommandRun r = Generate({dir, "--prompt_tokens=1,2,3", "--max_new_tokens=4"});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, "1 2 3 | 4 5 6 7\n");
  EXPECT_EQ(r.err, "");
  r = Generate({"--format=json", "--prompt_tokens=14", "--max_new_tokens=2", dir});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, "{\"prompt\": [14], \"generated\": [15, 0]}\n");
  r = Generate({dir, "--prompt_tokens=5", "--max_new_tokens=0"});
  EXPECT_EQ(r.out, "5 |\n");
  // Seeded sampling on a checkpoint with random weights.
  const model::GptConfig config = SmallConfig();
  const std::string random = WriteCheckpoint("random", config, WeightsOf(*WholeModel(config, 3)));
  const std::vector<std::string> sample = {random, "--prompt_tokens=1", "--max_new_tokens=16", "--temperature=1",
                                           "--seed=9"};
  r = Generate(sample);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(Generate(sample).out, r.out);
  std::vector<std::string> other = sample;
  other.back() = "--seed=10";
  EXPECT_NE(Generate(other).out, r.out);
}

TEST(RunGenerateTest, BadUsageExitsTwoNamingTheFlagAndAnUnreadableCheckpointOne) {
  const std::string dir = WriteCheckpoint("shift-errors", ShiftConfig(), ShiftWeights(ShiftConfig()));
  struct Case {
    std::vector<std::string> args;
    int code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{dir}, 2, "--prompt_tokens=ID,ID,... is required"},
      {{dir, "--prompt_tokens="}, 2, "--prompt_tokens is empty"},
      {{dir, "--prompt_tokens=1,x"}, 2, "--prompt_tokens: 'x' is not a token id"},
      {{dir, "--prompt_tokens=1,16"}, 2, "token 16 (position 1) is outside [0, vocab = 16)"},
      {{dir, "--prompt_tokens=1", "--max_new_tokens=1048577"}, 2, "--max_new_tokens=1048577 must be in [0, 1048576]"},
      {{dir, "--prompt_tokens=1", "--temperature=hot"}, 2, "--temperature='hot' is not a number"},
      {{dir, "--prompt_tokens=1", "--top_k=-1"}, 2, "--top_k=-1"},
      {{dir, "--prompt_tokens=1", "--seed=-1"}, 2, "--seed='-1'"},
      {{dir, "--prompt_tokens=1", "--format=xml"}, 2, "--format='xml' must be text or json"},
      {{dir, "--prompt_tokens=1", "--device=tpu"}, 2, "--device='tpu'"},
      {{dir, "--prompt_tokens=1", "--bogus=1"}, 2, "unknown flag --bogus"},
      {{"--prompt_tokens=1"}, 2, "want one CHECKPOINT directory, got 0"},
      {{dir + "/nope", "--prompt_tokens=1"}, 1, "no such directory"},
  };
  for (const Case& c : cases) {
    CommandRun r = Generate(c.args);
    EXPECT_EQ(r.code, c.code) << c.message << ": " << r.err;
    EXPECT_THAT(r.err, HasSubstr(c.message));
    EXPECT_THAT(r.err, HasSubstr("baton-worker generate: "));
    EXPECT_EQ(r.out, "");
  }
}

}  // namespace
}  // namespace baton::generate
