// StageModel: what the step executor needs from the model chunk(s) a worker
// holds, so the real GPT stage (worker/model/gpt_stage.h) and the synthetic
// cost model (ops that busy-wait for configured times and pass tensors of a
// configured size) plug in alike.
//
// One StageModel is one pipeline chunk (stage) on one TP rank. Activations
// passed between stages (and their gradients) are buffers of
// activation_elements() elements of activation_dtype() per microbatch. Not thread-safe: one thread drives a worker's stages.
//
// Names: "stage" is one pipeline chunk on one TP rank everywhere. StageModel
// is the executor's interface to it; GptStageModel (gpt_stage_model.h) and
// SyntheticStage (synthetic_stage.h) implement it; model::GptStage is the GPT
// math GptStageModel adapts (data and optimizer settings in, microbatch
// tensors out). What a stage scored is model::StepScore, one struct for the
// math, the interface and the executor's report.
#ifndef BATON_WORKER_STAGE_MODEL_H_
#define BATON_WORKER_STAGE_MODEL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/tensor.h"
#include "worker/comm/communicator.h"
#include "worker/model/parameters.h"
#include "worker/model/step_score.h"

namespace baton {

// One microbatch of data (first and last stages): int32 [batch, seq] each.
// A target of -1 is ignored (no loss, no gradient, not counted).
struct MicrobatchData {
  kernels::Tensor tokens;
  kernels::Tensor targets;
};

// A named local tensor and how it fits into the full tensor (for checkpoints).
struct NamedShard {
  std::string name;
  kernels::Tensor value;     // this rank's shard
  kernels::Shape full_shape;
  int split_dim = -1;        // -1: replicated; else split evenly over tp ranks along this dim
  bool qkv = false;          // split per q, k, v block along dim 0 (see ShardSpec::QkvRows)
  // A copy of a tensor another stage also holds under the same name and
  // keeps equal (the last stage's "wte" for the tied LM head): a checkpoint
  // stores the other one and restores both from it.
  bool tied_copy = false;
};

// Everything the next steps of one chunk depend on: parameters, AdamW
// moments and the optimizer step counter (host copies of the flat buffers, in
// the chunk's parameter order). Same layout only (same chunk, TP rank and TP
// size); worker/checkpoint/ reshards between layouts. adam_m and adam_v are
// empty for a model without moments (the synthetic stage).
struct ChunkState {
  int64_t optimizer_step = 0;
  std::vector<float> values, adam_m, adam_v;
};

// ZeRO-1 (parallel.zero_stage 1): the buffers of a chunk whose AdamW
// moments are sharded over its data-parallel group (model::DpShard). The
// executor reduce-scatters padded_grads into shard_grads (then averages
// them), the chunk's OptimizerStep updates shard_values from shard_grads,
// and the executor all-gathers padded_values from every rank's shard. All
// undefined for a chunk that is not sharded.
struct DpShardBuffers {
  kernels::Tensor padded_grads;   // dp · count; grads of every value, then zero padding
  kernels::Tensor shard_grads;    // count: this rank's reduced shard
  kernels::Tensor padded_values;  // dp · count
  kernels::Tensor shard_values;   // count: this rank's part of padded_values
  bool sharded() const { return shard_grads.defined(); }
};

// Expert parallelism: a chunk's state with the experts of every rank of its
// expert group (StageModel::GatherExperts): the dense parameters, then each
// rank's experts in rank order; `shards` names the state's tensors in that
// order, their values host views into state.values (valid while `state` is
// neither changed nor copied: move the struct whole).
struct GatheredExperts {
  ChunkState state;
  std::vector<NamedShard> shards;
};

// Mixture of Experts: what a chunk's routers did since ZeroGrad, over its
// MoE blocks and the microbatches run forward (model::GptStage::moe_routed,
// moe_kept, MoeAuxLossSum).
struct MoeStats {
  std::vector<int64_t> routed;  // per expert: top-k choices routed to it; empty for a dense model
  std::vector<int64_t> kept;    // per expert: those kept after capacity drops
  double aux_loss = 0;          // the load-balancing losses as they enter the objective (1 / microbatches)
};

class StageModel {
 public:
  virtual ~StageModel() = default;

  virtual int64_t activation_elements() const = 0;
  // The dtype of the pipeline messages (activations and input gradients):
  // float32, or bf16 for a train.precision = bf16 model (half the bytes).
  virtual kernels::DType activation_dtype() const { return kernels::DType::kFloat32; }

  // `input` is the previous stage's activations (empty on the first stage,
  // which reads data.tokens); `output` receives this stage's activations
  // (empty on the last stage, which scores data.targets).
  virtual absl::Status Forward(int mb, const MicrobatchData& data, const kernels::Tensor& input,
                               const kernels::Tensor& output) = 0;
  // `grad_output` is empty on the last stage; `grad_input` empty on the first.
  virtual absl::Status BackwardInput(int mb, const kernels::Tensor& grad_output,
                                     const kernels::Tensor& grad_input) = 0;
  virtual absl::Status BackwardWeight(int mb) = 0;

  virtual void ZeroGrad() = 0;
  virtual void DropInFlight() = 0;  // after a failed or discarded step

  // The flat gradient buffer (all parameters of this stage), for the DP
  // all-reduce; and this rank's share of the squared global norm.
  virtual kernels::Tensor Gradients() = 0;
  virtual double LocalGradSqNorm() const = 0;
  // Sums the tied embedding gradient copies (PP > 1, first/last stage only;
  // others return OK without communicating).
  virtual absl::Status SyncTiedGradients() = 0;
  // Returns (or, on a stream, orders the chunk's stream) once the other
  // holder of the tied embedding has reached its sum too: a one-float
  // all-reduce, so that SyncTiedGradients' time is the sum's own, and the
  // wait for the peer's last backward is bubble (docs/metrics.md). OK at once
  // for chunks without the tie.
  virtual absl::Status AwaitTiedPeer() { return absl::OkStatus(); }
  // The tied embedding's gradient (a view into Gradients()), on the first
  // and last chunk of a pipeline of more than one chunk; undefined elsewhere.
  virtual kernels::Tensor TiedGradient() { return kernels::Tensor(); }
  virtual absl::Status OptimizerStep(float grad_scale) = 0;

  virtual model::StepScore score() const = 0;  // last stage; zero elsewhere
  // score() and LocalGradSqNorm() at the end of a step's backward work, read
  // back with at most one host synchronisation; on return every op the chunk
  // enqueued before the call is done. The device's error, if any.
  virtual absl::Status ReadStepResults(model::StepScore* score, double* grad_sq_norm) {
    *score = this->score();
    *grad_sq_norm = LocalGradSqNorm();
    return Synchronize();
  }
  // ReadStepResults in two halves, so a rank with several chunks on one
  // device waits on the host once for all of them: EnqueueStepResults
  // enqueues the reads on the chunk's stream without a host wait (true when
  // it did: the model splits the read); then, after the host waited for
  // work that covers this chunk's stream, TakeStepResults returns them.
  // By default nothing is enqueued and TakeStepResults is ReadStepResults.
  virtual bool EnqueueStepResults() { return false; }
  virtual absl::Status TakeStepResults(model::StepScore* score, double* grad_sq_norm) {
    return ReadStepResults(score, grad_sq_norm);
  }

  // Where the chunk's ops run: the device of the activations and gradients
  // passed in and out, and the context for ops on its buffers (the gradient
  // average). Host by default.
  virtual const kernels::ExecContext& context() const { return kernels::ExecContext::Host(); }
  // Blocks until every op the chunk has enqueued is done, so its outputs can
  // be read by a communicator. Immediate on the host.
  virtual absl::Status Synchronize() { return absl::OkStatus(); }
  virtual std::vector<NamedShard> Shards() = 0;
  // Shards() with every value in host memory: the shards themselves on the
  // host, else host copies of them (copied on the chunk's stream and waited
  // for; `storage` holds the copies and must outlive the result). Between
  // steps only, like CaptureState().
  absl::StatusOr<std::vector<NamedShard>> HostShards(std::vector<float>* storage);

  // A host copy of the chunk's state. Call between steps only (after the
  // optimizer step or a discard, not while microbatches are in flight).
  // Sharded (DpShard()): the moments are the shard's only, and the state
  // restores the same layout and DP rank only.
  virtual ChunkState CaptureState() const = 0;
  // The chunk's whole state for a checkpoint: CaptureState(), with the
  // moments of a DP-sharded chunk all-gathered over `dp` (its DP group: a
  // collective, every rank of the group calls it for the same chunks in the
  // same order; `timeout` bounds the gather).
  virtual absl::StatusOr<ChunkState> CaptureFullState(comm::Communicator* dp, absl::Duration timeout) {
    (void)dp;
    (void)timeout;
    return CaptureState();
  }
  // RestoreState from a whole state (a checkpoint's, moments of every
  // value): a DP-sharded chunk keeps its shard of the moments.
  virtual absl::Status RestoreFullState(const ChunkState& state) { return RestoreState(state); }
  virtual DpShardBuffers DpShard() { return {}; }
  // Expert parallelism (parallel.ep > 1): how many trailing elements of
  // Gradients() hold this rank's experts, which the executor reduces over the
  // expert-data-parallel group (the ranks holding the same experts) rather
  // than the data-parallel group; 0 for a chunk without expert parallelism.
  virtual int64_t expert_elements() const { return 0; }
  // Expert parallelism: `state` (this chunk's whole state: CaptureState, or
  // CaptureFullState when sharded; moments may be left empty, for weights
  // only) with every rank's experts, for a checkpoint that is the same as
  // without expert parallelism. A collective over `ep` (the chunk's expert
  // group; every rank calls it for the same chunks in the same order;
  // `timeout` bounds it). Between steps only.
  virtual absl::StatusOr<GatheredExperts> GatherExperts(comm::Communicator* ep, absl::Duration timeout,
                                                        ChunkState state) {
    (void)ep;
    (void)timeout;
    (void)state;
    return absl::UnimplementedError("this model has no experts to gather");
  }
  // After the executor all-gathered DpShard().padded_values: refreshes what
  // is derived from the values (bf16 copies), on the chunk's stream.
  virtual void ValuesGathered() {}
  // Bytes of weights, gradients and optimizer state the chunk holds on its
  // device (baton_device_memory_bytes); zero for a model without them.
  virtual model::ParameterStore::MemoryBytes MemoryBytes() const { return {}; }
  // The most activation bytes held at once since ZeroGrad (GptStage::
  // activation_bytes); zero for a model that does not count them.
  virtual int64_t activation_bytes() const { return 0; }
  // MoE: the chunk's routing counts and load-balancing loss since ZeroGrad.
  // May wait for the chunk's stream (the loss is on the device): call it
  // once the step's results were read, when the stream is idle. Empty for a
  // model without experts.
  virtual MoeStats ReadMoeStats() const { return {}; }
  // Sets the state bit for bit from a CaptureState() of the same layout,
  // drops microbatches in flight and zeroes gradients, so the next step runs
  // exactly as the captured model's next step would. INVALID_ARGUMENT (model
  // unchanged) when a size does not match this chunk.
  virtual absl::Status RestoreState(const ChunkState& state) = 0;
};

}  // namespace baton

#endif  // BATON_WORKER_STAGE_MODEL_H_
