// Hugging Face GPT-2 and Llama interop (docs/checkpoints.md, "Hugging Face
// checkpoints"): a transformers GPT-2 or Llama model directory (config.json
// and model.safetensors, or model.safetensors.index.json and its shards)
// read into baton's tensors, written as a complete v2 checkpoint a job
// resumes from, and a baton checkpoint of any layout written back as a
// directory `GPT2LMHeadModel.from_pretrained` or
// `LlamaForCausalLM.from_pretrained` loads.
//
// GPT-2 (model_type "gpt2"): HF `transformer.<name>` is baton's `<name>`
// (`wte.weight` and `wpe.weight` are `wte` and `wpe`); the Conv1D weights
// (`attn.c_attn`, `attn.c_proj`, `mlp.c_fc`, `mlp.c_proj`), stored [in, out]
// by HF, are transposed to baton's [out, in]; the LM head is the token
// embedding (HF `lm_head.weight`, when stored, must equal it); baton's `wpe`
// holds the first seq_len of HF's n_positions rows. The `attn.bias` /
// `attn.masked_bias` buffers of older saves (the causal mask) are skipped on
// import and not written on export (transformers rebuilds them).
//
// Llama (model_type "llama"): HF `model.<name>` is baton's `<name>`
// (`embed_tokens.weight`, `layers.N.self_attn.q_proj.weight`, ...,
// `norm.weight`), `lm_head.weight` is `lm_head.weight` (untied models only;
// tied, a stored copy must equal the embedding); every matrix is [out, in]
// in both, so nothing is transposed, and HF's rotate-half rotary embedding
// is baton's, so q and k are not permuted. There is no position table:
// seq_len (max_position_embeddings, or --seq_len) only bounds the sequence.
// The `rotary_emb.inv_freq` buffers of older saves are skipped.
//
// Every size is bounded before anything is allocated (config fields, file
// sizes against what the config implies, each tensor's shape against the
// config), and every bad input is an error naming the file and the tensor or
// field to fix, never a crash.
#ifndef BATON_CLI_HF_CHECKPOINT_H_
#define BATON_CLI_HF_CHECKPOINT_H_

#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/checkpoint_manifest.h"

namespace baton::cli {

// The model a transformers config.json describes, as baton's model shape.
// INVALID_ARGUMENT naming DIR/config.json and the field for a model_type
// other than gpt2 (also when absent) or llama, sizes out of range, and
// anything baton cannot represent.
//
// GPT-2 (arch "gpt2", seq_len = n_positions): an activation other than the
// tanh GELU (gelu_new), a layer_norm_epsilon other than 1e-5, n_inner other
// than 4·n_embd, an untied LM head (tie_word_embeddings false),
// scale_attn_weights false, scale_attn_by_inverse_layer_idx,
// reorder_and_upcast_attn, add_cross_attention.
//
// Llama (arch "llama"): hidden_size, num_hidden_layers, num_attention_heads,
// num_key_value_heads (absent: the heads), intermediate_size, vocab_size,
// max_position_embeddings (seq_len), rms_norm_eps (absent: 1e-6, as
// LlamaConfig), rope_theta (absent: 10000), tie_word_embeddings (absent:
// false). Refused: hidden_act other than silu, attention_bias or mlp_bias
// true, rope_scaling other than null, head_dim other than hidden_size /
// num_attention_heads, pretraining_tp other than 1, kv heads that do not
// divide the heads, an odd head dimension.
absl::StatusOr<checkpoint::ModelShape> ReadHfConfig(const std::string& hf_dir);

// The `model { ... }` block of a job spec (proto/baton/v1/job.proto) that
// trains `model`, every field set (a Llama's kv_heads, ffn_dim, rope_theta,
// norm_eps, tie_embeddings included), for `--resume` from its import.
std::string JobModelBlock(const checkpoint::ModelShape& model);

// The weights of the model in `hf_dir`, under baton's names and in baton's
// layout (values only), for `model` = ReadHfConfig(hf_dir) with seq_len at
// most its n_positions / max_position_embeddings (GPT-2's wpe keeps the
// first seq_len rows). F32, F16 and BF16 tensors are read (converted to f32
// exactly). Errors name the file and the tensor: missing, of another shape
// or dtype, unknown, listed twice, in a shard that is missing or truncated,
// a tied model's lm_head.weight that differs from the token embedding.
absl::StatusOr<std::map<std::string, checkpoint::FullTensor>> ReadHfWeights(
    const std::string& hf_dir, const checkpoint::ModelShape& model);

struct HfImportOptions {
  // GPT-2: rows of wpe to keep; Llama: the longest sequence. 0: n_positions
  // or max_position_embeddings.
  int seq_len = 0;
  bool force = false;  // replace a non-empty `out_dir`
};
// `batonctl checkpoint import-hf`: writes `out_dir` as a complete (v2)
// checkpoint — one chunk, tp 1, zero AdamW moments, optimizer step 0, step 0,
// a manifest with the model — and returns the model. The checkpoint is built
// under a temporary name beside `out_dir` and renamed into place, so a
// failure never leaves a partial checkpoint under the final name; a
// non-empty `out_dir` is refused (FAILED_PRECONDITION) unless `force`.
absl::StatusOr<checkpoint::ModelShape> ImportHfCheckpoint(const std::string& hf_dir,
                                                          const std::string& out_dir,
                                                          const HfImportOptions& options);

// `batonctl checkpoint export-hf`: gathers the checkpoint in `checkpoint_dir`
// (any layout; a checkpoint.dir root picks its newest complete step) and
// writes `out_dir` with config.json and model.safetensors (F32, HF names).
// GPT-2: Conv1D layout, no lm_head.weight (transformers ties it). Llama:
// config.json for LlamaForCausalLM (every field ReadHfConfig reads,
// max_position_embeddings = seq_len, torch_dtype float32), lm_head.weight
// only when untied. Same temporary name, rename and `force` rule as the
// import. Refuses a checkpoint whose manifest holds no GPT model (v1,
// synthetic), a Llama without its fields, or an MoE model (model.moe:
// "MoE export is not supported yet"), before reading any shard.
absl::StatusOr<checkpoint::ModelShape> ExportHfCheckpoint(const std::string& checkpoint_dir,
                                                          const std::string& out_dir, bool force);

}  // namespace baton::cli

#endif  // BATON_CLI_HF_CHECKPOINT_H_
