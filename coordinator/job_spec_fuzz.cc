// Fuzzes the job spec parser (textproto and JSON) and validator: any bytes
// must give a JobSpec or a clear error, and a valid spec must plan, estimate
// its memory and partition its layers within bounded memory and time.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "coordinator/job_spec.h"
#include "coordinator/memory_estimate.h"
#include "coordinator/planner.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<baton::v1::JobSpec> job = baton::ParseJobSpec(text, "fuzz");
  if (!job.ok() || !baton::ValidateJobSpec(*job).ok()) return 0;
  const baton::ParallelDims d = baton::DimsOf(*job);
  std::vector<baton::v1::WorkerInfo> workers(d.world_size());
  for (int i = 0; i < d.world_size(); ++i) {
    workers[i].set_name("w" + std::to_string(i));
    workers[i].set_host("h" + std::to_string(i % 3));
    workers[i].set_worker_id(i + 1);
    workers[i].set_memory_bytes(int64_t{1} << (20 + i % 20));
  }
  absl::StatusOr<baton::v1::Plan> plan = baton::MakePlan(*job, workers, 1);
  if (plan.ok()) {
    for (int p = 0; p < d.pp; ++p) baton::EstimateWorkerMemory(*job, *plan, p);
  }
  return 0;
}
