#include "worker/checkpoint/checkpoint.h"

#include <dirent.h>

#include <cstring>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/file_io.h"
#include "common/json.h"
#include "common/safetensors.h"
#include "common/status_macros.h"

namespace baton::checkpoint {
namespace {

constexpr char kShardFormat[] = "baton-shard-v1";
constexpr char kManifestFormat[] = "baton-checkpoint-v1";
constexpr char kLayoutPrefix[] = "baton.layout.";

// How one stored tensor fits into its full tensor.
struct Layout {
  std::vector<int64_t> full_shape;
  int split_dim = -1;  // -1: replicated
  bool qkv = false;
  int tp_rank = 0;
  int tp_size = 1;

  bool SameSplit(const Layout& o) const {
    return full_shape == o.full_shape && split_dim == o.split_dim && qkv == o.qkv &&
           tp_size == o.tp_size;
  }
};

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

int64_t Product(const std::vector<int64_t>& shape, size_t begin, size_t end) {
  int64_t n = 1;
  for (size_t i = begin; i < end; ++i) n *= shape[i];
  return n;
}

// The full tensor viewed as [outer, split, inner]; rank r holds
// [outer, split / tp_size, inner] starting at r · split / tp_size.
struct SplitView {
  int64_t outer = 1, split = 1, inner = 1;
};

// The local shape `layout` implies, after checking that the split divides.
absl::StatusOr<std::vector<int64_t>> LocalShape(const Layout& l) {
  const int ndim = static_cast<int>(l.full_shape.size());
  for (int64_t d : l.full_shape) {
    if (d < 0) return absl::InvalidArgumentError(absl::StrCat("negative dimension in ", ShapeString(l.full_shape)));
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

SplitView ViewOf(const Layout& l) {
  SplitView v;
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

std::string LayoutJson(const Layout& l) {
  return absl::StrCat("{\"full_shape\":[", absl::StrJoin(l.full_shape, ","), "],\"split_dim\":", l.split_dim,
                      ",\"qkv\":", l.qkv ? "true" : "false", ",\"tp_rank\":", l.tp_rank,
                      ",\"tp_size\":", l.tp_size, "}");
}

absl::StatusOr<Layout> ParseLayout(const std::string& text) {
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
  Layout l;
  for (const JsonValue& d : shape->items()) {
    if (!d.integer()) return absl::InvalidArgumentError("full_shape must list integers");
    l.full_shape.push_back(*d.integer());
  }
  l.split_dim = static_cast<int>(*split->integer());
  l.qkv = qkv->bool_value();
  l.tp_rank = static_cast<int>(*rank->integer());
  l.tp_size = static_cast<int>(*size->integer());
  return l;
}

// Names of the *.safetensors files in `dir`.
absl::StatusOr<std::set<std::string>> ShardFilesIn(const std::string& dir) {
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) {
    return absl::NotFoundError(absl::StrCat("cannot list checkpoint directory ", dir, ": ", std::strerror(errno)));
  }
  std::set<std::string> out;
  while (dirent* e = readdir(d)) {
    if (absl::EndsWith(e->d_name, ".safetensors")) out.insert(e->d_name);
  }
  closedir(d);
  return out;
}

// One stored shard of a tensor.
struct Piece {
  Layout layout;
  std::vector<float> values;
  std::string file;
};

// Pieces of one tensor of one chunk, by TP rank.
using TpPieces = std::map<int, Piece>;

// Copies `piece` (rank r of the split) into `full`.
void Insert(const Piece& piece, std::vector<float>& full) {
  const SplitView v = ViewOf(piece.layout);
  const int64_t part = v.split / piece.layout.tp_size;
  const int64_t run = part * v.inner;
  for (int64_t o = 0; o < v.outer; ++o) {
    std::memcpy(full.data() + (o * v.split + piece.layout.tp_rank * part) * v.inner,
                piece.values.data() + o * run, sizeof(float) * run);
  }
}

bool BitwiseEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), sizeof(float) * a.size()) == 0;
}

// Assembles the full tensor `name` of chunk `chunk` from its TP pieces.
absl::StatusOr<FullTensor> Gather(const std::string& name, int chunk, const TpPieces& pieces, int tp_size) {
  const std::string where = absl::StrCat("tensor ", name, " of chunk ", chunk);
  for (int r = 0; r < tp_size; ++r) {
    if (pieces.count(r) == 0) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": missing from ", ShardFileName(chunk, r),
                                                     ", which holds other tensors of the chunk; the shard "
                                                     "files come from different models"));
    }
  }
  const Piece& first = pieces.at(0);
  FullTensor full;
  full.shape = first.layout.full_shape;
  for (const auto& [rank, piece] : pieces) {
    if (!piece.layout.SameSplit(first.layout)) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": ", piece.file, " says ",
                                                     LayoutJson(piece.layout), " but ", first.file, " says ",
                                                     LayoutJson(first.layout)));
    }
  }
  if (first.layout.split_dim == -1) {
    for (const auto& [rank, piece] : pieces) {
      if (!BitwiseEqual(piece.values, first.values)) {
        return absl::InvalidArgumentError(absl::StrCat(where, " is replicated but differs between ", first.file,
                                                       " and ", piece.file, "; the TP ranks diverged"));
      }
    }
    full.values = first.values;
    return full;
  }
  full.values.assign(static_cast<size_t>(Product(full.shape, 0, full.shape.size())), 0.0f);
  for (const auto& [rank, piece] : pieces) Insert(piece, full.values);
  return full;
}

}  // namespace

std::string ShardFileName(int pp_stage_chunk, int tp_rank) {
  return absl::StrCat("chunk", pp_stage_chunk, "-tp", tp_rank, ".safetensors");
}

absl::StatusOr<std::string> WriteShardFile(const std::string& dir, int pp_stage_chunk, int tp_rank, int tp_size,
                                           const std::vector<NamedShard>& shards) {
  if (pp_stage_chunk < 0 || tp_size < 1 || tp_rank < 0 || tp_rank >= tp_size) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint shard: chunk ", pp_stage_chunk, ", tp_rank ",
                                                   tp_rank, ", tp_size ", tp_size, " is not a valid position"));
  }
  const std::string file = ShardFileName(pp_stage_chunk, tp_rank);
  SafetensorsWriter writer;
  writer.SetMetadata("baton.format", kShardFormat);
  writer.SetMetadata("baton.chunk", absl::StrCat(pp_stage_chunk));
  writer.SetMetadata("baton.tp_rank", absl::StrCat(tp_rank));
  writer.SetMetadata("baton.tp_size", absl::StrCat(tp_size));
  for (const NamedShard& s : shards) {
    const std::string where = absl::StrCat("checkpoint ", file, ": tensor ", s.name);
    if (!s.value.defined() || !s.value.device().is_cpu() || s.value.dtype() != kernels::DType::kFloat32) {
      return absl::InvalidArgumentError(absl::StrCat(where, " must be a float32 tensor in host memory"));
    }
    Layout l;
    l.full_shape.assign(s.full_shape.begin(), s.full_shape.end());
    l.split_dim = s.split_dim;
    l.qkv = s.qkv;
    l.tp_rank = tp_rank;
    l.tp_size = tp_size;
    absl::StatusOr<std::vector<int64_t>> local = LocalShape(l);
    if (!local.ok()) return WithContext(local.status(), where);
    const std::vector<int64_t> have(s.value.shape().begin(), s.value.shape().end());
    if (have != *local) {
      return absl::InvalidArgumentError(absl::StrCat(where, " has shape ", ShapeString(have), " but full shape ",
                                                     ShapeString(l.full_shape), " split on dim ", l.split_dim,
                                                     " over ", tp_size, " ranks gives ", ShapeString(*local)));
    }
    BATON_RETURN_IF_ERROR_CTX(
        writer.AddFloat32(s.name, have, absl::MakeConstSpan(s.value.f32(), static_cast<size_t>(s.value.numel()))),
        "checkpoint ", file);
    writer.SetMetadata(kLayoutPrefix + s.name, LayoutJson(l));
  }
  BATON_RETURN_IF_ERROR(writer.WriteFile(absl::StrCat(dir, "/", file)));
  return file;
}

absl::Status WriteManifest(const std::string& dir, const std::vector<std::string>& files,
                           const std::string& job_name, int64_t step) {
  const std::set<std::string> unique(files.begin(), files.end());
  if (unique.empty()) return absl::InvalidArgumentError("checkpoint manifest: no shard files to list");
  std::vector<std::string> quoted;
  for (const std::string& f : unique) {
    if (f.empty() || f.find('/') != std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("checkpoint manifest: \"", f, "\" is not a file name inside ", dir));
    }
    absl::StatusOr<std::string> unused = ReadFile(absl::StrCat(dir, "/", f));
    if (!unused.ok()) {
      return absl::FailedPreconditionError(absl::StrCat("checkpoint manifest: shard ", f, " is not in ", dir,
                                                        " (", unused.status().message(), ")"));
    }
    quoted.push_back(JsonQuote(f));
  }
  const std::string text = absl::StrCat("{\n  \"format\": \"", kManifestFormat, "\",\n  \"job\": ", JsonQuote(job_name),
                                        ",\n  \"step\": ", step, ",\n  \"files\": [", absl::StrJoin(quoted, ", "),
                                        "]\n}\n");
  return WriteFileAtomically(absl::StrCat(dir, "/manifest.json"), text);
}

absl::StatusOr<ManifestInfo> ReadManifest(const std::string& dir) {
  const std::string path = absl::StrCat(dir, "/manifest.json");
  absl::StatusOr<std::string> text = ReadFile(path);
  if (!text.ok()) {
    return absl::Status(text.status().code(), absl::StrCat(text.status().message(),
                                                           "; is ", dir, " a baton checkpoint directory?"));
  }
  absl::StatusOr<JsonValue> j = JsonValue::Parse(*text);
  if (!j.ok()) return WithContext(j.status(), path);
  const JsonValue* format = j->Find("format");
  const JsonValue* job = j->Find("job");
  const JsonValue* step = j->Find("step");
  const JsonValue* files = j->Find("files");
  if (format == nullptr || !format->is_string() || format->str() != kManifestFormat) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": \"format\" is not \"", kManifestFormat, "\""));
  }
  if (job == nullptr || !job->is_string() || step == nullptr || !step->integer() || files == nullptr ||
      !files->is_array() || files->items().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": want {\"format\", \"job\": string, \"step\": integer, \"files\": [names]}"));
  }
  ManifestInfo info;
  info.job = job->str();
  info.step = *step->integer();
  std::set<std::string> seen;
  for (const JsonValue& f : files->items()) {
    if (!f.is_string() || f.str().empty() || f.str().find('/') != std::string::npos || !seen.insert(f.str()).second) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": \"files\" must list distinct file names in ", dir));
    }
    info.files.push_back(f.str());
  }
  return info;
}

absl::StatusOr<std::map<std::string, FullTensor>> LoadFullWeights(const std::string& dir) {
  BATON_ASSIGN_OR_RETURN(ManifestInfo manifest, ReadManifest(dir));
  BATON_ASSIGN_OR_RETURN(std::set<std::string> present, ShardFilesIn(dir));
  for (const std::string& f : manifest.files) present.erase(f);
  if (!present.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint ", dir, ": ", absl::StrJoin(present, ", "),
        " not listed in manifest.json; remove leftovers of another checkpoint or save into an empty directory"));
  }

  int tp_size = -1;
  std::map<int, std::map<int, std::string>> files_by_chunk;  // chunk -> tp rank -> file
  // name -> chunk -> pieces by TP rank
  std::map<std::string, std::map<int, TpPieces>> pieces;
  for (const std::string& name : manifest.files) {
    const std::string path = absl::StrCat(dir, "/", name);
    BATON_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Read(path));
    auto format = file.metadata().find("baton.format");
    if (format == file.metadata().end() || format->second != kShardFormat) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": not a baton shard (metadata baton.format is not \"",
                                                     kShardFormat, "\")"));
    }
    absl::StatusOr<int64_t> chunk = file.MetadataInt("baton.chunk");
    absl::StatusOr<int64_t> rank = file.MetadataInt("baton.tp_rank");
    absl::StatusOr<int64_t> size = file.MetadataInt("baton.tp_size");
    if (!chunk.ok() || !rank.ok() || !size.ok() || *chunk < 0 || *size < 1 || *rank < 0 || *rank >= *size ||
        *chunk > (1 << 20) || *size > (1 << 20)) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": metadata baton.chunk, baton.tp_rank, baton.tp_size missing or out of range"));
    }
    if (tp_size == -1) tp_size = static_cast<int>(*size);
    if (*size != tp_size) {
      return absl::InvalidArgumentError(absl::StrCat("checkpoint ", dir, ": ", name, " has tp_size ", *size, " but ",
                                                     manifest.files.front(), " has ", tp_size));
    }
    auto [it, inserted] = files_by_chunk[static_cast<int>(*chunk)].emplace(static_cast<int>(*rank), name);
    if (!inserted) {
      return absl::InvalidArgumentError(absl::StrCat("checkpoint ", dir, ": ", it->second, " and ", name,
                                                     " both hold chunk ", *chunk, " tp rank ", *rank));
    }
    for (const auto& [tensor, entry] : file.tensors()) {
      const std::string where = absl::StrCat(path, ": tensor ", tensor);
      auto meta = file.metadata().find(kLayoutPrefix + tensor);
      if (meta == file.metadata().end()) {
        return absl::InvalidArgumentError(absl::StrCat(where, " has no ", kLayoutPrefix, tensor, " metadata"));
      }
      absl::StatusOr<Layout> layout = ParseLayout(meta->second);
      if (!layout.ok()) return WithContext(layout.status(), absl::StrCat(where, " layout"));
      if (layout->tp_rank != *rank || layout->tp_size != tp_size) {
        return absl::InvalidArgumentError(absl::StrCat(where, " says tp rank ", layout->tp_rank, " of ",
                                                       layout->tp_size, " but the file is rank ", *rank, " of ",
                                                       tp_size));
      }
      absl::StatusOr<std::vector<int64_t>> local = LocalShape(*layout);
      if (!local.ok()) return WithContext(local.status(), where);
      if (*local != entry.shape) {
        return absl::InvalidArgumentError(absl::StrCat(where, " has shape ", ShapeString(entry.shape),
                                                       " but its layout ", meta->second, " implies ",
                                                       ShapeString(*local)));
      }
      Piece piece;
      piece.layout = *std::move(layout);
      piece.file = name;
      BATON_ASSIGN_OR_RETURN(piece.values, file.Float32s(tensor));
      pieces[tensor][static_cast<int>(*chunk)].emplace(static_cast<int>(*rank), std::move(piece));
    }
  }

  // Every chunk from 0 to the last, each with every TP rank.
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

  std::map<std::string, FullTensor> out;
  std::map<std::string, int> chunk_of;
  for (const auto& [name, by_chunk] : pieces) {
    for (const auto& [chunk, tp_pieces] : by_chunk) {
      BATON_ASSIGN_OR_RETURN(FullTensor full, Gather(name, chunk, tp_pieces, tp_size));
      auto [it, inserted] = out.try_emplace(name, std::move(full));  // no move when present
      if (inserted) {
        chunk_of[name] = chunk;
        continue;
      }
      if (it->second.shape != full.shape || !BitwiseEqual(it->second.values, full.values)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "checkpoint ", dir, ": tensor ", name, " is stored by chunk ", chunk_of[name], " and chunk ", chunk,
            " with different ", it->second.shape != full.shape ? "shapes" : "values",
            "; tied copies (the embedding on the first and last stage) must stay equal"));
      }
    }
  }
  return out;
}

absl::StatusOr<std::vector<NamedShard>> ShardsOf(const model::ParameterStore& params) {
  std::vector<NamedShard> out;
  for (const model::Parameter& p : params.parameters()) {
    NamedShard s;
    s.name = p.spec.name;
    s.value = p.value;
    s.full_shape = p.spec.full_shape;
    const model::ShardSpec& spec = p.spec.shard;
    const std::vector<int64_t> full(p.spec.full_shape.begin(), p.spec.full_shape.end());
    const size_t d = static_cast<size_t>(spec.dim);
    if (!spec.replicated) {
      s.split_dim = spec.dim;
      const bool plain = d < full.size() && spec.outer == Product(full, 0, d) && spec.split == full[d] &&
                         spec.inner == Product(full, d + 1, full.size());
      s.qkv = !plain && d == 0 && !full.empty() && spec.outer == 3 && spec.split * 3 == full[0] &&
              spec.inner == Product(full, 1, full.size());
      if (!plain && !s.qkv) {
        return absl::InternalError(absl::StrCat("parameter ", s.name, ": its ShardSpec has no checkpoint layout"));
      }
    }
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace baton::checkpoint
