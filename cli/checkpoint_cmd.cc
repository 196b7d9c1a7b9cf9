#include "cli/checkpoint_cmd.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "cli/args.h"
#include "common/json.h"
#include "common/checkpoint_manifest.h"
#include "common/weights_diff.h"

namespace baton::cli {
namespace {

constexpr char kUsage[] = "usage: batonctl checkpoint diff DIR_A DIR_B [--json]";

std::string Number(double v) { return absl::StrFormat("%.6g", v); }

}  // namespace

int RunCheckpointCommand(const std::vector<std::string>& argv, std::ostream& out, std::ostream& err) {
  absl::StatusOr<Args> args = Args::Parse(argv, {}, {"json"});
  if (!args.ok()) {
    err << "batonctl checkpoint: " << args.status().message() << "\n" << kUsage << "\n";
    return 2;
  }
  const std::vector<std::string>& words = args->positionals();
  if (words.size() != 3 || words[0] != "diff") {
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
