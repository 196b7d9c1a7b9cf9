#include "worker/checkpoint/checkpoint.h"

#include <algorithm>
#include <cstring>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/crc32.h"
#include "common/safetensors.h"
#include "common/status_macros.h"

namespace baton::checkpoint {
namespace {

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

int64_t Product(const std::vector<int64_t>& shape, size_t begin, size_t end) {
  int64_t n = 1;
  for (size_t i = begin; i < end; ++i) n *= shape[i];
  return n;
}

// The layout of one NamedShard, checked against its local shape.
absl::StatusOr<ChunkTensor> TensorOf(const NamedShard& s, const std::vector<int64_t>& have, int tp_rank,
                                     int tp_size, const std::string& where) {
  ChunkTensor t;
  t.name = s.name;
  t.local_shape = have;
  t.layout.full_shape.assign(s.full_shape.begin(), s.full_shape.end());
  t.layout.split_dim = s.split_dim;
  t.layout.qkv = s.qkv;
  t.layout.tp_rank = tp_rank;
  t.layout.tp_size = tp_size;
  absl::StatusOr<std::vector<int64_t>> local = LocalShape(t.layout);
  if (!local.ok()) return WithContext(local.status(), where);
  if (have != *local) {
    return absl::InvalidArgumentError(absl::StrCat(where, " has shape ", ShapeString(have), " but full shape ",
                                                   ShapeString(t.layout.full_shape), " split on dim ",
                                                   t.layout.split_dim, " over ", tp_size, " ranks gives ",
                                                   ShapeString(*local)));
  }
  return t;
}

absl::Status CheckPosition(int chunk, int tp_rank, int tp_size) {
  if (chunk < 0 || tp_size < 1 || tp_rank < 0 || tp_rank >= tp_size) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint shard: chunk ", chunk, ", tp_rank ", tp_rank,
                                                   ", tp_size ", tp_size, " is not a valid position"));
  }
  return absl::OkStatus();
}

void SetHeader(SafetensorsWriter& writer, const char* format, int chunk, int tp_rank, int tp_size) {
  writer.SetMetadata("baton.format", format);
  writer.SetMetadata("baton.chunk", absl::StrCat(chunk));
  writer.SetMetadata("baton.tp_rank", absl::StrCat(tp_rank));
  writer.SetMetadata("baton.tp_size", absl::StrCat(tp_size));
}

}  // namespace

absl::StatusOr<std::string> WriteShardFile(const std::string& dir, int pp_stage_chunk, int tp_rank, int tp_size,
                                           const std::vector<NamedShard>& shards) {
  BATON_RETURN_IF_ERROR(CheckPosition(pp_stage_chunk, tp_rank, tp_size));
  const std::string file = ShardFileName(pp_stage_chunk, tp_rank);
  SafetensorsWriter writer;
  SetHeader(writer, kShardFormatV1, pp_stage_chunk, tp_rank, tp_size);
  for (const NamedShard& s : shards) {
    const std::string where = absl::StrCat("checkpoint ", file, ": tensor ", s.name);
    if (!s.value.defined() || !s.value.device().is_cpu() || s.value.dtype() != kernels::DType::kFloat32) {
      return absl::InvalidArgumentError(absl::StrCat(where, " must be a float32 tensor in host memory"));
    }
    const std::vector<int64_t> have(s.value.shape().begin(), s.value.shape().end());
    BATON_ASSIGN_OR_RETURN(ChunkTensor t, TensorOf(s, have, tp_rank, tp_size, where));
    BATON_RETURN_IF_ERROR_CTX(
        writer.AddFloat32(s.name, have, absl::MakeConstSpan(s.value.f32(), static_cast<size_t>(s.value.numel()))),
        "checkpoint ", file);
    writer.SetMetadata(kLayoutPrefix + s.name, LayoutJson(t.layout));
  }
  BATON_RETURN_IF_ERROR(writer.WriteFile(absl::StrCat(dir, "/", file)));
  return file;
}

int64_t ChunkLayout::elements() const {
  int64_t n = 0;
  for (const ChunkTensor& t : tensors) n += NumElements(t.local_shape);
  return n;
}

absl::StatusOr<ChunkLayout> LayoutOfChunk(const std::vector<NamedShard>& shards, int chunk, int tp_rank,
                                          int tp_size) {
  BATON_RETURN_IF_ERROR(CheckPosition(chunk, tp_rank, tp_size));
  ChunkLayout layout;
  layout.chunk = chunk;
  layout.tp_rank = tp_rank;
  layout.tp_size = tp_size;
  std::set<std::string> names;
  for (const NamedShard& s : shards) {
    const std::string where = absl::StrCat("chunk ", chunk, " tp rank ", tp_rank, ": tensor ", s.name);
    if (!names.insert(s.name).second) return absl::InvalidArgumentError(absl::StrCat(where, " listed twice"));
    if (!s.value.defined() || s.value.dtype() != kernels::DType::kFloat32) {
      return absl::InvalidArgumentError(absl::StrCat(where, " must be a float32 tensor"));
    }
    const std::vector<int64_t> have(s.value.shape().begin(), s.value.shape().end());
    BATON_ASSIGN_OR_RETURN(ChunkTensor t, TensorOf(s, have, tp_rank, tp_size, where));
    layout.tensors.push_back(std::move(t));
  }
  return layout;
}

absl::StatusOr<std::string> WriteStateShardFile(const std::string& dir, const ChunkLayout& layout,
                                                const ChunkState& state) {
  BATON_RETURN_IF_ERROR(CheckPosition(layout.chunk, layout.tp_rank, layout.tp_size));
  const std::string file = ShardFileName(layout.chunk, layout.tp_rank);
  const size_t n = static_cast<size_t>(layout.elements());
  const bool moments = !state.adam_m.empty() || !state.adam_v.empty();
  if (state.values.size() != n || (moments && (state.adam_m.size() != n || state.adam_v.size() != n)) ||
      state.optimizer_step < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint ", file, ": the state has ", state.values.size(), " values, ", state.adam_m.size(), " + ",
        state.adam_v.size(), " moments and step ", state.optimizer_step, " but the chunk's tensors hold ", n,
        " elements"));
  }
  // The v2 format itself is written in common/ (batonctl writes it too).
  std::vector<StateShardTensor> tensors;
  size_t offset = 0;
  for (const ChunkTensor& t : layout.tensors) {
    const size_t count = static_cast<size_t>(NumElements(t.local_shape));
    StateShardTensor s{t.name, t.layout, absl::Span<const float>(state.values.data() + offset, count), {}, {}};
    if (moments) {
      s.adam_m = absl::Span<const float>(state.adam_m.data() + offset, count);
      s.adam_v = absl::Span<const float>(state.adam_v.data() + offset, count);
    }
    tensors.push_back(std::move(s));
    offset += count;
  }
  BATON_ASSIGN_OR_RETURN(std::string written,
                         checkpoint::WriteStateShardFile(dir, layout.chunk, layout.tp_rank, layout.tp_size,
                                                         state.optimizer_step, moments, tensors));
  if (written != file) return absl::InternalError(absl::StrCat("checkpoint: wrote ", written, ", not ", file));
  return file;
}

absl::StatusOr<std::map<std::string, FullTensor>> LoadFullWeights(const std::string& dir) {
  BATON_ASSIGN_OR_RETURN(FullState state, LoadFullState(dir));
  for (auto& [name, t] : state.tensors) {
    t.adam_m.clear();
    t.adam_v.clear();
  }
  return std::move(state.tensors);
}

absl::StatusOr<ChunkState> ChunkStateFrom(const FullState& full, const ChunkLayout& layout,
                                          bool allow_weights_only) {
  const bool moments = full.has_moments;
  if (full.optimizer_step < 0 && !allow_weights_only) {
    return absl::FailedPreconditionError(
        "the checkpoint holds weights only (format v1, no optimizer state); training cannot resume from it "
        "exactly");
  }
  const size_t n = static_cast<size_t>(layout.elements());
  ChunkState state;
  state.optimizer_step = std::max<int64_t>(full.optimizer_step, 0);
  state.values.resize(n);
  if (moments || allow_weights_only) {
    state.adam_m.resize(n);
    state.adam_v.resize(n);
  }
  size_t offset = 0;
  for (const ChunkTensor& t : layout.tensors) {
    const std::string where = absl::StrCat("chunk ", layout.chunk, " tp rank ", layout.tp_rank, " of ",
                                           layout.tp_size, ": tensor ", t.name);
    auto it = full.tensors.find(t.name);
    if (it == full.tensors.end()) {
      return absl::InvalidArgumentError(absl::StrCat(where, " is not in the checkpoint; it is from another model"));
    }
    const FullTensor& f = it->second;
    if (f.shape != t.layout.full_shape) {
      return absl::InvalidArgumentError(absl::StrCat(where, " has full shape ", ShapeString(f.shape),
                                                     " in the checkpoint but ", ShapeString(t.layout.full_shape),
                                                     " in this model; it is from another model"));
    }
    const size_t want = static_cast<size_t>(NumElements(f.shape));
    if (f.values.size() != want || (moments && (f.adam_m.size() != want || f.adam_v.size() != want))) {
      return absl::InternalError(absl::StrCat(where, ": the loaded checkpoint holds no values for it"));
    }
    ExtractShard(t.layout, f.values.data(), state.values.data() + offset);
    if (moments) {
      ExtractShard(t.layout, f.adam_m.data(), state.adam_m.data() + offset);
      ExtractShard(t.layout, f.adam_v.data(), state.adam_v.data() + offset);
    }
    offset += static_cast<size_t>(NumElements(t.local_shape));
  }
  return state;
}

absl::StatusOr<ChunkState> LoadChunkState(const std::string& dir, const ChunkLayout& layout) {
  std::set<std::string> names;
  for (const ChunkTensor& t : layout.tensors) names.insert(t.name);
  BATON_ASSIGN_OR_RETURN(FullState full, LoadFullState(dir, &names));
  absl::StatusOr<ChunkState> state = ChunkStateFrom(full, layout);
  if (!state.ok()) return WithContext(state.status(), absl::StrCat("checkpoint ", dir));
  return state;
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
