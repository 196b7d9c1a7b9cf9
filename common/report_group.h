// Report groups (docs/protocol.md, "Report groups"): which group a rank of a
// pp x tp x dp mesh reports through, and its seat there. The coordinator
// (JobRunner) and the workers (WorkerJob) both place ranks with this, from
// the plan's dimensions and Plan.report_group_columns alone (a worker's plan
// holds only its own rank).
//
// Pipeline columns (the pp ranks of one tp and dp rank) are numbered
// c = dp_rank * tp + tp_rank. A group is `columns` consecutive columns
// (the last group may have fewer); inside it ranks are numbered by column,
// then pipeline rank, so seat 0 (pipeline rank 0 of the group's first
// column) is the group's leader.
#ifndef BATON_COMMON_REPORT_GROUP_H_
#define BATON_COMMON_REPORT_GROUP_H_

#include <string>

namespace baton {

// The coordinator's group size (JobRunner::Options::report_group_ranks).
inline constexpr int kDefaultReportGroupRanks = 16;

struct ReportGroupSeat {
  int group = 0;  // the group's index, 0 .. ReportGroupCount - 1
  int rank = 0;   // the seat in the group; 0 is the leader
  int size = 0;   // ranks in the group
};

struct MeshRank {
  int pp_rank = 0, tp_rank = 0, dp_rank = 0;
};

// `columns` < 1 counts as 1. Ranks outside the mesh are the caller's to
// refuse first.
ReportGroupSeat ReportGroupSeatOf(int pp, int tp, int dp, int columns, int pp_rank, int tp_rank, int dp_rank);
// The mesh rank at `seat` of group `group` (the inverse of ReportGroupSeatOf),
// for messages that name a member.
MeshRank ReportGroupMember(int pp, int tp, int columns, int group, int seat);
int ReportGroupCount(int tp, int dp, int columns);
// Columns per group for groups of about `target_ranks` ranks:
// ceil(target_ranks / pp), within 1 .. tp * dp.
int ReportGroupColumnsFor(int pp, int tp, int dp, int target_ranks);
// The name of group `group`'s communicator of a job generation.
std::string ReportGroupName(int group);

}  // namespace baton

#endif  // BATON_COMMON_REPORT_GROUP_H_
