// Checkpoints: every worker writes its parameters as one safetensors shard
// file per (model chunk, TP rank), the coordinator lists them in a manifest,
// and LoadFullWeights gathers any layout (TP 1/2/4, any PP split, interleaved
// chunks) back into full tensors. Format: docs/checkpoints.md.
//
//   dir/chunk<c>-tp<t>.safetensors   c: global model-chunk index (the pipeline
//                                    stage, or the virtual stage when
//                                    interleaved), contiguous from 0
//   dir/manifest.json                {"format", "job", "step", "files"}
//
// Each tensor's metadata entry "baton.layout.<name>" records its full shape,
// split dimension, qkv flag and (tp_rank, tp_size), so a file describes
// itself. With data parallelism only one replica needs to write; replicas
// writing the same file name are harmless (each write is atomic and the
// contents are equal).
#ifndef BATON_WORKER_CHECKPOINT_CHECKPOINT_H_
#define BATON_WORKER_CHECKPOINT_CHECKPOINT_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/model/parameters.h"
#include "worker/stage_model.h"

namespace baton::checkpoint {

// A whole (unsharded) float32 tensor, row-major.
struct FullTensor {
  std::vector<int64_t> shape;
  std::vector<float> values;
};

// "chunk<c>-tp<t>.safetensors".
std::string ShardFileName(int pp_stage_chunk, int tp_rank);

// Writes `shards` (float32 host tensors) to dir/ShardFileName(...) atomically
// and returns that file name (relative to `dir`, as WriteManifest wants it).
// Errors (INVALID_ARGUMENT) name the tensor: a local shape that is not the
// full shape split over tp_size, a split that does not divide, a name used
// twice, a tensor that is not float32 or not in host memory.
absl::StatusOr<std::string> WriteShardFile(const std::string& dir, int pp_stage_chunk, int tp_rank,
                                           int tp_size, const std::vector<NamedShard>& shards);

// Writes dir/manifest.json atomically. `files` are names inside `dir` (as
// WriteShardFile returns them; duplicates are dropped); each must exist.
absl::Status WriteManifest(const std::string& dir, const std::vector<std::string>& files,
                           const std::string& job_name, int64_t step);

// What manifest.json says besides the file list.
struct ManifestInfo {
  std::string job;
  int64_t step = 0;
  std::vector<std::string> files;
};
absl::StatusOr<ManifestInfo> ReadManifest(const std::string& dir);

// Reads the manifest and every shard, and gathers full tensors by name.
// A name present in several chunks (the tied embedding on the first and last
// stage) must be equal bit for bit there, as must replicated tensors across
// TP ranks; one copy is kept. Errors say what is wrong and where: a missing
// or unreadable file, a shard file in `dir` the manifest does not list, a
// chunk or TP rank with no file, a tensor missing on some TP rank, layouts
// that disagree, copies that differ.
absl::StatusOr<std::map<std::string, FullTensor>> LoadFullWeights(const std::string& dir);

// The checkpoint view of a stage's parameters: each parameter's local value
// with its full shape and split. INTERNAL for a ShardSpec with no such view.
absl::StatusOr<std::vector<NamedShard>> ShardsOf(const model::ParameterStore& params);

}  // namespace baton::checkpoint

#endif  // BATON_WORKER_CHECKPOINT_CHECKPOINT_H_
