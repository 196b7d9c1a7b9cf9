// Schedule validator: proves a schedule (compute-only or lowered) runs to
// completion with correct data flow before any worker sees it. Checks, in
// order, reporting the first violation:
//   1. shape: one program per rank, stages/microbatches in range, every action
//      on the rank that holds its stage, peers that hold the partner stage;
//   2. counts: every (stage, mb) has exactly one F and either one B or one I
//      and one W; at most one REDUCE_GRADS and OPTIMIZER_STEP, at the end;
//   3. order on a rank: F before I/B, I before W, and for stages on the same
//      rank upstream F before downstream F, downstream B/I before upstream B/I;
//   4. lowered schedules: every cross-rank dependency has exactly one send
//      after its producer and one receive before its consumer, and each pair
//      of ranks posts its sends and receives in the same order;
//   5. no deadlock: the programs are run (dependency waits for compute-only
//      schedules, rendezvous batches for lowered ones, see ir.h);
//   6. peak stored activations per rank within ActivationBound().
#ifndef BATON_COORDINATOR_SCHEDULE_VALIDATOR_H_
#define BATON_COORDINATOR_SCHEDULE_VALIDATOR_H_

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "coordinator/schedule/grid.h"
#include "coordinator/schedule/ir.h"

namespace baton::schedule {

struct Violation {
  std::string message;          // names the actions, ranks and positions involved
  std::optional<CellRef> cell;  // the offending action, when there is one
};

// The first violation, or nullopt for a valid schedule.
std::optional<Violation> FindViolation(const Schedule& schedule);

// OK, or FailedPrecondition with the first violation followed by the
// program-order grid with the offending cell marked.
absl::Status Validate(const Schedule& schedule);

}  // namespace baton::schedule

#endif  // BATON_COORDINATOR_SCHEDULE_VALIDATOR_H_
