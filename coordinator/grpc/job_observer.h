// JobObserver: what the coordinator's gRPC service tells the job it runs
// (JobRunner) and asks of it. Kept apart from the service so the job driver
// does not depend on the adapter.
#ifndef BATON_COORDINATOR_GRPC_JOB_OBSERVER_H_
#define BATON_COORDINATOR_GRPC_JOB_OBSERVER_H_

#include <string>

#include "absl/time/time.h"
#include "baton/v1/coordinator.pb.h"

namespace baton {

class JobObserver {
 public:
  virtual ~JobObserver() = default;
  // A message from `worker` on its session (not heartbeats or goodbyes).
  // Takes the message (the service moves its read buffer in).
  virtual void OnWorkerMessage(const std::string& worker, v1::WorkerMessage message) = 0;
  // `worker`'s session ended or its lease expired; `hung` when the lease
  // expired (the process may still exist but stopped answering).
  virtual void OnWorkerLost(const std::string& worker, const std::string& why, bool hung = false) = 0;
  virtual void FillStatus(v1::GetStatusResponse* status) const = 0;
  // Chrome trace of `steps` steps; while the job runs, traces the next ones
  // (waiting up to `wait` for them).
  virtual std::string TraceJson(int steps, absl::Duration wait) = 0;
};

}  // namespace baton

#endif  // BATON_COORDINATOR_GRPC_JOB_OBSERVER_H_
