// GptConfig and StageConfig: the shape of a GPT-2 model and of one stage of
// it (a contiguous block range on one pipeline rank, one shard of a tensor-
// parallel group), validated into absl::Status errors that name the field.
#ifndef BATON_WORKER_MODEL_GPT_CONFIG_H_
#define BATON_WORKER_MODEL_GPT_CONFIG_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "baton/v1/job.pb.h"
#include "kernels/backend.h"
#include "kernels/tensor.h"

namespace baton::model {

// model.arch: GPT-2 (LayerNorm, learned positions, GELU MLP, biases, tied
// head) or Llama (RMSNorm, rotary positions, SwiGLU MLP, grouped-query
// attention, no biases, untied head unless tie_embeddings).
enum class Arch { kGpt2, kLlama };

struct GptConfig {
  Arch arch = Arch::kGpt2;
  int layers = 0;
  int d_model = 0;
  int heads = 0;
  int vocab = 0;
  int seq_len = 0;  // longest sequence (GPT-2: rows of the position embedding)
  // Llama only (GPT-2 keeps the defaults; ValidateGptConfig says so).
  int kv_heads = 0;     // 0: heads
  int ffn = 0;          // MLP width; 0: 4 · d_model
  float rope_theta = 10000.0f;
  float norm_eps = 1e-5f;
  bool tie_embeddings = true;  // GPT-2 always; Llama from the spec (default false)
  // Mixture of Experts (model.moe; proto MoeSpec has the math): 0 experts is
  // a dense model. Block i's MLP is an MoE MLP iff moe_block(i).
  int moe_experts = 0;
  int moe_top_k = 0;
  int moe_every = 1;                 // every_n_layers
  double moe_capacity_factor = 0.0;  // 0: dropless
  float moe_aux_coef = 0.01f;

  bool llama() const { return arch == Arch::kLlama; }
  int head_dim() const { return d_model / heads; }
  int key_value_heads() const { return kv_heads > 0 ? kv_heads : heads; }
  int ffn_dim() const { return ffn > 0 ? ffn : 4 * d_model; }
  bool moe() const { return moe_experts > 0; }
  bool moe_block(int block) const { return moe() && (block + 1) % moe_every == 0; }
};

// The largest model.moe.experts (each expert is a parameter tensor per
// matrix per MoE block, and the dispatch plans hold one row per expert).
inline constexpr int kMaxExperts = 1024;

// The name of the token embedding parameter ("wte" for GPT-2,
// "embed_tokens.weight" for Llama); with a tied head the last pipeline stage
// holds a copy of that name.
const char* TokenEmbeddingName(const GptConfig& config);

// The largest vocabulary: the accuracy count passes token ids as floats
// (kernels::kMaxArgmaxVocab), exact up to 2^24.
inline constexpr int kMaxVocab = 1 << 24;

// Copies the model fields of a JobSpec, defaults filled in (no validation;
// see ValidateGptConfig). An unknown model.arch is left for
// ValidateModelSpec.
GptConfig GptConfigFromSpec(const baton::v1::ModelSpec& spec);

// model.arch as written ("", "gpt2" or "llama") and the Llama fields set
// only for Llama; then GptConfigFromSpec's config validated.
absl::Status ValidateModelSpec(const baton::v1::ModelSpec& spec);

// Positive sizes, heads dividing d_model, vocab at most kMaxVocab; for Llama
// kv_heads dividing heads, an even head_dim, a positive finite rope_theta and
// norm_eps; for GPT-2 the Llama fields at their defaults. Errors name the
// field ("model.heads"), as written in a JobSpec.
absl::Status ValidateGptConfig(const GptConfig& config);

struct BlockRange {
  int first = 0;  // first block index
  int count = 0;  // number of blocks
};

// Contiguous, balanced split of `layers` blocks over `pp` stages; earlier
// stages take the remainder. Errors name "parallel.pp".
absl::StatusOr<std::vector<BlockRange>> SplitLayers(int layers, int pp);

struct StageConfig {
  GptConfig model;
  // The stage's position in the pipeline of model chunks. Without virtual
  // stages a chunk is a pipeline rank; with v virtual stages per rank the
  // pipeline has pp · v chunks and these are the chunk's index and count
  // (see MakeChunkConfig). Chunk 0 holds the embeddings, the last the head.
  int pp_rank = 0;
  int pp_size = 1;
  BlockRange blocks;  // must lie inside [0, model.layers)
  int tp_rank = 0;
  int tp_size = 1;
  // Microbatches per step. The step's objective is the mean over them of each
  // microbatch's mean loss over its scored tokens (targets other than -1), so
  // each microbatch's gradient is scaled by 1 / (scored tokens · microbatches)
  // (see GptStage).
  int microbatches = 1;
  // Shards the token embedding and the tied LM head by vocabulary rows over
  // the TP group (needs model.vocab divisible by tp) instead of replicating
  // them; the loss then takes a two-step sharded cross-entropy.
  bool vocab_parallel = false;
  // Megatron sequence parallelism (parallel.sequence_parallel; needs tp_size
  // > 1): the residual stream, the norms and the biases after the
  // row-parallel GEMMs hold this rank's 1/tp of every microbatch's tokens
  // (rows of the flattened [batch · seq, d_model]; batch · seq must be
  // divisible by tp_size); the TP all-reduces become reduce-scatters and the
  // column-parallel GEMMs' inputs are all-gathered (see GptStage).
  bool sequence_parallel = false;
  uint64_t seed = 0;  // weight initialisation
  absl::Duration comm_timeout = absl::Minutes(5);
  // Where the stage's parameters, gradients, optimizer state and activations
  // live and its ops run (kernels/backend.h). Inputs tokens/targets stay host
  // tensors; activations passed in and out are on this device.
  kernels::Device device;
  // train.precision (kernels/backend.h §6). kBFloat16: GEMM inputs, attention
  // activations and the stage's input/output activations and gradients in
  // bf16; master weights, gradients, AdamW moments, LayerNorm/GELU/softmax/
  // loss math and every reduction in fp32 (see GptStage).
  kernels::Precision precision = kernels::Precision::kFloat32;
  // ZeRO-1 (parallel.zero_stage 1): with dp_size > 1 the stage keeps the
  // AdamW moments of its data-parallel shard only (ParameterStore::
  // ShardOverDp); the executor reduce-scatters the gradients into that shard
  // and all-gathers the values after the optimizer step. dp_size 1: whole.
  int dp_rank = 0;
  int dp_size = 1;
  // Context parallelism (parallel.cp; see GptStage "Context parallelism"):
  // every sequence of model.seq_len tokens is cut into 2 · cp_size chunks and
  // this rank holds chunks cp_rank and 2 · cp_size − 1 − cp_rank (the
  // load-balanced causal split); attention runs as ring attention over the
  // cp group. cp_size 1: whole sequences.
  int cp_rank = 0;
  int cp_size = 1;
  // Expert parallelism (parallel.ep; model.moe only): this rank holds
  // experts [ep_rank · E/ep, (ep_rank + 1) · E/ep) of every MoE block, and
  // the tokens its router sends elsewhere go to the ep group's rank holding
  // their expert and back by all-to-all (see GptStage "Mixture of
  // Experts"). ep_size 1: every expert here.
  int ep_rank = 0;
  int ep_size = 1;

  bool is_first() const { return pp_rank == 0; }
  bool is_last() const { return pp_rank == pp_size - 1; }
};

// train.precision: "fp32" or empty → kFloat32, "bf16" → kBFloat16; anything
// else INVALID_ARGUMENT naming the field and the accepted values.
absl::StatusOr<kernels::Precision> PrecisionFromSpec(const v1::TrainSpec& train);

// The stage config for (pp_rank, tp_rank) of a model split evenly with
// SplitLayers; validated.
absl::StatusOr<StageConfig> MakeStageConfig(const GptConfig& model, int pp_rank, int pp_size,
                                            int tp_rank, int tp_size, uint64_t seed);

// The stage config of model chunk `chunk` of `num_chunks` holding `blocks`, as
// the planner assigns them (any contiguous ranges that tile the model, uneven
// and in chunk order); validated. For interleaved schedules num_chunks =
// pp · virtual_stages. The caller sets microbatches and vocab_parallel.
absl::StatusOr<StageConfig> MakeChunkConfig(const GptConfig& model, int chunk, int num_chunks,
                                            BlockRange blocks, int tp_rank, int tp_size,
                                            uint64_t seed);

// Everything ValidateGptConfig checks, plus: tp dividing heads, kv_heads and
// the MLP width,
// ranks inside their groups, the block range inside the model, a positive
// microbatch count. Errors name the field ("parallel.tp").
absl::Status ValidateStageConfig(const StageConfig& config);

}  // namespace baton::model

#endif  // BATON_WORKER_MODEL_GPT_CONFIG_H_
