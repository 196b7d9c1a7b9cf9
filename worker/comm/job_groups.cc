#include "worker/comm/job_groups.h"

#include "absl/strings/str_cat.h"

namespace baton::comm {

const char* GroupKindName(GroupKind kind) {
  switch (kind) {
    case GroupKind::kTp:
      return "tp";
    case GroupKind::kPipeline:
      return "pp";
    case GroupKind::kDp:
      return "dp";
    case GroupKind::kTie:
      return "tie";
  }
  return "?";
}

int JobSize(const JobLayout& layout) { return layout.pp * layout.tp * layout.dp; }

int JobRank(const JobLayout& layout, const RankCoords& rank) {
  return (rank.dp_rank * layout.pp + rank.pp_rank) * layout.tp + rank.tp_rank;
}

absl::StatusOr<std::vector<GroupRound>> PlanJobGroups(const JobLayout& layout,
                                                      const RankCoords& rank) {
  const int pp = layout.pp, tp = layout.tp, dp = layout.dp;
  if (pp < 1 || tp < 1 || dp < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("layout pp ", pp, " tp ", tp, " dp ", dp, ": every degree must be >= 1"));
  }
  const int p = rank.pp_rank, t = rank.tp_rank, d = rank.dp_rank;
  if (p < 0 || p >= pp || t < 0 || t >= tp || d < 0 || d >= dp) {
    return absl::InvalidArgumentError(absl::StrCat("rank (pp ", p, ", tp ", t, ", dp ", d,
                                                   ") is outside the layout pp ", pp, " tp ", tp,
                                                   " dp ", dp));
  }
  std::vector<GroupRound> rounds;
  auto add = [&](GroupKind kind, int color, int key, int size, std::string group) {
    rounds.push_back(GroupRound{kind, color, key, size, std::move(group)});
  };
  if (tp > 1) add(GroupKind::kTp, d * pp + p, t, tp, absl::StrCat("tp-d", d, "-p", p));
  if (pp > 1) add(GroupKind::kPipeline, d * tp + t, p, pp, absl::StrCat("pp-d", d, "-t", t));
  if (dp > 1) add(GroupKind::kDp, p * tp + t, d, dp, absl::StrCat("dp-p", p, "-t", t));
  const int first = layout.first_stage_rank, last = layout.last_stage_rank < 0 ? pp - 1 : layout.last_stage_rank;
  if (first < 0 || first >= pp || last >= pp) {
    return absl::InvalidArgumentError(absl::StrCat("the first and last stages sit on pipeline ranks ", first, " and ",
                                                   last, ", outside the layout's pp ", pp));
  }
  if (pp > 1 && layout.tied_embedding && first != last) {
    // The pipeline ranks of the first stage (key 0) and of the last.
    if (p == first || p == last) {
      add(GroupKind::kTie, d * tp + t, p == first ? 0 : 1, 2, absl::StrCat("tie-d", d, "-t", t));
    } else {
      add(GroupKind::kTie, kNoColor, 0, 0, "");
    }
  }
  return rounds;
}

}  // namespace baton::comm
