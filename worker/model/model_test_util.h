// Helpers shared by the model's tests: random token ids, the relative L2
// error the gradient checks use, the gathered tensors of an InProcModel,
// and the small MoE model of the MoE tests.
#ifndef BATON_WORKER_MODEL_MODEL_TEST_UTIL_H_
#define BATON_WORKER_MODEL_MODEL_TEST_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "kernels/tensor.h"
#include "worker/model/gpt_config.h"

namespace baton::model {

// int32 [b, t] of ids drawn uniformly from [0, vocab).
inline kernels::Tensor RandomIds(std::mt19937& rng, int64_t b, int64_t t, int vocab) {
  kernels::Tensor ids = kernels::Tensor::Zeros({b, t}, kernels::DType::kInt32);
  std::uniform_int_distribution<int> dist(0, vocab - 1);
  for (int64_t i = 0; i < ids.numel(); ++i) ids.i32()[i] = dist(rng);
  return ids;
}

// ‖got − want‖₂ / ‖want‖₂, in double; infinite when the sizes differ.
inline double RelError(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size()) return std::numeric_limits<double>::infinity();
  double diff = 0, norm = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff += (double{got[i]} - want[i]) * (double{got[i]} - want[i]);
    norm += double{want[i]} * want[i];
  }
  return std::sqrt(diff) / std::max(std::sqrt(norm), 1e-30);
}

// The values of a gathered tensor (InProcModel::FullValue / FullGrad); a
// failed gather fails the calling test and gives no values.
inline std::vector<float> Full(absl::StatusOr<std::vector<float>> gathered) {
  if (!gathered.ok()) {
    ADD_FAILURE() << "gather failed: " << gathered.status();
    return {};
  }
  return *std::move(gathered);
}

// A small MoE model (d_model 32, 4 heads, vocab 40, seq_len 16; Llama with
// 2 key/value heads, MLP 48, untied head), every `every`-th block MoE with
// `experts` experts, load-balancing coefficient 0.05.
inline GptConfig SmallMoeModel(Arch arch, int layers, int experts, int top_k, double capacity_factor, int every = 1) {
  GptConfig c;
  c.arch = arch;
  c.layers = layers;
  c.d_model = 32;
  c.heads = 4;
  c.vocab = 40;
  c.seq_len = 16;
  if (arch == Arch::kLlama) {
    c.kv_heads = 2;
    c.ffn = 48;
    c.tie_embeddings = false;
  }
  c.moe_experts = experts;
  c.moe_top_k = top_k;
  c.moe_every = every;
  c.moe_capacity_factor = capacity_factor;
  c.moe_aux_coef = 0.05f;
  return c;
}

}  // namespace baton::model

#endif  // BATON_WORKER_MODEL_MODEL_TEST_UTIL_H_
