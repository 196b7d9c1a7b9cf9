#include "cli/checkpoint_cmd.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "cli/args.h"
#include "cli/hf_checkpoint.h"
#include "common/json.h"
#include "common/checkpoint_manifest.h"
#include "common/weights_diff.h"

namespace baton::cli {
namespace {

constexpr char kUsage[] =
    "usage: batonctl checkpoint diff DIR_A DIR_B [--json]\n"
    "       batonctl checkpoint import-hf HF_DIR --out=CKPT [--seq_len=N] [--force]\n"
    "       batonctl checkpoint export-hf CKPT --out=HF_DIR [--force]";

std::string Number(double v) { return absl::StrFormat("%.6g", v); }

// Bad input (a file to fix, a flag to change) is exit code 2, as for diff; a
// failure to write is 1.
int HfExitCode(const absl::Status& s) {
  return absl::IsInvalidArgument(s) || absl::IsNotFound(s) || absl::IsFailedPrecondition(s) ||
                 absl::IsDataLoss(s)
             ? 2
             : 1;
}

int RunImportHf(const Args& args, const std::string& hf_dir, std::ostream& out, std::ostream& err) {
  absl::StatusOr<int64_t> seq_len = args.GetInt("seq_len", 0);
  if (!seq_len.ok() || *seq_len < 0 || *seq_len > (1 << 20)) {
    err << "batonctl checkpoint import-hf: --seq_len must be a positive integer (default: n_positions)\n";
    return 2;
  }
  HfImportOptions options;
  options.seq_len = static_cast<int>(*seq_len);
  options.force = args.GetBool("force");
  const std::string ckpt = args.GetString("out", "");
  absl::StatusOr<checkpoint::ModelShape> model = ImportHfCheckpoint(hf_dir, ckpt, options);
  if (!model.ok()) {
    err << "batonctl checkpoint import-hf: " << model.status().message() << "\n";
    return HfExitCode(model.status());
  }
  out << "imported " << hf_dir << " into " << ckpt << ": " << checkpoint::DescribeModel(*model)
      << " (step 0, zero AdamW moments); resume with a job of this model and --resume=" << ckpt << ":\n  "
      << JobModelBlock(*model) << "\n";
  return 0;
}

int RunExportHf(const Args& args, const std::string& ckpt, std::ostream& out, std::ostream& err) {
  const std::string hf_dir = args.GetString("out", "");
  absl::StatusOr<checkpoint::ModelShape> model = ExportHfCheckpoint(ckpt, hf_dir, args.GetBool("force"));
  if (!model.ok()) {
    err << "batonctl checkpoint export-hf: " << model.status().message() << "\n";
    return HfExitCode(model.status());
  }
  out << "exported " << ckpt << " to " << hf_dir << ": " << checkpoint::DescribeModel(*model)
      << "; load it with " << (model->arch == "llama" ? "LlamaForCausalLM" : "GPT2LMHeadModel")
      << ".from_pretrained(\"" << hf_dir << "\")\n";
  return 0;
}

}  // namespace

int RunCheckpointCommand(const std::vector<std::string>& argv, std::ostream& out, std::ostream& err) {
  absl::StatusOr<Args> args = Args::Parse(argv, {"out", "seq_len"}, {"json", "force"});
  if (!args.ok()) {
    err << "batonctl checkpoint: " << args.status().message() << "\n" << kUsage << "\n";
    return 2;
  }
  const std::vector<std::string>& words = args->positionals();
  const bool hf = words.size() == 2 && (words[0] == "import-hf" || words[0] == "export-hf");
  if (hf && !args->Has("out")) {
    err << "batonctl checkpoint " << words[0] << ": --out is required\n" << kUsage << "\n";
    return 2;
  }
  if (hf && words[0] == "import-hf") return RunImportHf(*args, words[1], out, err);
  if (hf) return RunExportHf(*args, words[1], out, err);
  if (words.size() != 3 || words[0] != "diff" || args->Has("out") || args->Has("seq_len") ||
      args->GetBool("force")) {
    err << kUsage << "\n";
    return 2;
  }
  checkpoint::FullState state[2];
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<checkpoint::FullState> s = checkpoint::LoadFullState(words[1 + i]);
    if (!s.ok()) {
      err << "batonctl checkpoint diff: cannot load " << words[1 + i] << ": " << s.status().message() << "\n";
      return 2;
    }
    state[i] = *std::move(s);
  }
  absl::StatusOr<checkpoint::WeightsDiff> diff = checkpoint::CompareWeights(state[0].tensors, state[1].tensors);
  if (!diff.ok()) {
    err << "batonctl checkpoint diff: " << words[1] << " and " << words[2] << ": " << diff.status().message()
        << "\n";
    return 1;
  }
  // The optimizer state, when both checkpoints hold it (v2).
  const bool both_optimizer = state[0].optimizer_step >= 0 && state[1].optimizer_step >= 0;
  absl::StatusOr<checkpoint::WeightsDiff> moments = absl::FailedPreconditionError("no optimizer state");
  if (both_optimizer && (state[0].has_moments || state[1].has_moments)) {
    moments = checkpoint::CompareMoments(state[0], state[1]);
  }
  if (args->GetBool("json")) {
    out << "{\"max_abs_diff\": " << JsonNumber(diff->max_abs_diff) << ", \"max_rel_diff\": "
        << JsonNumber(diff->max_rel_diff) << ", \"tensors\": " << diff->tensors.size();
    if (both_optimizer) {
      out << ", \"optimizer_step\": [" << state[0].optimizer_step << ", " << state[1].optimizer_step << "]";
    }
    if (moments.ok()) {
      out << ", \"moments_max_abs_diff\": " << JsonNumber(moments->max_abs_diff)
          << ", \"moments_max_rel_diff\": " << JsonNumber(moments->max_rel_diff);
    }
    out << "}\n";
    return 0;
  }
  out << "max_abs_diff " << Number(diff->max_abs_diff) << "  max_rel_diff " << Number(diff->max_rel_diff)
      << "  (" << diff->tensors.size() << " tensors; rel = ||a-b|| / ||b|| per tensor, b = " << words[2] << ")\n";
  if (both_optimizer) {
    out << "optimizer: step " << state[0].optimizer_step << " vs " << state[1].optimizer_step;
    if (moments.ok()) {
      out << "  adam moments max_abs_diff " << Number(moments->max_abs_diff) << "  max_rel_diff "
          << Number(moments->max_rel_diff) << "\n";
    } else {
      out << "  (" << moments.status().message() << ")\n";
    }
  } else if (state[0].optimizer_step >= 0 || state[1].optimizer_step >= 0) {
    out << "optimizer: only the " << (state[0].optimizer_step >= 0 ? "first" : "second")
        << " checkpoint holds optimizer state; weights compared only\n";
  }
  out << absl::StrFormat("%-32s %-14s %-14s %s\n", "TENSOR", "SHAPE", "MAX_ABS_DIFF", "REL_DIFF");
  for (const checkpoint::TensorDiff& t : diff->tensors) {
    out << absl::StrFormat("%-32s %-14s %-14s %s\n", t.name, absl::StrCat("[", absl::StrJoin(t.shape, ","), "]"),
                           Number(t.max_abs_diff), Number(t.rel_diff));
  }
  return 0;
}

}  // namespace baton::cli
