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
    case GroupKind::kCp:
      return "cp";
    case GroupKind::kEp:
      return "ep";
    case GroupKind::kExpertDp:
      return "edp";
  }
  return "?";
}

int JobSize(const JobLayout& layout) { return layout.pp * layout.tp * layout.cp * layout.dp; }

int JobRank(const JobLayout& layout, const RankCoords& rank) {
  return ((rank.dp_rank * layout.pp + rank.pp_rank) * layout.cp + rank.cp_rank) * layout.tp + rank.tp_rank;
}

absl::StatusOr<std::vector<GroupRound>> PlanJobGroups(const JobLayout& layout,
                                                      const RankCoords& rank) {
  const int pp = layout.pp, tp = layout.tp, dp = layout.dp, cp = layout.cp, ep = layout.ep;
  if (pp < 1 || tp < 1 || dp < 1 || cp < 1 || ep < 1) {
    return absl::InvalidArgumentError(absl::StrCat("layout pp ", pp, " tp ", tp, " dp ", dp, " cp ", cp, " ep ", ep,
                                                   ": every degree must be >= 1"));
  }
  if (dp % ep != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("layout ep ", ep, " does not divide dp ", dp, ": expert groups are carved out of dp"));
  }
  const int p = rank.pp_rank, t = rank.tp_rank, d = rank.dp_rank, c = rank.cp_rank;
  if (p < 0 || p >= pp || t < 0 || t >= tp || d < 0 || d >= dp || c < 0 || c >= cp) {
    return absl::InvalidArgumentError(absl::StrCat("rank (pp ", p, ", tp ", t, ", dp ", d, ", cp ", c,
                                                   ") is outside the layout pp ", pp, " tp ", tp,
                                                   " dp ", dp, " cp ", cp));
  }
  std::vector<GroupRound> rounds;
  auto add = [&](GroupKind kind, int color, int key, int size, std::string group) {
    rounds.push_back(GroupRound{kind, color, key, size, std::move(group)});
  };
  // The cp rank in names only when there is more than one (cp = 1 names are
  // those of a pp x tp x dp job); colors reduce the same way with cp = 1.
  const std::string cn = cp > 1 ? absl::StrCat("-c", c) : "";
  if (tp > 1) add(GroupKind::kTp, (d * pp + p) * cp + c, t, tp, absl::StrCat("tp-d", d, "-p", p, cn));
  if (pp > 1) add(GroupKind::kPipeline, (d * cp + c) * tp + t, p, pp, absl::StrCat("pp-d", d, cn, "-t", t));
  // Megatron's dp x cp group: the cp ranks of a replica hold the same
  // parameters too, so gradients reduce (and ZeRO shards) over all of them.
  if (dp * cp > 1) add(GroupKind::kDp, p * tp + t, d * cp + c, dp * cp, absl::StrCat("dp-p", p, "-t", t));
  const int first = layout.first_stage_rank, last = layout.last_stage_rank < 0 ? pp - 1 : layout.last_stage_rank;
  if (first < 0 || first >= pp || last >= pp) {
    return absl::InvalidArgumentError(absl::StrCat("the first and last stages sit on pipeline ranks ", first, " and ",
                                                   last, ", outside the layout's pp ", pp));
  }
  if (pp > 1 && layout.tied_embedding && first != last) {
    // The pipeline ranks of the first stage (key 0) and of the last.
    if (p == first || p == last) {
      add(GroupKind::kTie, (d * cp + c) * tp + t, p == first ? 0 : 1, 2, absl::StrCat("tie-d", d, cn, "-t", t));
    } else {
      add(GroupKind::kTie, kNoColor, 0, 0, "");
    }
  }
  if (cp > 1) add(GroupKind::kCp, (d * pp + p) * tp + t, c, cp, absl::StrCat("cp-d", d, "-p", p, "-t", t));
  // Expert groups within one DP group (p, c, t): `column` numbers that DP group.
  const int column = (p * cp + c) * tp + t;
  const int expert_group = d / ep, expert_slot = d % ep, expert_groups = dp / ep;
  if (ep > 1) {
    add(GroupKind::kEp, column * expert_groups + expert_group, expert_slot, ep,
        absl::StrCat("ep-p", p, cn, "-t", t, "-g", expert_group));
  }
  if (ep > 1 && expert_groups > 1) {
    add(GroupKind::kExpertDp, column * ep + expert_slot, expert_group, expert_groups,
        absl::StrCat("edp-p", p, cn, "-t", t, "-s", expert_slot));
  }
  return rounds;
}

}  // namespace baton::comm
