#include "tests/golden/golden.h"

#include <cmath>
#include <cstring>

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
  BATON_RETURN_IF_ERROR_CTX(model::ValidateGptConfig(g.config), "golden metadata");
  BATON_ASSIGN_OR_RETURN(std::vector<int64_t> tokens, file.Ints("tokens"));
  BATON_ASSIGN_OR_RETURN(std::vector<int64_t> targets, file.Ints("targets"));
  if (tokens.size() != static_cast<size_t>(batch * seq_len) || targets.size() != tokens.size()) {
    return absl::InvalidArgumentError("golden: tokens/targets are not [batch, seq_len]");
  }
  g.tokens.assign(tokens.begin(), tokens.end());
  g.targets.assign(targets.begin(), targets.end());
  BATON_ASSIGN_OR_RETURN(std::vector<double> loss, file.Floats("loss"));
  if (loss.size() != 1) return absl::InvalidArgumentError("golden: loss is not a scalar");
  g.loss = loss[0];
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
