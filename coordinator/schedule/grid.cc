#include "coordinator/schedule/grid.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "coordinator/schedule/simulator.h"

namespace baton::schedule {
namespace {

constexpr int kMaxColumns = 48;
constexpr int kMaxRows = 16;

// rows[r][c] = label, or "" for an empty cell drawn as `empty`. Draws rows
// [row_lo, row_hi) and columns [col_lo, col_hi) with the marked cell in
// brackets.
std::string Draw(const std::vector<std::vector<std::string>>& rows, int row_lo, int row_hi,
                 int col_lo, int col_hi, int mark_row, int mark_col, const std::string& empty) {
  size_t width = 1;
  for (int r = row_lo; r < row_hi; ++r) {
    for (int c = col_lo; c < col_hi && c < static_cast<int>(rows[r].size()); ++c) {
      width = std::max(width, rows[r][c].size());
    }
  }
  const std::string rank_header = absl::StrCat("rank ", rows.size() - 1);
  std::string out;
  if (row_lo > 0) absl::StrAppend(&out, "  (ranks 0..", row_lo - 1, " not shown)\n");
  for (int r = row_lo; r < row_hi; ++r) {
    std::string line = absl::StrCat("rank ", r);
    line.resize(rank_header.size(), ' ');
    absl::StrAppend(&line, " |");
    if (col_lo > 0) absl::StrAppend(&line, " ...");
    for (int c = col_lo; c < col_hi; ++c) {
      std::string cell =
          c < static_cast<int>(rows[r].size()) && !rows[r][c].empty() ? rows[r][c] : empty;
      const bool marked = r == mark_row && c == mark_col;
      cell.resize(width, ' ');
      absl::StrAppend(&line, marked ? "[" : " ", cell, marked ? "]" : " ");
    }
    int row_len = static_cast<int>(rows[r].size());
    if (col_hi < row_len) absl::StrAppend(&line, " ...");
    while (!line.empty() && line.back() == ' ') line.pop_back();
    absl::StrAppend(&out, line, "\n");
  }
  if (row_hi < static_cast<int>(rows.size())) {
    absl::StrAppend(&out, "  (ranks ", row_hi, "..", rows.size() - 1, " not shown)\n");
  }
  return out;
}

}  // namespace

absl::StatusOr<std::string> RenderTimeGrid(const Schedule& schedule) {
  const Schedule compute = ComputeOnly(schedule);
  CostModel unit;
  unit.forward = unit.backward_input = unit.backward_weight = 1;
  unit.backward = 1;
  auto sim = Simulate(compute, unit);
  if (!sim.ok()) return sim.status();
  // Costs are 1/v per action; slot = start * v.
  const int v = schedule.virtual_stages;
  const int slots = static_cast<int>(std::lround(sim->makespan * v));
  std::vector<std::vector<std::string>> rows(compute.num_ranks, std::vector<std::string>(slots));
  for (int r = 0; r < compute.num_ranks; ++r) {
    for (size_t i = 0; i < compute.ranks[r].size(); ++i) {
      int slot = static_cast<int>(std::lround(sim->timings[r][i].start * v));
      // The second half of an overlapped pair starts with the first ("0F7&"):
      // drawn in the slot after it, the pair's second slot.
      if (i > 0 && compute.ranks[r][i - 1].overlap_with_next) ++slot;
      rows[r][slot] = CellLabel(compute.ranks[r][i], v);
    }
  }
  return Draw(rows, 0, compute.num_ranks, 0, slots, -1, -1, ".");
}

std::string RenderProgramGrid(const Schedule& schedule, std::optional<CellRef> mark) {
  const int p = static_cast<int>(schedule.ranks.size());
  std::vector<std::vector<std::string>> rows(p);
  int mark_row = -1, mark_col = -1;
  for (int r = 0; r < p; ++r) {
    const auto& program = schedule.ranks[r];
    for (size_t i = 0; i < program.size(); ++i) {
      if (mark && mark->rank == r && static_cast<int>(i) >= mark->action && mark_row < 0) {
        if (IsCompute(program[i].kind) || i + 1 == program.size()) {
          mark_row = r;
          mark_col = static_cast<int>(rows[r].size());
        }
      }
      if (IsCompute(program[i].kind)) {
        rows[r].push_back(CellLabel(program[i], schedule.virtual_stages));
      }
    }
  }
  if (mark_row >= 0 && mark_col >= static_cast<int>(rows[mark_row].size())) {
    rows[mark_row].push_back("");  // a mark after the last compute action
  }
  int columns = 0;
  for (const auto& row : rows) columns = std::max(columns, static_cast<int>(row.size()));
  int col_lo = 0, col_hi = columns, row_lo = 0, row_hi = p;
  if (columns > kMaxColumns) {
    col_lo = std::clamp(mark_col - kMaxColumns / 2, 0, columns - kMaxColumns);
    col_hi = col_lo + kMaxColumns;
  }
  if (p > kMaxRows) {
    row_lo = std::clamp(mark_row - kMaxRows / 2, 0, p - kMaxRows);
    row_hi = row_lo + kMaxRows;
  }
  return Draw(rows, row_lo, row_hi, col_lo, col_hi, mark_row, mark_col, "");
}

}  // namespace baton::schedule
