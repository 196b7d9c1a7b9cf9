#include "tests/golden/golden.h"

#include <cmath>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/tensor.h"
#include "worker/model/inproc_model.h"

namespace baton::golden {
namespace {

double RelError(const std::vector<float>& ours, const std::vector<double>& golden) {
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < golden.size(); ++i) {
    diff += (ours[i] - golden[i]) * (ours[i] - golden[i]);
    norm += golden[i] * golden[i];
  }
  return std::sqrt(diff) / std::max(std::sqrt(norm), 1e-30);
}

absl::StatusOr<double> MetadataDouble(const SafetensorsFile& file, const std::string& key) {
  auto it = file.metadata().find(key);
  double value = 0;
  if (it == file.metadata().end() || !absl::SimpleAtod(it->second, &value)) {
    return absl::InvalidArgumentError(absl::StrCat("golden metadata: want a number \"", key, "\""));
  }
  return value;
}

absl::StatusOr<int> MetadataInt32(const SafetensorsFile& file, const std::string& key) {
  BATON_ASSIGN_OR_RETURN(int64_t value, file.MetadataInt(key));
  return static_cast<int>(value);
}

// arch and the Llama fields (absent arch: GPT-2, which has none of them).
absl::Status LoadArch(const SafetensorsFile& file, model::GptConfig& config) {
  auto arch = file.metadata().find("arch");
  if (arch == file.metadata().end() || arch->second == "gpt2") return absl::OkStatus();
  if (arch->second != "llama") {
    return absl::InvalidArgumentError(
        absl::StrCat("golden metadata: arch \"", arch->second, "\" is neither \"gpt2\" nor \"llama\""));
  }
  config.arch = model::Arch::kLlama;
  BATON_ASSIGN_OR_RETURN(config.kv_heads, MetadataInt32(file, "kv_heads"));
  BATON_ASSIGN_OR_RETURN(config.ffn, MetadataInt32(file, "ffn_dim"));
  BATON_ASSIGN_OR_RETURN(double rope_theta, MetadataDouble(file, "rope_theta"));
  BATON_ASSIGN_OR_RETURN(double norm_eps, MetadataDouble(file, "norm_eps"));
  BATON_ASSIGN_OR_RETURN(int tie, MetadataInt32(file, "tie_embeddings"));
  config.rope_theta = static_cast<float>(rope_theta);
  config.norm_eps = static_cast<float>(norm_eps);
  config.tie_embeddings = tie != 0;
  return absl::OkStatus();
}

// The moe_* fields; absent moe_experts: a dense model.
absl::Status LoadMoe(const SafetensorsFile& file, model::GptConfig& config) {
  if (!file.metadata().count("moe_experts")) return absl::OkStatus();
  BATON_ASSIGN_OR_RETURN(config.moe_experts, MetadataInt32(file, "moe_experts"));
  BATON_ASSIGN_OR_RETURN(config.moe_top_k, MetadataInt32(file, "moe_top_k"));
  BATON_ASSIGN_OR_RETURN(config.moe_every, MetadataInt32(file, "moe_every_n_layers"));
  BATON_ASSIGN_OR_RETURN(config.moe_capacity_factor, MetadataDouble(file, "moe_capacity_factor"));
  BATON_ASSIGN_OR_RETURN(double aux_coef, MetadataDouble(file, "moe_aux_loss_coef"));
  config.moe_aux_coef = static_cast<float>(aux_coef);
  return absl::OkStatus();
}

absl::StatusOr<double> Scalar(const SafetensorsFile& file, const std::string& name) {
  BATON_ASSIGN_OR_RETURN(std::vector<double> v, file.Floats(name));
  if (v.size() != 1) return absl::InvalidArgumentError(absl::StrCat("golden: ", name, " is not a scalar"));
  return v[0];
}

}  // namespace

absl::StatusOr<Golden> LoadGolden(const SafetensorsFile& file) {
  Golden g;
  BATON_ASSIGN_OR_RETURN(int64_t layers, file.MetadataInt("layers"));
  BATON_ASSIGN_OR_RETURN(int64_t d_model, file.MetadataInt("d_model"));
  BATON_ASSIGN_OR_RETURN(int64_t heads, file.MetadataInt("heads"));
  BATON_ASSIGN_OR_RETURN(int64_t vocab, file.MetadataInt("vocab"));
  BATON_ASSIGN_OR_RETURN(int64_t seq_len, file.MetadataInt("seq_len"));
  BATON_ASSIGN_OR_RETURN(int64_t batch, file.MetadataInt("batch"));
  g.config.layers = static_cast<int>(layers);
  g.config.d_model = static_cast<int>(d_model);
  g.config.heads = static_cast<int>(heads);
  g.config.vocab = static_cast<int>(vocab);
  g.config.seq_len = static_cast<int>(seq_len);
  g.batch = static_cast<int>(batch);
  BATON_RETURN_IF_ERROR(LoadArch(file, g.config));
  BATON_RETURN_IF_ERROR(LoadMoe(file, g.config));
  BATON_RETURN_IF_ERROR_CTX(model::ValidateGptConfig(g.config), "golden metadata");
  BATON_ASSIGN_OR_RETURN(std::vector<int64_t> tokens, file.Ints("tokens"));
  BATON_ASSIGN_OR_RETURN(std::vector<int64_t> targets, file.Ints("targets"));
  if (tokens.size() != static_cast<size_t>(batch * seq_len) || targets.size() != tokens.size()) {
    return absl::InvalidArgumentError("golden: tokens/targets are not [batch, seq_len]");
  }
  g.tokens.assign(tokens.begin(), tokens.end());
  g.targets.assign(targets.begin(), targets.end());
  BATON_ASSIGN_OR_RETURN(g.loss, Scalar(file, "loss"));
  if (g.config.moe() != (file.tensors().count("aux_loss") > 0)) {
    return absl::InvalidArgumentError(g.config.moe() ? "golden: an MoE model (moe_experts) without \"aux_loss\""
                                                     : "golden: \"aux_loss\" without moe_experts in the metadata");
  }
  if (g.config.moe()) {
    BATON_ASSIGN_OR_RETURN(g.aux_loss, Scalar(file, "aux_loss"));
  }
  for (const auto& [name, entry] : file.tensors()) {
    if (name.rfind("param/", 0) == 0) {
      BATON_ASSIGN_OR_RETURN(std::vector<double> v, file.Floats(name));
      g.params[name.substr(6)].assign(v.begin(), v.end());
    } else if (name.rfind("grad/", 0) == 0) {
      BATON_ASSIGN_OR_RETURN(g.grads[name.substr(5)], file.Floats(name));
    }
  }
  return g;
}

absl::StatusOr<std::vector<Comparison>> CompareWithGolden(const Golden& golden, int tp, int pp,
                                                          bool vocab_parallel,
                                                          kernels::Device device,
                                                          kernels::Precision precision, int cp) {
  BATON_ASSIGN_OR_RETURN(auto model,
                         model::InProcModel::Create(golden.config, pp, tp, /*seed=*/0,
                                                    /*microbatches=*/1, vocab_parallel, device,
                                                    precision, /*sequence_parallel=*/false, cp));
  const std::vector<std::string> names = model->ParameterNames();
  if (names.size() != golden.params.size() || names.size() != golden.grads.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("golden holds ", golden.params.size(), " parameters and ", golden.grads.size(),
                     " gradients; the model has ", names.size(), " parameters"));
  }
  for (const std::string& name : names) {
    auto p = golden.params.find(name);
    if (p == golden.params.end() || !golden.grads.count(name)) {
      return absl::InvalidArgumentError(absl::StrCat("golden lacks parameter ", name));
    }
    BATON_RETURN_IF_ERROR_CTX(model->SetParameter(name, p->second), "golden parameter");
  }
  const int64_t b = golden.batch, t = golden.config.seq_len;
  kernels::Tensor tokens = kernels::Tensor::Zeros({b, t}, kernels::DType::kInt32);
  kernels::Tensor targets = kernels::Tensor::Zeros({b, t}, kernels::DType::kInt32);
  std::memcpy(tokens.i32(), golden.tokens.data(), tokens.bytes());
  std::memcpy(targets.i32(), golden.targets.data(), targets.bytes());
  BATON_ASSIGN_OR_RETURN(double loss, model->ForwardBackward({tokens}, {targets}));

  std::vector<Comparison> out;
  out.push_back({"loss", std::abs(loss - golden.loss) / std::abs(golden.loss)});
  if (golden.config.moe()) {
    out.push_back({"aux_loss", std::abs(model->LastAuxLoss() - golden.aux_loss) /
                                   std::max(std::abs(golden.aux_loss), 1e-30)});
  }
  for (const std::string& name : names) {
    const std::vector<double>& want = golden.grads.at(name);
    BATON_ASSIGN_OR_RETURN(const std::vector<float> got, model->FullGrad(name));
    if (got.size() != want.size()) {
      return absl::InvalidArgumentError(absl::StrCat("golden gradient of ", name, " has ",
                                                     want.size(), " values, ours ", got.size()));
    }
    out.push_back({name, RelError(got, want)});
  }
  return out;
}

}  // namespace baton::golden
