// transformers' own Llama against baton's: tests/hf/testdata holds tiny
// LlamaForCausalLM models saved by save_pretrained (llama_tiny: grouped-query
// attention, untied head, rope_theta 500000, saved whole and sharded;
// llama_tiny_tied: multi-head attention, tied head) and, for a fixed batch,
// the loss and the gradient of every parameter transformers computed in
// float64 (gen_hf_llama_golden.py). Each directory goes through `batonctl
// checkpoint import-hf`'s importer into a v2 checkpoint, which is loaded into
// baton's model at pp × tp = 1×1, 2×1, 1×2, 2×2 (and 2×2 with the embedding
// and head split by vocabulary rows), and baton's loss and full
// gradients must be transformers'. Bad directories (shapes that disagree
// with config.json, an unsupported field, a missing tensor) are refused
// naming the file and the field or tensor.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "cli/hf_checkpoint.h"
#include "common/checkpoint_manifest.h"
#include "common/file_io.h"
#include "common/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/tensor.h"
#include "worker/model/gpt_config.h"
#include "worker/model/inproc_model.h"

namespace baton {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr char kTestdata[] = "tests/hf/testdata";
constexpr char kGradPrefix[] = "grad/";
// Loss: |baton − HF| / |HF|. Gradients: per tensor, max |baton − HF| over
// its elements divided by max |HF| over its elements. baton computes in
// float32, the golden in float64 on the same float32 weights.
constexpr double kLossTolerance = 1e-5;
constexpr double kGradTolerance = 1e-4;

struct Golden {
  int batch = 0, seq = 0;
  std::vector<int32_t> tokens, targets;
  double loss = 0;
  std::map<std::string, std::vector<double>> grads;  // by baton name
};

Golden LoadGolden(const std::string& name) {
  absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Read(absl::StrCat(kTestdata, "/", name, "_golden.safetensors"));
  EXPECT_TRUE(f.ok()) << f.status();
  Golden g;
  if (!f.ok()) return g;
  g.batch = static_cast<int>(*f->MetadataInt("batch"));
  g.seq = static_cast<int>(*f->MetadataInt("seq_len"));
  const std::vector<int64_t> tokens = *f->Ints("tokens"), targets = *f->Ints("targets");
  g.tokens.assign(tokens.begin(), tokens.end());
  g.targets.assign(targets.begin(), targets.end());
  g.loss = f->Floats("loss")->at(0);
  for (const auto& [tensor, entry] : f->tensors()) {
    if (tensor.rfind(kGradPrefix, 0) == 0) g.grads[tensor.substr(strlen(kGradPrefix))] = *f->Floats(tensor);
  }
  return g;
}

std::string TmpDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return absl::StrCat(tmp ? tmp : "/tmp", "/", name);
}

model::GptConfig ConfigOf(const checkpoint::ModelShape& m) {
  model::GptConfig c;
  c.arch = model::Arch::kLlama;
  c.layers = m.layers;
  c.d_model = m.d_model;
  c.heads = m.heads;
  c.kv_heads = m.kv_heads;
  c.ffn = m.ffn_dim;
  c.vocab = m.vocab;
  c.seq_len = m.seq_len;
  c.rope_theta = m.rope_theta;
  c.norm_eps = m.norm_eps;
  c.tie_embeddings = m.tie_embeddings;
  return c;
}

struct Case {
  std::string dir;     // under testdata
  std::string golden;  // <golden>_golden.safetensors
  int kv_heads;
  float rope_theta;
  bool tied;
};

class HfLlamaGoldenTest : public ::testing::TestWithParam<Case> {};

TEST_P(HfLlamaGoldenTest, BatonLossAndGradientsEqualTransformersAtEveryLayout) {
  const Case& c = GetParam();
  const Golden golden = LoadGolden(c.golden);
  ASSERT_EQ(golden.tokens.size(), static_cast<size_t>(golden.batch * golden.seq));
  const std::string ckpt = TmpDir("ckpt_" + c.dir);
  absl::StatusOr<checkpoint::ModelShape> shape =
      cli::ImportHfCheckpoint(absl::StrCat(kTestdata, "/", c.dir), ckpt, {});
  ASSERT_TRUE(shape.ok()) << shape.status();
  EXPECT_EQ(shape->arch, "llama");
  EXPECT_EQ(shape->layers, 2);
  EXPECT_EQ(shape->d_model, 32);
  EXPECT_EQ(shape->heads, 4);
  EXPECT_EQ(shape->kv_heads, c.kv_heads);
  EXPECT_EQ(shape->ffn_dim, 48);
  EXPECT_EQ(shape->vocab, 64);
  EXPECT_EQ(shape->seq_len, 16);
  EXPECT_EQ(shape->rope_theta, c.rope_theta);
  EXPECT_EQ(shape->norm_eps, 1e-6f);
  EXPECT_EQ(shape->tie_embeddings, c.tied);
  absl::StatusOr<checkpoint::FullState> state = checkpoint::LoadFullState(ckpt);
  ASSERT_TRUE(state.ok()) << state.status();
  // The checkpoint holds exactly the parameters transformers has.
  std::set<std::string> stored, want;
  for (const auto& [name, t] : state->tensors) stored.insert(name);
  for (const auto& [name, g] : golden.grads) want.insert(name);
  ASSERT_EQ(stored, want);
  EXPECT_EQ(stored.count("lm_head.weight"), c.tied ? 0u : 1u);

  const model::GptConfig config = ConfigOf(*shape);
  ASSERT_EQ(config.seq_len, golden.seq);
  kernels::Tensor tokens = kernels::Tensor::Zeros({golden.batch, golden.seq}, kernels::DType::kInt32);
  kernels::Tensor targets = kernels::Tensor::Zeros({golden.batch, golden.seq}, kernels::DType::kInt32);
  std::memcpy(tokens.i32(), golden.tokens.data(), tokens.bytes());
  std::memcpy(targets.i32(), golden.targets.data(), targets.bytes());

  struct Layout {
    int pp, tp;
    bool vocab_parallel;
  };
  for (const Layout l : {Layout{1, 1, false}, Layout{2, 1, false}, Layout{1, 2, false}, Layout{2, 2, false},
                         Layout{2, 2, true}}) {
    const std::string layout =
        absl::StrCat("pp ", l.pp, " tp ", l.tp, l.vocab_parallel ? " vocab-parallel" : "");
    SCOPED_TRACE(layout);
    auto model = model::InProcModel::Create(config, l.pp, l.tp, /*seed=*/7, /*microbatches=*/1, l.vocab_parallel);
    ASSERT_TRUE(model.ok()) << model.status();
    const std::vector<std::string> names = (*model)->ParameterNames();
    ASSERT_EQ(std::set<std::string>(names.begin(), names.end()), want);
    for (const std::string& name : names) {
      ASSERT_TRUE((*model)->SetParameter(name, state->tensors.at(name).values).ok()) << name;
    }
    absl::StatusOr<double> loss = (*model)->ForwardBackward({tokens}, {targets});
    ASSERT_TRUE(loss.ok()) << loss.status();
    const double loss_rel = std::abs(*loss - golden.loss) / std::abs(golden.loss);
    EXPECT_LE(loss_rel, kLossTolerance) << "baton " << *loss << " vs transformers " << golden.loss;

    double worst = 0;
    std::string worst_name;
    for (const std::string& name : names) {
      absl::StatusOr<std::vector<float>> grad = (*model)->FullGrad(name);
      ASSERT_TRUE(grad.ok()) << grad.status();
      const std::vector<double>& hf = golden.grads.at(name);
      ASSERT_EQ(grad->size(), hf.size()) << name;
      double max_abs = 0, max_diff = 0;
      for (size_t i = 0; i < hf.size(); ++i) {
        max_abs = std::max(max_abs, std::abs(hf[i]));
        max_diff = std::max(max_diff, std::abs((*grad)[i] - hf[i]));
      }
      ASSERT_GT(max_abs, 0) << name << ": transformers' gradient is zero; the golden checks nothing";
      const double rel = max_diff / max_abs;
      EXPECT_LE(rel, kGradTolerance) << name << ": max |baton - HF| " << max_diff << ", max |HF| " << max_abs;
      if (rel > worst) {
        worst = rel;
        worst_name = name;
      }
    }
    std::cout << c.dir << " " << layout << ": loss " << *loss << " (transformers "
              << golden.loss << ", rel diff " << loss_rel << "); worst gradient rel diff " << worst << " ("
              << worst_name << ")\n";
  }
}

INSTANTIATE_TEST_SUITE_P(
    LlamaModels, HfLlamaGoldenTest,
    ::testing::Values(Case{"llama_tiny", "llama_tiny", 2, 500000.0f, false},
                      Case{"llama_tiny_sharded", "llama_tiny", 2, 500000.0f, false},
                      Case{"llama_tiny_tied", "llama_tiny_tied", 4, 10000.0f, true}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.dir; });

// ---- bad directories ---------------------------------------------------------

// A copy of testdata/llama_tiny with config.json edited by `config_edits`
// and the tensors in `drop` left out of model.safetensors.
std::string BadCopy(const std::string& name, const std::vector<std::pair<std::string, std::string>>& config_edits,
                    const std::set<std::string>& drop = {}) {
  const std::string src = absl::StrCat(kTestdata, "/llama_tiny");
  const std::string dir = TmpDir(name);
  EXPECT_TRUE(MakeDirectories(dir).ok());
  absl::StatusOr<std::string> config = ReadFile(src + "/config.json");
  EXPECT_TRUE(config.ok()) << config.status();
  const std::string edited = absl::StrReplaceAll(*config, config_edits);
  EXPECT_NE(edited == *config, !config_edits.empty()) << "an edit of " << name << " matched nothing";
  EXPECT_TRUE(WriteFileAtomically(dir + "/config.json", edited).ok());
  absl::StatusOr<SafetensorsFile> weights = SafetensorsFile::Read(src + "/model.safetensors");
  EXPECT_TRUE(weights.ok()) << weights.status();
  SafetensorsWriter out;
  out.SetMetadata("format", "pt");
  for (const auto& [tensor, entry] : weights->tensors()) {
    if (drop.count(tensor) != 0) continue;
    EXPECT_TRUE(out.AddFloat32(tensor, entry.shape, *weights->Float32s(tensor)).ok()) << tensor;
  }
  EXPECT_TRUE(out.WriteFile(dir + "/model.safetensors").ok());
  return dir;
}

absl::Status Import(const std::string& dir) {
  return cli::ImportHfCheckpoint(dir, dir + "_ckpt", {}).status();
}

TEST(HfLlamaBadInputTest, ShapesThatDisagreeWithConfigJsonNameTheTensor) {
  const std::string dir = BadCopy("llama_bad_ffn", {{"\"intermediate_size\": 48", "\"intermediate_size\": 40"}});
  const absl::Status s = Import(dir);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_THAT(s.message(), AllOf(HasSubstr(dir + "/model.safetensors: tensor model.layers.0.mlp.down_proj.weight "
                                                 "has shape [32, 48]"),
                                 HasSubstr("config.json implies [32, 40]")));
  EXPECT_FALSE(checkpoint::ReadManifest(dir + "_ckpt").ok());

  const std::string kv = BadCopy("llama_bad_kv", {{"\"num_key_value_heads\": 2", "\"num_key_value_heads\": 4"}});
  EXPECT_THAT(Import(kv).message(),
              AllOf(HasSubstr("tensor model.layers.0.self_attn.k_proj.weight has shape [16, 32]"),
                    HasSubstr("config.json implies [32, 32]")));
}

TEST(HfLlamaBadInputTest, UnsupportedConfigFieldsAreRefusedByName) {
  struct Bad {
    std::string from, to, want;
  };
  int i = 0;
  for (const Bad& b : {
           Bad{"\"rope_scaling\": null", "\"rope_scaling\": {\"type\": \"linear\", \"factor\": 2.0}",
               "config.json: rope_scaling is set"},
           Bad{"\"hidden_act\": \"silu\"", "\"hidden_act\": \"gelu\"", "config.json: hidden_act must be \"silu\""},
           Bad{"\"attention_bias\": false", "\"attention_bias\": true", "config.json: attention_bias is true"},
           Bad{"\"pretraining_tp\": 1", "\"pretraining_tp\": 2", "config.json: pretraining_tp is 2"},
           Bad{"\"model_type\": \"llama\"", "\"model_type\": \"mistral\"", "config.json: model_type is not"},
       }) {
    const absl::Status s = Import(BadCopy(absl::StrCat("llama_bad_field_", i++), {{b.from, b.to}}));
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_THAT(s.message(), HasSubstr(b.want));
  }
}

TEST(HfLlamaBadInputTest, AMissingTensorIsNamed) {
  const std::string dir = BadCopy("llama_missing_up", {}, {"model.layers.1.mlp.up_proj.weight"});
  EXPECT_THAT(Import(dir).message(),
              HasSubstr(dir + "/model.safetensors: tensor model.layers.1.mlp.up_proj.weight is missing"));
  // An untied model without its head: tie_word_embeddings says why it is needed.
  const std::string head = BadCopy("llama_missing_head", {}, {"lm_head.weight"});
  EXPECT_THAT(Import(head).message(), AllOf(HasSubstr("tensor lm_head.weight is missing"),
                                            HasSubstr("tie_word_embeddings is false")));
}

}  // namespace
}  // namespace baton
