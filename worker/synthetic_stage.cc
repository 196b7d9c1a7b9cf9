#include "worker/synthetic_stage.h"

#include <chrono>
#include <thread>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace baton {
namespace {

using kernels::Tensor;

// Waits until `budget` has passed since `start` (steady clock): sleeps until
// shortly before the deadline, then spins the rest. Sleeping keeps many
// worker processes on few cores from competing for CPU (which would delay the
// ones whose op has ended); the short spin absorbs the sleep's wake-up latency.
void WaitUntil(std::chrono::steady_clock::time_point start, absl::Duration budget) {
  const auto deadline = start + absl::ToChronoNanoseconds(budget);
  const auto spin_from = deadline - std::chrono::microseconds(300);
  if (std::chrono::steady_clock::now() < spin_from) std::this_thread::sleep_until(spin_from);
  while (std::chrono::steady_clock::now() < deadline) {
  }
}

void FillWith(const Tensor& t, float value) {
  float* p = t.f32();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = value;
}

}  // namespace

absl::StatusOr<std::unique_ptr<SyntheticStage>> SyntheticStage::Create(
    const v1::SyntheticCost& cost, int chunk, int num_chunks) {
  const struct {
    const char* field;
    double ms;
  } times[] = {{"forward_ms", cost.forward_ms()},
               {"backward_input_ms", cost.backward_input_ms()},
               {"backward_weight_ms", cost.backward_weight_ms()}};
  for (const auto& t : times) {
    if (!(t.ms >= 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("model.synthetic.", t.field, " = ", t.ms, ": must be zero or positive"));
    }
  }
  if (cost.activation_bytes() < 4) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.synthetic.activation_bytes = ", cost.activation_bytes(),
                     ": must be at least 4 (one float per microbatch)"));
  }
  if (num_chunks <= 0 || chunk < 0 || chunk >= num_chunks) {
    return absl::InvalidArgumentError(
        absl::StrCat("synthetic stage: chunk ", chunk, " is outside [0, ", num_chunks, ")"));
  }
  return std::unique_ptr<SyntheticStage>(new SyntheticStage(cost, chunk, num_chunks));
}

SyntheticStage::SyntheticStage(const v1::SyntheticCost& cost, int chunk, int num_chunks)
    : forward_(absl::Milliseconds(cost.forward_ms())),
      backward_input_(absl::Milliseconds(cost.backward_input_ms())),
      backward_weight_(absl::Milliseconds(cost.backward_weight_ms())),
      elements_(cost.activation_bytes() / 4),
      chunk_(chunk),
      num_chunks_(num_chunks),
      weight_(Tensor::Zeros({kSyntheticGradElements})),
      grad_(Tensor::Zeros({kSyntheticGradElements})) {}

absl::Status SyntheticStage::Expect(const Tensor& t, const char* what, int mb, float want) const {
  if (!t.defined() || t.dtype() != kernels::DType::kFloat32 || t.numel() != elements_) {
    return absl::InvalidArgumentError(absl::StrCat("synthetic chunk ", chunk_, ", microbatch ",
                                                   mb, ": ", what, ": want ", elements_,
                                                   " floats (activation_bytes / 4)"));
  }
  const float* p = t.f32();
  for (int64_t i = 0; i < elements_; ++i) {
    if (p[i] != want) {
      return absl::InternalError(absl::StrCat(
          "synthetic chunk ", chunk_, ", microbatch ", mb, ": ", what, "[", i, "] = ", p[i],
          ", expected ", want, ": the transfer from the neighbouring chunk lost, misrouted or "
          "corrupted data"));
    }
  }
  return absl::OkStatus();
}

absl::Status SyntheticStage::Forward(int mb, const MicrobatchData& /*data*/, const Tensor& input,
                                     const Tensor& output) {
  const auto start = std::chrono::steady_clock::now();
  if (in_flight_.contains(mb)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "Forward(", mb, "): microbatch already run forward and not yet backward"));
  }
  const float base = static_cast<float>(mb) * static_cast<float>(num_chunks_);
  if (!is_first()) {
    if (absl::Status s = Expect(input, "input activations", mb, base + chunk_); !s.ok()) return s;
  }
  if (!is_last()) {
    if (!output.defined() || output.numel() != elements_) {
      return absl::InvalidArgumentError(absl::StrCat("Forward(", mb, "): output: want ",
                                                     elements_, " floats"));
    }
    FillWith(output, base + chunk_ + 1);
  }
  in_flight_[mb] = Phase::kForwardDone;
  WaitUntil(start, forward_);
  return absl::OkStatus();
}

absl::Status SyntheticStage::BackwardInput(int mb, const Tensor& grad_output,
                                           const Tensor& grad_input) {
  const auto start = std::chrono::steady_clock::now();
  auto it = in_flight_.find(mb);
  if (it == in_flight_.end() || it->second != Phase::kForwardDone) {
    return absl::FailedPreconditionError(absl::StrCat(
        "BackwardInput(", mb, "): microbatch has not run forward, or already ran backward"));
  }
  const float base = static_cast<float>(mb) * static_cast<float>(num_chunks_);
  if (!is_last()) {
    if (absl::Status s =
            Expect(grad_output, "output gradient", mb, base + (num_chunks_ - 1 - chunk_));
        !s.ok()) {
      return s;
    }
  }
  if (!is_first()) {
    if (!grad_input.defined() || grad_input.numel() != elements_) {
      return absl::InvalidArgumentError(absl::StrCat("BackwardInput(", mb, "): grad_input: want ",
                                                     elements_, " floats"));
    }
    FillWith(grad_input, base + (num_chunks_ - chunk_));
  }
  it->second = Phase::kBackwardInputDone;
  WaitUntil(start, backward_input_);
  return absl::OkStatus();
}

absl::Status SyntheticStage::BackwardWeight(int mb) {
  const auto start = std::chrono::steady_clock::now();
  auto it = in_flight_.find(mb);
  if (it == in_flight_.end() || it->second != Phase::kBackwardInputDone) {
    return absl::FailedPreconditionError(
        absl::StrCat("BackwardWeight(", mb, "): BackwardInput has not run"));
  }
  in_flight_.erase(it);
  float* g = grad_.f32();
  for (int64_t i = 0; i < kSyntheticGradElements; ++i) g[i] += 1e-3f * static_cast<float>(i % 7 + 1);
  WaitUntil(start, backward_weight_);
  return absl::OkStatus();
}

void SyntheticStage::ZeroGrad() { std::memset(grad_.raw(), 0, grad_.bytes()); }

double SyntheticStage::LocalGradSqNorm() const {
  double sum = 0;
  const float* g = grad_.f32();
  for (int64_t i = 0; i < kSyntheticGradElements; ++i) sum += double{g[i]} * g[i];
  return sum;
}

absl::Status SyntheticStage::OptimizerStep(float grad_scale) {
  if (!in_flight_.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "OptimizerStep: ", in_flight_.size(), " microbatches still await their backward pass"));
  }
  float* w = weight_.f32();
  const float* g = grad_.f32();
  for (int64_t i = 0; i < kSyntheticGradElements; ++i) w[i] -= 0.01f * grad_scale * g[i];
  ++optimizer_step_;
  return absl::OkStatus();
}

std::vector<NamedShard> SyntheticStage::Shards() {
  NamedShard shard;
  shard.name = absl::StrCat("synthetic.", chunk_, ".weight");
  shard.value = weight_;
  shard.full_shape = {kSyntheticGradElements};
  return {shard};
}

ChunkState SyntheticStage::CaptureState() const {
  ChunkState state;
  state.optimizer_step = optimizer_step_;
  state.values.assign(weight_.f32(), weight_.f32() + kSyntheticGradElements);
  return state;
}

absl::Status SyntheticStage::RestoreState(const ChunkState& state) {
  if (state.values.size() != static_cast<size_t>(kSyntheticGradElements) ||
      !state.adam_m.empty() || !state.adam_v.empty() || state.optimizer_step < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "restoring synthetic chunk ", chunk_, ": want ", kSyntheticGradElements,
        " values, no adam moments and a step >= 0; got ", state.values.size(), " values, ",
        state.adam_m.size(), " + ", state.adam_v.size(), " moments, step ",
        state.optimizer_step));
  }
  in_flight_.clear();
  ZeroGrad();
  std::memcpy(weight_.raw(), state.values.data(), weight_.bytes());
  optimizer_step_ = state.optimizer_step;
  return absl::OkStatus();
}

}  // namespace baton
