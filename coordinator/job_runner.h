// JobRunner: runs one training job on the registered workers.
//
//   waiting      until pp*tp*dp workers are READY (after --ready_timeout the
//                shortfall is reported as the job error, and waiting goes on)
//   configuring  plan (planner.h), schedule built, lowered and validated
//                (coordinator/schedule), Configure{plan, program, job} to
//                every assigned worker, which rendezvous through the KV
//   running      per step: RunStep(n) -> GradsReady from every worker ->
//                global grad norm, clip factor, finite check -> Commit(n, clip)
//                or Discard(n) -> StepDone (timings) from every worker
//   saving       SaveWeights(out/final) and the manifest (with --out)
//   done | failed
//
// A worker of the plan that is lost, or reports an error, fails the job at
// once (the rest get Abort) with a message naming its stage; recovery is a
// later issue. Thread-safe: a thread of its own drives the job; worker
// messages arrive from gRPC threads; commands go out through the registry's
// sessions, never under this class's lock.
#ifndef BATON_COORDINATOR_JOB_RUNNER_H_
#define BATON_COORDINATOR_JOB_RUNNER_H_

#include <deque>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "baton/v1/coordinator.pb.h"
#include "baton/v1/job.pb.h"
#include "baton/v1/plan.pb.h"
#include "coordinator/fan_out.h"
#include "coordinator/grpc/coordinator_service.h"
#include "coordinator/kv_store.h"
#include "coordinator/worker_registry.h"
#include "prometheus/registry.h"

namespace baton {

class JobRunner : public JobObserver {
 public:
  struct Options {
    std::string out_dir;  // summary.json, steps.jsonl, trace.json, final/ ("" = none)
    absl::Duration ready_timeout = absl::Seconds(60);
    absl::Duration configure_timeout = absl::Minutes(3);
    absl::Duration step_timeout = absl::Minutes(30);
    int traced_steps = 3;  // the last N steps are traced (and kept for GetTrace)
    int max_kept_traces = 16;
  };

  JobRunner(v1::JobSpec job, WorkerRegistry* registry, KvStore* kv, Options options,
            prometheus::Registry& metrics);
  ~JobRunner();

  void Start();
  // Stops the job thread (the job is marked failed if it had not finished).
  void Stop();

  void OnWorkerMessage(const std::string& worker, const v1::WorkerMessage& message) override;
  void OnWorkerLost(const std::string& worker, const std::string& why) override;
  void FillStatus(v1::GetStatusResponse* status) const override;
  // Chrome trace of the last `steps` traced steps (all workers). While the
  // job runs, the next `steps` steps are traced and waited for (up to `wait`).
  std::string TraceJson(int steps, absl::Duration wait) override;

 private:
  struct StepRecord {
    int64_t step = 0;
    bool committed = false;
    double loss = 0, accuracy = 0, grad_norm = 0, clip = 1;
    double wall = 0, tokens_per_second = 0, bubble_ratio = 0, comm_ratio = 0;
  };

  void Run();
  absl::Status RunJob();
  absl::Status WaitForWorkers(std::vector<v1::WorkerInfo>* ready);
  absl::Status Configure(const std::vector<v1::WorkerInfo>& ready);
  absl::Status RunStep(int64_t step);
  absl::Status Save();
  void Fail(const absl::Status& why);
  void SendAll(const v1::CoordinatorMessage& message);
  // Waits until every assigned worker has put a message in `inbox` (or the
  // job failed / timed out); returns the messages by worker name.
  absl::StatusOr<std::map<std::string, v1::WorkerMessage>> Collect(
      std::map<std::string, v1::WorkerMessage>* inbox, absl::Duration timeout, const char* what)
      ABSL_LOCKS_EXCLUDED(mu_);
  std::string StageOf(const std::string& worker) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status WriteOutputs() ABSL_LOCKS_EXCLUDED(mu_);

  const v1::JobSpec job_;
  WorkerRegistry* const registry_;
  KvStore* const kv_;
  const Options options_;

  prometheus::Gauge* expected_bubble_metric_;
  prometheus::Gauge* step_metric_;
  prometheus::Gauge* loss_metric_;
  prometheus::Counter* discarded_metric_;

  mutable absl::Mutex mu_;
  std::string state_ ABSL_GUARDED_BY(mu_) = "waiting";
  absl::Status error_ ABSL_GUARDED_BY(mu_);  // why the job is failing / cannot start
  bool failed_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  v1::Plan plan_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, v1::RankAssignment> assigned_ ABSL_GUARDED_BY(mu_);  // by worker name
  double expected_bubble_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, v1::WorkerMessage> configured_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, v1::WorkerMessage> reports_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, v1::WorkerMessage> done_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, v1::WorkerMessage> saved_ ABSL_GUARDED_BY(mu_);
  std::vector<StepRecord> steps_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::StageStatus> stage_status_ ABSL_GUARDED_BY(mu_);
  // Traced steps: per step, per worker, its events.
  std::deque<std::pair<int64_t, std::map<std::string, v1::StepDone>>> traces_ ABSL_GUARDED_BY(mu_);
  int trace_requested_ ABSL_GUARDED_BY(mu_) = 0;  // steps still to trace for GetTrace
  double total_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  double total_wall_ ABSL_GUARDED_BY(mu_) = 0;
  double sum_bubble_ ABSL_GUARDED_BY(mu_) = 0, sum_comm_ ABSL_GUARDED_BY(mu_) = 0,
         sum_worker_wall_ ABSL_GUARDED_BY(mu_) = 0;

  // Sends a command to every worker at once (see fan_out.h).
  FanOut fan_out_{16};
  std::thread thread_;
};

}  // namespace baton

#endif  // BATON_COORDINATOR_JOB_RUNNER_H_
