#include "cli/checkpoint_cmd.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "cli/args.h"
#include "common/json.h"
#include "worker/checkpoint/checkpoint.h"
#include "worker/checkpoint/weights_diff.h"

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
  std::map<std::string, checkpoint::FullTensor> weights[2];
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<std::map<std::string, checkpoint::FullTensor>> w = checkpoint::LoadFullWeights(words[1 + i]);
    if (!w.ok()) {
      err << "batonctl checkpoint diff: cannot load " << words[1 + i] << ": " << w.status().message() << "\n";
      return 2;
    }
    weights[i] = *std::move(w);
  }
  absl::StatusOr<checkpoint::WeightsDiff> diff = checkpoint::CompareWeights(weights[0], weights[1]);
  if (!diff.ok()) {
    err << "batonctl checkpoint diff: " << words[1] << " and " << words[2] << ": " << diff.status().message()
        << "\n";
    return 1;
  }
  if (args->GetBool("json")) {
    out << "{\"max_abs_diff\": " << JsonNumber(diff->max_abs_diff) << ", \"max_rel_diff\": "
        << JsonNumber(diff->max_rel_diff) << ", \"tensors\": " << diff->tensors.size() << "}\n";
    return 0;
  }
  out << "max_abs_diff " << Number(diff->max_abs_diff) << "  max_rel_diff " << Number(diff->max_rel_diff)
      << "  (" << diff->tensors.size() << " tensors; rel = ||a-b|| / ||b|| per tensor, b = " << words[2] << ")\n";
  out << absl::StrFormat("%-32s %-14s %-14s %s\n", "TENSOR", "SHAPE", "MAX_ABS_DIFF", "REL_DIFF");
  for (const checkpoint::TensorDiff& t : diff->tensors) {
    out << absl::StrFormat("%-32s %-14s %-14s %s\n", t.name, absl::StrCat("[", absl::StrJoin(t.shape, ","), "]"),
                           Number(t.max_abs_diff), Number(t.rel_diff));
  }
  return 0;
}

}  // namespace baton::cli
