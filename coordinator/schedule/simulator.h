// Event-driven simulator of a pipeline schedule under a cost model: per-op
// costs (F, I, W; B = I + W unless set), per-stage multipliers for uneven
// stages, and a per-message communication cost (latency + bytes / bandwidth).
//
// A compute-only schedule runs with eager messages: an op starts once its rank
// is free and its inputs have arrived (producer end + message cost when the
// producer is on another rank). A lowered schedule runs its programs batch by
// batch (see ir.h). By default a send returns once posted (an isend whose
// buffer is released later) and a receive waits for the data (send post +
// message cost). With `blocking_sends`, sends wait for the receiver too
// (rendezvous: both sides finish at the later post + message cost), the
// strict semantics the validator proves deadlock freedom under.
//
// Costs describe a rank's whole model share (one stage when v = 1); a chunk
// of an interleaved or V schedule costs 1/v of that, times its stage
// multiplier. An overlapped pair (ir.h) runs as one op of PairCost.
#ifndef BATON_COORDINATOR_SCHEDULE_SIMULATOR_H_
#define BATON_COORDINATOR_SCHEDULE_SIMULATOR_H_

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "coordinator/schedule/ir.h"

namespace baton::schedule {

struct CostModel {
  double forward = 1;
  double backward_input = 1;
  double backward_weight = 1;
  std::optional<double> backward;         // cost of a full B; unset: I + W
  // Cost of an overlapped pair (an F marked overlap_with_next and the B or I
  // after it), DualPipe's F&B; unset: the two halves' costs added.
  std::optional<double> overlapped;
  std::vector<double> stage_multipliers;  // empty, or one factor per stage
  double comm_latency = 0;
  double comm_bandwidth = std::numeric_limits<double>::infinity();  // bytes/unit
  double activation_bytes = 0;  // bytes per message (activations or gradients)
  bool blocking_sends = false;  // lowered schedules only; see above

  // InvalidArgument naming the field when a cost is negative or not finite,
  // the bandwidth is not positive, or the multipliers do not match the stages.
  absl::Status Check(int num_stages) const;
  // Duration of a compute action of `schedule` (0 for non-compute actions).
  double ComputeCost(const Action& action, int virtual_stages) const;
  // Duration of an overlapped pair: `overlapped` (times the halves' mean
  // stage multiplier, over v) or the two costs added.
  double PairCost(const Action& forward_half, const Action& backward_half, int virtual_stages) const;
  // Time one point-to-point message takes once both sides are ready.
  double MessageCost() const;
};

struct ActionTiming {
  double start = 0;
  double end = 0;
  // Order in which the simulator executed compute actions (a topological
  // order of the dependency graph); -1 for other actions.
  int64_t sequence = -1;
};

struct RankStats {
  int rank = 0;
  double busy = 0;          // time in compute actions
  double bubble_ratio = 0;  // 1 - busy / makespan
  int peak_activations = 0;
};

struct SimulationResult {
  double makespan = 0;
  double bubble_ratio = 0;  // 1 - sum(busy) / (p * makespan)
  std::vector<RankStats> ranks;
  std::vector<std::vector<ActionTiming>> timings;  // [rank][action index]
};

// FailedPrecondition when the schedule cannot finish (a deadlock; the
// validator explains it), InvalidArgument for out-of-range actions or a bad
// cost model.
absl::StatusOr<SimulationResult> Simulate(const Schedule& schedule, const CostModel& costs);

struct Deadlock {
  std::string message;  // every stuck rank, its action and what it waits for
  int rank = 0;         // the lowest stuck rank
  int action = 0;       // and the action it is stuck at
};

// Runs the schedule with unit costs and blocking sends and reports the ranks left stuck, or
// nullopt when it finishes. Actions must be in range (see Simulate).
std::optional<Deadlock> FindDeadlock(const Schedule& schedule);

}  // namespace baton::schedule

#endif  // BATON_COORDINATOR_SCHEDULE_SIMULATOR_H_
