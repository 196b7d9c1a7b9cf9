// JobGroups: the communicator groups one rank of a job generation belongs to
// (TP group, pipeline group, DP group, tied-embedding pair, and for the
// planned axes the CP ring and the expert groups), named and ordered the
// same way on every rank.
//
// The result is one GroupRound per kind of group, in the one global order
// every rank uses (tp, pp, dp, tie, cp, ep, edp; kinds the layout does not
// have are left out on every rank, so with cp = ep = 1 the rounds are the
// four of a pp x tp x dp job). A round is exactly what one ncclCommSplit call of the
// job's parent communicator needs: ranks of the same group share `color`
// (distinct per group, >= 0), `key` is the rank's rank within its group, and
// a rank in none of the round's groups (the middle pipeline stages in the
// tie round) gets kNoColor. The per-group path (Gloo, or NCCL without
// splitting) creates the rounds' groups in the same order, skipping kNoColor.
//
// Global (job) rank of (pp rank p, tp rank t, dp rank d, cp rank c):
// ((d * pp + p) * cp + c) * tp + t, the planner's order (coordinator/planner.h);
// (d * pp + p) * tp + t when cp = 1.
//
// The groups, for a rank (p, t, d, c); a group's name is its key scope, and
// "-c<c>" appears in names only when cp > 1 (so cp = 1 names are unchanged):
//   tp   the tp ranks of one (d, p, c)                   "tp-d<d>-p<p>[-c<c>]"
//   pp   the pp ranks of one (d, c, t)                   "pp-d<d>[-c<c>]-t<t>"
//   dp   the dp x cp ranks of one (p, t), key d * cp + c: the ranks that
//        hold the same parameters (Megatron's "dp-cp" group), over which
//        gradients are averaged and ZeRO shards (dp * cp > 1) "dp-p<p>-t<t>"
//   tie  first and last stage's pp ranks of one (d, c, t) "tie-d<d>[-c<c>]-t<t>"
//   cp   the cp ranks of one (d, p, t), the ring context parallelism passes
//        key/value blocks around (cp > 1)                 "cp-d<d>-p<p>-t<t>"
//   ep   the expert group: the ep consecutive dp ranks d = g*ep .. g*ep+ep-1
//        of one (p, c, t), key d % ep (ep > 1)            "ep-p<p>[-c<c>]-t<t>-g<g>"
//   edp  the expert-data-parallel group: the dp ranks of one (p, c, t) that
//        hold the same expert slot s = d % ep, key d / ep; it reduces the
//        experts' gradients (dp / ep > 1)                 "edp-p<p>[-c<c>]-t<t>-s<s>"
//
// Pure functions: no I/O, thread-safe.
#ifndef BATON_WORKER_COMM_JOB_GROUPS_H_
#define BATON_WORKER_COMM_JOB_GROUPS_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace baton::comm {

struct JobLayout {
  int pp = 1;
  int tp = 1;
  int dp = 1;
  // The pipeline ranks holding the first and the last stage share the tied
  // embedding (pp > 1, a GPT model rather than the synthetic cost model).
  bool tied_embedding = false;
  // Where those stages are: pipeline rank 0 and pp - 1 (-1) when looped;
  // a V puts both on rank 0, and then no tie group is made (the two chunks
  // sum their copies locally).
  int first_stage_rank = 0;
  int last_stage_rank = -1;
  // Planned axes, last so that positional initialisers of the fields above
  // keep their meaning: context-parallel degree, and the expert-parallel
  // degree carved out of dp (ep divides dp).
  int cp = 1;
  int ep = 1;
};

struct RankCoords {
  int pp_rank = 0;
  int tp_rank = 0;
  int dp_rank = 0;
  int cp_rank = 0;
};

// kExpertDp: the expert-data-parallel group (see above).
enum class GroupKind { kTp, kPipeline, kDp, kTie, kCp, kEp, kExpertDp };

// Equals NCCL_SPLIT_NOCOLOR; the rank joins no group in this round.
inline constexpr int kNoColor = -1;

struct GroupRound {
  GroupKind kind = GroupKind::kTp;
  int color = kNoColor;  // the group's index in this round, or kNoColor
  int key = 0;           // rank within the group (NCCL orders a split's ranks by key)
  int size = 0;          // ranks in the group (0 with kNoColor)
  std::string group;     // e.g. "tp-d0-p1", the key scope "comm/<group>/gen<g>" (empty with kNoColor)
};

const char* GroupKindName(GroupKind kind);  // "tp", "pp", "dp", "tie", "cp", "ep", "edp"

int JobSize(const JobLayout& layout);
int JobRank(const JobLayout& layout, const RankCoords& rank);

// The rounds of `rank` in `layout`. INVALID_ARGUMENT for a non-positive
// degree, an ep that does not divide dp, or coordinates outside the layout.
absl::StatusOr<std::vector<GroupRound>> PlanJobGroups(const JobLayout& layout,
                                                      const RankCoords& rank);

}  // namespace baton::comm

#endif  // BATON_WORKER_COMM_JOB_GROUPS_H_
