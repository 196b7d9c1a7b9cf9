// A full training step of a GPT-2-small-shaped model (12 layers, d 768, 12
// heads, vocab 50304, seq 1024 by default) on one device through GptStage
// (pp = tp = 1): step time, tokens/s, model FLOP utilisation, peak device
// memory, system allocations after the first step and host synchronisations
// per step. One JSON object on stdout.
//
// FLOPs per token: 6·P (forward + backward of every parameter's GEMM) plus
// 12·L·T·C for attention scores and context (the causal half is computed in
// full by the unfused path, and counted in full here, as PaLM's formula does).
// MFU is against the datasheet peaks (989 TFLOP/s dense bf16, 67 fp32);
// --precision=fp32 runs true fp32 (no TF32), --precision=bf16 is
// train.precision = bf16 (bf16 GEMM inputs and attention, fp32 master
// weights, moments and reductions; docs/model.md). The MFU that means
// something is the one against the peak of the run's precision.
//
//   bazel build //bench:gpu_model_bench && bazel-bin/bench/gpu_model_bench --device=cuda:0 [--precision=bf16]
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "kernels/device.h"
#include "kernels/tensor.h"
#include "worker/model/gpt_config.h"
#include "worker/model/gpt_stage.h"

ABSL_FLAG(std::string, device, "cuda:0", "cpu or cuda:N");
ABSL_FLAG(int, layers, 12, "transformer blocks");
ABSL_FLAG(int, d_model, 768, "model width");
ABSL_FLAG(int, heads, 12, "attention heads");
ABSL_FLAG(int, vocab, 50304, "vocabulary size");
ABSL_FLAG(int, seq_len, 1024, "tokens per sequence");
ABSL_FLAG(int, micro_batch, 8, "sequences per step");
ABSL_FLAG(int, warmup, 2, "untimed steps first");
ABSL_FLAG(int, steps, 5, "timed steps");
ABSL_FLAG(std::string, precision, "fp32", "train.precision: fp32 or bf16");

namespace {

using baton::kernels::Device;
using baton::kernels::Tensor;

// `s` as the inside of a JSON string.
std::string JsonEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (c != '\n') out += c;
  }
  return out;
}

int Fail(const std::string& what) {
  std::printf("{\"error\": \"%s\"}\n", JsonEscape(what).c_str());
  std::fprintf(stderr, "gpu_model_bench: %s\n", what.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  absl::StatusOr<Device> parsed = baton::kernels::ParseDevice(absl::GetFlag(FLAGS_device));
  if (!parsed.ok()) return Fail(std::string(parsed.status().message()));
  const Device device = *parsed;
  absl::Status probe = baton::kernels::CheckDeviceUsable(device);
  if (!probe.ok()) return Fail(std::string(probe.message()));
  baton::model::GptConfig model;
  model.layers = absl::GetFlag(FLAGS_layers);
  model.d_model = absl::GetFlag(FLAGS_d_model);
  model.heads = absl::GetFlag(FLAGS_heads);
  model.vocab = absl::GetFlag(FLAGS_vocab);
  model.seq_len = absl::GetFlag(FLAGS_seq_len);
  const int b = absl::GetFlag(FLAGS_micro_batch), t = model.seq_len;
  absl::StatusOr<baton::model::StageConfig> config =
      baton::model::MakeStageConfig(model, 0, 1, 0, 1, /*seed=*/1);
  if (!config.ok()) return Fail(std::string(config.status().message()));
  config->device = device;
  baton::v1::TrainSpec train;
  train.set_precision(absl::GetFlag(FLAGS_precision));
  absl::StatusOr<baton::kernels::Precision> precision = baton::model::PrecisionFromSpec(train);
  if (!precision.ok()) return Fail(std::string(precision.status().message()));
  config->precision = *precision;
  const char* precision_name = *precision == baton::kernels::Precision::kBFloat16 ? "bf16" : "fp32";
  absl::StatusOr<std::unique_ptr<baton::model::GptStage>> stage =
      baton::model::GptStage::Create(*config, nullptr);
  if (!stage.ok()) return Fail(std::string(stage.status().message()));

  std::mt19937 rng(5);
  std::uniform_int_distribution<int> id(0, model.vocab - 1);
  baton::model::StageInputs in;
  // Pinned, as the executor keeps them: copying pageable memory to the
  // device waits for the stream on the host.
  absl::StatusOr<Tensor> pinned_tokens = baton::kernels::PinnedHostZeros(device, {b, t}, baton::kernels::DType::kInt32);
  absl::StatusOr<Tensor> pinned_targets = baton::kernels::PinnedHostZeros(device, {b, t}, baton::kernels::DType::kInt32);
  if (!pinned_tokens.ok()) return Fail(std::string(pinned_tokens.status().message()));
  if (!pinned_targets.ok()) return Fail(std::string(pinned_targets.status().message()));
  in.tokens = *pinned_tokens;
  in.targets = *pinned_targets;
  for (int i = 0; i < b * t; ++i) {
    in.tokens.i32()[i] = id(rng);
    in.targets.i32()[i] = id(rng);
  }
  baton::kernels::AdamWConfig adam;
  adam.lr = 1e-4f;
  adam.weight_decay = 0.1f;
  double loss = 0;
  auto step = [&]() -> absl::Status {
    (*stage)->ZeroGrad();
    absl::Status s = (*stage)->Forward(0, in, Tensor());
    if (s.ok()) s = (*stage)->Backward(0, Tensor(), Tensor());
    baton::model::StepScore score;
    double grad_sq_norm = 0;
    if (s.ok()) s = (*stage)->ReadStepResults(&score, &grad_sq_norm);  // the step's one wait, as the executor's
    if (s.ok()) s = (*stage)->OptimizerStep(adam, 1.0f);
    if (s.ok()) loss = score.tokens > 0 ? score.loss_sum / score.tokens : 0;
    return s;
  };
  const int warmup = absl::GetFlag(FLAGS_warmup), steps = absl::GetFlag(FLAGS_steps);
  for (int i = 0; i < std::max(warmup, 1); ++i) {
    absl::Status s = step();
    if (!s.ok()) return Fail(absl::StrCat("warm-up step: ", s.message()));
  }
  (void)(*stage)->score();  // waits for the last warm-up optimizer step
  const int64_t allocations = baton::kernels::GetMemoryStats(device).system_allocations;
  const int64_t syncs = baton::kernels::HostSyncCount();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) {
    absl::Status s = step();
    if (!s.ok()) return Fail(absl::StrCat("step ", i, ": ", s.message()));
  }
  const int64_t step_syncs = baton::kernels::HostSyncCount() - syncs;
  (void)(*stage)->score();  // waits for the last optimizer step (not counted above)
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / steps;
  const baton::kernels::MemoryStats mem = baton::kernels::GetMemoryStats(device);
  // Parameters: embeddings, per block (QKV, proj, fc, fc_proj weights and
  // biases, two LayerNorms), the final LayerNorm; the head is tied.
  const double c = model.d_model, l = model.layers;
  const double params = model.vocab * c + t * c + l * (12 * c * c + 13 * c) + 2 * c;
  const double tokens = static_cast<double>(b) * t;
  const double flops = tokens * (6 * params + 12 * l * t * c);
  const double achieved = flops / seconds;
  std::printf(
      "{\"device\": \"%s\", \"layers\": %d, \"d_model\": %d, \"heads\": %d, \"vocab\": %d, "
      "\"seq_len\": %d, \"micro_batch\": %d, \"precision\": \"%s\", \"params\": %.0f, "
      "\"step_ms\": %.2f, \"tokens_per_s\": %.0f, \"tflops\": %.2f, \"mfu_of_fp32_peak_67\": %.3f, "
      "\"mfu_of_bf16_peak_989\": %.4f, \"peak_reserved_gib\": %.2f, "
      "\"allocations_after_warmup\": %lld, \"host_syncs_per_step\": %.2f, \"loss\": %.4f}\n",
      absl::GetFlag(FLAGS_device).c_str(), model.layers, model.d_model, model.heads, model.vocab,
      model.seq_len, b, precision_name, params, seconds * 1e3, tokens / seconds, achieved / 1e12,
      achieved / 67e12, achieved / 989e12, mem.peak_reserved_bytes / double(1 << 30),
      static_cast<long long>(mem.system_allocations - allocations),
      static_cast<double>(step_syncs) / steps, loss);
  return 0;
}
