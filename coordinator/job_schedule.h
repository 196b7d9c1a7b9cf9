// The pipeline schedule of a job: built from schedule.kind by the builders
// (coordinator/schedule/builders.h), or imported from schedule.csv (a
// PyTorch pipelining CSV, coordinator/schedule/pytorch_csv.h), and where its
// stages live (the placement the planner writes into Plan.stage_ranks and
// the worker reads its chunks from).
#ifndef BATON_COORDINATOR_JOB_SCHEDULE_H_
#define BATON_COORDINATOR_JOB_SCHEDULE_H_

#include <vector>

#include "absl/status/statusor.h"
#include "baton/v1/job.pb.h"
#include "coordinator/schedule/ir.h"
#include "coordinator/schedule/simulator.h"

namespace baton {

// The schedule as given: compute-only from a builder or a compute-only CSV,
// lowered when the CSV has its sends and receives (kind "csv"). The job must
// have passed ValidateJobSpec.
absl::StatusOr<schedule::Schedule> GivenScheduleOf(const v1::JobSpec& job);

// The programs the workers run: the given schedule lowered with `costs`
// (or as given when it is lowered already), validated.
absl::StatusOr<schedule::Schedule> LoweredScheduleOf(const v1::JobSpec& job, const schedule::CostModel& costs);

// The job's placement (Schedule::stage_ranks): empty for looped schedules.
absl::StatusOr<std::vector<int>> PlacementOfJob(const v1::JobSpec& job);

}  // namespace baton

#endif  // BATON_COORDINATOR_JOB_SCHEDULE_H_
