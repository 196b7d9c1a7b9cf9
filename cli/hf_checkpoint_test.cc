#include "cli/hf_checkpoint.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <sstream>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "cli/checkpoint_cmd.h"
#include "common/checkpoint_manifest.h"
#include "common/file_io.h"
#include "common/safetensors.h"
#include "gmock/gmock.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"

namespace baton::cli {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

// A tiny GPT-2: 1 layer, n_embd 8, 2 heads, vocab 10, n_positions 6.
constexpr int kC = 8, kV = 10, kP = 6, kF = 4 * kC;

std::string TmpDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return absl::StrCat(tmp ? tmp : "/tmp", "/", name);
}

bool Exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

std::string Config(const std::string& extra = "") {
  return absl::StrCat(
      "{\"model_type\": \"gpt2\", \"architectures\": [\"GPT2LMHeadModel\"], \"activation_function\": \"gelu_new\", "
      "\"layer_norm_epsilon\": 1e-05, \"n_embd\": ",
      kC, ", \"n_head\": 2, \"n_layer\": 1, \"n_positions\": ", kP, ", \"vocab_size\": ", kV,
      ", \"n_inner\": null, \"scale_attn_weights\": true", extra, "}");
}

struct Tensor {
  std::vector<int64_t> shape;
  std::vector<float> values;
};

// HF names and shapes ([in, out] Conv1D) with distinct values that f16 and
// bf16 hold exactly: v(i) = ((seed * 7 + i) % 64) / 8 − 4.
std::map<std::string, Tensor> HfModel() {
  std::map<std::string, std::vector<int64_t>> shapes = {
      {"transformer.wte.weight", {kV, kC}},
      {"transformer.wpe.weight", {kP, kC}},
      {"transformer.h.0.ln_1.weight", {kC}},
      {"transformer.h.0.ln_1.bias", {kC}},
      {"transformer.h.0.attn.c_attn.weight", {kC, 3 * kC}},
      {"transformer.h.0.attn.c_attn.bias", {3 * kC}},
      {"transformer.h.0.attn.c_proj.weight", {kC, kC}},
      {"transformer.h.0.attn.c_proj.bias", {kC}},
      {"transformer.h.0.ln_2.weight", {kC}},
      {"transformer.h.0.ln_2.bias", {kC}},
      {"transformer.h.0.mlp.c_fc.weight", {kC, kF}},
      {"transformer.h.0.mlp.c_fc.bias", {kF}},
      {"transformer.h.0.mlp.c_proj.weight", {kF, kC}},
      {"transformer.h.0.mlp.c_proj.bias", {kC}},
      {"transformer.ln_f.weight", {kC}},
      {"transformer.ln_f.bias", {kC}},
  };
  std::map<std::string, Tensor> out;
  int seed = 0;
  for (const auto& [name, shape] : shapes) {
    Tensor t{shape, {}};
    t.values.resize(checkpoint::NumElements(shape));
    for (size_t i = 0; i < t.values.size(); ++i) t.values[i] = ((seed * 7 + i) % 64) / 8.0f - 4.0f;
    out[name] = t;
    ++seed;
  }
  return out;
}

// Serializes tensors as safetensors in `dtype` (F32, F16, BF16; the test
// values convert exactly), metadata {"format": "pt"} as transformers writes.
std::string Serialize(const std::map<std::string, Tensor>& tensors, const std::string& dtype = "F32") {
  std::string header = "{\"__metadata__\":{\"format\":\"pt\"}";
  std::string data;
  for (const auto& [name, t] : tensors) {
    const size_t begin = data.size();
    for (float v : t.values) {
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      if (dtype == "F32") {
        data.append(reinterpret_cast<const char*>(&bits), 4);
        continue;
      }
      uint16_t h;
      if (dtype == "BF16") {
        h = static_cast<uint16_t>(bits >> 16);
      } else {  // F16, normal numbers and zero only (what HfModel makes)
        const uint32_t sign = (bits >> 16) & 0x8000;
        const int exp = static_cast<int>((bits >> 23) & 0xff);
        h = exp == 0 ? static_cast<uint16_t>(sign)
                     : static_cast<uint16_t>(sign | ((exp - 127 + 15) << 10) | ((bits >> 13) & 0x3ff));
      }
      data.append(reinterpret_cast<const char*>(&h), 2);
    }
    absl::StrAppend(&header, ",\"", name, "\":{\"dtype\":\"", dtype, "\",\"shape\":[", absl::StrJoin(t.shape, ","),
                    "],\"data_offsets\":[", begin, ",", data.size(), "]}");
  }
  header += "}";
  std::string out(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}

std::string WriteHfDir(const std::string& name, const std::map<std::string, Tensor>& tensors,
                       const std::string& config = Config(), const std::string& dtype = "F32") {
  const std::string dir = TmpDir(name);
  EXPECT_TRUE(MakeDirectories(dir).ok());
  EXPECT_TRUE(WriteFileAtomically(dir + "/config.json", config).ok());
  EXPECT_TRUE(WriteFileAtomically(dir + "/model.safetensors", Serialize(tensors, dtype)).ok());
  return dir;
}

absl::Status Import(const std::string& hf, const std::string& out, int seq_len = 0) {
  HfImportOptions options;
  options.seq_len = seq_len;
  return ImportHfCheckpoint(hf, out, options).status();
}

TEST(HfCheckpointTest, ImportMapsNamesTransposesConv1DAndWritesACompleteCheckpoint) {
  const std::map<std::string, Tensor> hf = HfModel();
  const std::string src = WriteHfDir("map_hf", hf);
  const std::string ckpt = TmpDir("map_ckpt");
  ASSERT_TRUE(Import(src, ckpt).ok());

  absl::StatusOr<checkpoint::FullState> state = checkpoint::LoadFullState(ckpt);
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(state->optimizer_step, 0);
  EXPECT_TRUE(state->has_moments);
  EXPECT_EQ(state->chunks, 1);
  EXPECT_EQ(state->tp_size, 1);
  EXPECT_EQ(state->manifest.step, 0);
  EXPECT_EQ(state->manifest.model.layers, 1);
  EXPECT_EQ(state->manifest.model.d_model, kC);
  EXPECT_EQ(state->manifest.model.heads, 2);
  EXPECT_EQ(state->manifest.model.vocab, kV);
  EXPECT_EQ(state->manifest.model.seq_len, kP);
  std::vector<std::string> names;
  for (const auto& [name, t] : state->tensors) names.push_back(name);
  EXPECT_THAT(names, ::testing::UnorderedElementsAre(
                         "wte", "wpe", "h.0.ln_1.weight", "h.0.ln_1.bias", "h.0.attn.c_attn.weight",
                         "h.0.attn.c_attn.bias", "h.0.attn.c_proj.weight", "h.0.attn.c_proj.bias", "h.0.ln_2.weight",
                         "h.0.ln_2.bias", "h.0.mlp.c_fc.weight", "h.0.mlp.c_fc.bias", "h.0.mlp.c_proj.weight",
                         "h.0.mlp.c_proj.bias", "ln_f.weight", "ln_f.bias"));
  for (const auto& [name, t] : state->tensors) {
    EXPECT_EQ(t.adam_m, std::vector<float>(t.values.size(), 0.0f)) << name;
    EXPECT_EQ(t.adam_v, std::vector<float>(t.values.size(), 0.0f)) << name;
  }
  EXPECT_EQ(state->tensors.at("wte").values, hf.at("transformer.wte.weight").values);
  EXPECT_EQ(state->tensors.at("h.0.ln_2.bias").values, hf.at("transformer.h.0.ln_2.bias").values);
  // Conv1D: HF [in, out] at [i][o] is baton [out, in] at [o][i].
  struct Conv {
    std::string name;
    int in, out;
  };
  for (const Conv& c : {Conv{"h.0.attn.c_attn.weight", kC, 3 * kC}, Conv{"h.0.attn.c_proj.weight", kC, kC},
                        Conv{"h.0.mlp.c_fc.weight", kC, kF}, Conv{"h.0.mlp.c_proj.weight", kF, kC}}) {
    const checkpoint::FullTensor& b = state->tensors.at(c.name);
    const Tensor& h = hf.at("transformer." + c.name);
    ASSERT_EQ(b.shape, (std::vector<int64_t>{c.out, c.in})) << c.name;
    for (int i = 0; i < c.in; ++i) {
      for (int o = 0; o < c.out; ++o) ASSERT_EQ(b.values[o * c.in + i], h.values[i * c.out + o]) << c.name;
    }
  }
}

TEST(HfCheckpointTest, ResumeValidationAcceptsTheImportAndNamesAMismatchedField) {
  const std::string ckpt = TmpDir("resume_ckpt");
  ASSERT_TRUE(Import(WriteHfDir("resume_hf", HfModel()), ckpt).ok());
  v1::JobSpec job;
  job.set_name("finetune");
  job.mutable_model()->set_layers(1);
  job.mutable_model()->set_d_model(kC);
  job.mutable_model()->set_heads(2);
  job.mutable_model()->set_vocab(kV);
  job.mutable_model()->set_seq_len(kP);
  absl::StatusOr<checkpoint::FullState> ok = checkpoint::ValidateResumeCheckpoint(ckpt, job);
  EXPECT_TRUE(ok.ok()) << ok.status();

  job.mutable_model()->set_heads(4);
  job.mutable_model()->set_seq_len(4);
  absl::StatusOr<checkpoint::FullState> bad = checkpoint::ValidateResumeCheckpoint(ckpt, job);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), AllOf(HasSubstr("another model"), HasSubstr("model.heads 4 (checkpoint: 2)"),
                                            HasSubstr("model.seq_len 4 (checkpoint: 6)")));
}

TEST(HfCheckpointTest, RoundTripIsBitForBit) {
  const std::map<std::string, Tensor> hf = HfModel();
  const std::string ckpt = TmpDir("round_ckpt");
  const std::string back = TmpDir("round_back");
  ASSERT_TRUE(Import(WriteHfDir("round_hf", hf), ckpt).ok());
  absl::StatusOr<checkpoint::ModelShape> m = ExportHfCheckpoint(ckpt, back, false);
  ASSERT_TRUE(m.ok()) << m.status();
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Read(back + "/model.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->metadata().at("format"), "pt");
  ASSERT_EQ(file->tensors().size(), hf.size());  // no lm_head.weight, no attn.bias
  for (const auto& [name, t] : hf) {
    ASSERT_EQ(file->tensors().count(name), 1u) << name;
    EXPECT_EQ(file->tensors().at(name).shape, t.shape) << name;
    EXPECT_EQ(*file->Float32s(name), t.values) << name;
  }
  // The exported config reads back as the same model.
  absl::StatusOr<checkpoint::ModelShape> config = ReadHfConfig(back);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(*config, *m);
  absl::StatusOr<std::string> text = ReadFile(back + "/config.json");
  EXPECT_THAT(*text, AllOf(HasSubstr("\"model_type\": \"gpt2\""), HasSubstr("\"GPT2LMHeadModel\""),
                           HasSubstr("\"tie_word_embeddings\": true"), HasSubstr("\"n_positions\": 6"),
                           HasSubstr("\"activation_function\": \"gelu_new\"")));
}

TEST(HfCheckpointTest, ReadsF16AndBF16AndATiedLmHeadAndOldMaskBuffers) {
  std::map<std::string, Tensor> hf = HfModel();
  const std::vector<float> wte = hf.at("transformer.wte.weight").values;
  hf["lm_head.weight"] = hf.at("transformer.wte.weight");
  hf["transformer.h.0.attn.bias"] = {{1, 1, kP, kP}, std::vector<float>(kP * kP, 1.0f)};
  hf["transformer.h.0.attn.masked_bias"] = {{}, {-1e4f}};
  for (const std::string dtype : {"F16", "BF16"}) {
    const std::string ckpt = TmpDir("dtype_ckpt_" + dtype);
    ASSERT_TRUE(Import(WriteHfDir("dtype_hf_" + dtype, hf, Config(), dtype), ckpt).ok()) << dtype;
    absl::StatusOr<checkpoint::FullState> state = checkpoint::LoadFullState(ckpt);
    ASSERT_TRUE(state.ok()) << state.status();
    EXPECT_EQ(state->tensors.at("wte").values, wte) << dtype;
    EXPECT_EQ(state->tensors.count("lm_head.weight"), 0u);
  }
}

TEST(HfCheckpointTest, SeqLenKeepsTheFirstPositions) {
  const std::map<std::string, Tensor> hf = HfModel();
  const std::string src = WriteHfDir("seq_hf", hf);
  const std::string ckpt = TmpDir("seq_ckpt");
  ASSERT_TRUE(Import(src, ckpt, 4).ok());
  absl::StatusOr<checkpoint::FullState> state = checkpoint::LoadFullState(ckpt);
  ASSERT_TRUE(state.ok());
  EXPECT_EQ(state->manifest.model.seq_len, 4);
  const std::vector<float>& all = hf.at("transformer.wpe.weight").values;
  EXPECT_EQ(state->tensors.at("wpe").values, std::vector<float>(all.begin(), all.begin() + 4 * kC));
  absl::Status too_long = Import(src, TmpDir("seq_ckpt2"), kP + 1);
  EXPECT_THAT(too_long.message(), AllOf(HasSubstr("--seq_len=7"), HasSubstr("n_positions (6)")));
}

TEST(HfCheckpointTest, ShardedIndexAndMissingShard) {
  std::map<std::string, Tensor> hf = HfModel();
  std::map<std::string, Tensor> a, b;
  std::vector<std::string> map;
  for (const auto& [name, t] : hf) {
    const bool first = name.find(".h.0.") == std::string::npos;
    (first ? a : b)[name] = t;
    map.push_back(absl::StrCat("\"", name, "\": \"", first ? "model-00001-of-00002.safetensors"
                                                          : "model-00002-of-00002.safetensors", "\""));
  }
  const std::string dir = TmpDir("sharded_hf");
  ASSERT_TRUE(MakeDirectories(dir).ok());
  ASSERT_TRUE(WriteFileAtomically(dir + "/config.json", Config()).ok());
  ASSERT_TRUE(WriteFileAtomically(dir + "/model.safetensors.index.json",
                                  absl::StrCat("{\"metadata\": {}, \"weight_map\": {", absl::StrJoin(map, ", "), "}}"))
                  .ok());
  ASSERT_TRUE(WriteFileAtomically(dir + "/model-00001-of-00002.safetensors", Serialize(a)).ok());
  ASSERT_TRUE(WriteFileAtomically(dir + "/model-00002-of-00002.safetensors", Serialize(b)).ok());
  ASSERT_TRUE(Import(dir, TmpDir("sharded_ckpt")).ok());
  absl::StatusOr<checkpoint::FullState> state = checkpoint::LoadFullState(TmpDir("sharded_ckpt"));
  ASSERT_TRUE(state.ok());
  EXPECT_EQ(state->tensors.size(), hf.size());

  ASSERT_EQ(std::remove((dir + "/model-00002-of-00002.safetensors").c_str()), 0);
  absl::Status missing = Import(dir, TmpDir("sharded_ckpt2"));
  EXPECT_THAT(missing.message(), AllOf(HasSubstr("model-00002-of-00002.safetensors: missing"),
                                       HasSubstr("model.safetensors.index.json"), HasSubstr("transformer.h.0.")));
  EXPECT_FALSE(Exists(TmpDir("sharded_ckpt2")));
}

struct BadCase {
  std::string name;
  std::string config;                       // config.json text
  std::function<void(std::map<std::string, Tensor>&)> edit;  // on the tensors
  std::vector<std::string> want;            // substrings of the error
};

TEST(HfCheckpointTest, EveryBadInputNamesWhatToFix) {
  auto none = [](std::map<std::string, Tensor>&) {};
  const std::vector<BadCase> cases = {
      {"wrong_shape", Config(), [](auto& t) { t["transformer.h.0.mlp.c_fc.weight"].shape = {kF, kC}; },
       {"model.safetensors: tensor transformer.h.0.mlp.c_fc.weight has shape [32, 8]", "implies [8, 32]"}},
      {"missing_tensor", Config(), [](auto& t) { t.erase("transformer.ln_f.bias"); },
       {"model.safetensors: tensor transformer.ln_f.bias is missing"}},
      {"unknown_tensor", Config(), [](auto& t) { t["transformer.h.1.ln_1.weight"] = t["transformer.ln_f.bias"]; },
       {"tensor transformer.h.1.ln_1.weight is not part of a GPT-2 of 1 layers"}},
      {"untied_head", Config(),
       [](auto& t) {
         t["lm_head.weight"] = t["transformer.wte.weight"];
         t["lm_head.weight"].values[3] += 1;
       },
       {"lm_head.weight differs from transformer.wte.weight", "untied"}},
      {"untied_config", Config(", \"tie_word_embeddings\": false"), none,
       {"config.json: tie_word_embeddings is false", "untied head cannot be imported"}},
      {"activation", absl::StrReplaceAll(Config(), {{"gelu_new", "relu"}}), none,
       {"config.json: activation_function must be \"gelu_new\""}},
      {"epsilon", absl::StrReplaceAll(Config(), {{"1e-05", "1e-06"}}), none,
       {"config.json: layer_norm_epsilon must be 1e-05"}},
      {"n_inner", absl::StrReplaceAll(Config(), {{"\"n_inner\": null", "\"n_inner\": 16"}}), none,
       {"config.json: n_inner must be null or 4 * n_embd (32)"}},
      {"inverse_layer_idx", Config(", \"scale_attn_by_inverse_layer_idx\": true"), none,
       {"config.json: scale_attn_by_inverse_layer_idx is true"}},
      {"reorder", Config(", \"reorder_and_upcast_attn\": true"), none, {"config.json: reorder_and_upcast_attn is true"}},
      {"model_type", absl::StrReplaceAll(Config(), {{"\"gpt2\"", "\"gptj\""}}), none,
       {"config.json: model_type is not \"gpt2\""}},
      {"heads", absl::StrReplaceAll(Config(), {{"\"n_head\": 2", "\"n_head\": 3"}}), none,
       {"config.json: n_head (3) must divide n_embd (8)"}},
      {"huge_vocab", absl::StrReplaceAll(Config(), {{"\"vocab_size\": 10", "\"vocab_size\": 100000000"}}), none,
       {"config.json: vocab_size must be an integer from 1 to 16777216"}},
      {"missing_field", absl::StrReplaceAll(Config(), {{"\"n_layer\": 1, ", ""}}), none,
       {"config.json: n_layer is missing"}},
      {"bad_json", "{\"n_embd\": ", none, {"config.json"}},
  };
  for (const BadCase& c : cases) {
    std::map<std::string, Tensor> hf = HfModel();
    c.edit(hf);
    const std::string out = TmpDir("bad_ckpt_" + c.name);
    absl::Status s = Import(WriteHfDir("bad_hf_" + c.name, hf, c.config), out);
    if (c.want.empty()) {
      EXPECT_TRUE(s.ok()) << c.name << ": " << s;
      continue;
    }
    ASSERT_FALSE(s.ok()) << c.name;
    for (const std::string& w : c.want) EXPECT_THAT(s.message(), HasSubstr(w)) << c.name;
    EXPECT_FALSE(Exists(out)) << c.name << ": a failed import left " << out;
    EXPECT_FALSE(Exists(absl::StrCat(out, ".tmp-", getpid()))) << c.name;
  }
}

TEST(HfCheckpointTest, TruncatedAndMissingWeightFilesNameTheFile) {
  const std::string dir = WriteHfDir("trunc_hf", HfModel());
  const std::string bytes = *ReadFile(dir + "/model.safetensors");
  for (size_t keep : {size_t{4}, size_t{40}, bytes.size() - 3}) {
    ASSERT_TRUE(WriteFileAtomically(dir + "/model.safetensors", bytes.substr(0, keep)).ok());
    absl::Status s = Import(dir, TmpDir("trunc_ckpt"));
    ASSERT_FALSE(s.ok()) << keep;
    EXPECT_THAT(s.message(), AllOf(HasSubstr(dir + "/model.safetensors"), HasSubstr("safetensors"))) << keep;
  }
  ASSERT_EQ(std::remove((dir + "/model.safetensors").c_str()), 0);
  absl::Status s = Import(dir, TmpDir("trunc_ckpt"));
  EXPECT_THAT(s.message(), AllOf(HasSubstr("neither model.safetensors nor model.safetensors.index.json"),
                                 HasSubstr("safe_serialization=True")));
}

TEST(HfCheckpointTest, OutputDirectoryIsNeverOverwrittenUnlessForced) {
  const std::string src = WriteHfDir("force_hf", HfModel());
  const std::string ckpt = TmpDir("force_ckpt");
  ASSERT_TRUE(MakeDirectories(ckpt).ok());  // an empty directory is fine
  ASSERT_TRUE(Import(src, ckpt).ok());
  absl::Status again = Import(src, ckpt);
  EXPECT_THAT(again.message(), AllOf(HasSubstr(ckpt + ": not empty"), HasSubstr("--force")));
  HfImportOptions force;
  force.force = true;
  ASSERT_TRUE(ImportHfCheckpoint(src, ckpt, force).ok());
  EXPECT_TRUE(checkpoint::LoadFullState(ckpt).ok());

  const std::string hf = TmpDir("force_export");
  ASSERT_TRUE(ExportHfCheckpoint(ckpt, hf, false).ok());
  EXPECT_THAT(ExportHfCheckpoint(ckpt, hf, false).status().message(), HasSubstr("not empty"));
  EXPECT_TRUE(ExportHfCheckpoint(ckpt, hf, true).ok());
}

// Export gathers any layout: the imported model re-saved as 2 chunks at tp 2
// (column-split QKV and MLP weights, the tied wte in both chunks) exports
// the same tensors as the single-chunk import.
TEST(HfCheckpointTest, ExportGathersAPipelineAndTensorParallelCheckpoint) {
  const std::map<std::string, Tensor> hf = HfModel();
  const std::string ckpt = TmpDir("tp_import");
  ASSERT_TRUE(Import(WriteHfDir("tp_hf", hf), ckpt).ok());
  absl::StatusOr<checkpoint::FullState> full = checkpoint::LoadFullState(ckpt);
  ASSERT_TRUE(full.ok());
  const std::string sharded = TmpDir("tp_sharded");
  ASSERT_TRUE(MakeDirectories(sharded).ok());
  std::vector<std::string> files;
  std::deque<std::vector<float>> keep;  // the shards' values (push_back keeps references valid)
  for (int chunk = 0; chunk < 2; ++chunk) {
    for (int r = 0; r < 2; ++r) {
      std::vector<checkpoint::StateShardTensor> tensors;
      for (const auto& [name, t] : full->tensors) {
        const bool in_chunk = chunk == 0 ? name.rfind("ln_f", 0) != 0 : (name == "wte" || name.rfind("ln_f", 0) == 0);
        if (!in_chunk) continue;
        checkpoint::TensorLayout l;
        l.full_shape = t.shape;
        l.tp_rank = r;
        l.tp_size = 2;
        if (name == "h.0.attn.c_attn.weight" || name == "h.0.attn.c_attn.bias") {
          l.split_dim = 0;
          l.qkv = true;
        } else if (name == "h.0.mlp.c_fc.weight") {
          l.split_dim = 0;
        } else if (name == "h.0.mlp.c_proj.weight") {
          l.split_dim = 1;
        }
        std::vector<float> local(checkpoint::NumElements(*checkpoint::LocalShape(l)));
        checkpoint::ExtractShard(l, t.values.data(), local.data());
        keep.push_back(std::move(local));
        const std::vector<float>& v = keep.back();
        keep.push_back(std::vector<float>(v.size(), 0.0f));
        const std::vector<float>& z = keep.back();
        tensors.push_back({name, l, v, z, z});
      }
      absl::StatusOr<std::string> f = checkpoint::WriteStateShardFile(sharded, chunk, r, 2, 0, true, tensors);
      ASSERT_TRUE(f.ok()) << f.status();
      files.push_back(*f);
    }
  }
  checkpoint::ManifestInfo m = full->manifest;
  m.layout.pp = 2;
  m.layout.tp = 2;
  m.files = files;
  ASSERT_TRUE(checkpoint::WriteManifest(sharded, m).ok());

  const std::string out = TmpDir("tp_export");
  absl::StatusOr<checkpoint::ModelShape> shape = ExportHfCheckpoint(sharded, out, false);
  ASSERT_TRUE(shape.ok()) << shape.status();
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Read(out + "/model.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  for (const auto& [name, t] : hf) EXPECT_EQ(*file->Float32s(name), t.values) << name;
}

// A directory `dir` under the test's temp dir holding one shard file with a
// tensor "w" of two floats (no manifest yet); returns the file's name.
absl::StatusOr<std::string> OneTensorShard(const std::string& dir) {
  if (absl::Status made = MakeDirectories(dir); !made.ok()) return made;
  checkpoint::TensorLayout l;
  l.full_shape = {2};
  std::vector<float> v = {1, 2};
  return checkpoint::WriteStateShardFile(dir, 0, 0, 1, 0, false, {{"w", l, v, {}, {}}});
}

TEST(HfCheckpointTest, ExportRefusesACheckpointWithoutAGptModel) {
  const std::string dir = TmpDir("v1_ckpt");
  absl::StatusOr<std::string> f = OneTensorShard(dir);
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_TRUE(checkpoint::WriteManifest(dir, {*f}, "job", 3).ok());  // v1: no model
  absl::Status s = ExportHfCheckpoint(dir, TmpDir("v1_export"), false).status();
  EXPECT_THAT(s.message(), HasSubstr("names no GPT model"));
  EXPECT_FALSE(Exists(TmpDir("v1_export")));
}

// An MoE checkpoint is refused before any shard is read, naming the model:
// GPT2LMHeadModel has no experts, and no Mixtral export is written.
TEST(HfCheckpointTest, ExportRefusesAnMoeCheckpoint) {
  const std::string dir = TmpDir("moe_ckpt");
  absl::StatusOr<std::string> f = OneTensorShard(dir);
  ASSERT_TRUE(f.ok()) << f.status();
  v1::JobSpec job;
  job.set_name("moe");
  v1::ModelSpec* m = job.mutable_model();
  m->set_layers(2);
  m->set_d_model(8);
  m->set_heads(2);
  m->set_vocab(10);
  m->set_seq_len(6);
  m->mutable_moe()->set_experts(4);
  m->mutable_moe()->set_top_k(2);
  ASSERT_TRUE(checkpoint::WriteManifest(dir, checkpoint::ManifestFor(job, 3, {*f})).ok());
  absl::Status s = ExportHfCheckpoint(dir, TmpDir("moe_export"), false).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("holds a GPT of layers 2, d_model 8, heads 2, vocab 10, seq_len 6, MoE of 4 "
                                     "experts"));
  EXPECT_THAT(s.message(), HasSubstr("MoE export is not supported yet"));
  EXPECT_FALSE(Exists(TmpDir("moe_export")));
  // The same checkpoint without experts in its manifest gets past that check.
  job.mutable_model()->clear_moe();
  ASSERT_TRUE(checkpoint::WriteManifest(dir, checkpoint::ManifestFor(job, 3, {*f})).ok());
  s = ExportHfCheckpoint(dir, TmpDir("dense_export"), false).status();
  EXPECT_THAT(s.message(), Not(HasSubstr("MoE"))) << s;
}

// ---- Llama ------------------------------------------------------------------

// A tiny Llama: 1 layer, hidden 8, 2 heads of 4, 1 key/value head,
// intermediate 12, vocab 10, 6 positions.
constexpr int kLlamaF = 12, kLlamaKv = 4;

std::string LlamaConfig(const std::string& extra = "", bool tied = false) {
  return absl::StrCat(
      "{\"model_type\": \"llama\", \"architectures\": [\"LlamaForCausalLM\"], \"hidden_act\": \"silu\", "
      "\"hidden_size\": ", kC, ", \"num_attention_heads\": 2, \"num_key_value_heads\": 1, \"num_hidden_layers\": 1, "
      "\"intermediate_size\": ", kLlamaF, ", \"vocab_size\": ", kV, ", \"max_position_embeddings\": ", kP,
      ", \"rms_norm_eps\": 1e-05, \"rope_theta\": 500000.0, \"rope_scaling\": null, \"attention_bias\": false, "
      "\"pretraining_tp\": 1, \"tie_word_embeddings\": ", tied ? "true" : "false", extra, "}");
}

std::map<std::string, Tensor> LlamaHfModel(bool tied = false) {
  std::map<std::string, std::vector<int64_t>> shapes = {
      {"model.embed_tokens.weight", {kV, kC}},
      {"model.layers.0.input_layernorm.weight", {kC}},
      {"model.layers.0.self_attn.q_proj.weight", {kC, kC}},
      {"model.layers.0.self_attn.k_proj.weight", {kLlamaKv, kC}},
      {"model.layers.0.self_attn.v_proj.weight", {kLlamaKv, kC}},
      {"model.layers.0.self_attn.o_proj.weight", {kC, kC}},
      {"model.layers.0.post_attention_layernorm.weight", {kC}},
      {"model.layers.0.mlp.gate_proj.weight", {kLlamaF, kC}},
      {"model.layers.0.mlp.up_proj.weight", {kLlamaF, kC}},
      {"model.layers.0.mlp.down_proj.weight", {kC, kLlamaF}},
      {"model.norm.weight", {kC}},
  };
  if (!tied) shapes["lm_head.weight"] = {kV, kC};
  std::map<std::string, Tensor> out;
  int seed = 3;
  for (const auto& [name, shape] : shapes) {
    Tensor t{shape, {}};
    t.values.resize(checkpoint::NumElements(shape));
    for (size_t i = 0; i < t.values.size(); ++i) t.values[i] = ((seed * 7 + i) % 64) / 8.0f - 4.0f;
    out[name] = t;
    ++seed;
  }
  return out;
}

TEST(HfCheckpointTest, LlamaImportKeepsNamesAndLayoutAndRecordsTheArchitecture) {
  const std::map<std::string, Tensor> hf = LlamaHfModel();
  for (const std::string dtype : {"F32", "F16", "BF16"}) {
    const std::string ckpt = TmpDir("llama_map_ckpt_" + dtype);
    ASSERT_TRUE(Import(WriteHfDir("llama_map_hf_" + dtype, hf, LlamaConfig(), dtype), ckpt).ok()) << dtype;
    absl::StatusOr<checkpoint::FullState> state = checkpoint::LoadFullState(ckpt);
    ASSERT_TRUE(state.ok()) << state.status();
    EXPECT_EQ(state->chunks, 1);
    ASSERT_EQ(state->tensors.size(), hf.size()) << dtype;
    for (const auto& [name, t] : hf) {
      const std::string baton = name.rfind("model.", 0) == 0 ? name.substr(6) : name;
      ASSERT_EQ(state->tensors.count(baton), 1u) << baton;
      EXPECT_EQ(state->tensors.at(baton).shape, t.shape) << baton;  // [out, in] in both: no transpose
      EXPECT_EQ(state->tensors.at(baton).values, t.values) << baton << " " << dtype;
    }
  }
  absl::StatusOr<checkpoint::ModelShape> m = ReadHfConfig(TmpDir("llama_map_hf_F32"));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->arch, "llama");
  EXPECT_EQ(m->layers, 1);
  EXPECT_EQ(m->d_model, kC);
  EXPECT_EQ(m->heads, 2);
  EXPECT_EQ(m->kv_heads, 1);
  EXPECT_EQ(m->ffn_dim, kLlamaF);
  EXPECT_EQ(m->vocab, kV);
  EXPECT_EQ(m->seq_len, kP);
  EXPECT_EQ(m->rope_theta, 500000.0f);
  EXPECT_EQ(m->norm_eps, 1e-5f);
  EXPECT_FALSE(m->tie_embeddings);
}

TEST(HfCheckpointTest, LlamaConfigDefaultsAreLlamaConfigs) {
  std::string config = LlamaConfig();
  for (const char* field : {", \"num_key_value_heads\": 1", ", \"rms_norm_eps\": 1e-05", ", \"rope_theta\": 500000.0",
                            ", \"tie_word_embeddings\": false", ", \"hidden_act\": \"silu\"",
                            ", \"rope_scaling\": null"}) {
    config = absl::StrReplaceAll(config, {{field, ""}});
  }
  std::map<std::string, Tensor> hf = LlamaHfModel();
  hf["model.layers.0.self_attn.k_proj.weight"].shape = {kC, kC};  // kv heads = heads
  hf["model.layers.0.self_attn.k_proj.weight"].values.resize(kC * kC);
  hf["model.layers.0.self_attn.v_proj.weight"] = hf["model.layers.0.self_attn.k_proj.weight"];
  const std::string dir = WriteHfDir("llama_defaults_hf", hf, config);
  absl::StatusOr<checkpoint::ModelShape> m = ReadHfConfig(dir);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->kv_heads, 2);
  EXPECT_EQ(m->norm_eps, 1e-6f);
  EXPECT_EQ(m->rope_theta, 10000.0f);
  EXPECT_FALSE(m->tie_embeddings);
  EXPECT_TRUE(Import(dir, TmpDir("llama_defaults_ckpt")).ok());
}

TEST(HfCheckpointTest, LlamaTiedHeadAndOldRotaryBuffers) {
  std::map<std::string, Tensor> hf = LlamaHfModel(/*tied=*/true);
  hf["model.layers.0.self_attn.rotary_emb.inv_freq"] = {{2}, {1.0f, 0.5f}};
  const std::string ckpt = TmpDir("llama_tied_ckpt");
  ASSERT_TRUE(Import(WriteHfDir("llama_tied_hf", hf, LlamaConfig("", true)), ckpt).ok());
  absl::StatusOr<checkpoint::FullState> state = checkpoint::LoadFullState(ckpt);
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(state->tensors.count("lm_head.weight"), 0u);
  EXPECT_EQ(state->tensors.size(), hf.size() - 1);  // no inv_freq
  EXPECT_TRUE(state->manifest.model.tie_embeddings);

  // A stored copy of the tied head is accepted when it equals the embedding.
  hf["lm_head.weight"] = hf.at("model.embed_tokens.weight");
  EXPECT_TRUE(Import(WriteHfDir("llama_tied_copy_hf", hf, LlamaConfig("", true)), TmpDir("llama_tied_copy")).ok());
  hf["lm_head.weight"].values[0] += 1;
  absl::Status s = Import(WriteHfDir("llama_tied_bad_hf", hf, LlamaConfig("", true)), TmpDir("llama_tied_bad"));
  EXPECT_THAT(s.message(), AllOf(HasSubstr("lm_head.weight differs from model.embed_tokens.weight"),
                                 HasSubstr("tie_word_embeddings true")));
}

TEST(HfCheckpointTest, LlamaBadInputNamesWhatToFix) {
  auto none = [](std::map<std::string, Tensor>&) {};
  const std::vector<BadCase> cases = {
      {"shape",
       LlamaConfig(),
       [](auto& t) {
         t["model.layers.0.mlp.up_proj.weight"].shape = {kC, kLlamaF};
       },
       {"model.safetensors: tensor model.layers.0.mlp.up_proj.weight has shape [8, 12]", "implies [12, 8]"}},
      {"missing",
       LlamaConfig(),
       [](auto& t) { t.erase("model.norm.weight"); },
       {"model.safetensors: tensor model.norm.weight is missing (a Llama of this config.json has it"}},
      {"missing_head",
       LlamaConfig(),
       [](auto& t) { t.erase("lm_head.weight"); },
       {"tensor lm_head.weight is missing", "tie_word_embeddings is false"}},
      {"unknown",
       LlamaConfig(),
       [](auto& t) { t["model.layers.0.self_attn.q_proj.bias"] = t["model.norm.weight"]; },
       {"tensor model.layers.0.self_attn.q_proj.bias is not part of a Llama of 1 layers"}},
      {"rope_scaling",
       absl::StrReplaceAll(LlamaConfig(), {{"\"rope_scaling\": null",
                                            "\"rope_scaling\": "
                                            "{\"rope_type\": \"llama3\", \"factor\": 8.0}"}}),
       none,
       {"config.json: rope_scaling is set", "only rope_scaling null"}},
      {"act",
       absl::StrReplaceAll(LlamaConfig(), {{"\"silu\"", "\"gelu\""}}),
       none,
       {"config.json: hidden_act must be \"silu\""}},
      {"attention_bias",
       absl::StrReplaceAll(LlamaConfig(), {{"\"attention_bias\": false", "\"attention_bias\": true"}}),
       none,
       {"config.json: attention_bias is true"}},
      {"mlp_bias", LlamaConfig(", \"mlp_bias\": true"), none, {"config.json: mlp_bias is true"}},
      {"head_dim",
       LlamaConfig(", \"head_dim\": 8"),
       none,
       {"config.json: head_dim must be hidden_size / num_attention_heads (4)"}},
      {"pretraining_tp",
       absl::StrReplaceAll(LlamaConfig(), {{"\"pretraining_tp\": 1", "\"pretraining_tp\": 2"}}),
       none,
       {"config.json: pretraining_tp is 2"}},
      {"kv_heads",
       absl::StrReplaceAll(LlamaConfig(), {{"\"num_key_value_heads\": 1", "\"num_key_value_heads\": 3"}}),
       none,
       {"config.json: num_key_value_heads must be an integer from 1 to 2"}},
      {"odd_head_dim",
       absl::StrReplaceAll(LlamaConfig(), {{"\"num_attention_heads\": 2", "\"num_attention_heads\": 8"},
                                           {"\"num_key_value_heads\": 1", "\"num_key_value_heads\": 8"}}),
       none,
       {"config.json: num_attention_heads gives an odd head dimension 8 / 8 = 1"}},
      {"eps",
       absl::StrReplaceAll(LlamaConfig(), {{"\"rms_norm_eps\": 1e-05", "\"rms_norm_eps\": -1"}}),
       none,
       {"config.json: rms_norm_eps must be a positive number"}},
      {"theta",
       absl::StrReplaceAll(LlamaConfig(), {{"\"rope_theta\": 500000.0", "\"rope_theta\": \"big\""}}),
       none,
       {"config.json: rope_theta must be a positive number"}},
      {"missing_field",
       absl::StrReplaceAll(LlamaConfig(), {{"\"intermediate_size\": 12, ", ""}}),
       none,
       {"config.json: intermediate_size is missing (a transformers Llama config has it)"}},
      {"tied_flag",
       absl::StrReplaceAll(LlamaConfig(), {{"\"tie_word_embeddings\": false", "\"tie_word_embeddings\": 1"}}),
       none,
       {"config.json: tie_word_embeddings must be true or false"}},
  };
  for (const BadCase& c : cases) {
    std::map<std::string, Tensor> hf = LlamaHfModel();
    c.edit(hf);
    const std::string out = TmpDir("llama_bad_ckpt_" + c.name);
    absl::Status s = Import(WriteHfDir("llama_bad_hf_" + c.name, hf, c.config), out);
    ASSERT_FALSE(s.ok()) << c.name;
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << c.name << ": " << s;
    for (const std::string& w : c.want) EXPECT_THAT(s.message(), HasSubstr(w)) << c.name;
    EXPECT_FALSE(Exists(out)) << c.name;
  }
}

// JobModelBlock is the spec of the model imported: it parses as a JobSpec's
// model with every Llama field as config.json gave it.
TEST(HfCheckpointTest, JobModelBlockIsTheImportedModelsSpec) {
  absl::StatusOr<checkpoint::ModelShape> m =
      ReadHfConfig(WriteHfDir("llama_block_hf", LlamaHfModel(), LlamaConfig()));
  ASSERT_TRUE(m.ok()) << m.status();
  const std::string block = JobModelBlock(*m);
  v1::JobSpec job;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(block, &job)) << block;
  const v1::ModelSpec& s = job.model();
  EXPECT_EQ(s.arch(), "llama");
  EXPECT_EQ(s.layers(), 1);
  EXPECT_EQ(s.d_model(), kC);
  EXPECT_EQ(s.heads(), 2);
  EXPECT_EQ(s.kv_heads(), 1);
  EXPECT_EQ(s.ffn_dim(), kLlamaF);
  EXPECT_EQ(s.vocab(), kV);
  EXPECT_EQ(s.seq_len(), kP);
  EXPECT_EQ(s.rope_theta(), 500000.0f);
  EXPECT_EQ(s.norm_eps(), 1e-5f);
  ASSERT_TRUE(s.has_tie_embeddings());
  EXPECT_FALSE(s.tie_embeddings());

  absl::StatusOr<checkpoint::ModelShape> gpt2 = ReadHfConfig(WriteHfDir("gpt2_block_hf", HfModel()));
  ASSERT_TRUE(gpt2.ok());
  v1::JobSpec gpt2_job;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(JobModelBlock(*gpt2), &gpt2_job));
  EXPECT_EQ(gpt2_job.model().arch(), "");
  EXPECT_EQ(gpt2_job.model().d_model(), kC);
}

// Needs the manifest to record the architecture (common/checkpoint_manifest).
TEST(HfCheckpointTest, LlamaRoundTripIsBitForBit) {
  for (const bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    const std::map<std::string, Tensor> hf = LlamaHfModel(tied);
    const std::string tag = tied ? "tied" : "untied";
    const std::string ckpt = TmpDir("llama_round_ckpt_" + tag), back = TmpDir("llama_round_back_" + tag);
    ASSERT_TRUE(Import(WriteHfDir("llama_round_hf_" + tag, hf, LlamaConfig("", tied)), ckpt).ok());
    absl::StatusOr<checkpoint::ModelShape> m = ExportHfCheckpoint(ckpt, back, false);
    ASSERT_TRUE(m.ok()) << m.status();
    absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Read(back + "/model.safetensors");
    ASSERT_TRUE(file.ok()) << file.status();
    EXPECT_EQ(file->metadata().at("format"), "pt");
    ASSERT_EQ(file->tensors().size(), hf.size());
    for (const auto& [name, t] : hf) {
      ASSERT_EQ(file->tensors().count(name), 1u) << name;
      EXPECT_EQ(file->tensors().at(name).shape, t.shape) << name;
      EXPECT_EQ(*file->Float32s(name), t.values) << name;
    }
    absl::StatusOr<checkpoint::ModelShape> config = ReadHfConfig(back);
    ASSERT_TRUE(config.ok()) << config.status();
    EXPECT_EQ(config->arch, "llama");
    EXPECT_EQ(config->kv_heads, 1);
    EXPECT_EQ(config->ffn_dim, kLlamaF);
    EXPECT_EQ(config->rope_theta, 500000.0f);
    EXPECT_EQ(config->norm_eps, 1e-5f);
    EXPECT_EQ(config->tie_embeddings, tied);
    absl::StatusOr<std::string> text = ReadFile(back + "/config.json");
    EXPECT_THAT(*text, AllOf(HasSubstr("\"model_type\": \"llama\""), HasSubstr("\"LlamaForCausalLM\""),
                             HasSubstr("\"rms_norm_eps\": 1e-05"), HasSubstr("\"rope_theta\": 500000.0,"),
                             HasSubstr("\"max_position_embeddings\": 6"), HasSubstr("\"torch_dtype\": \"float32\""),
                             HasSubstr(tied ? "\"tie_word_embeddings\": true" : "\"tie_word_embeddings\": false")));
  }
}

std::pair<int, std::string> RunCli(const std::vector<std::string>& args) {
  std::ostringstream out, err;
  const int code = RunCheckpointCommand(args, out, err);
  return {code, out.str() + err.str()};
}

TEST(HfCheckpointTest, CommandLine) {
  const std::string src = WriteHfDir("cli_hf", HfModel());
  const std::string ckpt = TmpDir("cli_ckpt");
  auto [code, text] = RunCli({"import-hf", src, "--out=" + ckpt});
  EXPECT_EQ(code, 0) << text;
  EXPECT_THAT(text, HasSubstr("--resume=" + ckpt));
  std::tie(code, text) = RunCli({"export-hf", ckpt, "--out", TmpDir("cli_export")});
  EXPECT_EQ(code, 0) << text;
  EXPECT_THAT(text, HasSubstr("GPT2LMHeadModel.from_pretrained"));
  std::tie(code, text) = RunCli({"import-hf", src});
  EXPECT_EQ(code, 2);
  EXPECT_THAT(text, HasSubstr("--out is required"));
  std::tie(code, text) = RunCli({"import-hf", src, "--out=" + ckpt});
  EXPECT_EQ(code, 2);
  EXPECT_THAT(text, HasSubstr("--force"));
  std::tie(code, text) = RunCli({"import-hf", src, "--out=" + TmpDir("cli_ckpt2"), "--seq_len=x"});
  EXPECT_EQ(code, 2);
  std::tie(code, text) = RunCli({"export-hf", TmpDir("no_such_ckpt"), "--out=" + TmpDir("cli_export2")});
  EXPECT_EQ(code, 2);
  EXPECT_THAT(text, HasSubstr("no_such_ckpt"));
}

}  // namespace
}  // namespace baton::cli
