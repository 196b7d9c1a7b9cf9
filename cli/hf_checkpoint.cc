#include "cli/hf_checkpoint.h"

#include <dirent.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
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
constexpr char kGpt2Prefix[] = "transformer.";
constexpr char kLlamaPrefix[] = "model.";
constexpr char kLmHead[] = "lm_head.weight";

// baton's LayerNorm epsilon (kernels/cpu/layernorm.h) and the bounds a
// config must respect before anything is allocated from it.
constexpr double kLayerNormEps = 1e-5;
constexpr int64_t kMaxEmbd = 1 << 16;
constexpr int64_t kMaxLayers = 1 << 10;
constexpr int64_t kMaxVocab = 1 << 24;  // worker/model/gpt_config.h kMaxVocab
constexpr int64_t kMaxPositions = 1 << 20;
constexpr int64_t kMaxFfn = 1 << 20;
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
  ConfigReader(const JsonValue& root, std::string path, std::string family)
      : root_(root), path_(std::move(path)), family_(std::move(family)) {}

  absl::Status Bad(const std::string& field, const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": ", field, " ", what));
  }
  // A required integer in [1, max].
  absl::StatusOr<int64_t> Int(const std::string& field, int64_t max) const {
    const JsonValue* v = root_.Find(field);
    if (v == nullptr) return Bad(field, absl::StrCat("is missing (a transformers ", family_, " config has it)"));
    return IntValue(field, *v, max);
  }
  // An optional integer in [1, max]; `absent` when missing or null.
  absl::StatusOr<int64_t> OptionalInt(const std::string& field, int64_t absent, int64_t max) const {
    const JsonValue* v = root_.Find(field);
    if (v == nullptr || v->kind() == JsonValue::Kind::kNull) return absent;
    return IntValue(field, *v, max);
  }
  // An optional positive finite number below `max`; `absent` when missing.
  absl::StatusOr<double> OptionalPositive(const std::string& field, double absent, double max) const {
    const JsonValue* v = root_.Find(field);
    if (v == nullptr || v->kind() == JsonValue::Kind::kNull) return absent;
    if (!v->is_number() || !std::isfinite(v->number()) || v->number() <= 0 || v->number() >= max) {
      return Bad(field, absl::StrCat("must be a positive number below ", max));
    }
    return v->number();
  }
  // An optional boolean, `absent` when missing or null.
  absl::StatusOr<bool> OptionalBool(const std::string& field, bool absent) const {
    const JsonValue* v = root_.Find(field);
    if (v == nullptr || v->kind() == JsonValue::Kind::kNull) return absent;
    if (v->kind() != JsonValue::Kind::kBool) return Bad(field, "must be true or false");
    return v->bool_value();
  }
  // An optional boolean that baton supports only as `want` (HF's default
  // when absent is `want` too).
  absl::Status BoolIs(const std::string& field, bool want, const std::string& why) const {
    BATON_ASSIGN_OR_RETURN(bool value, OptionalBool(field, want));
    if (value != want) return Bad(field, absl::StrCat("is ", want ? "false" : "true", ": ", why));
    return absl::OkStatus();
  }
  // A field baton has no equivalent of: absent or null only.
  absl::Status Null(const std::string& field, const std::string& why) const {
    const JsonValue* v = root_.Find(field);
    if (v == nullptr || v->kind() == JsonValue::Kind::kNull) return absl::OkStatus();
    return Bad(field, absl::StrCat("is set: ", why));
  }
  const JsonValue* Find(const std::string& field) const { return root_.Find(field); }

 private:
  absl::StatusOr<int64_t> IntValue(const std::string& field, const JsonValue& v, int64_t max) const {
    if (!v.integer().has_value() || *v.integer() < 1 || *v.integer() > max) {
      return Bad(field, absl::StrCat("must be an integer from 1 to ", max));
    }
    return *v.integer();
  }

  const JsonValue& root_;
  std::string path_, family_;
};

bool IsLlama(const ModelShape& m) { return m.arch == "llama"; }

// ModelShape's equality, the architecture's fields included whatever
// ModelShape::operator== compares.
bool SameModel(const ModelShape& a, const ModelShape& b) {
  return a.synthetic == b.synthetic && a.layers == b.layers && a.d_model == b.d_model && a.heads == b.heads &&
         a.vocab == b.vocab && a.seq_len == b.seq_len && a.arch == b.arch && a.kv_heads == b.kv_heads &&
         a.ffn_dim == b.ffn_dim && a.rope_theta == b.rope_theta && a.norm_eps == b.norm_eps &&
         a.tie_embeddings == b.tie_embeddings && a.moe_experts == b.moe_experts && a.moe_top_k == b.moe_top_k &&
         a.moe_every == b.moe_every && a.moe_capacity_factor == b.moe_capacity_factor &&
         a.moe_aux_coef == b.moe_aux_coef;
}

// ---- the tensors of a model ------------------------------------------------

struct HfTensor {
  std::string hf_name;  // as stored in a *ForCausalLM save (with its prefix)
  std::string baton_name;
  std::vector<int64_t> hf_shape;  // as HF stores it
  bool conv1d = false;            // HF [in, out], baton [out, in]
};

// How one architecture's tensors are named and laid out by transformers.
struct HfLayout {
  std::string family;  // "GPT-2", "Llama": for messages
  std::string prefix;  // of every tensor but lm_head.weight; a bare *Model save has none
  // Every tensor under its HF name less `prefix`, with the shape HF stores
  // (GPT-2's wpe with n_positions rows). An untied Llama's head is
  // "lm_head.weight", stored without a prefix.
  std::map<std::string, HfTensor> tensors;
  // With a tied head: the baton name of the token embedding an optional
  // lm_head.weight must equal.
  std::string tied_to;
  std::string architecture;  // config.json "architectures"
};

// The GPT-2 of `m` (n_positions rows of wpe).
HfLayout Gpt2Layout(const ModelShape& m, int64_t n_positions) {
  const int64_t c = m.d_model, v = m.vocab, f = 4 * c;
  HfLayout l;
  l.family = "GPT-2";
  l.prefix = kGpt2Prefix;
  l.tied_to = "wte";
  l.architecture = "GPT2LMHeadModel";
  auto add = [&](const std::string& name, const std::string& baton, std::vector<int64_t> shape, bool conv1d) {
    l.tensors[name] = {l.prefix + name, baton, std::move(shape), conv1d};
  };
  add("wte.weight", "wte", {v, c}, false);
  add("wpe.weight", "wpe", {n_positions, c}, false);
  for (int i = 0; i < m.layers; ++i) {
    const std::string p = absl::StrCat("h.", i, ".");
    for (const char* n :
         {"ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias", "attn.c_proj.bias", "mlp.c_proj.bias"}) {
      add(p + n, p + n, {c}, false);
    }
    add(p + "attn.c_attn.weight", p + "attn.c_attn.weight", {c, 3 * c}, true);
    add(p + "attn.c_attn.bias", p + "attn.c_attn.bias", {3 * c}, false);
    add(p + "attn.c_proj.weight", p + "attn.c_proj.weight", {c, c}, true);
    add(p + "mlp.c_fc.weight", p + "mlp.c_fc.weight", {c, f}, true);
    add(p + "mlp.c_fc.bias", p + "mlp.c_fc.bias", {f}, false);
    add(p + "mlp.c_proj.weight", p + "mlp.c_proj.weight", {f, c}, true);
  }
  add("ln_f.weight", "ln_f.weight", {c}, false);
  add("ln_f.bias", "ln_f.bias", {c}, false);
  return l;
}

// The Llama of `m`: baton's names are HF's less "model.", every matrix
// [out, in] in both (nn.Linear), so nothing is transposed.
HfLayout LlamaLayout(const ModelShape& m) {
  const int64_t c = m.d_model, v = m.vocab, f = m.ffn_dim, hd = m.d_model / m.heads;
  const int64_t qc = m.heads * hd, kvc = m.kv_heads * hd;
  HfLayout l;
  l.family = "Llama";
  l.prefix = kLlamaPrefix;
  l.tied_to = m.tie_embeddings ? "embed_tokens.weight" : "";
  l.architecture = "LlamaForCausalLM";
  auto add = [&](const std::string& name, std::vector<int64_t> shape) {
    l.tensors[name] = {l.prefix + name, name, std::move(shape), false};
  };
  add("embed_tokens.weight", {v, c});
  for (int i = 0; i < m.layers; ++i) {
    const std::string p = absl::StrCat("layers.", i, ".");
    add(p + "input_layernorm.weight", {c});
    add(p + "self_attn.q_proj.weight", {qc, c});
    add(p + "self_attn.k_proj.weight", {kvc, c});
    add(p + "self_attn.v_proj.weight", {kvc, c});
    add(p + "self_attn.o_proj.weight", {c, qc});
    add(p + "post_attention_layernorm.weight", {c});
    add(p + "mlp.gate_proj.weight", {f, c});
    add(p + "mlp.up_proj.weight", {f, c});
    add(p + "mlp.down_proj.weight", {c, f});
  }
  add("norm.weight", {c});
  if (!m.tie_embeddings) l.tensors[kLmHead] = {kLmHead, kLmHead, {v, c}, false};
  return l;
}

HfLayout LayoutOf(const ModelShape& m, int64_t n_positions) {
  return IsLlama(m) ? LlamaLayout(m) : Gpt2Layout(m, n_positions);
}

int64_t ModelElements(const ModelShape& m, int64_t n_positions) {
  const int64_t c = m.d_model;
  if (IsLlama(m)) {
    const int64_t hd = c / m.heads, qc = m.heads * hd, kvc = int64_t{m.kv_heads} * hd, f = m.ffn_dim;
    return int64_t{m.vocab} * c * (m.tie_embeddings ? 1 : 2) + c +
           m.layers * (2 * c + 2 * qc * c + 2 * kvc * c + 3 * f * c);
  }
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

// A buffer older transformers saved with the weights (name less prefix):
// GPT-2's causal mask, Llama's rotary inverse frequencies. Rebuilt by both.
bool IsBuffer(const ModelShape& m, const std::string& name) {
  if (IsLlama(m)) return absl::StartsWith(name, "layers.") && absl::EndsWith(name, ".self_attn.rotary_emb.inv_freq");
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
        "; is it a transformers GPT-2 or Llama directory saved with safetensors (save_pretrained(DIR, "
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

// The shortest decimal that reads back as `v` (a float): 1e-06, not
// 9.99999997e-07, so a config.json written by export reads as written; a
// whole number as transformers writes it (500000.0, not 5e+05).
std::string FloatJson(float v) {
  char buf[64];
  if (std::abs(v) < 1e15f && v == std::floor(v)) {
    std::snprintf(buf, sizeof(buf), "%.1f", static_cast<double>(v));
    return buf;
  }
  for (int digits = 1; digits <= 9; ++digits) {
    std::snprintf(buf, sizeof(buf), "%.*g", digits, static_cast<double>(v));
    if (std::strtof(buf, nullptr) == v) break;
  }
  return buf;
}

std::string Gpt2ConfigJson(const ModelShape& m) {
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

std::string LlamaConfigJson(const ModelShape& m) {
  return absl::StrCat(
      "{\n"
      "  \"architectures\": [\"LlamaForCausalLM\"],\n"
      "  \"attention_bias\": false,\n"
      "  \"attention_dropout\": 0.0,\n"
      "  \"head_dim\": ", m.d_model / m.heads, ",\n",
      "  \"hidden_act\": \"silu\",\n"
      "  \"hidden_size\": ", m.d_model, ",\n",
      "  \"initializer_range\": 0.02,\n"
      "  \"intermediate_size\": ", m.ffn_dim, ",\n",
      "  \"max_position_embeddings\": ", m.seq_len, ",\n",
      "  \"mlp_bias\": false,\n"
      "  \"model_type\": \"llama\",\n"
      "  \"num_attention_heads\": ", m.heads, ",\n",
      "  \"num_hidden_layers\": ", m.layers, ",\n",
      "  \"num_key_value_heads\": ", m.kv_heads, ",\n",
      "  \"pretraining_tp\": 1,\n"
      "  \"rms_norm_eps\": ", FloatJson(m.norm_eps), ",\n",
      "  \"rope_scaling\": null,\n"
      "  \"rope_theta\": ", FloatJson(m.rope_theta), ",\n",
      "  \"tie_word_embeddings\": ", m.tie_embeddings ? "true" : "false", ",\n",
      "  \"torch_dtype\": \"float32\",\n"
      "  \"use_cache\": true,\n"
      "  \"vocab_size\": ", m.vocab, "\n}\n");
}

std::string ConfigJson(const ModelShape& m) { return IsLlama(m) ? LlamaConfigJson(m) : Gpt2ConfigJson(m); }

absl::StatusOr<ModelShape> ReadGpt2Config(const ConfigReader& c, const std::string& path) {
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

// transformers' LlamaConfig (4.40 and later fields): defaults as LlamaConfig
// has them where a field is absent.
absl::StatusOr<ModelShape> ReadLlamaConfig(const ConfigReader& c, const std::string& path) {
  ModelShape m;
  m.arch = "llama";
  BATON_ASSIGN_OR_RETURN(int64_t hidden, c.Int("hidden_size", kMaxEmbd));
  BATON_ASSIGN_OR_RETURN(int64_t layers, c.Int("num_hidden_layers", kMaxLayers));
  BATON_ASSIGN_OR_RETURN(int64_t heads, c.Int("num_attention_heads", hidden));
  BATON_ASSIGN_OR_RETURN(int64_t kv_heads, c.OptionalInt("num_key_value_heads", heads, heads));
  BATON_ASSIGN_OR_RETURN(int64_t ffn, c.Int("intermediate_size", kMaxFfn));
  BATON_ASSIGN_OR_RETURN(int64_t vocab, c.Int("vocab_size", kMaxVocab));
  BATON_ASSIGN_OR_RETURN(int64_t positions, c.Int("max_position_embeddings", kMaxPositions));
  if (hidden % heads != 0) {
    return c.Bad("num_attention_heads", absl::StrCat("(", heads, ") must divide hidden_size (", hidden, ")"));
  }
  if (heads % kv_heads != 0) {
    return c.Bad("num_key_value_heads",
                 absl::StrCat("(", kv_heads, ") must divide num_attention_heads (", heads, ")"));
  }
  const int64_t head_dim = hidden / heads;
  if (head_dim % 2 != 0) {
    return c.Bad("num_attention_heads", absl::StrCat("gives an odd head dimension ", hidden, " / ", heads, " = ",
                                                     head_dim, "; baton's rotary embedding needs it even"));
  }
  if (const JsonValue* v = c.Find("head_dim"); v != nullptr && v->kind() != JsonValue::Kind::kNull &&
                                               (!v->integer().has_value() || *v->integer() != head_dim)) {
    return c.Bad("head_dim", absl::StrCat("must be hidden_size / num_attention_heads (", head_dim,
                                          "): baton's attention heads are d_model / heads wide"));
  }
  if (const JsonValue* v = c.Find("hidden_act"); v != nullptr) {
    // Both names are x · sigmoid(x), the gate activation of baton's SwiGLU.
    if (!v->is_string() || (v->str() != "silu" && v->str() != "swish")) {
      return c.Bad("hidden_act", "must be \"silu\" (the SwiGLU gate baton's Llama MLP uses)");
    }
  }
  BATON_RETURN_IF_ERROR(c.BoolIs("attention_bias", false, "baton's Llama attention has no biases"));
  BATON_RETURN_IF_ERROR(c.BoolIs("mlp_bias", false, "baton's Llama MLP has no biases"));
  BATON_RETURN_IF_ERROR(c.Null("rope_scaling",
                               "baton's rotary embedding has no scaling (linear, dynamic, yarn, llama3); only "
                               "rope_scaling null is imported"));
  BATON_ASSIGN_OR_RETURN(int64_t tp, c.OptionalInt("pretraining_tp", 1, 1 << 20));
  if (tp != 1) return c.Bad("pretraining_tp", absl::StrCat("is ", tp, ": only pretraining_tp 1 is imported"));
  BATON_ASSIGN_OR_RETURN(double eps, c.OptionalPositive("rms_norm_eps", 1e-6, 1.0));
  BATON_ASSIGN_OR_RETURN(double theta, c.OptionalPositive("rope_theta", 10000.0, 1e30));
  BATON_ASSIGN_OR_RETURN(bool tied, c.OptionalBool("tie_word_embeddings", false));
  if (static_cast<float>(eps) <= 0.0f) return c.Bad("rms_norm_eps", "is too small for a float32 epsilon");
  m.d_model = static_cast<int>(hidden);
  m.layers = static_cast<int>(layers);
  m.heads = static_cast<int>(heads);
  m.kv_heads = static_cast<int>(kv_heads);
  m.ffn_dim = static_cast<int>(ffn);
  m.vocab = static_cast<int>(vocab);
  m.seq_len = static_cast<int>(positions);
  m.norm_eps = static_cast<float>(eps);
  m.rope_theta = static_cast<float>(theta);
  m.tie_embeddings = tied;
  if (ModelElements(m, positions) > kMaxElements) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": the model has ", ModelElements(m, positions),
                                                   " parameters, more than the ", kMaxElements,
                                                   " batonctl converts in memory"));
  }
  return m;
}

std::string ArchField(const std::string& arch) { return arch == "llama" ? "llama" : "gpt2"; }

}  // namespace

std::string JobModelBlock(const ModelShape& m) {
  if (!IsLlama(m)) {
    return absl::StrCat("model { layers: ", m.layers, " d_model: ", m.d_model, " heads: ", m.heads,
                        " vocab: ", m.vocab, " seq_len: ", m.seq_len, " }");
  }
  return absl::StrCat("model { arch: \"llama\" layers: ", m.layers, " d_model: ", m.d_model, " heads: ", m.heads,
                      " kv_heads: ", m.kv_heads, " ffn_dim: ", m.ffn_dim, " vocab: ", m.vocab,
                      " seq_len: ", m.seq_len, " rope_theta: ", FloatJson(m.rope_theta),
                      " norm_eps: ", FloatJson(m.norm_eps), " tie_embeddings: ", m.tie_embeddings ? "true" : "false",
                      " }");
}

absl::StatusOr<ModelShape> ReadHfConfig(const std::string& hf_dir) {
  const std::string path = Join(hf_dir, kConfigFile);
  BATON_ASSIGN_OR_RETURN(std::string text, ReadBounded(path, kMaxJsonBytes, "a config.json may have"));
  absl::StatusOr<JsonValue> root = JsonValue::Parse(text);
  if (!root.ok()) return WithContext(root.status(), path);
  if (!root->is_object()) return absl::InvalidArgumentError(absl::StrCat(path, ": not a JSON object"));
  const JsonValue* type = root->Find("model_type");
  if (type != nullptr && type->is_string() && type->str() == "llama") {
    return ReadLlamaConfig(ConfigReader(*root, path, "Llama"), path);
  }
  const ConfigReader c(*root, path, "GPT-2");
  if (type != nullptr && (!type->is_string() || type->str() != "gpt2")) {
    return c.Bad("model_type", "is not \"gpt2\" or \"llama\"; only GPT-2 and Llama models are imported");
  }
  return ReadGpt2Config(c, path);
}

absl::StatusOr<std::map<std::string, FullTensor>> ReadHfWeights(const std::string& hf_dir,
                                                                const ModelShape& model) {
  BATON_ASSIGN_OR_RETURN(ModelShape config, ReadHfConfig(hf_dir));
  const int64_t positions = config.seq_len;
  ModelShape same = model;
  same.seq_len = config.seq_len;
  if (!SameModel(same, config)) {
    return absl::InvalidArgumentError(absl::StrCat(hf_dir, ": holds ", checkpoint::DescribeModel(config),
                                                   ", not the requested ", checkpoint::DescribeModel(model)));
  }
  const bool llama = IsLlama(model);
  if (model.seq_len < 1 || model.seq_len > positions) {
    return absl::InvalidArgumentError(absl::StrCat(hf_dir, ": seq_len ", model.seq_len, " must be from 1 to ",
                                                   llama ? "max_position_embeddings" : "n_positions", " (",
                                                   positions, ")"));
  }
  const HfLayout layout = LayoutOf(model, positions);
  const std::map<std::string, HfTensor>& want = layout.tensors;
  BATON_ASSIGN_OR_RETURN(auto files, WeightFiles(hf_dir));
  // No file of a model this size needs more than all its tensors in f32, a
  // tied lm_head copy, the buffers and the largest header.
  const int64_t max_file = 8 + kMaxHeaderBytes +
                           4 * (ModelElements(model, positions) + int64_t{model.vocab} * model.d_model +
                                model.layers * (positions * positions + 1 + model.d_model));

  std::map<std::string, FullTensor> out;
  std::map<std::string, std::string> seen;  // HF name (no prefix) → file
  std::optional<std::vector<float>> tied_head;  // an lm_head.weight that must equal the embedding
  const std::string needs = absl::StrCat("a ", layout.family, " of this config.json needs");
  for (const auto& [file, listed] : files) {
    const std::string path = Join(hf_dir, file);
    absl::StatusOr<std::string> bytes = ReadBounded(path, max_file, needs);
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
      const std::string name =
          absl::StartsWith(stored, layout.prefix) ? stored.substr(layout.prefix.size()) : stored;
      if (IsBuffer(model, name)) continue;
      if (!seen.emplace(name, file).second) {
        return absl::InvalidArgumentError(absl::StrCat(where, " is stored twice (also in ", seen[name], ")"));
      }
      std::vector<int64_t> shape;
      const HfTensor* hf = nullptr;
      if (auto it = want.find(name); it != want.end()) {
        hf = &it->second;
        shape = hf->hf_shape;
      } else if (name == kLmHead && !layout.tied_to.empty()) {
        shape = {model.vocab, model.d_model};
      } else {
        return absl::InvalidArgumentError(absl::StrCat(
            where, " is not part of a ", layout.family, " of ", model.layers, " layers (baton imports ",
            llama ? "LlamaForCausalLM / LlamaModel" : "GPT2LMHeadModel / GPT2Model", " weights only)"));
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
        tied_head = std::move(values);
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
  const std::string has_it = absl::StrCat("(a ", layout.family, " of this config.json has it",
                                          llama && !model.tie_embeddings
                                              ? "; tie_word_embeddings is false, so the LM head is stored"
                                              : "",
                                          ")");
  for (const auto& [name, hf] : want) {
    if (seen.count(name) == 0) {
      return absl::InvalidArgumentError(
          files.count(kWeightsFile) > 0
              ? absl::StrCat(Join(hf_dir, kWeightsFile), ": tensor ", hf.hf_name, " is missing ", has_it)
              : absl::StrCat(Join(hf_dir, kIndexFile), ": tensor ", hf.hf_name, " is missing from the weight_map ",
                             has_it));
    }
  }
  if (tied_head.has_value() && *tied_head != out[layout.tied_to].values) {
    return absl::InvalidArgumentError(absl::StrCat(
        hf_dir, ": tensor ", kLmHead, " differs from ", want.at(llama ? "embed_tokens.weight" : "wte.weight").hf_name,
        llama ? "; config.json says tie_word_embeddings true (the LM head is the token embedding): set it to "
                "false to import the separate head"
              : "; baton's LM head is the token embedding, so an untied model cannot be imported"));
  }
  return out;
}

absl::StatusOr<ModelShape> ImportHfCheckpoint(const std::string& hf_dir, const std::string& out_dir,
                                              const HfImportOptions& options) {
  BATON_RETURN_IF_ERROR(CheckOutput(out_dir, options.force));
  BATON_ASSIGN_OR_RETURN(ModelShape model, ReadHfConfig(hf_dir));
  if (options.seq_len != 0) {
    if (options.seq_len < 1 || options.seq_len > model.seq_len) {
      return absl::InvalidArgumentError(absl::StrCat("--seq_len=", options.seq_len, " must be from 1 to ", hf_dir,
                                                     "'s ", IsLlama(model) ? "max_position_embeddings" : "n_positions",
                                                     " (", model.seq_len, ")"));
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
  if (m.moe()) {
    // GPT2LMHeadModel has no experts, and a Mixtral-style export (and its
    // golden against transformers) is not written yet.
    return absl::FailedPreconditionError(absl::StrCat(
        dir, ": holds ", checkpoint::DescribeModel(m), "; MoE export is not supported yet: only dense GPT-2 and "
        "Llama checkpoints are exported"));
  }
  if (IsLlama(m) && (m.heads < 1 || m.kv_heads < 1 || m.ffn_dim < 1 || !(m.rope_theta > 0) || !(m.norm_eps > 0) ||
                     m.d_model % m.heads != 0)) {
    return absl::FailedPreconditionError(absl::StrCat(
        dir, ": the manifest's Llama model lacks kv_heads, ffn_dim, rope_theta or norm_eps (",
        checkpoint::DescribeModel(m), "); export needs them all"));
  }
  if (ModelElements(m, m.seq_len) > kMaxElements) {
    return absl::InvalidArgumentError(absl::StrCat(dir, ": the model is larger than batonctl converts in memory"));
  }
  BATON_ASSIGN_OR_RETURN(checkpoint::FullState state, checkpoint::LoadFullState(dir));
  if (!IsLlama(m) && state.tensors.count("embed_tokens.weight") > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        dir, ": holds a Llama's tensors (embed_tokens.weight) but its manifest records arch \"", ArchField(m.arch),
        "\"; it was written by a baton that does not record the architecture"));
  }
  const HfLayout layout = LayoutOf(m, m.seq_len);
  std::set<std::string> exported;
  SafetensorsWriter writer;
  writer.SetMetadata("format", "pt");  // transformers refuses safetensors files without it
  for (const auto& [hf_name, hf] : layout.tensors) {
    auto it = state.tensors.find(hf.baton_name);
    const std::vector<int64_t> want =
        hf.conv1d ? std::vector<int64_t>{hf.hf_shape[1], hf.hf_shape[0]} : hf.hf_shape;
    if (it == state.tensors.end()) {
      return absl::InvalidArgumentError(absl::StrCat(dir, ": tensor ", hf.baton_name, " is missing; the manifest's ",
                                                     checkpoint::DescribeModel(m), " (arch ", ArchField(m.arch),
                                                     ") has it"));
    }
    if (it->second.shape != want) {
      return absl::InvalidArgumentError(absl::StrCat(dir, ": tensor ", hf.baton_name, " has shape ",
                                                     Shape(it->second.shape), " but the manifest's model needs ",
                                                     Shape(want)));
    }
    const std::vector<float> values =
        hf.conv1d ? Transpose(it->second.values, want[0], want[1]) : it->second.values;
    BATON_RETURN_IF_ERROR(writer.AddFloat32(hf.hf_name, hf.hf_shape, values));
    exported.insert(hf.baton_name);
  }
  for (const auto& [name, t] : state.tensors) {
    if (exported.count(name) == 0) {
      return absl::InvalidArgumentError(absl::StrCat(dir, ": tensor ", name, " is not part of a ", layout.family,
                                                     " ", checkpoint::DescribeModel(m), " (arch ", ArchField(m.arch),
                                                     ")"));
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
