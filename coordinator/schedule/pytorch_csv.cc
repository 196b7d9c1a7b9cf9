#include "coordinator/schedule/pytorch_csv.h"

#include <algorithm>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace baton::schedule {
namespace {

absl::StatusOr<Action> ParseCell(absl::string_view cell) {
  size_t i = 0;
  while (i < cell.size() && absl::ascii_isdigit(cell[i])) ++i;
  size_t j = i;
  while (j < cell.size() && !absl::ascii_isdigit(cell[j])) ++j;
  const absl::string_view stage = cell.substr(0, i), kind = cell.substr(i, j - i),
                          mb = cell.substr(j);
  int stage_value = 0, mb_value = 0;
  if (stage.empty() || mb.empty() || !absl::SimpleAtoi(stage, &stage_value) ||
      !absl::SimpleAtoi(mb, &mb_value)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", cell, "' is not an action; write <stage><F|I|W|B><microbatch>, like 0F3"));
  }
  // No valid schedule has a stage or microbatch index at kMaxScheduleCells
  // (and INT_MAX + 1 would overflow the counts inferred from them).
  if (stage_value < 0 || mb_value < 0 || stage_value >= kMaxScheduleCells || mb_value >= kMaxScheduleCells) {
    return absl::InvalidArgumentError(absl::StrCat("'", cell, "' has a stage or microbatch outside [0, ",
                                                   kMaxScheduleCells, ")"));
  }
  Action a{ActionKind::kForward, stage_value, mb_value, 0};
  if (kind == "F") {
    a.kind = ActionKind::kForward;
  } else if (kind == "B") {
    a.kind = ActionKind::kBackward;
  } else if (kind == "I") {
    a.kind = ActionKind::kBackwardInput;
  } else if (kind == "W") {
    a.kind = ActionKind::kBackwardWeight;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", cell, "' has kind '", kind, "'; the compute-only format allows F, I, W and B"));
  }
  return a;
}

}  // namespace

std::string ToPytorchCsv(const Schedule& schedule) {
  std::string out;
  for (const auto& program : schedule.ranks) {
    std::vector<std::string> cells;
    for (const Action& a : program) {
      if (IsCompute(a.kind)) cells.push_back(absl::StrCat(a.stage, KindName(a.kind), a.microbatch));
    }
    absl::StrAppend(&out, absl::StrJoin(cells, ","), "\n");
  }
  return out;
}

absl::StatusOr<Schedule> FromPytorchCsv(absl::string_view csv) {
  std::vector<absl::string_view> lines = absl::StrSplit(csv, '\n');
  while (!lines.empty() && absl::StripAsciiWhitespace(lines.back()).empty()) lines.pop_back();
  if (lines.empty()) {
    return absl::InvalidArgumentError("the CSV is empty; expected one row of actions per rank");
  }
  Schedule s;
  s.num_ranks = static_cast<int>(lines.size());
  s.ranks.resize(lines.size());
  int max_stage = -1, max_mb = -1;
  for (size_t row = 0; row < lines.size(); ++row) {
    std::vector<absl::string_view> cells = absl::StrSplit(lines[row], ',');
    for (size_t col = 0; col < cells.size(); ++col) {
      const absl::string_view cell = absl::StripAsciiWhitespace(cells[col]);
      if (cell.empty()) continue;
      auto action = ParseCell(cell);
      if (!action.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("row ", row + 1, " (rank ", row, "), cell ",
                                                       col + 1, ": ", action.status().message()));
      }
      max_stage = std::max(max_stage, action->stage);
      max_mb = std::max(max_mb, action->microbatch);
      s.ranks[row].push_back(*action);
    }
  }
  if (max_stage < 0) return absl::InvalidArgumentError("the CSV holds no actions");
  const int stages = max_stage + 1;
  if (stages % s.num_ranks != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the CSV uses stages 0..", max_stage, " on ", s.num_ranks,
                     " ranks; the number of "
                     "stages must be a multiple of the number of rows (one row per rank)"));
  }
  s.virtual_stages = stages / s.num_ranks;
  s.microbatches = max_mb + 1;
  if (int64_t{stages} * s.microbatches > kMaxScheduleCells) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the CSV uses ", stages, " stages and ", s.microbatches, " microbatches, more than the ",
        kMaxScheduleCells, " (stage, microbatch) cells supported"));
  }
  return s;
}

}  // namespace baton::schedule
