#include "worker/model/inproc_model.h"

#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/grad_norm.h"

namespace baton::model {

using kernels::Tensor;

absl::StatusOr<std::unique_ptr<InProcModel>> InProcModel::Create(const GptConfig& model, int pp,
                                                                 int tp, uint64_t seed,
                                                                 int microbatches,
                                                                 bool vocab_parallel,
                                                                 kernels::Device device,
                                                                 kernels::Precision precision,
                                                                 bool sequence_parallel) {
  auto m = std::unique_ptr<InProcModel>(new InProcModel());
  m->device_ = device;
  m->pp_ = pp;
  m->tp_ = tp;
  m->model_ = model;
  m->stages_.resize(pp);
  for (int s = 0; s < pp; ++s) {
    m->tp_groups_.push_back(comm::InProcCommunicator::CreateGroup(tp));
    for (int r = 0; r < tp; ++r) {
      BATON_ASSIGN_OR_RETURN(StageConfig config, MakeStageConfig(model, s, pp, r, tp, seed));
      config.microbatches = microbatches;
      config.vocab_parallel = vocab_parallel;
      config.sequence_parallel = sequence_parallel;
      config.comm_timeout = absl::Seconds(60);
      config.device = device;
      config.precision = precision;
      BATON_ASSIGN_OR_RETURN(auto stage, GptStage::Create(config, m->tp_groups_[s][r].get()));
      m->stages_[s].push_back(std::move(stage));
    }
    m->ready_.emplace_back();
    for (int r = 0; r < tp; ++r) {
      BATON_ASSIGN_OR_RETURN(auto event, kernels::Event::Create(device));
      m->ready_[s].push_back(std::move(event));
    }
  }
  if (pp > 1) {
    for (int r = 0; r < tp; ++r) m->tie_groups_.push_back(comm::InProcCommunicator::CreateGroup(2));
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

absl::Status InProcModel::RunRank(int r, const std::vector<Tensor>& tokens,
                                  const std::vector<Tensor>& targets) {
  const int mbs = static_cast<int>(tokens.size());
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
  std::vector<absl::Status> status(tp_);
  std::vector<std::thread> threads;
  for (int r = 0; r < tp_; ++r) {
    threads.emplace_back([&, r] {
      status[r] = RunRank(r, tokens, targets);
      if (!status[r].ok()) {
        // Unblock the other ranks waiting in collectives with this one.
        for (auto& group : tp_groups_) group[r]->Abort(status[r].message());
        for (int s = 0; s < pp_; ++s) stages_[s][r]->DropInFlight();
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (const absl::Status& s : status) BATON_RETURN_IF_ERROR(s);
  return stages_[pp_ - 1][0]->MeanLoss();
}

double InProcModel::GlobalGradSqNorm() const {
  double sum = 0.0;
  for (const auto& row : stages_) {
    for (const auto& stage : row) sum += stage->LocalGradSqNorm();
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
