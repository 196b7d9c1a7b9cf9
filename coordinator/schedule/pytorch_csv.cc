#include "coordinator/schedule/pytorch_csv.h"

#include <algorithm>
#include <map>
#include <set>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace baton::schedule {
namespace {

constexpr absl::string_view kOverlapSuffix = ")OVERLAP_F_B";

// A cell as written, before the naming is settled.
struct RawCell {
  std::string kind;  // F, I, W, B, BW, SEND_F, RECV_F, SEND_B, RECV_B
  int stage = 0;
  int mb = 0;
  int row = 0;
  int col = 0;
  int half = 0;  // 0: a cell of its own; 1, 2: first or second half of an OVERLAP_F_B
};

std::string Where(int row, int col) { return absl::StrCat("row ", row + 1, " (rank ", row, "), cell ", col + 1); }
std::string Where(const RawCell& c) { return Where(c.row, c.col); }

bool IsCommKind(absl::string_view kind) {
  return kind == "SEND_F" || kind == "RECV_F" || kind == "SEND_B" || kind == "RECV_B";
}

absl::StatusOr<RawCell> ParseAction(absl::string_view cell) {
  size_t i = 0;
  while (i < cell.size() && absl::ascii_isdigit(cell[i])) ++i;
  size_t j = i;
  while (j < cell.size() && !absl::ascii_isdigit(cell[j])) ++j;
  const absl::string_view stage = cell.substr(0, i), kind = cell.substr(i, j - i), mb = cell.substr(j);
  RawCell c;
  if (stage.empty() || mb.empty() || !absl::SimpleAtoi(stage, &c.stage) || !absl::SimpleAtoi(mb, &c.mb)) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", cell, "' is not an action; write <stage><kind><microbatch>, like 0F3"));
  }
  // No valid schedule has a stage or microbatch index at kMaxScheduleCells
  // (and INT_MAX + 1 would overflow the counts inferred from them).
  if (c.stage < 0 || c.mb < 0 || c.stage >= kMaxScheduleCells || c.mb >= kMaxScheduleCells) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", cell, "' has a stage or microbatch outside [0, ", kMaxScheduleCells, ")"));
  }
  if (kind != "F" && kind != "I" && kind != "W" && kind != "B" && kind != "BW" && !IsCommKind(kind)) {
    return absl::InvalidArgumentError(absl::StrCat("'", cell, "' has kind '", kind,
                                                   "'; the format allows F, I, W, B (BW in the older naming), "
                                                   "SEND_F, RECV_F, SEND_B, RECV_B and (F;B)OVERLAP_F_B"));
  }
  c.kind = std::string(kind);
  return c;
}

// One CSV cell: an action, or an overlapped pair of two.
absl::Status ParseCell(absl::string_view cell, int row, int col, std::vector<RawCell>* out) {
  auto add = [&](absl::string_view text, int half) -> absl::Status {
    absl::StatusOr<RawCell> c = ParseAction(text);
    if (!c.ok()) return c.status();
    c->row = row;
    c->col = col;
    c->half = half;
    out->push_back(*c);
    return absl::OkStatus();
  };
  if (!absl::StartsWith(cell, "(")) return add(cell, 0);
  if (!absl::EndsWith(cell, kOverlapSuffix)) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", cell, "' is not an overlapped pair; write (<forward>;<backward>)OVERLAP_F_B"));
  }
  const absl::string_view inner = cell.substr(1, cell.size() - 1 - kOverlapSuffix.size());
  std::vector<absl::string_view> halves = absl::StrSplit(inner, ';');
  if (halves.size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", cell, "' has ", halves.size(), " parts; an OVERLAP_F_B pairs one F with one B"));
  }
  for (int h = 0; h < 2; ++h) {
    absl::Status st = add(absl::StripAsciiWhitespace(halves[h]), h + 1);
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

bool UsesLegacyNaming(const std::vector<RawCell>& cells) {
  std::set<std::pair<int, int>> b, w;
  for (const RawCell& c : cells) {
    if (c.kind == "BW") return true;
    if (c.kind == "I") return false;
    if (c.kind == "B") b.insert({c.stage, c.mb});
    if (c.kind == "W") w.insert({c.stage, c.mb});
  }
  for (const auto& key : b) {
    if (w.count(key)) return true;
  }
  return false;
}

absl::StatusOr<ActionKind> KindOf(const RawCell& c, bool legacy) {
  if (c.kind == "F") return ActionKind::kForward;
  if (c.kind == "W") return ActionKind::kBackwardWeight;
  if (c.kind == "SEND_F") return ActionKind::kSendF;
  if (c.kind == "RECV_F") return ActionKind::kRecvF;
  if (c.kind == "SEND_B") return ActionKind::kSendB;
  if (c.kind == "RECV_B") return ActionKind::kRecvB;
  if (legacy) {
    if (c.kind == "B") return ActionKind::kBackwardInput;
    if (c.kind == "BW") return ActionKind::kBackward;
    return absl::InvalidArgumentError(absl::StrCat(Where(c), ": '", c.stage, c.kind, c.mb,
                                                   "' is current naming, but the file is read with the older "
                                                   "naming (B = input backward, BW = full backward)"));
  }
  if (c.kind == "I") return ActionKind::kBackwardInput;
  if (c.kind == "B") return ActionKind::kBackward;
  return absl::InvalidArgumentError(absl::StrCat(Where(c), ": '", c.stage, c.kind, c.mb,
                                                 "' is the older naming's full backward, but the file is read "
                                                 "with the current naming (I, W, B); read it with the legacy naming"));
}

std::string CellText(const Action& a) { return absl::StrCat(a.stage, KindName(a.kind), a.microbatch); }

}  // namespace

absl::StatusOr<CsvNaming> ParseCsvNaming(absl::string_view name) {
  if (name.empty() || name == "auto") return CsvNaming::kAuto;
  if (name == "current") return CsvNaming::kCurrent;
  if (name == "legacy") return CsvNaming::kLegacy;
  return absl::InvalidArgumentError(absl::StrCat("CSV naming '", name,
                                                 "' is unknown; use auto, current (I/W/B) or legacy (B/W/BW)"));
}

std::string ToPytorchCsv(const Schedule& schedule, bool comms) {
  std::string out;
  for (const auto& program : schedule.ranks) {
    std::vector<std::string> cells;
    for (size_t i = 0; i < program.size(); ++i) {
      const Action& a = program[i];
      if (a.overlap_with_next && i + 1 < program.size()) {
        cells.push_back(absl::StrCat("(", CellText(a), ";", CellText(program[i + 1]), ")OVERLAP_F_B"));
        ++i;
      } else if (IsCompute(a.kind) || (comms && IsCommunication(a.kind))) {
        cells.push_back(CellText(a));
      }
    }
    absl::StrAppend(&out, absl::StrJoin(cells, ","), "\n");
  }
  return out;
}

absl::StatusOr<Schedule> FromPytorchCsv(absl::string_view csv, CsvNaming naming) {
  std::vector<absl::string_view> lines = absl::StrSplit(csv, '\n');
  while (!lines.empty() && absl::StripAsciiWhitespace(lines.back()).empty()) lines.pop_back();
  if (lines.empty()) {
    return absl::InvalidArgumentError("the CSV is empty; expected one row of actions per rank");
  }
  const int rows = static_cast<int>(lines.size());
  std::vector<RawCell> cells;
  int max_stage = -1, max_mb = -1;
  for (int row = 0; row < rows; ++row) {
    std::vector<absl::string_view> fields = absl::StrSplit(lines[row], ',');
    for (int col = 0; col < static_cast<int>(fields.size()); ++col) {
      const absl::string_view cell = absl::StripAsciiWhitespace(fields[col]);
      if (cell.empty()) continue;
      absl::Status st = ParseCell(cell, row, col, &cells);
      if (!st.ok()) return absl::InvalidArgumentError(absl::StrCat(Where(row, col), ": ", st.message()));
    }
  }
  for (const RawCell& c : cells) {
    max_stage = std::max(max_stage, c.stage);
    max_mb = std::max(max_mb, c.mb);
  }
  if (max_stage < 0) return absl::InvalidArgumentError("the CSV holds no actions");
  const int stages = max_stage + 1;
  if (stages % rows != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the CSV uses stages 0..", max_stage, " on ", rows,
                     " ranks; the number of "
                     "stages must be a multiple of the number of rows (one row per rank)"));
  }
  Schedule s;
  s.num_ranks = rows;
  s.virtual_stages = stages / rows;
  s.microbatches = max_mb + 1;
  if (int64_t{stages} * s.microbatches > kMaxScheduleCells) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the CSV uses ", stages, " stages and ", s.microbatches, " microbatches, more than the ",
        kMaxScheduleCells, " (stage, microbatch) cells supported"));
  }

  // Placement: the row of the first cell naming a stage; every later cell
  // must agree.
  std::vector<const RawCell*> first(stages, nullptr);
  for (const RawCell& c : cells) {
    const RawCell*& seen = first[c.stage];
    if (seen == nullptr) {
      seen = &c;
      continue;
    }
    if (seen->row == c.row) continue;
    if (c.half != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          Where(c), ": the overlapped pair's halves are on different ranks: stage ", c.stage, " lives on rank ",
          seen->row, " (", Where(*seen), "); both halves of an OVERLAP_F_B run on the rank of its row"));
    }
    return absl::InvalidArgumentError(absl::StrCat(Where(c), ": '", c.stage, c.kind, c.mb, "' puts stage ", c.stage,
                                                   " on rank ", c.row, ", but ", Where(*seen),
                                                   " put it on rank ", seen->row,
                                                   "; a stage lives on one rank"));
  }
  std::vector<int> held(rows, 0);
  for (int st = 0; st < stages; ++st) {
    if (first[st] == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("stage ", st, " of 0..", max_stage,
                                                     " appears in no row; every stage needs its actions"));
    }
    s.stage_ranks.push_back(first[st]->row);
    ++held[first[st]->row];
  }
  for (int r = 0; r < rows; ++r) {
    if (held[r] != s.virtual_stages) {
      return absl::InvalidArgumentError(absl::StrCat("row ", r + 1, " (rank ", r, ") holds ", held[r],
                                                     " stages; every rank must hold ", s.virtual_stages, " (",
                                                     stages, " stages on ", rows, " ranks)"));
    }
  }
  bool looped = true;
  for (int st = 0; st < stages; ++st) looped &= s.stage_ranks[st] == st % rows;
  if (looped) s.stage_ranks.clear();

  const bool legacy = naming == CsvNaming::kLegacy || (naming == CsvNaming::kAuto && UsesLegacyNaming(cells));
  s.ranks.resize(rows);
  for (const RawCell& c : cells) {
    absl::StatusOr<ActionKind> kind = KindOf(c, legacy);
    if (!kind.ok()) return kind.status();
    Action a{*kind, c.stage, c.mb, 0};
    if (IsCommunication(a.kind)) {
      const bool toward_next = a.kind == ActionKind::kSendF || a.kind == ActionKind::kRecvB;
      const int partner = toward_next ? c.stage + 1 : c.stage - 1;
      if (partner < 0 || partner >= stages) {
        return absl::InvalidArgumentError(absl::StrCat(Where(c), ": '", c.stage, c.kind, c.mb,
                                                       "' has no partner: stage ", partner, " does not exist"));
      }
      a.peer = s.RankOf(partner);
      if (a.peer == c.row) {
        return absl::InvalidArgumentError(absl::StrCat(Where(c), ": '", c.stage, c.kind, c.mb, "' is not needed: stages ",
                                                       c.stage, " and ", partner, " are both on rank ", c.row));
      }
    }
    if (c.half == 1) {
      if (a.kind != ActionKind::kForward) {
        return absl::InvalidArgumentError(absl::StrCat(Where(c), ": the first half of an OVERLAP_F_B is '", c.stage,
                                                       c.kind, c.mb, "'; it must be a forward (F)"));
      }
      a.overlap_with_next = true;
    }
    if (c.half == 2 && a.kind != ActionKind::kBackward && a.kind != ActionKind::kBackwardInput) {
      return absl::InvalidArgumentError(absl::StrCat(Where(c), ": the second half of an OVERLAP_F_B is '", c.stage,
                                                     c.kind, c.mb, "'; it must be a backward (B or I)"));
    }
    s.ranks[c.row].push_back(a);
  }
  return s;
}

}  // namespace baton::schedule
