#include "worker/generate.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "kernels/backend.h"
#include "kernels/device.h"
#include "worker/model/parameters.h"

namespace baton::generate {

using kernels::Tensor;

absl::Status ValidateSamplingOptions(const SamplingOptions& options) {
  if (!std::isfinite(options.temperature) || options.temperature < 0 || options.temperature > kMaxTemperature) {
    return absl::InvalidArgumentError(absl::StrCat("--temperature=", options.temperature,
                                                   " must be 0 (greedy) or in (0, ", kMaxTemperature, "]"));
  }
  if (options.top_k < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--top_k=", options.top_k, " must be >= 0 (0: sample from every token)"));
  }
  return absl::OkStatus();
}

namespace {

absl::Status CheckFinite(absl::Span<const float> logits) {
  if (logits.empty()) return absl::InvalidArgumentError("no logits to pick a token from");
  for (size_t i = 0; i < logits.size(); ++i) {
    if (!std::isfinite(logits[i])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the logit of token ", i, " is ", logits[i], "; the checkpoint's weights are not finite (a diverged run?)"));
    }
  }
  return absl::OkStatus();
}

// SplitMix64 (Steele, Lea, Flood 2014): a full-period 64-bit generator whose
// output is the same everywhere, unlike std:: distributions.
uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

}  // namespace

absl::StatusOr<int32_t> ArgmaxToken(absl::Span<const float> logits) {
  BATON_RETURN_IF_ERROR(CheckFinite(logits));
  size_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i) {
    if (logits[i] > logits[best]) best = i;  // strict: the first maximum wins ties
  }
  return static_cast<int32_t>(best);
}

TokenSampler::TokenSampler(const SamplingOptions& options) : options_(options), state_(options.seed) {}

double TokenSampler::Uniform() { return static_cast<double>(SplitMix64(state_) >> 11) * 0x1.0p-53; }

absl::StatusOr<int32_t> TokenSampler::Next(absl::Span<const float> logits) {
  if (options_.temperature == 0) return ArgmaxToken(logits);
  BATON_RETURN_IF_ERROR(CheckFinite(logits));
  // The candidates in a fixed order: every id ascending, or the top k by
  // (logit descending, id ascending), so ties are cut the same way each time.
  std::vector<int32_t> ids(logits.size());
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i);
  if (options_.top_k > 0 && options_.top_k < static_cast<int64_t>(ids.size())) {
    const auto k = static_cast<size_t>(options_.top_k);
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int32_t a, int32_t b) {
      return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
    });
    ids.resize(k);
  }
  // softmax(logits / T) in double, shifted by the largest logit so the
  // largest weight is exactly 1 (no overflow at small T).
  float max = logits[ids[0]];
  for (int32_t id : ids) max = std::max(max, logits[id]);
  std::vector<double> weights(ids.size());
  double total = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    weights[i] = std::exp((static_cast<double>(logits[ids[i]]) - max) / options_.temperature);
    total += weights[i];
  }
  const double u = Uniform() * total;
  double cumulative = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    cumulative += weights[i];
    if (u < cumulative) return ids[i];
  }
  // Rounding left u at the very top: the last token with any weight.
  for (size_t i = ids.size(); i-- > 0;) {
    if (weights[i] > 0) return ids[i];
  }
  return ids.back();
}

absl::Span<const int32_t> ContextWindow(absl::Span<const int32_t> tokens, int seq_len) {
  const size_t n = static_cast<size_t>(std::max(seq_len, 0));
  return tokens.size() <= n ? tokens : tokens.subspan(tokens.size() - n);
}

absl::StatusOr<std::unique_ptr<Generator>> Generator::Create(
    const model::GptConfig& config, const std::map<std::string, checkpoint::FullTensor>& weights,
    kernels::Device device) {
  BATON_RETURN_IF_ERROR_CTX(model::ValidateGptConfig(config), "the checkpoint's model");
  BATON_ASSIGN_OR_RETURN(model::StageConfig stage_config,
                         model::MakeStageConfig(config, /*pp_rank=*/0, /*pp_size=*/1, /*tp_rank=*/0,
                                                /*tp_size=*/1, /*seed=*/0));
  stage_config.device = device;
  // Names and shapes are checked before the stage allocates anything.
  const std::vector<model::ParameterSpec> specs = model::StageParameterSpecs(stage_config);
  std::set<std::string> names;
  for (const model::ParameterSpec& spec : specs) {
    names.insert(spec.name);
    auto it = weights.find(spec.name);
    if (it == weights.end()) {
      return absl::InvalidArgumentError(absl::StrCat("the checkpoint has no tensor ", spec.name, " of its model (",
                                                     config.layers, " layers)"));
    }
    const std::vector<int64_t> want(spec.full_shape.begin(), spec.full_shape.end());
    if (it->second.shape != want || it->second.values.size() != static_cast<size_t>(checkpoint::NumElements(want))) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", spec.name, " has shape [",
                                                     absl::StrJoin(it->second.shape, ","), "], its model wants [",
                                                     absl::StrJoin(want, ","), "]"));
    }
  }
  for (const auto& [name, tensor] : weights) {
    if (names.count(name) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("the checkpoint holds tensor ", name, ", which its model config has no place for"));
    }
  }
  BATON_ASSIGN_OR_RETURN(std::unique_ptr<model::GptStage> stage, model::GptStage::Create(stage_config, nullptr));
  for (const model::ParameterSpec& spec : specs) {
    BATON_RETURN_IF_ERROR_CTX(stage->parameters().SetFull(spec.name, weights.at(spec.name).values), "setting ",
                              spec.name);
  }
  stage->RefreshBf16Weights();  // a no-op at fp32; kept so a bf16 stage would stay right
  BATON_ASSIGN_OR_RETURN(Tensor logits, kernels::ZerosOn(device, {config.seq_len, config.vocab}));
  return std::unique_ptr<Generator>(new Generator(config, std::move(stage), std::move(logits)));
}

absl::StatusOr<std::unique_ptr<Generator>> Generator::FromCheckpoint(const std::string& dir, kernels::Device device) {
  BATON_ASSIGN_OR_RETURN(const std::string resolved, checkpoint::ResolveCheckpoint(dir));
  BATON_ASSIGN_OR_RETURN(const checkpoint::ManifestInfo manifest, checkpoint::ReadManifest(resolved));
  if (manifest.version < 2) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint ", resolved, " is a version 1 checkpoint, whose manifest does not record the model (heads "
        "cannot be told from the tensors); use a checkpoint saved by a current release"));
  }
  if (manifest.model.synthetic) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint ", resolved, " holds ", checkpoint::DescribeModel(manifest.model),
                     ", which has no tokens to generate; use a checkpoint of a GPT job"));
  }
  model::GptConfig config;
  config.layers = manifest.model.layers;
  config.d_model = manifest.model.d_model;
  config.heads = manifest.model.heads;
  config.vocab = manifest.model.vocab;
  config.seq_len = manifest.model.seq_len;
  if (manifest.model.arch == "llama") {
    config.arch = model::Arch::kLlama;
    config.kv_heads = manifest.model.kv_heads;
    config.ffn = manifest.model.ffn_dim;
    config.rope_theta = manifest.model.rope_theta;
    config.norm_eps = manifest.model.norm_eps;
    config.tie_embeddings = manifest.model.tie_embeddings;
  }
  if (manifest.model.moe()) {
    config.moe_experts = manifest.model.moe_experts;
    config.moe_top_k = manifest.model.moe_top_k;
    config.moe_every = manifest.model.moe_every;
    config.moe_capacity_factor = manifest.model.moe_capacity_factor;
    config.moe_aux_coef = manifest.model.moe_aux_coef;
  }
  BATON_ASSIGN_OR_RETURN(checkpoint::FullState state, checkpoint::LoadFullState(resolved));
  for (auto& [name, t] : state.tensors) {  // sampling needs no optimizer state
    std::vector<float>().swap(t.adam_m);
    std::vector<float>().swap(t.adam_v);
  }
  absl::StatusOr<std::unique_ptr<Generator>> generator = Create(config, state.tensors, device);
  if (!generator.ok()) return WithContext(generator.status(), absl::StrCat("checkpoint ", resolved));
  return generator;
}

absl::StatusOr<std::vector<float>> Generator::NextLogits(absl::Span<const int32_t> context) {
  const int64_t t = static_cast<int64_t>(context.size());
  if (t < 1 || t > config_.seq_len) {
    return absl::InvalidArgumentError(
        absl::StrCat("a context of ", t, " tokens; want 1 to model.seq_len = ", config_.seq_len));
  }
  // The host copy the stage reads; it outlives the forward (we wait below).
  std::vector<int32_t> ids(context.begin(), context.end());
  model::StageInputs inputs;
  inputs.tokens = Tensor::View(ids.data(), {1, t}, kernels::DType::kInt32);
  const int64_t v = config_.vocab;
  const Tensor window = logits_.Rows(0, t);
  BATON_RETURN_IF_ERROR(stage_->ForwardLogits(inputs, window.Reshaped({1, t, v})));
  BATON_RETURN_IF_ERROR_CTX(stage_->stream().Synchronize(), "running the model forward");
  return model::ParameterStore::ToHost(window.Rows(t - 1, t));
}

namespace {

absl::Status ValidatePrompt(absl::Span<const int32_t> prompt, int vocab) {
  if (prompt.empty()) return absl::InvalidArgumentError("--prompt_tokens is empty; give at least one token id");
  if (static_cast<int64_t>(prompt.size()) > kMaxPromptTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("--prompt_tokens holds ", prompt.size(), " tokens, more than ", kMaxPromptTokens));
  }
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] < 0 || prompt[i] >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat("--prompt_tokens: token ", prompt[i], " (position ", i,
                                                     ") is outside [0, vocab = ", vocab,
                                                     ") of the checkpoint's model"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateMaxNewTokens(int64_t n) {
  if (n < 0 || n > kMaxNewTokens) {
    return absl::InvalidArgumentError(absl::StrCat("--max_new_tokens=", n, " must be in [0, ", kMaxNewTokens, "]"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<int32_t>> Generator::Generate(absl::Span<const int32_t> prompt, int64_t max_new_tokens,
                                                         const SamplingOptions& options) {
  BATON_RETURN_IF_ERROR(ValidatePrompt(prompt, config_.vocab));
  BATON_RETURN_IF_ERROR(ValidateMaxNewTokens(max_new_tokens));
  BATON_RETURN_IF_ERROR(ValidateSamplingOptions(options));
  std::vector<int32_t> all(prompt.begin(), prompt.end());
  all.reserve(all.size() + static_cast<size_t>(max_new_tokens));
  TokenSampler sampler(options);
  for (int64_t i = 0; i < max_new_tokens; ++i) {
    const std::string step = absl::StrCat("generating token ", i + 1, " of ", max_new_tokens);
    absl::StatusOr<std::vector<float>> logits = NextLogits(ContextWindow(all, config_.seq_len));
    if (!logits.ok()) return WithContext(logits.status(), step);
    absl::StatusOr<int32_t> token = sampler.Next(*logits);
    if (!token.ok()) return WithContext(token.status(), step);
    all.push_back(*token);
  }
  return std::vector<int32_t>(all.begin() + static_cast<std::ptrdiff_t>(prompt.size()), all.end());
}

namespace {

// What to give, for a bare `baton-worker generate`.
constexpr char kUsage[] =
    "want CHECKPOINT --prompt_tokens=ID,ID,... [--max_new_tokens=16] [--temperature=0] "
    "[--top_k=0] [--seed=0] [--device=cpu] [--format=text|json]";

struct Flags {
  std::string checkpoint;
  std::vector<int32_t> prompt;
  int64_t max_new_tokens = 16;
  SamplingOptions sampling;
  std::string device = "cpu";
  bool json = false;
};

absl::StatusOr<std::vector<int32_t>> ParsePrompt(const std::string& text) {
  if (text.empty()) return absl::InvalidArgumentError("--prompt_tokens is empty; give at least one token id");
  std::vector<int32_t> out;
  for (absl::string_view word : absl::StrSplit(text, ',')) {
    if (static_cast<int64_t>(out.size()) >= kMaxPromptTokens) {
      return absl::InvalidArgumentError(absl::StrCat("--prompt_tokens holds more than ", kMaxPromptTokens, " tokens"));
    }
    int64_t id = 0;
    if (!absl::SimpleAtoi(word, &id) || id < 0 || id >= model::kMaxVocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("--prompt_tokens: '", word, "' is not a token id (want comma-separated ids, e.g. 1,2,3)"));
    }
    out.push_back(static_cast<int32_t>(id));
  }
  return out;
}

// `--name=value` words and one positional; INVALID_ARGUMENT naming the flag.
absl::StatusOr<Flags> ParseFlags(const std::vector<std::string>& args) {
  Flags f;
  bool have_prompt = false;
  std::vector<std::string> positionals;
  for (const std::string& a : args) {
    if (a.rfind("--", 0) != 0) {
      positionals.push_back(a);
      continue;
    }
    const size_t eq = a.find('=');
    if (eq == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(a, " needs a value (", a, "=VALUE)"));
    }
    const std::string name = a.substr(2, eq - 2), value = a.substr(eq + 1);
    auto int_flag = [&](int64_t* out) -> absl::Status {
      if (!absl::SimpleAtoi(value, out)) {
        return absl::InvalidArgumentError(absl::StrCat("--", name, "='", value, "' is not an integer"));
      }
      return absl::OkStatus();
    };
    if (name == "prompt_tokens") {
      BATON_ASSIGN_OR_RETURN(f.prompt, ParsePrompt(value));
      have_prompt = true;
    } else if (name == "max_new_tokens") {
      BATON_RETURN_IF_ERROR(int_flag(&f.max_new_tokens));
      BATON_RETURN_IF_ERROR(ValidateMaxNewTokens(f.max_new_tokens));
    } else if (name == "top_k") {
      BATON_RETURN_IF_ERROR(int_flag(&f.sampling.top_k));
    } else if (name == "seed") {
      if (!absl::SimpleAtoi(value, &f.sampling.seed)) {
        return absl::InvalidArgumentError(absl::StrCat("--seed='", value, "' is not an integer in [0, 2^64)"));
      }
    } else if (name == "temperature") {
      if (!absl::SimpleAtod(value, &f.sampling.temperature)) {
        return absl::InvalidArgumentError(absl::StrCat("--temperature='", value, "' is not a number"));
      }
    } else if (name == "device") {
      f.device = value;
    } else if (name == "format") {
      if (value != "text" && value != "json") {
        return absl::InvalidArgumentError(absl::StrCat("--format='", value, "' must be text or json"));
      }
      f.json = value == "json";
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
    }
  }
  if (positionals.size() != 1) {
    return absl::InvalidArgumentError(absl::StrCat("want one CHECKPOINT directory, got ", positionals.size()));
  }
  f.checkpoint = positionals[0];
  if (!have_prompt) return absl::InvalidArgumentError("--prompt_tokens=ID,ID,... is required");
  BATON_RETURN_IF_ERROR(ValidateSamplingOptions(f.sampling));
  return f;
}

std::string JsonIds(absl::Span<const int32_t> ids) { return absl::StrCat("[", absl::StrJoin(ids, ", "), "]"); }

}  // namespace

int RunGenerate(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  // One line, naming the flag; the usage only when no flags were understood.
  auto fail = [&err](int code, const absl::Status& s) {
    err << "baton-worker generate: " << s.message() << "\n";
    return code;
  };
  if (args.empty()) return fail(2, absl::InvalidArgumentError(kUsage));
  absl::StatusOr<Flags> flags = ParseFlags(args);
  if (!flags.ok()) return fail(2, flags.status());
  absl::StatusOr<kernels::Device> device = kernels::ParseDevice(flags->device);
  if (!device.ok()) {
    return fail(2, absl::InvalidArgumentError(
                       absl::StrCat("--device='", flags->device, "' must be \"cpu\" or \"cuda:N\" (e.g. cuda:0)")));
  }
  if (absl::Status usable = kernels::CheckDeviceUsable(*device); !usable.ok()) {
    return fail(1, WithContext(usable, absl::StrCat("--device=", flags->device)));
  }
  absl::StatusOr<std::unique_ptr<Generator>> generator = Generator::FromCheckpoint(flags->checkpoint, *device);
  if (!generator.ok()) return fail(1, generator.status());
  // Prompt ids against the model's vocabulary: a usage error, not a failure.
  if (absl::Status s = ValidatePrompt(flags->prompt, (*generator)->config().vocab); !s.ok()) return fail(2, s);
  absl::StatusOr<std::vector<int32_t>> tokens =
      (*generator)->Generate(flags->prompt, flags->max_new_tokens, flags->sampling);
  if (!tokens.ok()) return fail(1, tokens.status());
  if (flags->json) {
    out << "{\"prompt\": " << JsonIds(flags->prompt) << ", \"generated\": " << JsonIds(*tokens) << "}\n";
  } else {
    out << absl::StrJoin(flags->prompt, " ") << " |" << (tokens->empty() ? "" : " ") << absl::StrJoin(*tokens, " ")
        << "\n";
  }
  out.flush();
  return out.good() ? 0 : fail(1, absl::UnavailableError("cannot write the tokens to stdout"));
}

}  // namespace baton::generate
