// Checkpoints, the worker's side: every worker writes its chunks' state as
// one safetensors shard file per (model chunk, TP rank); the coordinator
// lists them in a manifest (common/checkpoint_manifest.h, which also reads,
// gathers and validates checkpoints). Format: docs/checkpoints.md.
//
//   dir/chunk<c>-tp<t>.safetensors   c: global model-chunk index (the pipeline
//                                    stage, or the virtual stage when
//                                    interleaved), contiguous from 0
//   dir/manifest.json                written last by the coordinator
//
// Two shard versions: v1 (WriteShardFile) holds weights only; v2
// (WriteStateShardFile) a ChunkState: weights, AdamW moments ("adam_m/<name>",
// "adam_v/<name>"), the optimizer step and a CRC-32 per tensor, enough to
// resume training bit for bit. Each tensor's metadata entry
// "baton.layout.<name>" records its full shape, split dimension, qkv flag and
// (tp_rank, tp_size), so a file describes itself and any layout can be
// resharded into any other (ChunkStateFrom). With data parallelism only one
// replica needs to write; replicas writing the same file name are harmless
// (each write is atomic and the contents are equal).
#ifndef BATON_WORKER_CHECKPOINT_CHECKPOINT_H_
#define BATON_WORKER_CHECKPOINT_CHECKPOINT_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/checkpoint_manifest.h"
#include "worker/model/parameters.h"
#include "worker/stage_model.h"

namespace baton::checkpoint {

// Writes `shards` (float32 host tensors) as a v1 (weights only) shard file
// dir/ShardFileName(...) atomically and returns that file name (relative to
// `dir`, as WriteManifest wants it). Errors (INVALID_ARGUMENT) name the
// tensor: a local shape that is not the full shape split over tp_size, a
// split that does not divide, a name used twice, a tensor that is not float32
// or not in host memory.
absl::StatusOr<std::string> WriteShardFile(const std::string& dir, int pp_stage_chunk, int tp_rank,
                                           int tp_size, const std::vector<NamedShard>& shards);

// Where one chunk's tensors sit: in the flat order of its ChunkState (the
// order of StageModel::Shards()), each with its local shape and its layout in
// the full tensor.
struct ChunkTensor {
  std::string name;
  std::vector<int64_t> local_shape;
  TensorLayout layout;
};
struct ChunkLayout {
  int chunk = 0, tp_rank = 0, tp_size = 1;
  std::vector<ChunkTensor> tensors;
  int64_t elements() const;  // sum of local sizes: ChunkState::values.size()
};
// The layout of a chunk from its model's Shards() (a copy: no tensor data is
// kept). Errors name the tensor whose local shape does not fit its split.
absl::StatusOr<ChunkLayout> LayoutOfChunk(const std::vector<NamedShard>& shards, int chunk, int tp_rank,
                                          int tp_size);

// Writes `state` (of a chunk laid out as `layout`) as a v2 shard file
// dir/ShardFileName(layout.chunk, layout.tp_rank) atomically and returns its
// name. INVALID_ARGUMENT when the state's sizes do not fit the layout.
absl::StatusOr<std::string> WriteStateShardFile(const std::string& dir, const ChunkLayout& layout,
                                                const ChunkState& state);

// Reads the checkpoint in `dir` and gathers full tensors by name (weights
// only; see LoadFullState).
absl::StatusOr<std::map<std::string, FullTensor>> LoadFullWeights(const std::string& dir);

// The exact ChunkState of a chunk laid out as `layout` (any chunk, TP rank,
// TP size, partition, vocabulary-parallel or not) from a checkpoint saved by
// any layout: each tensor's full values and moments, cut to the target's
// shard. The tied embedding copy of a last chunk gets the one "wte". Errors
// name the tensor: missing from the checkpoint, or of another full shape; a
// checkpoint without optimizer state (v1) gives zero moments only when
// `allow_weights_only`.
absl::StatusOr<ChunkState> ChunkStateFrom(const FullState& full, const ChunkLayout& layout,
                                          bool allow_weights_only = false);
// LoadFullState(dir, only the layout's tensors) + ChunkStateFrom.
absl::StatusOr<ChunkState> LoadChunkState(const std::string& dir, const ChunkLayout& layout);

// The checkpoint view of a stage's parameters: each parameter's local value
// with its full shape and split. INTERNAL for a ShardSpec with no such view.
absl::StatusOr<std::vector<NamedShard>> ShardsOf(const model::ParameterStore& params);

}  // namespace baton::checkpoint

#endif  // BATON_WORKER_CHECKPOINT_CHECKPOINT_H_
