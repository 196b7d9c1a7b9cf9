// SyntheticStage: the synthetic cost model (`model { synthetic { forward_ms
// backward_input_ms backward_weight_ms activation_bytes } }`) behind the
// StageModel interface, so schedules and the runtime can be measured at any
// scale without the math.
//
// Each op waits on a steady clock for its configured time (sleeping, then
// spinning the last 300 us, so that many workers on few cores do not compete
// for CPU and wake-up latency does not blur bubble measurements) and passes
// float activations and gradients of
// activation_bytes / 4 elements (whatever train.precision says: the cost
// model's message size is activation_bytes as configured, so a bf16 job is
// modelled by halving activation_bytes). Their contents check the transfers end to
// end, per microbatch mb of a pipeline of S chunks:
//   - chunk c's output activations all hold mb·S + c + 1 (chunk 0 writes
//     mb·S + 1, every later chunk its input + 1), so chunk c expects mb·S + c;
//   - the last chunk's input gradient all holds mb·S + 1, every earlier
//     chunk's its output gradient + 1, so chunk c expects mb·S + S − 1 − c.
// A value that does not match is an INTERNAL error naming the chunk, the
// microbatch and the element (a lost, stale, misrouted or corrupted message).
// The fill and the check run inside the op's time budget.
//
// Parameters: one replicated "synthetic.<chunk>.weight" [1024] with a
// gradient of 1024 floats, so data-parallel all-reduce, grad-norm and the
// optimizer run as with a real model: each BackwardWeight adds 1e-3 · (i % 7 +
// 1) to gradient element i, and OptimizerStep does weight −= 0.01 · scale ·
// grad. score() is always zero. Its ChunkState is the weight and the
// count of optimizer steps (no moments).
//
// Not thread-safe: one thread drives a worker's stages.
#ifndef BATON_WORKER_SYNTHETIC_STAGE_H_
#define BATON_WORKER_SYNTHETIC_STAGE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "baton/v1/job.pb.h"
#include "kernels/tensor.h"
#include "worker/stage_model.h"

namespace baton {

inline constexpr int64_t kSyntheticGradElements = 1024;

class SyntheticStage : public StageModel {
 public:
  // Chunk `chunk` of `num_chunks` (pipeline ranks × virtual stages). Errors
  // name the field: negative times, activation_bytes below 4 (one float).
  static absl::StatusOr<std::unique_ptr<SyntheticStage>> Create(const v1::SyntheticCost& cost,
                                                                int chunk, int num_chunks);

  int64_t activation_elements() const override { return elements_; }
  absl::Status Forward(int mb, const MicrobatchData& data, const kernels::Tensor& input,
                       const kernels::Tensor& output) override;
  absl::Status BackwardInput(int mb, const kernels::Tensor& grad_output,
                             const kernels::Tensor& grad_input) override;
  absl::Status BackwardWeight(int mb) override;
  void ZeroGrad() override;
  void DropInFlight() override { in_flight_.clear(); }
  kernels::Tensor Gradients() override { return grad_; }
  double LocalGradSqNorm() const override;
  absl::Status SyncTiedGradients() override { return absl::OkStatus(); }
  absl::Status OptimizerStep(float grad_scale) override;
  model::StepScore score() const override { return model::StepScore(); }
  std::vector<NamedShard> Shards() override;
  ChunkState CaptureState() const override;
  absl::Status RestoreState(const ChunkState& state) override;

 private:
  enum class Phase { kForwardDone, kBackwardInputDone };

  SyntheticStage(const v1::SyntheticCost& cost, int chunk, int num_chunks);
  bool is_first() const { return chunk_ == 0; }
  bool is_last() const { return chunk_ == num_chunks_ - 1; }
  // Checks that `t` has activation_elements() floats all equal to `want`.
  absl::Status Expect(const kernels::Tensor& t, const char* what, int mb, float want) const;

  absl::Duration forward_, backward_input_, backward_weight_;
  int64_t elements_;
  int chunk_, num_chunks_;
  kernels::Tensor weight_, grad_;
  int64_t optimizer_step_ = 0;
  absl::flat_hash_map<int, Phase> in_flight_;
};

}  // namespace baton

#endif  // BATON_WORKER_SYNTHETIC_STAGE_H_
