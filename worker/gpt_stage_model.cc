#include "worker/gpt_stage_model.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "kernels/backend.h"
#include "worker/model/comm_buffer.h"
#include "worker/model/context_parallel.h"

namespace baton {

using kernels::Tensor;

kernels::AdamWConfig AdamWFromTrainSpec(const v1::TrainSpec& train) {
  kernels::AdamWConfig config;
  config.lr = static_cast<float>(train.lr());
  config.weight_decay = static_cast<float>(train.weight_decay());
  config.beta1 = 0.9f;
  config.beta2 = 0.95f;
  config.eps = 1e-8f;
  return config;
}

absl::StatusOr<std::unique_ptr<GptStageModel>> GptStageModel::Create(
    const model::StageConfig& config, int64_t micro_batch_size, comm::Communicator* tp_group,
    comm::Communicator* tie_group, const kernels::AdamWConfig& adamw, comm::Communicator* cp_group,
    comm::Communicator* ep_group) {
  if (micro_batch_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("train.micro_batch_size = ", micro_batch_size, ": must be positive"));
  }
  const bool needs_tie =
      config.model.tie_embeddings && config.pp_size > 1 && (config.is_first() || config.is_last());
  // No group: both ends are on this rank (TieLocally pairs them).
  if (needs_tie && tie_group != nullptr &&
      (tie_group->size() != 2 || tie_group->rank() != (config.is_first() ? 0 : 1))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model chunk ", config.pp_rank, " of ", config.pp_size,
        " holds the tied embedding and needs a two-rank tie group where the first chunk is "
        "rank 0 and the last rank 1"));
  }
  BATON_ASSIGN_OR_RETURN(std::unique_ptr<model::GptStage> stage,
                         model::GptStage::Create(config, tp_group, cp_group, ep_group));
  std::unique_ptr<GptStageModel> model(
      new GptStageModel(config, micro_batch_size, std::move(stage), tie_group, adamw));
  if (needs_tie) {
    BATON_ASSIGN_OR_RETURN(model->tie_arrival_, kernels::ZerosOn(config.device, {1}, kernels::DType::kFloat32));
  }
  return model;
}

int64_t GptStageModel::activation_elements() const {
  return batch_ * config_.model.seq_len / config_.cp_size * config_.model.d_model;
}

namespace {

// This CP rank's view [2B, T / (2 cp)] of a microbatch's int32 [B, T] ids.
absl::StatusOr<Tensor> ContextParallelView(const Tensor& whole, const model::StageConfig& config,
                                           const char* what) {
  if (config.cp_size == 1) return whole;
  const int64_t seq = config.model.seq_len;
  if (!whole.defined() || whole.dtype() != kernels::DType::kInt32 || !whole.device().is_cpu() ||
      whole.ndim() != 2 || whole.dim(1) != seq) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": want host int32 [micro_batch_size, model.seq_len = ", seq,
                                                   "] to split over parallel.cp = ", config.cp_size, " ranks"));
  }
  const int64_t batch = whole.dim(0);
  BATON_ASSIGN_OR_RETURN(Tensor local, Tensor::TryZeros({2 * batch, seq / (2 * config.cp_size)},
                                                        kernels::DType::kInt32));
  model::SliceForContextParallel(whole.i32(), batch, seq, config.cp_rank, config.cp_size, local.i32());
  return local;
}

}  // namespace

absl::Status GptStageModel::Forward(int mb, const MicrobatchData& data, const Tensor& input,
                                    const Tensor& output) {
  model::StageInputs in;
  if (config_.is_first()) {
    BATON_ASSIGN_OR_RETURN(in.tokens, ContextParallelView(data.tokens, config_, "tokens"));
  } else {
    if (!input.defined() || input.numel() != activation_elements()) {
      return absl::InvalidArgumentError(
          absl::StrCat("Forward(", mb, "): input: want ", activation_elements(),
                       " activations (micro_batch_size × seq_len / cp × d_model), got ",
                       input.defined() ? input.numel() : 0));
    }
    const bool cp = config_.cp_size > 1;
    in.activations = input.Reshaped({cp ? 2 * batch_ : batch_,
                                     cp ? config_.model.seq_len / (2 * config_.cp_size) : config_.model.seq_len,
                                     config_.model.d_model});
  }
  if (config_.is_last()) {
    BATON_ASSIGN_OR_RETURN(in.targets, ContextParallelView(data.targets, config_, "targets"));
  }
  return stage_->Forward(mb, in, output);
}

absl::Status GptStageModel::BackwardInput(int mb, const Tensor& grad_output,
                                          const Tensor& grad_input) {
  return stage_->BackwardInput(mb, grad_output, grad_input);
}

absl::Status GptStageModel::BackwardWeight(int mb) { return stage_->BackwardWeight(mb); }

void GptStageModel::ZeroGrad() { stage_->ZeroGrad(); }

void GptStageModel::DropInFlight() { stage_->DropInFlight(); }

Tensor GptStageModel::Gradients() { return stage_->parameters().grads(); }

double GptStageModel::LocalGradSqNorm() const { return stage_->LocalGradSqNorm(); }

absl::Status GptStageModel::TieLocally(GptStageModel& first, GptStageModel& last) {
  if (!first.holds_tied_embedding() || !last.holds_tied_embedding() || !first.config_.is_first() ||
      !last.config_.is_last() || first.tie_ != nullptr || last.tie_ != nullptr) {
    return absl::InvalidArgumentError(
        "TieLocally pairs the first and the last chunk of a pipeline, both on this rank without a tie group");
  }
  if (first.context().stream != nullptr) {
    BATON_ASSIGN_OR_RETURN(first.tie_events_[0], kernels::Event::Create(first.config_.device));
    BATON_ASSIGN_OR_RETURN(first.tie_events_[1], kernels::Event::Create(first.config_.device));
  }
  first.local_tie_ = &last;
  last.local_tie_ = &first;
  return absl::OkStatus();
}

Tensor GptStageModel::TiedEmbeddingGrad() {
  for (model::Parameter& p : stage_->parameters().parameters()) {
    if (p.spec.name == model::TokenEmbeddingName(config_.model)) return p.grad;
  }
  return Tensor();
}

absl::Status GptStageModel::SumTiedGradientsLocally() {
  if (!config_.is_first()) return absl::OkStatus();  // the first chunk's call sums both copies
  const Tensor mine = TiedEmbeddingGrad(), theirs = local_tie_->TiedEmbeddingGrad();
  kernels::Stream* stream = context().stream;
  kernels::Stream* other = local_tie_->context().stream;
  if (stream != nullptr) {  // after the last chunk's backward, before its later work
    BATON_RETURN_IF_ERROR(tie_events_[0]->Record(*other));
    BATON_RETURN_IF_ERROR(tie_events_[0]->StreamWait(*stream));
  }
  kernels::Residual(context(), mine, mine, theirs);  // a + b, as the two-rank all-reduce sums
  kernels::Copy(context(), theirs, mine);
  if (stream != nullptr) {
    BATON_RETURN_IF_ERROR(tie_events_[1]->Record(*stream));
    BATON_RETURN_IF_ERROR(tie_events_[1]->StreamWait(*other));
  }
  return absl::OkStatus();
}

absl::Status GptStageModel::AwaitTiedPeer() {
  if (!holds_tied_embedding() || local_tie_ != nullptr) return absl::OkStatus();
  if (tie_ == nullptr) return absl::FailedPreconditionError("the tied embedding has no tie group and no local partner");
  constexpr char kName[] = "arrival at the tied embedding's sum";
  const comm::Buffer arrival = model::CommBuffer(tie_arrival_);
  if (context().stream != nullptr && comm::CanEnqueueAllReduce(*tie_, arrival)) {
    return comm::EnqueueAllReduce(*tie_, arrival, kName, stage_->stream(), config_.comm_timeout, tie_status_);
  }
  return stage_->SumOverGroup(*tie_, tie_arrival_, kName);
}

absl::Status GptStageModel::SyncTiedGradients() {
  if (!holds_tied_embedding()) return absl::OkStatus();
  if (local_tie_ != nullptr) return SumTiedGradientsLocally();
  if (tie_ == nullptr) return absl::FailedPreconditionError("the tied embedding has no tie group and no local partner");
  const int want_rank = config_.is_first() ? 0 : 1;
  if (context().stream != nullptr && tie_->size() == 2 && tie_->rank() == want_rank) {
    for (model::Parameter& p : stage_->parameters().parameters()) {
      if (p.spec.name != model::TokenEmbeddingName(config_.model)) continue;
      const comm::Buffer grad = model::CommBuffer(p.grad);
      if (!comm::CanEnqueueAllReduce(*tie_, grad)) break;
      return comm::EnqueueAllReduce(*tie_, grad, "all-reduce of the tied embedding gradient", stage_->stream(),
                                    config_.comm_timeout, tie_status_);
    }
  }
  return stage_->SyncTiedEmbeddingGrad(*tie_);
}

absl::Status GptStageModel::ReadStepResults(model::StepScore* score, double* grad_sq_norm) {
  absl::Status read = stage_->ReadStepResults(score, grad_sq_norm);  // waits for the stream
  absl::Status tie = tie_status_->status();
  tie_status_->Reset();  // the stream is idle now
  return tie.ok() ? read : tie;
}

bool GptStageModel::EnqueueStepResults() {
  if (context().stream == nullptr) return false;  // the CPU: nothing to enqueue
  stage_->EnqueueStepResults();
  return true;
}

absl::Status GptStageModel::TakeStepResults(model::StepScore* score, double* grad_sq_norm) {
  if (context().stream == nullptr) return ReadStepResults(score, grad_sq_norm);
  absl::Status stage = stage_->TakeStepResults(score, grad_sq_norm);  // the caller waited for the stream
  absl::Status tie = tie_status_->status();
  tie_status_->Reset();  // the stream is idle now
  return tie.ok() ? stage : tie;
}

absl::Status GptStageModel::OptimizerStep(float grad_scale) {
  return stage_->OptimizerStep(adamw_, grad_scale);
}

model::StepScore GptStageModel::score() const { return stage_->score(); }

MoeStats GptStageModel::ReadMoeStats() const {
  MoeStats stats;
  if (!config_.model.moe()) return stats;
  stats.routed = stage_->moe_routed();
  stats.kept = stage_->moe_kept();
  // GptStage sums each microbatch's losses; the objective weights them
  // 1 / microbatches, like the cross-entropy.
  stats.aux_loss = stage_->MoeAuxLossSum() / std::max(1, config_.microbatches);
  return stats;
}

std::vector<NamedShard> GptStageModel::Shards() {
  std::vector<NamedShard> shards;
  for (model::Parameter& p : stage_->parameters().parameters()) {
    NamedShard shard;
    shard.name = p.spec.name;
    shard.value = p.value;
    shard.full_shape = p.spec.full_shape;
    if (!p.spec.shard.replicated) {
      shard.split_dim = p.spec.shard.dim;
      shard.qkv = p.spec.shard.outer == 3 && p.spec.shard.dim == 0;  // ShardSpec::QkvRows
    }
    shard.tied_copy = p.spec.name == model::TokenEmbeddingName(config_.model) && !config_.is_first();
    shards.push_back(std::move(shard));
  }
  return shards;
}

namespace {

// Host <-> store copies ordered on the stage's stream (after the optimizer
// step it enqueued), then waited for. On the host a plain memcpy.
void EnqueueToHost(const kernels::ExecContext& ctx, const Tensor& t, std::vector<float>* out) {
  out->resize(static_cast<size_t>(t.numel()));
  if (t.device().is_cpu()) {
    std::memcpy(out->data(), t.f32(), t.bytes());
    return;
  }
  kernels::Copy(ctx, Tensor::View(out->data(), {t.numel()}), t);
}

void EnqueueFromHost(const kernels::ExecContext& ctx, const std::vector<float>& from, const Tensor& to) {
  if (from.empty()) return;
  if (to.device().is_cpu()) {
    std::memcpy(to.f32(), from.data(), sizeof(float) * from.size());
    return;
  }
  kernels::Copy(ctx, to, Tensor::View(const_cast<float*>(from.data()), {to.numel()}));
}

}  // namespace

ChunkState GptStageModel::CaptureState() const {
  const model::ParameterStore& params = stage_->parameters();
  const kernels::ExecContext& ctx = stage_->context();
  ChunkState state;
  state.optimizer_step = stage_->optimizer_step();
  EnqueueToHost(ctx, params.values(), &state.values);
  EnqueueToHost(ctx, params.adam_m(), &state.adam_m);
  EnqueueToHost(ctx, params.adam_v(), &state.adam_v);
  if (absl::Status s = stage_->stream().Synchronize(); !s.ok()) {
    // A device that failed cannot give its state; a negative step marks the
    // capture invalid, and every consumer (RestoreState, the checkpoint
    // writer, the encoder's reader) refuses it.
    BATON_LOG(ERROR) << "model chunk " << config_.pp_rank << ": capturing state failed: " << s.message();
    return ChunkState{-1, {}, {}, {}};
  }
  return state;
}

absl::Status GptStageModel::RestoreState(const ChunkState& state) {
  const model::ParameterStore& params = stage_->parameters();
  const int64_t n = params.values().numel();
  const int64_t moments = params.adam_m().numel();  // n, or the DP shard's count
  const struct {
    const char* what;
    size_t size;
    int64_t want;
  } parts[] = {{"values", state.values.size(), n},
               {"adam_m", state.adam_m.size(), moments},
               {"adam_v", state.adam_v.size(), moments}};
  for (const auto& part : parts) {
    if (part.size != static_cast<size_t>(part.want)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "restoring model chunk ", config_.pp_rank, " tp rank ", config_.tp_rank, " of ",
          config_.tp_size, ": state has ", part.size, " ", part.what, ", the chunk holds ", part.want,
          "; the state was captured from another layout or model"));
    }
  }
  if (state.optimizer_step < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "restoring model chunk ", config_.pp_rank, ": optimizer_step ", state.optimizer_step,
        " is negative"));
  }
  stage_->DropInFlight();
  stage_->ZeroGrad();
  const kernels::ExecContext& ctx = stage_->context();
  EnqueueFromHost(ctx, state.values, params.values());
  EnqueueFromHost(ctx, state.adam_m, params.adam_m());
  EnqueueFromHost(ctx, state.adam_v, params.adam_v());
  stage_->RefreshBf16Weights();
  // `state` must outlive the copies.
  BATON_RETURN_IF_ERROR_CTX(stage_->stream().Synchronize(), "restoring model chunk ", config_.pp_rank);
  stage_->set_optimizer_step(state.optimizer_step);
  return absl::OkStatus();
}

DpShardBuffers GptStageModel::DpShard() {
  const model::ParameterStore& params = stage_->parameters();
  if (!params.dp_shard().sharded()) return {};
  return DpShardBuffers{params.padded_grads(), params.shard_grads(), params.padded_values(), params.shard_values()};
}

absl::StatusOr<ChunkState> GptStageModel::CaptureFullState(comm::Communicator* dp, absl::Duration timeout) {
  const model::ParameterStore& params = stage_->parameters();
  const model::DpShard& shard = params.dp_shard();
  if (!shard.sharded()) return CaptureState();
  if (dp == nullptr || dp->size() != shard.size || dp->rank() != shard.rank) {
    return absl::FailedPreconditionError(absl::StrCat(
        "model chunk ", config_.pp_rank, ": its optimizer state is sharded over ", shard.size,
        " data-parallel ranks, but no data-parallel group of that size holds this rank ", shard.rank));
  }
  ChunkState state = CaptureState();
  if (state.optimizer_step < 0) {
    return absl::InternalError(absl::StrCat("model chunk ", config_.pp_rank, ": capturing its state failed"));
  }
  // Every rank's moment shard, gathered on the chunk's device, then to the
  // host; the padding is dropped.
  const std::string what = absl::StrCat("gathering the AdamW moments of chunk ", config_.pp_rank,
                                        " over the data-parallel group");
  absl::StatusOr<Tensor> gathered = kernels::ZerosOn(params.device(), {shard.padded()});
  if (!gathered.ok()) return WithContext(gathered.status(), what);
  std::vector<float>* parts[2] = {&state.adam_m, &state.adam_v};
  const Tensor* moments[2] = {&params.adam_m(), &params.adam_v()};
  for (int i = 0; i < 2; ++i) {
    BATON_RETURN_IF_ERROR_CTX(dp->AllGather(model::CommBuffer(*moments[i]), model::CommBuffer(*gathered))->Wait(timeout),
                              what);
    BATON_ASSIGN_OR_RETURN(std::vector<float> full, model::ParameterStore::ToHost(*gathered));
    full.resize(static_cast<size_t>(shard.elements));
    *parts[i] = std::move(full);
  }
  return state;
}

absl::StatusOr<GatheredExperts> GptStageModel::GatherExperts(comm::Communicator* ep, absl::Duration timeout,
                                                             ChunkState state) {
  const int64_t tail = stage_->expert_elements();
  if (tail == 0 || ep == nullptr || ep->size() != config_.ep_size || ep->rank() != config_.ep_rank) {
    return absl::FailedPreconditionError(absl::StrCat(
        "model chunk ", config_.pp_rank, ": gathering experts needs parallel.ep > 1 and the chunk's expert group of ",
        config_.ep_size, " ranks (this one ", config_.ep_rank, ")"));
  }
  const model::ParameterStore& params = stage_->parameters();
  const int64_t n = params.values().numel(), dense = n - tail, ep_size = config_.ep_size;
  if (state.optimizer_step < 0 || state.values.size() != static_cast<size_t>(n)) {
    return absl::InvalidArgumentError(absl::StrCat("model chunk ", config_.pp_rank, ": gathering experts needs the ",
                                                   "chunk's whole state (", n, " values), got ", state.values.size()));
  }
  GatheredExperts out;
  out.state = std::move(state);
  const std::string what =
      absl::StrCat("gathering the experts of chunk ", config_.pp_rank, " over the expert-parallel group");
  // Through the chunk's device, as a device communicator needs.
  absl::StatusOr<Tensor> mine = kernels::ZerosOn(params.device(), {tail});
  absl::StatusOr<Tensor> gathered = kernels::ZerosOn(params.device(), {ep_size * tail});
  if (!mine.ok()) return WithContext(mine.status(), what);
  if (!gathered.ok()) return WithContext(gathered.status(), what);
  for (std::vector<float>* part : {&out.state.values, &out.state.adam_m, &out.state.adam_v}) {
    if (part->empty()) continue;  // weights only
    if (part->size() != static_cast<size_t>(n)) {
      return absl::InvalidArgumentError(absl::StrCat("model chunk ", config_.pp_rank, ": gathering experts needs ",
                                                     "whole moments (", n, "), got ", part->size()));
    }
    const std::vector<float> own(part->begin() + dense, part->end());
    EnqueueFromHost(stage_->context(), own, *mine);
    BATON_RETURN_IF_ERROR_CTX(stage_->stream().Synchronize(), what);
    BATON_RETURN_IF_ERROR_CTX(ep->AllGather(model::CommBuffer(*mine), model::CommBuffer(*gathered))->Wait(timeout), what);
    BATON_ASSIGN_OR_RETURN(std::vector<float> all, model::ParameterStore::ToHost(*gathered));
    part->resize(static_cast<size_t>(dense));
    part->insert(part->end(), all.begin(), all.end());
  }
  // The dense tensors as this rank names them, then each rank's experts:
  // this rank's expert tensors (same shapes on every rank) under the names
  // that rank gives them.
  std::vector<NamedShard> own = Shards();
  size_t first_expert = 0;
  while (first_expert < own.size() && !params.parameters()[first_expert].spec.expert) ++first_expert;
  for (size_t i = 0; i < first_expert; ++i) {
    own[i].value = Tensor::View(out.state.values.data() + params.parameters()[i].offset, own[i].value.shape());
    out.shards.push_back(own[i]);
  }
  int64_t offset = dense;
  for (int r = 0; r < ep_size; ++r) {
    model::StageConfig other = config_;
    other.ep_rank = r;
    std::vector<model::ParameterSpec> names = model::StageParameterSpecs(other);
    for (size_t i = first_expert; i < own.size(); ++i) {
      NamedShard s = own[i];
      s.name = names[i].name;
      s.value = Tensor::View(out.state.values.data() + offset, own[i].value.shape());
      offset += s.value.numel();
      out.shards.push_back(std::move(s));
    }
  }
  return out;
}

absl::Status GptStageModel::RestoreFullState(const ChunkState& state) {
  const model::DpShard& shard = stage_->parameters().dp_shard();
  if (!shard.sharded()) return RestoreState(state);
  const size_t n = static_cast<size_t>(shard.elements);
  if (state.values.size() != n || state.adam_m.size() != n || state.adam_v.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "restoring model chunk ", config_.pp_rank, " tp rank ", config_.tp_rank, ": the state has ",
        state.values.size(), " values and ", state.adam_m.size(), " + ", state.adam_v.size(),
        " moments, the chunk holds ", n, "; it is from another layout or model"));
  }
  // This rank's part of the moments; the padding past the last value is zero.
  ChunkState mine;
  mine.optimizer_step = state.optimizer_step;
  mine.values = state.values;
  for (auto [from, to] : {std::pair{&state.adam_m, &mine.adam_m}, std::pair{&state.adam_v, &mine.adam_v}}) {
    to->assign(static_cast<size_t>(shard.count), 0.0f);
    const int64_t end = std::min(shard.begin + shard.count, shard.elements);
    for (int64_t i = shard.begin; i < end; ++i) (*to)[static_cast<size_t>(i - shard.begin)] = (*from)[static_cast<size_t>(i)];
  }
  return RestoreState(mine);
}

}  // namespace baton
