// InProcModel: one GPT model laid out as pp pipeline stages × tp tensor-
// parallel ranks inside one process — one thread per TP rank, in-process
// communicators for the TP groups and the tied-embedding pairs. It runs a
// GPipe-ordered step (all forwards, then BackwardInput last stage first, then
// the deferred BackwardWeights) and gathers full gradients from the shards.
// For golden checks, layout-equivalence tests and benchmarks; the real
// runtime drives GptStage from the worker executor instead.
#ifndef BATON_WORKER_MODEL_INPROC_MODEL_H_
#define BATON_WORKER_MODEL_INPROC_MODEL_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/ops.h"
#include "kernels/tensor.h"
#include "worker/comm/inproc_communicator.h"
#include "worker/model/gpt_config.h"
#include "worker/model/gpt_stage.h"

namespace baton::model {

class InProcModel {
 public:
  // `vocab_parallel`: see StageConfig::vocab_parallel. `device`: where every
  // stage runs (StageConfig::device); stages hand activations and gradients
  // to each other through events between their streams. `precision`: see
  // StageConfig::precision (bf16: the stages exchange bf16 activations).
  // `sequence_parallel`: see StageConfig::sequence_parallel. `cp`: context
  // parallelism (StageConfig::cp_size): cp x tp threads ("lanes", lane = cp
  // rank · tp + tp rank), each slicing its view of every microbatch; the
  // gradients are averaged over the cp ranks after the backward.
  static absl::StatusOr<std::unique_ptr<InProcModel>> Create(
      const GptConfig& model, int pp, int tp, uint64_t seed, int microbatches, bool vocab_parallel,
      kernels::Device device = kernels::Device::Cpu(),
      kernels::Precision precision = kernels::Precision::kFloat32, bool sequence_parallel = false, int cp = 1);

  // Sets parameter `name` on every stage and rank that holds it.
  absl::Status SetParameter(const std::string& name, absl::Span<const float> full);

  // Zeroes gradients, runs every microbatch (tokens[i], targets[i]: int32
  // [B, T]) forward and backward, sums the tied embedding gradient copies,
  // and returns the mean loss.
  absl::StatusOr<double> ForwardBackward(const std::vector<kernels::Tensor>& tokens,
                                         const std::vector<kernels::Tensor>& targets);
  // MoE: the load-balancing losses of the last ForwardBackward as they enter
  // its objective: summed over the MoE blocks, averaged over the
  // microbatches (lane 0's stages; every TP rank routes alike). 0 for a
  // dense model.
  double LastAuxLoss() const;
  // Global squared gradient norm (sum of every rank's share).
  double GlobalGradSqNorm() const;
  // Clips to `max_grad_norm` (0 = off) and takes one AdamW step everywhere.
  absl::Status OptimizerStep(const kernels::AdamWConfig& config, double max_grad_norm);

  // Every parameter name once, in model order.
  std::vector<std::string> ParameterNames() const;
  // Full (unsharded) value or gradient, gathered from the TP shards of the
  // first stage that holds `name` (waits for its streams). NOT_FOUND when no
  // stage holds `name`; a failed wait or device copy is an error naming the
  // parameter and the rank.
  absl::StatusOr<std::vector<float>> FullValue(const std::string& name) const;
  absl::StatusOr<std::vector<float>> FullGrad(const std::string& name) const;

  GptStage& stage(int pp_rank, int tp_rank) { return *stages_[pp_rank][tp_rank]; }

 private:
  InProcModel() = default;
  absl::StatusOr<std::vector<float>> Gather(const std::string& name, bool grad) const;
  absl::Status RunRank(int tp_rank, const std::vector<kernels::Tensor>& tokens,
                       const std::vector<kernels::Tensor>& targets);

  int pp_ = 1, tp_ = 1, cp_ = 1, microbatches_ = 1;
  GptConfig model_;
  kernels::Device device_;
  // [pp][lane]: recorded on a stage's stream after it produced an output.
  std::vector<std::vector<std::unique_ptr<kernels::Event>>> ready_;
  // [pp][lane] stages; tp_groups_[pp · cp + cp rank] the TP group of a
  // stage; cp_groups_[pp · tp + tp rank] its CP ring (cp > 1);
  // tie_groups_[lane] the (first, last) stage pair of a lane.
  std::vector<std::vector<std::unique_ptr<GptStage>>> stages_;
  std::vector<std::vector<std::unique_ptr<comm::InProcCommunicator>>> tp_groups_;
  std::vector<std::vector<std::unique_ptr<comm::InProcCommunicator>>> tie_groups_;
  std::vector<std::vector<std::unique_ptr<comm::InProcCommunicator>>> cp_groups_;
};

}  // namespace baton::model

#endif  // BATON_WORKER_MODEL_INPROC_MODEL_H_
