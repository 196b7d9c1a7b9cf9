// Tests of `batonctl generate`: the real batonctl execs the real baton-worker
// on checkpoints written here with the checkpoint format's own writer.
#include "cli/generate_cmd.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <map>

#include "absl/strings/str_cat.h"
#include "common/checkpoint_manifest.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/process.h"

namespace baton::cli {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr int kLayers = 1, kDModel = 16, kHeads = 2, kVocab = 16, kSeqLen = 4;

// A GPT whose greedy continuation of token i is i + 1 (mod 16): one block,
// weights zero but wte = 4·one-hot rows (d_model = vocab), LayerNorm gains 1,
// c_fc the identity on its first 16 units and c_proj 10 × the shift i → i + 1
// (worker/generate_test.cc derives why). Saved as two pipeline chunks, the
// last holding ln_f and its copy of the tied wte, as a pp = 2 run saves it.
std::string WriteCountingCheckpoint(const std::string& name) {
  const int64_t c = kDModel, f = 4 * kDModel;
  std::map<std::string, std::vector<int64_t>> shapes = {
      {"wte", {kVocab, c}},
      {"wpe", {kSeqLen, c}},
      {"h.0.ln_1.weight", {c}},
      {"h.0.ln_1.bias", {c}},
      {"h.0.attn.c_attn.weight", {3 * c, c}},
      {"h.0.attn.c_attn.bias", {3 * c}},
      {"h.0.attn.c_proj.weight", {c, c}},
      {"h.0.attn.c_proj.bias", {c}},
      {"h.0.ln_2.weight", {c}},
      {"h.0.ln_2.bias", {c}},
      {"h.0.mlp.c_fc.weight", {f, c}},
      {"h.0.mlp.c_fc.bias", {f}},
      {"h.0.mlp.c_proj.weight", {c, f}},
      {"h.0.mlp.c_proj.bias", {c}},
      {"ln_f.weight", {c}},
      {"ln_f.bias", {c}},
  };
  std::map<std::string, std::vector<float>> values;
  for (const auto& [n, shape] : shapes) values[n].assign(checkpoint::NumElements(shape), 0.0f);
  for (int64_t i = 0; i < kVocab; ++i) values["wte"][i * c + i] = 4.0f;
  for (const char* ln : {"h.0.ln_1.weight", "h.0.ln_2.weight", "ln_f.weight"}) {
    std::fill(values[ln].begin(), values[ln].end(), 1.0f);
  }
  for (int64_t i = 0; i < c; ++i) values["h.0.mlp.c_fc.weight"][i * c + i] = 1.0f;
  for (int64_t i = 0; i < c; ++i) values["h.0.mlp.c_proj.weight"][((i + 1) % c) * f + i] = 10.0f;

  const std::string dir = testing::TempDir(name);
  std::vector<checkpoint::StateShardTensor> chunks[2];
  for (const auto& [n, shape] : shapes) {
    checkpoint::StateShardTensor t;
    t.name = n;
    t.layout.full_shape = shape;
    t.values = values[n];
    const bool last = n.rfind("ln_f.", 0) == 0;
    chunks[last ? 1 : 0].push_back(t);
    if (n == "wte") chunks[1].push_back(t);  // the head's copy
  }
  checkpoint::ManifestInfo info;
  info.job = "counting";
  info.step = 5;
  info.model = {false, kLayers, kDModel, kHeads, kVocab, kSeqLen, 0};
  info.layout.pp = 2;
  for (int chunk = 0; chunk < 2; ++chunk) {
    auto file = checkpoint::WriteStateShardFile(dir, chunk, 0, 1, /*optimizer_step=*/5, /*moments=*/false,
                                                chunks[chunk]);
    EXPECT_TRUE(file.ok()) << file.status();
    info.files.push_back(*file);
  }
  EXPECT_TRUE(checkpoint::WriteManifest(dir, info).ok());
  return dir;
}

testing::CommandResult Batonctl(const std::vector<std::string>& args) {
  return testing::RunCommand(testing::RunfilePath("cli/batonctl"), args, absl::Seconds(60));
}

TEST(GenerateCommandTest, PrintsTheGreedyContinuationOfTheModel) {
  const std::string ckpt = WriteCountingCheckpoint("counting");
  testing::CommandResult r = Batonctl({"generate", ckpt, "--prompt_tokens=1,2,3", "--max_new_tokens=5"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output, "1 2 3 | 4 5 6 7 8\n");
  // Flags before the subcommand, `--flag value`, JSON, and a prompt longer
  // than seq_len = 4 (only its last 4 tokens are seen).
  r = Batonctl({"--format=json", "generate", "--prompt_tokens", "9,10,11,12,13,14", ckpt, "--max_new_tokens=3"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output, "{\"prompt\": [9, 10, 11, 12, 13, 14], \"generated\": [15, 0, 1]}\n");
}

TEST(GenerateCommandTest, SamplingWithASeedRepeatsItself) {
  const std::string ckpt = WriteCountingCheckpoint("sampling");
  // At temperature 20 the counting model's logits (a few units apart) give
  // every token a fair chance.
  const std::vector<std::string> args = {"generate", ckpt, "--prompt_tokens=0", "--max_new_tokens=24",
                                         "--temperature=20", "--seed=1"};
  testing::CommandResult a = Batonctl(args);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  ASSERT_THAT(a.output, ::testing::StartsWith("0 | "));
  EXPECT_EQ(Batonctl(args).output, a.output);
  std::vector<std::string> other = args;
  other.back() = "--seed=2";
  testing::CommandResult b = Batonctl(other);
  EXPECT_EQ(b.exit_code, 0) << b.output;
  EXPECT_NE(b.output, a.output);
  EXPECT_NE(a.output, "0 | 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 0 1 2 3 4 5 6 7 8\n");  // not greedy
  // top_k = 1 is greedy at any temperature.
  std::vector<std::string> top1 = args;
  top1.push_back("--top_k=1");
  EXPECT_EQ(Batonctl(top1).output, "0 | 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 0 1 2 3 4 5 6 7 8\n");
}

TEST(GenerateCommandTest, ErrorsAreOneLineNamingTheFlagWithTheExitCode) {
  const std::string ckpt = WriteCountingCheckpoint("errors");
  struct Case {
    std::vector<std::string> args;
    int code;
    std::string message;
  };
  const std::vector<Case> cases = {
      // batonctl's own checks.
      {{"generate", ckpt}, 2, "batonctl generate: --prompt_tokens=ID,ID,... is required"},
      {{"generate", "--prompt_tokens=1"}, 2, "batonctl generate: want one CHECKPOINT directory, got 0"},
      {{"generate", ckpt, "--prompt_tokens=1", "--topk=3"}, 2, "unknown flag --topk"},
      {{"generate", ckpt, "--prompt_tokens=1", "--bin_dir=/nonexistent"}, 2, "cannot find baton-worker"},
      // The worker's.
      {{"generate", ckpt, "--prompt_tokens=1,16"}, 2,
       "baton-worker generate: --prompt_tokens: token 16 (position 1) is outside [0, vocab = 16)"},
      {{"generate", ckpt, "--prompt_tokens="}, 2, "--prompt_tokens is empty"},
      {{"generate", ckpt, "--prompt_tokens=1", "--max_new_tokens=2000000"}, 2,
       "--max_new_tokens=2000000 must be in [0, 1048576]"},
      {{"generate", ckpt, "--prompt_tokens=1", "--temperature=-1"}, 2, "--temperature=-1"},
      {{"generate", ckpt, "--prompt_tokens=1", "--top_k=-2"}, 2, "--top_k=-2"},
      {{"generate", ckpt, "--prompt_tokens=1", "--device=gpu"}, 2, "--device='gpu'"},
      {{"generate", ckpt + "/missing", "--prompt_tokens=1"}, 1, "no such directory"},
  };
  for (const Case& c : cases) {
    testing::CommandResult r = Batonctl(c.args);
    EXPECT_EQ(r.exit_code, c.code) << c.message << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr(c.message));
    EXPECT_THAT(r.output, ::testing::Not(HasSubstr(" | "))) << "no tokens on failure";
  }
  // A corrupted shard is an error of the checkpoint, exit 1.
  ASSERT_EQ(truncate((ckpt + "/chunk1-tp0.safetensors").c_str(), 40), 0);
  testing::CommandResult r = Batonctl({"generate", ckpt, "--prompt_tokens=1"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("chunk1-tp0.safetensors"));
}

TEST(GenerateCommandTest, FindsTheWorkerInBinDir) {
  const std::string ckpt = WriteCountingCheckpoint("bin_dir");
  const std::string bin = testing::TempDir("bin");
  char real[4096];
  ASSERT_NE(realpath(testing::RunfilePath("worker/baton-worker").c_str(), real), nullptr);
  ASSERT_EQ(symlink(real, (bin + "/baton-worker").c_str()), 0);
  testing::CommandResult r =
      Batonctl({"generate", ckpt, "--prompt_tokens=7", "--max_new_tokens=2", "--bin_dir=" + bin});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output, "7 | 8 9\n");
}

TEST(GenerateWorkerArgsTest, PassesEveryGivenFlagAsNameEqualsValue) {
  std::string bin_dir;
  auto args = GenerateWorkerArgs({"--seed", "4", "ck", "--prompt_tokens=1,2", "--bin_dir=/b", "--format=json"},
                                 &bin_dir);
  ASSERT_TRUE(args.ok()) << args.status();
  EXPECT_THAT(*args, ElementsAre("generate", "ck", "--prompt_tokens=1,2", "--seed=4", "--format=json"));
  EXPECT_EQ(bin_dir, "/b");
  EXPECT_THAT(std::string(GenerateWorkerArgs({"a", "b", "--prompt_tokens=1"}).status().message()),
              HasSubstr("got 2"));
}

}  // namespace
}  // namespace baton::cli
