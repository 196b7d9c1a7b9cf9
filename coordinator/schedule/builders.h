// Schedule builders: the compute order (F, B, I, W per rank, no communication)
// of the pipeline schedules baton supports. Lowering (lowering.h) adds the
// sends and receives afterwards.
//
//  gpipe        all forwards, then all backwards. Stores m activations.
//  1f1b         PipeDream-flush: rank r runs min(p-r-1, m) warm-up forwards,
//               then alternates one forward and one backward, then drains.
//               Stores min(p - r, m) activations.
//  interleaved  Megatron's interleaved 1F1B with v virtual stages (chunks) per
//               rank. Microbatches go through in groups of p: for each group,
//               every chunk in turn runs the p microbatches of the group
//               (backwards visit the chunks in reverse). Warm-up is
//               (p - r - 1) * 2 + (v - 1) * p chunk-forwards. Constraint: the
//               number of microbatches must be a multiple of p (otherwise the
//               Megatron order deadlocks); the bubble then is
//               (p-1)/(v*m + p-1) of the step.
//  zb-h1        Zero Bubble H1 (Qi et al., 2023): 1F1B with the backward split
//               into I (input gradient, on the critical path) and W (weight
//               gradient); rank r defers its W by r microbatches, which fills
//               the drain bubbles with W. With F = I = W the bubble is about a
//               third of 1F1B's when m >= p. Every rank stores at most
//               min(p, m) activations: 1F1B's peak (rank 0's), although ranks
//               r > 0 store more than their own 1F1B count.
//  zb-v         ZB-V (Qi et al., section 6): two chunks per rank in a V
//               (rank r holds r and 2p - 1 - r, so the last chunk's loss and
//               the first backward are on rank 0), I and W split; with
//               F = I = W the bubble is near zero and every rank stores at
//               most 2p chunk-activations (1F1B's peak). virtual_stages 2.
//  dualpipe-v   DualPipe-V (DeepSeek): the V placement with each rank's
//               steady state overlapping the forward of one chunk and the
//               backward of the other (OVERLAP_F_B pairs). Bubble
//               (p - 1)(F&B + B - 3W) in chunk costs. virtual_stages 2,
//               microbatches >= 2p.
#ifndef BATON_COORDINATOR_SCHEDULE_BUILDERS_H_
#define BATON_COORDINATOR_SCHEDULE_BUILDERS_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/schedule/ir.h"

namespace baton::schedule {

struct ScheduleSpec {
  std::string kind;  // one of ScheduleKinds()
  int num_ranks = 1;
  int microbatches = 1;
  int virtual_stages = 1;  // > 1 only for "interleaved"; 2 for "zb-v" and "dualpipe-v"
};

// The builder names accepted by BuildSchedule, in documentation order.
const std::vector<std::string>& ScheduleKinds();

// True for the kinds that place chunks in a V ("zb-v", "dualpipe-v").
bool IsVShaped(const std::string& kind);

// The stage-to-rank placement a builder kind uses (Schedule::stage_ranks):
// the V for V-shaped kinds, empty (looped) for the others.
std::vector<int> PlacementOf(const std::string& kind, int num_ranks, int virtual_stages);

// Builds the compute-only schedule. InvalidArgument (with what to change) for
// an unknown kind, sizes below 1, v > 1 on a non-interleaved schedule, or
// microbatches the schedule cannot use.
absl::StatusOr<Schedule> BuildSchedule(const ScheduleSpec& spec);

// Upper bound on activations (microbatch-chunks) stored at once on `rank`
// for a schedule of this kind; the validator enforces it. For an unknown kind
// (an imported schedule) the bound is everything: v * m.
int ActivationBound(const std::string& kind, int num_ranks, int microbatches, int virtual_stages,
                    int rank);

}  // namespace baton::schedule

#endif  // BATON_COORDINATOR_SCHEDULE_BUILDERS_H_
