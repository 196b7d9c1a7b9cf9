#include "coordinator/job_spec.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "absl/strings/ascii.h"
#include "common/status_macros.h"
#include "common/token_format.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "coordinator/schedule/builders.h"
#include "coordinator/schedule/pytorch_csv.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"
#include "google/protobuf/util/json_util.h"

namespace baton {
namespace {

class CollectFirstError : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int line, google::protobuf::io::ColumnNumber column, const std::string& message) override {
    if (first_.empty()) first_ = absl::StrCat("line ", line + 1, " column ", column + 1, ": ", message);
  }
  const std::string& first() const { return first_; }

 private:
  std::string first_;
};

absl::Status Invalid(absl::string_view field, absl::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat("job spec: ", field, ": ", problem));
}

absl::Status AtLeast(absl::string_view field, int64_t value, int64_t min, absl::string_view hint = "") {
  if (value >= min) return absl::OkStatus();
  return Invalid(field, absl::StrCat("is ", value, "; must be >= ", min, hint.empty() ? "" : " ", hint));
}

// value in [min, max]; the message says which bound and what to do.
absl::Status InRange(absl::string_view field, int64_t value, int64_t min, int64_t max,
                     absl::string_view hint = "") {
  BATON_RETURN_IF_ERROR(AtLeast(field, value, min, hint));
  if (value <= max) return absl::OkStatus();
  return Invalid(field, absl::StrCat("is ", value, "; baton supports at most ", max, hint.empty() ? "" : " ", hint));
}

absl::Status NonNegativeFinite(absl::string_view field, double value, double max = HUGE_VAL) {
  if (!std::isfinite(value) || value < 0) {
    return Invalid(field, absl::StrCat("is ", value, "; must be a finite number >= 0"));
  }
  if (value > max) return Invalid(field, absl::StrCat("is ", value, "; baton supports at most ", max));
  return absl::OkStatus();
}

bool IsLlama(const v1::ModelSpec& m) { return m.arch() == "llama"; }

// The MLP's hidden width: model.ffn_dim when set, else 4 * d_model (GPT-2's
// only width; worker/model/gpt_config.h GptConfig::ffn_dim).
int64_t FfnDim(const v1::ModelSpec& m) { return m.has_ffn_dim() ? m.ffn_dim() : 4 * int64_t{m.d_model()}; }

// The largest tensor of a stage, in elements (see JobLimits::kMaxTensorElements).
// With context parallelism a rank holds seq_len/cp tokens of every sequence;
// its attention scores are counted as those query rows against the whole
// sequence's keys (an upper bound of any one ring block's).
absl::Status CheckTensorSizes(const v1::JobSpec& job, const ParallelDims& d) {
  const v1::ModelSpec& m = job.model();
  const int64_t tokens = int64_t{job.train().micro_batch_size()} * m.seq_len();
  const int64_t ffn = FfnDim(m);
  const struct {
    const char* what;
    int64_t elements;
  } tensors[] = {
      {"attention scores (micro_batch_size * heads/tp * seq_len^2 / cp)",
       tokens * (m.heads() / d.tp) * m.seq_len() / d.cp},
      {"logits (micro_batch_size * seq_len/cp * vocab)", tokens / d.cp * m.vocab()},
      {"MLP activations (micro_batch_size * seq_len/cp * MLP width)", tokens / d.cp * ffn},
      {"token embedding (vocab * d_model)", int64_t{m.vocab()} * m.d_model()},
      {"MLP weight (d_model * MLP width)", int64_t{m.d_model()} * ffn},
  };
  for (const auto& t : tensors) {
    if (t.elements > JobLimits::kMaxTensorElements) {
      return Invalid("model", absl::StrCat("the ", t.what, " would hold ", t.elements, " elements in one tensor; ",
                                           "baton supports at most ", JobLimits::kMaxTensorElements,
                                           ": lower train.micro_batch_size, model.seq_len, model.vocab, "
                                           "model.d_model or model.ffn_dim, or raise parallel.tp (or "
                                           "parallel.cp, for the token-sized ones)"));
    }
  }
  if (!m.has_moe()) return absl::OkStatus();
  // An MoE block's router probabilities [tokens, experts] and its experts'
  // hidden rows [MoeExpertRows, MLP width / tp] (per cp rank's tokens).
  const v1::MoeSpec& moe = m.moe();
  const struct {
    const char* what;
    double elements;
  } moe_tensors[] = {
      {"MoE router probabilities (micro_batch_size * seq_len * model.moe.experts)",
       static_cast<double>(tokens) * moe.experts()},
      {"MoE expert hidden rows (the experts' rows of a microbatch * MLP width / tp)",
       MoeExpertRows(moe, static_cast<double>(tokens)) * static_cast<double>(ffn / d.tp)},
  };
  for (const auto& t : moe_tensors) {
    if (t.elements > static_cast<double>(JobLimits::kMaxTensorElements)) {
      return Invalid("model.moe", absl::StrCat("the ", t.what, " would hold ", t.elements, " elements in one "
                                               "tensor; baton supports at most ", JobLimits::kMaxTensorElements,
                                               ": lower train.micro_batch_size, model.seq_len, model.moe.experts, "
                                               "model.moe.top_k or model.moe.capacity_factor, or raise "
                                               "parallel.tp"));
    }
  }
  return absl::OkStatus();
}

// model.arch and the Llama fields, the same rules as the worker's
// ValidateModelSpec / ValidateGptConfig (worker/model/gpt_config.cc; restated
// here: the coordinator does not depend on worker/model, DESIGN.md §12). Runs
// after d_model, heads and their divisibility are checked, before anything is
// sized from ffn_dim.
absl::Status ValidateArchitecture(const v1::ModelSpec& m, const ParallelDims& d) {
  if (!m.arch().empty() && m.arch() != "gpt2" && m.arch() != "llama") {
    return Invalid("model.arch", absl::StrCat("is \"", m.arch(), "\"; use \"gpt2\" (the default) or \"llama\""));
  }
  if (m.has_kv_heads()) {
    BATON_RETURN_IF_ERROR(InRange("model.kv_heads", m.kv_heads(), 1, JobLimits::kMaxHeads,
                                  "(leave it unset for model.heads)"));
  }
  if (m.has_ffn_dim()) {
    BATON_RETURN_IF_ERROR(InRange("model.ffn_dim", m.ffn_dim(), 1, JobLimits::kMaxFfnDim,
                                  "(leave it unset for 4 * model.d_model)"));
  }
  const int kv = m.has_kv_heads() ? m.kv_heads() : m.heads();
  if (!IsLlama(m)) {
    // GPT-2 has none of Llama's knobs: a set one is a mistake, not ignored.
    const char* llama = "set model.arch: \"llama\" for a Llama model, or leave it unset";
    if (kv != m.heads()) {
      return Invalid("model.kv_heads", absl::StrCat("is ", kv, " but GPT-2 attention has model.heads=", m.heads(),
                                                    " key/value heads; ", llama));
    }
    if (FfnDim(m) != 4 * int64_t{m.d_model()}) {
      return Invalid("model.ffn_dim", absl::StrCat("is ", FfnDim(m), " but GPT-2's MLP is 4*d_model=",
                                                   4 * int64_t{m.d_model()}, " wide; ", llama));
    }
    if (m.has_rope_theta() && m.rope_theta() != 10000.0f) {
      return Invalid("model.rope_theta", absl::StrCat("is ", m.rope_theta(),
                                                      " but GPT-2 has learned positions, no rotary embedding; ",
                                                      llama));
    }
    if (m.has_norm_eps() && m.norm_eps() != 1e-5f) {
      return Invalid("model.norm_eps", absl::StrCat("is ", m.norm_eps(), " but GPT-2's LayerNorm epsilon is 1e-5; ",
                                                    llama));
    }
    if (m.has_tie_embeddings() && !m.tie_embeddings()) {
      return Invalid("model.tie_embeddings",
                     absl::StrCat("is false but GPT-2's LM head is its token embedding; ", llama));
    }
    return absl::OkStatus();
  }
  if (m.heads() % kv != 0) {
    return Invalid("model.kv_heads", absl::StrCat("is ", kv, " and does not divide model.heads=", m.heads(),
                                                  "; grouped-query attention shares each key/value head among "
                                                  "heads/kv_heads query heads, so choose kv_heads that divides "
                                                  "heads"));
  }
  const int head_dim = m.d_model() / m.heads();
  if (head_dim % 2 != 0) {
    return Invalid("model.heads", absl::StrCat("is ", m.heads(), " and makes head_dim = d_model/heads = ", head_dim,
                                               " odd; rotary embeddings rotate pairs of channels, so choose heads "
                                               "that makes it even"));
  }
  if (m.has_rope_theta() && (!std::isfinite(m.rope_theta()) || m.rope_theta() <= 1.0f)) {
    return Invalid("model.rope_theta", absl::StrCat("is ", m.rope_theta(), "; must be a finite number > 1 "
                                                    "(Llama 2: 10000, the default; Llama 3: 500000)"));
  }
  if (m.has_norm_eps() && (!std::isfinite(m.norm_eps()) || m.norm_eps() <= 0.0f || m.norm_eps() > 1.0f)) {
    return Invalid("model.norm_eps", absl::StrCat("is ", m.norm_eps(), "; must be a finite number in (0, 1] "
                                                  "(Llama: 1e-5, the default, or 1e-6)"));
  }
  if (kv % d.tp != 0) {
    return Invalid("parallel.tp", absl::StrCat("is ", d.tp, " and must divide model.kv_heads=", kv,
                                               "; each tensor-parallel rank holds whole key/value heads, so "
                                               "choose tp that divides kv_heads"));
  }
  return absl::OkStatus();
}

absl::Status ValidateModel(const v1::JobSpec& job, const ParallelDims& d) {
  const v1::ModelSpec& m = job.model();
  BATON_RETURN_IF_ERROR(InRange("model.layers", m.layers(), 1, JobLimits::kMaxLayers));
  const int stages = d.pp * d.virtual_stages;
  if (m.layers() < stages) {
    return Invalid("model.layers",
                   absl::StrCat("is ", m.layers(), " but parallel.pp=", d.pp, " x virtual_stages=",
                                d.virtual_stages, " makes ", stages,
                                " stages and each stage needs at least one layer; lower pp or "
                                "virtual_stages, or add layers"));
  }
  if (m.has_synthetic()) {
    const v1::SyntheticCost& c = m.synthetic();
    const double max_ms = JobLimits::kMaxSyntheticOpMs;
    BATON_RETURN_IF_ERROR(NonNegativeFinite("model.synthetic.forward_ms", c.forward_ms(), max_ms));
    BATON_RETURN_IF_ERROR(NonNegativeFinite("model.synthetic.backward_input_ms", c.backward_input_ms(), max_ms));
    BATON_RETURN_IF_ERROR(NonNegativeFinite("model.synthetic.backward_weight_ms", c.backward_weight_ms(), max_ms));
    return InRange("model.synthetic.activation_bytes", c.activation_bytes(), 4,
                   JobLimits::kMaxSyntheticActivationBytes, "(bytes passed per microbatch; at least one float)");
  }
  BATON_RETURN_IF_ERROR(InRange("model.d_model", m.d_model(), 1, JobLimits::kMaxDModel));
  BATON_RETURN_IF_ERROR(InRange("model.heads", m.heads(), 1, JobLimits::kMaxHeads));
  BATON_RETURN_IF_ERROR(InRange("model.vocab", m.vocab(), 2, JobLimits::kMaxVocab));
  BATON_RETURN_IF_ERROR(InRange("model.seq_len", m.seq_len(), 1, JobLimits::kMaxSeqLen));
  if (m.d_model() % m.heads() != 0) {
    return Invalid("model.heads", absl::StrCat("is ", m.heads(), " and does not divide model.d_model=",
                                               m.d_model(), "; choose heads that divides d_model"));
  }
  if (m.heads() % d.tp != 0) {
    return Invalid("parallel.tp", absl::StrCat("is ", d.tp, " and does not divide model.heads=", m.heads(),
                                               "; tensor parallelism splits heads across ranks, so "
                                               "choose tp that divides heads"));
  }
  BATON_RETURN_IF_ERROR(ValidateArchitecture(m, d));
  if (FfnDim(m) % d.tp != 0) {
    return Invalid("parallel.tp", absl::StrCat("is ", d.tp, " and does not divide the MLP width ",
                                               m.has_ffn_dim() ? "model.ffn_dim=" : "4*d_model=", FfnDim(m),
                                               "; tensor parallelism splits the MLP's columns across ranks, so "
                                               "choose tp that divides it"));
  }
  return absl::OkStatus();
}

absl::Status ValidateParallel(const ParallelDims& d) {
  const char* hint = "(leave it unset for 1)";
  const int max = JobLimits::kMaxWorkers;
  BATON_RETURN_IF_ERROR(InRange("parallel.pp", d.pp, 1, max, hint));
  BATON_RETURN_IF_ERROR(InRange("parallel.tp", d.tp, 1, max, hint));
  BATON_RETURN_IF_ERROR(InRange("parallel.dp", d.dp, 1, max, hint));
  BATON_RETURN_IF_ERROR(InRange("parallel.virtual_stages", d.virtual_stages, 1, JobLimits::kMaxVirtualStages, hint));
  BATON_RETURN_IF_ERROR(InRange("parallel.cp", d.cp, 1, max, hint));
  BATON_RETURN_IF_ERROR(InRange("parallel.ep", d.ep, 1, max, hint));
  if (d.dp % d.ep != 0) {
    return Invalid("parallel.ep", absl::StrCat("is ", d.ep, " and must divide parallel.dp=", d.dp,
                                               " (expert groups are carved out of the data-parallel ranks); "
                                               "choose ep that divides dp"));
  }
  const int64_t world = static_cast<int64_t>(d.pp) * d.tp * d.cp * d.dp;
  if (world > max) {
    return Invalid("parallel", absl::StrCat(d.cp > 1 ? "pp*tp*cp*dp = " : "pp*tp*dp = ", world,
                                            " workers; baton supports at most ", max));
  }
  return absl::OkStatus();
}

// parallel.zero_stage (ZeRO, job.proto): 0 to 3, of which 0 and 1 run. Stage
// 1 shards the AdamW moments over the data-parallel group (with cp > 1 the
// dp*cp ranks of one (pp, tp), which reduce the gradients together), so it
// needs at least two of them and a model that has optimizer state. With
// expert parallelism (ep > 1) it shards over the dp / ep ranks holding the
// same experts, so it needs dp > ep, and cp 1.
absl::Status ValidateZeroStage(const v1::JobSpec& job, const ParallelDims& d) {
  const char* field = "parallel.zero_stage";
  if (d.zero_stage < 0 || d.zero_stage > 3) {
    return Invalid(field, absl::StrCat("is ", d.zero_stage, "; ZeRO stages are 0 to 3, of which baton runs 0 "
                                       "(unset: every DP replica holds the whole state) and 1 (the optimizer "
                                       "state sharded over the DP ranks): set 0 or 1"));
  }
  if (d.zero_stage >= 2) {
    return Invalid(field, absl::StrCat("is ", d.zero_stage, "; stages 2 and 3 (sharded gradients / parameters) "
                                       "are not implemented yet: use 1 (sharded optimizer state) or 0"));
  }
  if (d.zero_stage == 0) return absl::OkStatus();
  // With ep ZeRO 1 shards over the ranks that hold the same experts (dp /
  // ep of them). (A dense model with ep is refused by RefusePlannedAxes,
  // which says why.)
  if (d.ep > 1 && job.model().has_moe() && d.dp == d.ep) {
    return Invalid(field, absl::StrCat("is ", d.zero_stage, " with parallel.ep = parallel.dp = ", d.ep,
                                       ": with expert parallelism ZeRO shards over the dp / ep ranks holding the "
                                       "same experts, and here there is one: raise dp above ep, or set "
                                       "zero_stage 0"));
  }
  if (d.ep > 1 && job.model().has_moe() && d.cp > 1) {
    return Invalid(field, absl::StrCat("is ", d.zero_stage, " with parallel.ep = ", d.ep, " and parallel.cp = ", d.cp,
                                       ": ZeRO with expert and context parallelism together is not supported yet; "
                                       "set zero_stage 0, or one of ep and cp to 1"));
  }
  if (d.dp * d.cp == 1) {
    return Invalid(field, absl::StrCat("is ", d.zero_stage, " and shards the optimizer state over the "
                                       "data-parallel ranks; with parallel.dp = 1 there is nothing to shard: "
                                       "set dp >= 2 or zero_stage 0"));
  }
  if (job.model().has_synthetic()) {
    return Invalid(field, absl::StrCat("is ", d.zero_stage, " but model.synthetic is set, and synthetic stages "
                                       "hold no optimizer state: set zero_stage 0 (or leave it unset), or train "
                                       "a real model"));
  }
  return absl::OkStatus();
}

// parallel.sequence_parallel splits each microbatch's tokens over the TP
// group, so it needs a group (tp >= 2), a real model, and tokens that split.
absl::Status ValidateSequenceParallel(const v1::JobSpec& job, const ParallelDims& d) {
  if (!d.sequence_parallel) return absl::OkStatus();
  const char* field = "parallel.sequence_parallel";
  if (d.tp < 2) {
    return Invalid(field, absl::StrCat("is true but parallel.tp = ", d.tp, "; sequence parallelism splits the "
                                       "tokens over the tensor-parallel ranks: set tp >= 2 or "
                                       "sequence_parallel false"));
  }
  if (job.model().has_synthetic()) {
    return Invalid(field, "is true but model.synthetic is set, and synthetic stages have no sequence to split: "
                          "set sequence_parallel false, or train a real model");
  }
  // With context parallelism each rank holds seq_len / cp tokens of every
  // sequence (ValidateContextParallel has checked that they split), and SP
  // splits those.
  const int64_t tokens = int64_t{job.train().micro_batch_size()} * job.model().seq_len() / d.cp;
  if (tokens % d.tp != 0) {
    return Invalid(field, absl::StrCat("is true but a microbatch's train.micro_batch_size * model.seq_len",
                                       d.cp > 1 ? absl::StrCat(" / parallel.cp = ", tokens,
                                                               " tokens per context-parallel rank")
                                                : absl::StrCat(" = ", tokens, " tokens"),
                                       " do not split over parallel.tp = ", d.tp,
                                       " ranks: make them divisible by tp"));
  }
  return absl::OkStatus();
}

// parallel.cp splits every sequence into 2*cp chunks, CP rank c holding
// chunks c and 2cp-1-c (the load-balanced causal split,
// worker/model/context_parallel.h), and runs ring attention over the cp
// group; the gradients are reduced over the dp*cp ranks of one (pp, tp).
// So it needs attention to split (a real model) and sequences that cut into
// 2*cp equal chunks.
absl::Status ValidateContextParallel(const v1::JobSpec& job, const ParallelDims& d) {
  if (d.cp == 1) return absl::OkStatus();
  const char* field = "parallel.cp";
  if (job.model().has_synthetic()) {
    return Invalid(field, absl::StrCat("is ", d.cp, " but model.synthetic is set, a cost model with no attention "
                                       "to split over context-parallel ranks: leave cp unset (1), or train a "
                                       "real model"));
  }
  const int64_t seq = job.model().seq_len();
  if (seq % (2 * int64_t{d.cp}) != 0) {
    return Invalid(field, absl::StrCat("is ", d.cp, " and splits every sequence into 2*cp = ", 2 * d.cp,
                                       " equal chunks (each context-parallel rank holds two, for an even share "
                                       "of the causal attention), but model.seq_len = ", seq,
                                       " does not divide by ", 2 * d.cp,
                                       ": make model.seq_len a multiple of 2*cp, or choose a cp for which it is"));
  }
  return absl::OkStatus();
}

// model.moe (job.proto MoeSpec): the same rules as the worker's ValidateMoe
// (worker/model/gpt_config.cc; restated, as ValidateArchitecture's are),
// then what this version runs MoE without: a synthetic model. With
// parallel.ep > 1 ep must divide the experts (each expert-parallel rank
// holds experts/ep of every MoE block). Runs after ValidateModel
// (model.layers is in range).
absl::Status ValidateMoe(const v1::JobSpec& job, const ParallelDims& d) {
  const v1::ModelSpec& m = job.model();
  if (!m.has_moe()) return absl::OkStatus();
  if (m.has_synthetic()) {
    return Invalid("model.moe", "is set but model.synthetic is set, a cost model with no MLP to split into "
                                "experts: remove model.moe, or train a real model");
  }
  const v1::MoeSpec& moe = m.moe();
  BATON_RETURN_IF_ERROR(InRange("model.moe.experts", moe.experts(), 2, JobLimits::kMaxExperts,
                                "(the expert MLPs of each MoE block; leave model.moe unset for a dense model)"));
  if (moe.top_k() < 1 || moe.top_k() > moe.experts()) {
    return Invalid("model.moe.top_k", absl::StrCat("is ", moe.top_k(), "; must be in [1, model.moe.experts = ",
                                                   moe.experts(), "]: the experts each token is sent to "
                                                   "(1: Switch, 2: Mixtral)"));
  }
  if (moe.every_n_layers() < 0 || moe.every_n_layers() > m.layers()) {
    return Invalid("model.moe.every_n_layers",
                   absl::StrCat("is ", moe.every_n_layers(), "; must be in [0, model.layers = ", m.layers(),
                                "]: block i is an MoE block when (i + 1) % every_n_layers == 0 (0, unset, or 1: "
                                "every block)"));
  }
  const double capacity = moe.capacity_factor();
  if (!std::isfinite(capacity) || capacity < 0 || capacity > JobLimits::kMaxCapacityFactor) {
    return Invalid("model.moe.capacity_factor",
                   absl::StrCat("is ", capacity, "; must be a finite number in [0, ", JobLimits::kMaxCapacityFactor,
                                "] (0, unset: dropless, every choice kept; 1.25: each expert takes 1.25x its "
                                "even share of a microbatch's choices)"));
  }
  if (moe.has_aux_loss_coef() && (!std::isfinite(moe.aux_loss_coef()) || moe.aux_loss_coef() < 0)) {
    return Invalid("model.moe.aux_loss_coef",
                   absl::StrCat("is ", moe.aux_loss_coef(), "; must be a finite number >= 0 (unset: 0.01, "
                                "Switch's; 0: no load-balancing loss)"));
  }
  if (d.ep > 1 && moe.experts() % d.ep != 0) {
    return Invalid("parallel.ep", absl::StrCat("is ", d.ep, " and must divide model.moe.experts=", moe.experts(),
                                               " (each expert-parallel rank would hold experts/ep whole "
                                               "experts); choose ep that divides experts"));
  }
  return absl::OkStatus();
}

// Expert parallelism splits the experts of model.moe over ep data-parallel
// ranks; a dense model has none to split (the planner may still plan its
// mesh: ValidateJobSpecAllowingPlannedAxes). Runs after every other check,
// so a spec whose ep is wrong for another reason (not dividing dp or the
// experts) is told that first.
absl::Status RefusePlannedAxes(const v1::JobSpec& job, const ParallelDims& d) {
  if (d.ep == 1 || job.model().has_moe()) return absl::OkStatus();
  return Invalid("parallel.ep", absl::StrCat("is ", d.ep, " but model.moe is unset: expert parallelism splits "
                                             "the experts of a Mixture-of-Experts model over ranks, and a dense "
                                             "model has none; leave ep unset, or set model.moe"));
}

// schedule.kind "csv": the CSV parses, and its rows, stages and
// microbatches are the job's.
absl::Status ValidateCsvSchedule(const v1::ScheduleSpec& spec, const ParallelDims& d) {
  if (spec.csv().empty()) {
    return Invalid("schedule.csv", "is empty; schedule.kind \"csv\" needs the schedule in csv or csv_file");
  }
  if (spec.csv().size() > JobLimits::kMaxScheduleCsvBytes) {
    return Invalid("schedule.csv", absl::StrCat("is ", spec.csv().size(), " bytes; at most ",
                                                JobLimits::kMaxScheduleCsvBytes, " are read"));
  }
  absl::StatusOr<schedule::CsvNaming> naming = schedule::ParseCsvNaming(spec.csv_naming());
  if (!naming.ok()) return Invalid("schedule.csv_naming", std::string(naming.status().message()));
  absl::StatusOr<schedule::Schedule> s = schedule::FromPytorchCsv(spec.csv(), *naming);
  if (!s.ok()) return Invalid("schedule.csv", std::string(s.status().message()));
  if (s->num_ranks != d.pp) {
    return Invalid("schedule.csv", absl::StrCat("has ", s->num_ranks, " rows (pipeline ranks) but parallel.pp is ",
                                                d.pp, "; give one row per pipeline rank"));
  }
  if (s->virtual_stages != d.virtual_stages) {
    return Invalid("parallel.virtual_stages",
                   absl::StrCat("is ", d.virtual_stages, " but schedule.csv places ", s->virtual_stages,
                                " stages on every rank; set virtual_stages: ", s->virtual_stages));
  }
  if (s->microbatches != spec.microbatches()) {
    return Invalid("schedule.microbatches", absl::StrCat("is ", spec.microbatches(), " but schedule.csv runs ",
                                                         s->microbatches, "; set microbatches: ", s->microbatches));
  }
  return absl::OkStatus();
}

absl::Status ValidateSchedule(const v1::JobSpec& job, const ParallelDims& d) {
  const std::string& kind = job.schedule().kind();
  const std::vector<std::string>& kinds = schedule::ScheduleKinds();
  if (kind != "csv" && std::find(kinds.begin(), kinds.end(), kind) == kinds.end()) {
    return Invalid("schedule.kind", absl::StrCat("'", kind, "' is not a schedule; use one of: ",
                                                 absl::StrJoin(kinds, ", "), ", or csv (a PyTorch pipelining CSV)"));
  }
  if (kind != "csv" && (!job.schedule().csv().empty() || !job.schedule().csv_file().empty() ||
                        !job.schedule().csv_naming().empty())) {
    return Invalid("schedule.csv", "is set, but schedule.kind is not \"csv\"; set kind: \"csv\" to run it");
  }
  const int m = job.schedule().microbatches();
  BATON_RETURN_IF_ERROR(InRange("schedule.microbatches", m, 1, JobLimits::kMaxMicrobatches));
  const int64_t cells = int64_t{d.pp} * m * d.virtual_stages;
  if (cells > JobLimits::kMaxScheduleCells) {
    return Invalid("schedule.microbatches",
                   absl::StrCat("is ", m, " with parallel.pp=", d.pp, " and virtual_stages=", d.virtual_stages,
                                ": the schedule would have pp*microbatches*virtual_stages = ", cells,
                                " cells; baton supports at most ", JobLimits::kMaxScheduleCells,
                                ": use fewer microbatches (at most ",
                                JobLimits::kMaxScheduleCells / (int64_t{d.pp} * d.virtual_stages),
                                " here) with a larger train.micro_batch_size"));
  }
  if (kind == "csv") return ValidateCsvSchedule(job.schedule(), d);
  if (schedule::IsVShaped(kind)) {
    if (d.virtual_stages != 2) {
      return Invalid("parallel.virtual_stages",
                     absl::StrCat("is ", d.virtual_stages, "; schedule.kind '", kind,
                                  "' places two chunks on every pipeline rank in a V: set virtual_stages: 2"));
    }
    if (kind == "dualpipe-v" && m < 2 * d.pp) {
      return Invalid("schedule.microbatches",
                     absl::StrCat("is ", m, "; dualpipe-v needs at least 2 x parallel.pp = ", 2 * d.pp));
    }
    return absl::OkStatus();
  }
  if (kind == "interleaved") {
    if (d.pp < 2) {
      return Invalid("parallel.pp", "schedule.kind 'interleaved' needs pp >= 2 (chunks are spread over pipeline ranks)");
    }
    if (d.virtual_stages < 2) {
      return Invalid("parallel.virtual_stages",
                     "schedule.kind 'interleaved' needs virtual_stages >= 2 (chunks per pipeline rank)");
    }
    if (m % d.pp != 0) {
      return Invalid("schedule.microbatches",
                     absl::StrCat("is ", m, "; the interleaved schedule needs a multiple of parallel.pp=", d.pp));
    }
  } else if (d.virtual_stages != 1) {
    return Invalid("parallel.virtual_stages",
                   absl::StrCat("is ", d.virtual_stages, "; more than one chunk per rank needs schedule.kind: "
                                "\"interleaved\", \"zb-v\", \"dualpipe-v\" or \"csv\""));
  }
  return absl::OkStatus();
}

absl::Status ValidateTrain(const v1::TrainSpec& t) {
  BATON_RETURN_IF_ERROR(InRange("train.steps", t.steps(), 1, JobLimits::kMaxSteps));
  BATON_RETURN_IF_ERROR(InRange("train.micro_batch_size", t.micro_batch_size(), 1, JobLimits::kMaxMicroBatchSize));
  BATON_RETURN_IF_ERROR(NonNegativeFinite("train.lr", t.lr()));
  BATON_RETURN_IF_ERROR(NonNegativeFinite("train.weight_decay", t.weight_decay()));
  if (!t.precision().empty() && t.precision() != "fp32" && t.precision() != "bf16") {
    return absl::InvalidArgumentError(
        absl::StrCat("train.precision: is \"", t.precision(), "\"; want \"fp32\" or \"bf16\""));
  }
  return NonNegativeFinite("train.grad_clip", t.grad_clip());
}

// `at`: where the spec sits ("data", or "train.eval_data"), for the field
// names in errors.
absl::Status ValidateData(const v1::DataSpec& data, const v1::ModelSpec& model, absl::string_view at) {
  auto field_of = [at](absl::string_view name) { return absl::StrCat(at, ".", name); };
  if (model.has_synthetic()) return absl::OkStatus();  // the cost model reads no data
  if (!data.token_format().empty()) {
    if (data.source_case() != v1::DataSpec::kTokensFile) {
      return Invalid(field_of("token_format"),
                     absl::StrCat("applies to ", field_of("tokens_file"), " only; remove it or use tokens_file"));
    }
    const std::string& format = data.token_format();
    if (!ParseTokenFormat(format).ok()) {
      return Invalid(field_of("token_format"), absl::StrCat("is \"", format, "\"; use \"raw_uint16\" (the default), "
                                                       "\"raw_uint32\", \"llmc\" or \"megatron\""));
    }
  }
  std::string path, field;
  if (data.source_case() == v1::DataSpec::kTextFile) {
    path = data.text_file();
    field = field_of("text_file");
  } else if (data.source_case() == v1::DataSpec::kTokensFile) {
    path = data.tokens_file();
    field = field_of("tokens_file");
  } else {
    const std::string& task = data.synthetic().task();
    if (!task.empty() && task != "addition") {
      return Invalid(field_of("synthetic.task"), absl::StrCat("'", task, "' is unknown; use \"addition\""));
    }
    if (model.vocab() < 13) {
      return Invalid("model.vocab", absl::StrCat("is ", model.vocab(),
                                                 "; the addition task needs 13 token ids (digits, '+', '=', ';')"));
    }
    if (model.seq_len() < 8) {
      return Invalid("model.seq_len", absl::StrCat("is ", model.seq_len(), "; the addition task needs at least 8"));
    }
    return absl::OkStatus();
  }
  // The file lives on the workers, under each worker's --data_dir; they check
  // it (regular file, inside the data root, size; for tokens_file, which may
  // be a directory or glob of shards, each shard's header, size and a sample
  // of its ids) when the job is configured.
  if (path.empty()) return Invalid(field, "is empty: give a file path relative to the workers' --data_dir");
  if (path.size() > 4096 || path.find('\0') != std::string::npos) {
    return Invalid(field, "is not a usable path: give a file path relative to the workers' --data_dir");
  }
  if (data.source_case() == v1::DataSpec::kTextFile && model.vocab() < 256) {
    return Invalid("model.vocab", absl::StrCat("is ", model.vocab(), "; ", field_of("text_file"), " is byte-level and needs 256"));
  }
  return absl::OkStatus();
}

absl::Status ValidateEval(const v1::JobSpec& job) {
  const v1::TrainSpec& t = job.train();
  BATON_RETURN_IF_ERROR(InRange("train.eval_every_steps", t.eval_every_steps(), 0, JobLimits::kMaxSteps));
  if (t.has_eval_steps()) {
    BATON_RETURN_IF_ERROR(InRange("train.eval_steps", t.eval_steps(), 1, JobLimits::kMaxEvalSteps));
  }
  if (t.eval_every_steps() == 0) {
    if (t.has_eval_data() || t.has_eval_steps()) {
      return Invalid("train.eval_every_steps",
                     "is 0 (never) but train.eval_data or train.eval_steps is set; set eval_every_steps to evaluate");
    }
    return absl::OkStatus();
  }
  if (job.model().has_synthetic()) {
    return Invalid("train.eval_every_steps", "the synthetic cost model has no loss to evaluate; remove it");
  }
  if (!t.has_eval_data() || t.eval_data().source_case() == v1::DataSpec::SOURCE_NOT_SET) {
    return Invalid("train.eval_data", "must name the held-out data when train.eval_every_steps > 0, e.g. "
                                      "eval_data { tokens_file: \"val.bin\" }");
  }
  return ValidateData(t.eval_data(), job.model(), "train.eval_data");
}

}  // namespace

ParallelDims DimsOf(const v1::JobSpec& job) {
  const v1::ParallelSpec& p = job.parallel();
  ParallelDims d;
  d.pp = p.has_pp() ? p.pp() : 1;
  d.tp = p.has_tp() ? p.tp() : 1;
  d.dp = p.has_dp() ? p.dp() : 1;
  d.virtual_stages = p.has_virtual_stages() ? p.virtual_stages() : 1;
  d.cp = p.has_cp() ? p.cp() : 1;
  d.ep = p.has_ep() ? p.ep() : 1;
  d.zero_stage = p.zero_stage();  // unset: 0
  d.sequence_parallel = p.sequence_parallel();
  return d;
}

double MoeExpertRows(const v1::MoeSpec& moe, double tokens) {
  const double choices = tokens * moe.top_k();
  if (moe.capacity_factor() <= 0 || moe.experts() <= 0) return choices;  // dropless
  const double capacity = std::ceil(moe.capacity_factor() * choices / moe.experts());
  return std::min(capacity, tokens) * moe.experts();
}

int MoeEvery(const v1::ModelSpec& model) {
  if (!model.has_moe()) return 0;
  return model.moe().every_n_layers() > 0 ? model.moe().every_n_layers() : 1;
}

int MoeBlocksIn(int every, int first, int end) {
  if (every <= 0 || end <= first) return 0;
  // Blocks i in [first, end) with (i + 1) a multiple of `every`: the
  // multiples in [first + 1, end].
  return end / every - first / every;
}

absl::StatusOr<v1::JobSpec> ParseJobSpec(absl::string_view text, absl::string_view source) {
  v1::JobSpec job;
  if (text.size() > JobLimits::kMaxSpecBytes) {
    return absl::InvalidArgumentError(absl::StrCat("job spec ", source, " is larger than ", JobLimits::kMaxSpecBytes,
                                                   " bytes; a job spec is a few lines"));
  }
  absl::string_view stripped = absl::StripLeadingAsciiWhitespace(text);
  if (!stripped.empty() && stripped.front() == '{') {
    google::protobuf::util::JsonParseOptions options;
    options.ignore_unknown_fields = false;
    auto status = google::protobuf::util::JsonStringToMessage(std::string(text), &job, options);
    if (!status.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("job spec ", source, " is not valid JobSpec JSON: ", status.message().as_string()));
    }
  } else {
    google::protobuf::TextFormat::Parser parser;
    CollectFirstError errors;
    parser.RecordErrorsTo(&errors);
    if (!parser.ParseFromString(std::string(text), &job)) {
      return absl::InvalidArgumentError(absl::StrCat("job spec ", source, " is not valid JobSpec textproto: ",
                                                     errors.first(),
                                                     " (fields are listed in proto/baton/v1/job.proto)"));
    }
  }
  return job;
}

namespace {

// A regular file of at most `max` bytes (so --job=/dev/zero cannot fill the
// memory); `what` names it in errors ("job file", "schedule CSV").
absl::StatusOr<std::string> ReadSmallFile(const std::string& path, size_t max, const char* what, const char* hint) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    return absl::NotFoundError(absl::StrCat("cannot read ", what, " '", path, "': ", std::strerror(errno)));
  }
  struct stat st;
  if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode)) {
    std::fclose(f);
    return absl::InvalidArgumentError(absl::StrCat(what, " '", path, "' is not a regular file"));
  }
  std::string text;
  char buffer[1 << 14];
  size_t n = 0;
  while ((n = std::fread(buffer, 1, sizeof(buffer), f)) > 0 && text.size() <= max) text.append(buffer, n);
  std::fclose(f);
  if (text.size() > max) {
    return absl::InvalidArgumentError(absl::StrCat(what, " '", path, "' is larger than ", max, " bytes; ", hint));
  }
  return text;
}

}  // namespace

absl::StatusOr<v1::JobSpec> LoadJobSpec(const std::string& path) {
  BATON_ASSIGN_OR_RETURN(const std::string text,
                         ReadSmallFile(path, JobLimits::kMaxSpecBytes, "job file", "a job spec is a few lines"));
  absl::StatusOr<v1::JobSpec> job = ParseJobSpec(text, path);
  if (!job.ok()) return job.status();
  if (const std::string& csv_file = job->schedule().csv_file(); !csv_file.empty()) {
    if (!job->schedule().csv().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": schedule.csv_file and schedule.csv are both set; keep one"));
    }
    const size_t slash = path.rfind('/');
    const std::string file =
        csv_file.front() == '/' || slash == std::string::npos ? csv_file : path.substr(0, slash + 1) + csv_file;
    absl::StatusOr<std::string> csv =
        ReadSmallFile(file, JobLimits::kMaxScheduleCsvBytes, "schedule CSV", "a schedule is one row per rank");
    if (!csv.ok()) return WithContext(csv.status(), absl::StrCat(path, ": schedule.csv_file"));
    job->mutable_schedule()->set_csv(*std::move(csv));
    job->mutable_schedule()->clear_csv_file();
  }
  BATON_RETURN_IF_ERROR_CTX(ValidateJobSpec(*job), path);
  return job;
}

// fault_tolerance (owner: recovery; docs/protocol.md "Recovery").
absl::Status ValidateFaultTolerance(const v1::FaultToleranceSpec& f) {
  if (f.has_max_restarts() && (f.max_restarts() < 0 || f.max_restarts() > 1000)) {
    return Invalid("fault_tolerance.max_restarts",
                   absl::StrCat("is ", f.max_restarts(), "; must be between 0 (fail at the first fault) and 1000"));
  }
  if (f.has_replacement_timeout_s() &&
      (!std::isfinite(f.replacement_timeout_s()) || f.replacement_timeout_s() < 0 ||
       f.replacement_timeout_s() > 86400)) {
    return Invalid("fault_tolerance.replacement_timeout_s",
                   absl::StrCat("is ", f.replacement_timeout_s(), "; must be between 0 and 86400 seconds"));
  }
  if (f.has_snapshot_every_steps()) {
    BATON_RETURN_IF_ERROR(AtLeast("fault_tolerance.snapshot_every_steps", f.snapshot_every_steps(), 0,
                                  "(0: no in-memory snapshots)"));
  }
  return absl::OkStatus();
}

absl::Status ValidateJobSpec(const v1::JobSpec& job) {
  BATON_RETURN_IF_ERROR(ValidateJobSpecAllowingPlannedAxes(job));
  return RefusePlannedAxes(job, DimsOf(job));
}

absl::Status ValidateJobSpecAllowingPlannedAxes(const v1::JobSpec& job) {
  if (job.name().empty()) return Invalid("name", "must be set, e.g. name: \"demo\"");
  const ParallelDims d = DimsOf(job);
  BATON_RETURN_IF_ERROR(ValidateParallel(d));
  BATON_RETURN_IF_ERROR(ValidateZeroStage(job, d));
  BATON_RETURN_IF_ERROR(ValidateModel(job, d));
  BATON_RETURN_IF_ERROR(ValidateMoe(job, d));
  BATON_RETURN_IF_ERROR(ValidateContextParallel(job, d));
  BATON_RETURN_IF_ERROR(ValidateSequenceParallel(job, d));
  BATON_RETURN_IF_ERROR(ValidateSchedule(job, d));
  BATON_RETURN_IF_ERROR(ValidateTrain(job.train()));
  if (!job.model().has_synthetic()) BATON_RETURN_IF_ERROR(CheckTensorSizes(job, d));
  BATON_RETURN_IF_ERROR(ValidateData(job.data(), job.model(), "data"));
  BATON_RETURN_IF_ERROR(ValidateEval(job));
  BATON_RETURN_IF_ERROR(
      InRange("checkpoint.every_steps", job.checkpoint().every_steps(), 0, JobLimits::kMaxCheckpointEverySteps));
  if (job.checkpoint().every_steps() > 0 && job.checkpoint().dir().empty()) {
    return Invalid("checkpoint.dir", "must be set when checkpoint.every_steps > 0");
  }
  if (job.checkpoint().has_keep()) {
    BATON_RETURN_IF_ERROR(AtLeast("checkpoint.keep", job.checkpoint().keep(), 1));
  }
  BATON_RETURN_IF_ERROR(ValidateFaultTolerance(job.fault_tolerance()));
  return absl::OkStatus();
}

}  // namespace baton
