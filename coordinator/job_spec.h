// JobSpec loading and validation. Every error names the field and says what
// to change; the coordinator exits with code 2 on an invalid --job.
#ifndef BATON_COORDINATOR_JOB_SPEC_H_
#define BATON_COORDINATOR_JOB_SPEC_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "baton/v1/job.pb.h"
#include "coordinator/schedule/ir.h"

namespace baton {

// Hard caps on every size a job spec sets, checked before anything is
// allocated for it (ValidateJobSpec). They bound what one coordinator and
// worker process will ever be asked to build; the memory a job really needs
// is checked against what the workers reported by CheckPlanFitsMemory
// (coordinator/memory_estimate.h).
struct JobLimits {
  static constexpr int kMaxLayers = 1024;
  static constexpr int kMaxDModel = 1 << 16;
  // model.ffn_dim (Llama's MLP width): GPT-2's 4 * d_model at the largest d_model.
  static constexpr int kMaxFfnDim = 4 * kMaxDModel;
  static constexpr int kMaxHeads = 1024;
  static constexpr int kMaxVocab = 1 << 20;
  static constexpr int kMaxSeqLen = 1 << 16;
  static constexpr int kMaxMicroBatchSize = 1 << 16;
  static constexpr int kMaxMicrobatches = 1 << 16;
  static constexpr int64_t kMaxSteps = 100'000'000;
  // pp * tp * cp * dp that a job may plan (paper-scale meshes); how many workers one
  // coordinator holds is its --max_workers (default 4096, worker_registry.h).
  static constexpr int kMaxWorkers = 65536;
  static constexpr int kMaxVirtualStages = 64;
  // pp * microbatches * virtual_stages: the (rank, microbatch, chunk) cells of
  // the schedule the coordinator builds, lowers, validates and simulates.
  static constexpr int64_t kMaxScheduleCells = schedule::kMaxScheduleCells;
  // Elements of the largest single tensor of a stage (the kernels index with
  // 32-bit counts in places): attention scores, logits, the embedding.
  static constexpr int64_t kMaxTensorElements = (int64_t{1} << 31) - 1;
  static constexpr double kMaxSyntheticOpMs = 60'000;
  static constexpr int64_t kMaxSyntheticActivationBytes = int64_t{1} << 30;
  static constexpr int64_t kMaxCheckpointEverySteps = kMaxSteps;
  static constexpr int kMaxEvalSteps = 10000;  // train.eval_steps: global batches per evaluation
  // model.moe.experts and model.moe.capacity_factor: the worker's bounds
  // (worker/model/gpt_config.h kMaxExperts, gpt_config.cc ValidateMoe),
  // restated: the coordinator does not depend on worker/model (DESIGN.md §12).
  static constexpr int kMaxExperts = 1024;
  static constexpr double kMaxCapacityFactor = 1e6;
  static constexpr size_t kMaxSpecBytes = 1 << 20;  // the job file itself
  static constexpr size_t kMaxScheduleCsvBytes = 1 << 20;  // schedule.csv (or csv_file)
};

// The effective parallel layout (unset sizes mean 1; docs/architecture.md
// "Parallel mesh"). cp ranks split each sequence (2*cp chunks, two per rank)
// and reduce the gradients with the DP ranks as one group of dp*cp; ep is a
// planned axis, its ranks carved out of dp (ep divides dp, adds no ranks).
// zero_stage (unset: 0) says how that group shares the training state: 0
// every rank whole, 1 each of the dp*cp ranks holds the AdamW moments of its
// 1/(dp*cp) shard of each chunk's parameters only (docs/model.md "ZeRO"); it
// adds no ranks.
struct ParallelDims {
  int pp = 1;
  int tp = 1;
  int dp = 1;
  int virtual_stages = 1;
  int cp = 1;
  int ep = 1;
  int zero_stage = 0;
  bool sequence_parallel = false;  // Megatron SP inside the TP groups; adds no ranks
  int world_size() const { return pp * tp * cp * dp; }
  // Whether the ranks of the data-parallel group (dp*cp of one (pp, tp))
  // hold different optimizer shards (ZeRO stage >= 1), so that none is a
  // replica of another's full state.
  bool sharded_optimizer() const { return zero_stage >= 1; }
};

ParallelDims DimsOf(const v1::JobSpec& job);

// Parses textproto, or JSON when the text starts with '{'. Unknown fields are
// errors. `source` names the input in messages (e.g. the file path).
absl::StatusOr<v1::JobSpec> ParseJobSpec(absl::string_view text, absl::string_view source);

// Reads, parses and validates a job file; a schedule.csv_file (relative to
// the job file's directory) is read into schedule.csv.
absl::StatusOr<v1::JobSpec> LoadJobSpec(const std::string& path);

// Checks that the spec is consistent and buildable (INVALID_ARGUMENT otherwise).
// parallel.ep > 1 needs model.moe (a dense model has no experts to split),
// ep dividing dp and the experts, and zero_stage 0.
// parallel.cp > 1 needs a real model and model.seq_len divisible by 2*cp.
// model.moe (job.proto MoeSpec) needs a real model, fp32, and no cp.
// parallel.zero_stage 2 and 3 are refused here and by
// ValidateJobSpecAllowingPlannedAxes alike: they are not planned axes.
absl::Status ValidateJobSpec(const v1::JobSpec& job);

// ValidateJobSpec without that refusal (every other check, ep's own and cp's
// included: ep divides parallel.dp and, with model.moe, model.moe.experts): for planning meshes with the planned axis (MakePlanOfMesh) before
// the model uses it. Never for a job that is going to run.
absl::Status ValidateJobSpecAllowingPlannedAxes(const v1::JobSpec& job);

// The rows an MoE block's experts hold in all for one microbatch of `tokens`
// tokens (docs/model.md "Mixture of Experts"): dropless (capacity_factor 0)
// every choice, tokens * top_k; otherwise each expert's capacity
// ceil(capacity_factor * tokens * top_k / experts), at most `tokens` (a
// token chooses an expert once), times experts. For the tensor bound and
// the memory estimate.
double MoeExpertRows(const v1::MoeSpec& moe, double tokens);

// model.moe.every_n_layers with its default (unset: 1, every block); 0 for
// a dense model (no model.moe).
int MoeEvery(const v1::ModelSpec& model);

// How many of blocks [first, end) are MoE blocks in a model whose block i is
// one iff (i + 1) % every == 0 (job.proto MoeSpec); 0 when `every` is 0.
int MoeBlocksIn(int every, int first, int end);

}  // namespace baton

#endif  // BATON_COORDINATOR_JOB_SPEC_H_
