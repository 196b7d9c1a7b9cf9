// The checkpoint format, the part every binary needs (docs/checkpoints.md):
// shard file names and per-tensor layout metadata, manifest.json (written
// last, atomically: a directory with a manifest is a complete checkpoint),
// the step-<n> directories of periodic checkpoints, pruning to `keep`, and
// reading and validating shard files without any model code. The worker
// writes shards (worker/checkpoint/checkpoint.h); the coordinator writes the
// manifest, prunes, and validates a --resume directory before any worker
// trains; batonctl compares checkpoints.
#ifndef BATON_COMMON_CHECKPOINT_MANIFEST_H_
#define BATON_COMMON_CHECKPOINT_MANIFEST_H_

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "baton/v1/job.pb.h"

namespace baton::checkpoint {

inline constexpr char kShardFormatV1[] = "baton-shard-v1";  // weights only
inline constexpr char kShardFormatV2[] = "baton-shard-v2";  // + optimizer step, moments, CRCs
inline constexpr char kManifestFormatV1[] = "baton-checkpoint-v1";
inline constexpr char kManifestFormatV2[] = "baton-checkpoint-v2";
inline constexpr char kManifestFile[] = "manifest.json";
// Tensor name prefixes of the AdamW moments of parameter <name> in v2 shards.
inline constexpr char kAdamMPrefix[] = "adam_m/";
inline constexpr char kAdamVPrefix[] = "adam_v/";
// Shard metadata keys: the layout of tensor <name>, and (v2) its CRC-32.
inline constexpr char kLayoutPrefix[] = "baton.layout.";
inline constexpr char kCrcPrefix[] = "baton.crc32.";

// "chunk<c>-tp<t>.safetensors".
std::string ShardFileName(int pp_stage_chunk, int tp_rank);

// How one stored tensor fits into its full tensor: the full tensor viewed as
// [outer, split, inner]; TP rank r holds [outer, split / tp_size, inner]
// starting at r · split / tp_size. split_dim -1: replicated (whole on every
// rank). qkv: the fused QKV tensor [3C, ...], each of q, k, v split.
struct TensorLayout {
  std::vector<int64_t> full_shape;
  int split_dim = -1;
  bool qkv = false;
  int tp_rank = 0;
  int tp_size = 1;

  bool SameSplit(const TensorLayout& o) const {
    return full_shape == o.full_shape && split_dim == o.split_dim && qkv == o.qkv &&
           tp_size == o.tp_size;
  }
};
std::string LayoutJson(const TensorLayout& l);
absl::StatusOr<TensorLayout> ParseLayout(const std::string& json);
// The local shape `l` implies, after checking that the split divides.
absl::StatusOr<std::vector<int64_t>> LocalShape(const TensorLayout& l);
int64_t NumElements(const std::vector<int64_t>& shape);
// Copies rank l.tp_rank's shard between `full` and `local` (sizes as implied
// by a layout LocalShape accepted).
void InsertShard(const TensorLayout& l, const float* local, float* full);
void ExtractShard(const TensorLayout& l, const float* full, float* local);

// The model a checkpoint holds (from the job spec that wrote it).
struct ModelShape {
  bool synthetic = false;
  int layers = 0, d_model = 0, heads = 0, vocab = 0, seq_len = 0;  // GPT only
  int chunks = 0;  // synthetic: one weight per model chunk
  // (The fields above keep their order: callers brace-initialise them.)
  // Llama (arch "llama"): the spec's values with defaults filled in
  // (kv_heads = heads, ffn_dim = 4 * d_model, rope_theta 10000, norm_eps
  // 1e-5, tie_embeddings false). GPT-2 (arch "gpt2", also for manifests
  // written before arch existed) leaves them at the initial values below
  // (0, and tie_embeddings true); operator== ignores them for GPT-2, and
  // manifest.json records them for Llama only.
  std::string arch = "gpt2";
  int kv_heads = 0, ffn_dim = 0;
  float rope_theta = 0, norm_eps = 0;
  bool tie_embeddings = true;
  // model.moe (job.proto MoeSpec), either architecture: moe_experts 0 is a
  // dense model (the other fields 0). An MoE model's values have the
  // defaults filled in (every_n_layers 1, aux_loss_coef 0.01, as
  // worker/model/gpt_config.cc GptConfigFromSpec fills them); manifest.json
  // records them, as "moe", for MoE models only, and operator== compares all
  // five.
  int moe_experts = 0, moe_top_k = 0, moe_every = 0;
  double moe_capacity_factor = 0;
  float moe_aux_coef = 0;
  bool moe() const { return moe_experts > 0; }
  // Block i is an MoE block iff (i + 1) % every_n_layers == 0.
  bool moe_block(int block) const { return moe() && moe_every > 0 && (block + 1) % moe_every == 0; }
  bool operator==(const ModelShape& o) const;
};
struct ParallelLayout {
  int pp = 1, tp = 1, dp = 1, virtual_stages = 1;
  std::string schedule;
};
ModelShape ModelShapeOf(const v1::JobSpec& job);
// checkpoint.keep, 2 when unset.
int CheckpointKeep(const v1::JobSpec& job);
ParallelLayout ParallelLayoutOf(const v1::JobSpec& job);
std::string DescribeModel(const ModelShape& m);

struct ManifestInfo {
  int version = 2;  // 1: an older weights-only checkpoint without model or layout
  std::string job;
  int64_t step = 0;  // the job's committed steps when saved
  ModelShape model;  // version 2
  ParallelLayout layout;  // version 2: the layout that saved it (informational)
  std::vector<std::string> files;
};
// A version 2 manifest for `job` at `step`.
ManifestInfo ManifestFor(const v1::JobSpec& job, int64_t step, std::vector<std::string> files);

// Writes dir/manifest.json atomically, after checking that every listed file
// (a name inside `dir`; duplicates dropped) exists. Call it last, once every
// shard is written: the manifest is what makes a checkpoint complete.
absl::Status WriteManifest(const std::string& dir, const ManifestInfo& info);
// A version 1 (weights only) manifest, as older releases wrote.
absl::Status WriteManifest(const std::string& dir, const std::vector<std::string>& files,
                           const std::string& job_name, int64_t step);
// Reads version 1 or 2; errors name the file and what is wrong.
absl::StatusOr<ManifestInfo> ReadManifest(const std::string& dir);

// Periodic checkpoints: root/step-<n, 8+ digits>/.
std::string StepDirName(int64_t step);
struct CheckpointEntry {
  int64_t step = 0;
  std::string path;
  bool complete = false;  // has a manifest.json
};
// The step-<n> directories under `root`, oldest first. An absent root is an
// empty list.
absl::StatusOr<std::vector<CheckpointEntry>> ListCheckpoints(const std::string& root);
// `dir` itself when it holds a manifest, else the newest complete step-<n>
// under it; NOT_FOUND saying what was looked for otherwise.
absl::StatusOr<std::string> ResolveCheckpoint(const std::string& dir);
// Deletes all but the newest `keep` (>= 1) complete checkpoints under `root`,
// and incomplete ones older than the newest complete one (a save that
// crashed); never one newer (it may be being written). Returns the paths
// removed.
absl::StatusOr<std::vector<std::string>> PruneCheckpoints(const std::string& root, int keep);

// One shard file, read and checked on its own: the safetensors structure
// (truncation, bad offsets), the metadata, every tensor's layout against its
// stored shape, and (v2) every tensor's CRC-32. Errors start with the path.
struct ShardTensor {
  TensorLayout layout;
  std::vector<float> values;  // empty when not kept
  uint32_t crc = 0;           // CRC-32 of the values' bytes
};
struct ShardContents {
  std::string file;  // name inside the directory
  int version = 1;
  int chunk = 0, tp_rank = 0, tp_size = 1;
  int64_t optimizer_step = -1;  // v2
  bool has_moments = false;     // v2 with AdamW moments
  // Parameters by name; their moments under kAdamMPrefix / kAdamVPrefix.
  std::map<std::string, ShardTensor> tensors;
};
// `keep_values` false drops the values after checking (validation).
absl::StatusOr<ShardContents> ReadShardFile(const std::string& dir, const std::string& file,
                                            bool keep_values = true);

// One parameter of a v2 shard file: its local values (the size its layout's
// LocalShape implies) and, in a shard with moments, both AdamW moments of
// the same size.
struct StateShardTensor {
  std::string name;
  TensorLayout layout;
  absl::Span<const float> values, adam_m, adam_v;
};
// Writes a v2 (complete) shard file dir/ShardFileName(chunk, tp_rank)
// atomically — metadata, layouts, CRC-32s; moments stored when `moments` —
// and returns its name. INVALID_ARGUMENT naming the tensor for a layout of
// another (tp_rank, tp_size), a split that does not divide, or a value count
// that disagrees with the layout. The one writer of the v2 format: the
// worker (worker/checkpoint/checkpoint.h) and `batonctl checkpoint
// import-hf` both call it.
absl::StatusOr<std::string> WriteStateShardFile(const std::string& dir, int chunk, int tp_rank,
                                                int tp_size, int64_t optimizer_step, bool moments,
                                                const std::vector<StateShardTensor>& tensors);

// A whole (unsharded) float32 tensor, row-major, with its AdamW moments
// (empty when the checkpoint has none).
struct FullTensor {
  std::vector<int64_t> shape;
  std::vector<float> values, adam_m, adam_v;
};
struct FullState {
  std::string dir;  // the checkpoint directory read
  ManifestInfo manifest;
  int chunks = 0, tp_size = 1;
  int64_t optimizer_step = -1;  // -1: a v1 checkpoint (no optimizer state)
  bool has_moments = false;
  std::map<std::string, FullTensor> tensors;  // parameters by name
};
// Reads the manifest and every shard and gathers full tensors (and moments)
// by name. `only`, when set, limits the tensors gathered (every file is still
// checked). A name in several chunks (the tied embedding) must be equal bit
// for bit there, as must replicated tensors across TP ranks. Errors say what
// is wrong and where: a missing, truncated or corrupted file, a shard file
// the manifest does not list, a chunk or TP rank with no file, a tensor
// missing on some rank, layouts that disagree, copies that differ.
absl::StatusOr<FullState> LoadFullState(const std::string& dir,
                                        const std::set<std::string>* only = nullptr);

// Everything LoadFullState checks (without keeping the values, one file in
// memory at a time; copies are compared by CRC-32), plus, for resuming `job`: a version 2 manifest whose
// model equals the job's (else the message lists the job-spec fields that
// differ), optimizer state in every file (one optimizer step), and tensor
// shapes that fit the model (GPT-2: wte [vocab, d_model], wpe [seq_len,
// d_model], blocks h.0 .. h.<layers-1>; Llama: embed_tokens.weight [vocab,
// d_model], norm.weight [d_model], lm_head.weight [vocab, d_model] when
// untied (and none when tied), blocks layers.0 .. layers.<layers-1>, each
// tensor of its Hugging Face shape; synthetic: one weight per chunk of the
// job; MoE blocks (ModelShape::moe_block) hold the router and every
// expert's matrices instead of the dense MLP's: GPT-2 mlp.router.weight
// [experts, d_model], mlp.experts.<e>.c_fc.weight [4 d_model, d_model] and
// .c_proj.weight [d_model, 4 d_model]; Llama block_sparse_moe.gate.weight
// [experts, d_model], block_sparse_moe.experts.<e>.w1 / w3.weight [ffn_dim,
// d_model] and .w2.weight [d_model, ffn_dim]). The message names the file
// and the problem. The returned tensors hold shapes only.
absl::StatusOr<FullState> ValidateCheckpointForJob(const std::string& dir,
                                                   const v1::JobSpec& job);

// What `--resume=DIR` runs before any worker trains: ResolveCheckpoint(DIR)
// (a checkpoint, or the newest complete step-<n> under a checkpoint.dir),
// then ValidateCheckpointForJob. The result's `dir` is the checkpoint chosen
// and manifest.step the step to continue after.
absl::StatusOr<FullState> ValidateResumeCheckpoint(const std::string& dir, const v1::JobSpec& job);

}  // namespace baton::checkpoint

#endif  // BATON_COMMON_CHECKPOINT_MANIFEST_H_
