// JobRunner: drives one training job on the registered workers, as an
// explicit state machine (coordinator/job_state.h). Each state is one small
// transition function that returns the next state:
//
//   waiting      until pp*tp*dp workers are READY (after --ready_timeout the
//                shortfall is reported as the job error, and waiting goes on)
//                -> configuring
//   configuring  plan (planner.h), schedule built, lowered and validated
//                (coordinator/schedule), Configure{plan, program, job,
//                resume_step, state} to every assigned worker, which
//                rendezvous through the KV at the plan's generation
//                -> running, or recovering on a fault
//   running      one step: RunStep(n) -> GradsReady from every worker ->
//                global grad norm, clip factor, finite check -> Commit(n, clip)
//                or Discard(n) -> StepDone from every worker (in report
//                groups, docs/protocol.md: RunStep to each pipeline column's
//                leader, whose report carries its members')
//                -> running (next step), saving when a periodic checkpoint
//                is due or after the last step, done, or recovering on a fault
//   recovering   (docs/protocol.md "Recovery") a worker of the plan was lost
//                or reported an error: survivors get Abort (their processes
//                and in-memory snapshots stay), a replacement is found (a
//                spare READY worker, or the lost name registering again,
//                waited for up to fault_tolerance.replacement_timeout_s),
//                the recovery step R is chosen (the newest step whose state
//                exists for every shard), the lost shard's state is fetched
//                from a DP replica or the buddy holding its snapshot (with
//                parallel.zero_stage >= 1 from the buddy only: DP ranks
//                hold different optimizer shards; with parallel.ep > 1
//                only a replica with the same expert slot, dp % ep)
//                -> configuring (new generation, resume at R; steps after R
//                are replayed), or failed
//   saving       a periodic checkpoint (checkpoint.every_steps): from the
//                SaveWeights request until every worker copied its state to
//                host memory (Saved{copied}); the files are written in the
//                background while training goes on -> running.
//                After the last step (with --out): SaveWeights(out/final),
//                a complete (v2) checkpoint, and its manifest -> done
//   done | failed
//
// The first cause wins: a job error names the worker that was lost (or, when
// none was, failed) first, with its stage, not a peer's consequential error.
//
// Thread-safe: a thread of its own drives the job; worker messages arrive
// from gRPC threads; commands go out through JobWorkers, never under this
// class's lock. Time comes from the injected Clock (waits poll it), so the
// transitions are unit-tested against fake workers and a fake clock.
#ifndef BATON_COORDINATOR_JOB_RUNNER_H_
#define BATON_COORDINATOR_JOB_RUNNER_H_

#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "baton/v1/coordinator.pb.h"
#include "baton/v1/job.pb.h"
#include "baton/v1/plan.pb.h"
#include "baton/v1/program.pb.h"
#include "common/clock.h"
#include "common/report_group.h"
#include "coordinator/grpc/job_observer.h"
#include "coordinator/job_state.h"
#include "coordinator/kv_store.h"
#include "coordinator/worker_registry.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace baton {

// The worker-facing side of the job driver: the registry and KV in the
// coordinator, fakes in unit tests.
class JobWorkers {
 public:
  virtual ~JobWorkers() = default;
  // Every registered worker (state, incarnation, host).
  virtual std::vector<v1::WorkerInfo> List() const = 0;
  // Pushes `message` to `worker`'s session; false when it has none. Never
  // blocks (the session queues it).
  virtual bool Send(const std::string& worker, const v1::CoordinatorMessage& message) = 0;
  // Send to each of `workers`; the registry's looks their sessions up under
  // one lock.
  virtual void SendEach(const std::vector<std::string>& workers, const v1::CoordinatorMessage& message) {
    for (const std::string& w : workers) Send(w, message);
  }
  // Starts the next generation of the job's world (rendezvous scope) and returns it.
  virtual int64_t NextGeneration() = 0;
  // Starts a generation above `floor` (adopting workers of generation
  // `floor` after a coordinator restart) and returns it. This default steps
  // NextGeneration up to it (fakes); the registry's jumps there at once, as
  // `floor` comes from the workers.
  virtual int64_t GenerationAbove(int64_t floor) {
    int64_t generation = NextGeneration();
    while (generation <= floor) generation = NextGeneration();
    return generation;
  }
};

std::unique_ptr<JobWorkers> MakeRegistryJobWorkers(WorkerRegistry* registry, KvStore* kv, std::string job);

// Defaults of JobSpec.fault_tolerance.
struct FaultTolerance {
  int max_restarts = 10;
  absl::Duration replacement_timeout = absl::Seconds(60);
  std::optional<int> snapshot_every_steps;  // unset: SnapshotDue's adaptive rule
};
FaultTolerance FaultToleranceOf(const v1::JobSpec& job);

// The share of the step time a worker's snapshot may stall it, with
// snapshot_every_steps unset.
inline constexpr double kMaxSnapshotOverhead = 0.05;

// Whether committed step `step` is snapshotted (Commit.snapshot), every
// worker the same. With `every` set: every `every`-th step (0: never).
// Unset: the first step after `last` == 0 (none yet: it measures the cost),
// then every k-th step after `last`, k = ceil(stall / (kMaxSnapshotOverhead
// * step)) >= 1, where `stall` is the longest capture of the last snapshot
// (ShardSnapshot.capture_seconds) and `step` a step's wall time: a snapshot
// that costs well under 5% of a step is taken every step (every CPU test
// model), a large model on GPUs whose state takes longer to copy than a step
// is snapshotted every few seconds instead of slowing every step.
bool SnapshotDue(std::optional<int> every, int64_t step, int64_t last, double stall_seconds, double step_seconds);

// Checks that `plan` is one whole mesh: pp*tp*cp*dp ranks (Plan.cp 0 means
// 1), each with its pp, tp, cp and dp rank inside the mesh and no two on the
// same coordinates. INVALID_ARGUMENT naming the first rank that is not.
absl::Status ValidatePlanMesh(const v1::Plan& plan);

// How many pipeline columns make one report group for `plan`'s job
// (Plan.report_group_columns, common/report_group.h), 0 when it runs without
// groups: every rank registered report_groups and verdict_in_run_step and
// the plan has at least `min_ranks` ranks. Groups are single columns unless
// every rank registered report_group_columns; then about `group_ranks`
// ranks each (whole columns). A group must have two ranks or more. Always 0
// with cp > 1: the seats (ReportGroupSeatOf, which the workers share) are
// laid over the (pp, tp, dp) mesh only.
int ReportGroupColumns(const v1::Plan& plan, int min_ranks, int group_ranks);
// The report groups of `plan` (Plan.report_group_columns columns each):
// each group's leader -> its members' names by seat 1 .. size-1.
// INVALID_ARGUMENT when a rank is outside the mesh, held twice or missing,
// or when the plan has cp > 1 (no report groups then).
absl::StatusOr<std::map<std::string, std::vector<std::string>>> ReportGroupsOf(const v1::Plan& plan);

class JobRunner : public JobObserver {
 public:
  struct Options {
    std::string out_dir;  // summary.json, steps.jsonl, trace.json, final/ ("" = none)
    absl::Duration ready_timeout = absl::Seconds(60);
    absl::Duration configure_timeout = absl::Minutes(3);
    absl::Duration step_timeout = absl::Minutes(30);
    // After the first fault, how long to gather others before deciding who is
    // lost (a killed worker's peers report connection errors at about the
    // time its session breaks).
    absl::Duration settle = absl::Milliseconds(500);
    // Fetching a lost shard's state from its source.
    absl::Duration fetch_timeout = absl::Seconds(60);
    // Waits re-check the clock this often.
    absl::Duration poll = absl::Milliseconds(10);
    // How long waiting holds on for the rest of the workers once some report
    // holding this job (a coordinator restart), before starting it over.
    absl::Duration adopt_grace = absl::Seconds(15);
    // --resume: a checkpoint directory (or a checkpoint.dir root: its newest
    // complete step-<n>), validated before any worker starts training.
    std::string resume_dir;
    int traced_steps = 3;  // the last N steps are traced (and kept for GetTrace)
    // Report groups (Plan.report_groups) from this many ranks up, where every
    // rank registered them, of about this many ranks each (whole pipeline
    // columns; where every rank registered report_group_columns, else one
    // column each).
    int report_groups_min_ranks = 64;
    int report_group_ranks = kDefaultReportGroupRanks;
    int max_kept_traces = 16;
  };

  JobRunner(v1::JobSpec job, JobWorkers* workers, Clock* clock, Options options, prometheus::Registry& metrics);
  // Production: the registry and KV, the real clock.
  JobRunner(v1::JobSpec job, WorkerRegistry* registry, KvStore* kv, Options options,
            prometheus::Registry& metrics);
  ~JobRunner();

  void Start();
  // Stops the job thread (the job is marked failed if it had not finished).
  void Stop();

  void OnWorkerMessage(const std::string& worker, v1::WorkerMessage message) override;
  void OnWorkerLost(const std::string& worker, const std::string& why, bool hung = false) override;
  void FillStatus(v1::GetStatusResponse* status) const override;
  // Chrome trace of the last `steps` traced steps (all workers), plus a span
  // per recent recovery (process "coordinator", thread "recovery": cause,
  // lost worker and stage, source of the state, step R, replayed steps,
  // from the fault to the first step completed after it). While the job
  // runs, the next `steps` steps are traced and waited for (up to `wait`).
  std::string TraceJson(int steps, absl::Duration wait) override;

  JobState state() const;
  absl::Status error() const;

 private:
  // Worker names looked up per message (hashed: at thousands of workers a
  // tree's string compares were a tenth of the coordinator's step CPU).
  using WorkerSet = absl::flat_hash_set<std::string>;
  struct StepRecord {
    int64_t step = 0;
    bool committed = false;
    double loss = 0, accuracy = 0, grad_norm = 0, clip = 1;
    double wall = 0, tokens_per_second = 0, bubble_ratio = 0, comm_ratio = 0;
    int64_t epoch = 0;  // the data epoch the step's batch starts in (StepReport.epoch)
  };
  struct Fault {
    std::string worker;
    FaultCause cause = FaultCause::kWorkerLost;
    std::string why;
    absl::StatusCode code = absl::StatusCode::kUnavailable;
    int64_t generation = 0;
  };
  // What the next `configuring` sends.
  struct Setup {
    v1::Plan plan;
    int64_t resume_step = 0;
    std::map<std::string, std::string> state;  // worker -> ShardState bytes (replacements)
    std::string checkpoint_dir;                 // restore resume_step from this checkpoint instead
  };
  // A periodic checkpoint being written (SaveWeights{with_state}).
  struct PendingCheckpoint {
    int64_t step = 0;
    std::string dir;
    std::set<std::string> waiting;  // workers that have not reported Saved{files}
    std::set<std::string> copying;  // workers that have not copied their state to host memory
    std::vector<std::string> files;
  };
  // What a worker's own snapshots and its buddy copies cover (mirrors the
  // workers' bounded stores: kOwnSnapshots / kHeldSnapshots).
  static constexpr int kOwnSnapshots = 3;
  static constexpr int kHeldSnapshots = 2;

  void Run();
  // The transitions: each does one state's work and returns the next state.
  absl::StatusOr<JobState> Waiting();
  // Waiting found workers holding this job (a restarted coordinator): take
  // their plan and continue from the newest step every shard holds.
  absl::StatusOr<JobState> Adopt(const std::vector<v1::WorkerInfo>& ready,
                                 const std::map<std::vector<int>, v1::WorkerInfo>& slots, int64_t generation);
  // Restores steps_ from an earlier life's steps.jsonl (rewritten without a torn last line).
  void LoadSteps();
  absl::StatusOr<JobState> Configuring();
  absl::StatusOr<JobState> Running();
  absl::StatusOr<JobState> Recovering();
  absl::StatusOr<JobState> Saving();
  // Saving for a periodic checkpoint: until every worker copied its state.
  absl::StatusOr<JobState> SavingCheckpoint(int64_t step);
  void Transition(JobState to);
  void Fail(const absl::Status& why);

  // Step pieces.
  // The global gradient norm: the reports' grad_sq_norm over DP rank 0, or
  // over every rank with ZeRO stage >= 1 (each DP rank's own shard), or
  // with ep > 1 over DP ranks 0 .. ep - 1 (rank 0 the dense parameters,
  // each its own experts).
  double Aggregate(const std::map<std::string, v1::WorkerMessage>& reports, double* loss, int64_t* correct,
                   int64_t* predicted, bool* finite);
  void RecordStep(int64_t step, bool committed, bool traced, double loss, double accuracy, double norm,
                  double clip, double wall, int64_t epoch, const std::map<std::string, v1::WorkerMessage>& done);

  // Recovery pieces.
  // A fault of `worker`'s own (it reported an error, or broke the protocol):
  // "<stage> (worker <name>) <why>".
  void AddWorkerError(const std::string& worker, const std::string& why, absl::StatusCode code)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status FaultsToStatus() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const Fault* FirstCause() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Plan workers that lost their process (not READY, or a new incarnation).
  std::set<std::string> LostWorkers(const std::vector<v1::WorkerInfo>& list) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Newest step every survivor holds and every lost slot can be sourced at
  // (a DP replica's own snapshot, except under ZeRO, or the buddy's copy of
  // the lost worker's); fills `sources` (lost worker -> {source worker,
  // owner to fetch}).
  int64_t ChooseResumeStep(const std::set<std::string>& lost,
                           std::map<std::string, std::pair<std::string, std::string>>* sources)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::map<std::string, std::string> Buddies(const v1::Plan& plan) const;

  // Messaging.
  // One message from `worker`; a snapshot to relay fills `relay_to`, `relay`.
  void Handle(const std::string& worker, v1::WorkerMessage message, std::string* relay_to,
              v1::CoordinatorMessage* relay) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A report: the previous step's StepDone held in it
  // (RunStep.step_done_in_report) is handled first, as the message it stands
  // for, then the report.
  void HandleReport(const std::string& worker, v1::WorkerMessage message, std::string* relay_to,
                    v1::CoordinatorMessage* relay) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A leader's report (report groups): its members' reports are handled as
  // theirs, then its own. A report that breaks the group's rules (members
  // from a non-leader, a count other than the column's without an error) is
  // the sender's fault.
  void HandleGroupReport(const std::string& worker, v1::WorkerMessage message, std::string* relay_to,
                         v1::CoordinatorMessage* relay) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SendAll(const v1::CoordinatorMessage& message);
  // RunStep: to every worker, or under report groups to the leaders, which
  // pass it on.
  void SendRunStep(const v1::CoordinatorMessage& message);
  // Starts collecting `what` (a WorkerMessage body case) for `step` from
  // `from`. Forgets a step sent ahead (ahead_): a recovery or a save comes
  // between.
  void Expect(v1::WorkerMessage::BodyCase what, int64_t step, std::shared_ptr<const WorkerSet> from)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until every expected worker answered (or a fault, stop, timeout).
  // ABORTED when a fault arrived (see faults_) — unless `complete_wins` and
  // every expected answer is in without an error of its own: then the
  // answers are returned and the fault (of a step sent ahead) is left for
  // the next Collect.
  absl::StatusOr<std::map<std::string, v1::WorkerMessage>> Collect(absl::Duration timeout, const char* what,
                                                                   bool complete_wins = false)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Sends `verdict` on the previous step and RunStep of `step` right behind
  // it, while the previous step's StepDone are still being collected, and
  // collects the step's GradsReady aside (ahead_) until Running takes them
  // over. Workers that registered verdict_in_run_step get one message, the
  // RunStep carrying the verdict (and allowing its StepDone inside the
  // step's report); the others get two. Returns when the RunSteps were sent
  // (the step's start).
  absl::Time SendAhead(const v1::CoordinatorMessage& verdict, int64_t step, std::shared_ptr<const WorkerSet> names)
      ABSL_LOCKS_EXCLUDED(mu_);
  // RunStep of `step` with its trace flag (consumes one requested trace).
  v1::CoordinatorMessage RunStepMessage(int64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits until `cond` holds (true) or the clock passes `deadline` (false).
  bool WaitUntil(const std::function<bool()>& cond, absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string StageOf(const std::string& worker) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string SlotOf(const std::string& worker) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string Who(const std::string& worker) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status WriteOutputs() ABSL_LOCKS_EXCLUDED(mu_);
  void AppendStepsLine(const std::string& line);
  // Periodic checkpoints: whether one is due after committed step `step`;
  // start one (false: one is still being written, or saved already);
  // write the manifest (and prune) once every worker reported its files.
  bool CheckpointDue(int64_t step) const;
  // train.eval_every_steps: after step `step` (every N-th, and the last).
  bool EvalDue(int64_t step) const;
  // Sends Evaluate{step} to every worker of `names` and records the held-out
  // loss from their EvalReports. ABORTED where a worker failed (recover).
  absl::Status Evaluate(int64_t step, std::shared_ptr<const WorkerSet> names);
  bool MaybeStartCheckpoint(int64_t step);
  absl::Status FinishCheckpoint();

  const v1::JobSpec job_;
  const FaultTolerance ft_;
  std::unique_ptr<JobWorkers> owned_workers_;
  JobWorkers* workers_;  // owned_workers_ or the caller's
  Clock* const clock_;
  const Options options_;

  std::map<JobState, prometheus::Gauge*> state_metric_;
  prometheus::Family<prometheus::Gauge>* expected_bubble_family_;
  prometheus::Gauge* step_metric_;
  prometheus::Gauge* loss_metric_;
  prometheus::Counter* discarded_metric_;
  std::map<FaultCause, prometheus::Counter*> recoveries_metric_;
  prometheus::Histogram* recovery_seconds_metric_;
  prometheus::Counter* replayed_metric_;
  prometheus::Gauge* eval_loss_metric_;
  prometheus::Gauge* eval_perplexity_metric_;

  mutable absl::Mutex mu_;
  JobState state_ ABSL_GUARDED_BY(mu_) = JobState::kWaiting;
  absl::Status error_ ABSL_GUARDED_BY(mu_);  // why the job is failing / cannot start
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;

  // The live world.
  Setup setup_ ABSL_GUARDED_BY(mu_);  // next configuring
  v1::Plan plan_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::Program> programs_ ABSL_GUARDED_BY(mu_);  // by pp rank
  std::map<std::string, v1::RankAssignment> assigned_ ABSL_GUARDED_BY(mu_);  // by worker name
  // assigned_'s names; a new set with every configuring (steps sent ahead
  // to an earlier world are told apart by it).
  std::shared_ptr<const WorkerSet> plan_workers_ ABSL_GUARDED_BY(mu_) = std::make_shared<const WorkerSet>();
  std::map<std::string, int64_t> incarnation_ ABSL_GUARDED_BY(mu_);         // at configure time
  std::map<std::string, std::string> buddy_ ABSL_GUARDED_BY(mu_);           // worker -> holder of its snapshots
  // Report groups of the live world (empty when the plan has none): leader
  // -> members by pp rank 1 .. pp-1.
  std::map<std::string, std::vector<std::string>> groups_ ABSL_GUARDED_BY(mu_);
  int64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  double expected_bubble_ ABSL_GUARDED_BY(mu_) = 0;

  // What the transition in progress waits for.
  v1::WorkerMessage::BodyCase expect_case_ ABSL_GUARDED_BY(mu_) = v1::WorkerMessage::BODY_NOT_SET;
  int64_t expect_step_ ABSL_GUARDED_BY(mu_) = 0;
  std::shared_ptr<const WorkerSet> expect_from_ ABSL_GUARDED_BY(mu_) = std::make_shared<const WorkerSet>();
  std::map<std::string, v1::WorkerMessage> inbox_ ABSL_GUARDED_BY(mu_);
  // A step whose RunStep went out before the previous step's StepDone were
  // all in (docs/protocol.md "Steps overlap their commit"): its GradsReady
  // gather here until Running collects them.
  struct Ahead {
    int64_t step = 0;
    bool trace = false;
    absl::Time sent;
    std::shared_ptr<const WorkerSet> from;
    std::map<std::string, v1::WorkerMessage> inbox;
  };
  std::optional<Ahead> ahead_ ABSL_GUARDED_BY(mu_);
  std::vector<Fault> faults_ ABSL_GUARDED_BY(mu_);  // since the last recovery, in arrival order

  // Progress.
  int64_t next_step_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t committed_ ABSL_GUARDED_BY(mu_) = 0;  // newest step every worker finished
  int64_t recorded_ ABSL_GUARDED_BY(mu_) = 0;   // newest step in steps_ / steps.jsonl
  std::map<std::string, std::deque<int64_t>> own_snapshots_ ABSL_GUARDED_BY(mu_);   // worker -> steps
  // SnapshotDue's inputs: the newest step every worker was asked to
  // snapshot (or holds, after configuring), the longest capture of the
  // newest snapshot reported, and a step's wall time (moving average).
  int64_t last_snapshot_step_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t stall_step_ ABSL_GUARDED_BY(mu_) = 0;
  double snapshot_stall_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  double step_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  // Buddy copies by shard slot ("pp.tp.dp"): which worker holds them, under
  // which owner name (the slot's worker when it was sent), and their steps.
  struct Held {
    std::string holder, owner;
    std::deque<int64_t> steps;
  };
  std::map<std::string, Held> held_snapshots_ ABSL_GUARDED_BY(mu_);

  // Checkpoints.
  std::optional<PendingCheckpoint> pending_checkpoint_ ABSL_GUARDED_BY(mu_);
  int64_t checkpoint_due_ ABSL_GUARDED_BY(mu_) = 0;  // Running -> Saving: the step to checkpoint
  int64_t checkpoint_step_ ABSL_GUARDED_BY(mu_) = 0;  // newest complete checkpoint
  std::string checkpoint_dir_ ABSL_GUARDED_BY(mu_);
  std::string resume_checkpoint_ ABSL_GUARDED_BY(mu_);  // --resume, resolved and validated

  // Recovery bookkeeping.
  int restarts_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t replayed_ ABSL_GUARDED_BY(mu_) = 0;
  // The last evaluation: the step whose weights it used (0: none yet).
  int64_t eval_step_ ABSL_GUARDED_BY(mu_) = 0;
  double eval_loss_ ABSL_GUARDED_BY(mu_) = 0;
  // The step of an evaluation sent but not recorded (a recovery came
  // between): run again once the workers hold that step (0: none).
  int64_t eval_pending_ ABSL_GUARDED_BY(mu_) = 0;
  std::string recovery_ ABSL_GUARDED_BY(mu_);  // what the last recovery did (GetStatus)
  std::optional<absl::Time> recovery_started_ ABSL_GUARDED_BY(mu_);
  // Recoveries as the trace shows them (the last kKeptRecoveryMarks).
  struct RecoveryMark {
    int number = 0;
    std::string cause, worker, stage, source, error, detail;
    int64_t resume_step = 0, replayed_steps = 0, generation = 0;
    absl::Time started;
    std::optional<absl::Time> ended;  // first step completed after it
    std::string outcome;              // "" while open: "recovered" / "superseded by recovery N"
  };
  static constexpr size_t kKeptRecoveryMarks = 16;
  void MarkRecovery(RecoveryMark mark) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::deque<RecoveryMark> recovery_marks_ ABSL_GUARDED_BY(mu_);

  // Outputs.
  std::vector<StepRecord> steps_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::StageStatus> stage_status_ ABSL_GUARDED_BY(mu_);
  // Traced steps: per step, per worker, its events.
  std::deque<std::pair<int64_t, std::map<std::string, v1::StepDone>>> traces_ ABSL_GUARDED_BY(mu_);
  int trace_requested_ ABSL_GUARDED_BY(mu_) = 0;  // steps still to trace for GetTrace
  double total_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  double total_wall_ ABSL_GUARDED_BY(mu_) = 0;
  double sum_bubble_ ABSL_GUARDED_BY(mu_) = 0, sum_comm_ ABSL_GUARDED_BY(mu_) = 0,
         sum_worker_wall_ ABSL_GUARDED_BY(mu_) = 0;

  std::thread thread_;
};

}  // namespace baton

#endif  // BATON_COORDINATOR_JOB_RUNNER_H_
