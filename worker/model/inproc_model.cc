#include "worker/model/inproc_model.h"

#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/grad_norm.h"
#include "worker/model/comm_buffer.h"
#include "worker/model/context_parallel.h"

namespace baton::model {

using kernels::Tensor;

absl::StatusOr<std::unique_ptr<InProcModel>> InProcModel::Create(const GptConfig& model, int pp,
                                                                 int tp, uint64_t seed,
                                                                 int microbatches,
                                                                 bool vocab_parallel,
                                                                 kernels::Device device,
                                                                 kernels::Precision precision,
                                                                 bool sequence_parallel, int cp) {
  if (cp < 1) return absl::InvalidArgumentError(absl::StrCat("parallel.cp = ", cp, ": must be positive"));
  auto m = std::unique_ptr<InProcModel>(new InProcModel());
  m->device_ = device;
  m->pp_ = pp;
  m->tp_ = tp;
  m->cp_ = cp;
  m->microbatches_ = microbatches;
  m->model_ = model;
  m->stages_.resize(pp);
  const int lanes = cp * tp;
  for (int s = 0; s < pp; ++s) {
    for (int c = 0; c < cp; ++c) m->tp_groups_.push_back(comm::InProcCommunicator::CreateGroup(tp));
    if (cp > 1) {
      for (int t = 0; t < tp; ++t) m->cp_groups_.push_back(comm::InProcCommunicator::CreateGroup(cp));
    }
    for (int lane = 0; lane < lanes; ++lane) {
      const int c = lane / tp, r = lane % tp;
      BATON_ASSIGN_OR_RETURN(StageConfig config, MakeStageConfig(model, s, pp, r, tp, seed));
      config.microbatches = microbatches;
      config.vocab_parallel = vocab_parallel;
      config.sequence_parallel = sequence_parallel;
      config.cp_rank = c;
      config.cp_size = cp;
      config.comm_timeout = absl::Seconds(60);
      config.device = device;
      config.precision = precision;
      BATON_ASSIGN_OR_RETURN(auto stage, GptStage::Create(config, m->tp_groups_[s * cp + c][r].get(),
                                                          cp > 1 ? m->cp_groups_[s * tp + r][c].get() : nullptr));
      m->stages_[s].push_back(std::move(stage));
    }
    m->ready_.emplace_back();
    for (int lane = 0; lane < lanes; ++lane) {
      BATON_ASSIGN_OR_RETURN(auto event, kernels::Event::Create(device));
      m->ready_[s].push_back(std::move(event));
    }
  }
  if (pp > 1) {
    for (int lane = 0; lane < lanes; ++lane) m->tie_groups_.push_back(comm::InProcCommunicator::CreateGroup(2));
  }
  return m;
}

absl::Status InProcModel::SetParameter(const std::string& name, absl::Span<const float> full) {
  bool found = false;
  for (auto& row : stages_) {
    for (auto& stage : row) {
      if (stage->parameters().Find(name) == nullptr) continue;
      BATON_RETURN_IF_ERROR(stage->parameters().SetFull(name, full));
      stage->RefreshBf16Weights();
      found = true;
    }
  }
  if (!found) return absl::NotFoundError(absl::StrCat("no stage holds parameter ", name));
  return absl::OkStatus();
}

absl::Status InProcModel::RunRank(int r, const std::vector<Tensor>& whole_tokens,
                                  const std::vector<Tensor>& whole_targets) {
  const int mbs = static_cast<int>(whole_tokens.size());
  const int cr = r / tp_;  // this lane's cp rank
  // Under CP the lane's view of every microbatch (context_parallel.h).
  std::vector<Tensor> tokens = whole_tokens, targets = whole_targets;
  if (cp_ > 1) {
    for (int mb = 0; mb < mbs; ++mb) {
      const int64_t batch = whole_tokens[mb].dim(0), seq = whole_tokens[mb].dim(1);
      if (seq % (2 * cp_) != 0) {
        return absl::InvalidArgumentError(absl::StrCat("sequences of ", seq, " tokens do not split into 2 * cp = ",
                                                       2 * cp_, " chunks"));
      }
      tokens[mb] = Tensor::Zeros({2 * batch, seq / (2 * cp_)}, kernels::DType::kInt32);
      targets[mb] = Tensor::Zeros({2 * batch, seq / (2 * cp_)}, kernels::DType::kInt32);
      SliceForContextParallel(whole_tokens[mb].i32(), batch, seq, cr, cp_, tokens[mb].i32());
      SliceForContextParallel(whole_targets[mb].i32(), batch, seq, cr, cp_, targets[mb].i32());
    }
  }
  const int64_t b = tokens[0].dim(0), t = tokens[0].dim(1), c = model_.d_model;
  // acts[mb][s]: output of stage s; grads[mb][s]: gradient of stage s's input.
  std::vector<std::vector<Tensor>> acts(mbs), grads(mbs);
  for (int mb = 0; mb < mbs; ++mb) {
    for (int s = 0; s < pp_; ++s) {
      const kernels::DType dtype = stages_[s][r]->activation_dtype();  // the pipeline messages
      BATON_ASSIGN_OR_RETURN(Tensor act, kernels::ZerosOn(device_, {b, t, c}, dtype));
      BATON_ASSIGN_OR_RETURN(Tensor grad, kernels::ZerosOn(device_, {b, t, c}, dtype));
      acts[mb].push_back(act);
      grads[mb].push_back(grad);
    }
  }
  // Stage `to` may read what stage `from` has enqueued so far.
  auto handoff = [&](int from, int to) -> absl::Status {
    BATON_RETURN_IF_ERROR(ready_[from][r]->Record(stages_[from][r]->stream()));
    return ready_[from][r]->StreamWait(stages_[to][r]->stream());
  };
  for (int mb = 0; mb < mbs; ++mb) {
    for (int s = 0; s < pp_; ++s) {
      StageInputs in;
      in.tokens = tokens[mb];
      in.targets = targets[mb];
      if (s > 0) {
        in.activations = acts[mb][s - 1];
        BATON_RETURN_IF_ERROR(handoff(s - 1, s));
      }
      BATON_RETURN_IF_ERROR(stages_[s][r]->Forward(mb, in, acts[mb][s]));
    }
  }
  for (int mb = 0; mb < mbs; ++mb) {
    for (int s = pp_ - 1; s >= 0; --s) {
      const Tensor grad_out = s + 1 < pp_ ? grads[mb][s + 1] : Tensor();
      if (s + 1 < pp_) BATON_RETURN_IF_ERROR(handoff(s + 1, s));
      BATON_RETURN_IF_ERROR(stages_[s][r]->BackwardInput(mb, grad_out, grads[mb][s]));
    }
  }
  for (int mb = 0; mb < mbs; ++mb) {
    for (int s = pp_ - 1; s >= 0; --s) BATON_RETURN_IF_ERROR(stages_[s][r]->BackwardWeight(mb));
  }
  if (pp_ > 1 && model_.tie_embeddings) {
    absl::Status first_status;
    std::thread first(
        [&] { first_status = stages_[0][r]->SyncTiedEmbeddingGrad(*tie_groups_[r][0]); });
    const absl::Status last_status = stages_[pp_ - 1][r]->SyncTiedEmbeddingGrad(*tie_groups_[r][1]);
    first.join();
    BATON_RETURN_IF_ERROR(first_status);
    BATON_RETURN_IF_ERROR(last_status);
  }
  if (cp_ > 1) {
    // The cp ranks' gradients averaged, as the executor does over dp x cp.
    for (int s = 0; s < pp_; ++s) {
      GptStage& stage = *stages_[s][r];
      BATON_RETURN_IF_ERROR(stage.stream().Synchronize());
      const Tensor g = stage.parameters().grads();
      BATON_RETURN_IF_ERROR(cp_groups_[s * tp_ + r % tp_][cr]->AllReduceSum(CommBuffer(g))->Wait(absl::Seconds(60)));
      kernels::Scale(stage.context(), g, 1.0f / static_cast<float>(cp_));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<double> InProcModel::ForwardBackward(const std::vector<Tensor>& tokens,
                                                    const std::vector<Tensor>& targets) {
  if (tokens.empty() || tokens.size() != targets.size()) {
    return absl::InvalidArgumentError("ForwardBackward: want as many targets as token batches");
  }
  for (auto& row : stages_) {
    for (auto& stage : row) stage->ZeroGrad();
  }
  const int lanes = cp_ * tp_;
  std::vector<absl::Status> status(lanes);
  std::vector<std::thread> threads;
  for (int r = 0; r < lanes; ++r) {
    threads.emplace_back([&, r] {
      status[r] = RunRank(r, tokens, targets);
      if (!status[r].ok()) {
        // Unblock the other ranks waiting in collectives with this one.
        for (int s = 0; s < pp_; ++s) {
          tp_groups_[s * cp_ + r / tp_][r % tp_]->Abort(status[r].message());
          if (cp_ > 1) cp_groups_[s * tp_ + r % tp_][r / tp_]->Abort(status[r].message());
          stages_[s][r]->DropInFlight();
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (const absl::Status& s : status) BATON_RETURN_IF_ERROR(s);
  if (cp_ == 1) return stages_[pp_ - 1][0]->MeanLoss();
  // The cp ranks' losses over all their scored tokens.
  double loss_sum = 0.0;
  int64_t scored = 0;
  for (int c = 0; c < cp_; ++c) {
    const StepScore score = stages_[pp_ - 1][c * tp_]->score();
    loss_sum += score.loss_sum;
    scored += score.tokens;
  }
  return scored == 0 ? 0.0 : loss_sum / static_cast<double>(scored);
}

double InProcModel::LastAuxLoss() const {
  double sum = 0.0;
  for (const auto& row : stages_) sum += row[0]->MoeAuxLossSum();
  return sum / static_cast<double>(microbatches_);
}

double InProcModel::GlobalGradSqNorm() const {
  double sum = 0.0;
  for (const auto& row : stages_) {
    // The cp ranks hold the same averaged gradients: cp rank 0's lanes count.
    for (int r = 0; r < tp_; ++r) sum += row[r]->LocalGradSqNorm();
  }
  return sum;
}

absl::Status InProcModel::OptimizerStep(const kernels::AdamWConfig& config, double max_grad_norm) {
  const float clip = kernels::cpu::ClipFactor(GlobalGradSqNorm(), max_grad_norm);
  for (auto& row : stages_) {
    for (auto& stage : row) BATON_RETURN_IF_ERROR(stage->OptimizerStep(config, clip));
  }
  return absl::OkStatus();
}

std::vector<std::string> InProcModel::ParameterNames() const {
  std::vector<std::string> names;
  for (const auto& row : stages_) {
    for (const Parameter& p : row[0]->parameters().parameters()) {
      if (std::find(names.begin(), names.end(), p.spec.name) == names.end()) {
        names.push_back(p.spec.name);
      }
    }
  }
  return names;
}

absl::StatusOr<std::vector<float>> InProcModel::Gather(const std::string& name, bool grad) const {
  const char* what = grad ? "gradient" : "value";
  for (const auto& row : stages_) {
    if (row[0]->parameters().Find(name) == nullptr) continue;
    std::vector<float> full;
    for (int r = 0; r < tp_; ++r) {
      const Parameter* p = row[r]->parameters().Find(name);
      const std::string context = absl::StrCat("gathering the ", what, " of ", name, " from tp rank ", r);
      BATON_RETURN_IF_ERROR_CTX(row[r]->stream().Synchronize(), context);
      absl::StatusOr<std::vector<float>> local = ParameterStore::ToHost(grad ? p->grad : p->value);
      if (!local.ok()) return WithContext(local.status(), context);
      if (full.empty()) full.resize(kernels::NumElements(p->spec.full_shape));
      InsertShard(p->spec.shard, r, tp_, local->data(), full.data());
    }
    return full;
  }
  return absl::NotFoundError(absl::StrCat("no stage holds a parameter named \"", name, "\""));
}

absl::StatusOr<std::vector<float>> InProcModel::FullValue(const std::string& name) const {
  return Gather(name, /*grad=*/false);
}

absl::StatusOr<std::vector<float>> InProcModel::FullGrad(const std::string& name) const {
  return Gather(name, /*grad=*/true);
}

}  // namespace baton::model
