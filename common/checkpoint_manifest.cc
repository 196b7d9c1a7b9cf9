#include "common/checkpoint_manifest.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/crc32.h"
#include "common/file_io.h"
#include "common/json.h"
#include "common/safetensors.h"
#include "common/status_macros.h"

namespace baton::checkpoint {
namespace {

constexpr int kMaxChunks = 1 << 20;
constexpr int kMaxTp = 1 << 20;

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

int64_t Product(const std::vector<int64_t>& shape, size_t begin, size_t end) {
  int64_t n = 1;
  for (size_t i = begin; i < end; ++i) n *= shape[i];
  return n;
}

struct SplitView {
  int64_t outer = 1, split = 1, inner = 1;
};

SplitView ViewOf(const TensorLayout& l) {
  SplitView v;
  if (l.split_dim < 0) {
    v.split = NumElements(l.full_shape);
    return v;
  }
  const size_t d = static_cast<size_t>(l.split_dim);
  if (l.qkv) {
    v.outer = 3;
    v.split = l.full_shape[0] / 3;
    v.inner = Product(l.full_shape, 1, l.full_shape.size());
  } else {
    v.outer = Product(l.full_shape, 0, d);
    v.split = l.full_shape[d];
    v.inner = Product(l.full_shape, d + 1, l.full_shape.size());
  }
  return v;
}

void CopyShard(const TensorLayout& l, float* full, float* local, bool to_local) {
  const SplitView v = ViewOf(l);
  const int64_t parts = l.split_dim < 0 ? 1 : l.tp_size;
  const int64_t piece = v.split / parts;
  const int64_t begin = l.split_dim < 0 ? 0 : l.tp_rank * piece;
  const int64_t run = piece * v.inner;
  for (int64_t o = 0; o < v.outer; ++o) {
    float* f = full + (o * v.split + begin) * v.inner;
    float* p = local + o * run;
    if (to_local) {
      std::memcpy(p, f, sizeof(float) * run);
    } else {
      std::memcpy(f, p, sizeof(float) * run);
    }
  }
}

bool IsDir(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool Exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

// Names in `dir` (no "." or ".."); NOT_FOUND when it cannot be listed.
absl::StatusOr<std::vector<std::string>> ListDir(const std::string& dir) {
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) {
    return absl::NotFoundError(absl::StrCat("cannot list ", dir, ": ", std::strerror(errno)));
  }
  std::vector<std::string> out;
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") out.push_back(name);
  }
  closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

bool IsLlama(const ModelShape& m) { return m.arch == "llama"; }

// A finite float as a JSON number that reads back (through a double, as
// ReadManifest reads it) as the same float: the 6-digit form when it does
// ("500000", "1e-05"), else the shortest longer one.
std::string FloatNumber(float f) {
  if (!std::isfinite(f)) return "null";
  std::string text = absl::StrCat(f);
  for (int precision = 7; static_cast<float>(std::strtod(text.c_str(), nullptr)) != f && precision <= 9;
       ++precision) {
    text = absl::StrFormat("%.*g", precision, static_cast<double>(f));
  }
  return text;
}

// A finite double as a JSON number that reads back as the same double: the
// 6-digit form when it does ("1.25"), else the shortest longer one.
std::string DoubleNumber(double d) {
  if (!std::isfinite(d)) return "null";
  std::string text = absl::StrCat(d);
  for (int precision = 7; std::strtod(text.c_str(), nullptr) != d && precision <= 17; ++precision) {
    text = absl::StrFormat("%.*g", precision, d);
  }
  return text;
}

// The manifest's model object. A GPT-2 model is written as before arch
// existed (a reader without it still reads it right); a Llama model adds
// arch and its fields; an MoE model (either) adds "moe".
std::string ModelJson(const ModelShape& m) {
  if (m.synthetic) return absl::StrCat("{\"synthetic\": true, \"chunks\": ", m.chunks, "}");
  const std::string llama =
      IsLlama(m) ? absl::StrCat(", \"arch\": \"llama\", \"kv_heads\": ", m.kv_heads, ", \"ffn_dim\": ", m.ffn_dim,
                                ", \"rope_theta\": ", FloatNumber(m.rope_theta), ", \"norm_eps\": ", FloatNumber(m.norm_eps),
                                ", \"tie_embeddings\": ", m.tie_embeddings ? "true" : "false")
                 : "";
  const std::string moe =
      m.moe() ? absl::StrCat(", \"moe\": {\"experts\": ", m.moe_experts, ", \"top_k\": ", m.moe_top_k,
                             ", \"every_n_layers\": ", m.moe_every, ", \"capacity_factor\": ",
                             DoubleNumber(m.moe_capacity_factor), ", \"aux_loss_coef\": ",
                             FloatNumber(m.moe_aux_coef), "}")
              : "";
  return absl::StrCat("{\"layers\": ", m.layers, ", \"d_model\": ", m.d_model, ", \"heads\": ", m.heads,
                      ", \"vocab\": ", m.vocab, ", \"seq_len\": ", m.seq_len, llama, moe, "}");
}

// The MoE fields of a description: "" for a dense model.
std::string DescribeMoe(const ModelShape& m) {
  if (!m.moe()) return "";
  return absl::StrCat(", MoE of ", m.moe_experts, " experts (top_k ", m.moe_top_k, ", every_n_layers ", m.moe_every,
                      ", capacity_factor ", DoubleNumber(m.moe_capacity_factor), ", aux_loss_coef ",
                      FloatNumber(m.moe_aux_coef), ")");
}

// The full shape of an MoE block's own tensor `rest` (its name after
// "h.<i>." / "layers.<i>."): the router and each expert's matrices (see
// ValidateCheckpointForJob); empty for any other name, an expert index
// outside [0, experts) included.
std::vector<int64_t> MoeTensorShape(const ModelShape& m, const std::string& rest) {
  const bool llama = IsLlama(m);
  const int64_t c = m.d_model, f = llama ? m.ffn_dim : 4 * int64_t{m.d_model};
  if (rest == (llama ? "block_sparse_moe.gate.weight" : "mlp.router.weight")) return {m.moe_experts, c};
  const std::string experts = llama ? "block_sparse_moe.experts." : "mlp.experts.";
  if (!absl::StartsWith(rest, experts)) return {};
  const size_t dot = rest.find('.', experts.size());
  const std::string index = rest.substr(experts.size(), dot == std::string::npos ? 0 : dot - experts.size());
  int e = -1;
  if (!absl::SimpleAtoi(index, &e) || e < 0 || e >= m.moe_experts || absl::StrCat(e) != index) return {};
  const std::string matrix = rest.substr(dot + 1);
  if (matrix == (llama ? "w1.weight" : "c_fc.weight") || (llama && matrix == "w3.weight")) return {f, c};
  if (matrix == (llama ? "w2.weight" : "c_proj.weight")) return {c, f};
  return {};
}

// Whether `rest` names a tensor of an MoE MLP (router or experts, in either
// architecture's names), well formed or not.
bool IsMoeTensorName(const std::string& rest) {
  return absl::StartsWith(rest, "mlp.router.") || absl::StartsWith(rest, "mlp.experts.") ||
         absl::StartsWith(rest, "block_sparse_moe.");
}

}  // namespace

std::string ShardFileName(int pp_stage_chunk, int tp_rank) {
  return absl::StrCat("chunk", pp_stage_chunk, "-tp", tp_rank, ".safetensors");
}

int64_t NumElements(const std::vector<int64_t>& shape) { return Product(shape, 0, shape.size()); }

std::string LayoutJson(const TensorLayout& l) {
  return absl::StrCat("{\"full_shape\":[", absl::StrJoin(l.full_shape, ","), "],\"split_dim\":", l.split_dim,
                      ",\"qkv\":", l.qkv ? "true" : "false", ",\"tp_rank\":", l.tp_rank,
                      ",\"tp_size\":", l.tp_size, "}");
}

absl::StatusOr<TensorLayout> ParseLayout(const std::string& text) {
  BATON_ASSIGN_OR_RETURN(JsonValue j, JsonValue::Parse(text));
  const JsonValue* shape = j.Find("full_shape");
  const JsonValue* split = j.Find("split_dim");
  const JsonValue* qkv = j.Find("qkv");
  const JsonValue* rank = j.Find("tp_rank");
  const JsonValue* size = j.Find("tp_size");
  if (shape == nullptr || !shape->is_array() || split == nullptr || !split->integer() || qkv == nullptr ||
      qkv->kind() != JsonValue::Kind::kBool || rank == nullptr || !rank->integer() || size == nullptr ||
      !size->integer()) {
    return absl::InvalidArgumentError(
        "want {\"full_shape\": [...], \"split_dim\", \"qkv\", \"tp_rank\", \"tp_size\"}");
  }
  if (shape->items().size() > 8) return absl::InvalidArgumentError("full_shape has more than 8 dimensions");
  TensorLayout l;
  for (const JsonValue& d : shape->items()) {
    if (!d.integer() || *d.integer() < 0 || *d.integer() > (int64_t{1} << 40)) {
      return absl::InvalidArgumentError("full_shape must list integers in [0, 2^40]");
    }
    l.full_shape.push_back(*d.integer());
  }
  if (*split->integer() < -1 || *split->integer() > 8 || *rank->integer() < 0 || *rank->integer() > kMaxTp ||
      *size->integer() < 1 || *size->integer() > kMaxTp) {
    return absl::InvalidArgumentError("split_dim, tp_rank or tp_size out of range");
  }
  l.split_dim = static_cast<int>(*split->integer());
  l.qkv = qkv->bool_value();
  l.tp_rank = static_cast<int>(*rank->integer());
  l.tp_size = static_cast<int>(*size->integer());
  return l;
}

absl::StatusOr<std::vector<int64_t>> LocalShape(const TensorLayout& l) {
  const int ndim = static_cast<int>(l.full_shape.size());
  int64_t n = 1;
  for (int64_t d : l.full_shape) {
    if (d < 0) return absl::InvalidArgumentError(absl::StrCat("negative dimension in ", ShapeString(l.full_shape)));
    if (d > 0 && n > (int64_t{1} << 40) / d) {
      return absl::InvalidArgumentError(absl::StrCat("full shape ", ShapeString(l.full_shape), " is too large"));
    }
    n *= d;
  }
  if (l.tp_size < 1 || l.tp_rank < 0 || l.tp_rank >= l.tp_size) {
    return absl::InvalidArgumentError(absl::StrCat("tp_rank ", l.tp_rank, " is outside tp_size ", l.tp_size));
  }
  if (l.split_dim == -1) {
    if (l.qkv) return absl::InvalidArgumentError("qkv needs split_dim 0");
    return l.full_shape;
  }
  if (l.split_dim < -1 || l.split_dim >= ndim) {
    return absl::InvalidArgumentError(
        absl::StrCat("split_dim ", l.split_dim, " is outside the full shape ", ShapeString(l.full_shape)));
  }
  const int64_t parts = l.qkv ? 3 * int64_t{l.tp_size} : l.tp_size;
  if (l.qkv && l.split_dim != 0) return absl::InvalidArgumentError("qkv needs split_dim 0");
  if (l.full_shape[l.split_dim] % parts != 0) {
    return absl::InvalidArgumentError(absl::StrCat("dimension ", l.split_dim, " of ", ShapeString(l.full_shape),
                                                   " does not split into ", parts, l.qkv ? " (3 · tp) " : " ",
                                                   "equal parts"));
  }
  std::vector<int64_t> local = l.full_shape;
  local[l.split_dim] /= l.tp_size;
  return local;
}

void InsertShard(const TensorLayout& l, const float* local, float* full) {
  CopyShard(l, full, const_cast<float*>(local), /*to_local=*/false);
}

void ExtractShard(const TensorLayout& l, const float* full, float* local) {
  CopyShard(l, const_cast<float*>(full), local, /*to_local=*/true);
}

bool ModelShape::operator==(const ModelShape& o) const {
  if (synthetic != o.synthetic) return false;
  if (synthetic) return chunks == o.chunks;
  if (layers != o.layers || d_model != o.d_model || heads != o.heads || vocab != o.vocab ||
      seq_len != o.seq_len || IsLlama(*this) != IsLlama(o)) {
    return false;
  }
  if (moe() != o.moe()) return false;
  // capacity_factor and aux_loss_coef shape the training, not the weights
  // (like train.lr): a resume may change them.
  if (moe() && (moe_experts != o.moe_experts || moe_top_k != o.moe_top_k || moe_every != o.moe_every)) {
    return false;
  }
  // GPT-2 fixes the Llama fields (whatever a shape holds in them).
  if (!IsLlama(*this)) return true;
  return kv_heads == o.kv_heads && ffn_dim == o.ffn_dim && rope_theta == o.rope_theta && norm_eps == o.norm_eps &&
         tie_embeddings == o.tie_embeddings;
}

ParallelLayout ParallelLayoutOf(const v1::JobSpec& job) {
  const v1::ParallelSpec& p = job.parallel();
  ParallelLayout l;
  l.pp = p.has_pp() ? p.pp() : 1;
  l.tp = p.has_tp() ? p.tp() : 1;
  l.dp = p.has_dp() ? p.dp() : 1;
  l.virtual_stages = p.has_virtual_stages() ? p.virtual_stages() : 1;
  l.schedule = job.schedule().kind();
  return l;
}

int CheckpointKeep(const v1::JobSpec& job) {
  return job.checkpoint().has_keep() ? job.checkpoint().keep() : 2;
}

ModelShape ModelShapeOf(const v1::JobSpec& job) {
  ModelShape m;
  const v1::ModelSpec& s = job.model();
  if (s.has_synthetic()) {
    const ParallelLayout l = ParallelLayoutOf(job);
    m.synthetic = true;
    m.chunks = l.pp * l.virtual_stages;
    return m;
  }
  m.layers = s.layers();
  m.d_model = s.d_model();
  m.heads = s.heads();
  m.vocab = s.vocab();
  m.seq_len = s.seq_len();
  if (s.has_moe() && s.moe().experts() > 0) {
    // Defaults as worker/model/gpt_config.cc GptConfigFromSpec fills them.
    const v1::MoeSpec& moe = s.moe();
    m.moe_experts = moe.experts();
    m.moe_top_k = moe.top_k();
    m.moe_every = moe.every_n_layers() > 0 ? moe.every_n_layers() : 1;
    m.moe_capacity_factor = moe.capacity_factor();
    m.moe_aux_coef = moe.has_aux_loss_coef() ? moe.aux_loss_coef() : 0.01f;
  }
  if (s.arch() != "llama") return m;  // "" and "gpt2" (ValidateJobSpec refuses others)
  // Defaults as worker/model/gpt_config.cc GptConfigFromSpec fills them.
  m.arch = "llama";
  m.kv_heads = s.has_kv_heads() ? s.kv_heads() : s.heads();
  m.ffn_dim = s.has_ffn_dim() ? s.ffn_dim() : 4 * s.d_model();
  m.rope_theta = s.has_rope_theta() ? s.rope_theta() : 10000.0f;
  m.norm_eps = s.has_norm_eps() ? s.norm_eps() : 1e-5f;
  m.tie_embeddings = s.tie_embeddings();  // unset: false, a separate lm_head
  return m;
}

std::string DescribeModel(const ModelShape& m) {
  if (m.synthetic) return absl::StrCat("a synthetic model of ", m.chunks, " chunks");
  if (IsLlama(m)) {
    return absl::StrCat("a Llama (arch llama) of layers ", m.layers, ", d_model ", m.d_model, ", heads ", m.heads,
                        ", kv_heads ", m.kv_heads, ", ffn_dim ", m.ffn_dim, ", vocab ", m.vocab, ", seq_len ",
                        m.seq_len, ", rope_theta ", FloatNumber(m.rope_theta), ", norm_eps ", FloatNumber(m.norm_eps),
                        m.tie_embeddings ? ", tied embeddings" : ", untied lm_head", DescribeMoe(m));
  }
  return absl::StrCat("a GPT of layers ", m.layers, ", d_model ", m.d_model, ", heads ", m.heads, ", vocab ",
                      m.vocab, ", seq_len ", m.seq_len, DescribeMoe(m));
}

ManifestInfo ManifestFor(const v1::JobSpec& job, int64_t step, std::vector<std::string> files) {
  ManifestInfo info;
  info.version = 2;
  info.job = job.name();
  info.step = step;
  info.model = ModelShapeOf(job);
  info.layout = ParallelLayoutOf(job);
  info.files = std::move(files);
  return info;
}

absl::Status WriteManifest(const std::string& dir, const ManifestInfo& info) {
  const std::set<std::string> unique(info.files.begin(), info.files.end());
  if (unique.empty()) return absl::InvalidArgumentError("checkpoint manifest: no shard files to list");
  if (info.version != 1 && info.version != 2) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint manifest: version ", info.version, " unknown"));
  }
  std::vector<std::string> quoted;
  for (const std::string& f : unique) {
    if (f.empty() || f.find('/') != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat("checkpoint manifest: \"", f, "\" is not a file name inside ", dir));
    }
    if (!Exists(absl::StrCat(dir, "/", f))) {
      return absl::FailedPreconditionError(absl::StrCat("checkpoint manifest: shard ", f, " is not in ", dir));
    }
    quoted.push_back(JsonQuote(f));
  }
  std::string text;
  if (info.version == 1) {
    text = absl::StrCat("{\n  \"format\": \"", kManifestFormatV1, "\",\n  \"job\": ", JsonQuote(info.job),
                        ",\n  \"step\": ", info.step, ",\n  \"files\": [", absl::StrJoin(quoted, ", "), "]\n}\n");
  } else {
    const ParallelLayout& l = info.layout;
    text = absl::StrCat("{\n  \"format\": \"", kManifestFormatV2, "\",\n  \"job\": ", JsonQuote(info.job),
                        ",\n  \"step\": ", info.step, ",\n  \"model\": ", ModelJson(info.model),
                        ",\n  \"layout\": {\"pp\": ", l.pp, ", \"tp\": ", l.tp, ", \"dp\": ", l.dp,
                        ", \"virtual_stages\": ", l.virtual_stages, ", \"schedule\": ", JsonQuote(l.schedule),
                        "},\n  \"files\": [", absl::StrJoin(quoted, ", "), "]\n}\n");
  }
  return WriteFileAtomically(absl::StrCat(dir, "/", kManifestFile), text);
}

absl::Status WriteManifest(const std::string& dir, const std::vector<std::string>& files,
                           const std::string& job_name, int64_t step) {
  ManifestInfo info;
  info.version = 1;
  info.job = job_name;
  info.step = step;
  info.files = files;
  return WriteManifest(dir, info);
}

absl::StatusOr<ManifestInfo> ReadManifest(const std::string& dir) {
  const std::string path = absl::StrCat(dir, "/", kManifestFile);
  absl::StatusOr<std::string> text = ReadFile(path);
  if (!text.ok()) {
    return absl::Status(text.status().code(),
                        absl::StrCat(text.status().message(), "; is ", dir,
                                     " a baton checkpoint directory? (a save that did not finish has no manifest)"));
  }
  absl::StatusOr<JsonValue> j = JsonValue::Parse(*text);
  if (!j.ok()) return WithContext(j.status(), path);
  const JsonValue* format = j->Find("format");
  const JsonValue* job = j->Find("job");
  const JsonValue* step = j->Find("step");
  const JsonValue* files = j->Find("files");
  ManifestInfo info;
  if (format != nullptr && format->is_string() && format->str() == kManifestFormatV1) {
    info.version = 1;
  } else if (format != nullptr && format->is_string() && format->str() == kManifestFormatV2) {
    info.version = 2;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(path, ": \"format\" is neither \"", kManifestFormatV1,
                                                   "\" nor \"", kManifestFormatV2, "\""));
  }
  if (job == nullptr || !job->is_string() || step == nullptr || !step->integer() || *step->integer() < 0 ||
      files == nullptr || !files->is_array() || files->items().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": want {\"format\", \"job\": string, \"step\": integer >= 0, \"files\": [names]}"));
  }
  info.job = job->str();
  info.step = *step->integer();
  std::set<std::string> seen;
  for (const JsonValue& f : files->items()) {
    if (!f.is_string() || f.str().empty() || f.str().find('/') != std::string::npos || !seen.insert(f.str()).second) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": \"files\" must list distinct file names in ", dir));
    }
    info.files.push_back(f.str());
  }
  if (info.version == 2) {
    const JsonValue* model = j->Find("model");
    const JsonValue* layout = j->Find("layout");
    if (model == nullptr || !model->is_object() || layout == nullptr || !layout->is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": a v2 manifest needs \"model\" and \"layout\" objects"));
    }
    auto get_int = [&](const JsonValue& obj, const char* key, int* out) -> absl::Status {
      const JsonValue* v = obj.Find(key);
      if (v == nullptr || !v->integer() || *v->integer() < 0 || *v->integer() > (1 << 30)) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": ", key, " must be an integer in [0, 2^30]"));
      }
      *out = static_cast<int>(*v->integer());
      return absl::OkStatus();
    };
    const JsonValue* synthetic = model->Find("synthetic");
    if (synthetic != nullptr && synthetic->kind() == JsonValue::Kind::kBool && synthetic->bool_value()) {
      info.model.synthetic = true;
      BATON_RETURN_IF_ERROR(get_int(*model, "chunks", &info.model.chunks));
    } else {
      BATON_RETURN_IF_ERROR(get_int(*model, "layers", &info.model.layers));
      BATON_RETURN_IF_ERROR(get_int(*model, "d_model", &info.model.d_model));
      BATON_RETURN_IF_ERROR(get_int(*model, "heads", &info.model.heads));
      BATON_RETURN_IF_ERROR(get_int(*model, "vocab", &info.model.vocab));
      BATON_RETURN_IF_ERROR(get_int(*model, "seq_len", &info.model.seq_len));
      // "arch" is absent from GPT-2 manifests (and from every manifest
      // written before Llama): GPT-2.
      const JsonValue* arch = model->Find("arch");
      if (arch != nullptr && (!arch->is_string() || (arch->str() != "gpt2" && arch->str() != "llama"))) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": model.arch must be \"gpt2\" or \"llama\""));
      }
      if (arch != nullptr && arch->str() == "llama") {
        ModelShape& m = info.model;
        m.arch = "llama";
        BATON_RETURN_IF_ERROR(get_int(*model, "kv_heads", &m.kv_heads));
        BATON_RETURN_IF_ERROR(get_int(*model, "ffn_dim", &m.ffn_dim));
        auto get_float = [&](const char* key, float* out) -> absl::Status {
          const JsonValue* v = model->Find(key);
          if (v == nullptr || !v->is_number() || !std::isfinite(static_cast<float>(v->number())) ||
              v->number() <= 0) {
            return absl::InvalidArgumentError(
                absl::StrCat(path, ": a Llama model's ", key, " must be a positive finite number"));
          }
          *out = static_cast<float>(v->number());
          return absl::OkStatus();
        };
        BATON_RETURN_IF_ERROR(get_float("rope_theta", &m.rope_theta));
        BATON_RETURN_IF_ERROR(get_float("norm_eps", &m.norm_eps));
        const JsonValue* tie = model->Find("tie_embeddings");
        if (tie == nullptr || tie->kind() != JsonValue::Kind::kBool) {
          return absl::InvalidArgumentError(
              absl::StrCat(path, ": a Llama model's tie_embeddings must be true or false"));
        }
        m.tie_embeddings = tie->bool_value();
      }
      // "moe" is absent from dense manifests (and from every manifest
      // written before MoE).
      const JsonValue* moe = model->Find("moe");
      if (moe != nullptr) {
        ModelShape& m = info.model;
        auto bad = [&](const char* what) {
          return absl::InvalidArgumentError(absl::StrCat(path, ": model.moe", what));
        };
        if (!moe->is_object()) return bad(" must be an object of experts, top_k, every_n_layers, capacity_factor "
                                          "and aux_loss_coef");
        BATON_RETURN_IF_ERROR(get_int(*moe, "experts", &m.moe_experts));
        BATON_RETURN_IF_ERROR(get_int(*moe, "top_k", &m.moe_top_k));
        BATON_RETURN_IF_ERROR(get_int(*moe, "every_n_layers", &m.moe_every));
        if (m.moe_experts < 2) return bad(".experts must be at least 2");
        if (m.moe_top_k < 1 || m.moe_top_k > m.moe_experts) return bad(".top_k must be in [1, experts]");
        if (m.moe_every < 1) return bad(".every_n_layers must be at least 1");
        const JsonValue* capacity = moe->Find("capacity_factor");
        const JsonValue* coef = moe->Find("aux_loss_coef");
        if (capacity == nullptr || !capacity->is_number() || !std::isfinite(capacity->number()) ||
            capacity->number() < 0) {
          return bad(".capacity_factor must be a finite number >= 0");
        }
        if (coef == nullptr || !coef->is_number() || !std::isfinite(static_cast<float>(coef->number())) ||
            coef->number() < 0) {
          return bad(".aux_loss_coef must be a finite number >= 0");
        }
        m.moe_capacity_factor = capacity->number();
        m.moe_aux_coef = static_cast<float>(coef->number());
      }
    }
    BATON_RETURN_IF_ERROR(get_int(*layout, "pp", &info.layout.pp));
    BATON_RETURN_IF_ERROR(get_int(*layout, "tp", &info.layout.tp));
    BATON_RETURN_IF_ERROR(get_int(*layout, "dp", &info.layout.dp));
    BATON_RETURN_IF_ERROR(get_int(*layout, "virtual_stages", &info.layout.virtual_stages));
    const JsonValue* schedule = layout->Find("schedule");
    if (schedule != nullptr && schedule->is_string()) info.layout.schedule = schedule->str();
  }
  return info;
}

std::string StepDirName(int64_t step) { return absl::StrFormat("step-%08d", step); }

absl::StatusOr<std::vector<CheckpointEntry>> ListCheckpoints(const std::string& root) {
  if (!Exists(root)) return std::vector<CheckpointEntry>();
  BATON_ASSIGN_OR_RETURN(std::vector<std::string> names, ListDir(root));
  std::vector<CheckpointEntry> out;
  for (const std::string& name : names) {
    int64_t step = 0;
    if (!absl::StartsWith(name, "step-") || !absl::SimpleAtoi(name.substr(5), &step) || step < 0) continue;
    CheckpointEntry e;
    e.step = step;
    e.path = absl::StrCat(root, "/", name);
    if (!IsDir(e.path)) continue;
    e.complete = Exists(absl::StrCat(e.path, "/", kManifestFile));
    out.push_back(std::move(e));
  }
  std::sort(out.begin(), out.end(),
            [](const CheckpointEntry& a, const CheckpointEntry& b) { return a.step < b.step; });
  return out;
}

absl::StatusOr<std::string> ResolveCheckpoint(const std::string& dir) {
  if (Exists(absl::StrCat(dir, "/", kManifestFile))) return dir;
  if (!IsDir(dir)) return absl::NotFoundError(absl::StrCat("checkpoint ", dir, ": no such directory"));
  BATON_ASSIGN_OR_RETURN(std::vector<CheckpointEntry> all, ListCheckpoints(dir));
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    if (it->complete) return it->path;
  }
  return absl::NotFoundError(absl::StrCat(
      "checkpoint ", dir, ": no ", kManifestFile, " in it and no complete step-<n> checkpoint under it (",
      all.size(), " incomplete); give a checkpoint directory or the checkpoint.dir of a job that saved one"));
}

absl::StatusOr<std::vector<std::string>> PruneCheckpoints(const std::string& root, int keep) {
  if (keep < 1) return absl::InvalidArgumentError(absl::StrCat("checkpoint.keep = ", keep, ": must be at least 1"));
  BATON_ASSIGN_OR_RETURN(std::vector<CheckpointEntry> all, ListCheckpoints(root));
  int64_t newest_complete = -1;
  int complete_seen = 0;
  std::vector<std::string> doomed;
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    if (it->complete) {
      if (newest_complete < 0) newest_complete = it->step;
      if (++complete_seen > keep) doomed.push_back(it->path);
    } else if (newest_complete >= 0) {
      doomed.push_back(it->path);  // older than a complete save: a crashed one
    }
  }
  for (const std::string& path : doomed) {
    // The manifest goes first, so a checkpoint half removed never looks complete.
    const std::string manifest = absl::StrCat(path, "/", kManifestFile);
    if (Exists(manifest) && unlink(manifest.c_str()) != 0) {
      return absl::InternalError(absl::StrCat("pruning: cannot remove ", manifest, ": ", std::strerror(errno)));
    }
    BATON_ASSIGN_OR_RETURN(std::vector<std::string> names, ListDir(path));
    for (const std::string& name : names) {
      const std::string file = absl::StrCat(path, "/", name);
      if (IsDir(file)) {
        return absl::FailedPreconditionError(
            absl::StrCat("pruning: ", path, " holds a directory ", name, "; not a checkpoint baton wrote"));
      }
      if (unlink(file.c_str()) != 0) {
        return absl::InternalError(absl::StrCat("pruning: cannot remove ", file, ": ", std::strerror(errno)));
      }
    }
    if (rmdir(path.c_str()) != 0) {
      return absl::InternalError(absl::StrCat("pruning: cannot remove ", path, ": ", std::strerror(errno)));
    }
  }
  return doomed;
}

absl::StatusOr<std::string> WriteStateShardFile(const std::string& dir, int chunk, int tp_rank, int tp_size,
                                                int64_t optimizer_step, bool moments,
                                                const std::vector<StateShardTensor>& tensors) {
  if (chunk < 0 || tp_size < 1 || tp_rank < 0 || tp_rank >= tp_size || optimizer_step < 0) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint shard: chunk ", chunk, ", tp_rank ", tp_rank,
                                                   ", tp_size ", tp_size, ", optimizer step ", optimizer_step,
                                                   " is not a valid position"));
  }
  const std::string file = ShardFileName(chunk, tp_rank);
  SafetensorsWriter writer;
  writer.SetMetadata("baton.format", kShardFormatV2);
  writer.SetMetadata("baton.chunk", absl::StrCat(chunk));
  writer.SetMetadata("baton.tp_rank", absl::StrCat(tp_rank));
  writer.SetMetadata("baton.tp_size", absl::StrCat(tp_size));
  writer.SetMetadata("baton.optimizer_step", absl::StrCat(optimizer_step));
  writer.SetMetadata("baton.moments", moments ? "adamw" : "none");
  for (const StateShardTensor& t : tensors) {
    const std::string where = absl::StrCat("checkpoint ", file, ": tensor ", t.name);
    if (t.layout.tp_rank != tp_rank || t.layout.tp_size != tp_size) {
      return absl::InvalidArgumentError(absl::StrCat(where, " has the layout of tp rank ", t.layout.tp_rank,
                                                     " of ", t.layout.tp_size));
    }
    absl::StatusOr<std::vector<int64_t>> local = LocalShape(t.layout);
    if (!local.ok()) return WithContext(local.status(), where);
    const size_t count = static_cast<size_t>(NumElements(*local));
    if (t.values.size() != count || (moments && (t.adam_m.size() != count || t.adam_v.size() != count))) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": ", t.values.size(), " values and ", t.adam_m.size(),
                                                     " + ", t.adam_v.size(), " moments but its layout holds ",
                                                     count));
    }
    struct Part {
      std::string name;
      absl::Span<const float> values;
    };
    std::vector<Part> parts = {{t.name, t.values}};
    if (moments) {
      parts.push_back({kAdamMPrefix + t.name, t.adam_m});
      parts.push_back({kAdamVPrefix + t.name, t.adam_v});
    }
    for (const Part& p : parts) {
      BATON_RETURN_IF_ERROR_CTX(writer.AddFloat32(p.name, *local, p.values), "checkpoint ", file);
      writer.SetMetadata(kLayoutPrefix + p.name, LayoutJson(t.layout));
      writer.SetMetadata(kCrcPrefix + p.name,
                         absl::StrCat(Crc32(absl::string_view(reinterpret_cast<const char*>(p.values.data()),
                                                              sizeof(float) * count))));
    }
  }
  BATON_RETURN_IF_ERROR(writer.WriteFile(absl::StrCat(dir, "/", file)));
  return file;
}

absl::StatusOr<ShardContents> ReadShardFile(const std::string& dir, const std::string& name, bool keep_values) {
  const std::string path = absl::StrCat(dir, "/", name);
  absl::StatusOr<SafetensorsFile> read = SafetensorsFile::Read(path);
  if (!read.ok()) {
    if (absl::IsNotFound(read.status())) {
      return absl::NotFoundError(absl::StrCat(path, ": missing (listed in ", kManifestFile, ")"));
    }
    return WithContext(read.status(), "checkpoint shard (truncated or corrupted)");
  }
  const SafetensorsFile& file = *read;
  ShardContents out;
  out.file = name;
  auto format = file.metadata().find("baton.format");
  if (format != file.metadata().end() && format->second == kShardFormatV1) {
    out.version = 1;
  } else if (format != file.metadata().end() && format->second == kShardFormatV2) {
    out.version = 2;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a baton shard (metadata baton.format is not \"",
                                                   kShardFormatV1, "\" or \"", kShardFormatV2, "\")"));
  }
  absl::StatusOr<int64_t> chunk = file.MetadataInt("baton.chunk");
  absl::StatusOr<int64_t> rank = file.MetadataInt("baton.tp_rank");
  absl::StatusOr<int64_t> size = file.MetadataInt("baton.tp_size");
  if (!chunk.ok() || !rank.ok() || !size.ok() || *chunk < 0 || *size < 1 || *rank < 0 || *rank >= *size ||
      *chunk >= kMaxChunks || *size > kMaxTp) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": metadata baton.chunk, baton.tp_rank, baton.tp_size missing or out of range"));
  }
  out.chunk = static_cast<int>(*chunk);
  out.tp_rank = static_cast<int>(*rank);
  out.tp_size = static_cast<int>(*size);
  if (out.version == 2) {
    absl::StatusOr<int64_t> step = file.MetadataInt("baton.optimizer_step");
    auto moments = file.metadata().find("baton.moments");
    if (!step.ok() || *step < 0 || moments == file.metadata().end() ||
        (moments->second != "adamw" && moments->second != "none")) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": metadata baton.optimizer_step (>= 0) or baton.moments (adamw|none) missing or invalid"));
    }
    out.optimizer_step = *step;
    out.has_moments = moments->second == "adamw";
  }
  for (const auto& [tensor, entry] : file.tensors()) {
    const std::string where = absl::StrCat(path, ": tensor ", tensor);
    auto meta = file.metadata().find(kLayoutPrefix + tensor);
    if (meta == file.metadata().end()) {
      return absl::InvalidArgumentError(absl::StrCat(where, " has no ", kLayoutPrefix, tensor, " metadata"));
    }
    absl::StatusOr<TensorLayout> layout = ParseLayout(meta->second);
    if (!layout.ok()) return WithContext(layout.status(), absl::StrCat(where, " layout"));
    if (layout->tp_rank != out.tp_rank || layout->tp_size != out.tp_size) {
      return absl::InvalidArgumentError(absl::StrCat(where, " says tp rank ", layout->tp_rank, " of ",
                                                     layout->tp_size, " but the file is rank ", out.tp_rank,
                                                     " of ", out.tp_size));
    }
    absl::StatusOr<std::vector<int64_t>> local = LocalShape(*layout);
    if (!local.ok()) return WithContext(local.status(), where);
    if (*local != entry.shape) {
      return absl::InvalidArgumentError(absl::StrCat(where, " has shape ", ShapeString(entry.shape),
                                                     " but its layout ", meta->second, " implies ",
                                                     ShapeString(*local)));
    }
    const bool moment = absl::StartsWith(tensor, kAdamMPrefix) || absl::StartsWith(tensor, kAdamVPrefix);
    if (moment && !out.has_moments) {
      return absl::InvalidArgumentError(absl::StrCat(where, " is an optimizer moment in a file without moments"));
    }
    ShardTensor t;
    t.layout = *std::move(layout);
    absl::StatusOr<std::vector<float>> values = file.Float32s(tensor);
    if (!values.ok()) return WithContext(values.status(), where);
    t.crc = Crc32(absl::string_view(reinterpret_cast<const char*>(values->data()),
                                    sizeof(float) * values->size()));
    if (out.version == 2) {
      absl::StatusOr<int64_t> want = file.MetadataInt(kCrcPrefix + tensor);
      if (!want.ok()) return absl::InvalidArgumentError(absl::StrCat(where, " has no ", kCrcPrefix, tensor));
      if (*want != t.crc) {
        return absl::DataLossError(absl::StrCat(where, ": CRC-32 ", t.crc, " but the file recorded ", *want,
                                                "; the data is corrupted"));
      }
    }
    if (keep_values) t.values = *std::move(values);
    out.tensors.emplace(tensor, std::move(t));
  }
  if (out.has_moments) {
    for (const auto& [tensor, t] : out.tensors) {
      std::string param;
      if (absl::StartsWith(tensor, kAdamMPrefix)) param = tensor.substr(strlen(kAdamMPrefix));
      if (absl::StartsWith(tensor, kAdamVPrefix)) param = tensor.substr(strlen(kAdamVPrefix));
      const bool moment = !param.empty() || tensor == kAdamMPrefix || tensor == kAdamVPrefix;
      if (moment) {
        auto p = out.tensors.find(param);
        if (p == out.tensors.end() || !p->second.layout.SameSplit(t.layout)) {
          return absl::InvalidArgumentError(absl::StrCat(path, ": optimizer moment ", tensor,
                                                         " has no parameter ", param, " of the same layout"));
        }
        continue;
      }
      for (const char* prefix : {kAdamMPrefix, kAdamVPrefix}) {
        if (out.tensors.count(prefix + tensor) == 0) {
          return absl::InvalidArgumentError(
              absl::StrCat(path, ": parameter ", tensor, " has no ", prefix, tensor, " moment"));
        }
      }
    }
  }
  return out;
}

namespace {

// One stored shard of a tensor.
struct Piece {
  TensorLayout layout;
  std::vector<float> values;
  uint32_t crc = 0;
  std::string file;
};
using TpPieces = std::map<int, Piece>;  // by TP rank

struct Gathered {
  std::vector<int64_t> shape;
  std::vector<float> values;          // empty when values were not kept
  std::vector<uint32_t> piece_crcs;   // by TP rank, to compare copies without values
};

bool BitwiseEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), sizeof(float) * a.size()) == 0);
}

absl::StatusOr<Gathered> Gather(const std::string& name, int chunk, const TpPieces& pieces, int tp_size,
                                bool keep_values) {
  const std::string where = absl::StrCat("tensor ", name, " of chunk ", chunk);
  for (int r = 0; r < tp_size; ++r) {
    if (pieces.count(r) == 0) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": missing from ", ShardFileName(chunk, r),
                                                     ", which holds other tensors of the chunk; the shard "
                                                     "files come from different models"));
    }
  }
  const Piece& first = pieces.at(0);
  Gathered full;
  full.shape = first.layout.full_shape;
  for (const auto& [rank, piece] : pieces) {
    if (!piece.layout.SameSplit(first.layout)) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": ", piece.file, " says ", LayoutJson(piece.layout),
                                                     " but ", first.file, " says ", LayoutJson(first.layout)));
    }
    full.piece_crcs.push_back(piece.crc);
  }
  if (first.layout.split_dim == -1) {
    for (const auto& [rank, piece] : pieces) {
      if (piece.crc != first.crc || !BitwiseEqual(piece.values, first.values)) {
        return absl::InvalidArgumentError(absl::StrCat(where, " is replicated but differs between ", first.file,
                                                       " and ", piece.file, "; the TP ranks diverged"));
      }
    }
    full.values = first.values;
    return full;
  }
  if (!keep_values) return full;
  full.values.assign(static_cast<size_t>(NumElements(full.shape)), 0.0f);
  for (const auto& [rank, piece] : pieces) InsertShard(piece.layout, piece.values.data(), full.values.data());
  return full;
}

// Reads and cross-checks every file of the checkpoint in `dir`.
absl::StatusOr<FullState> Collect(const std::string& dir, bool keep_values, const std::set<std::string>* only) {
  FullState state;
  state.dir = dir;
  BATON_ASSIGN_OR_RETURN(state.manifest, ReadManifest(dir));
  BATON_ASSIGN_OR_RETURN(std::vector<std::string> present, ListDir(dir));
  std::vector<std::string> unlisted;
  const std::set<std::string> listed(state.manifest.files.begin(), state.manifest.files.end());
  for (const std::string& f : present) {
    if (absl::EndsWith(f, ".safetensors") && listed.count(f) == 0) unlisted.push_back(f);
  }
  if (!unlisted.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint ", dir, ": ", absl::StrJoin(unlisted, ", "), " not listed in ", kManifestFile,
        "; remove leftovers of another checkpoint or save into an empty directory"));
  }
  int tp_size = -1;
  int version = -1;
  std::string first_file;
  std::map<int, std::map<int, std::string>> files_by_chunk;  // chunk -> tp rank -> file
  std::map<std::string, std::map<int, TpPieces>> pieces;     // name -> chunk -> pieces
  for (const std::string& name : state.manifest.files) {
    BATON_ASSIGN_OR_RETURN(ShardContents shard, ReadShardFile(dir, name, keep_values));
    if (tp_size == -1) {
      tp_size = shard.tp_size;
      version = shard.version;
      state.optimizer_step = shard.optimizer_step;
      state.has_moments = shard.has_moments;
      first_file = name;
    }
    if (shard.tp_size != tp_size) {
      return absl::InvalidArgumentError(absl::StrCat("checkpoint ", dir, ": ", name, " has tp_size ", shard.tp_size,
                                                     " but ", first_file, " has ", tp_size));
    }
    if (shard.version != version || shard.optimizer_step != state.optimizer_step ||
        shard.has_moments != state.has_moments) {
      return absl::InvalidArgumentError(absl::StrCat(
          "checkpoint ", dir, ": ", name, " (format v", shard.version, ", optimizer step ", shard.optimizer_step,
          shard.has_moments ? ", with moments" : "", ") and ", first_file, " (format v", version,
          ", optimizer step ", state.optimizer_step, state.has_moments ? ", with moments" : "",
          ") come from different saves"));
    }
    auto [it, inserted] = files_by_chunk[shard.chunk].emplace(shard.tp_rank, name);
    if (!inserted) {
      return absl::InvalidArgumentError(absl::StrCat("checkpoint ", dir, ": ", it->second, " and ", name,
                                                     " both hold chunk ", shard.chunk, " tp rank ", shard.tp_rank));
    }
    for (auto& [tensor, t] : shard.tensors) {
      if (only != nullptr) {
        std::string param = tensor;
        if (absl::StartsWith(tensor, kAdamMPrefix)) param = tensor.substr(strlen(kAdamMPrefix));
        if (absl::StartsWith(tensor, kAdamVPrefix)) param = tensor.substr(strlen(kAdamVPrefix));
        if (only->count(param) == 0) continue;
      }
      Piece piece;
      piece.layout = t.layout;
      piece.crc = t.crc;
      piece.file = name;
      piece.values = std::move(t.values);
      pieces[tensor][shard.chunk].emplace(shard.tp_rank, std::move(piece));
    }
  }
  const int chunks = files_by_chunk.rbegin()->first + 1;
  for (int c = 0; c < chunks; ++c) {
    for (int r = 0; r < tp_size; ++r) {
      if (files_by_chunk.count(c) == 0 || files_by_chunk[c].count(r) == 0) {
        return absl::InvalidArgumentError(absl::StrCat("checkpoint ", dir, ": no shard for chunk ", c, " tp rank ",
                                                       r, " (", ShardFileName(c, r), ") among ", chunks,
                                                       " chunks × tp ", tp_size, "; the save is incomplete"));
      }
    }
  }
  state.chunks = chunks;
  state.tp_size = tp_size;

  std::map<std::string, Gathered> out;
  std::map<std::string, int> chunk_of;
  for (auto& [name, by_chunk] : pieces) {
    for (auto& [chunk, tp_pieces] : by_chunk) {
      BATON_ASSIGN_OR_RETURN(Gathered full, Gather(name, chunk, tp_pieces, tp_size, keep_values));
      tp_pieces.clear();  // free the pieces as soon as they are assembled
      auto [it, inserted] = out.try_emplace(name, std::move(full));
      if (inserted) {
        chunk_of[name] = chunk;
        continue;
      }
      if (it->second.shape != full.shape || !BitwiseEqual(it->second.values, full.values) ||
          it->second.piece_crcs != full.piece_crcs) {
        return absl::InvalidArgumentError(absl::StrCat(
            "checkpoint ", dir, ": tensor ", name, " is stored by chunk ", chunk_of[name], " and chunk ", chunk,
            " with different ", it->second.shape != full.shape ? "shapes" : "values",
            "; tied copies (the embedding on the first and last stage) must stay equal"));
      }
    }
  }
  for (auto& [name, g] : out) {
    std::string param = name;
    std::vector<float>* slot = nullptr;
    FullTensor* t = nullptr;
    if (absl::StartsWith(name, kAdamMPrefix)) {
      t = &state.tensors[name.substr(strlen(kAdamMPrefix))];
      slot = &t->adam_m;
    } else if (absl::StartsWith(name, kAdamVPrefix)) {
      t = &state.tensors[name.substr(strlen(kAdamVPrefix))];
      slot = &t->adam_v;
    } else {
      t = &state.tensors[name];
      slot = &t->values;
    }
    t->shape = g.shape;
    *slot = std::move(g.values);
  }
  return state;
}

}  // namespace

absl::StatusOr<FullState> LoadFullState(const std::string& dir, const std::set<std::string>* only) {
  return Collect(dir, /*keep_values=*/true, only);
}

absl::StatusOr<FullState> ValidateCheckpointForJob(const std::string& dir, const v1::JobSpec& job) {
  BATON_ASSIGN_OR_RETURN(FullState state, Collect(dir, /*keep_values=*/false, nullptr));
  const std::string manifest = absl::StrCat(dir, "/", kManifestFile);
  if (state.manifest.version < 2 || state.optimizer_step < 0 ) {
    return absl::FailedPreconditionError(absl::StrCat(
        manifest, ": a weights-only (v1) checkpoint; resuming needs the optimizer state of a v2 checkpoint"));
  }
  const ModelShape want = ModelShapeOf(job);
  if (!(state.manifest.model == want)) {
    // Name the job-spec fields that differ, so the operator knows what to fix.
    const ModelShape& have = state.manifest.model;
    std::vector<std::string> fields;
    auto field = [&](const char* name, int64_t h, int64_t w) {
      if (h != w) fields.push_back(absl::StrCat("model.", name, " ", w, " (checkpoint: ", h, ")"));
    };
    if (!have.synthetic && !want.synthetic) {
      field("layers", have.layers, want.layers);
      field("d_model", have.d_model, want.d_model);
      field("heads", have.heads, want.heads);
      field("vocab", have.vocab, want.vocab);
      field("seq_len", have.seq_len, want.seq_len);
      if (have.arch != want.arch) {
        fields.push_back(absl::StrCat("model.arch \"", want.arch, "\" (checkpoint: \"", have.arch, "\")"));
      } else if (IsLlama(want)) {
        field("kv_heads", have.kv_heads, want.kv_heads);
        field("ffn_dim", have.ffn_dim, want.ffn_dim);
        auto real = [&](const char* name, float h, float w) {
          if (h != w) {
            fields.push_back(absl::StrCat("model.", name, " ", FloatNumber(w), " (checkpoint: ", FloatNumber(h), ")"));
          }
        };
        real("rope_theta", have.rope_theta, want.rope_theta);
        real("norm_eps", have.norm_eps, want.norm_eps);
        if (have.tie_embeddings != want.tie_embeddings) {
          fields.push_back(absl::StrCat("model.tie_embeddings ", want.tie_embeddings ? "true" : "false",
                                        " (checkpoint: ", have.tie_embeddings ? "true" : "false", ")"));
        }
      }
      if (have.moe() != want.moe()) {
        fields.push_back(want.moe() ? "model.moe set (checkpoint: a dense model)"
                                    : absl::StrCat("model.moe unset (checkpoint: ", have.moe_experts, " experts)"));
      } else if (want.moe()) {
        field("moe.experts", have.moe_experts, want.moe_experts);
        field("moe.top_k", have.moe_top_k, want.moe_top_k);
        field("moe.every_n_layers", have.moe_every, want.moe_every);
      }
    }
    return absl::InvalidArgumentError(absl::StrCat(
        manifest, ": the checkpoint holds ", DescribeModel(have), " but the job trains ", DescribeModel(want),
        "; it is from another model", fields.empty() ? "" : absl::StrCat(": ", absl::StrJoin(fields, ", "))));
  }
  if (want.synthetic) {
    if (state.chunks != want.chunks) {
      return absl::InvalidArgumentError(absl::StrCat("checkpoint ", dir, ": ", state.chunks,
                                                     " synthetic chunks but the job has ", want.chunks));
    }
    return state;
  }
  if (!state.has_moments) {
    return absl::InvalidArgumentError(absl::StrCat(dir, "/", ShardFileName(0, 0),
                                                   ": no AdamW moments; resuming a GPT needs them"));
  }
  // Shapes that betray another model even if the manifest was edited.
  auto where = [&](const std::string& tensor) {
    return absl::StrCat("checkpoint ", dir, ": tensor ", tensor);
  };
  const int64_t c = want.d_model, v = want.vocab;
  const bool llama = IsLlama(want);
  std::vector<std::pair<std::string, std::vector<int64_t>>> fixed;
  if (llama) {
    fixed = {{"embed_tokens.weight", {v, c}}, {"norm.weight", {c}}};
    if (!want.tie_embeddings) fixed.push_back({"lm_head.weight", {v, c}});
  } else {
    fixed = {{"wte", {v, c}}, {"wpe", {want.seq_len, c}}};
  }
  for (const auto& [name, shape] : fixed) {
    auto it = state.tensors.find(name);
    if (it == state.tensors.end()) return absl::InvalidArgumentError(absl::StrCat(where(name), " is missing"));
    if (it->second.shape != shape) {
      return absl::InvalidArgumentError(absl::StrCat(where(name), " has shape ", ShapeString(it->second.shape),
                                                     " but the job's model needs ", ShapeString(shape)));
    }
  }
  if (llama && want.tie_embeddings && state.tensors.count("lm_head.weight") > 0) {
    return absl::InvalidArgumentError(absl::StrCat(where("lm_head.weight"),
                                                   " is an untied LM head but the job ties it to embed_tokens; "
                                                   "set model.tie_embeddings: false to resume it"));
  }
  // Llama's block tensors by name (after "layers.<i>."), full shapes.
  const int64_t hd = want.heads > 0 ? c / want.heads : 0;
  const int64_t q = int64_t{want.heads} * hd, kv = int64_t{want.kv_heads} * hd, f = want.ffn_dim;
  const std::map<std::string, std::vector<int64_t>> llama_block = {
      {"input_layernorm.weight", {c}},     {"self_attn.q_proj.weight", {q, c}},
      {"self_attn.k_proj.weight", {kv, c}}, {"self_attn.v_proj.weight", {kv, c}},
      {"self_attn.o_proj.weight", {c, q}},  {"post_attention_layernorm.weight", {c}},
      {"mlp.gate_proj.weight", {f, c}},     {"mlp.up_proj.weight", {f, c}},
      {"mlp.down_proj.weight", {c, f}},
  };
  const std::string prefix = llama ? "layers." : "h.";
  std::set<int> blocks;
  for (const auto& [name, t] : state.tensors) {
    if (!absl::StartsWith(name, prefix)) continue;
    const size_t dot = name.find('.', prefix.size());
    int block = -1;
    if (dot == std::string::npos ||
        !absl::SimpleAtoi(name.substr(prefix.size(), dot - prefix.size()), &block) || block < 0 ||
        block >= want.layers) {
      return absl::InvalidArgumentError(absl::StrCat(where(name), " is not a block of a ", want.layers,
                                                     "-layer model"));
    }
    blocks.insert(block);
    const std::string rest = name.substr(dot + 1);
    // An MoE block holds the router and its experts instead of the dense
    // MLP; a dense block none of them.
    if (want.moe_block(block)) {
      const std::vector<int64_t> moe_shape = MoeTensorShape(want, rest);
      if (!moe_shape.empty()) {
        if (t.shape != moe_shape) {
          return absl::InvalidArgumentError(absl::StrCat(
              where(name), " has shape ", ShapeString(t.shape), " but the job's model needs ", ShapeString(moe_shape),
              " (d_model ", c, ", experts ", want.moe_experts, llama ? absl::StrCat(", ffn_dim ", want.ffn_dim) : "",
              ")"));
        }
        continue;
      }
      if (IsMoeTensorName(rest) || absl::StartsWith(rest, "mlp.")) {
        return absl::InvalidArgumentError(absl::StrCat(where(name), " is not a tensor of MoE block ", block,
                                                       " (", want.moe_experts, " experts)"));
      }
    } else if (IsMoeTensorName(rest)) {
      return absl::InvalidArgumentError(absl::StrCat(
          where(name), " is a tensor of an MoE block but block ", block, " of the job's model is dense",
          want.moe() ? absl::StrCat(" (model.moe.every_n_layers ", want.moe_every, ")") : " (model.moe unset)"));
    }
    if (llama) {
      auto it = llama_block.find(rest);
      if (it == llama_block.end()) {
        return absl::InvalidArgumentError(absl::StrCat(where(name), " is not a tensor of a Llama block"));
      }
      if (t.shape != it->second) {
        return absl::InvalidArgumentError(absl::StrCat(
            where(name), " has shape ", ShapeString(t.shape), " but the job's model needs ",
            ShapeString(it->second), " (d_model ", c, ", heads ", want.heads, ", kv_heads ", want.kv_heads,
            ", ffn_dim ", f, ")"));
      }
      continue;
    }
    // Every dimension of a block tensor is 1, 3 or 4 times d_model.
    for (int64_t d : t.shape) {
      if (want.d_model <= 0 || d % want.d_model != 0 || d / want.d_model > 4) {
        return absl::InvalidArgumentError(absl::StrCat(where(name), " has shape ", ShapeString(t.shape),
                                                       ", which does not fit d_model ", want.d_model));
      }
    }
  }
  if (static_cast<int>(blocks.size()) != want.layers) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint ", dir, ": holds ", blocks.size(),
                                                   " transformer blocks but the job's model has ", want.layers));
  }
  return state;
}

absl::StatusOr<FullState> ValidateResumeCheckpoint(const std::string& dir, const v1::JobSpec& job) {
  BATON_ASSIGN_OR_RETURN(std::string chosen, ResolveCheckpoint(dir));
  return ValidateCheckpointForJob(chosen, job);
}

}  // namespace baton::checkpoint
