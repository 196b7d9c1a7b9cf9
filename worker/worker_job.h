// WorkerJob: the worker's part of a training job, driven by the commands the
// coordinator pushes on the session.
//
//   Configure{plan, program, job}  find this worker's (pp, tp, dp) rank, build
//                                  its model chunk(s), data source and the
//                                  TP / pipeline / DP / tied-embedding
//                                  communicators (rendezvous through the
//                                  coordinator KV at the plan's generation)
//                                  -> Configured
//   RunStep{n}                     StepExecutor::RunStep -> GradsReady report
//   Commit{n, clip} / Discard{n}   optimizer step or drop -> StepDone
//   SaveWeights{dir}               DP rank 0 writes its shards -> Saved
//   Abort                          aborts the communicators, drops the job
//
// Commands run on a thread of their own (the session's reader never blocks);
// Abort also acts at once from the reader thread, so a blocked collective is
// released. Step timings feed the worker's Prometheus metrics.
#ifndef BATON_WORKER_WORKER_JOB_H_
#define BATON_WORKER_WORKER_JOB_H_

#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "baton/v1/coordinator.grpc.pb.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"
#include "worker/comm/communicator.h"
#include "worker/comm/timed_communicator.h"
#include "worker/executor.h"
#include "worker/stage_model.h"

namespace baton {

class WorkerAgent;

class WorkerJob {
 public:
  struct Job;  // the live job: rank, communicators, chunks, executor

  struct Options {
    std::string name;                      // this worker's name (as in the plan)
    std::string comm_host = "127.0.0.1";   // address peers reach this worker's Gloo pairs at
    std::string device = "cpu";            // --device
    absl::Duration op_timeout = absl::Minutes(5);
    absl::Duration rendezvous_timeout = absl::Minutes(2);
  };

  // `stub` reaches the coordinator (KV rendezvous); `agent` sends the replies.
  WorkerJob(Options options, std::shared_ptr<v1::Coordinator::StubInterface> stub, WorkerAgent* agent,
            prometheus::Registry& metrics);
  ~WorkerJob();

  // Called on the session's reader thread.
  void Handle(const v1::CoordinatorMessage& message);
  // The session ended: the job (if any) cannot go on.
  void SessionLost();

 private:

  void Loop();
  void Process(const v1::CoordinatorMessage& message);
  absl::Status Configure(const v1::Configure& configure);
  absl::Status Build(const v1::Configure& configure, Job* job);
  void AbortJob(const std::string& reason);
  void Reply(v1::WorkerMessage message);
  void RecordMetrics(const v1::StepDone& done, const v1::StepReport& report);

  const Options options_;
  std::shared_ptr<v1::Coordinator::StubInterface> stub_;
  WorkerAgent* const agent_;

  prometheus::Family<prometheus::Counter>* wall_family_;
  prometheus::Family<prometheus::Counter>* compute_family_;
  prometheus::Family<prometheus::Counter>* comm_family_;
  prometheus::Family<prometheus::Counter>* bubble_family_;
  prometheus::Family<prometheus::Counter>* tokens_family_;
  prometheus::Family<prometheus::Gauge>* loss_family_;
  prometheus::Family<prometheus::Gauge>* step_family_;

  absl::Mutex mu_;
  std::deque<v1::CoordinatorMessage> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Communicators of the live job, so Abort can reach them from any thread.
  std::vector<comm::Communicator*> live_comms_ ABSL_GUARDED_BY(mu_);

  std::unique_ptr<Job> job_;  // owned by the Loop thread
  std::thread thread_;
};

}  // namespace baton

#endif  // BATON_WORKER_WORKER_JOB_H_
