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
//   RunStep{n+1, commit / discard} the verdict on step n first (-> StepDone),
//                                  then step n+1 (-> GradsReady report); with
//                                  step_done_in_report the StepDone rides in
//                                  that report unless it failed or the
//                                  Commit asks for a snapshot
//   SaveWeights{dir}               DP rank 0 writes its shards -> Saved
//
// Report groups (Plan.report_groups, docs/protocol.md): the rank also joins
// its report group's Gloo communicator (Plan.report_group_columns whole
// pipeline columns, common/report_group.h). The leader (seat 0: pipeline
// rank 0 of the group's first column) passes each RunStep on to its members
// before anything else, runs its step and sends
// the members' reports inside its own; a member takes its RunSteps from the
// leader (a reader thread queues them with the session's commands) and
// gives its report to the leader instead of the coordinator.
//   Abort                          aborts the communicators, drops the job
//                                  (the snapshots below stay)
//
// Recovery (docs/protocol.md): after every fault_tolerance.snapshot_every_steps
// committed steps the worker captures its chunks' state (a ShardState), keeps
// the last kOwnSnapshots of them and sends a copy to the coordinator, which
// relays it to this worker's buddy (HoldSnapshot; the last kHeldSnapshots per
// owner are kept). FetchState{owner, step} answers with one of them. A
// Configure with resume_step R > 0 rebuilds the job and restores every chunk
// from Configure.state (a replacement) or from its own snapshot of step R (a
// survivor), bit for bit.
//
// Commands run on a thread of their own (the session's reader never blocks);
// Abort also acts at once from the reader thread, so a blocked collective is
// released. Step timings feed the worker's Prometheus metrics.
#ifndef BATON_WORKER_WORKER_JOB_H_
#define BATON_WORKER_WORKER_JOB_H_

#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "baton/v1/coordinator.grpc.pb.h"
#include "common/session_fragments.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"
#include "worker/checkpoint/async_writer.h"
#include "worker/comm/communicator.h"
#include "worker/comm/communicator_factory.h"
#include "worker/comm/timed_communicator.h"
#include "worker/executor.h"
#include "worker/stage_model.h"

namespace baton {

class WorkerAgent;

// What WorkerJob needs of the worker's session with the coordinator: the
// WorkerAgent in the daemon, a fake in unit tests (worker_job_test.cc).
class JobSession {
 public:
  virtual ~JobSession() = default;
  // Sends a reply on the open session; false when none is open. Called from
  // the job thread, the session's reader thread and the checkpoint writer.
  virtual bool Send(v1::WorkerMessage message) = 0;
  // The step heartbeats report.
  virtual void SetStep(int64_t step) = 0;
  // Now on the coordinator's clock (trace timestamps).
  virtual int64_t CoordinatorNowMicros() const = 0;
};

class WorkerJob {
 public:
  struct Job;  // the live job: rank, communicators, chunks, executor

  static constexpr int kOwnSnapshots = 3;
  static constexpr int kHeldSnapshots = 2;
  // A shard state larger than this is kept locally but not sent to the buddy:
  // the session carries messages over gRPC's 4 MiB as fragments
  // (common/session_fragments.h) up to kMaxFragmentedMessageBytes (2 GiB - 1,
  // protobuf's own bound), less room for the message around the state.
  static constexpr size_t kMaxSnapshotBytes = static_cast<size_t>(kMaxFragmentedMessageBytes) - (64 << 10);

  struct Options {
    std::string name;                      // this worker's name (as in the plan)
    std::string comm_host = "127.0.0.1";   // address peers reach this worker's Gloo pairs at
    std::string device = "cpu";            // --device
    std::string data_dir;                  // --data_dir: data files only from under it ("" = none)
    std::vector<std::string> output_dirs;  // --output_dir: weights and checkpoints only under these (none = no saves)
    absl::Duration op_timeout = absl::Minutes(5);
    absl::Duration rendezvous_timeout = absl::Minutes(2);
  };

  // `stub` reaches the coordinator (KV rendezvous); `agent` sends the replies.
  WorkerJob(Options options, std::shared_ptr<v1::Coordinator::StubInterface> stub, WorkerAgent* agent,
            prometheus::Registry& metrics);
  // The same with any session (unit tests).
  WorkerJob(Options options, std::shared_ptr<v1::Coordinator::StubInterface> stub,
            std::unique_ptr<JobSession> session, prometheus::Registry& metrics);
  ~WorkerJob();

  // Called on the session's reader thread.
  void Handle(const v1::CoordinatorMessage& message);
  // The session ended: the job's communicators are aborted and the live job
  // dropped; the snapshots stay, so a restarted coordinator can adopt it.
  void SessionLost();
  // What this worker holds (job, generation, rank, restorable steps); empty
  // when nothing. Thread-safe.
  void Describe(v1::HeldJob* held);

 private:

  void Loop();
  void Process(const v1::CoordinatorMessage& message);
  // Report groups (docs/protocol.md). Leader: passes `run` on to every
  // member of its group; gathers their reports of the step into `report`
  // (an error naming the member that did not report). Member: the reader
  // thread's loop, queuing each step from the leader until the group is
  // aborted; gives the step's report to the leader (to the coordinator
  // when that fails).
  absl::Status PassOn(const v1::CoordinatorMessage& run);
  void GatherMembers(v1::StepReport* report);
  void TakeSteps(Job* job);
  void GiveToLeader(v1::WorkerMessage reply);
  // Applies a step's verdict (exactly one of `commit` and `discard` is
  // non-null), a message of its own or RunStep.commit / discard: answers
  // StepDone, then snapshots if the Commit asks for it. With `hold`
  // (RunStep.step_done_in_report) a StepDone that is neither a failure nor
  // a snapshot step's is returned instead, for the step's report.
  std::optional<v1::StepDone> ApplyVerdict(const v1::Commit* commit, const v1::Discard* discard, bool hold);
  absl::Status Configure(const v1::Configure& configure);
  absl::Status Build(const v1::Configure& configure, Job* job);
  void AbortJob(const std::string& reason);
  // Sends `message` on the session, after any snapshot still being sent
  // (AwaitSnapshotSent): nothing overtakes a snapshot.
  void Reply(v1::WorkerMessage message);
  // Sends a snapshot on a thread of its own, so the job loop goes on with
  // the next step while it crosses (docs/protocol.md, "Snapshots"); waits
  // for the one before it first, so at most one is in flight.
  void SendSnapshot(v1::WorkerMessage snapshot);
  // Returns once no snapshot is being sent.
  void AwaitSnapshotSent();
  void RecordMetrics(const v1::StepDone& done, const v1::StepReport& report);
  // The live chunks' state as a serialized ShardState of `step`.
  std::string EncodeShardState(int64_t step);
  // After committed step `step`: capture, keep and send the snapshot.
  void Snapshot(int64_t step);
  // Sets every chunk to the state of step `step` (from `state`, or the own snapshot).
  absl::Status Restore(int64_t step, const std::string& state);
  // Sets every chunk to the state saved in checkpoint `dir` (any layout).
  absl::Status RestoreFromCheckpoint(int64_t step, const std::string& dir);
  // Keeps the live chunks' state as the own snapshot of `step`.
  void KeepOwn(int64_t step);
  void SaveCheckpoint(const v1::SaveWeights& save);
  // Expert parallelism: the expert group of replica 0 (dp ranks < ep)
  // gathers every expert of each chunk, so replica 0 writes what ep = 1
  // would; empty on the other ranks and without ep. `states` holds chunks'
  // whole states (CaptureFullState) and is consumed; a chunk missing there
  // gives CaptureState(), without moments when `weights_only`.
  absl::StatusOr<std::map<int, GatheredExperts>> GatherExpertsToReplicaZero(std::map<int, ChunkState>* states,
                                                                            bool weights_only);
  // Reader thread: keep a buddy copy / answer a FetchState.
  void Hold(const v1::ShardSnapshot& snapshot);
  // Evaluate{step}: train.eval_steps forward-only batches of the eval data;
  // the EvalReport (with the error, if one failed).
  v1::WorkerMessage Evaluate(int64_t step);
  void Fetch(const v1::FetchState& fetch);

  const Options options_;
  std::shared_ptr<v1::Coordinator::StubInterface> stub_;
  const std::unique_ptr<JobSession> session_;

  prometheus::Family<prometheus::Counter>* wall_family_;
  prometheus::Family<prometheus::Counter>* compute_family_;
  prometheus::Family<prometheus::Counter>* comm_family_;
  prometheus::Family<prometheus::Counter>* comm_bytes_family_;
  prometheus::Family<prometheus::Counter>* bubble_family_;
  prometheus::Family<prometheus::Counter>* tokens_family_;
  prometheus::Family<prometheus::Gauge>* loss_family_;
  prometheus::Family<prometheus::Gauge>* step_family_;
  prometheus::Family<prometheus::Counter>* snapshot_bytes_family_;
  prometheus::Family<prometheus::Counter>* snapshot_stall_family_;
  prometheus::Family<prometheus::Counter>* checkpoint_bytes_family_;
  prometheus::Family<prometheus::Counter>* checkpoint_stall_family_;
  prometheus::Family<prometheus::Gauge>* device_memory_family_;
  prometheus::Family<prometheus::Counter>* host_syncs_family_;
  prometheus::Family<prometheus::Counter>* moe_tokens_family_;  // {expert, kind}
  prometheus::Family<prometheus::Gauge>* moe_dropped_family_;
  prometheus::Family<prometheus::Gauge>* moe_aux_loss_family_;
  int64_t host_syncs_seen_ = 0;  // kernels::HostSyncCount() at the last RecordMetrics (worker thread)

  // A command to run on the Loop thread: from the session, or (report
  // groups) a step a member took from its leader for its job `group_job`
  // (Job::id), dropped once that job is gone.
  struct Queued {
    v1::CoordinatorMessage message;
    uint64_t group_job = 0;
  };

  absl::Mutex mu_;
  std::deque<Queued> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Communicators of the live job, so Abort can reach them from any thread.
  std::vector<comm::Communicator*> live_comms_ ABSL_GUARDED_BY(mu_);

  // Snapshots survive Abort and lost sessions (never the process).
  absl::Mutex snap_mu_ ABSL_ACQUIRED_AFTER(mu_);
  std::string own_key_ ABSL_GUARDED_BY(snap_mu_);  // job and shard the own snapshots belong to
  std::map<int64_t, std::string> own_ ABSL_GUARDED_BY(snap_mu_);  // step -> ShardState
  std::map<std::string, std::map<int64_t, std::string>> held_ ABSL_GUARDED_BY(snap_mu_);  // owner -> step -> ShardState
  int64_t generation_ ABSL_GUARDED_BY(snap_mu_) = 0;  // of the live job, for FetchState answers
  std::string held_job_ ABSL_GUARDED_BY(snap_mu_);
  v1::RankAssignment held_rank_ ABSL_GUARDED_BY(snap_mu_);

  // The thread sending the latest snapshot (SendSnapshot), joined by the
  // next reply.
  absl::Mutex send_mu_;
  std::thread snapshot_sender_ ABSL_GUARDED_BY(send_mu_);

  // Periodic checkpoints: copies state synchronously, writes in the background.
  std::unique_ptr<checkpoint::AsyncWriter> writer_;

  std::unique_ptr<Job> job_;  // owned by the Loop thread
  uint64_t next_job_id_ = 1;  // the Loop thread's
  std::thread thread_;
};

}  // namespace baton

#endif  // BATON_WORKER_WORKER_JOB_H_
