// Parameters of one stage: names, full (unsharded) shapes, how each is split
// over the tensor-parallel group, seeded initialisation, and one flat buffer
// each for values, gradients and the two AdamW moments (so a data-parallel
// all-reduce or a checkpoint can move a stage's state in one piece).
//
// Initialisation is a pure function of (seed, name, element index of the full
// tensor): each rank draws the full tensor and keeps its shard, so every
// TP/PP layout starts from the same model.
#ifndef BATON_WORKER_MODEL_PARAMETERS_H_
#define BATON_WORKER_MODEL_PARAMETERS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/tensor.h"
#include "kernels/ops.h"

namespace baton::model {

// The full tensor viewed as [outer, split, inner]; TP rank r holds
// [outer, split / tp, inner] starting at r · split / tp along the middle, and
// its local shape is the full shape with dimension `dim` divided by tp.
// Replicated tensors are whole on every rank.
struct ShardSpec {
  int64_t outer = 1;
  int64_t split = 1;
  int64_t inner = 1;
  bool replicated = true;
  int dim = 0;

  // Column-parallel weight [out, in] or bias [out]: rows split.
  static ShardSpec Rows(int64_t rows, int64_t cols);
  // QKV weight [3C, C] or bias [3C]: each of q, k, v split by heads.
  static ShardSpec QkvRows(int64_t c, int64_t cols);
  // Row-parallel weight [out, in]: columns split.
  static ShardSpec Columns(int64_t rows, int64_t cols);
  static ShardSpec Replicated(int64_t numel);
};

enum class InitKind { kNormal, kZeros, kOnes };

struct ParameterSpec {
  std::string name;  // e.g. "h.3.attn.c_attn.weight"
  kernels::Shape full_shape;
  ShardSpec shard;
  InitKind init = InitKind::kZeros;
  float init_std = 0.0f;
  bool weight_decay = false;  // matrices decay; biases and LayerNorm do not
  // Counted in this rank's share of the global grad norm. False for
  // replicated tensors on TP ranks > 0 and for the tied embedding copy on
  // the last pipeline stage, so every gradient is counted once.
  bool counts_in_norm = true;
  // A GEMM weight: with bf16 copies (ParameterStore::AllocateBf16Copies) it
  // also has a bf16 copy of its values that bf16 GEMMs read.
  bool gemm_weight = false;
  // An expert's tensor under expert parallelism (StageConfig::ep_size > 1):
  // held by one rank of the expert group, its gradient reduced over the
  // expert-data-parallel group. These come last in a stage's specs, so they
  // are the tail of the flat buffers (GptStage::expert_elements).
  bool expert = false;
};

struct Parameter {
  ParameterSpec spec;
  kernels::Tensor value, grad, adam_m, adam_v;  // local shard, views into the store
  // Where `value` starts in the store's flat buffers (elements). With the
  // optimizer state sharded over DP (ParameterStore::ShardOverDp) adam_m and
  // adam_v are undefined: the moments of this rank's DP shard live in the
  // store's flat adam_m() / adam_v(), which may cut through any parameter.
  int64_t offset = 0;
  // bf16 copy of `value` (GEMM weights with bf16 copies; undefined
  // otherwise). AdamW rewrites it with every update; RefreshBf16Copies sets
  // it from `value` (after initialisation or a restore).
  kernels::Tensor value_bf16;
};

// Copies between a full tensor and rank `rank`'s shard (of `size` ranks).
void ExtractShard(const ShardSpec& shard, int rank, int size, const float* full, float* local);
void InsertShard(const ShardSpec& shard, int rank, int size, const float* local, float* full);
int64_t LocalElements(const ShardSpec& shard, int size);

// Deterministic N(0, std) values for element indices [0, n) of `name`.
void FillNormal(uint64_t seed, const std::string& name, float std, float* out, int64_t n);

// The DP shard of a stage's flat buffers under ZeRO-1 (parallel.zero_stage):
// the flat buffer of `elements` is padded to `size` * `count`, and DP rank
// `rank` owns elements [begin, begin + count), begin = rank * count. The
// count is ceil(elements / size) rounded up to 16 elements (64 bytes), so
// every rank's shard is aligned. Unsharded: size 1, the whole buffer.
struct DpShard {
  int rank = 0;
  int size = 1;
  int64_t elements = 0;  // the stage's parameter elements on this TP rank
  int64_t begin = 0;
  int64_t count = 0;
  int64_t padded() const { return count * size; }
  bool sharded() const { return size > 1; }

  static DpShard Of(int64_t elements, int rank, int size);
};

class ParameterStore {
 public:
  // The store of this rank's shards of `specs`: the flat values, zero, in
  // host memory (Initialize draws them there). The gradients and AdamW
  // moments come with Place, on their device. A host without the memory:
  // OutOfMemoryError (kernels::IsOutOfMemory) naming the bytes.
  static absl::StatusOr<ParameterStore> Create(std::vector<ParameterSpec> specs, int tp_rank, int tp_size);

  // Draws every parameter from `seed` (full tensors, then this rank's shard).
  // On the host: call before Place.
  void Initialize(uint64_t seed);
  // Puts the store on `device`, once, before any use of the gradients or
  // moments: the values move there (stay, for the CPU), and the gradients
  // and both moments are allocated there zero-filled, never on the host
  // first; parameter views rebound. Out of memory: OutOfMemoryError, and
  // the store is unchanged.
  absl::Status Place(kernels::Device device);
  // ZeRO-1: keeps the AdamW moments of DP rank `dp_rank`'s shard only (of
  // `dp_size`; DpShard), and a gradient buffer of that shard for the
  // reduce-scatter; the values and gradients are padded to DpShard::padded
  // so an all-gather and a reduce-scatter move them in one piece. Call
  // before Place. INVALID_ARGUMENT for a rank outside the group; after
  // Place, FAILED_PRECONDITION.
  absl::Status ShardOverDp(int dp_rank, int dp_size);
  const DpShard& dp_shard() const { return dp_shard_; }
  kernels::Device device() const { return values_.device(); }
  // Gives every GEMM weight (ParameterSpec::gemm_weight) a bf16 copy, one
  // flat bf16 buffer on device() (call after Place), and fills it with
  // RefreshBf16Copies. For train.precision = bf16.
  absl::Status AllocateBf16Copies(const kernels::ExecContext& ctx);
  // Rounds every value that has a bf16 copy into it (enqueued on ctx); for
  // after the fp32 values were set other than by AdamW (SetFull, a restore).
  void RefreshBf16Copies(const kernels::ExecContext& ctx);
  bool has_bf16_copies() const { return values_bf16_.defined(); }
  // Sets parameter `name` from its full (unsharded) values (its bf16 copy,
  // if any, is the caller's to refresh).
  absl::Status SetFull(const std::string& name, absl::Span<const float> full);
  // A host copy of `t` (a view into this store, on any device); waits for
  // it. A failed device copy is an error naming the tensor's device.
  static absl::StatusOr<std::vector<float>> ToHost(const kernels::Tensor& t);

  std::vector<Parameter>& parameters() { return params_; }
  const std::vector<Parameter>& parameters() const { return params_; }
  Parameter* Find(const std::string& name);

  // Every gradient of the stage in one buffer (for zeroing, or one
  // data-parallel all-reduce).
  const kernels::Tensor& grads() const { return grads_; }
  // The flat values (same order as grads()), for capturing and restoring a
  // stage's state.
  const kernels::Tensor& values() const { return values_; }
  // The AdamW moments: of every value, or of the DP shard's values
  // (dp_shard().count elements) when sharded.
  const kernels::Tensor& adam_m() const { return adam_m_; }
  const kernels::Tensor& adam_v() const { return adam_v_; }
  // Sharded only (undefined otherwise): the values and gradients padded to
  // dp_shard().padded() (grads() and values() are their first elements; the
  // padding stays zero), the shard's part of the values, and the shard's
  // gradient, where the reduce-scatter puts it.
  const kernels::Tensor& padded_values() const { return padded_values_; }
  const kernels::Tensor& padded_grads() const { return padded_grads_; }
  kernels::Tensor shard_values() const;
  const kernels::Tensor& shard_grads() const { return shard_grads_; }

  // Bytes this store holds on its device, by kind: the fp32 values and bf16
  // copies ("weights"), the gradients and the shard's gradient ("grads"),
  // the two AdamW moments ("optimizer").
  struct MemoryBytes {
    int64_t weights = 0, grads = 0, optimizer = 0;
  };
  MemoryBytes memory_bytes() const;

 private:
  ParameterStore(std::vector<ParameterSpec> specs, kernels::Tensor values, int tp_rank, int tp_size);
  // Points every parameter's views into the flat buffers (undefined views
  // for buffers not allocated yet).
  void BindViews();

  std::vector<Parameter> params_;
  kernels::Tensor values_, grads_, adam_m_, adam_v_;
  kernels::Tensor values_bf16_;  // GEMM weights' bf16 copies, when allocated
  kernels::Tensor padded_values_, padded_grads_, shard_grads_;  // sharded only
  DpShard dp_shard_;
  int tp_rank_, tp_size_;
};

}  // namespace baton::model

#endif  // BATON_WORKER_MODEL_PARAMETERS_H_
