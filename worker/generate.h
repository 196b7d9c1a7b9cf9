// `baton-worker generate`: samples tokens from a checkpoint's GPT, for a
// quick look at what a run has learnt (docs/generate.md). One-shot: the
// worker binary runs it and exits, never as the daemon; `batonctl generate`
// finds the worker binary and execs it (batonctl links no model code,
// DESIGN.md §12).
//
// The model is held whole as one stage (pp = 1, tp = 1, fp32) on one device,
// whatever layout saved the checkpoint (LoadFullState gathers full tensors).
// Each new token costs one forward of the context window (no KV cache): the
// window is the last model.seq_len tokens of prompt + generated so far, since
// the position embedding has seq_len rows (a sliding window: older tokens are
// forgotten). Causal attention makes the last position's logits depend on the
// window only.
//
// Sampling: temperature 0 is greedy (argmax, the lowest token id on ties);
// otherwise a draw from softmax(logits / T), over the top_k largest logits
// when top_k > 0. The draws come from SplitMix64 seeded with `seed`, turned
// into probabilities by this file's own arithmetic (no std:: distribution,
// whose results differ between standard libraries), so one seed gives the
// same tokens for the same logits; logits themselves can differ in the last
// bits between devices (cpu vs cuda:N), which can change a close draw.
//
// Not thread-safe: one thread drives a Generator.
#ifndef BATON_WORKER_GENERATE_H_
#define BATON_WORKER_GENERATE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/checkpoint_manifest.h"
#include "kernels/tensor.h"
#include "worker/model/gpt_config.h"
#include "worker/model/gpt_stage.h"

namespace baton::generate {

// Bounds on what a command line can ask for (each step is a forward pass; a
// million is far past a quick look, and keeps the token list a few MiB).
inline constexpr int64_t kMaxNewTokens = int64_t{1} << 20;
inline constexpr int64_t kMaxPromptTokens = int64_t{1} << 20;
// Beyond this the distribution is uniform to float precision anyway.
inline constexpr double kMaxTemperature = 1e4;

struct SamplingOptions {
  double temperature = 0;  // 0: greedy; else finite, in (0, kMaxTemperature]
  int64_t top_k = 0;       // 0: every token; k >= vocab keeps every token too
  uint64_t seed = 0;
};

// INVALID_ARGUMENT naming the flag (--temperature, --top_k).
absl::Status ValidateSamplingOptions(const SamplingOptions& options);

// The id of the largest logit, the lowest id on ties. INVALID_ARGUMENT for
// no logits or a non-finite one (a diverged checkpoint).
absl::StatusOr<int32_t> ArgmaxToken(absl::Span<const float> logits);

// Turns logits into tokens: greedy at temperature 0, else seeded draws (see
// the file comment). Each Next() with temperature > 0 takes one draw.
class TokenSampler {
 public:
  // `options` must pass ValidateSamplingOptions.
  explicit TokenSampler(const SamplingOptions& options);
  absl::StatusOr<int32_t> Next(absl::Span<const float> logits);

 private:
  double Uniform();  // [0, 1), 53 bits

  SamplingOptions options_;
  uint64_t state_;
};

// The last `seq_len` of `tokens` (all of them when fewer).
absl::Span<const int32_t> ContextWindow(absl::Span<const int32_t> tokens, int seq_len);

// A GPT as one stage on one device, with weights set from full tensors.
class Generator {
 public:
  // `weights` must hold exactly the model's parameters at their full shapes
  // (errors name the tensor). `device` must be usable (CheckDeviceUsable).
  static absl::StatusOr<std::unique_ptr<Generator>> Create(
      const model::GptConfig& config, const std::map<std::string, checkpoint::FullTensor>& weights,
      kernels::Device device);
  // The model config from the manifest, the weights from LoadFullState.
  // `dir` is a checkpoint, or a checkpoint.dir whose newest complete step-<n>
  // is taken (ResolveCheckpoint).
  static absl::StatusOr<std::unique_ptr<Generator>> FromCheckpoint(const std::string& dir,
                                                                   kernels::Device device);

  const model::GptConfig& config() const { return config_; }
  // The logits [vocab] at the last position of `context` (1..seq_len ids in
  // [0, vocab)), on the host.
  absl::StatusOr<std::vector<float>> NextLogits(absl::Span<const int32_t> context);
  // `max_new_tokens` (0..kMaxNewTokens) tokens after `prompt` (non-empty, ids
  // in [0, vocab), at most kMaxPromptTokens), each from the window ending at
  // the token before it. Errors name the flag (--prompt_tokens,
  // --max_new_tokens).
  absl::StatusOr<std::vector<int32_t>> Generate(absl::Span<const int32_t> prompt, int64_t max_new_tokens,
                                                const SamplingOptions& options);

 private:
  Generator(model::GptConfig config, std::unique_ptr<model::GptStage> stage, kernels::Tensor logits)
      : config_(config), stage_(std::move(stage)), logits_(std::move(logits)) {}

  model::GptConfig config_;
  std::unique_ptr<model::GptStage> stage_;
  kernels::Tensor logits_;  // [seq_len, vocab] on the device: one window's logits
};

// `baton-worker generate CKPT --prompt_tokens=1,2,3 [--max_new_tokens=16]
// [--temperature=0] [--top_k=0] [--seed=0] [--device=cpu] [--format=text|json]`:
// `args` are the words after "generate". Prints one line to `out`:
// "1 2 3 | 7 7 4" (prompt | generated) or {"prompt": [1, 2, 3], "generated":
// [7, 7, 4]}; an error is one line on `err`. Exit codes: 0 ok, 1 the
// checkpoint cannot be read or the model cannot run, 2 bad usage (the
// message names the flag).
int RunGenerate(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

}  // namespace baton::generate

#endif  // BATON_WORKER_GENERATE_H_
