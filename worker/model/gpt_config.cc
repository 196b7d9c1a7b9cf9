#include "worker/model/gpt_config.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace baton::model {
namespace {

absl::Status Invalid(absl::string_view field, const absl::AlphaNum& value, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(field, " = ", value, ": ", why));
}

// model.moe: moe_experts 0 is a dense model (the other fields unused).
absl::Status ValidateMoe(const GptConfig& c) {
  if (c.moe_experts == 0) return absl::OkStatus();
  if (c.moe_experts < 2 || c.moe_experts > kMaxExperts) {
    return Invalid("model.moe.experts", c.moe_experts,
                   absl::StrCat("must be in [2, ", kMaxExperts, "] (leave model.moe unset for a dense model)"));
  }
  if (c.moe_top_k < 1 || c.moe_top_k > c.moe_experts) {
    return Invalid("model.moe.top_k", c.moe_top_k,
                   absl::StrCat("must be in [1, model.moe.experts = ", c.moe_experts, "]: the experts each token is sent to"));
  }
  if (c.moe_every < 1 || c.moe_every > c.layers) {
    return Invalid("model.moe.every_n_layers", c.moe_every,
                   absl::StrCat("must be in [1, model.layers = ", c.layers, "] (1, or unset: every block is an MoE block)"));
  }
  if (!std::isfinite(c.moe_capacity_factor) || c.moe_capacity_factor < 0 || c.moe_capacity_factor > 1e6) {
    return Invalid("model.moe.capacity_factor", c.moe_capacity_factor,
                   "must be a finite number >= 0 (0: dropless, every choice kept; 1.25: each expert takes 1.25x its even share)");
  }
  if (!std::isfinite(c.moe_aux_coef) || c.moe_aux_coef < 0) {
    return Invalid("model.moe.aux_loss_coef", c.moe_aux_coef, "must be a finite number >= 0 (Switch: 0.01)");
  }
  return absl::OkStatus();
}

}  // namespace

const char* TokenEmbeddingName(const GptConfig& config) {
  return config.llama() ? "embed_tokens.weight" : "wte";
}

GptConfig GptConfigFromSpec(const baton::v1::ModelSpec& spec) {
  GptConfig config;
  config.arch = spec.arch() == "llama" ? Arch::kLlama : Arch::kGpt2;
  config.layers = spec.layers();
  config.d_model = spec.d_model();
  config.heads = spec.heads();
  config.vocab = spec.vocab();
  config.seq_len = spec.seq_len();
  if (spec.has_kv_heads()) config.kv_heads = spec.kv_heads();
  if (spec.has_ffn_dim()) config.ffn = spec.ffn_dim();
  if (spec.has_rope_theta()) config.rope_theta = spec.rope_theta();
  if (spec.has_norm_eps()) config.norm_eps = spec.norm_eps();
  config.tie_embeddings = config.llama() ? spec.tie_embeddings() : true;
  if (!config.llama() && spec.has_tie_embeddings()) config.tie_embeddings = spec.tie_embeddings();
  if (spec.has_moe()) {
    const baton::v1::MoeSpec& moe = spec.moe();
    config.moe_experts = moe.experts();
    config.moe_top_k = moe.top_k();
    config.moe_every = moe.every_n_layers() == 0 ? 1 : moe.every_n_layers();
    config.moe_capacity_factor = moe.capacity_factor();
    if (moe.has_aux_loss_coef()) config.moe_aux_coef = moe.aux_loss_coef();
  }
  return config;
}

absl::Status ValidateModelSpec(const baton::v1::ModelSpec& spec) {
  if (!spec.arch().empty() && spec.arch() != "gpt2" && spec.arch() != "llama") {
    return Invalid("model.arch", absl::StrCat("\"", spec.arch(), "\""), "want \"gpt2\" (the default) or \"llama\"");
  }
  if (spec.has_kv_heads() && spec.kv_heads() <= 0) {
    return Invalid("model.kv_heads", spec.kv_heads(), "must be positive (leave it unset for model.heads)");
  }
  if (spec.has_ffn_dim() && spec.ffn_dim() <= 0) {
    return Invalid("model.ffn_dim", spec.ffn_dim(), "must be positive (leave it unset for 4 * model.d_model)");
  }
  return ValidateGptConfig(GptConfigFromSpec(spec));
}

absl::Status ValidateGptConfig(const GptConfig& c) {
  if (c.layers <= 0) return Invalid("model.layers", c.layers, "must be positive");
  if (c.d_model <= 0) return Invalid("model.d_model", c.d_model, "must be positive");
  if (c.heads <= 0) return Invalid("model.heads", c.heads, "must be positive");
  if (c.vocab <= 0) return Invalid("model.vocab", c.vocab, "must be positive");
  if (c.seq_len <= 0) return Invalid("model.seq_len", c.seq_len, "must be positive");
  if (c.vocab > kMaxVocab) {
    return Invalid("model.vocab", c.vocab, absl::StrCat("must be at most ", kMaxVocab));
  }
  if (c.d_model % c.heads != 0) {
    return Invalid("model.heads", c.heads, absl::StrCat("must divide model.d_model = ", c.d_model));
  }
  if (c.ffn_dim() <= 0) return Invalid("model.ffn_dim", c.ffn_dim(), "must be positive");
  BATON_RETURN_IF_ERROR(ValidateMoe(c));
  if (!c.llama()) {
    // GPT-2 has none of Llama's knobs; a set one is a mistake, not ignored.
    if (c.kv_heads != 0 && c.kv_heads != c.heads) {
      return Invalid("model.kv_heads", c.kv_heads, "is a Llama field; GPT-2 attention has model.heads key/value heads (set model.arch = \"llama\" or leave it unset)");
    }
    if (c.ffn_dim() != 4 * c.d_model) {
      return Invalid("model.ffn_dim", c.ffn_dim(), absl::StrCat("GPT-2's MLP is 4 * model.d_model = ", 4 * c.d_model, " wide (set model.arch = \"llama\" for another width, or leave it unset)"));
    }
    if (c.rope_theta != 10000.0f) return Invalid("model.rope_theta", c.rope_theta, "is a Llama field; GPT-2 has learned positions (leave it unset)");
    if (c.norm_eps != 1e-5f) return Invalid("model.norm_eps", c.norm_eps, "GPT-2's LayerNorm epsilon is 1e-5 (leave it unset)");
    if (!c.tie_embeddings) return Invalid("model.tie_embeddings", "false", "GPT-2's LM head is its token embedding (leave it unset)");
    return absl::OkStatus();
  }
  const int kv = c.key_value_heads();
  if (kv <= 0 || c.heads % kv != 0) {
    return Invalid("model.kv_heads", kv, absl::StrCat("must divide model.heads = ", c.heads, " (grouped-query attention shares each key/value head among heads / kv_heads query heads)"));
  }
  if (c.head_dim() % 2 != 0) {
    return Invalid("model.heads", c.heads, absl::StrCat("makes head_dim = d_model / heads = ", c.head_dim(), " odd; rotary embeddings rotate pairs, so choose heads that makes it even"));
  }
  if (!std::isfinite(c.rope_theta) || c.rope_theta <= 1.0f) {
    return Invalid("model.rope_theta", c.rope_theta, "must be a finite number > 1 (Llama 2: 10000, Llama 3: 500000)");
  }
  if (!std::isfinite(c.norm_eps) || c.norm_eps <= 0.0f || c.norm_eps > 1.0f) {
    return Invalid("model.norm_eps", c.norm_eps, "must be a finite number in (0, 1] (Llama: 1e-5 or 1e-6)");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<BlockRange>> SplitLayers(int layers, int pp) {
  if (pp <= 0) return Invalid("parallel.pp", pp, "must be positive");
  if (pp > layers) {
    return Invalid(
        "parallel.pp", pp,
        absl::StrCat("more stages than model.layers = ", layers, "; every stage needs a block"));
  }
  std::vector<BlockRange> ranges(pp);
  int next = 0;
  for (int s = 0; s < pp; ++s) {
    ranges[s].first = next;
    ranges[s].count = layers / pp + (s < layers % pp ? 1 : 0);
    next += ranges[s].count;
  }
  return ranges;
}

absl::StatusOr<StageConfig> MakeStageConfig(const GptConfig& model, int pp_rank, int pp_size,
                                            int tp_rank, int tp_size, uint64_t seed) {
  BATON_RETURN_IF_ERROR(ValidateGptConfig(model));
  BATON_ASSIGN_OR_RETURN(std::vector<BlockRange> ranges, SplitLayers(model.layers, pp_size));
  if (pp_rank < 0 || pp_rank >= pp_size) {
    return Invalid("pp_rank", pp_rank, absl::StrCat("outside [0, ", pp_size, ")"));
  }
  StageConfig config;
  config.model = model;
  config.pp_rank = pp_rank;
  config.pp_size = pp_size;
  config.blocks = ranges[pp_rank];
  config.tp_rank = tp_rank;
  config.tp_size = tp_size;
  config.seed = seed;
  BATON_RETURN_IF_ERROR(ValidateStageConfig(config));
  return config;
}

absl::StatusOr<StageConfig> MakeChunkConfig(const GptConfig& model, int chunk, int num_chunks,
                                            BlockRange blocks, int tp_rank, int tp_size,
                                            uint64_t seed) {
  StageConfig config;
  config.model = model;
  config.pp_rank = chunk;
  config.pp_size = num_chunks;
  config.blocks = blocks;
  config.tp_rank = tp_rank;
  config.tp_size = tp_size;
  config.seed = seed;
  BATON_RETURN_IF_ERROR_CTX(ValidateStageConfig(config), "model chunk ", chunk, " of ",
                            num_chunks);
  return config;
}

absl::Status ValidateStageConfig(const StageConfig& c) {
  BATON_RETURN_IF_ERROR(ValidateGptConfig(c.model));
  if (c.pp_size <= 0) return Invalid("parallel.pp", c.pp_size, "must be positive");
  if (c.pp_rank < 0 || c.pp_rank >= c.pp_size) {
    return Invalid("pp_rank", c.pp_rank, absl::StrCat("outside [0, ", c.pp_size, ")"));
  }
  if (c.tp_size <= 0) return Invalid("parallel.tp", c.tp_size, "must be positive");
  if (c.model.heads % c.tp_size != 0) {
    return Invalid("parallel.tp", c.tp_size,
                   absl::StrCat("must divide model.heads = ", c.model.heads));
  }
  if (c.model.ffn_dim() % c.tp_size != 0) {
    return Invalid("parallel.tp", c.tp_size,
                   absl::StrCat("must divide the MLP width ", c.model.llama() ? "model.ffn_dim" : "4 * model.d_model",
                                " = ", c.model.ffn_dim()));
  }
  if (c.model.key_value_heads() % c.tp_size != 0) {
    return Invalid("parallel.tp", c.tp_size,
                   absl::StrCat("must divide model.kv_heads = ", c.model.key_value_heads(),
                                " (each tensor-parallel rank holds whole key/value heads)"));
  }
  if (c.vocab_parallel && c.model.vocab % c.tp_size != 0) {
    return Invalid("model.vocab", c.model.vocab,
                   absl::StrCat("must be divisible by parallel.tp = ", c.tp_size,
                                " for a vocabulary-parallel embedding"));
  }
  if (c.sequence_parallel && c.tp_size < 2) {
    return Invalid("parallel.sequence_parallel", "true",
                   absl::StrCat("shards the sequence over the tensor-parallel group, but parallel.tp = ", c.tp_size,
                                ": set tp >= 2 or sequence_parallel false"));
  }
  if (c.ep_size <= 0) return Invalid("parallel.ep", c.ep_size, "must be positive");
  if (c.ep_rank < 0 || c.ep_rank >= c.ep_size) {
    return Invalid("ep_rank", c.ep_rank, absl::StrCat("outside [0, ", c.ep_size, ")"));
  }
  if (c.ep_size > 1 && !c.model.moe()) {
    return Invalid("parallel.ep", c.ep_size, "splits the experts of model.moe, which is unset; leave ep unset");
  }
  if (c.ep_size > 1 && c.model.moe_experts % c.ep_size != 0) {
    return Invalid("parallel.ep", c.ep_size,
                   absl::StrCat("must divide model.moe.experts = ", c.model.moe_experts,
                                " (each expert-parallel rank holds experts / ep whole experts)"));
  }
  if (c.cp_size <= 0) return Invalid("parallel.cp", c.cp_size, "must be positive");
  if (c.cp_rank < 0 || c.cp_rank >= c.cp_size) {
    return Invalid("cp_rank", c.cp_rank, absl::StrCat("outside [0, ", c.cp_size, ")"));
  }
  if (c.cp_size > 1 && c.model.seq_len % (2 * c.cp_size) != 0) {
    return Invalid("model.seq_len", c.model.seq_len,
                   absl::StrCat("must be divisible by 2 * parallel.cp = ", 2 * c.cp_size,
                                " (each context-parallel rank holds two of the sequence's 2 * cp chunks)"));
  }
  if (c.tp_rank < 0 || c.tp_rank >= c.tp_size) {
    return Invalid("tp_rank", c.tp_rank, absl::StrCat("outside [0, ", c.tp_size, ")"));
  }
  if (c.blocks.first < 0 || c.blocks.count < 0 ||
      c.blocks.first + c.blocks.count > c.model.layers) {
    return Invalid("blocks",
                   absl::StrCat("[", c.blocks.first, ", ", c.blocks.first + c.blocks.count, ")"),
                   absl::StrCat("outside the model's ", c.model.layers, " layers"));
  }
  if (c.is_first() != (c.blocks.first == 0) && c.blocks.count > 0) {
    return Invalid("blocks.first", c.blocks.first,
                   "the first pipeline stage must start at block 0 and no other may");
  }
  if (c.is_last() && c.blocks.first + c.blocks.count != c.model.layers) {
    return Invalid(
        "blocks", c.blocks.first + c.blocks.count,
        absl::StrCat("the last pipeline stage must end at model.layers = ", c.model.layers));
  }
  if (c.microbatches <= 0) {
    return Invalid("schedule.microbatches", c.microbatches, "must be positive");
  }
  return absl::OkStatus();
}

absl::StatusOr<kernels::Precision> PrecisionFromSpec(const v1::TrainSpec& train) {
  if (train.precision().empty() || train.precision() == "fp32") return kernels::Precision::kFloat32;
  if (train.precision() == "bf16") return kernels::Precision::kBFloat16;
  return absl::InvalidArgumentError(absl::StrCat("train.precision: is \"", train.precision(),
                                                 "\"; want \"fp32\" or \"bf16\""));
}

}  // namespace baton::model
