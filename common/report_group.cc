#include "common/report_group.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace baton {

ReportGroupSeat ReportGroupSeatOf(int pp, int tp, int dp, int columns, int pp_rank, int tp_rank, int dp_rank) {
  const int k = std::max(1, columns);
  const int column = dp_rank * tp + tp_rank;
  ReportGroupSeat seat;
  seat.group = column / k;
  seat.rank = (column - seat.group * k) * pp + pp_rank;
  seat.size = std::min(k, tp * dp - seat.group * k) * pp;
  return seat;
}

MeshRank ReportGroupMember(int pp, int tp, int columns, int group, int seat) {
  const int column = group * std::max(1, columns) + seat / pp;
  return MeshRank{seat % pp, column % tp, column / tp};
}

int ReportGroupCount(int tp, int dp, int columns) {
  const int k = std::max(1, columns);
  return (tp * dp + k - 1) / k;
}

int ReportGroupColumnsFor(int pp, int tp, int dp, int target_ranks) {
  const int want = (std::max(1, target_ranks) + pp - 1) / pp;
  return std::clamp(want, 1, std::max(1, tp * dp));
}

std::string ReportGroupName(int group) { return absl::StrCat("report-", group); }

}  // namespace baton
