// Lowering: turns a compute-only schedule into the programs workers run, by
// inserting SEND_F/RECV_F/SEND_B/RECV_B for every dependency that crosses
// ranks and appending REDUCE_GRADS and OPTIMIZER_STEP. The result cannot
// deadlock under the blocking (rendezvous) semantics of ir.h; see lowering.cc
// for the invariant.
#ifndef BATON_COORDINATOR_SCHEDULE_LOWERING_H_
#define BATON_COORDINATOR_SCHEDULE_LOWERING_H_

#include "absl/status/statusor.h"
#include "coordinator/schedule/ir.h"
#include "coordinator/schedule/simulator.h"

namespace baton::schedule {

// `costs` shapes where messages go (sends and receives are placed where the
// simulated timeline needs them); any cost model gives a deadlock-free
// result. InvalidArgument when the input already has communication or
// reduction actions; FailedPrecondition when the compute order deadlocks.
absl::StatusOr<Schedule> Lower(const Schedule& compute, const CostModel& costs = CostModel());

}  // namespace baton::schedule

#endif  // BATON_COORDINATOR_SCHEDULE_LOWERING_H_
