#include "worker/model/gpt_stage.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/backend.h"
#include "worker/model/comm_buffer.h"
#include "worker/model/context_parallel.h"

namespace baton::model {

using kernels::Shape;
using kernels::Tensor;

// One transformer block: a norm, attention and its output projection (the
// attention sub-block), a norm and the MLP (the MLP sub-block). GPT-2: Layer-
// Norm, fused qkv with biases, GELU MLP with biases. Llama: RMSNorm (no
// bias: *_b null), q/k/v projections with rotary positions and grouped-
// query heads (qkv_w null), SwiGLU MLP gate/up/down (fc_w = gate, fc2_w =
// down), no biases.
struct GptStage::Block {
  int index = 0;
  Parameter *ln1_w = nullptr, *ln1_b = nullptr, *qkv_w = nullptr, *qkv_b = nullptr;
  Parameter *proj_w = nullptr, *proj_b = nullptr;
  Parameter *ln2_w = nullptr, *ln2_b = nullptr, *fc_w = nullptr, *fc_b = nullptr;
  Parameter *fc2_w = nullptr, *fc2_b = nullptr;
  Parameter *q_w = nullptr, *k_w = nullptr, *v_w = nullptr, *up_w = nullptr;  // Llama
  // An MoE block (GptConfig::moe_block): the router and each expert's MLP
  // (fc = GPT-2's c_fc / Llama's w1, up = w3, fc2 = c_proj / w2); the dense
  // MLP's pointers stay null.
  struct Expert {
    Parameter *fc = nullptr, *up = nullptr, *fc2 = nullptr;
  };
  Parameter* router = nullptr;
  std::vector<Expert> experts;
  bool moe() const { return router != nullptr; }
};

// One expert's rows of an MoE block's compute buffers: `expert` is its index
// among this rank's experts (Block::experts).
struct GptStage::ExpertRows {
  int expert = 0;
  int64_t row = 0, rows = 0;
};

// What one block keeps from forward for backward, and the output gradients
// BackwardInput keeps for BackwardWeight. All views into the microbatch arena.
// Llama: h is the gate, up the up projection, g silu(gate) · up; q, k, v the
// projections before RopePack; dh / dup their gradients as the GEMMs take
// them, dq / dk / dv those of the projections.
struct GptStage::BlockActivations {
  Tensor x_in, ln1, mean1, rstd1, qkv, att, y, x_mid, ln2, mean2, rstd2, h, g, x_out;
  Tensor d_out, d_mid, dh, dqkv;
  Tensor q, k, v, up, dup, dq, dk, dv;  // Llama
  // MoE (see MoeForward): the router's probabilities [n, E], choices and
  // gates [n, K], their buffer rows [n, K], the load-balancing loss's logit
  // gradient [n, E]; the expert buffers [E, cap, ·] (h, up, g as the dense
  // MLP's, per expert row) and the rows each expert got; backward's expert
  // output gradients and router logit gradient.
  Tensor probs, expert, gate, slot, dlogits_aux, expert_in, expert_out, dexpert_out, dlogits;
  int64_t cap = 0;
  // The rows this rank's experts computed (expert_rows_in, and h, up, g,
  // dexpert_out, dh, dup in the same rows): this rank's buffer without EP;
  // under EP what the all-to-all brought, ep_recv_rows from each ep rank
  // (ep_send_rows to each: what goes the other way).
  Tensor expert_rows_in;
  std::vector<ExpertRows> expert_rows;
  std::vector<int64_t> ep_send_rows, ep_recv_rows;
  // Under EP: every ep rank's kept rows per expert, [ep][E] (rank s's row
  // is what its buffer holds of each expert; only those rows travel).
  std::vector<int64_t> ep_kept;
};

struct GptStage::Microbatch {
  Microbatch(kernels::Device device, std::string what) : arena(device, std::move(what)) {}
  kernels::Arena arena;
  int64_t batch = 0, seq = 0;
  Tensor tokens, targets;
  Tensor x0;  // stage input
  std::vector<BlockActivations> blocks;
  Tensor xf, meanf, rstdf, dlogits;  // last stage
  Tensor dlogits_gemm;               // dlogits as the head's GEMMs take it (bf16 or itself)
  Tensor d_x0;                       // gradient of the stage input
  bool backward_input_done = false;
};

namespace {

// Half `half` of a tensor of a CP view (context_parallel.h): rows [half · R,
// (half + 1) · R) of its 2R rows, whether they are the view's sequences
// ([2B, ...]) or their tokens ([2B · T, ...]).
Tensor Half(const Tensor& t, int half) {
  const int64_t rows = t.dim(0) / 2;
  return t.Rows(half * rows, (half + 1) * rows);
}

// The experts (global indices, ascending) this rank holds: all, or its ep
// rank's E/ep.
std::vector<int> LocalExperts(const StageConfig& config) {
  const int local = config.model.moe_experts / std::max(1, config.ep_size);
  std::vector<int> experts(local);
  for (int l = 0; l < local; ++l) experts[l] = config.ep_rank * local + l;
  return experts;
}

int64_t Sum(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t{0}); }

constexpr float kInitStd = 0.02f;
static_assert(kMaxVocab <= kernels::kMaxArgmaxVocab, "token ids must pass exactly as floats");

// A copy of `src` (host or device) in the arena, enqueued on ctx's stream.
absl::StatusOr<Tensor> Copy(const kernels::ExecContext& ctx, kernels::Arena& arena, const Tensor& src,
                            Shape shape) {
  BATON_ASSIGN_OR_RETURN(Tensor dst, arena.Allocate(std::move(shape), src.dtype()));
  kernels::Copy(ctx, dst, src);
  return dst;
}

constexpr absl::string_view kOutOfMemoryAdvice =
    "; lower train.micro_batch_size or model.seq_len, or use more pipeline stages (parallel.pp) or tensor "
    "parallelism (parallel.tp)";

// What to change when a stage's parameters, gradients and AdamW moments do
// not fit (the micro-batch size does not matter there).
constexpr absl::string_view kParameterMemoryAdvice =
    "; use more pipeline stages (parallel.pp) or tensor parallelism (parallel.tp), or a smaller model";

// `status` with `context`; out of memory, it also says what to change for the
// parameters.
absl::Status ParameterError(const absl::Status& status, const std::string& context) {
  absl::Status s = WithContext(status, context);
  if (!kernels::IsOutOfMemory(s)) return s;
  return kernels::OutOfMemoryError(absl::StrCat(s.message(), kParameterMemoryAdvice));
}

// `status` with `context`; an activation arena out of device memory also says
// what the operator can change.
absl::Status ActivationError(const absl::Status& status, const std::string& context) {
  return WithOutOfMemoryAdvice(WithContext(status, context));
}

}  // namespace

absl::Status WithOutOfMemoryAdvice(const absl::Status& status) {
  // Other exhausted resources (a communicator's bound on early messages, a
  // workspace over its bound) say what to change themselves.
  if (!kernels::IsOutOfMemory(status) || absl::StrContains(status.message(), kOutOfMemoryAdvice) ||
      absl::StrContains(status.message(), kParameterMemoryAdvice)) {
    return status;
  }
  return kernels::OutOfMemoryError(absl::StrCat(status.message(), kOutOfMemoryAdvice));
}

namespace {
std::vector<ParameterSpec> LlamaParameterSpecs(const StageConfig& config);
}  // namespace

namespace {
std::vector<ParameterSpec> GptParameterSpecs(const StageConfig& config);
}  // namespace

std::vector<ParameterSpec> StageParameterSpecs(const StageConfig& config) {
  std::vector<ParameterSpec> specs = config.model.llama() ? LlamaParameterSpecs(config) : GptParameterSpecs(config);
  if (config.ep_size > 1) {
    // Expert parallelism: this rank's experts last (the tail the executor
    // reduces over the expert-data-parallel group), each part in model
    // order. The dense parameters are the same on every rank of the expert
    // group; the group's rank 0 counts them in the global norm, every rank
    // its own experts (the coordinator adds the group's ranks).
    std::stable_partition(specs.begin(), specs.end(), [](const ParameterSpec& s) { return !s.expert; });
    if (config.ep_rank != 0) {
      for (ParameterSpec& s : specs) s.counts_in_norm &= s.expert;
    }
  }
  return specs;
}

namespace {

std::vector<ParameterSpec> GptParameterSpecs(const StageConfig& config) {
  const GptConfig& m = config.model;
  const int64_t c = m.d_model, f = m.ffn_dim();
  const bool tp0 = config.tp_rank == 0;
  std::vector<ParameterSpec> specs;
  auto replicated = [&](std::string name, Shape shape, InitKind init, float std, bool decay) {
    ParameterSpec s;
    s.name = std::move(name);
    s.shard = ShardSpec::Replicated(kernels::NumElements(shape));
    s.full_shape = std::move(shape);
    s.init = init;
    s.init_std = std;
    s.weight_decay = decay;
    s.counts_in_norm = tp0;
    specs.push_back(std::move(s));
  };
  auto sharded = [&](std::string name, Shape shape, ShardSpec shard, InitKind init, float std,
                     bool decay) {
    ParameterSpec s;
    s.name = std::move(name);
    s.full_shape = std::move(shape);
    s.shard = shard;
    s.init = init;
    s.init_std = std;
    s.weight_decay = decay;
    specs.push_back(std::move(s));
  };
  auto token_embedding = [&] {
    if (config.vocab_parallel) {
      sharded("wte", {m.vocab, c}, ShardSpec::Rows(m.vocab, c), InitKind::kNormal, kInitStd, true);
    } else {
      replicated("wte", {m.vocab, c}, InitKind::kNormal, kInitStd, true);
    }
    // The LM head's GEMM weight (the first stage only looks rows up).
    specs.back().gemm_weight = config.is_last();
  };
  auto gemm_weight = [&] { specs.back().gemm_weight = true; };
  if (config.is_first()) {
    token_embedding();
    replicated("wpe", {m.seq_len, c}, InitKind::kNormal, kInitStd, true);
  }
  // GPT-2 scales the init of the projections into the residual stream.
  const float proj_std = kInitStd / std::sqrt(2.0f * static_cast<float>(m.layers));
  for (int i = config.blocks.first; i < config.blocks.first + config.blocks.count; ++i) {
    const std::string p = absl::StrCat("h.", i, ".");
    replicated(p + "ln_1.weight", {c}, InitKind::kOnes, 0, false);
    replicated(p + "ln_1.bias", {c}, InitKind::kZeros, 0, false);
    sharded(p + "attn.c_attn.weight", {3 * c, c}, ShardSpec::QkvRows(c, c), InitKind::kNormal,
            kInitStd, true);
    gemm_weight();
    sharded(p + "attn.c_attn.bias", {3 * c}, ShardSpec::QkvRows(c, 1), InitKind::kZeros, 0, false);
    sharded(p + "attn.c_proj.weight", {c, c}, ShardSpec::Columns(c, c), InitKind::kNormal, proj_std,
            true);
    gemm_weight();
    replicated(p + "attn.c_proj.bias", {c}, InitKind::kZeros, 0, false);
    replicated(p + "ln_2.weight", {c}, InitKind::kOnes, 0, false);
    replicated(p + "ln_2.bias", {c}, InitKind::kZeros, 0, false);
    if (m.moe_block(i)) {
      // Bias-free experts behind a replicated router (see MoeForward).
      replicated(p + "mlp.router.weight", {m.moe_experts, c}, InitKind::kNormal, kInitStd, true);
      gemm_weight();
      for (const int e : LocalExperts(config)) {
        const std::string x = absl::StrCat(p, "mlp.experts.", e, ".");
        sharded(x + "c_fc.weight", {f, c}, ShardSpec::Rows(f, c), InitKind::kNormal, kInitStd, true);
        gemm_weight();
        sharded(x + "c_proj.weight", {c, f}, ShardSpec::Columns(c, f), InitKind::kNormal, proj_std, true);
        gemm_weight();
        specs[specs.size() - 2].expert = specs.back().expert = true;
      }
      continue;
    }
    sharded(p + "mlp.c_fc.weight", {f, c}, ShardSpec::Rows(f, c), InitKind::kNormal, kInitStd,
            true);
    gemm_weight();
    sharded(p + "mlp.c_fc.bias", {f}, ShardSpec::Rows(f, 1), InitKind::kZeros, 0, false);
    sharded(p + "mlp.c_proj.weight", {c, f}, ShardSpec::Columns(c, f), InitKind::kNormal, proj_std,
            true);
    gemm_weight();
    replicated(p + "mlp.c_proj.bias", {c}, InitKind::kZeros, 0, false);
  }
  if (config.is_last()) {
    replicated("ln_f.weight", {c}, InitKind::kOnes, 0, false);
    replicated("ln_f.bias", {c}, InitKind::kZeros, 0, false);
    if (!config.is_first()) {
      // The head's copy of the tied embedding; the first stage counts it.
      token_embedding();
      specs.back().counts_in_norm = false;
    }
  }
  return specs;
}

// Llama's parameters under Hugging Face's names less "model." (so import and
// export map them one to one; every matrix [out, in] as torch stores it).
// Initialisation as transformers' LlamaPreTrainedModel: N(0, 0.02) for every
// matrix, RMSNorm weights 1.
std::vector<ParameterSpec> LlamaParameterSpecs(const StageConfig& config) {
  const GptConfig& m = config.model;
  const int64_t c = m.d_model, f = m.ffn_dim(), hd = m.head_dim();
  const int64_t qc = int64_t{m.heads} * hd, kvc = int64_t{m.key_value_heads()} * hd;
  const bool tp0 = config.tp_rank == 0;
  std::vector<ParameterSpec> specs;
  auto add = [&](std::string name, Shape shape, ShardSpec shard, bool matrix) {
    ParameterSpec s;
    s.name = std::move(name);
    s.full_shape = std::move(shape);
    s.shard = shard;
    s.init = matrix ? InitKind::kNormal : InitKind::kOnes;
    s.init_std = matrix ? kInitStd : 0.0f;
    s.weight_decay = matrix;
    s.counts_in_norm = !shard.replicated || tp0;
    s.gemm_weight = matrix;
    specs.push_back(std::move(s));
  };
  auto vocab_rows = [&] {
    return config.vocab_parallel ? ShardSpec::Rows(m.vocab, c) : ShardSpec::Replicated(int64_t{m.vocab} * c);
  };
  if (config.is_first()) {
    add("embed_tokens.weight", {m.vocab, c}, vocab_rows(), true);
    // The first stage only looks rows up; a tied head on the same stage
    // multiplies by it.
    specs.back().gemm_weight = config.is_last() && m.tie_embeddings;
  }
  for (int i = config.blocks.first; i < config.blocks.first + config.blocks.count; ++i) {
    const std::string p = absl::StrCat("layers.", i, ".");
    add(p + "input_layernorm.weight", {c}, ShardSpec::Replicated(c), false);
    add(p + "self_attn.q_proj.weight", {qc, c}, ShardSpec::Rows(qc, c), true);
    add(p + "self_attn.k_proj.weight", {kvc, c}, ShardSpec::Rows(kvc, c), true);
    add(p + "self_attn.v_proj.weight", {kvc, c}, ShardSpec::Rows(kvc, c), true);
    add(p + "self_attn.o_proj.weight", {c, qc}, ShardSpec::Columns(c, qc), true);
    add(p + "post_attention_layernorm.weight", {c}, ShardSpec::Replicated(c), false);
    if (m.moe_block(i)) {
      // Mixtral's names: the router "gate", experts' w1 (gate), w3 (up), w2 (down).
      add(p + "block_sparse_moe.gate.weight", {m.moe_experts, c}, ShardSpec::Replicated(int64_t{m.moe_experts} * c),
          true);
      for (const int e : LocalExperts(config)) {
        const std::string x = absl::StrCat(p, "block_sparse_moe.experts.", e, ".");
        add(x + "w1.weight", {f, c}, ShardSpec::Rows(f, c), true);
        add(x + "w3.weight", {f, c}, ShardSpec::Rows(f, c), true);
        add(x + "w2.weight", {c, f}, ShardSpec::Columns(c, f), true);
        for (size_t k = specs.size() - 3; k < specs.size(); ++k) specs[k].expert = true;
      }
      continue;
    }
    add(p + "mlp.gate_proj.weight", {f, c}, ShardSpec::Rows(f, c), true);
    add(p + "mlp.up_proj.weight", {f, c}, ShardSpec::Rows(f, c), true);
    add(p + "mlp.down_proj.weight", {c, f}, ShardSpec::Columns(c, f), true);
  }
  if (config.is_last()) {
    add("norm.weight", {c}, ShardSpec::Replicated(c), false);
    if (!m.tie_embeddings) {
      add("lm_head.weight", {m.vocab, c}, vocab_rows(), true);
    } else if (!config.is_first()) {
      // The head's copy of the tied embedding; the first stage counts it.
      add("embed_tokens.weight", {m.vocab, c}, vocab_rows(), true);
      specs.back().counts_in_norm = false;
    }
  }
  return specs;
}

}  // namespace

int64_t GptStage::expert_elements() const {
  if (config_.ep_size <= 1) return 0;
  int64_t n = 0;
  for (const Parameter& p : params_.parameters()) {
    if (p.spec.expert) n += p.value.numel();
  }
  return n;
}

absl::StatusOr<std::unique_ptr<GptStage>> GptStage::Create(const StageConfig& config,
                                                           comm::Communicator* tp_group,
                                                           comm::Communicator* cp_group,
                                                           comm::Communicator* ep_group) {
  BATON_RETURN_IF_ERROR(ValidateStageConfig(config));
  if (config.ep_size > 1 &&
      (ep_group == nullptr || ep_group->size() != config.ep_size || ep_group->rank() != config.ep_rank)) {
    return absl::InvalidArgumentError(absl::StrCat("parallel.ep = ", config.ep_size,
                                                   " needs an expert-parallel communicator of that size where this "
                                                   "stage is rank ", config.ep_rank));
  }
  if (config.model.moe()) {
    // A backend without the routing kernels would abort at the first op.
    const kernels::Backend* backend = kernels::FindBackend(config.device.type);
    if (backend != nullptr && backend->router_top_k == nullptr) {
      return absl::UnimplementedError(absl::StrCat(
          "model.moe on ", kernels::DeviceToString(config.device),
          ": this device's backend has no Mixture-of-Experts routing kernels in this version; run MoE jobs on CPU "
          "workers, or leave model.moe unset"));
    }
  }
  if (config.cp_size > 1) {
    if (cp_group == nullptr || cp_group->size() != config.cp_size || cp_group->rank() != config.cp_rank) {
      return absl::InvalidArgumentError(absl::StrCat("parallel.cp = ", config.cp_size,
                                                     " needs a context-parallel communicator of that size where this "
                                                     "stage is rank ", config.cp_rank));
    }
  }
  if (config.tp_size > 1) {
    if (tp_group == nullptr || tp_group->size() != config.tp_size ||
        tp_group->rank() != config.tp_rank) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parallel.tp = ", config.tp_size, " needs a tensor-parallel communicator of that size",
          " where this stage is rank ", config.tp_rank));
    }
  }
  const std::string where = absl::StrCat("placing stage ", config.pp_rank, " (tp rank ",
                                         config.tp_rank, ") on ",
                                         kernels::DeviceToString(config.device));
  absl::StatusOr<ParameterStore> params =
      ParameterStore::Create(StageParameterSpecs(config), config.tp_rank, config.tp_size);
  if (!params.ok()) return ParameterError(params.status(), where);
  if (config.dp_size > 1) {
    if (absl::Status sharded = params->ShardOverDp(config.dp_rank, config.dp_size); !sharded.ok()) {
      return ParameterError(sharded, where);
    }
  }
  auto stage = std::unique_ptr<GptStage>(
      new GptStage(config, tp_group, config.cp_size > 1 ? cp_group : nullptr, *std::move(params)));
  if (config.ep_size > 1) stage->ep_ = ep_group;
  if (tp_group != nullptr) {
    stage->tp_collectives_ = comm::StreamCollectives::For(*tp_group);
    // TP time over NCCL is in no host wait: event pairs time it, taken by the
    // executor after every step (Executor::Run, TakeStreamSeconds).
    stage->tp_collectives_->TimeOpsOnStreams();
  }
  stage->params_.Initialize(config.seed);
  if (absl::Status placed = stage->PlaceOnDevice(); !placed.ok()) return ParameterError(placed, where);
  return stage;
}

GptStage::GptStage(const StageConfig& config, comm::Communicator* tp_group, comm::Communicator* cp_group,
                   ParameterStore params)
    : config_(config),
      tp_(tp_group),
      params_(std::move(params)),
      vocab_parallel_(config.vocab_parallel && config.tp_size > 1),
      vocab_begin_(vocab_parallel_ ? config.tp_rank * (config.model.vocab / config.tp_size) : 0),
      bf16_(config.precision == kernels::Precision::kBFloat16),
      llama_(config.model.llama()),
      sp_(config.sequence_parallel && config.tp_size > 1),
      cp_(cp_group),
      gemm_dtype_(bf16_ ? kernels::DType::kBFloat16 : kernels::DType::kFloat32) {
  BindParameters();
}

GptStage::~GptStage() = default;

absl::Status GptStage::PlaceOnDevice() {
  const kernels::Device device = config_.device;
  BATON_RETURN_IF_ERROR(params_.Place(device));
  BATON_ASSIGN_OR_RETURN(stream_, kernels::Stream::Create(device));
  scratch_ = std::make_unique<kernels::Arena>(device, "the op scratch arena");
  sp_scratch_ = std::make_unique<kernels::Arena>(device, "the sequence-parallel scratch arena");
  cp_scratch_ = std::make_unique<kernels::Arena>(device, "the ring-attention scratch arena");
  ctx_ = kernels::ExecContext::On(stream_.get(), scratch_.get(), config_.precision);
  if (bf16_) BATON_RETURN_IF_ERROR(params_.AllocateBf16Copies(ctx_));
  BATON_ASSIGN_OR_RETURN(loss_acc_, kernels::ZerosOn(device, {1}, kernels::DType::kFloat64));
  BATON_ASSIGN_OR_RETURN(aux_acc_, kernels::ZerosOn(device, {1}, kernels::DType::kFloat32));
  moe_routed_.assign(config_.model.moe_experts, 0);
  moe_kept_.assign(config_.model.moe_experts, 0);
  BATON_ASSIGN_OR_RETURN(hits_acc_, kernels::ZerosOn(device, {1}, kernels::DType::kInt64));
  BATON_ASSIGN_OR_RETURN(norm_acc_, kernels::ZerosOn(device, {1}, kernels::DType::kFloat64));
  // Pinned, so that copying the results into it waits for nothing on the host.
  static_assert(sizeof(HostResults) == 3 * sizeof(int64_t));
  BATON_ASSIGN_OR_RETURN(host_results_, kernels::PinnedHostZeros(device, {3}, kernels::DType::kInt64));
  return absl::OkStatus();
}

void GptStage::BindParameters() {
  if (llama_) {
    BindLlamaParameters();
    return;
  }
  wte_ = params_.Find("wte");
  head_ = wte_;
  wpe_ = params_.Find("wpe");
  lnf_w_ = params_.Find("ln_f.weight");
  lnf_b_ = params_.Find("ln_f.bias");
  for (int i = config_.blocks.first; i < config_.blocks.first + config_.blocks.count; ++i) {
    const std::string p = absl::StrCat("h.", i, ".");
    Block b;
    b.index = i;
    b.ln1_w = params_.Find(p + "ln_1.weight");
    b.ln1_b = params_.Find(p + "ln_1.bias");
    b.qkv_w = params_.Find(p + "attn.c_attn.weight");
    b.qkv_b = params_.Find(p + "attn.c_attn.bias");
    b.proj_w = params_.Find(p + "attn.c_proj.weight");
    b.proj_b = params_.Find(p + "attn.c_proj.bias");
    b.ln2_w = params_.Find(p + "ln_2.weight");
    b.ln2_b = params_.Find(p + "ln_2.bias");
    b.fc_w = params_.Find(p + "mlp.c_fc.weight");
    b.fc_b = params_.Find(p + "mlp.c_fc.bias");
    b.fc2_w = params_.Find(p + "mlp.c_proj.weight");
    b.fc2_b = params_.Find(p + "mlp.c_proj.bias");
    if (config_.model.moe_block(i)) {
      b.router = params_.Find(p + "mlp.router.weight");
      for (const int e : LocalExperts(config_)) {
        const std::string x = absl::StrCat(p, "mlp.experts.", e, ".");
        b.experts.push_back({params_.Find(x + "c_fc.weight"), nullptr, params_.Find(x + "c_proj.weight")});
      }
    }
    blocks_.push_back(b);
  }
}

void GptStage::BindLlamaParameters() {
  wte_ = params_.Find("embed_tokens.weight");
  head_ = config_.model.tie_embeddings ? wte_ : params_.Find("lm_head.weight");
  lnf_w_ = params_.Find("norm.weight");
  for (int i = config_.blocks.first; i < config_.blocks.first + config_.blocks.count; ++i) {
    const std::string p = absl::StrCat("layers.", i, ".");
    Block b;
    b.index = i;
    b.ln1_w = params_.Find(p + "input_layernorm.weight");
    b.q_w = params_.Find(p + "self_attn.q_proj.weight");
    b.k_w = params_.Find(p + "self_attn.k_proj.weight");
    b.v_w = params_.Find(p + "self_attn.v_proj.weight");
    b.proj_w = params_.Find(p + "self_attn.o_proj.weight");
    b.ln2_w = params_.Find(p + "post_attention_layernorm.weight");
    b.fc_w = params_.Find(p + "mlp.gate_proj.weight");
    b.up_w = params_.Find(p + "mlp.up_proj.weight");
    b.fc2_w = params_.Find(p + "mlp.down_proj.weight");
    if (config_.model.moe_block(i)) {
      b.router = params_.Find(p + "block_sparse_moe.gate.weight");
      for (const int e : LocalExperts(config_)) {
        const std::string x = absl::StrCat(p, "block_sparse_moe.experts.", e, ".");
        b.experts.push_back(
            {params_.Find(x + "w1.weight"), params_.Find(x + "w3.weight"), params_.Find(x + "w2.weight")});
      }
    }
    blocks_.push_back(b);
  }
}

absl::Status GptStage::Norm(kernels::Arena& arena, const Tensor& x, const Parameter* w, const Parameter* b,
                            Tensor* out, Tensor* mean, Tensor* rstd) {
  const int64_t n = x.dim(0), c = x.dim(1);
  BATON_ASSIGN_OR_RETURN(*out, arena.Allocate({n, c}, gemm_dtype_));
  BATON_ASSIGN_OR_RETURN(*rstd, arena.Allocate({n}));
  if (llama_) {
    kernels::RmsNorm(ctx_, *out, *rstd, x, w->value, config_.model.norm_eps);
    return absl::OkStatus();
  }
  BATON_ASSIGN_OR_RETURN(*mean, arena.Allocate({n}));
  kernels::LayerNorm(ctx_, *out, *mean, *rstd, x, w->value, b->value);
  return absl::OkStatus();
}

void GptStage::NormBackward(const Tensor& dx, const Parameter* w, const Parameter* b, const Tensor& dout,
                            const Tensor& x, const Tensor& mean, const Tensor& rstd) {
  if (llama_) {
    kernels::RmsNormBackward(ctx_, dx, w->grad, dout, x, w->value, rstd);
  } else {
    kernels::LayerNormBackward(ctx_, dx, w->grad, b->grad, dout, x, w->value, mean, rstd);
  }
}

absl::Status GptStage::AllReduceTp(const Tensor& t, const char* what, int block) {
  if (config_.tp_size == 1) return absl::OkStatus();
  return AllReduceOnStream(*tp_collectives_, t,
                           absl::StrCat("tensor-parallel all-reduce of ", what,
                                        block >= 0 ? absl::StrCat(" in block ", block) : ""));
}

absl::Status GptStage::AllGatherTp(const Tensor& in, const Tensor& out, const char* what) {
  return MoveOverTp(TpMove::kAllGather, in, out, absl::StrCat("tensor-parallel all-gather of ", what));
}

absl::Status GptStage::ReduceScatterTp(const Tensor& in, const Tensor& out, const char* what, int block) {
  return MoveOverTp(TpMove::kReduceScatter, in, out,
                    absl::StrCat("tensor-parallel reduce-scatter of ", what,
                                 block >= 0 ? absl::StrCat(" in block ", block) : ""));
}

absl::Status GptStage::MoveOverTp(TpMove move, const Tensor& in, const Tensor& out, const std::string& name) {
  const comm::Buffer from = CommBuffer(in), to = CommBuffer(out);
  const bool gather = move == TpMove::kAllGather;
  if (tp_collectives_->CanEnqueue(from) && tp_collectives_->CanEnqueue(to)) {
    return gather ? tp_collectives_->AllGather(from, to, name, *stream_, config_.comm_timeout, comm_status_)
                  : tp_collectives_->ReduceScatterSum(from, to, name, *stream_, config_.comm_timeout, comm_status_);
  }
  // CUDA memory over a host communicator: it reads memory the stream has
  // finished writing.
  absl::Status status = stream_->Synchronize();
  if (status.ok()) {
    status = (gather ? tp_->AllGather(from, to) : tp_->ReduceScatterSum(from, to))->Wait(config_.comm_timeout);
  }
  return WithContext(status, name);
}

absl::StatusOr<Tensor> GptStage::SumOverTp(const Tensor& partial, const char* what, int block) {
  if (!sp_) {
    BATON_RETURN_IF_ERROR(AllReduceTp(partial, what, block));
    return partial;
  }
  BATON_ASSIGN_OR_RETURN(Tensor rows, sp_scratch_->Allocate({partial.dim(0) / config_.tp_size, partial.dim(1)}));
  BATON_RETURN_IF_ERROR(ReduceScatterTp(partial, rows, what, block));
  return rows;
}

absl::Status GptStage::NormForGemm(kernels::Arena& arena, const Tensor& x, const Parameter* w, const Parameter* b,
                                   Tensor* whole, Tensor* rows, Tensor* mean, Tensor* rstd, const char* what,
                                   int block) {
  if (!sp_) {
    BATON_RETURN_IF_ERROR(Norm(arena, x, w, b, whole, mean, rstd));
    *rows = *whole;
    return absl::OkStatus();
  }
  // The rows and statistics stay with the microbatch (the weight gradient
  // gathers the rows again, the norm's backward reads the statistics); the
  // whole is a temporary.
  BATON_RETURN_IF_ERROR(Norm(arena, x, w, b, rows, mean, rstd));
  BATON_ASSIGN_OR_RETURN(*whole, GatherRows(*sp_scratch_, *rows, what, block));
  return absl::OkStatus();
}

absl::StatusOr<Tensor> GptStage::GatherRows(kernels::Arena& arena, const Tensor& rows, const char* what, int block) {
  if (!sp_) return rows;
  BATON_ASSIGN_OR_RETURN(Tensor whole, arena.Allocate({rows.dim(0) * config_.tp_size, rows.dim(1)}, rows.dtype()));
  const std::string name = block >= 0 ? absl::StrCat(what, " in block ", block) : std::string(what);
  BATON_RETURN_IF_ERROR(AllGatherTp(rows, whole, name.c_str()));
  return whole;
}

Tensor GptStage::OwnRows(const Tensor& whole, int64_t n) const {
  const Tensor flat = whole.Reshaped({n, whole.numel() / n});
  if (!sp_) return flat;
  const int64_t rows = n / config_.tp_size;
  return flat.Rows(config_.tp_rank * rows, (config_.tp_rank + 1) * rows);
}

absl::Status GptStage::SumNormGradsOverTp() {
  std::vector<const Parameter*> norms;
  for (const Block& b : blocks_) {
    for (const Parameter* p : {b.ln1_w, b.ln1_b, b.ln2_w, b.ln2_b}) {
      if (p != nullptr) norms.push_back(p);
    }
  }
  for (const Parameter* p : {lnf_w_, lnf_b_}) {
    if (p != nullptr) norms.push_back(p);
  }
  int64_t total = 0;
  for (const Parameter* p : norms) total += p->grad.numel();
  if (total == 0) return absl::OkStatus();
  // Packed into one buffer of the op scratch (reset at ZeroGrad), summed,
  // unpacked.
  BATON_ASSIGN_OR_RETURN(Tensor packed, scratch_->Allocate({total}));
  int64_t at = 0;
  for (const Parameter* p : norms) {
    kernels::Copy(ctx_, packed.Rows(at, at + p->grad.numel()), p->grad.Reshaped({p->grad.numel()}));
    at += p->grad.numel();
  }
  BATON_RETURN_IF_ERROR(AllReduceTp(packed, "the sequence-parallel norm weight gradients", -1));
  at = 0;
  for (const Parameter* p : norms) {
    kernels::Copy(ctx_, p->grad.Reshaped({p->grad.numel()}), packed.Rows(at, at + p->grad.numel()));
    at += p->grad.numel();
  }
  return absl::OkStatus();
}

absl::Status GptStage::AllReduceOnStream(comm::StreamCollectives& coll, const Tensor& t, const std::string& name) {
  const comm::Buffer buf = CommBuffer(t);
  if (coll.CanEnqueue(buf)) return coll.AllReduceSum(buf, name, *stream_, config_.comm_timeout, comm_status_);
  // CUDA memory over a host communicator: it reads memory the stream has
  // finished writing.
  absl::Status status = stream_->Synchronize();
  if (status.ok()) status = coll.communicator().AllReduceSum(buf)->Wait(config_.comm_timeout);
  return WithContext(status, name);
}

const Tensor& GptStage::W(const Parameter* p) const { return bf16_ ? p->value_bf16 : p->value; }

absl::StatusOr<Tensor> GptStage::ForGemm(kernels::Arena& arena, const Tensor& t) const {
  if (!bf16_) return t;
  BATON_ASSIGN_OR_RETURN(Tensor low, arena.Allocate(t.shape(), kernels::DType::kBFloat16));
  kernels::Cast(ctx_, low, t);
  return low;
}

void GptStage::RefreshBf16Weights() {
  if (bf16_) params_.RefreshBf16Copies(ctx_);
}

namespace {

const char* DTypeName(kernels::DType dtype) {
  return dtype == kernels::DType::kBFloat16 ? "bf16" : "float";
}

}  // namespace

absl::Status GptStage::ValidateInputs(const StageInputs& in, const Tensor& output, int64_t* batch,
                                      int64_t* seq, bool logits_only) const {
  const GptConfig& m = config_.model;
  const Tensor& shaped = config_.is_first() ? in.tokens : in.activations;
  const char* shaped_name = config_.is_first() ? "tokens" : "activations";
  const int want_dims = config_.is_first() ? 2 : 3;
  // Tokens are host tensors; activations live on the stage's device.
  const kernels::Device want_device = config_.is_first() ? kernels::Device::Cpu() : config_.device;
  if (!shaped.defined() || shaped.ndim() != want_dims || shaped.device() != want_device) {
    return absl::InvalidArgumentError(absl::StrCat(
        shaped_name, ": missing, or not a tensor [batch, seq", config_.is_first() ? "]" : ", d_model]",
        " on ", kernels::DeviceToString(want_device)));
  }
  *batch = shaped.dim(0);
  *seq = shaped.dim(1);
  if (*batch <= 0 || *seq <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(shaped_name, ": empty batch"));
  }
  if (*seq > m.seq_len) {
    return absl::InvalidArgumentError(absl::StrCat(
        shaped_name, ": sequence of ", *seq, " tokens is longer than model.seq_len = ", m.seq_len));
  }
  if (cp_ != nullptr && (*batch % 2 != 0 || *seq * 2 * config_.cp_size > m.seq_len)) {
    return absl::InvalidArgumentError(absl::StrCat(
        shaped_name, ": [", *batch, ", ", *seq, "] is no context-parallel view of a microbatch: want [2 * "
        "micro_batch_size, T / (2 * parallel.cp)] for sequences of T <= model.seq_len = ", m.seq_len,
        " tokens (worker/model/context_parallel.h)"));
  }
  const int64_t n = *batch * *seq;
  if (sp_ && n % config_.tp_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        shaped_name, ": parallel.sequence_parallel splits the microbatch's ", *batch, " x ", *seq, " = ", n,
        " tokens over parallel.tp = ", config_.tp_size,
        " ranks, which does not divide them: make train.micro_batch_size * model.seq_len divisible by tp"));
  }
  auto check_ids = [&](const Tensor& ids, const char* name, bool allow_ignore) -> absl::Status {
    if (!ids.defined() || ids.dtype() != kernels::DType::kInt32 || ids.numel() != n ||
        !ids.device().is_cpu()) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, ": want int32 [", *batch, ", ", *seq, "] in host memory to match the microbatch"));
    }
    for (int64_t i = 0; i < n; ++i) {
      const int32_t id = ids.i32()[i];
      if ((id < 0 || id >= m.vocab) && !(allow_ignore && id == kernels::kIgnoreTarget)) {
        return absl::InvalidArgumentError(absl::StrCat(
            name, "[", i, "] = ", id, " is outside [0, model.vocab = ", m.vocab, ")",
            allow_ignore ? " and is not -1 (ignored)" : ""));
      }
    }
    return absl::OkStatus();
  };
  if (config_.is_first()) {
    BATON_RETURN_IF_ERROR(check_ids(in.tokens, "tokens", /*allow_ignore=*/false));
  } else if (in.activations.dtype() != activation_dtype() ||
             in.activations.numel() != n * m.d_model) {
    return absl::InvalidArgumentError(absl::StrCat("activations: want ", DTypeName(activation_dtype()),
                                                   " [", *batch, ", ", *seq, ", ", m.d_model, "]"));
  }
  if (config_.is_last()) {
    if (!logits_only) BATON_RETURN_IF_ERROR(check_ids(in.targets, "targets", /*allow_ignore=*/true));
  } else if (!output.defined() || output.dtype() != activation_dtype() ||
             output.numel() != n * m.d_model) {
    return absl::InvalidArgumentError(absl::StrCat("output: want ", DTypeName(activation_dtype()),
                                                   " [", *batch, ", ", *seq, ", ", m.d_model, "]"));
  }
  return absl::OkStatus();
}

std::unique_ptr<GptStage::Microbatch> GptStage::TakeMicrobatch(int64_t batch, int64_t seq) {
  std::unique_ptr<Microbatch> state;
  if (free_.empty()) {
    state = std::make_unique<Microbatch>(config_.device, "an activation arena");
  } else {
    state = std::move(free_.back());
    free_.pop_back();
  }
  state->batch = batch;
  state->seq = seq;
  state->backward_input_done = false;
  return state;
}

absl::Status GptStage::Forward(int mb, const StageInputs& inputs, const Tensor& output) {
  if (in_flight_.contains(mb)) {
    return absl::FailedPreconditionError(
        absl::StrCat("Forward(", mb, "): microbatch already run forward and not yet backward"));
  }
  int64_t batch = 0, seq = 0;
  BATON_RETURN_IF_ERROR_CTX(ValidateInputs(inputs, output, &batch, &seq), "Forward(", mb, ")");
  std::unique_ptr<Microbatch> state = TakeMicrobatch(batch, seq);
  StepScore score;
  const absl::Status status = RunForward(*state, inputs, output, &score);
  if (!status.ok()) {
    state->arena.Reset();
    free_.push_back(std::move(state));
    return ActivationError(status, absl::StrCat("Forward(", mb, ")"));
  }
  // The loss and hits went into the device accumulators (see score()).
  score_.tokens += score.tokens;
  in_flight_[mb] = std::move(state);
  SampleActivationBytes();
  return absl::OkStatus();
}

absl::Status GptStage::ForwardLogits(const StageInputs& inputs, const Tensor& logits) {
  if (!config_.is_last()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "ForwardLogits: stage ", config_.pp_rank, " is not the last pipeline stage; only the last has the LM head"));
  }
  if (!in_flight_.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "ForwardLogits: ", in_flight_.size(), " microbatches are in flight; call it between steps"));
  }
  if (cp_ != nullptr) {
    return absl::UnimplementedError(
        "ForwardLogits: sampling from a context-parallel stage (parallel.cp > 1) is not implemented; sample from a "
        "checkpoint loaded without parallel.cp");
  }
  int64_t batch = 0, seq = 0;
  BATON_RETURN_IF_ERROR_CTX(ValidateInputs(inputs, Tensor(), &batch, &seq, /*logits_only=*/true), "ForwardLogits");
  const int64_t columns = head_->value.dim(0);
  if (!logits.defined() || logits.dtype() != kernels::DType::kFloat32 || logits.device() != config_.device ||
      logits.numel() != batch * seq * columns) {
    return absl::InvalidArgumentError(absl::StrCat("ForwardLogits: logits: want float [", batch, ", ", seq, ", ",
                                                   columns, "] on ", kernels::DeviceToString(config_.device)));
  }
  // The previous call's temporaries are done with (stream order), as at ZeroGrad.
  scratch_->Reset();
  std::unique_ptr<Microbatch> state = TakeMicrobatch(batch, seq);
  StepScore unused;
  const Tensor flat = logits.Reshaped({batch * seq, columns});
  const absl::Status status = RunForward(*state, inputs, Tensor(), &unused, &flat);
  // Nothing is kept: the arena goes back to the pool at once (later users of
  // its memory run after these ops on the same stream).
  state->arena.Reset();
  free_.push_back(std::move(state));
  if (!status.ok()) return ActivationError(status, "ForwardLogits");
  return absl::OkStatus();
}

absl::Status GptStage::RunForward(Microbatch& s, const StageInputs& inputs, const Tensor& output,
                                  StepScore* score, const Tensor* logits) {
  const int64_t n = s.batch * s.seq, c = config_.model.d_model;
  const int64_t rows = ResidualRows(n);  // of the residual stream here
  kernels::Arena& arena = s.arena;
  if (sp_) sp_scratch_->Reset();
  if (config_.is_first()) {
    BATON_ASSIGN_OR_RETURN(s.tokens, Copy(ctx_, arena, inputs.tokens, {s.batch, s.seq}));
    // Under SP the whole embedding is a temporary: the stream keeps this
    // rank's rows of it.
    kernels::Arena& whole_arena = sp_ ? *sp_scratch_ : arena;
    BATON_ASSIGN_OR_RETURN(Tensor x0, whole_arena.Allocate({n, c}));
    // With a vocabulary-parallel table each rank embeds the tokens it holds,
    // rank 0 adds the positions, and the all-reduce assembles the whole.
    const bool add_positions = !vocab_parallel_ || config_.tp_rank == 0;
    const Tensor wpe = add_positions && wpe_ != nullptr ? wpe_->value : Tensor();
    if (cp_ == nullptr) {
      kernels::Embedding(ctx_, x0, s.tokens, wte_->value, vocab_begin_, wpe);
    } else {
      // Each half of the CP view at its chunk's positions.
      for (int half = 0; half < 2; ++half) {
        const int64_t offset = HalfOffset(half, s.seq);
        kernels::Embedding(ctx_, Half(x0, half), Half(s.tokens, half), wte_->value, vocab_begin_,
                           wpe.defined() ? wpe.Rows(offset, offset + s.seq) : Tensor());
      }
    }
    if (!sp_) {
      s.x0 = x0;
      if (vocab_parallel_) BATON_RETURN_IF_ERROR(AllReduceTp(s.x0, "the vocabulary-parallel embedding", -1));
    } else {
      BATON_ASSIGN_OR_RETURN(s.x0, arena.Allocate({rows, c}));
      if (vocab_parallel_) {
        BATON_RETURN_IF_ERROR(ReduceScatterTp(x0, s.x0, "the vocabulary-parallel embedding", -1));
      } else {
        kernels::Copy(ctx_, s.x0, OwnRows(x0, n));
      }
    }
  } else if (bf16_) {
    // The residual stream is fp32; the message between stages is bf16.
    BATON_ASSIGN_OR_RETURN(s.x0, arena.Allocate({rows, c}));
    kernels::Cast(ctx_, s.x0, OwnRows(inputs.activations, n));
  } else {
    BATON_ASSIGN_OR_RETURN(s.x0, Copy(ctx_, arena, OwnRows(inputs.activations, n), {rows, c}));
  }
  if (config_.is_last() && logits == nullptr) {
    // Scored tokens are counted on the host, from the host targets.
    const int32_t* targets = inputs.targets.i32();
    for (int64_t i = 0; i < n; ++i) {
      if (targets[i] != kernels::kIgnoreTarget) ++score->tokens;
    }
    BATON_ASSIGN_OR_RETURN(s.targets, Copy(ctx_, arena, inputs.targets, {n}));
  }
  s.blocks.resize(blocks_.size());
  Tensor x = s.x0;
  for (size_t i = 0; i < blocks_.size(); ++i) {
    s.blocks[i].x_in = x;
    BATON_RETURN_IF_ERROR_CTX(BlockForward(blocks_[i], s, s.blocks[i]), "block ", blocks_[i].index,
                              " forward");
    x = s.blocks[i].x_out;
  }
  if (!config_.is_last()) {
    if (sp_) {
      // The message is whole: every rank's rows, gathered (in fp32, then
      // rounded for a bf16 message).
      if (!bf16_) return AllGatherTp(x, output, "the stage output");
      BATON_ASSIGN_OR_RETURN(Tensor whole, GatherRows(*sp_scratch_, x, "the stage output", -1));
      kernels::Cast(ctx_, output, whole);
    } else if (bf16_) {
      kernels::Cast(ctx_, output, x);
    } else {
      kernels::Copy(ctx_, output, x);
    }
    return absl::OkStatus();
  }
  Tensor xf;  // the head's input, whole (s.xf keeps this rank's rows under SP)
  BATON_RETURN_IF_ERROR(
      NormForGemm(arena, x, lnf_w_, lnf_b_, &xf, &s.xf, &s.meanf, &s.rstdf, "the final norm output", -1));
  // This rank's vocabulary columns.
  BATON_ASSIGN_OR_RETURN(s.dlogits, arena.Allocate({n, head_->value.dim(0)}));
  kernels::Linear(ctx_, s.dlogits, xf, W(head_), Tensor());
  if (logits != nullptr) {
    kernels::Copy(ctx_, *logits, s.dlogits);
    return absl::OkStatus();
  }
  // The microbatch's scored tokens: under CP every rank's, summed over the
  // ring (ignored targets need not split evenly), and the scale is cp times
  // larger because the executor averages the cp ranks' gradients: their
  // average is then the serial model's gradient exactly.
  int64_t scored = score->tokens;
  if (cp_ != nullptr) {
    int64_t count = scored;
    comm::Buffer buffer{&count, 1, comm::DType::kInt64, -1};
    BATON_RETURN_IF_ERROR_CTX(cp_->AllReduceSum(buffer)->Wait(config_.comm_timeout),
                              "context-parallel sum of the microbatch's scored tokens");
    scored = count;
  }
  const float grad_scale =
      scored == 0 ? 0.0f
                  : static_cast<float>(config_.cp_size) / static_cast<float>(scored * config_.microbatches);
  if (vocab_parallel_) return ScoreVocabularyParallel(s, grad_scale);
  BATON_ASSIGN_OR_RETURN(Tensor max, arena.Allocate({n}));
  BATON_ASSIGN_OR_RETURN(Tensor index, arena.Allocate({n}));
  kernels::ShardArgmax(ctx_, s.dlogits, 0, max, index);
  kernels::CountArgmaxHits(ctx_, max, index, s.targets, hits_acc_);
  kernels::SoftmaxCrossEntropy(ctx_, s.dlogits, s.targets, grad_scale, loss_acc_);
  return absl::OkStatus();
}

absl::Status GptStage::ScoreVocabularyParallel(Microbatch& s, float grad_scale) {
  const int64_t n = s.batch * s.seq, tp = config_.tp_size;
  kernels::Arena& arena = s.arena;
  // Each rank's log-sum-exps, largest logits and their indices travel in one
  // all-gather: stats [3, n] → stats_all [tp, 3, n].
  BATON_ASSIGN_OR_RETURN(Tensor stats, arena.Allocate({3, n}));
  BATON_ASSIGN_OR_RETURN(Tensor stats_all, arena.Allocate({tp, 3, n}));
  Tensor lse = stats.Rows(0, 1).Reshaped({n});
  Tensor max = stats.Rows(1, 2).Reshaped({n});
  Tensor index = stats.Rows(2, 3).Reshaped({n});
  BATON_ASSIGN_OR_RETURN(Tensor row_max, arena.Allocate({n}));
  BATON_ASSIGN_OR_RETURN(Tensor target_logit, arena.Allocate({n}));
  kernels::ShardArgmax(ctx_, s.dlogits, vocab_begin_, max, index);
  kernels::ShardedCrossEntropyStats(ctx_, s.dlogits, s.targets, vocab_begin_, row_max, lse, target_logit);
  BATON_RETURN_IF_ERROR(AllGatherTp(stats, stats_all, "the vocabulary-shard loss statistics"));
  BATON_RETURN_IF_ERROR(AllReduceTp(target_logit, "the target logits", -1));
  BATON_ASSIGN_OR_RETURN(Tensor lse_all, arena.Allocate({tp, n}));
  BATON_ASSIGN_OR_RETURN(Tensor max_all, arena.Allocate({tp, n}));
  BATON_ASSIGN_OR_RETURN(Tensor index_all, arena.Allocate({tp, n}));
  const Tensor rows = stats_all.Reshaped({tp * 3, n});
  for (int64_t r = 0; r < tp; ++r) {
    kernels::Copy(ctx_, lse_all.Rows(r, r + 1), rows.Rows(3 * r, 3 * r + 1));
    kernels::Copy(ctx_, max_all.Rows(r, r + 1), rows.Rows(3 * r + 1, 3 * r + 2));
    kernels::Copy(ctx_, index_all.Rows(r, r + 1), rows.Rows(3 * r + 2, 3 * r + 3));
  }
  kernels::CountArgmaxHits(ctx_, max_all, index_all, s.targets, hits_acc_);
  kernels::ShardedCrossEntropyFinish(ctx_, s.dlogits, s.targets, vocab_begin_, row_max, lse_all,
                                     target_logit, grad_scale, loss_acc_);
  return absl::OkStatus();
}

absl::Status GptStage::BlockForward(const Block& b, Microbatch& mb, BlockActivations& a) {
  const int64_t rows = ResidualRows(mb.batch * mb.seq), c = config_.model.d_model;
  kernels::Arena& arena = mb.arena;
  if (sp_) sp_scratch_->Reset();
  // Attention sub-block: x_mid = x_in + proj(attn(norm1(x_in))).
  // a.ln1 / a.ln2: the whole norm output while the sub-block runs, then (SP)
  // the rows the weight gradient gathers again.
  Tensor kept;
  BATON_RETURN_IF_ERROR(
      NormForGemm(arena, a.x_in, b.ln1_w, b.ln1_b, &a.ln1, &kept, &a.mean1, &a.rstd1, "the attention input", b.index));
  BATON_ASSIGN_OR_RETURN(Tensor attn_out, AttentionForward(b, mb, a));
  a.ln1 = kept;
  BATON_ASSIGN_OR_RETURN(a.x_mid, arena.Allocate({rows, c}));
  kernels::Residual(ctx_, a.x_mid, a.x_in, attn_out);
  // MLP sub-block: x_out = x_mid + mlp(norm2(x_mid)).
  BATON_RETURN_IF_ERROR(
      NormForGemm(arena, a.x_mid, b.ln2_w, b.ln2_b, &a.ln2, &kept, &a.mean2, &a.rstd2, "the MLP input", b.index));
  BATON_ASSIGN_OR_RETURN(Tensor mlp_out, MlpForward(b, mb, a));
  a.ln2 = kept;
  BATON_ASSIGN_OR_RETURN(a.x_out, arena.Allocate({rows, c}));
  kernels::Residual(ctx_, a.x_out, a.x_mid, mlp_out);
  return absl::OkStatus();
}

absl::StatusOr<Tensor> GptStage::AttentionForward(const Block& b, Microbatch& mb, BlockActivations& a) {
  const GptConfig& m = config_.model;
  const int64_t n = mb.batch * mb.seq, c = m.d_model, tp = config_.tp_size;
  const int64_t cl = int64_t{m.heads} * m.head_dim() / tp;  // this rank's query channels
  const int heads = static_cast<int>(m.heads / tp);
  kernels::Arena& arena = mb.arena;
  const kernels::DType g16 = gemm_dtype_;  // GEMM inputs and attention tensors
  BATON_ASSIGN_OR_RETURN(a.qkv, arena.Allocate({mb.batch, mb.seq, 3 * cl}, g16));
  if (llama_) {
    // Separate q, k, v projections (k and v of kv_heads / tp heads), then
    // rotary positions and the grouped heads' expansion into the packed qkv.
    const int kv_heads = m.key_value_heads() / static_cast<int>(tp);
    const int64_t kvl = int64_t{kv_heads} * m.head_dim();
    BATON_ASSIGN_OR_RETURN(a.q, arena.Allocate({n, cl}));
    BATON_ASSIGN_OR_RETURN(a.k, arena.Allocate({n, kvl}));
    BATON_ASSIGN_OR_RETURN(a.v, arena.Allocate({n, kvl}));
    kernels::Linear(ctx_, a.q, a.ln1, W(b.q_w), Tensor());
    kernels::Linear(ctx_, a.k, a.ln1, W(b.k_w), Tensor());
    kernels::Linear(ctx_, a.v, a.ln1, W(b.v_w), Tensor());
    if (cp_ == nullptr) {
      kernels::RopePack(ctx_, a.qkv, a.q, a.k, a.v, heads, kv_heads, m.rope_theta);
    } else {
      for (int half = 0; half < 2; ++half) {
        kernels::RopePack(ctx_, Half(a.qkv, half), Half(a.q, half), Half(a.k, half), Half(a.v, half), heads, kv_heads,
                          m.rope_theta, HalfOffset(half, mb.seq));
      }
    }
  } else {
    kernels::Linear(ctx_, a.qkv, a.ln1, W(b.qkv_w), b.qkv_b->value);
  }
  BATON_ASSIGN_OR_RETURN(a.y, arena.Allocate({n, cl}, g16));
  if (cp_ != nullptr) {
    BATON_RETURN_IF_ERROR(RingAttentionForward(b, mb, a));
  } else {
    // What this device's attention keeps for the backward: P [B,H,T,T], or
    // only the softmax statistics and the output where a fused kernel runs.
    const kernels::AttentionBuffers att = kernels::AttentionBuffersFor(ctx_, mb.batch, mb.seq, cl, heads, g16);
    BATON_ASSIGN_OR_RETURN(a.att, arena.Allocate(att.saved, att.saved_dtype));
    kernels::Attention(ctx_, a.y, a.att, a.qkv, heads);
  }
  BATON_ASSIGN_OR_RETURN(Tensor partial, (sp_ ? *sp_scratch_ : arena).Allocate({n, c}));
  kernels::Linear(ctx_, partial, a.y, W(b.proj_w), Tensor());
  BATON_ASSIGN_OR_RETURN(Tensor attn_out, SumOverTp(partial, "the attention output", b.index));
  if (b.proj_b != nullptr) kernels::AddBias(ctx_, attn_out, b.proj_b->value);
  return attn_out;
}

absl::StatusOr<Tensor> GptStage::MlpForward(const Block& b, Microbatch& mb, BlockActivations& a) {
  if (b.moe()) return MoeForward(b, mb, a);
  const int64_t n = mb.batch * mb.seq, c = config_.model.d_model;
  const int64_t fl = config_.model.ffn_dim() / config_.tp_size;
  kernels::Arena& arena = mb.arena;
  BATON_ASSIGN_OR_RETURN(a.h, arena.Allocate({n, fl}));
  BATON_ASSIGN_OR_RETURN(Tensor g, arena.Allocate({n, fl}));
  if (llama_) {
    // SwiGLU: down(silu(gate(x)) · up(x)); gate and up fp32, as its
    // backward reads them.
    BATON_ASSIGN_OR_RETURN(a.up, arena.Allocate({n, fl}));
    kernels::Linear(ctx_, a.h, a.ln2, W(b.fc_w), Tensor());
    kernels::Linear(ctx_, a.up, a.ln2, W(b.up_w), Tensor());
    kernels::SwiGlu(ctx_, g, a.h, a.up);
  } else {
    kernels::Linear(ctx_, a.h, a.ln2, W(b.fc_w), b.fc_b->value);
    kernels::Gelu(ctx_, g, a.h);  // fp32 (h too: GELU's backward reads it)
  }
  BATON_ASSIGN_OR_RETURN(a.g, ForGemm(arena, g));
  BATON_ASSIGN_OR_RETURN(Tensor partial, (sp_ ? *sp_scratch_ : arena).Allocate({n, c}));
  kernels::Linear(ctx_, partial, a.g, W(b.fc2_w), Tensor());
  BATON_ASSIGN_OR_RETURN(Tensor mlp_out, SumOverTp(partial, "the MLP output", b.index));
  if (b.fc2_b != nullptr) kernels::AddBias(ctx_, mlp_out, b.fc2_b->value);
  return mlp_out;
}

absl::StatusOr<GptStage::Microbatch*> GptStage::Find(int mb, const char* op) {
  auto it = in_flight_.find(mb);
  if (it == in_flight_.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat(op, "(", mb, "): microbatch has not run forward"));
  }
  return it->second.get();
}

absl::Status GptStage::BackwardInput(int mb, const Tensor& grad_output, const Tensor& grad_input) {
  BATON_ASSIGN_OR_RETURN(Microbatch * s, Find(mb, "BackwardInput"));
  if (s->backward_input_done) {
    return absl::FailedPreconditionError(
        absl::StrCat("BackwardInput(", mb, "): already done for this microbatch"));
  }
  const int64_t n = s->batch * s->seq, c = config_.model.d_model;
  const kernels::DType io = activation_dtype();
  if (!config_.is_last() &&
      (!grad_output.defined() || grad_output.numel() != n * c || grad_output.dtype() != io)) {
    return absl::InvalidArgumentError(absl::StrCat("BackwardInput(", mb, "): grad_output: want ",
                                                   DTypeName(io), " [", s->batch, ", ", s->seq,
                                                   ", ", c, "]"));
  }
  if (!config_.is_first() &&
      (!grad_input.defined() || grad_input.numel() != n * c || grad_input.dtype() != io)) {
    return absl::InvalidArgumentError(absl::StrCat("BackwardInput(", mb, "): grad_input: want ",
                                                   DTypeName(io), " [", s->batch, ", ", s->seq,
                                                   ", ", c, "]"));
  }
  const absl::Status status = RunBackwardInput(*s, grad_output, grad_input);
  SampleActivationBytes();
  if (status.ok()) return status;
  return ActivationError(status, absl::StrCat("BackwardInput(", mb, ")"));
}

absl::Status GptStage::RunBackwardInput(Microbatch& s, const Tensor& grad_output,
                                        const Tensor& grad_input) {
  const int64_t n = s.batch * s.seq, c = config_.model.d_model;
  const int64_t rows = ResidualRows(n);
  kernels::Arena& arena = s.arena;
  if (sp_) sp_scratch_->Reset();
  Tensor d;  // gradient of the current block's output (this rank's rows under SP)
  if (config_.is_last()) {
    const Tensor x_last = s.blocks.empty() ? s.x0 : s.blocks.back().x_out;
    BATON_ASSIGN_OR_RETURN(Tensor dxf, (sp_ ? *sp_scratch_ : arena).Allocate({n, c}));
    BATON_ASSIGN_OR_RETURN(s.dlogits_gemm, ForGemm(arena, s.dlogits));
    kernels::LinearBackwardInput(ctx_, dxf, s.dlogits_gemm, W(head_), /*accumulate=*/false);
    if (vocab_parallel_) {
      BATON_ASSIGN_OR_RETURN(dxf, SumOverTp(dxf, "the LM head input gradient", -1));
    } else if (sp_) {
      dxf = OwnRows(dxf, n);  // every rank computed the whole
    }
    BATON_ASSIGN_OR_RETURN(d, arena.Allocate({rows, c}));
    kernels::FillZero(ctx_, d);
    NormBackward(d, lnf_w_, lnf_b_, dxf, x_last, s.meanf, s.rstdf);
  } else if (bf16_) {
    BATON_ASSIGN_OR_RETURN(d, arena.Allocate({rows, c}));
    kernels::Cast(ctx_, d, OwnRows(grad_output, n));
  } else {
    BATON_ASSIGN_OR_RETURN(d, Copy(ctx_, arena, OwnRows(grad_output, n), {rows, c}));
  }
  for (int i = static_cast<int>(blocks_.size()) - 1; i >= 0; --i) {
    BATON_ASSIGN_OR_RETURN(Tensor d_in, arena.Allocate({rows, c}));
    BATON_RETURN_IF_ERROR_CTX(BlockBackwardInput(blocks_[i], s, s.blocks[i], d, d_in), "block ",
                              blocks_[i].index, " backward");
    d = d_in;
  }
  if (sp_) {
    // The embedding's gradient and the message are whole: every rank's rows
    // gathered (the first stage keeps them for BackwardWeight).
    if (config_.is_first()) {
      BATON_ASSIGN_OR_RETURN(d, GatherRows(arena, d, "the embedding gradient", -1));
    } else if (!bf16_) {
      BATON_RETURN_IF_ERROR(AllGatherTp(d, grad_input, "the stage input gradient"));
    } else {
      BATON_ASSIGN_OR_RETURN(Tensor whole, GatherRows(*sp_scratch_, d, "the stage input gradient", -1));
      kernels::Cast(ctx_, grad_input, whole);
    }
  }
  s.d_x0 = d;
  if (!config_.is_first() && !sp_) {
    if (bf16_) {
      kernels::Cast(ctx_, grad_input, d);
    } else {
      kernels::Copy(ctx_, grad_input, d);
    }
  }
  s.backward_input_done = true;
  return absl::OkStatus();
}

absl::Status GptStage::BlockBackwardInput(const Block& b, Microbatch& mb, BlockActivations& a,
                                          const Tensor& d_out, const Tensor& d_in) {
  const int64_t rows = ResidualRows(mb.batch * mb.seq), c = config_.model.d_model;
  kernels::Arena& arena = mb.arena;
  if (sp_) sp_scratch_->Reset();
  // With bf16, each gradient entering a GEMM is rounded to bf16 once (a.d_out,
  // a.dh, a.d_mid, ...; dqkv comes out of attention in bf16); bias and norm
  // gradients and the residual stream stay fp32. Under SP the row-parallel
  // GEMMs read every token's output gradient: this rank's rows gathered (an
  // fp32 temporary when a bf16 copy is what stays).
  BATON_ASSIGN_OR_RETURN(const Tensor d_out_all,
                         GatherRows(bf16_ ? *sp_scratch_ : arena, d_out, "the MLP output gradient", b.index));
  BATON_ASSIGN_OR_RETURN(a.d_out, ForGemm(arena, d_out_all));
  BATON_ASSIGN_OR_RETURN(Tensor dln2, MlpBackwardInput(b, mb, a, d_out_all));
  BATON_ASSIGN_OR_RETURN(dln2, SumOverTp(dln2, "the MLP input gradient", b.index));
  BATON_ASSIGN_OR_RETURN(Tensor d_mid, arena.Allocate({rows, c}));  // fp32, the residual stream's gradient
  kernels::Copy(ctx_, d_mid, d_out);
  NormBackward(d_mid, b.ln2_w, b.ln2_b, dln2, a.x_mid, a.mean2, a.rstd2);
  BATON_ASSIGN_OR_RETURN(const Tensor d_mid_all,
                         GatherRows(bf16_ ? *sp_scratch_ : arena, d_mid, "the attention output gradient", b.index));
  BATON_ASSIGN_OR_RETURN(Tensor dln1, AttentionBackwardInput(b, mb, a, d_mid_all));
  BATON_ASSIGN_OR_RETURN(dln1, SumOverTp(dln1, "the attention input gradient", b.index));
  kernels::Copy(ctx_, d_in, d_mid);
  NormBackward(d_in, b.ln1_w, b.ln1_b, dln1, a.x_in, a.mean1, a.rstd1);
  return absl::OkStatus();
}

absl::StatusOr<Tensor> GptStage::MlpBackwardInput(const Block& b, Microbatch& mb, BlockActivations& a,
                                                  const Tensor& d_out) {
  if (b.moe()) return MoeBackwardInput(b, mb, a, d_out);
  const int64_t n = mb.batch * mb.seq, c = config_.model.d_model;
  const int64_t fl = config_.model.ffn_dim() / config_.tp_size;
  kernels::Arena& arena = mb.arena;
  if (b.fc2_b != nullptr) kernels::BiasBackward(ctx_, b.fc2_b->grad, d_out);
  BATON_ASSIGN_OR_RETURN(Tensor dg, arena.Allocate({n, fl}));
  kernels::LinearBackwardInput(ctx_, dg, a.d_out, W(b.fc2_w), /*accumulate=*/false);
  // A partial sum over TP: under SP a temporary (reduce-scattered).
  BATON_ASSIGN_OR_RETURN(Tensor dln2, (sp_ ? *sp_scratch_ : arena).Allocate({n, c}));
  if (llama_) {
    BATON_ASSIGN_OR_RETURN(Tensor dgate, arena.Allocate({n, fl}));
    BATON_ASSIGN_OR_RETURN(Tensor dup, arena.Allocate({n, fl}));
    kernels::SwiGluBackward(ctx_, dgate, dup, dg, a.h, a.up);
    BATON_ASSIGN_OR_RETURN(a.dh, ForGemm(arena, dgate));
    BATON_ASSIGN_OR_RETURN(a.dup, ForGemm(arena, dup));
    kernels::LinearBackwardInput(ctx_, dln2, a.dh, W(b.fc_w), /*accumulate=*/false);
    kernels::LinearBackwardInput(ctx_, dln2, a.dup, W(b.up_w), /*accumulate=*/true);
    return dln2;
  }
  kernels::GeluBackward(ctx_, dg, a.h, dg);
  kernels::BiasBackward(ctx_, b.fc_b->grad, dg);
  BATON_ASSIGN_OR_RETURN(a.dh, ForGemm(arena, dg));
  kernels::LinearBackwardInput(ctx_, dln2, a.dh, W(b.fc_w), /*accumulate=*/false);
  return dln2;
}

absl::StatusOr<Tensor> GptStage::AttentionBackwardInput(const Block& b, Microbatch& mb, BlockActivations& a,
                                                        const Tensor& d_mid) {
  const GptConfig& m = config_.model;
  const int64_t n = mb.batch * mb.seq, c = m.d_model, tp = config_.tp_size;
  const int64_t cl = int64_t{m.heads} * m.head_dim() / tp;
  const int heads = static_cast<int>(m.heads / tp);
  kernels::Arena& arena = mb.arena;
  if (b.proj_b != nullptr) kernels::BiasBackward(ctx_, b.proj_b->grad, d_mid);
  BATON_ASSIGN_OR_RETURN(a.d_mid, ForGemm(arena, d_mid));
  BATON_ASSIGN_OR_RETURN(Tensor dy, arena.Allocate({n, cl}, gemm_dtype_));
  kernels::LinearBackwardInput(ctx_, dy, a.d_mid, W(b.proj_w), /*accumulate=*/false);
  BATON_ASSIGN_OR_RETURN(a.dqkv, arena.Allocate({mb.batch, mb.seq, 3 * cl}, gemm_dtype_));
  if (cp_ != nullptr) {
    BATON_RETURN_IF_ERROR(RingAttentionBackward(b, mb, a, dy));
  } else {
    const kernels::AttentionBuffers att =
        kernels::AttentionBuffersFor(ctx_, mb.batch, mb.seq, cl, heads, gemm_dtype_);
    BATON_ASSIGN_OR_RETURN(Tensor scratch, arena.Allocate({att.backward_scratch}));
    kernels::AttentionBackward(ctx_, a.dqkv, scratch, dy, a.qkv, a.att, heads);
  }
  BATON_ASSIGN_OR_RETURN(Tensor dln1, (sp_ ? *sp_scratch_ : arena).Allocate({n, c}));
  if (llama_) {
    const int kv_heads = m.key_value_heads() / static_cast<int>(tp);
    const int64_t kvl = int64_t{kv_heads} * m.head_dim();
    BATON_ASSIGN_OR_RETURN(a.dq, arena.Allocate({n, cl}, gemm_dtype_));
    BATON_ASSIGN_OR_RETURN(a.dk, arena.Allocate({n, kvl}, gemm_dtype_));
    BATON_ASSIGN_OR_RETURN(a.dv, arena.Allocate({n, kvl}, gemm_dtype_));
    if (cp_ == nullptr) {
      kernels::RopePackBackward(ctx_, a.dq, a.dk, a.dv, a.dqkv, heads, kv_heads, m.rope_theta);
    } else {
      for (int half = 0; half < 2; ++half) {
        kernels::RopePackBackward(ctx_, Half(a.dq, half), Half(a.dk, half), Half(a.dv, half), Half(a.dqkv, half),
                                  heads, kv_heads, m.rope_theta, HalfOffset(half, mb.seq));
      }
    }
    kernels::LinearBackwardInput(ctx_, dln1, a.dq, W(b.q_w), /*accumulate=*/false);
    kernels::LinearBackwardInput(ctx_, dln1, a.dk, W(b.k_w), /*accumulate=*/true);
    kernels::LinearBackwardInput(ctx_, dln1, a.dv, W(b.v_w), /*accumulate=*/true);
    return dln1;
  }
  if (bf16_) {
    BATON_ASSIGN_OR_RETURN(Tensor dqkv, arena.Allocate(a.dqkv.shape()));  // bias gradients sum in fp32
    kernels::Cast(ctx_, dqkv, a.dqkv);
    kernels::BiasBackward(ctx_, b.qkv_b->grad, dqkv);
  } else {
    kernels::BiasBackward(ctx_, b.qkv_b->grad, a.dqkv);
  }
  kernels::LinearBackwardInput(ctx_, dln1, a.dqkv, W(b.qkv_w), /*accumulate=*/false);
  return dln1;
}

// ---------------------------------------------------------------------------
// Mixture of Experts (see gpt_stage.h).

absl::StatusOr<Tensor> GptStage::MoeForward(const Block& b, Microbatch& mb, BlockActivations& a) {
  const GptConfig& m = config_.model;
  const int64_t n = mb.batch * mb.seq, c = m.d_model, fl = m.ffn_dim() / config_.tp_size;
  const int64_t experts = m.moe_experts, k = m.moe_top_k;
  kernels::Arena& arena = mb.arena;
  // Under bf16 the router and the token exchange run on the fp32 image of
  // the bf16 MLP input (routing in fp32, as Megatron and DeepSpeed do); the
  // experts' GEMMs read bf16 rows and their bf16 weight copies.
  BATON_ASSIGN_OR_RETURN(const Tensor x, Fp32Image(sp_ ? *sp_scratch_ : arena, a.ln2));
  // Routing: every TP rank routes the same whole tokens with the same
  // (replicated) router, so their choices agree bit for bit.
  BATON_ASSIGN_OR_RETURN(Tensor logits, (sp_ ? *sp_scratch_ : arena).Allocate({n, experts}));
  kernels::Linear(ctx_, logits, x, b.router->value, Tensor());
  BATON_ASSIGN_OR_RETURN(a.probs, arena.Allocate({n, experts}));
  BATON_ASSIGN_OR_RETURN(a.expert, arena.Allocate({n, k}, kernels::DType::kInt32));
  BATON_ASSIGN_OR_RETURN(a.gate, arena.Allocate({n, k}));
  BATON_ASSIGN_OR_RETURN(a.slot, arena.Allocate({n, k}, kernels::DType::kInt32));
  kernels::RouterTopK(ctx_, a.probs, a.expert, a.gate, logits, /*renormalize=*/k > 1);
  // Row 0: choices routed to each expert; row 1: those kept (capacity).
  BATON_ASSIGN_OR_RETURN(Tensor counts, arena.Allocate({2, experts}, kernels::DType::kInt64));
  kernels::ExpertTokenCounts(ctx_, counts.Rows(0, 1).Reshaped({experts}), a.expert);
  const int64_t capacity = m.moe_capacity_factor == 0.0
                               ? n * k  // dropless: no expert can take more
                               : kernels::MoeExpertCapacity(n, experts, k, m.moe_capacity_factor);
  kernels::PlanDispatch(ctx_, a.slot, counts.Rows(1, 2).Reshaped({experts}), a.expert, capacity);
  // The load-balancing loss, weighted as a microbatch's share of the step's
  // objective (1 / microbatches), with its logit gradient for the backward.
  BATON_ASSIGN_OR_RETURN(a.dlogits_aux, arena.Allocate({n, experts}));
  if (cp_ == nullptr) {
    kernels::LoadBalancingLoss(ctx_, aux_acc_, a.dlogits_aux, a.probs, a.expert, m.moe_aux_coef,
                               1.0f / static_cast<float>(config_.microbatches));
  } else {
    BATON_RETURN_IF_ERROR(CpLoadBalancingLoss(b, arena, a));
  }
  // The expert buffers are as long as the fullest expert's: the counts come
  // to the host (one synchronisation per MoE block), which also keeps each
  // expert's GEMMs to the rows it got.
  const Tensor host_counts = Tensor::Zeros({2, experts}, kernels::DType::kInt64);
  kernels::Copy(ctx_, host_counts, counts);
  BATON_RETURN_IF_ERROR_CTX(stream_->Synchronize(), "reading the expert token counts");
  std::vector<int64_t> kept(experts);
  a.cap = 1;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t routed = host_counts.data<int64_t>()[e];
    kept[e] = host_counts.data<int64_t>()[experts + e];
    a.cap = std::max(a.cap, kept[e]);
    moe_routed_[e] += routed;
    moe_kept_[e] += kept[e];
  }
  BATON_ASSIGN_OR_RETURN(a.expert_in, arena.Allocate({experts, a.cap, c}));
  kernels::Permute(ctx_, a.expert_in, x, a.expert, a.slot);
  // The rows this rank's experts compute: its own tokens' (ep 1), or every
  // ep rank's for the experts held here, by all-to-all.
  BATON_RETURN_IF_ERROR(PlanExpertRows(b, kept, a));
  const int64_t rows = a.ep_recv_rows.empty() ? experts * a.cap : Sum(a.ep_recv_rows);
  Tensor in = a.expert_in.Reshaped({experts * a.cap, c});
  if (ep_ != nullptr) {
    BATON_ASSIGN_OR_RETURN(in, arena.Allocate({rows, c}));
    BATON_RETURN_IF_ERROR(SendToExperts(arena, a, a.expert_in.Reshaped({experts * a.cap, c}), in,
                                        "the tokens for the experts", b.index));
  }
  BATON_ASSIGN_OR_RETURN(a.expert_rows_in, ForGemm(arena, in));  // bf16: rounded once, every row
  BATON_ASSIGN_OR_RETURN(a.h, arena.Allocate({rows, fl}));
  BATON_ASSIGN_OR_RETURN(Tensor g32, arena.Allocate({rows, fl}));
  a.g = g32;  // bf16: the GEMM's rounded copy, row range by row range
  if (bf16_) {
    BATON_ASSIGN_OR_RETURN(a.g, arena.Allocate({rows, fl}, gemm_dtype_));
  }
  if (llama_) {
    BATON_ASSIGN_OR_RETURN(a.up, arena.Allocate({rows, fl}));
  }
  BATON_ASSIGN_OR_RETURN(Tensor out, arena.Allocate({rows, c}));
  for (const ExpertRows& r : a.expert_rows) {
    const Block::Expert& e = b.experts[r.expert];
    const int64_t lo = r.row, hi = r.row + r.rows;
    const Tensor h = a.h.Rows(lo, hi), g = g32.Rows(lo, hi), rows_in = a.expert_rows_in.Rows(lo, hi);
    kernels::Linear(ctx_, h, rows_in, W(e.fc), Tensor());
    if (llama_) {
      kernels::Linear(ctx_, a.up.Rows(lo, hi), rows_in, W(e.up), Tensor());
      kernels::SwiGlu(ctx_, g, h, a.up.Rows(lo, hi));
    } else {
      kernels::Gelu(ctx_, g, h);
    }
    if (bf16_) kernels::Cast(ctx_, a.g.Rows(lo, hi), g);
    kernels::Linear(ctx_, out.Rows(lo, hi), a.g.Rows(lo, hi), W(e.fc2), Tensor());
  }
  if (ep_ == nullptr) {
    a.expert_out = out.Reshaped({experts, a.cap, c});
  } else {
    // Back to the ranks whose tokens they are, in this rank's buffer layout.
    BATON_ASSIGN_OR_RETURN(a.expert_out, arena.Allocate({experts, a.cap, c}));
    BATON_RETURN_IF_ERROR(ReturnFromExperts(arena, a, out, a.expert_out.Reshaped({experts * a.cap, c}),
                                            "the expert outputs", b.index));
  }
  // The gated sum of each token's kept choices: a partial sum over TP.
  BATON_ASSIGN_OR_RETURN(Tensor partial, (sp_ ? *sp_scratch_ : arena).Allocate({n, c}));
  kernels::Combine(ctx_, partial, a.expert_out, a.gate, a.expert, a.slot);
  return SumOverTp(partial, "the MoE output", b.index);
}

absl::Status GptStage::CpLoadBalancingLoss(const Block& b, kernels::Arena& arena, BlockActivations& a) {
  // The loss is over the whole sequences' tokens, as without cp: the ring's
  // ranks gather every rank's router probabilities and choices (small: E + k
  // numbers a token), each computes the whole loss and keeps its own tokens'
  // logit gradients; cp rank 0 alone adds the loss, so the ranks' sum is it.
  const GptConfig& m = config_.model;
  const int64_t n = a.probs.dim(0), experts = m.moe_experts, k = m.moe_top_k, cp = config_.cp_size;
  BATON_ASSIGN_OR_RETURN(const Tensor probs, arena.Allocate({cp * n, experts}));
  BATON_ASSIGN_OR_RETURN(const Tensor expert, arena.Allocate({cp * n, k}, kernels::DType::kInt32));
  BATON_ASSIGN_OR_RETURN(const Tensor dlogits, arena.Allocate({cp * n, experts}));
  const std::string what = absl::StrCat("context-parallel all-gather of the router's choices in block ", b.index);
  BATON_RETURN_IF_ERROR_CTX(stream_->Synchronize(), what);  // the communicator reads what the stream wrote
  BATON_RETURN_IF_ERROR_CTX(cp_->AllGather(CommBuffer(a.probs), CommBuffer(probs))->Wait(config_.comm_timeout), what);
  BATON_RETURN_IF_ERROR_CTX(cp_->AllGather(CommBuffer(a.expert), CommBuffer(expert))->Wait(config_.comm_timeout),
                            what);
  // The executor averages gradients over the dp x cp group, as it must for
  // the cross-entropy (each cp rank's is of its own tokens' mean); this loss
  // is the whole sequences' already, so its gradient is weighted cp times
  // (the kernel's weight scales the gradient only).
  Tensor acc = aux_acc_;
  if (config_.cp_rank != 0) {
    BATON_ASSIGN_OR_RETURN(acc, arena.Allocate({1}));
    kernels::FillZero(ctx_, acc);
  }
  kernels::LoadBalancingLoss(ctx_, acc, dlogits, probs, expert, m.moe_aux_coef,
                             static_cast<float>(cp) / static_cast<float>(config_.microbatches));
  kernels::Copy(ctx_, a.dlogits_aux, dlogits.Rows(config_.cp_rank * n, (config_.cp_rank + 1) * n));
  return absl::OkStatus();
}

absl::Status GptStage::PlanExpertRows(const Block& b, const std::vector<int64_t>& kept, BlockActivations& a) {
  const int64_t experts = config_.model.moe_experts;
  a.expert_rows.clear();
  a.ep_send_rows.clear();
  a.ep_recv_rows.clear();
  if (ep_ == nullptr) {
    for (int64_t e = 0; e < experts; ++e) {
      if (kept[e] > 0) a.expert_rows.push_back({static_cast<int>(e), e * a.cap, kept[e]});
    }
    return absl::OkStatus();
  }
  // Every ep rank's kept counts, in one all-gather of host int64s.
  const int ep = config_.ep_size;
  const int64_t local = experts / ep;
  std::vector<int64_t> mine(kept.begin(), kept.end());
  a.ep_kept.assign(experts * ep, 0);
  comm::Buffer from{mine.data(), static_cast<int64_t>(mine.size()), comm::DType::kInt64, -1};
  comm::Buffer to{a.ep_kept.data(), static_cast<int64_t>(a.ep_kept.size()), comm::DType::kInt64, -1};
  BATON_RETURN_IF_ERROR_CTX(ep_->AllGather(from, to)->Wait(config_.comm_timeout),
                            "expert-parallel all-gather of the expert counts in block ", b.index);
  // Only kept rows travel, packed (PackExpertRows): this rank sends rank r
  // its kept rows of r's experts, and receives from each rank s the kept
  // rows of this rank's experts in s's buffer: [s][local expert][kept] rows.
  int64_t row = 0;
  for (int s = 0; s < ep; ++s) {
    int64_t send = 0;
    for (int64_t l = 0; l < local; ++l) send += kept[s * local + l];
    a.ep_send_rows.push_back(send);
    int64_t recv = 0;
    for (int64_t l = 0; l < local; ++l) {
      const int64_t rows = a.ep_kept[s * experts + config_.ep_rank * local + l];
      if (rows > 0) a.expert_rows.push_back({static_cast<int>(l), row, rows});
      row += rows;
      recv += rows;
    }
    a.ep_recv_rows.push_back(recv);
  }
  return absl::OkStatus();
}

void GptStage::PackExpertRows(const BlockActivations& a, const Tensor& buffer, const Tensor& packed, bool pack) {
  const int64_t experts = config_.model.moe_experts;
  int64_t row = 0;
  for (int64_t e = 0; e < experts; ++e) {  // rank r's experts are r·local … : rank order
    const int64_t n = a.ep_kept[config_.ep_rank * experts + e];
    if (n == 0) continue;
    const Tensor rows = buffer.Rows(e * a.cap, e * a.cap + n), at = packed.Rows(row, row + n);
    kernels::Copy(ctx_, pack ? at : rows, pack ? rows : at);
    row += n;
  }
}

absl::Status GptStage::SendToExperts(kernels::Arena& arena, const BlockActivations& a, const Tensor& buffer,
                                     const Tensor& to, const char* what, int block) {
  BATON_ASSIGN_OR_RETURN(const Tensor packed, arena.Allocate({Sum(a.ep_send_rows), buffer.dim(1)}));
  PackExpertRows(a, buffer, packed, /*pack=*/true);
  return ExchangeExpertRows(packed, a.ep_send_rows, to, a.ep_recv_rows, what, block);
}

absl::Status GptStage::ReturnFromExperts(kernels::Arena& arena, const BlockActivations& a, const Tensor& rows,
                                         const Tensor& buffer, const char* what, int block) {
  BATON_ASSIGN_OR_RETURN(const Tensor packed, arena.Allocate({Sum(a.ep_send_rows), buffer.dim(1)}));
  BATON_RETURN_IF_ERROR(ExchangeExpertRows(rows, a.ep_recv_rows, packed, a.ep_send_rows, what, block));
  kernels::FillZero(ctx_, buffer);  // the rows past each expert's count
  PackExpertRows(a, buffer, packed, /*pack=*/false);
  return absl::OkStatus();
}

absl::Status GptStage::ExchangeExpertRows(const Tensor& from, const std::vector<int64_t>& send_rows, const Tensor& to,
                                          const std::vector<int64_t>& recv_rows, const char* what, int block) {
  const int64_t width = from.dim(1);
  std::vector<int64_t> send(send_rows.size()), recv(recv_rows.size());
  for (size_t i = 0; i < send.size(); ++i) send[i] = send_rows[i] * width;
  for (size_t i = 0; i < recv.size(); ++i) recv[i] = recv_rows[i] * width;
  // The communicator reads and writes memory the stream is done with.
  absl::Status status = stream_->Synchronize();
  if (status.ok()) status = ep_->AllToAllV(CommBuffer(from), send, CommBuffer(to), recv)->Wait(config_.comm_timeout);
  return WithContext(status, absl::StrCat("expert-parallel all-to-all of ", what, " in block ", block));
}

absl::StatusOr<Tensor> GptStage::MoeBackwardInput(const Block& b, Microbatch& mb, BlockActivations& a,
                                                  const Tensor& d_out) {
  const GptConfig& m = config_.model;
  const int64_t n = mb.batch * mb.seq, c = m.d_model, fl = m.ffn_dim() / config_.tp_size;
  const int64_t experts = m.moe_experts, k = m.moe_top_k;
  const int64_t rows = a.expert_rows_in.dim(0);
  kernels::Arena& arena = mb.arena;
  BATON_ASSIGN_OR_RETURN(Tensor dexpert_out, arena.Allocate({experts, a.cap, c}));
  BATON_ASSIGN_OR_RETURN(Tensor dgate, arena.Allocate({n, k}));
  kernels::CombineBackward(ctx_, dexpert_out, dgate, d_out, a.expert_out, a.gate, a.expert, a.slot);
  // Each TP rank's expert outputs are partial sums, so are its gate gradients.
  BATON_RETURN_IF_ERROR(AllReduceTp(dgate, "the MoE gate gradients", b.index));
  a.dexpert_out = dexpert_out.Reshaped({experts * a.cap, c});
  if (ep_ != nullptr) {
    // To the experts' ranks, in the rows their forward computed.
    BATON_ASSIGN_OR_RETURN(a.dexpert_out, arena.Allocate({rows, c}));
    BATON_RETURN_IF_ERROR(SendToExperts(arena, a, dexpert_out.Reshaped({experts * a.cap, c}), a.dexpert_out,
                                        "the expert output gradients", b.index));
  }
  // bf16: each gradient entering a GEMM rounded once (as the dense MLP's).
  BATON_ASSIGN_OR_RETURN(a.dexpert_out, ForGemm(arena, a.dexpert_out));
  BATON_ASSIGN_OR_RETURN(Tensor dh32, arena.Allocate({rows, fl}));
  Tensor dup32;
  if (llama_) {
    BATON_ASSIGN_OR_RETURN(dup32, arena.Allocate({rows, fl}));
  }
  a.dh = dh32;
  a.dup = dup32;
  if (bf16_) {
    BATON_ASSIGN_OR_RETURN(a.dh, arena.Allocate({rows, fl}, gemm_dtype_));
    if (llama_) {
      BATON_ASSIGN_OR_RETURN(a.dup, arena.Allocate({rows, fl}, gemm_dtype_));
    }
  }
  BATON_ASSIGN_OR_RETURN(Tensor dg, arena.Allocate({rows, fl}));
  BATON_ASSIGN_OR_RETURN(Tensor dx, arena.Allocate({rows, c}));
  for (const ExpertRows& r : a.expert_rows) {
    const Block::Expert& e = b.experts[r.expert];
    const int64_t lo = r.row, hi = r.row + r.rows;
    const Tensor dge = dg.Rows(lo, hi), dh = dh32.Rows(lo, hi);
    kernels::LinearBackwardInput(ctx_, dge, a.dexpert_out.Rows(lo, hi), W(e.fc2), /*accumulate=*/false);
    if (llama_) {
      kernels::SwiGluBackward(ctx_, dh, dup32.Rows(lo, hi), dge, a.h.Rows(lo, hi), a.up.Rows(lo, hi));
      if (bf16_) {
        kernels::Cast(ctx_, a.dh.Rows(lo, hi), dh);
        kernels::Cast(ctx_, a.dup.Rows(lo, hi), dup32.Rows(lo, hi));
      }
      kernels::LinearBackwardInput(ctx_, dx.Rows(lo, hi), a.dh.Rows(lo, hi), W(e.fc), /*accumulate=*/false);
      kernels::LinearBackwardInput(ctx_, dx.Rows(lo, hi), a.dup.Rows(lo, hi), W(e.up), /*accumulate=*/true);
    } else {
      kernels::GeluBackward(ctx_, dh, a.h.Rows(lo, hi), dge);
      if (bf16_) kernels::Cast(ctx_, a.dh.Rows(lo, hi), dh);
      kernels::LinearBackwardInput(ctx_, dx.Rows(lo, hi), a.dh.Rows(lo, hi), W(e.fc), /*accumulate=*/false);
    }
  }
  Tensor din;
  if (ep_ == nullptr) {
    din = dx.Reshaped({experts, a.cap, c});
  } else {
    BATON_ASSIGN_OR_RETURN(din, arena.Allocate({experts, a.cap, c}));
    BATON_RETURN_IF_ERROR(ReturnFromExperts(arena, a, dx, din.Reshaped({experts * a.cap, c}),
                                            "the expert input gradients", b.index));
  }
  // A partial sum over TP, like the dense MLP's (under SP a temporary).
  BATON_ASSIGN_OR_RETURN(Tensor dln2, (sp_ ? *sp_scratch_ : arena).Allocate({n, c}));
  kernels::PermuteBackward(ctx_, dln2, din, a.expert, a.slot);
  // The router: through the gates and the load-balancing loss. Its weight is
  // replicated, so its input gradient joins the TP sum from rank 0 only.
  BATON_ASSIGN_OR_RETURN(a.dlogits, arena.Allocate({n, experts}));
  kernels::RouterTopKBackward(ctx_, a.dlogits, dgate, a.expert, a.gate, a.probs, /*renormalize=*/k > 1);
  kernels::Residual(ctx_, a.dlogits, a.dlogits, a.dlogits_aux);
  if (config_.tp_rank == 0) {
    kernels::LinearBackwardInput(ctx_, dln2, a.dlogits, b.router->value, /*accumulate=*/true);
  }
  return dln2;
}

absl::Status GptStage::MoeBackwardWeight(const Block& b, const BlockActivations& a, const Tensor& ln2) {
  for (const ExpertRows& r : a.expert_rows) {
    const Block::Expert& x = b.experts[r.expert];
    const int64_t lo = r.row, hi = r.row + r.rows;
    kernels::LinearBackwardWeight(ctx_, x.fc2->grad, a.dexpert_out.Rows(lo, hi), a.g.Rows(lo, hi));
    kernels::LinearBackwardWeight(ctx_, x.fc->grad, a.dh.Rows(lo, hi), a.expert_rows_in.Rows(lo, hi));
    if (llama_) kernels::LinearBackwardWeight(ctx_, x.up->grad, a.dup.Rows(lo, hi), a.expert_rows_in.Rows(lo, hi));
  }
  // The router's input is the fp32 image of the (bf16) MLP input, as in the
  // forward.
  BATON_ASSIGN_OR_RETURN(const Tensor x, Fp32Image(*sp_scratch_, ln2));
  kernels::LinearBackwardWeight(ctx_, b.router->grad, a.dlogits, x);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Context parallelism: ring attention (see gpt_stage.h).

struct GptStage::RingTransfer {
  std::shared_ptr<comm::Work> send, recv;
};

int64_t GptStage::HalfOffset(int half, int64_t seq) const {
  if (cp_ == nullptr) return 0;
  return CpHalfOffset(half, config_.cp_rank, config_.cp_size, seq * 2 * config_.cp_size);
}

uint64_t GptStage::NextRingTag() {
  // Chunks of one rank share its cp group: the chunk index keeps their tags apart.
  return (static_cast<uint64_t>(config_.pp_rank) << 48) | ++cp_tag_;
}

absl::StatusOr<Tensor> GptStage::Fp32Image(kernels::Arena& arena, const Tensor& t) const {
  if (t.dtype() == kernels::DType::kFloat32) return t;
  BATON_ASSIGN_OR_RETURN(Tensor wide, arena.Allocate(t.shape()));
  kernels::Cast(ctx_, wide, t);
  return wide;
}

int GptStage::PrevCpRank() const { return (config_.cp_rank + config_.cp_size - 1) % config_.cp_size; }

absl::StatusOr<std::shared_ptr<comm::Work>> GptStage::SendToNext(const Tensor& t, uint64_t tag) {
  // The communicator reads host memory: what the stream wrote must be done
  // (immediate on the CPU, which runs ops inline).
  BATON_RETURN_IF_ERROR(stream_->Synchronize());
  return cp_->Send(CommBuffer(t), (config_.cp_rank + 1) % config_.cp_size, tag);
}

absl::StatusOr<GptStage::RingTransfer> GptStage::StartRing(const Tensor& send, const Tensor& recv) {
  // Before the receive too: ops still on the stream may read `recv`'s
  // memory (the block it held a step ago).
  BATON_RETURN_IF_ERROR(stream_->Synchronize());
  const uint64_t tag = NextRingTag();
  RingTransfer t;
  t.recv = cp_->Recv(CommBuffer(recv), PrevCpRank(), tag);
  BATON_ASSIGN_OR_RETURN(t.send, SendToNext(send, tag));
  return t;
}

absl::Status GptStage::AwaitRingWork(comm::Work& work, const char* what, int block, bool sending) {
  BATON_RETURN_IF_ERROR_CTX(work.Wait(config_.comm_timeout), "context-parallel ring transfer of ", what,
                            " in block ", block,
                            sending ? absl::StrCat(" (sending to cp rank ", (config_.cp_rank + 1) % config_.cp_size, ")")
                                    : absl::StrCat(" (receiving from cp rank ", PrevCpRank(), ")"));
  return absl::OkStatus();
}

absl::Status GptStage::AwaitRing(RingTransfer& t, const char* what, int block) {
  BATON_RETURN_IF_ERROR(AwaitRingWork(*t.send, what, block, /*sending=*/true));
  return AwaitRingWork(*t.recv, what, block, /*sending=*/false);
}

absl::Status GptStage::RingAttentionForward(const Block& b, Microbatch& mb, BlockActivations& a) {
  const int cp = config_.cp_size, c = config_.cp_rank;
  const int64_t t = mb.seq, full = t * 2 * cp, rows_b = mb.batch / 2;
  const int64_t cl = a.qkv.dim(2) / 3;
  const int heads = static_cast<int>(config_.model.heads / config_.tp_size);
  kernels::Arena& tmp = *cp_scratch_;
  tmp.Reset();
  BATON_ASSIGN_OR_RETURN(a.att, mb.arena.Allocate({mb.batch, heads, t}));  // the log-sum-exps
  // Under bf16 the blocks read bf16 q, k and v (the key/value blocks travel
  // the ring in bf16), the output merges in fp32 and is rounded once
  // (kernels/ops.h: bf16 ring inputs).
  const Tensor& qkv = a.qkv;
  Tensor y = a.y.Reshaped({mb.batch, t, cl});
  if (bf16_) {
    BATON_ASSIGN_OR_RETURN(y, tmp.Allocate({mb.batch, t, cl}));
  }
  BATON_ASSIGN_OR_RETURN(Tensor cur, tmp.Allocate({mb.batch, t, 2 * cl}, qkv.dtype()));
  BATON_ASSIGN_OR_RETURN(Tensor next, tmp.Allocate({mb.batch, t, 2 * cl}, qkv.dtype()));
  BATON_ASSIGN_OR_RETURN(Tensor block_out, tmp.Allocate({rows_b, t, cl}));
  BATON_ASSIGN_OR_RETURN(Tensor block_lse, tmp.Allocate({rows_b, heads, t}));
  BATON_ASSIGN_OR_RETURN(Tensor scratch, tmp.Allocate({kernels::BlockAttentionScratch(t, t)}));
  kernels::KvOfQkv(ctx_, cur, qkv);
  // The diagonal blocks first: every query sees itself there, so they start
  // the running output and log-sum-exp.
  for (int half = 0; half < 2; ++half) {
    kernels::BlockAttention(ctx_, Half(y, half), Half(a.att, half), Half(qkv, half), Half(cur, half), heads,
                            HalfOffset(half, t), HalfOffset(half, t), scratch);
  }
  for (int step = 0; step < cp; ++step) {
    RingTransfer transfer;
    if (step + 1 < cp) {
      BATON_ASSIGN_OR_RETURN(transfer, StartRing(cur, next));
    }
    const int owner = (c - step + cp) % cp;  // whose k and v `cur` holds
    for (int qh = 0; qh < 2; ++qh) {
      for (int kh = 0; kh < 2; ++kh) {
        if (step == 0 && qh == kh) continue;  // the diagonal, done
        const int64_t q_offset = HalfOffset(qh, t), k_offset = CpHalfOffset(kh, owner, cp, full);
        if (k_offset > q_offset + t - 1) continue;  // wholly in the causal future
        kernels::BlockAttention(ctx_, block_out, block_lse, Half(qkv, qh), Half(cur, kh), heads, q_offset,
                                k_offset, scratch);
        kernels::MergeAttentionBlock(ctx_, Half(y, qh), Half(a.att, qh), block_out, block_lse, heads);
      }
    }
    if (step + 1 < cp) {
      BATON_RETURN_IF_ERROR(AwaitRing(transfer, "the keys and values", b.index));
      std::swap(cur, next);
    }
  }
  if (bf16_) kernels::Cast(ctx_, a.y.Reshaped({mb.batch, t, cl}), y);
  return absl::OkStatus();
}

absl::Status GptStage::RingAttentionBackward(const Block& b, Microbatch& mb, BlockActivations& a, const Tensor& dy) {
  const int cp = config_.cp_size, c = config_.cp_rank;
  const int64_t t = mb.seq, full = t * 2 * cp;
  const int64_t cl = a.qkv.dim(2) / 3;
  const int heads = static_cast<int>(config_.model.heads / config_.tp_size);
  kernels::Arena& tmp = *cp_scratch_;
  tmp.Reset();
  // Under bf16 the blocks read bf16 q, k, v, dout and out (the key/value
  // blocks travel in bf16); δ comes from the fp32 images, and dq and the
  // dk/dv accumulators stay fp32, rounded once at the end.
  const Tensor& qkv = a.qkv;
  const Tensor y = a.y.Reshaped({mb.batch, t, cl}), dout = dy.Reshaped({mb.batch, t, cl});
  Tensor dqkv = a.dqkv;
  if (bf16_) {
    BATON_ASSIGN_OR_RETURN(dqkv, tmp.Allocate(a.dqkv.shape()));
  }
  BATON_ASSIGN_OR_RETURN(Tensor delta, tmp.Allocate({mb.batch, heads, t}));
  {
    BATON_ASSIGN_OR_RETURN(const Tensor y_image, Fp32Image(tmp, y));
    BATON_ASSIGN_OR_RETURN(const Tensor dout_image, Fp32Image(tmp, dout));
    kernels::AttentionDelta(ctx_, delta, dout_image, y_image, heads);
  }
  BATON_ASSIGN_OR_RETURN(Tensor cur, tmp.Allocate({mb.batch, t, 2 * cl}, qkv.dtype()));
  BATON_ASSIGN_OR_RETURN(Tensor next, tmp.Allocate({mb.batch, t, 2 * cl}, qkv.dtype()));
  // A block's dk/dv accumulator arrives from the previous rank (acc_in)
  // while this rank computes its own share into a zeroed `part`; the sum
  // goes on to the next rank. Two parts: one may still be on its way.
  BATON_ASSIGN_OR_RETURN(Tensor acc_in, tmp.Allocate({mb.batch, t, 2 * cl}));
  Tensor parts[2];
  for (Tensor& part : parts) {
    BATON_ASSIGN_OR_RETURN(part, tmp.Allocate({mb.batch, t, 2 * cl}));
  }
  BATON_ASSIGN_OR_RETURN(Tensor scratch, tmp.Allocate({kernels::BlockAttentionBackwardScratch(t, t)}));
  kernels::FillZero(ctx_, dqkv);
  kernels::KvOfQkv(ctx_, cur, qkv);
  std::shared_ptr<comm::Work> sent[2];
  uint64_t acc_tag = 0;  // the tag the previous step's accumulator went out with (the same on every rank)
  const char* kGrads = "the key and value gradients";
  for (int step = 0; step < cp; ++step) {
    RingTransfer transfer;
    if (step + 1 < cp) {
      BATON_ASSIGN_OR_RETURN(transfer, StartRing(cur, next));
    }
    std::shared_ptr<comm::Work> acc_recv;
    if (step > 0) acc_recv = cp_->Recv(CommBuffer(acc_in), PrevCpRank(), acc_tag);
    const Tensor part = parts[step % 2];
    if (sent[step % 2] != nullptr) {
      BATON_RETURN_IF_ERROR(AwaitRingWork(*sent[step % 2], kGrads, b.index, /*sending=*/true));
    }
    kernels::FillZero(ctx_, part);
    const int owner = (c - step + cp) % cp;  // whose k, v and accumulator `cur` and `part` are
    for (int qh = 0; qh < 2; ++qh) {
      for (int kh = 0; kh < 2; ++kh) {
        const int64_t q_offset = HalfOffset(qh, t), k_offset = CpHalfOffset(kh, owner, cp, full);
        if (k_offset > q_offset + t - 1) continue;
        kernels::BlockAttentionBackward(ctx_, Half(dqkv, qh), Half(part, kh), Half(dout, qh), Half(y, qh),
                                        Half(qkv, qh), Half(cur, kh), Half(a.att, qh), Half(delta, qh), heads,
                                        q_offset, k_offset, scratch);
      }
    }
    if (acc_recv != nullptr) {
      BATON_RETURN_IF_ERROR(AwaitRingWork(*acc_recv, kGrads, b.index, /*sending=*/false));
      kernels::Residual(ctx_, part, acc_in, part);  // the earlier ranks' sum, then this one's share
    }
    // The accumulator travels with its block; after cp hops it is home.
    acc_tag = NextRingTag();
    BATON_ASSIGN_OR_RETURN(sent[step % 2], SendToNext(part, acc_tag));
    if (step + 1 < cp) {
      BATON_RETURN_IF_ERROR(AwaitRing(transfer, "the keys and values", b.index));
      std::swap(cur, next);
    }
  }
  // This rank's own block, back from its last hop.
  std::shared_ptr<comm::Work> home = cp_->Recv(CommBuffer(acc_in), PrevCpRank(), acc_tag);
  BATON_RETURN_IF_ERROR(AwaitRingWork(*home, kGrads, b.index, /*sending=*/false));
  for (const std::shared_ptr<comm::Work>& s : sent) {
    if (s != nullptr) BATON_RETURN_IF_ERROR(AwaitRingWork(*s, kGrads, b.index, /*sending=*/true));
  }
  kernels::QkvGradOfKv(ctx_, dqkv, acc_in);
  if (bf16_) kernels::Cast(ctx_, a.dqkv, dqkv);
  return absl::OkStatus();
}

absl::Status GptStage::BackwardWeight(int mb) {
  BATON_ASSIGN_OR_RETURN(Microbatch * s, Find(mb, "BackwardWeight"));
  if (!s->backward_input_done) {
    return absl::FailedPreconditionError(
        absl::StrCat("BackwardWeight(", mb, "): BackwardInput has not run"));
  }
  if (sp_) sp_scratch_->Reset();
  if (config_.is_last()) {
    BATON_ASSIGN_OR_RETURN(const Tensor xf, GatherRows(*sp_scratch_, s->xf, "the final norm output", -1));
    kernels::LinearBackwardWeight(ctx_, head_->grad, s->dlogits_gemm, xf);
  }
  for (int i = static_cast<int>(blocks_.size()) - 1; i >= 0; --i) {
    BATON_RETURN_IF_ERROR_CTX(BlockBackwardWeight(blocks_[i], s->blocks[i]), "block ", blocks_[i].index,
                              " weight gradient");
  }
  if (config_.is_first() && cp_ == nullptr) {
    kernels::EmbeddingBackward(ctx_, wte_->grad, vocab_begin_, wpe_ != nullptr ? wpe_->grad : Tensor(), s->d_x0,
                               s->tokens);
  } else if (config_.is_first()) {
    for (int half = 0; half < 2; ++half) {
      const int64_t offset = HalfOffset(half, s->seq);
      kernels::EmbeddingBackward(ctx_, wte_->grad, vocab_begin_,
                                 wpe_ != nullptr ? wpe_->grad.Rows(offset, offset + s->seq) : Tensor(),
                                 Half(s->d_x0, half), Half(s->tokens, half));
    }
  }
  // The microbatch is done: its activations go back to the pool.
  auto it = in_flight_.find(mb);
  it->second->arena.Reset();
  free_.push_back(std::move(it->second));
  in_flight_.erase(it);
  if (sp_ && ++backward_weights_ == config_.microbatches) return SumNormGradsOverTp();
  return absl::OkStatus();
}

absl::Status GptStage::BlockBackwardWeight(const Block& b, const BlockActivations& a) {
  // Under SP the norm outputs were kept as this rank's rows: gathered again
  // (Megatron's sequence-parallel backward), into the per-block temporaries.
  if (sp_) sp_scratch_->Reset();
  BATON_ASSIGN_OR_RETURN(const Tensor ln2, GatherRows(*sp_scratch_, a.ln2, "the MLP input", b.index));
  if (b.moe()) {
    BATON_RETURN_IF_ERROR(MoeBackwardWeight(b, a, ln2));
  } else {
    kernels::LinearBackwardWeight(ctx_, b.fc2_w->grad, a.d_out, a.g);
    kernels::LinearBackwardWeight(ctx_, b.fc_w->grad, a.dh, ln2);
    if (llama_) kernels::LinearBackwardWeight(ctx_, b.up_w->grad, a.dup, ln2);
  }
  kernels::LinearBackwardWeight(ctx_, b.proj_w->grad, a.d_mid, a.y);
  BATON_ASSIGN_OR_RETURN(const Tensor ln1, GatherRows(*sp_scratch_, a.ln1, "the attention input", b.index));
  if (llama_) {
    kernels::LinearBackwardWeight(ctx_, b.q_w->grad, a.dq, ln1);
    kernels::LinearBackwardWeight(ctx_, b.k_w->grad, a.dk, ln1);
    kernels::LinearBackwardWeight(ctx_, b.v_w->grad, a.dv, ln1);
  } else {
    kernels::LinearBackwardWeight(ctx_, b.qkv_w->grad, a.dqkv, ln1);
  }
  return absl::OkStatus();
}

absl::Status GptStage::Backward(int mb, const Tensor& grad_output, const Tensor& grad_input) {
  BATON_RETURN_IF_ERROR(BackwardInput(mb, grad_output, grad_input));
  return BackwardWeight(mb);
}

void GptStage::SampleActivationBytes() {
  int64_t total = static_cast<int64_t>(sp_scratch_->used_bytes() + cp_scratch_->used_bytes());
  for (const auto& [mb, state] : in_flight_) total += static_cast<int64_t>(state->arena.used_bytes());
  activation_high_water_ = std::max(activation_high_water_, total);
}

int64_t GptStage::activation_system_allocations() const {
  int64_t total = 0;
  for (const auto& state : free_) total += state->arena.system_allocations();
  for (const auto& [mb, state] : in_flight_) total += state->arena.system_allocations();
  return total;
}

double GptStage::MeanLoss() const {
  const StepScore score = this->score();
  return score.tokens == 0 ? 0.0 : score.loss_sum / static_cast<double>(score.tokens);
}

StepScore GptStage::score() const {
  StepScore score = score_;
  if (!config_.is_last()) return score;
  // Both accumulators are copied into pinned memory behind everything
  // enqueued so far (no wait), then one host synchronisation.
  HostResults& h = Results();
  kernels::Copy(ctx_, Tensor::View(&h.loss_sum, {1}, kernels::DType::kFloat64), loss_acc_);
  kernels::Copy(ctx_, Tensor::View(&h.hits, {1}, kernels::DType::kInt64), hits_acc_);
  if (!ctx_.stream->Synchronize().ok()) {
    // A failed device cannot report; a NaN (and -1 hits) fails the step's
    // finiteness check rather than passing a stale value.
    score.loss_sum = NAN;
    score.correct = -1;
    return score;
  }
  score.loss_sum = h.loss_sum;
  score.correct = h.hits;
  return score;
}

void GptStage::ZeroGrad() {
  comm_status_->Reset();
  scratch_->Reset();
  kernels::FillZero(ctx_, params_.grads());
  backward_weights_ = 0;
  activation_high_water_ = 0;
  kernels::FillZero(ctx_, loss_acc_);
  kernels::FillZero(ctx_, hits_acc_);
  kernels::FillZero(ctx_, aux_acc_);
  std::fill(moe_routed_.begin(), moe_routed_.end(), 0);
  std::fill(moe_kept_.begin(), moe_kept_.end(), 0);
  score_ = StepScore();
}

double GptStage::MoeAuxLossSum() const {
  if (!config_.model.moe()) return 0.0;
  float sum = 0;
  kernels::Copy(ctx_, Tensor::View(&sum, {1}, kernels::DType::kFloat32), aux_acc_);
  if (!ctx_.stream->Synchronize().ok()) return NAN;
  return sum;
}

void GptStage::DropInFlight() {
  for (auto& [mb, state] : in_flight_) {
    state->arena.Reset();
    free_.push_back(std::move(state));
  }
  in_flight_.clear();
}

// Calls `fn(p, lo, hi)` for every parameter p that has elements in this
// rank's DP shard, with [lo, hi) the shard's part of p in flat elements of
// the store (all of every parameter when unsharded).
template <typename Fn>
void ForEachInShard(const ParameterStore& params, Fn fn) {
  const model::DpShard& shard = params.dp_shard();
  const int64_t begin = shard.sharded() ? shard.begin : 0;
  const int64_t end = shard.sharded() ? shard.begin + shard.count : std::numeric_limits<int64_t>::max();
  for (const Parameter& p : params.parameters()) {
    const int64_t lo = std::max(begin, p.offset), hi = std::min(end, p.offset + p.value.numel());
    if (lo < hi) fn(p, lo, hi);
  }
}

void GptStage::AccumulateGradSqNorm() const {
  kernels::FillZero(ctx_, norm_acc_);
  if (!params_.dp_shard().sharded()) {
    for (const Parameter& p : params_.parameters()) {
      if (p.spec.counts_in_norm) kernels::SumOfSquares(ctx_, p.grad, norm_acc_);
    }
    return;
  }
  // ZeRO-1: the shard's reduced gradient, this rank's share of the norm (the
  // coordinator sums every DP rank's).
  const Tensor& grads = params_.shard_grads();
  const int64_t begin = params_.dp_shard().begin;
  ForEachInShard(params_, [&](const Parameter& p, int64_t lo, int64_t hi) {
    if (p.spec.counts_in_norm) kernels::SumOfSquares(ctx_, grads.Rows(lo - begin, hi - begin), norm_acc_);
  });
}

double GptStage::LocalGradSqNorm() const {
  AccumulateGradSqNorm();
  HostResults& h = Results();
  kernels::Copy(ctx_, Tensor::View(&h.sq, {1}, kernels::DType::kFloat64), norm_acc_);  // pinned: no wait
  return ctx_.stream->Synchronize().ok() ? h.sq : NAN;  // a failed device fails the finiteness check
}

void GptStage::EnqueueStepResults() {
  AccumulateGradSqNorm();
  HostResults& h = Results();
  kernels::Copy(ctx_, Tensor::View(&h.sq, {1}, kernels::DType::kFloat64), norm_acc_);
  if (config_.is_last()) {
    kernels::Copy(ctx_, Tensor::View(&h.loss_sum, {1}, kernels::DType::kFloat64), loss_acc_);
    kernels::Copy(ctx_, Tensor::View(&h.hits, {1}, kernels::DType::kInt64), hits_acc_);
  }
}

absl::Status GptStage::TakeStepResults(StepScore* score, double* grad_sq_norm) {
  *score = score_;
  const HostResults& h = Results();
  if (config_.is_last()) {
    score->loss_sum = h.loss_sum;
    score->correct = h.hits;
  }
  *grad_sq_norm = h.sq;
  absl::Status collectives = comm_status_->status();
  comm_status_->Reset();  // the stream is idle now
  return collectives;
}

absl::Status GptStage::ReadStepResults(StepScore* score, double* grad_sq_norm) {
  EnqueueStepResults();
  absl::Status waited = stream_->Synchronize();
  absl::Status collectives = TakeStepResults(score, grad_sq_norm);
  BATON_RETURN_IF_ERROR_CTX(waited, "reading the step's loss and gradient norm");
  return collectives;
}

absl::Status GptStage::SyncTiedEmbeddingGrad(comm::Communicator& group) {
  if (!config_.model.tie_embeddings || config_.pp_size == 1 || (!config_.is_first() && !config_.is_last())) {
    return absl::FailedPreconditionError(
        "SyncTiedEmbeddingGrad: only the first and last stage of a pipeline with a tied LM head hold the tied "
        "embedding");
  }
  if (group.size() != 2 || group.rank() != (config_.is_first() ? 0 : 1)) {
    return absl::InvalidArgumentError(
        "SyncTiedEmbeddingGrad: want a two-rank group, first stage rank 0, last stage rank 1");
  }
  return SumOverGroup(group, wte_->grad, "all-reduce of the tied embedding gradient");
}

absl::Status GptStage::SumOverGroup(comm::Communicator& group, const Tensor& t, const std::string& name) {
  return AllReduceOnStream(*comm::StreamCollectives::For(group), t, name);
}

absl::Status GptStage::OptimizerStep(const kernels::AdamWConfig& config, float grad_scale) {
  if (!in_flight_.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "OptimizerStep: ", in_flight_.size(), " microbatches still await their backward pass"));
  }
  ++step_;
  kernels::AdamWConfig no_decay = config;
  no_decay.weight_decay = 0.0f;
  if (!params_.dp_shard().sharded()) {
    for (Parameter& p : params_.parameters()) {
      kernels::AdamW(ctx_, p.value, p.grad, p.adam_m, p.adam_v, p.spec.weight_decay ? config : no_decay,
                     step_, grad_scale, p.value_bf16);
    }
    return absl::OkStatus();
  }
  // ZeRO-1: the shard's values only, from the shard's reduced gradient and
  // moments; the executor then all-gathers the values (and the bf16 copies
  // are refreshed from them: RefreshBf16Weights).
  const int64_t begin = params_.dp_shard().begin;
  const Tensor values = params_.padded_values();
  const Tensor& grads = params_.shard_grads();
  ForEachInShard(params_, [&](const Parameter& p, int64_t lo, int64_t hi) {
    auto shard = [&](const Tensor& t) { return t.Rows(lo - begin, hi - begin); };
    kernels::AdamW(ctx_, values.Rows(lo, hi), shard(grads), shard(params_.adam_m()), shard(params_.adam_v()),
                   p.spec.weight_decay ? config : no_decay, step_, grad_scale, Tensor());
  });
  return absl::OkStatus();
}

}  // namespace baton::model
