#include "cli/hf_checkpoint.h"

#include <dirent.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/file_io.h"
#include "common/json.h"
#include "common/safetensors.h"
#include "common/status_macros.h"

namespace baton::cli {
namespace {

using checkpoint::FullTensor;
using checkpoint::ModelShape;

constexpr char kConfigFile[] = "config.json";
constexpr char kWeightsFile[] = "model.safetensors";
constexpr char kIndexFile[] = "model.safetensors.index.json";
constexpr char kHfPrefix[] = "transformer.";
constexpr char kLmHead[] = "lm_head.weight";

// baton's LayerNorm epsilon (kernels/cpu/layernorm.h) and the bounds a
// config must respect before anything is allocated from it.
constexpr double kLayerNormEps = 1e-5;
constexpr int64_t kMaxEmbd = 1 << 16;
constexpr int64_t kMaxLayers = 1 << 10;
constexpr int64_t kMaxVocab = 1 << 24;  // worker/model/gpt_config.h kMaxVocab
constexpr int64_t kMaxPositions = 1 << 20;
// The largest model imported or exported: 2^31 floats (8 GiB) of weights,
// held in host memory with their zero moments while the shard is written.
constexpr int64_t kMaxElements = int64_t{1} << 31;
constexpr int64_t kMaxJsonBytes = 16 << 20;
constexpr int64_t kMaxHeaderBytes = 100 << 20;  // as common/safetensors.cc

std::string Shape(const std::vector<int64_t>& s) { return absl::StrCat("[", absl::StrJoin(s, ", "), "]"); }

std::string Join(const std::string& dir, const std::string& name) { return absl::StrCat(dir, "/", name); }

// The file's size, NOT_FOUND when absent; refuses sizes above `max_bytes`
// before reading, so a wrong or hostile file cannot make batonctl allocate.
absl::StatusOr<std::string> ReadBounded(const std::string& path, int64_t max_bytes, const std::string& why) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat(path, ": missing"));
    return absl::FailedPreconditionError(absl::StrCat(path, ": ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  if (st.st_size > max_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", st.st_size, " bytes, more than the ", max_bytes, " ", why));
  }
  return ReadFile(path);
}

bool Exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

// ---- config.json ----------------------------------------------------------

class ConfigReader {
 public:
  ConfigReader(const JsonValue& root, std::string path) : root_(root), path_(std::move(path)) {}

  absl::Status Bad(const std::string& field, const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": ", field, " ", what));
  }
  // A required integer in [1, max].
  absl::StatusOr<int64_t> Int(const std::string& field, int64_t max) const {
    const JsonValue* v = root_.Find(field);
    if (v == nullptr) return Bad(field, "is missing (a transformers GPT-2 config has it)");
    if (!v->integer().has_value() || *v->integer() < 1 || *v->integer() > max) {
      return Bad(field, absl::StrCat("must be an integer from 1 to ", max));
    }
    return *v->integer();
  }
  // An optional boolean that baton supports only as `want` (HF's default
  // when absent is `want` too).
  absl::Status BoolIs(const std::string& field, bool want, const std::string& why) const {
    const JsonValue* v = root_.Find(field);
    if (v == nullptr || v->kind() == JsonValue::Kind::kNull) return absl::OkStatus();
    if (v->kind() != JsonValue::Kind::kBool) return Bad(field, "must be true or false");
    if (v->bool_value() != want) return Bad(field, absl::StrCat("is ", want ? "false" : "true", ": ", why));
    return absl::OkStatus();
  }
  const JsonValue* Find(const std::string& field) const { return root_.Find(field); }

 private:
  const JsonValue& root_;
  std::string path_;
};

// ---- the tensors of a GPT-2 ------------------------------------------------

struct HfTensor {
  std::string baton_name;
  std::vector<int64_t> hf_shape;  // as HF stores it
  bool conv1d = false;            // HF [in, out], baton [out, in]
};

// Every tensor of the model under its HF name without the "transformer."
// prefix, with the shape HF stores (wpe with n_positions rows).
std::map<std::string, HfTensor> HfTensors(const ModelShape& m, int64_t n_positions) {
  const int64_t c = m.d_model, v = m.vocab, f = 4 * c;
  std::map<std::string, HfTensor> t;
  t["wte.weight"] = {"wte", {v, c}, false};
  t["wpe.weight"] = {"wpe", {n_positions, c}, false};
  for (int i = 0; i < m.layers; ++i) {
    const std::string p = absl::StrCat("h.", i, ".");
    t[p + "ln_1.weight"] = {p + "ln_1.weight", {c}, false};
    t[p + "ln_1.bias"] = {p + "ln_1.bias", {c}, false};
    t[p + "attn.c_attn.weight"] = {p + "attn.c_attn.weight", {c, 3 * c}, true};
    t[p + "attn.c_attn.bias"] = {p + "attn.c_attn.bias", {3 * c}, false};
    t[p + "attn.c_proj.weight"] = {p + "attn.c_proj.weight", {c, c}, true};
    t[p + "attn.c_proj.bias"] = {p + "attn.c_proj.bias", {c}, false};
    t[p + "ln_2.weight"] = {p + "ln_2.weight", {c}, false};
    t[p + "ln_2.bias"] = {p + "ln_2.bias", {c}, false};
    t[p + "mlp.c_fc.weight"] = {p + "mlp.c_fc.weight", {c, f}, true};
    t[p + "mlp.c_fc.bias"] = {p + "mlp.c_fc.bias", {f}, false};
    t[p + "mlp.c_proj.weight"] = {p + "mlp.c_proj.weight", {f, c}, true};
    t[p + "mlp.c_proj.bias"] = {p + "mlp.c_proj.bias", {c}, false};
  }
  t["ln_f.weight"] = {"ln_f.weight", {c}, false};
  t["ln_f.bias"] = {"ln_f.bias", {c}, false};
  return t;
}

int64_t ModelElements(const ModelShape& m, int64_t n_positions) {
  const int64_t c = m.d_model;
  return int64_t{m.vocab} * c + n_positions * c + m.layers * (12 * c * c + 13 * c) + 2 * c;
}

// [rows, cols] → [cols, rows].
std::vector<float> Transpose(const std::vector<float>& in, int64_t rows, int64_t cols) {
  std::vector<float> out(in.size());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t k = 0; k < cols; ++k) out[k * rows + r] = in[r * cols + k];
  }
  return out;
}

// A causal-mask buffer older transformers saved with the weights.
bool IsAttentionBuffer(const std::string& name) {
  return absl::StartsWith(name, "h.") &&
         (absl::EndsWith(name, ".attn.bias") || absl::EndsWith(name, ".attn.masked_bias"));
}

// Which file holds which tensor: one model.safetensors, or the index's map.
absl::StatusOr<std::map<std::string, std::vector<std::string>>> WeightFiles(const std::string& dir) {
  std::map<std::string, std::vector<std::string>> files;  // file → HF names (empty: all)
  if (Exists(Join(dir, kWeightsFile))) {
    files[kWeightsFile] = {};
    return files;
  }
  const std::string index_path = Join(dir, kIndexFile);
  absl::StatusOr<std::string> text = ReadBounded(index_path, kMaxJsonBytes, "an index may have");
  if (absl::IsNotFound(text.status())) {
    return absl::NotFoundError(absl::StrCat(
        dir, ": neither ", kWeightsFile, " nor ", kIndexFile,
        "; is it a transformers GPT-2 directory saved with safetensors (save_pretrained(DIR, "
        "safe_serialization=True))? pytorch_model.bin is not read"));
  }
  if (!text.ok()) return text.status();
  absl::StatusOr<JsonValue> root = JsonValue::Parse(*text);
  if (!root.ok()) return WithContext(root.status(), index_path);
  const JsonValue* map = root->Find("weight_map");
  if (map == nullptr || !map->is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(index_path, ": want {\"weight_map\": {tensor: file}}"));
  }
  for (const auto& [tensor, file] : map->members()) {
    // Shards must be plain names inside `dir`: an index cannot point elsewhere.
    if (!file.is_string() || file.str().empty() || file.str() == "." || file.str() == ".." ||
        absl::StrContains(file.str(), "/")) {
      return absl::InvalidArgumentError(absl::StrCat(index_path, ": tensor ", tensor,
                                                     " must map to a file name inside ", dir));
    }
    files[file.str()].push_back(tensor);
  }
  if (files.empty()) return absl::InvalidArgumentError(absl::StrCat(index_path, ": weight_map is empty"));
  return files;
}

// ---- output directories ----------------------------------------------------

absl::StatusOr<bool> IsNonEmptyDir(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return false;
  if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(path, ": exists and is not a directory"));
  }
  DIR* d = opendir(path.c_str());
  if (d == nullptr) return absl::FailedPreconditionError(absl::StrCat(path, ": ", std::strerror(errno)));
  bool any = false;
  while (dirent* e = readdir(d)) {
    if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) any = true;
  }
  closedir(d);
  return any;
}

absl::Status CheckOutput(const std::string& out_dir, bool force) {
  if (out_dir.empty()) return absl::InvalidArgumentError("--out is required");
  BATON_ASSIGN_OR_RETURN(bool nonempty, IsNonEmptyDir(out_dir));
  if (nonempty && !force) {
    return absl::FailedPreconditionError(
        absl::StrCat(out_dir, ": not empty; choose another --out or pass --force to replace it"));
  }
  return absl::OkStatus();
}

void RemoveTree(const std::string& path) {
  nftw(
      path.c_str(),
      [](const char* p, const struct stat*, int, struct FTW*) {
        remove(p);  // best effort: what cannot be removed is left, never half-installed
        return 0;
      },
      16,
      FTW_DEPTH | FTW_PHYS);
}

// A directory built under a temporary name beside the final one; removed
// unless Install() moved it into place.
class StagingDir {
 public:
  explicit StagingDir(std::string final_dir)
      : final_(std::move(final_dir)), path_(absl::StrCat(final_, ".tmp-", getpid())) {}
  ~StagingDir() {
    if (!installed_) RemoveTree(path_);
  }
  const std::string& path() const { return path_; }

  absl::Status Create() {
    RemoveTree(path_);  // a leftover of a crashed run of this pid
    return MakeDirectories(path_);
  }
  // rename(2) into place; an existing (empty, or with force any) final dir is
  // first moved aside and deleted after.
  absl::Status Install(bool force) {
    BATON_RETURN_IF_ERROR(CheckOutput(final_, force));
    std::string aside;
    if (Exists(final_)) {
      aside = absl::StrCat(final_, ".old-", getpid());
      RemoveTree(aside);
      if (rename(final_.c_str(), aside.c_str()) != 0) {
        return absl::FailedPreconditionError(absl::StrCat("cannot move ", final_, " aside: ", std::strerror(errno)));
      }
    }
    if (rename(path_.c_str(), final_.c_str()) != 0) {
      const std::string why = std::strerror(errno);
      if (!aside.empty()) rename(aside.c_str(), final_.c_str());
      return absl::FailedPreconditionError(absl::StrCat("cannot rename ", path_, " to ", final_, ": ", why));
    }
    installed_ = true;
    if (!aside.empty()) RemoveTree(aside);
    return absl::OkStatus();
  }

 private:
  std::string final_, path_;
  bool installed_ = false;
};

std::string ConfigJson(const ModelShape& m) {
  // Dropout 0: baton trains without dropout, so fine-tuning the export in
  // transformers starts from the same objective.
  return absl::StrCat(
      "{\n"
      "  \"activation_function\": \"gelu_new\",\n"
      "  \"architectures\": [\"GPT2LMHeadModel\"],\n"
      "  \"attn_pdrop\": 0.0,\n"
      "  \"embd_pdrop\": 0.0,\n"
      "  \"initializer_range\": 0.02,\n"
      "  \"layer_norm_epsilon\": 1e-05,\n"
      "  \"model_type\": \"gpt2\",\n",
      "  \"n_embd\": ", m.d_model, ",\n", "  \"n_head\": ", m.heads, ",\n", "  \"n_inner\": null,\n",
      "  \"n_layer\": ", m.layers, ",\n", "  \"n_positions\": ", m.seq_len, ",\n",
      "  \"reorder_and_upcast_attn\": false,\n"
      "  \"resid_pdrop\": 0.0,\n"
      "  \"scale_attn_by_inverse_layer_idx\": false,\n"
      "  \"scale_attn_weights\": true,\n"
      "  \"tie_word_embeddings\": true,\n"
      "  \"torch_dtype\": \"float32\",\n"
      "  \"use_cache\": true,\n",
      "  \"vocab_size\": ", m.vocab, "\n}\n");
}

}  // namespace

absl::StatusOr<ModelShape> ReadHfConfig(const std::string& hf_dir) {
  const std::string path = Join(hf_dir, kConfigFile);
  BATON_ASSIGN_OR_RETURN(std::string text, ReadBounded(path, kMaxJsonBytes, "a config.json may have"));
  absl::StatusOr<JsonValue> root = JsonValue::Parse(text);
  if (!root.ok()) return WithContext(root.status(), path);
  if (!root->is_object()) return absl::InvalidArgumentError(absl::StrCat(path, ": not a JSON object"));
  ConfigReader c(*root, path);
  if (const JsonValue* t = c.Find("model_type"); t != nullptr && (!t->is_string() || t->str() != "gpt2")) {
    return c.Bad("model_type", "is not \"gpt2\"; only GPT-2 models are imported");
  }
  ModelShape m;
  BATON_ASSIGN_OR_RETURN(int64_t embd, c.Int("n_embd", kMaxEmbd));
  BATON_ASSIGN_OR_RETURN(int64_t layers, c.Int("n_layer", kMaxLayers));
  BATON_ASSIGN_OR_RETURN(int64_t heads, c.Int("n_head", embd));
  BATON_ASSIGN_OR_RETURN(int64_t vocab, c.Int("vocab_size", kMaxVocab));
  BATON_ASSIGN_OR_RETURN(int64_t positions, c.Int("n_positions", kMaxPositions));
  if (embd % heads != 0) return c.Bad("n_head", absl::StrCat("(", heads, ") must divide n_embd (", embd, ")"));
  m.d_model = static_cast<int>(embd);
  m.layers = static_cast<int>(layers);
  m.heads = static_cast<int>(heads);
  m.vocab = static_cast<int>(vocab);
  m.seq_len = static_cast<int>(positions);
  if (const JsonValue* v = c.Find("n_inner"); v != nullptr && v->kind() != JsonValue::Kind::kNull &&
                                              (!v->integer().has_value() || *v->integer() != 4 * embd)) {
    return c.Bad("n_inner", absl::StrCat("must be null or 4 * n_embd (", 4 * embd, "): baton's MLP is 4x wide"));
  }
  if (const JsonValue* v = c.Find("activation_function"); v != nullptr) {
    // Both names are the tanh approximation of GELU, baton's activation.
    if (!v->is_string() || (v->str() != "gelu_new" && v->str() != "gelu_pytorch_tanh")) {
      return c.Bad("activation_function", "must be \"gelu_new\" (the tanh GELU baton's MLP uses)");
    }
  }
  if (const JsonValue* v = c.Find("layer_norm_epsilon"); v != nullptr) {
    if (!v->is_number() || std::abs(v->number() - kLayerNormEps) > 1e-6 * kLayerNormEps) {
      return c.Bad("layer_norm_epsilon", "must be 1e-05, the epsilon of baton's LayerNorm");
    }
  }
  BATON_RETURN_IF_ERROR(c.BoolIs("tie_word_embeddings", true,
                                 "baton's LM head is the token embedding; an untied head cannot be imported"));
  BATON_RETURN_IF_ERROR(c.BoolIs("scale_attn_weights", true, "baton scales attention scores by 1/sqrt(head_dim)"));
  BATON_RETURN_IF_ERROR(c.BoolIs("scale_attn_by_inverse_layer_idx", false,
                                 "baton does not scale attention by the layer index"));
  BATON_RETURN_IF_ERROR(c.BoolIs("reorder_and_upcast_attn", false, "baton's attention has no such variant"));
  BATON_RETURN_IF_ERROR(c.BoolIs("add_cross_attention", false, "baton's GPT-2 has no cross-attention"));
  if (ModelElements(m, positions) > kMaxElements) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": the model has ", ModelElements(m, positions),
                                                   " parameters, more than the ", kMaxElements,
                                                   " batonctl converts in memory"));
  }
  return m;
}

absl::StatusOr<std::map<std::string, FullTensor>> ReadHfWeights(const std::string& hf_dir,
                                                                const ModelShape& model) {
  BATON_ASSIGN_OR_RETURN(ModelShape config, ReadHfConfig(hf_dir));
  const int64_t positions = config.seq_len;
  ModelShape same = model;
  same.seq_len = config.seq_len;
  if (!(same == config)) {
    return absl::InvalidArgumentError(absl::StrCat(hf_dir, ": holds ", checkpoint::DescribeModel(config),
                                                   ", not the requested ", checkpoint::DescribeModel(model)));
  }
  if (model.seq_len < 1 || model.seq_len > positions) {
    return absl::InvalidArgumentError(absl::StrCat(hf_dir, ": seq_len ", model.seq_len,
                                                   " must be from 1 to n_positions (", positions, ")"));
  }
  const std::map<std::string, HfTensor> want = HfTensors(model, positions);
  BATON_ASSIGN_OR_RETURN(auto files, WeightFiles(hf_dir));
  // No file of a model this size needs more than all its tensors in f32, the
  // lm_head copy, the mask buffers and the largest header.
  const int64_t max_file = 8 + kMaxHeaderBytes +
                           4 * (ModelElements(model, positions) + int64_t{model.vocab} * model.d_model +
                                model.layers * (positions * positions + 1));

  std::map<std::string, FullTensor> out;
  std::map<std::string, std::string> seen;  // HF name (no prefix) → file
  std::optional<std::vector<float>> lm_head;
  for (const auto& [file, listed] : files) {
    const std::string path = Join(hf_dir, file);
    absl::StatusOr<std::string> bytes = ReadBounded(path, max_file, "a GPT-2 of this config.json needs");
    if (absl::IsNotFound(bytes.status()) && !listed.empty()) {
      return absl::NotFoundError(absl::StrCat(path, ": missing (listed in ", kIndexFile, " for tensor ",
                                              listed.front(), "); copy the whole model directory"));
    }
    if (!bytes.ok()) return bytes.status();
    absl::StatusOr<SafetensorsFile> st = SafetensorsFile::Parse(*std::move(bytes));
    if (!st.ok()) return WithContext(st.status(), path);
    const std::set<std::string> index(listed.begin(), listed.end());
    for (const std::string& name : listed) {
      if (st->tensors().count(name) == 0) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": tensor ", name, " is listed for this file in ",
                                                       kIndexFile, " but not stored in it"));
      }
    }
    for (const auto& [stored, entry] : st->tensors()) {
      const std::string where = absl::StrCat(path, ": tensor ", stored);
      if (!listed.empty() && index.count(stored) == 0) {
        return absl::InvalidArgumentError(absl::StrCat(where, " is not listed for this file in ", kIndexFile));
      }
      const std::string name = absl::StartsWith(stored, kHfPrefix) ? stored.substr(strlen(kHfPrefix)) : stored;
      if (IsAttentionBuffer(name)) continue;
      if (!seen.emplace(name, file).second) {
        return absl::InvalidArgumentError(absl::StrCat(where, " is stored twice (also in ", seen[name], ")"));
      }
      std::vector<int64_t> shape;
      const HfTensor* hf = nullptr;
      if (name == kLmHead) {
        shape = {model.vocab, model.d_model};
      } else if (auto it = want.find(name); it != want.end()) {
        hf = &it->second;
        shape = hf->hf_shape;
      } else {
        return absl::InvalidArgumentError(absl::StrCat(
            where, " is not part of a GPT-2 of ", model.layers,
            " layers (baton imports GPT2LMHeadModel / GPT2Model weights only)"));
      }
      if (entry.shape != shape) {
        return absl::InvalidArgumentError(absl::StrCat(where, " has shape ", Shape(entry.shape), " but ",
                                                       kConfigFile, " implies ", Shape(shape)));
      }
      if (entry.dtype != "F32" && entry.dtype != "F16" && entry.dtype != "BF16") {
        return absl::InvalidArgumentError(absl::StrCat(where, " is ", entry.dtype, "; want F32, F16 or BF16"));
      }
      absl::StatusOr<std::vector<double>> wide = st->Floats(stored);
      if (!wide.ok()) return WithContext(wide.status(), where);
      std::vector<float> values(wide->begin(), wide->end());
      wide->clear();
      if (hf == nullptr) {
        lm_head = std::move(values);
        continue;
      }
      FullTensor t;
      if (hf->conv1d) {
        values = Transpose(values, shape[0], shape[1]);
        t.shape = {shape[1], shape[0]};
      } else if (hf->baton_name == "wpe") {
        values.resize(static_cast<size_t>(model.seq_len) * model.d_model);  // the first seq_len positions
        t.shape = {model.seq_len, model.d_model};
      } else {
        t.shape = shape;
      }
      t.values = std::move(values);
      out[hf->baton_name] = std::move(t);
    }
  }
  for (const auto& [name, hf] : want) {
    if (seen.count(name) == 0) {
      return absl::InvalidArgumentError(
          files.count(kWeightsFile) > 0
              ? absl::StrCat(Join(hf_dir, kWeightsFile), ": tensor ", kHfPrefix, name,
                             " is missing (a GPT-2 of this config.json has it)")
              : absl::StrCat(Join(hf_dir, kIndexFile), ": tensor ", kHfPrefix, name,
                             " is missing from the weight_map (a GPT-2 of this config.json has it)"));
    }
  }
  if (lm_head.has_value() && *lm_head != out["wte"].values) {
    return absl::InvalidArgumentError(absl::StrCat(
        hf_dir, ": tensor ", kLmHead, " differs from ", kHfPrefix,
        "wte.weight; baton's LM head is the token embedding, so an untied model cannot be imported"));
  }
  return out;
}

absl::StatusOr<ModelShape> ImportHfCheckpoint(const std::string& hf_dir, const std::string& out_dir,
                                              const HfImportOptions& options) {
  BATON_RETURN_IF_ERROR(CheckOutput(out_dir, options.force));
  BATON_ASSIGN_OR_RETURN(ModelShape model, ReadHfConfig(hf_dir));
  if (options.seq_len != 0) {
    if (options.seq_len < 1 || options.seq_len > model.seq_len) {
      return absl::InvalidArgumentError(absl::StrCat("--seq_len=", options.seq_len, " must be from 1 to ",
                                                     hf_dir, "'s n_positions (", model.seq_len, ")"));
    }
    model.seq_len = options.seq_len;
  }
  BATON_ASSIGN_OR_RETURN(auto tensors, ReadHfWeights(hf_dir, model));

  // One chunk at tp 1, every tensor whole (replicated layout): any layout
  // loads it (ChunkStateFrom cuts shards from the full tensors).
  std::vector<float> zeros;
  for (const auto& [name, t] : tensors) zeros.resize(std::max(zeros.size(), t.values.size()));
  std::vector<checkpoint::StateShardTensor> shard;
  for (const auto& [name, t] : tensors) {
    checkpoint::TensorLayout layout;
    layout.full_shape = t.shape;
    const absl::Span<const float> zero(zeros.data(), t.values.size());
    shard.push_back({name, layout, t.values, zero, zero});
  }
  StagingDir staging(out_dir);
  BATON_RETURN_IF_ERROR(staging.Create());
  BATON_ASSIGN_OR_RETURN(std::string file, checkpoint::WriteStateShardFile(staging.path(), 0, 0, 1,
                                                                           /*optimizer_step=*/0, true, shard));
  checkpoint::ManifestInfo manifest;
  manifest.version = 2;
  manifest.job = "import-hf";
  manifest.step = 0;
  manifest.model = model;
  manifest.layout.schedule = "import-hf";  // informational: no job laid it out
  manifest.files = {file};
  BATON_RETURN_IF_ERROR(checkpoint::WriteManifest(staging.path(), manifest));
  BATON_RETURN_IF_ERROR(staging.Install(options.force));
  return model;
}

absl::StatusOr<ModelShape> ExportHfCheckpoint(const std::string& checkpoint_dir, const std::string& out_dir,
                                              bool force) {
  BATON_RETURN_IF_ERROR(CheckOutput(out_dir, force));
  BATON_ASSIGN_OR_RETURN(std::string dir, checkpoint::ResolveCheckpoint(checkpoint_dir));
  BATON_ASSIGN_OR_RETURN(checkpoint::ManifestInfo manifest, checkpoint::ReadManifest(dir));
  const ModelShape& m = manifest.model;
  if (manifest.version < 2 || m.synthetic || m.layers < 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        dir, ": the manifest names no GPT model (a v1 or synthetic checkpoint); export needs n_head, which "
             "only a v2 manifest records"));
  }
  if (ModelElements(m, m.seq_len) > kMaxElements) {
    return absl::InvalidArgumentError(absl::StrCat(dir, ": the model is larger than batonctl converts in memory"));
  }
  BATON_ASSIGN_OR_RETURN(checkpoint::FullState state, checkpoint::LoadFullState(dir));
  const std::map<std::string, HfTensor> names = HfTensors(m, m.seq_len);
  std::set<std::string> exported;
  SafetensorsWriter writer;
  writer.SetMetadata("format", "pt");  // transformers refuses safetensors files without it
  for (const auto& [hf_name, hf] : names) {
    auto it = state.tensors.find(hf.baton_name);
    const std::vector<int64_t> want =
        hf.conv1d ? std::vector<int64_t>{hf.hf_shape[1], hf.hf_shape[0]} : hf.hf_shape;
    if (it == state.tensors.end()) {
      return absl::InvalidArgumentError(absl::StrCat(dir, ": tensor ", hf.baton_name, " is missing; the manifest's ",
                                                     checkpoint::DescribeModel(m), " has it"));
    }
    if (it->second.shape != want) {
      return absl::InvalidArgumentError(absl::StrCat(dir, ": tensor ", hf.baton_name, " has shape ",
                                                     Shape(it->second.shape), " but the manifest's model needs ",
                                                     Shape(want)));
    }
    const std::vector<float> values =
        hf.conv1d ? Transpose(it->second.values, want[0], want[1]) : it->second.values;
    BATON_RETURN_IF_ERROR(writer.AddFloat32(kHfPrefix + hf_name, hf.hf_shape, values));
    exported.insert(hf.baton_name);
  }
  for (const auto& [name, t] : state.tensors) {
    if (exported.count(name) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(dir, ": tensor ", name, " is not part of a GPT-2 ", checkpoint::DescribeModel(m)));
    }
  }
  StagingDir staging(out_dir);
  BATON_RETURN_IF_ERROR(staging.Create());
  BATON_RETURN_IF_ERROR(writer.WriteFile(Join(staging.path(), kWeightsFile)));
  BATON_RETURN_IF_ERROR(WriteFileAtomically(Join(staging.path(), kConfigFile), ConfigJson(m)));
  BATON_RETURN_IF_ERROR(staging.Install(force));
  return m;
}

}  // namespace baton::cli
