#include "coordinator/job_schedule.h"

#include "common/status_macros.h"
#include "coordinator/job_spec.h"
#include "coordinator/schedule/builders.h"
#include "coordinator/schedule/lowering.h"
#include "coordinator/schedule/pytorch_csv.h"
#include "coordinator/schedule/validator.h"

namespace baton {

absl::StatusOr<schedule::Schedule> GivenScheduleOf(const v1::JobSpec& job) {
  const ParallelDims d = DimsOf(job);
  if (job.schedule().kind() == "csv") {
    BATON_ASSIGN_OR_RETURN(const schedule::CsvNaming naming, schedule::ParseCsvNaming(job.schedule().csv_naming()));
    absl::StatusOr<schedule::Schedule> s = schedule::FromPytorchCsv(job.schedule().csv(), naming);
    if (!s.ok()) return WithContext(s.status(), "schedule.csv");
    s->kind = "csv";
    return s;
  }
  return schedule::BuildSchedule(
      schedule::ScheduleSpec{job.schedule().kind(), d.pp, job.schedule().microbatches(), d.virtual_stages});
}

absl::StatusOr<schedule::Schedule> LoweredScheduleOf(const v1::JobSpec& job, const schedule::CostModel& costs) {
  BATON_ASSIGN_OR_RETURN(schedule::Schedule given, GivenScheduleOf(job));
  schedule::Schedule lowered;
  if (schedule::HasCommunication(given)) {
    lowered = std::move(given);
  } else {
    BATON_ASSIGN_OR_RETURN(lowered, schedule::Lower(given, costs));
  }
  BATON_RETURN_IF_ERROR_CTX(schedule::Validate(lowered), "the schedule failed validation");
  return lowered;
}

absl::StatusOr<std::vector<int>> PlacementOfJob(const v1::JobSpec& job) {
  if (job.schedule().kind() != "csv") {
    const ParallelDims d = DimsOf(job);
    return schedule::PlacementOf(job.schedule().kind(), d.pp, d.virtual_stages);
  }
  BATON_ASSIGN_OR_RETURN(const schedule::Schedule given, GivenScheduleOf(job));
  return given.stage_ranks;
}

}  // namespace baton
