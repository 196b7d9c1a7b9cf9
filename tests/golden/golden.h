// Golden comparison: loads a golden file written by gen_golden.py or
// gen_moe_golden.py (PyTorch's loss and gradients for one batch), runs
// baton's model on the same parameters and batch in a given TP × PP layout,
// and reports the relative error ‖ours − golden‖ / ‖golden‖ of the loss, of
// the MoE load-balancing loss (MoE goldens) and of every gradient.
#ifndef BATON_TESTS_GOLDEN_GOLDEN_H_
#define BATON_TESTS_GOLDEN_GOLDEN_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/safetensors.h"
#include "worker/model/gpt_config.h"

namespace baton::golden {

struct Golden {
  model::GptConfig config;
  int batch = 0;
  std::vector<int32_t> tokens, targets;  // [batch, seq_len]
  std::map<std::string, std::vector<float>> params;
  // Of loss + aux_loss.
  std::map<std::string, std::vector<double>> grads;
  double loss = 0;  // mean cross-entropy over the scored tokens
  // MoE (config.moe()): the sum over the MoE blocks of their load-balancing
  // losses; 0 for a dense model.
  double aux_loss = 0;
};

// The config comes from the metadata: layers, d_model, heads, vocab, seq_len
// and batch; arch ("gpt2" when absent, or "llama" with kv_heads, ffn_dim,
// rope_theta, norm_eps, tie_embeddings); and, for an MoE model, moe_experts,
// moe_top_k, moe_every_n_layers, moe_capacity_factor, moe_aux_loss_coef. An
// MoE golden must hold "aux_loss", a dense one must not. Errors name the key.
absl::StatusOr<Golden> LoadGolden(const SafetensorsFile& file);

struct Comparison {
  std::string name;  // "loss", "aux_loss" (MoE goldens) or a parameter name
  double rel_error = 0;
};

// Runs the model at (tp, pp), optionally with the vocabulary-parallel
// embedding and head, and compares (an MoE golden's aux_loss with the
// model's LastAuxLoss, after the comparison of "loss"). Errors: a layout the config does not
// allow, or a golden whose parameters do not match the model's. `device`:
// where the stages run (kernels/backend.h; its backend must be linked).
// `precision`: train.precision of the run (bf16: GEMM inputs, attention and
// the stages' messages in bf16 against PyTorch's float64 golden). `cp`:
// context parallelism (each sequence over cp ranks, ring attention).
absl::StatusOr<std::vector<Comparison>> CompareWithGolden(
    const Golden& golden, int tp, int pp, bool vocab_parallel,
    kernels::Device device = kernels::Device::Cpu(),
    kernels::Precision precision = kernels::Precision::kFloat32, int cp = 1);

}  // namespace baton::golden

#endif  // BATON_TESTS_GOLDEN_GOLDEN_H_
