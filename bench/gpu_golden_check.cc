// gpu_golden_check: baton's GPT on one device (pp = tp = 1, one GptStage)
// against a PyTorch golden file — the loss and every gradient, as
// golden_check does on the CPU, but with the stage's parameters, activations
// and gradients on --device.
//
//   gpu_golden_check --golden=tests/golden/gpt_a.safetensors --device=cuda:0
//
// Exits 0 when every relative error ‖ours − golden‖/‖golden‖ is within
// --tolerance (1e-4: the fp32 goldens), 1 when one is not, 2 when the device,
// the golden or the model cannot be used. bench/gpu_golden_check_test.sh runs
// it on the CPU in CI, which checks this harness; scripts/gpu_check.sh runs it
// on the GPU.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "common/safetensors.h"
#include "kernels/cpu/gemm.h"
#include "kernels/device.h"
#include "kernels/tensor.h"
#include "tests/golden/golden.h"
#include "worker/model/gpt_config.h"
#include "worker/model/gpt_stage.h"
#include "worker/model/parameters.h"

ABSL_FLAG(std::string, golden, "", "golden safetensors file from gen_golden.py");
ABSL_FLAG(std::string, device, "cuda:0", "cpu or cuda:N");
ABSL_FLAG(double, tolerance, 1e-4, "largest relative error accepted");

namespace {

using baton::kernels::Tensor;

int Usage(const std::string& what) {
  std::fprintf(stderr, "gpu_golden_check: %s\n", what.c_str());
  return 2;
}

double RelError(const std::vector<float>& ours, const std::vector<double>& golden) {
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < golden.size(); ++i) {
    diff += (ours[i] - golden[i]) * (ours[i] - golden[i]);
    norm += golden[i] * golden[i];
  }
  return std::sqrt(diff) / std::max(std::sqrt(norm), 1e-30);
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  baton::kernels::cpu::SetBlasThreads(1);
  const std::string path = absl::GetFlag(FLAGS_golden);
  absl::StatusOr<baton::kernels::Device> device =
      baton::kernels::ParseDevice(absl::GetFlag(FLAGS_device));
  if (!device.ok()) return Usage(std::string(device.status().message()));
  absl::Status usable = baton::kernels::CheckDeviceUsable(*device);
  if (!usable.ok()) return Usage(std::string(usable.message()));
  absl::StatusOr<baton::SafetensorsFile> file = baton::SafetensorsFile::Read(path);
  if (!file.ok()) return Usage(std::string(file.status().message()));
  absl::StatusOr<baton::golden::Golden> golden = baton::golden::LoadGolden(*file);
  if (!golden.ok()) return Usage(path + ": " + std::string(golden.status().message()));

  absl::StatusOr<baton::model::StageConfig> config =
      baton::model::MakeStageConfig(golden->config, 0, 1, 0, 1, /*seed=*/0);
  if (!config.ok()) return Usage(std::string(config.status().message()));
  config->device = *device;
  absl::StatusOr<std::unique_ptr<baton::model::GptStage>> stage =
      baton::model::GptStage::Create(*config, nullptr);
  if (!stage.ok()) return Usage(std::string(stage.status().message()));
  baton::model::ParameterStore& params = (*stage)->parameters();
  if (params.parameters().size() != golden->params.size()) {
    return Usage("the golden's parameters do not match the model's");
  }
  for (const baton::model::Parameter& p : params.parameters()) {
    auto it = golden->params.find(p.spec.name);
    if (it == golden->params.end() || !golden->grads.count(p.spec.name)) {
      return Usage("golden lacks parameter " + p.spec.name);
    }
    absl::Status s = params.SetFull(p.spec.name, it->second);
    if (!s.ok()) return Usage(std::string(s.message()));
  }

  const int64_t b = golden->batch, t = golden->config.seq_len;
  baton::model::StageInputs in;
  in.tokens = Tensor::Zeros({b, t}, baton::kernels::DType::kInt32);
  in.targets = Tensor::Zeros({b, t}, baton::kernels::DType::kInt32);
  std::memcpy(in.tokens.i32(), golden->tokens.data(), in.tokens.bytes());
  std::memcpy(in.targets.i32(), golden->targets.data(), in.targets.bytes());
  (*stage)->ZeroGrad();
  absl::Status s = (*stage)->Forward(0, in, Tensor());
  if (s.ok()) s = (*stage)->Backward(0, Tensor(), Tensor());
  if (!s.ok()) return Usage("step: " + std::string(s.message()));
  const double loss = (*stage)->MeanLoss();  // waits for the stage's stream

  const double tolerance = absl::GetFlag(FLAGS_tolerance);
  int bad = 0, compared = 0;
  double worst = 0;
  auto report = [&](const std::string& name, double err) {
    const bool ok = err <= tolerance;  // NaN fails
    bad += ok ? 0 : 1;
    ++compared;
    worst = err > worst ? err : worst;
    std::printf("  %-28s rel_error %.3e%s\n", name.c_str(), err, ok ? "" : "  FAIL");
  };
  std::printf("golden %s  device=%s pp=1 tp=1\n", path.c_str(),
              absl::GetFlag(FLAGS_device).c_str());
  report("loss", std::fabs(loss - golden->loss) / std::fabs(golden->loss));
  for (const baton::model::Parameter& p : params.parameters()) {
    const absl::StatusOr<std::vector<float>> grad = baton::model::ParameterStore::ToHost(p.grad);
    if (!grad.ok()) return Usage(p.spec.name + ": " + std::string(grad.status().message()));
    const std::vector<double>& want = golden->grads.at(p.spec.name);
    if (grad->size() != want.size()) return Usage(p.spec.name + ": gradient size differs");
    report(p.spec.name, RelError(*grad, want));
  }
  std::printf("%s: %d compared, worst %.3e, %d above %.0e\n", bad == 0 ? "PASS" : "FAIL",
              compared, worst, bad, tolerance);
  return bad == 0 ? 0 : 1;
}
