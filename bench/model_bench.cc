// model_bench: tokens per second of one full training step (forward,
// backward, AdamW) of baton's GPT on one CPU thread, and the share of that
// time spent in GEMM (summed over the timed steps). Defaults: layers=4 d_model=256 heads=8
// vocab=256 seq_len=128 micro_batch=8; --arch=llama (with --kv_heads, --ffn_dim) times
// the Llama architecture instead. Prints one "baton ..." line that bench/model_bench.sh
// compares with PyTorch.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "kernels/cpu/gemm.h"
#include "kernels/tensor.h"
#include "worker/model/gpt_stage.h"

ABSL_FLAG(int, layers, 4, "transformer blocks");
ABSL_FLAG(int, d_model, 256, "model width");
ABSL_FLAG(int, heads, 8, "attention heads");
ABSL_FLAG(int, vocab, 256, "vocabulary size");
ABSL_FLAG(int, seq_len, 128, "tokens per sequence");
ABSL_FLAG(int, micro_batch, 8, "sequences per step");
ABSL_FLAG(int, warmup, 2, "untimed steps first");
ABSL_FLAG(int, steps, 10, "timed steps");
ABSL_FLAG(std::string, arch, "gpt2", "gpt2 or llama");
ABSL_FLAG(int, kv_heads, 0, "llama: key/value heads (0 = heads)");
ABSL_FLAG(int, ffn_dim, 0, "llama: MLP width (0 = 4 * d_model)");
ABSL_FLAG(int, moe_experts, 0, "model.moe.experts (0: a dense model)");
ABSL_FLAG(int, moe_top_k, 2, "model.moe.top_k");
ABSL_FLAG(double, moe_capacity_factor, 0.0, "model.moe.capacity_factor (0: dropless)");

namespace {

using baton::kernels::Tensor;

int Run() {
  baton::kernels::cpu::SetBlasThreads(1);
  baton::model::GptConfig model;
  model.layers = absl::GetFlag(FLAGS_layers);
  model.d_model = absl::GetFlag(FLAGS_d_model);
  model.heads = absl::GetFlag(FLAGS_heads);
  model.vocab = absl::GetFlag(FLAGS_vocab);
  model.seq_len = absl::GetFlag(FLAGS_seq_len);
  if (absl::GetFlag(FLAGS_arch) == "llama") {
    model.arch = baton::model::Arch::kLlama;
    model.kv_heads = absl::GetFlag(FLAGS_kv_heads);
    model.ffn = absl::GetFlag(FLAGS_ffn_dim);
    model.tie_embeddings = false;
  } else if (absl::GetFlag(FLAGS_arch) != "gpt2") {
    std::fprintf(stderr, "model_bench: --arch must be gpt2 or llama\n");
    return 2;
  }
  model.moe_experts = absl::GetFlag(FLAGS_moe_experts);
  model.moe_top_k = absl::GetFlag(FLAGS_moe_top_k);
  model.moe_capacity_factor = absl::GetFlag(FLAGS_moe_capacity_factor);
  const int b = absl::GetFlag(FLAGS_micro_batch), t = model.seq_len;
  auto config = baton::model::MakeStageConfig(model, 0, 1, 0, 1, /*seed=*/1);
  if (!config.ok()) {
    std::fprintf(stderr, "model_bench: %s\n", std::string(config.status().message()).c_str());
    return 2;
  }
  auto stage = baton::model::GptStage::Create(*config, nullptr);
  if (!stage.ok()) {
    std::fprintf(stderr, "model_bench: %s\n", std::string(stage.status().message()).c_str());
    return 2;
  }
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> id(0, model.vocab - 1);
  baton::model::StageInputs in;
  in.tokens = Tensor::Zeros({b, t}, baton::kernels::DType::kInt32);
  in.targets = Tensor::Zeros({b, t}, baton::kernels::DType::kInt32);
  for (int i = 0; i < b * t; ++i) {
    in.tokens.i32()[i] = id(rng);
    in.targets.i32()[i] = id(rng);
  }
  baton::kernels::AdamWConfig adam;
  adam.lr = 1e-4f;
  adam.weight_decay = 0.1f;
  auto step = [&]() -> bool {
    (*stage)->ZeroGrad();
    return (*stage)->Forward(0, in, Tensor()).ok() &&
           (*stage)->Backward(0, Tensor(), Tensor()).ok() &&
           (*stage)->OptimizerStep(adam, 1.0f).ok();
  };
  for (int i = 0; i < absl::GetFlag(FLAGS_warmup); ++i) {
    if (!step()) return 2;
  }
  std::vector<double> seconds;
  double gemm = 0.0, flops = 0.0;
  for (int i = 0; i < absl::GetFlag(FLAGS_steps); ++i) {
    baton::kernels::cpu::ResetThreadGemmStats();
    const auto start = std::chrono::steady_clock::now();
    if (!step()) return 2;
    seconds.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    gemm += baton::kernels::cpu::ThreadGemmStats().seconds;
    flops += baton::kernels::cpu::ThreadGemmStats().flops;
  }
  double total = 0.0;
  for (double s : seconds) total += s;
  std::sort(seconds.begin(), seconds.end());
  // Throughput from the fastest step: on a shared machine the others carry
  // other processes' load; the median is printed beside it.
  const double best = seconds.front(), median = seconds[seconds.size() / 2];
  std::printf(
      "baton tokens_per_s=%.0f best_step_ms=%.1f median_step_ms=%.1f steps=%zu gemm_share=%.3f "
      "gemm_gflops=%.1f loss=%.4f arch=%s moe_experts=%d moe_top_k=%d\n",
      b * t / best, 1e3 * best, 1e3 * median, seconds.size(), gemm / total, flops / gemm / 1e9,
      (*stage)->MeanLoss(), absl::GetFlag(FLAGS_arch).c_str(), model.moe_experts,
      model.moe() ? model.moe_top_k : 0);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return Run();
}
