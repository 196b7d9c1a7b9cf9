// Hugging Face GPT-2 interop (docs/checkpoints.md, "Hugging Face
// checkpoints"): a transformers GPT-2 model directory (config.json and
// model.safetensors, or model.safetensors.index.json and its shards) read
// into baton's tensors, written as a complete v2 checkpoint a job resumes
// from, and a baton checkpoint of any layout written back as a directory
// `GPT2LMHeadModel.from_pretrained` loads.
//
// The mapping: HF `transformer.<name>` is baton's `<name>` (`wte.weight` and
// `wpe.weight` are `wte` and `wpe`); the Conv1D weights (`attn.c_attn`,
// `attn.c_proj`, `mlp.c_fc`, `mlp.c_proj`), stored [in, out] by HF, are
// transposed to baton's [out, in]; the LM head is the token embedding
// (HF `lm_head.weight`, when stored, must equal it); baton's `wpe` holds the
// first seq_len of HF's n_positions rows. The `attn.bias` / `attn.masked_bias`
// buffers of older saves (the causal mask) are skipped on import and not
// written on export (transformers rebuilds them).
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

// The GPT-2 a transformers config.json describes, as baton's model shape
// (seq_len = n_positions). INVALID_ARGUMENT naming DIR/config.json and the
// field for anything baton's GPT-2 cannot represent: a model_type other than
// gpt2, an activation other than the tanh GELU (gelu_new), a
// layer_norm_epsilon other than 1e-5, n_inner other than 4·n_embd, an untied
// LM head (tie_word_embeddings false), scale_attn_weights false,
// scale_attn_by_inverse_layer_idx, reorder_and_upcast_attn,
// add_cross_attention, or sizes out of range.
absl::StatusOr<checkpoint::ModelShape> ReadHfConfig(const std::string& hf_dir);

// The weights of the model in `hf_dir`, under baton's names and in baton's
// layout (values only), for `model` = ReadHfConfig(hf_dir) with seq_len at
// most its n_positions (wpe keeps the first seq_len rows). F32, F16 and BF16
// tensors are read (converted to f32 exactly). Errors name the file and the
// tensor: missing, of another shape or dtype, unknown, listed twice, in a
// shard that is missing or truncated, an lm_head.weight that differs from
// the token embedding.
absl::StatusOr<std::map<std::string, checkpoint::FullTensor>> ReadHfWeights(
    const std::string& hf_dir, const checkpoint::ModelShape& model);

struct HfImportOptions {
  int seq_len = 0;     // rows of wpe to keep; 0: n_positions
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
// writes `out_dir` with config.json and model.safetensors (F32, HF names,
// Conv1D layout, no lm_head.weight: transformers ties it). Same temporary
// name, rename and `force` rule as the import. Refuses a checkpoint whose
// manifest holds no GPT model (v1, synthetic).
absl::StatusOr<checkpoint::ModelShape> ExportHfCheckpoint(const std::string& checkpoint_dir,
                                                          const std::string& out_dir, bool force);

}  // namespace baton::cli

#endif  // BATON_CLI_HF_CHECKPOINT_H_
