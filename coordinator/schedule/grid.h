// Text pictures of a schedule, like the textbook tables: one row per rank,
// one column per slot, cells such as "F3", "B3", "I3", "W3" ("5F3" = stage 5
// when v > 1) and "." for idle. An overlapped pair is drawn as its two
// halves side by side, the first ending in "&" ("0F7& 7B3").
#ifndef BATON_COORDINATOR_SCHEDULE_GRID_H_
#define BATON_COORDINATOR_SCHEDULE_GRID_H_

#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "coordinator/schedule/ir.h"

namespace baton::schedule {

// An action of the schedule: schedule.ranks[rank][action].
struct CellRef {
  int rank = 0;
  int action = 0;
};

// Time grid: the compute actions simulated with every action (B included)
// taking one slot and free communication, so "." shows where a rank waits for
// a peer. FailedPrecondition when the schedule deadlocks.
absl::StatusOr<std::string> RenderTimeGrid(const Schedule& schedule);

// Program-order grid: column k of a row is the k-th compute action of that
// rank. `mark` is drawn as "[F3]"; a communication action marks the compute
// action that follows it. Wide or tall schedules are cut to a window around
// the mark.
std::string RenderProgramGrid(const Schedule& schedule, std::optional<CellRef> mark);

}  // namespace baton::schedule

#endif  // BATON_COORDINATOR_SCHEDULE_GRID_H_
