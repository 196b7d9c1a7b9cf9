// GptStageModel: the real GPT math behind the StageModel interface — one
// model::GptStage (one pipeline chunk on one TP rank) plus its AdamW settings
// and the communicator pairing its tied embedding with the other end of the
// pipeline.
//
// Activations are [micro_batch_size, model.seq_len, d_model] per microbatch,
// float32 or (config.precision bf16) bf16; data rows are model.seq_len tokens
// long. Captured and restored state is the fp32 master state; RestoreState
// rounds the restored weights into the bf16 copies.
//
// Shards() lists every parameter of the chunk under its model name
// (docs/model.md) with its full shape and TP split. The tied embedding (GPT-2,
// and Llama with tie_embeddings): the first chunk's token embedding and the
// last chunk's LM head are one tensor, "wte" (Llama: "embed_tokens.weight")
// [vocab, d_model]. With more than one chunk both hold a copy of that name;
// the last chunk's is marked tied_copy (equal to the first's after every
// optimizer step), so a checkpoint writes it once, from the first chunk, and
// restores both copies from it. An untied Llama head is "lm_head.weight",
// and its chunks have no tie group. Shard values are views into the
// parameter store: writing one sets the parameter.
//
// Not thread-safe: one thread drives a worker's stages.
#ifndef BATON_WORKER_GPT_STAGE_MODEL_H_
#define BATON_WORKER_GPT_STAGE_MODEL_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "baton/v1/job.pb.h"
#include "kernels/ops.h"
#include "worker/comm/communicator.h"
#include "worker/comm/stream_p2p.h"
#include "worker/model/gpt_config.h"
#include "worker/model/gpt_stage.h"
#include "worker/stage_model.h"

namespace baton {

// AdamW for a job: lr and weight_decay from train, betas 0.9 / 0.95, eps 1e-8.
kernels::AdamWConfig AdamWFromTrainSpec(const v1::TrainSpec& train);

class GptStageModel : public StageModel {
 public:
  // `config`: see model::MakeChunkConfig (set microbatches to the schedule's
  // microbatches per step). `tp_group`: config.tp_size ranks, this one
  // config.tp_rank; may be null when tp_size is 1. `tie_group`: for the first
  // and last chunk of a pipeline of more than one chunk, a two-rank group of
  // this TP rank's first chunk (rank 0) and last chunk (rank 1); null
  // elsewhere, and null when both chunks are on this rank (a V placement):
  // then TieLocally pairs them. `cp_group`: config.cp_size ranks (this one
  // config.cp_rank) when cp_size > 1, else null; the model hands the stage
  // its CP rank's view of each microbatch's tokens and targets
  // (model/context_parallel.h) and its activations are that view's.
  // `ep_group`: config.ep_size ranks (this one config.ep_rank) of the
  // chunk's expert group when ep_size > 1, else null. The communicators must
  // outlive the model.
  static absl::StatusOr<std::unique_ptr<GptStageModel>> Create(const model::StageConfig& config,
                                                               int64_t micro_batch_size,
                                                               comm::Communicator* tp_group,
                                                               comm::Communicator* tie_group,
                                                               const kernels::AdamWConfig& adamw,
                                                               comm::Communicator* cp_group = nullptr,
                                                               comm::Communicator* ep_group = nullptr);

  int64_t activation_elements() const override;
  kernels::DType activation_dtype() const override { return stage_->activation_dtype(); }
  absl::Status Forward(int mb, const MicrobatchData& data, const kernels::Tensor& input,
                       const kernels::Tensor& output) override;
  absl::Status BackwardInput(int mb, const kernels::Tensor& grad_output,
                             const kernels::Tensor& grad_input) override;
  absl::Status BackwardWeight(int mb) override;
  void ZeroGrad() override;
  void DropInFlight() override;
  kernels::Tensor Gradients() override;
  double LocalGradSqNorm() const override;
  absl::Status SyncTiedGradients() override;
  absl::Status AwaitTiedPeer() override;
  kernels::Tensor TiedGradient() override { return holds_tied_embedding() ? TiedEmbeddingGrad() : kernels::Tensor(); }
  absl::Status OptimizerStep(float grad_scale) override;
  model::StepScore score() const override;
  // Also reports a failure of the tied-embedding sum run on the stream.
  absl::Status ReadStepResults(model::StepScore* score, double* grad_sq_norm) override;
  bool EnqueueStepResults() override;
  absl::Status TakeStepResults(model::StepScore* score, double* grad_sq_norm) override;
  std::vector<NamedShard> Shards() override;
  // values, adam_m, adam_v: the parameter store's flat buffers (every
  // parameter's local shard, in StageParameterSpecs order); the tied
  // embedding copy of the last chunk is included like any parameter.
  ChunkState CaptureState() const override;
  absl::Status RestoreState(const ChunkState& state) override;
  absl::StatusOr<ChunkState> CaptureFullState(comm::Communicator* dp, absl::Duration timeout) override;
  absl::Status RestoreFullState(const ChunkState& state) override;
  DpShardBuffers DpShard() override;
  int64_t expert_elements() const override { return stage_->expert_elements(); }
  // All-gathers the experts' values and moments (through the chunk's
  // device) over `ep`; the other ranks' tensors are named as
  // StageParameterSpecs names them on those ranks.
  absl::StatusOr<GatheredExperts> GatherExperts(comm::Communicator* ep, absl::Duration timeout,
                                                ChunkState state) override;
  void ValuesGathered() override { stage_->RefreshBf16Weights(); }
  model::ParameterStore::MemoryBytes MemoryBytes() const override { return stage_->parameters().memory_bytes(); }
  int64_t activation_bytes() const override { return stage_->activation_bytes(); }
  // GptStage's counts, and MoeAuxLossSum / microbatches (one host sync).
  MoeStats ReadMoeStats() const override;
  const kernels::ExecContext& context() const override { return stage_->context(); }
  absl::Status Synchronize() override { return stage_->stream().Synchronize(); }

  model::GptStage& stage() { return *stage_; }

  // Both ends of the tied embedding on one rank (the first and the last
  // chunk, created without a tie group): SyncTiedGradients of the first sums
  // the two gradient copies into both (a + b, as the two-rank all-reduce),
  // after the last chunk's work on its stream; the last chunk's own call
  // does nothing, so the first must be synced first (the executor goes in
  // stage order). Both must outlive each other's use.
  static absl::Status TieLocally(GptStageModel& first, GptStageModel& last);

 private:
  GptStageModel(const model::StageConfig& config, int64_t micro_batch_size,
                std::unique_ptr<model::GptStage> stage, comm::Communicator* tie_group,
                const kernels::AdamWConfig& adamw)
      : config_(config),
        batch_(micro_batch_size),
        stage_(std::move(stage)),
        tie_(tie_group),
        adamw_(adamw) {}

  bool holds_tied_embedding() const {
    return config_.model.tie_embeddings && config_.pp_size > 1 && (config_.is_first() || config_.is_last());
  }

  model::StageConfig config_;
  int64_t batch_;
  std::unique_ptr<model::GptStage> stage_;
  comm::Communicator* tie_;
  kernels::AdamWConfig adamw_;
  // The other end of the tied embedding on this rank (TieLocally), and the
  // events ordering the first chunk's sum after the last one's stream and
  // the last one's later work after the sum.
  GptStageModel* local_tie_ = nullptr;
  std::unique_ptr<kernels::Event> tie_events_[2];
  kernels::Tensor TiedEmbeddingGrad();
  absl::Status SumTiedGradientsLocally();
  // A chunk on a stream whose tie group can sum from it (the simulated device
  // over a host communicator) runs the tied-embedding sum on its stream, no
  // host wait (comm/stream_p2p.h); its error is reported by ReadStepResults.
  const std::shared_ptr<comm::StreamCommStatus> tie_status_ = std::make_shared<comm::StreamCommStatus>();
  // One float on the chunk's device that AwaitTiedPeer sums (never read).
  kernels::Tensor tie_arrival_;
};

}  // namespace baton

#endif  // BATON_WORKER_GPT_STAGE_MODEL_H_
