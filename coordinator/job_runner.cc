#include "coordinator/job_runner.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <tuple>
#include <sys/stat.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/checkpoint_manifest.h"
#include "common/chrome_trace.h"
#include "common/file_io.h"
#include "common/json.h"
#include "common/log.h"
#include "common/report_group.h"
#include "common/status_macros.h"
#include "coordinator/job_schedule.h"
#include "coordinator/job_spec.h"
#include "coordinator/planner.h"
#include "coordinator/schedule/builders.h"
#include "coordinator/schedule/ir.h"
#include "coordinator/schedule/lowering.h"
#include "coordinator/schedule/simulator.h"
#include "coordinator/schedule/validator.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"

namespace baton {
namespace {

std::string Num(double v) { return std::isfinite(v) ? absl::StrFormat("%.9g", v) : "null"; }

// MoE: the share of the top-k choices dropped at capacity (0 when none were
// routed).
double DroppedRatio(int64_t routed, int64_t kept) {
  return routed > 0 ? 1.0 - static_cast<double>(kept) / static_cast<double>(routed) : 0.0;
}

// Simulator costs for the live plan: the synthetic model's own times, or
// F = I = W = 1 per block (an MoE block more, BlocksCost) with per-stage
// multipliers from the partition.
schedule::CostModel CostsFor(const v1::JobSpec& job, const v1::Plan& plan) {
  schedule::CostModel costs;
  const int v = std::max(1, plan.virtual_stages());
  if (job.model().has_synthetic()) {
    const auto& s = job.model().synthetic();
    // The simulator divides a stage's costs over its v chunks; a synthetic op is one chunk.
    costs.forward = s.forward_ms() * v;
    costs.backward_input = s.backward_input_ms() * v;
    costs.backward_weight = s.backward_weight_ms() * v;
    return costs;
  }
  LayerCosts lc = CostsOf(job.model());
  double total = 0;
  std::vector<double> cost;
  for (const v1::StagePartition& p : plan.stages()) {
    cost.push_back(BlocksCost(lc, p.first_layer(), p.first_layer() + p.num_layers()) +
                   (p.has_embedding() ? lc.embedding : 0) + (p.has_head() ? lc.head : 0));
    total += cost.back();
  }
  for (double c : cost) costs.stage_multipliers.push_back(c * cost.size() / total);
  return costs;
}

bool Holds(const std::deque<int64_t>& steps, int64_t step) {
  return std::find(steps.begin(), steps.end(), step) != steps.end();
}

void PushBounded(std::deque<int64_t>* steps, int64_t step, size_t max) {
  if (Holds(*steps, step)) return;
  steps->push_back(step);
  while (steps->size() > max) steps->pop_front();
}

void TrimAbove(std::deque<int64_t>* steps, int64_t step) {
  steps->erase(std::remove_if(steps->begin(), steps->end(), [&](int64_t s) { return s > step; }), steps->end());
}

class RegistryJobWorkers : public JobWorkers {
 public:
  RegistryJobWorkers(WorkerRegistry* registry, KvStore* kv, std::string job)
      : registry_(registry), kv_(kv), job_(std::move(job)) {}
  std::vector<v1::WorkerInfo> List() const override { return registry_->List(); }
  bool Send(const std::string& worker, const v1::CoordinatorMessage& message) override {
    std::shared_ptr<SessionHandle> session = registry_->SessionOf(worker);
    return session != nullptr && session->Send(message);
  }
  void SendEach(const std::vector<std::string>& workers, const v1::CoordinatorMessage& message) override {
    for (const std::shared_ptr<SessionHandle>& session : registry_->SessionsOf(workers)) {
      if (session != nullptr) session->Send(message);
    }
  }
  int64_t NextGeneration() override {
    const int64_t generation = kv_->CurrentGeneration(job_) + 1;
    kv_->AdvanceGeneration(job_, generation);
    return generation;
  }
  int64_t GenerationAbove(int64_t floor) override {
    // `floor` is a worker's word (bounded by WorkerRegistry::Register): one
    // step, never a loop of NextGeneration up to it.
    const int64_t generation = std::max(kv_->CurrentGeneration(job_), floor) + 1;
    kv_->AdvanceGeneration(job_, generation);
    return generation;
  }

 private:
  WorkerRegistry* const registry_;
  KvStore* const kv_;
  const std::string job_;
};

// The generation a worker's reply was made in (0: not stamped).
int64_t GenerationOf(const v1::WorkerMessage& m) {
  switch (m.body_case()) {
    case v1::WorkerMessage::kConfigured: return m.configured().generation();
    case v1::WorkerMessage::kReport: return m.report().generation();
    case v1::WorkerMessage::kStepDone: return m.step_done().generation();
    case v1::WorkerMessage::kSaved: return m.saved().generation();
    case v1::WorkerMessage::kSnapshot: return m.snapshot().generation();
    case v1::WorkerMessage::kFetchedState: return m.fetched_state().generation();
    case v1::WorkerMessage::kEvalReport: return m.eval_report().generation();
    default: return 0;
  }
}

int64_t StepOf(const v1::WorkerMessage& m) {
  switch (m.body_case()) {
    case v1::WorkerMessage::kReport: return m.report().step();
    case v1::WorkerMessage::kStepDone: return m.step_done().step();
    case v1::WorkerMessage::kFetchedState: return m.fetched_state().step();
    case v1::WorkerMessage::kEvalReport: return m.eval_report().step();
    default: return 0;
  }
}

// A rank's coordinates, the key of the slots a coordinator adopts.
std::vector<int> SlotKey(int pp_rank, int tp_rank, int cp_rank, int dp_rank) {
  return {pp_rank, tp_rank, cp_rank, dp_rank};
}

absl::StatusCode CodeOr(int32_t code, absl::StatusCode fallback) {
  return code > 0 && code <= static_cast<int>(absl::StatusCode::kUnauthenticated) ? static_cast<absl::StatusCode>(code)
                                                                                 : fallback;
}

}  // namespace

std::unique_ptr<JobWorkers> MakeRegistryJobWorkers(WorkerRegistry* registry, KvStore* kv, std::string job) {
  return std::make_unique<RegistryJobWorkers>(registry, kv, std::move(job));
}

FaultTolerance FaultToleranceOf(const v1::JobSpec& job) {
  FaultTolerance ft;
  const v1::FaultToleranceSpec& f = job.fault_tolerance();
  if (f.has_max_restarts()) ft.max_restarts = f.max_restarts();
  if (f.has_replacement_timeout_s()) ft.replacement_timeout = absl::Seconds(f.replacement_timeout_s());
  if (f.has_snapshot_every_steps()) ft.snapshot_every_steps = f.snapshot_every_steps();
  return ft;
}

absl::Status ValidatePlanMesh(const v1::Plan& plan) {
  const int cp = std::max(1, plan.cp());
  if (plan.pp() < 1 || plan.tp() < 1 || plan.dp() < 1 || plan.cp() < 0 ||
      static_cast<int64_t>(plan.pp()) * plan.tp() * cp * plan.dp() != plan.ranks_size()) {
    return absl::InvalidArgumentError(absl::StrCat("plan of pp ", plan.pp(), ", tp ", plan.tp(), ", cp ", cp,
                                                   ", dp ", plan.dp(), " has ", plan.ranks_size(),
                                                   " ranks; pp*tp*cp*dp make a whole mesh"));
  }
  std::set<std::tuple<int, int, int, int>> held;
  for (const v1::RankAssignment& r : plan.ranks()) {
    if (r.pp_rank() < 0 || r.pp_rank() >= plan.pp() || r.tp_rank() < 0 || r.tp_rank() >= plan.tp() ||
        r.cp_rank() < 0 || r.cp_rank() >= cp || r.dp_rank() < 0 || r.dp_rank() >= plan.dp()) {
      return absl::InvalidArgumentError(absl::StrCat("rank of ", r.worker_name(), " (pp ", r.pp_rank(), ", tp ",
                                                     r.tp_rank(), ", cp ", r.cp_rank(), ", dp ", r.dp_rank(),
                                                     ") is outside the plan's mesh"));
    }
    if (!held.insert({r.pp_rank(), r.tp_rank(), r.cp_rank(), r.dp_rank()}).second) {
      return absl::InvalidArgumentError(absl::StrCat("pp ", r.pp_rank(), ", tp ", r.tp_rank(), ", cp ",
                                                     r.cp_rank(), ", dp ", r.dp_rank(), " is held twice"));
    }
  }
  return absl::OkStatus();
}

int ReportGroupColumns(const v1::Plan& plan, int min_ranks, int group_ranks) {
  if (plan.pp() < 1 || plan.ranks_size() < std::max(1, min_ranks)) return 0;
  // The seats of common/report_group.h (the workers' too) know no cp rank:
  // a context-parallel job reports rank by rank.
  if (plan.cp() > 1) return 0;
  const auto all = [&plan](bool (v1::RankAssignment::*has)() const) {
    return std::all_of(plan.ranks().begin(), plan.ranks().end(), [has](const v1::RankAssignment& r) {
      return (r.*has)();
    });
  };
  if (!all(&v1::RankAssignment::report_groups) || !all(&v1::RankAssignment::verdict_in_run_step)) return 0;
  const int columns = all(&v1::RankAssignment::report_group_columns)
                          ? ReportGroupColumnsFor(plan.pp(), plan.tp(), plan.dp(), group_ranks)
                          : 1;
  return plan.pp() * columns >= 2 ? columns : 0;
}

absl::StatusOr<std::map<std::string, std::vector<std::string>>> ReportGroupsOf(const v1::Plan& plan) {
  BATON_RETURN_IF_ERROR(ValidatePlanMesh(plan));
  if (plan.cp() > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("a plan of cp ", plan.cp(), " has no report groups (their seats know no cp rank)"));
  }
  const int columns = std::max(1, plan.report_group_columns());
  // group -> names by seat.
  std::map<int, std::vector<std::string>> seats;
  for (const v1::RankAssignment& r : plan.ranks()) {
    const ReportGroupSeat seat =
        ReportGroupSeatOf(plan.pp(), plan.tp(), plan.dp(), columns, r.pp_rank(), r.tp_rank(), r.dp_rank());
    std::vector<std::string>& group = seats[seat.group];
    group.resize(seat.size);
    if (!group[seat.rank].empty()) {
      return absl::InvalidArgumentError(absl::StrCat("pp ", r.pp_rank(), ", tp ", r.tp_rank(), ", dp ", r.dp_rank(),
                                                     " is held twice"));
    }
    group[seat.rank] = r.worker_name();
  }
  std::map<std::string, std::vector<std::string>> groups;
  for (auto& [index, group] : seats) groups[group[0]] = std::vector<std::string>(group.begin() + 1, group.end());
  return groups;
}

bool SnapshotDue(std::optional<int> every, int64_t step, int64_t last, double stall_seconds, double step_seconds) {
  if (every.has_value()) return *every > 0 && step % *every == 0;
  if (last <= 0) return true;
  double k = 1;  // also while no step or no snapshot has been timed
  if (stall_seconds > 0 && step_seconds > 0) {
    k = std::max(1.0, std::ceil(stall_seconds / (kMaxSnapshotOverhead * step_seconds)));
  }
  return static_cast<double>(step - last) >= k;
}

JobRunner::JobRunner(v1::JobSpec job, WorkerRegistry* registry, KvStore* kv, Options options,
                     prometheus::Registry& metrics)
    : JobRunner(job, nullptr, RealClock::Get(), std::move(options), metrics) {
  owned_workers_ = MakeRegistryJobWorkers(registry, kv, job_.name());
  workers_ = owned_workers_.get();
}

JobRunner::JobRunner(v1::JobSpec job, JobWorkers* workers, Clock* clock, Options options,
                     prometheus::Registry& metrics)
    : job_(std::move(job)),
      ft_(FaultToleranceOf(job_)),
      workers_(workers),
      clock_(clock),
      options_(std::move(options)) {
  const prometheus::Labels labels = {{"training_job", job_.name()}};
  auto& states = prometheus::BuildGauge()
                     .Name("baton_job_state")
                     .Help("1 for the job's current state, 0 for the others")
                     .Register(metrics);
  for (JobState s : kAllJobStates) {
    state_metric_[s] = &states.Add({{"training_job", job_.name()}, {"state", JobStateName(s)}});
  }
  state_metric_[JobState::kWaiting]->Set(1);
  expected_bubble_family_ = &prometheus::BuildGauge()
                                 .Name("baton_expected_bubble_ratio")
                                 .Help("Bubble ratio the simulator expects for the live plan, per pipeline stage (0-1)")
                                 .Register(metrics);
  step_metric_ = &prometheus::BuildGauge()
                      .Name("baton_job_step")
                      .Help("Last committed step of the job")
                      .Register(metrics)
                      .Add(labels);
  loss_metric_ = &prometheus::BuildGauge()
                      .Name("baton_job_loss")
                      .Help("Loss of the last committed step")
                      .Register(metrics)
                      .Add(labels);
  discarded_metric_ = &prometheus::BuildCounter()
                           .Name("baton_discarded_steps_total")
                           .Help("Steps discarded for non-finite loss or gradients")
                           .Register(metrics)
                           .Add(labels);
  auto& recoveries = prometheus::BuildCounter()
                         .Name("baton_recoveries_total")
                         .Help("Recoveries started, by cause")
                         .Register(metrics);
  for (FaultCause c : kAllFaultCauses) {
    recoveries_metric_[c] = &recoveries.Add({{"training_job", job_.name()}, {"cause", FaultCauseName(c)}});
  }
  recovery_seconds_metric_ = &prometheus::BuildHistogram()
                                  .Name("baton_recovery_seconds")
                                  .Help("Fault detected to the first step completed after the recovery")
                                  .Register(metrics)
                                  .Add(labels, prometheus::Histogram::BucketBoundaries{0.5, 1, 2, 5, 10, 30, 60, 120,
                                                                                       300});
  replayed_metric_ = &prometheus::BuildCounter()
                          .Name("baton_replayed_steps_total")
                          .Help("Committed steps run again after a recovery rolled back to an older step")
                          .Register(metrics)
                          .Add(labels);
  eval_loss_metric_ = &prometheus::BuildGauge()
                           .Name("baton_job_eval_loss")
                           .Help("Held-out loss of the last evaluation (train.eval_every_steps)")
                           .Register(metrics)
                           .Add(labels);
  eval_perplexity_metric_ = &prometheus::BuildGauge()
                                 .Name("baton_job_eval_perplexity")
                                 .Help("exp(held-out loss) of the last evaluation")
                                 .Register(metrics)
                                 .Add(labels);
  // NaN until an evaluation ran (none without train.eval_every_steps): a
  // graph shows nothing rather than a loss of 0.
  eval_loss_metric_->Set(std::numeric_limits<double>::quiet_NaN());
  eval_perplexity_metric_->Set(std::numeric_limits<double>::quiet_NaN());
}

JobRunner::~JobRunner() { Stop(); }

void JobRunner::Start() {
  thread_ = std::thread([this] { Run(); });
}

void JobRunner::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

JobState JobRunner::state() const {
  absl::MutexLock lock(&mu_);
  return state_;
}

absl::Status JobRunner::error() const {
  absl::MutexLock lock(&mu_);
  return error_;
}

// ---------------------------------------------------------------------------
// The state machine.

void JobRunner::Run() {
  if (!options_.out_dir.empty()) {
    if (absl::Status s = MakeDirectories(options_.out_dir); !s.ok()) return Fail(s);
  }
  if (!options_.resume_dir.empty()) {
    // Refused before any worker trains: the message names the file and the problem.
    absl::StatusOr<std::string> dir = checkpoint::ResolveCheckpoint(options_.resume_dir);
    if (!dir.ok()) return Fail(WithContext(dir.status(), "--resume"));
    absl::StatusOr<checkpoint::FullState> valid = checkpoint::ValidateCheckpointForJob(*dir, job_);
    if (!valid.ok()) return Fail(WithContext(valid.status(), absl::StrCat("--resume=", *dir)));
    // A checkpoint of the job's last step is resumed too: nothing is
    // trained, the state is saved again (in this job's layout) as out/final.
    if (valid->manifest.step > job_.train().steps()) {
      return Fail(absl::InvalidArgumentError(absl::StrCat("--resume=", *dir, ": the checkpoint is of step ",
                                                          valid->manifest.step, ", the job has only ",
                                                          job_.train().steps(), " steps")));
    }
    absl::MutexLock lock(&mu_);
    resume_checkpoint_ = *dir;
    checkpoint_step_ = valid->manifest.step;
    checkpoint_dir_ = *dir;
    committed_ = recorded_ = valid->manifest.step;
    next_step_ = valid->manifest.step + 1;
    BATON_LOG(INFO) << "job '" << job_.name() << "': resuming from " << *dir << " (step " << valid->manifest.step
                    << ")";
  }
  for (;;) {
    const JobState now = state();
    if (IsFinal(now)) return;
    absl::StatusOr<JobState> next;
    switch (now) {
      case JobState::kWaiting: next = Waiting(); break;
      case JobState::kConfiguring: next = Configuring(); break;
      case JobState::kRunning: next = Running(); break;
      case JobState::kRecovering: next = Recovering(); break;
      case JobState::kSaving: next = Saving(); break;
      default: return;
    }
    if (!next.ok()) return Fail(next.status());
    if (*next == JobState::kDone && !options_.out_dir.empty()) {
      if (absl::Status s = WriteOutputs(); !s.ok()) return Fail(s);
    }
    if (*next != now) Transition(*next);
    if (*next == JobState::kDone) {
      absl::MutexLock lock(&mu_);
      BATON_LOG(INFO) << "job '" << job_.name() << "' done after " << steps_.size() << " steps";
    }
  }
}

void JobRunner::Transition(JobState to) {
  JobState from;
  {
    absl::MutexLock lock(&mu_);
    from = state_;
    state_ = to;
  }
  for (auto& [s, gauge] : state_metric_) gauge->Set(s == to ? 1 : 0);
  if (from != to) BATON_LOG(INFO) << "job '" << job_.name() << "': " << JobStateName(from) << " -> " << JobStateName(to);
}

void JobRunner::Fail(const absl::Status& why) {
  {
    absl::MutexLock lock(&mu_);
    if (state_ == JobState::kFailed) return;
    // A fault already recorded is the first cause; `why` may be its consequence.
    error_ = why;
    if (!faults_.empty() && why.code() != absl::StatusCode::kCancelled) {
      const absl::Status first = FaultsToStatus();
      if (!absl::StrContains(why.message(), first.message())) {
        error_ = absl::Status(first.code(), absl::StrCat(first.message(), "; then: ", why.message()));
      }
    }
  }
  Transition(JobState::kFailed);
  const absl::Status err = error();
  BATON_LOG(ERROR) << "job '" << job_.name() << "' failed: " << err.message();
  v1::CoordinatorMessage abort;
  abort.mutable_abort()->set_reason(std::string(err.message()));
  SendAll(abort);
  if (!options_.out_dir.empty()) WriteOutputs().IgnoreError();
}

absl::StatusOr<JobState> JobRunner::Waiting() {
  const ParallelDims d = DimsOf(job_);
  const int world = d.world_size();
  const absl::Time start = clock_->Now();
  bool reported = false;
  for (;;) {
    std::vector<v1::WorkerInfo> ready;
    for (v1::WorkerInfo& w : workers_->List()) {
      if (w.state() == v1::READY) ready.push_back(std::move(w));
    }
    // Workers that hold this job from an earlier coordinator: the newest
    // generation's reports, one per (pp, tp, cp, dp) slot.
    int64_t held_generation = 0;
    for (const v1::WorkerInfo& w : ready) {
      if (w.held().job() == job_.name() && w.held().steps_size() > 0) {
        held_generation = std::max(held_generation, w.held().generation());
      }
    }
    std::map<std::vector<int>, v1::WorkerInfo> slots;
    bool conflict = false;
    for (const v1::WorkerInfo& w : ready) {
      const v1::HeldJob& h = w.held();
      if (h.job() != job_.name() || h.generation() != held_generation || h.steps_size() == 0) continue;
      if (h.pp_rank() >= d.pp || h.tp_rank() >= d.tp || h.dp_rank() >= d.dp || h.cp_rank() < 0 || h.cp_rank() >= d.cp) {
        continue;
      }
      conflict |= !slots.emplace(SlotKey(h.pp_rank(), h.tp_rank(), h.cp_rank(), h.dp_rank()), w).second;
    }
    if (held_generation > 0 && !conflict && static_cast<int>(slots.size()) == world) {
      return Adopt(ready, slots, held_generation);
    }
    const bool adopting = held_generation > 0 && clock_->Now() - start < options_.adopt_grace;
    if (static_cast<int>(ready.size()) >= world && !adopting) {
      if (held_generation > 0) {
        BATON_LOG(WARNING) << "job '" << job_.name() << "': " << slots.size() << " of " << world
                           << " shards reported by workers of generation " << held_generation
                           << (conflict ? " (two workers claim one shard)" : "") << " after "
                           << absl::FormatDuration(options_.adopt_grace) << "; starting the job over";
      }
      if (!options_.out_dir.empty()) std::remove((options_.out_dir + "/steps.jsonl").c_str());
      BATON_ASSIGN_OR_RETURN(v1::Plan plan, MakePlan(job_, ready, workers_->NextGeneration()));
      absl::MutexLock lock(&mu_);
      error_ = absl::OkStatus();
      setup_ = Setup{std::move(plan), resume_checkpoint_.empty() ? 0 : checkpoint_step_, {}, resume_checkpoint_};
      return JobState::kConfiguring;
    }
    absl::MutexLock lock(&mu_);
    if (!reported && clock_->Now() - start > options_.ready_timeout) {
      reported = true;
      error_ = absl::FailedPreconditionError(
          absl::StrCat("job '", job_.name(), "' needs ", d.cp > 1 ? "pp*tp*cp*dp" : "pp*tp*dp", " = ", world,
                       " ready workers, ", ready.size(),
                       " are ready after ", absl::FormatDuration(options_.ready_timeout), "; start ",
                       world - static_cast<int>(ready.size()), " more workers (still waiting)"));
      BATON_LOG(WARNING) << error_.message();
    }
    if (WaitUntil([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_; },
                  clock_->Now() + absl::Milliseconds(100))) {
      return absl::CancelledError("coordinator shutting down");
    }
  }
}

absl::StatusOr<JobState> JobRunner::Adopt(const std::vector<v1::WorkerInfo>& ready,
                                          const std::map<std::vector<int>, v1::WorkerInfo>& slots,
                                          int64_t held_generation) {
  const int64_t generation = workers_->GenerationAbove(held_generation);
  BATON_ASSIGN_OR_RETURN(v1::Plan plan, MakePlan(job_, ready, generation));
  std::set<std::string> taken;
  for (v1::RankAssignment& r : *plan.mutable_ranks()) {
    const v1::WorkerInfo& w = slots.at(SlotKey(r.pp_rank(), r.tp_rank(), r.cp_rank(), r.dp_rank()));
    PlaceRank(w, &r);
    taken.insert(w.name());
  }
  plan.set_comm_backend(CommBackendOf(job_, plan));  // MakePlan chose it for its own placement
  plan.clear_spares();
  for (const v1::WorkerInfo& w : ready) {
    if (!taken.count(w.name())) plan.add_spares(w.name());
  }
  LoadSteps();
  int64_t recorded = 0;
  {
    absl::MutexLock lock(&mu_);
    recorded = recorded_;
  }
  // The newest step every shard can restore, and the newest such step that
  // steps.jsonl already holds. The workers may have committed a step whose
  // line the old coordinator never wrote (it died between Commit and the
  // write); resuming after it would leave that step out of steps.jsonl for
  // good, so with an output directory the job resumes from a step it has
  // recorded (0, the seeded initial state, is always available) and replays
  // the rest, which writes their lines.
  int64_t newest = 0, newest_recorded = 0;
  for (int64_t s : slots.begin()->second.held().steps()) {
    bool everywhere = true;
    for (const auto& [slot, w] : slots) {
      const auto& steps = w.held().steps();
      everywhere &= std::find(steps.begin(), steps.end(), s) != steps.end();
    }
    if (!everywhere) continue;
    newest = std::max(newest, s);
    if (s <= recorded) newest_recorded = std::max(newest_recorded, s);
  }
  const int64_t resume = options_.out_dir.empty() ? newest : newest_recorded;
  absl::MutexLock lock(&mu_);
  for (const auto& [slot, w] : slots) {
    std::deque<int64_t>& own = own_snapshots_[w.name()];
    for (int64_t s : w.held().steps()) {
      if (s <= resume) PushBounded(&own, s, kOwnSnapshots);
    }
    std::sort(own.begin(), own.end());
  }
  ++restarts_;
  recoveries_metric_[FaultCause::kCoordinatorRestart]->Increment();
  const int64_t replayed = std::max<int64_t>(0, std::max(recorded_, newest) - resume);
  replayed_ += replayed;
  replayed_metric_->Increment(static_cast<double>(replayed));
  recovery_ = absl::StrCat("adopted the running job from ", slots.size(), " workers of generation ",
                           held_generation, " after a coordinator restart; resuming after step ", resume, " (",
                           replayed, " steps replayed)");
  BATON_LOG(WARNING) << "job '" << job_.name() << "': " << recovery_;
  AppendStepsLine(absl::StrCat("{\"recovery\": ", restarts_, ", \"cause\": \"coordinator_restart\", \"worker\": \"\"",
                               ", \"resume_step\": ", resume, ", \"replayed_steps\": ", replayed,
                               ", \"generation\": ", generation, ", \"detail\": ", JsonQuote(recovery_), "}"));
  recovery_started_ = clock_->Now();
  RecoveryMark mark;
  mark.number = restarts_;
  mark.cause = FaultCauseName(FaultCause::kCoordinatorRestart);
  mark.source = "every worker's own memory (adopted)";
  mark.detail = recovery_;
  mark.resume_step = resume;
  mark.replayed_steps = replayed;
  mark.generation = generation;
  mark.started = *recovery_started_;
  MarkRecovery(std::move(mark));
  committed_ = resume;
  next_step_ = resume + 1;
  error_ = absl::OkStatus();
  setup_ = Setup{std::move(plan), resume, {}, {}};
  return JobState::kConfiguring;
}

void JobRunner::LoadSteps() {
  if (options_.out_dir.empty()) return;
  const std::string path = options_.out_dir + "/steps.jsonl";
  absl::StatusOr<std::string> text = ReadFile(path);
  if (!text.ok()) return;
  std::string kept;
  std::vector<StepRecord> records;
  int64_t last_eval = 0;  // the last evaluation recorded, so a replay does not evaluate again
  double last_eval_loss = 0;
  for (absl::string_view line : absl::StrSplit(*text, '\n', absl::SkipEmpty())) {
    absl::StatusOr<JsonValue> v = JsonValue::Parse(line);
    if (!v.ok() || !v->is_object()) continue;  // a line torn by the crash
    absl::StrAppend(&kept, line, "\n");
    if (const JsonValue* eval = v->Find("eval"); eval != nullptr && eval->is_number()) {
      const JsonValue* loss = v->Find("loss");
      if (loss != nullptr && loss->is_number() && eval->number() > last_eval) {
        last_eval = static_cast<int64_t>(eval->number());
        last_eval_loss = loss->number();
      }
      continue;
    }
    const JsonValue* step = v->Find("step");
    if (step == nullptr || !step->is_number()) continue;
    auto num = [&](const char* key) {
      const JsonValue* x = v->Find(key);
      return x != nullptr && x->is_number() ? x->number() : 0.0;
    };
    StepRecord r;
    r.step = static_cast<int64_t>(step->number());
    const JsonValue* committed = v->Find("committed");
    r.committed = committed != nullptr && committed->kind() == JsonValue::Kind::kBool && committed->bool_value();
    r.loss = num("loss");
    r.accuracy = num("accuracy");
    r.grad_norm = num("grad_norm");
    r.clip = num("clip");
    r.wall = num("wall_seconds");
    r.tokens_per_second = num("tokens_per_second");
    r.bubble_ratio = num("bubble_ratio");
    r.comm_ratio = num("comm_ratio");
    r.epoch = static_cast<int64_t>(num("epoch"));
    records.push_back(r);
  }
  if (absl::Status s = WriteFileAtomically(path, kept); !s.ok()) {
    BATON_LOG(WARNING) << "cannot rewrite " << path << ": " << s;
  }
  absl::MutexLock lock(&mu_);
  steps_ = std::move(records);
  recorded_ = steps_.empty() ? 0 : steps_.back().step;
  eval_step_ = last_eval;
  eval_loss_ = last_eval_loss;
}

absl::StatusOr<JobState> JobRunner::Configuring() {
  Setup setup;
  {
    absl::MutexLock lock(&mu_);
    setup = setup_;
  }
  v1::Plan& plan = setup.plan;
  BATON_RETURN_IF_ERROR_CTX(ValidatePlanMesh(plan), "configuring generation ", plan.generation());
  const int group_columns =
      ReportGroupColumns(plan, options_.report_groups_min_ranks, options_.report_group_ranks);
  plan.set_report_groups(group_columns > 0);
  plan.set_report_group_columns(group_columns);
  std::map<std::string, std::vector<std::string>> groups;
  if (plan.report_groups()) {
    BATON_ASSIGN_OR_RETURN(groups, ReportGroupsOf(plan));
  }
  const size_t leaders = groups.size();
  const schedule::CostModel costs = CostsFor(job_, plan);
  BATON_ASSIGN_OR_RETURN(schedule::Schedule lowered, LoweredScheduleOf(job_, costs));
  if (!std::equal(lowered.stage_ranks.begin(), lowered.stage_ranks.end(), plan.stage_ranks().begin(),
                  plan.stage_ranks().end())) {
    return absl::InternalError("the plan's stage placement differs from the schedule's");
  }
  BATON_ASSIGN_OR_RETURN(schedule::SimulationResult sim, schedule::Simulate(lowered, costs));
  std::vector<v1::Program> programs = schedule::ToPrograms(lowered);
  for (const schedule::RankStats& r : sim.ranks) {
    expected_bubble_family_->Add({{"training_job", job_.name()}, {"stage", std::to_string(r.rank)}})
        .Set(r.bubble_ratio);
  }
  std::map<std::string, int64_t> incarnations;
  for (const v1::WorkerInfo& w : workers_->List()) incarnations[w.name()] = w.incarnation();
  auto names = std::make_shared<WorkerSet>();
  std::map<std::string, std::string> buddies = Buddies(plan);
  {
    absl::MutexLock lock(&mu_);
    plan_ = plan;
    programs_ = programs;
    generation_ = plan.generation();
    expected_bubble_ = sim.bubble_ratio;
    assigned_.clear();
    incarnation_.clear();
    for (const v1::RankAssignment& r : plan.ranks()) {
      assigned_[r.worker_name()] = r;
      incarnation_[r.worker_name()] = incarnations[r.worker_name()];
      names->insert(r.worker_name());
    }
    plan_workers_ = names;
    buddy_ = buddies;
    groups_ = std::move(groups);
  }
  Expect(v1::WorkerMessage::kConfigured, 0, names);
  BATON_LOG(INFO) << "job '" << job_.name() << "' generation " << plan.generation() << ": " << plan.ranks_size()
                  << " workers, schedule " << lowered.kind << " (expected bubble "
                  << absl::StrFormat("%.1f%%", 100 * sim.bubble_ratio) << "), " << plan.spares_size() << " spares"
                  << (setup.resume_step > 0 ? absl::StrCat(", resuming after step ", setup.resume_step) : "")
                  << (plan.report_groups() ? absl::StrCat(", steps reported by ", leaders, " group leaders (",
                                                          group_columns, group_columns == 1 ? " column" : " columns",
                                                          " each)")
                                           : "");
  // Each worker gets the plan with its own rank only (a worker reads nothing
  // else of plan.ranks): the full list in every Configure would make
  // configuring quadratic in the workers (547 MB of messages at 4096).
  v1::Plan shared = plan;
  shared.clear_ranks();
  shared.clear_spares();
  // A schedule.csv (up to 1 MiB) stays here: workers run their Program.
  v1::JobSpec shipped = job_;
  shipped.mutable_schedule()->clear_csv();
  for (const v1::RankAssignment& r : plan.ranks()) {
    v1::CoordinatorMessage msg;
    v1::Configure* c = msg.mutable_configure();
    *c->mutable_plan() = shared;
    *c->mutable_plan()->add_ranks() = r;
    *c->mutable_program() = programs[r.pp_rank()];
    *c->mutable_job() = shipped;
    c->set_resume_step(setup.resume_step);
    if (auto it = setup.state.find(r.worker_name()); it != setup.state.end()) c->set_state(it->second);
    c->set_checkpoint_dir(setup.checkpoint_dir);
    if (!workers_->Send(r.worker_name(), msg)) {
      OnWorkerLost(r.worker_name(), "its session was gone when it was to be configured");
    }
  }
  absl::StatusOr<std::map<std::string, v1::WorkerMessage>> configured =
      Collect(options_.configure_timeout, "Configured");
  if (configured.status().code() == absl::StatusCode::kAborted) return JobState::kRecovering;
  if (!configured.ok()) return WithContext(configured.status(), "configuring the job");
  absl::MutexLock lock(&mu_);
  if (!setup.checkpoint_dir.empty()) {  // every worker now holds the checkpoint's step in memory
    for (const auto& [name, a] : assigned_) own_snapshots_[name] = {setup.resume_step};
  }
  last_snapshot_step_ = setup.resume_step;  // 0: the first step's snapshot measures what one costs
  return JobState::kRunning;
}

absl::StatusOr<JobState> JobRunner::Running() {
  int64_t step;
  std::shared_ptr<const WorkerSet> names;
  v1::CoordinatorMessage run;
  int64_t eval_pending = 0;
  bool sent = false;  // ahead, while the previous step's StepDone were collected
  absl::Time start;
  {
    absl::MutexLock lock(&mu_);
    step = next_step_;
    names = plan_workers_;
    eval_pending = eval_pending_;
    // Sent to the same world (a reconfiguration makes a new set).
    if (ahead_ && ahead_->step == step && ahead_->from == names) {
      // Its GradsReady so far become the inbox (Expect without clearing it).
      sent = true;
      start = ahead_->sent;
      run.mutable_run_step()->set_step(step);
      run.mutable_run_step()->set_trace(ahead_->trace);
      expect_case_ = v1::WorkerMessage::kReport;
      expect_step_ = step;
      expect_from_ = std::move(ahead_->from);
      inbox_ = std::move(ahead_->inbox);
    } else if (step <= job_.train().steps()) {
      run = RunStepMessage(step);
    }
    ahead_.reset();
  }
  BATON_RETURN_IF_ERROR(FinishCheckpoint());
  if (!sent && eval_pending > 0 && eval_pending == step - 1) {
    // A recovery interrupted the evaluation of the step the workers resumed
    // from: it runs now, on the same weights. (Resumed from an older step,
    // the replay reaches it again.)
    const absl::Status evaluated = Evaluate(step - 1, names);
    if (evaluated.code() == absl::StatusCode::kAborted) return JobState::kRecovering;
    BATON_RETURN_IF_ERROR(evaluated);
  }
  if (step > job_.train().steps()) return options_.out_dir.empty() ? JobState::kDone : JobState::kSaving;
  if (!sent) {
    start = absl::Now();
    Expect(v1::WorkerMessage::kReport, step, names);
    SendRunStep(run);
  }
  absl::StatusOr<std::map<std::string, v1::WorkerMessage>> reports =
      Collect(options_.step_timeout, "GradsReady");
  if (reports.status().code() == absl::StatusCode::kAborted) return JobState::kRecovering;
  if (!reports.ok()) return WithContext(reports.status(), absl::StrCat("step ", step));

  double loss = 0;
  int64_t correct = 0, predicted = 0;
  bool finite = true;
  const double norm = Aggregate(*reports, &loss, &correct, &predicted, &finite);
  int64_t epoch = 0;  // the ranks that read data agree; a rank without data says 0
  for (const auto& [name, msg] : *reports) epoch = std::max(epoch, msg.report().epoch());
  const double max_norm = job_.train().grad_clip();
  const double clip = max_norm > 0 && norm > max_norm ? max_norm / norm : 1.0;
  v1::CoordinatorMessage verdict;
  if (finite) {
    verdict.mutable_commit()->set_step(step);
    verdict.mutable_commit()->set_clip_factor(clip);
    absl::MutexLock lock(&mu_);
    if (SnapshotDue(ft_.snapshot_every_steps, step, last_snapshot_step_, snapshot_stall_seconds_, step_seconds_)) {
      verdict.mutable_commit()->set_snapshot(true);
      last_snapshot_step_ = step;
    }
  } else {
    verdict.mutable_discard()->set_step(step);
    verdict.mutable_discard()->set_reason("non-finite loss or gradient");
  }
  // The next step goes out right behind the verdict: each worker takes its
  // messages in order (applies the verdict, answers StepDone, snapshots if
  // asked, then runs it), so the workers do not wait a round trip to the
  // coordinator between steps. Not before a checkpoint (SaveWeights comes
  // first) or past the last step.
  const bool checkpoint = finite && CheckpointDue(step);
  // An evaluation runs between the Commit and the next step.
  const bool eval = finite && EvalDue(step);
  const bool ahead = !checkpoint && !eval && step < job_.train().steps();
  Expect(v1::WorkerMessage::kStepDone, step, names);
  absl::Time end;
  if (ahead) {
    end = SendAhead(verdict, step + 1, names);  // the next step's start
  } else {
    SendAll(verdict);
  }
  absl::StatusOr<std::map<std::string, v1::WorkerMessage>> done =
      Collect(options_.step_timeout, "StepDone", /*complete_wins=*/ahead);
  if (!done.ok()) {
    absl::MutexLock lock(&mu_);
    ahead_.reset();
  }
  if (done.status().code() == absl::StatusCode::kAborted) return JobState::kRecovering;
  if (!done.ok()) return WithContext(done.status(), absl::StrCat("step ", step));
  // The step's share of the job's time: until the next step went out, else
  // until every worker answered.
  if (!ahead) end = absl::Now();
  const double wall = absl::ToDoubleSeconds(end - start);
  {
    absl::MutexLock lock(&mu_);
    step_seconds_ = step_seconds_ > 0 ? 0.8 * step_seconds_ + 0.2 * wall : wall;
  }
  RecordStep(step, finite, run.run_step().trace(), loss, predicted > 0 ? static_cast<double>(correct) / predicted : 0,
             norm, clip, wall, epoch, *done);
  if (eval) {
    const absl::Status evaluated = Evaluate(step, names);
    if (evaluated.code() == absl::StatusCode::kAborted) return JobState::kRecovering;
    BATON_RETURN_IF_ERROR(evaluated);
  }
  if (checkpoint) {
    absl::MutexLock lock(&mu_);
    checkpoint_due_ = step;
    return JobState::kSaving;
  }
  return JobState::kRunning;
}

bool JobRunner::EvalDue(int64_t step) const {
  const int64_t every = job_.train().eval_every_steps();
  return every > 0 && (step % every == 0 || step == job_.train().steps());
}

absl::Status JobRunner::Evaluate(int64_t step, std::shared_ptr<const WorkerSet> names) {
  {
    absl::MutexLock lock(&mu_);
    if (step <= eval_step_) return absl::OkStatus();  // a step replayed after a recovery: evaluated already
    eval_pending_ = step;
  }
  const absl::Time start = absl::Now();
  Expect(v1::WorkerMessage::kEvalReport, step, names);
  v1::CoordinatorMessage evaluate;
  evaluate.mutable_evaluate()->set_step(step);
  SendAll(evaluate);
  // Each evaluation batch is a forward pass: at most a step's time each.
  const int batches = job_.train().has_eval_steps() ? job_.train().eval_steps() : 1;
  absl::StatusOr<std::map<std::string, v1::WorkerMessage>> reports =
      Collect(options_.step_timeout * batches, "EvalReport");
  if (!reports.ok()) return WithContext(reports.status(), absl::StrCat("evaluation after step ", step));
  double loss_sum = 0;
  int64_t tokens = 0;
  {
    absl::MutexLock lock(&mu_);
    // One TP rank of each last stage counts (its TP peers hold the same
    // sum); each DP replica and CP rank scores its own tokens (a CP rank its
    // two chunks of every sequence), so the sums over them all are the
    // batch's.
    for (const auto& [name, msg] : *reports) {
      const v1::EvalReport& r = msg.eval_report();
      if (!r.has_loss() || assigned_[name].tp_rank() != 0) continue;
      loss_sum += r.loss_sum();
      tokens += r.tokens();
    }
  }
  if (tokens <= 0) {
    return absl::InternalError(absl::StrCat("evaluation after step ", step, ": no last stage reported a loss"));
  }
  const double loss = loss_sum / static_cast<double>(tokens);
  const double perplexity = std::exp(loss);
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  {
    absl::MutexLock lock(&mu_);
    eval_pending_ = 0;
    if (step <= eval_step_) return absl::OkStatus();
    eval_step_ = step;
    eval_loss_ = loss;
  }
  eval_loss_metric_->Set(loss);
  eval_perplexity_metric_->Set(perplexity);
  BATON_LOG(INFO) << "eval after step " << step << ": loss " << Num(loss) << ", perplexity " << Num(perplexity)
                  << " (" << tokens << " tokens, " << Num(seconds) << " s)";
  AppendStepsLine(absl::StrCat("{\"eval\": ", step, ", \"loss\": ", Num(loss), ", \"perplexity\": ",
                               Num(perplexity), ", \"tokens\": ", tokens, ", \"seconds\": ", Num(seconds), "}"));
  return absl::OkStatus();
}

v1::CoordinatorMessage JobRunner::RunStepMessage(int64_t step) {
  v1::CoordinatorMessage run;
  const bool requested = trace_requested_ > 0;
  if (requested) --trace_requested_;
  run.mutable_run_step()->set_step(step);
  run.mutable_run_step()->set_trace(requested || step > job_.train().steps() - options_.traced_steps);
  return run;
}

absl::Time JobRunner::SendAhead(const v1::CoordinatorMessage& verdict, int64_t step,
                                std::shared_ptr<const WorkerSet> names) {
  v1::CoordinatorMessage run;
  v1::CoordinatorMessage folded;  // the RunStep with the verdict inside
  std::vector<std::string> fold_to, apart_to;
  absl::Time sent;
  {
    absl::MutexLock lock(&mu_);
    if (!groups_.empty()) {  // every rank takes the verdict in RunStep; members from their leader
      for (const auto& [leader, members] : groups_) fold_to.push_back(leader);
    } else {
      for (const auto& [name, a] : assigned_) (a.verdict_in_run_step() ? fold_to : apart_to).push_back(name);
    }
    run = RunStepMessage(step);
    folded = run;
    if (verdict.has_commit()) *folded.mutable_run_step()->mutable_commit() = verdict.commit();
    if (verdict.has_discard()) *folded.mutable_run_step()->mutable_discard() = verdict.discard();
    // Handle() takes a StepDone held in the report as its own message, and
    // the StepDone still being collected waits for it there.
    folded.mutable_run_step()->set_step_done_in_report(true);
    Ahead a;
    a.step = step;
    a.trace = run.run_step().trace();
    a.sent = sent = absl::Now();
    a.from = std::move(names);
    ahead_ = std::move(a);
  }
  // Session sends only queue (coordinator_service.h): one thread sends to
  // every worker.
  if (!fold_to.empty()) workers_->SendEach(fold_to, folded);
  if (!apart_to.empty()) {
    workers_->SendEach(apart_to, verdict);
    workers_->SendEach(apart_to, run);
  }
  return sent;
}

absl::StatusOr<JobState> JobRunner::Saving() {
  int64_t due = 0;
  {
    absl::MutexLock lock(&mu_);
    due = checkpoint_due_;
    checkpoint_due_ = 0;
  }
  if (due > 0) return SavingCheckpoint(due);
  {
    absl::MutexLock lock(&mu_);
    WaitUntil(
        [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return stopping_ || !faults_.empty() || !pending_checkpoint_ || pending_checkpoint_->waiting.empty();
        },
        clock_->Now() + options_.configure_timeout);
    if (!faults_.empty()) return JobState::kRecovering;
  }
  BATON_RETURN_IF_ERROR(FinishCheckpoint());
  const std::string dir = options_.out_dir + "/final";
  BATON_RETURN_IF_ERROR(MakeDirectories(dir));
  std::shared_ptr<const WorkerSet> names;
  {
    absl::MutexLock lock(&mu_);
    names = plan_workers_;
  }
  Expect(v1::WorkerMessage::kSaved, 0, names);
  // A complete (v2) checkpoint of the last step: weights, AdamW moments and
  // the optimizer step, so out/final can be resumed and compared in full.
  v1::CoordinatorMessage save;
  save.mutable_save_weights()->set_dir(dir);
  save.mutable_save_weights()->set_step(job_.train().steps());
  save.mutable_save_weights()->set_with_state(true);
  SendAll(save);
  absl::StatusOr<std::map<std::string, v1::WorkerMessage>> saved = Collect(options_.configure_timeout, "Saved");
  if (saved.status().code() == absl::StatusCode::kAborted) return JobState::kRecovering;
  if (!saved.ok()) return WithContext(saved.status(), "saving the final weights");
  std::vector<std::string> files;
  for (const auto& [name, msg] : *saved) {
    for (const std::string& f : msg.saved().files()) files.push_back(f);
  }
  std::sort(files.begin(), files.end());
  BATON_RETURN_IF_ERROR_CTX(checkpoint::WriteManifest(dir, checkpoint::ManifestFor(job_, job_.train().steps(), files)),
                            "saving the final weights");
  return JobState::kDone;
}

absl::StatusOr<JobState> JobRunner::SavingCheckpoint(int64_t step) {
  BATON_RETURN_IF_ERROR(FinishCheckpoint());  // the previous one, if its files are all written
  if (!MaybeStartCheckpoint(step)) return JobState::kRunning;
  absl::MutexLock lock(&mu_);
  const bool copied = WaitUntil(
      [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !faults_.empty() || !pending_checkpoint_ || pending_checkpoint_->copying.empty();
      },
      clock_->Now() + options_.configure_timeout);
  if (stopping_) return absl::CancelledError("coordinator shutting down");
  if (!faults_.empty()) return JobState::kRecovering;
  if (!copied) {
    std::vector<std::string> missing;
    for (const std::string& name : pending_checkpoint_->copying) missing.push_back(Who(name));
    return absl::DeadlineExceededError(absl::StrCat("checkpoint of step ", step, ": ", absl::StrJoin(missing, ", "),
                                                    " did not copy its state to host memory within ",
                                                    absl::FormatDuration(options_.configure_timeout)));
  }
  return JobState::kRunning;
}

// ---------------------------------------------------------------------------
// Recovery.

absl::StatusOr<JobState> JobRunner::Recovering() {
  {
    absl::MutexLock lock(&mu_);
    if (!recovery_started_) recovery_started_ = clock_->Now();
  }
  // Release the survivors' collectives at once; their processes and
  // snapshots stay.
  v1::CoordinatorMessage abort;
  abort.mutable_abort()->set_reason("a worker of the plan failed; recovering");
  SendAll(abort);
  // Gather the other consequences of the same fault before judging it.
  absl::MutexLock lock(&mu_);
  WaitUntil([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_; }, clock_->Now() + options_.settle);
  if (stopping_) return absl::CancelledError("coordinator shutting down");
  const Fault* first = FirstCause();
  if (first == nullptr) return absl::InternalError("recovering without a fault");
  const absl::Status cause = FaultsToStatus();
  const Fault first_fault = *first;
  if (first_fault.code == absl::StatusCode::kInvalidArgument ||
      first_fault.code == absl::StatusCode::kFailedPrecondition) {
    return cause;  // a configuration or disk problem: replaying would fail the same way
  }
  if (first_fault.cause == FaultCause::kWorkerError && first_fault.code == absl::StatusCode::kResourceExhausted) {
    // A worker out of memory: the same layout on the same workers runs out
    // again at the same step; the error says what to lower.
    return absl::Status(cause.code(), absl::StrCat(cause.message(), "; not recovering: the job does not fit"));
  }
  if (restarts_ >= ft_.max_restarts) {
    return absl::Status(cause.code(), absl::StrCat(cause.message(), "; not recovering: ", restarts_,
                                                   " recoveries already (fault_tolerance.max_restarts = ",
                                                   ft_.max_restarts, "); run the job again"));
  }
  ++restarts_;
  recoveries_metric_[first_fault.cause]->Increment();
  BATON_LOG(WARNING) << "job '" << job_.name() << "': recovery " << restarts_ << " of at most " << ft_.max_restarts
                     << ": " << cause.message();

  // Find a replacement for every lost worker: the same name registering
  // again, else a spare READY worker.
  const absl::Time deadline = clock_->Now() + ft_.replacement_timeout;
  std::set<std::string> lost;
  std::map<std::string, v1::WorkerInfo> replacement;  // lost name -> replacement
  for (;;) {
    std::vector<v1::WorkerInfo> list;
    mu_.Unlock();
    list = workers_->List();
    mu_.Lock();
    if (stopping_) return absl::CancelledError("coordinator shutting down");
    lost = LostWorkers(list);
    replacement.clear();
    std::set<std::string> taken;
    for (const std::string& name : lost) {
      for (const v1::WorkerInfo& w : list) {
        if (w.name() == name && w.state() == v1::READY) {
          replacement[name] = w;
          taken.insert(name);
        }
      }
    }
    for (const std::string& name : lost) {
      if (replacement.count(name)) continue;
      for (const v1::WorkerInfo& w : list) {
        if (w.state() == v1::READY && !assigned_.count(w.name()) && !taken.count(w.name())) {
          replacement[name] = w;
          taken.insert(w.name());
          break;
        }
      }
    }
    if (replacement.size() == lost.size()) break;
    if (clock_->Now() >= deadline) {
      std::vector<std::string> missing;
      for (const std::string& name : lost) {
        if (!replacement.count(name)) missing.push_back(Who(name));
      }
      return absl::Status(
          cause.code(),
          absl::StrCat(cause.message(), "; no replacement for ", absl::StrJoin(missing, ", "), " within ",
                       absl::FormatDuration(ft_.replacement_timeout),
                       " (fault_tolerance.replacement_timeout_s): no spare READY worker, and the lost worker did "
                       "not register again. Start a spare worker (batonctl local --spares=N) or restart the lost "
                       "one; no checkpoint can be resumed from yet in this version, so run the job again"));
    }
    std::vector<std::string> who;
    for (const std::string& n : lost) who.push_back(Who(n));
    recovery_ = absl::StrCat("waiting for a replacement of ", absl::StrJoin(who, ", "));
    WaitUntil([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_; },
              clock_->Now() + std::max(options_.poll, absl::Milliseconds(50)));
  }

  // From here on, a fault is a new one (a second fault during recovery);
  // replies of the old world are dropped.
  faults_.clear();
  generation_ = 0;
  pending_checkpoint_.reset();  // an unfinished save stays incomplete (no manifest) and is pruned later
  checkpoint_due_ = 0;

  // The recovery step and where each lost shard's state comes from.
  std::map<std::string, std::pair<std::string, std::string>> sources;
  int64_t resume = ChooseResumeStep(lost, &sources);
  std::string from_checkpoint;  // the newest complete checkpoint, when newer than what memory offers
  // At step 0 too: a --resume checkpoint of step 0 (an import) is the
  // initial state, not the seed.
  if (!checkpoint_dir_.empty() && (checkpoint_step_ > resume || resume == 0)) {
    resume = checkpoint_step_;
    from_checkpoint = checkpoint_dir_;
  }
  std::map<std::string, std::string> states;  // replacement name -> ShardState
  std::vector<std::string> described, sources_described;
  for (const std::string& name : lost) {
    const auto src = sources.find(name);
    const std::string from =
        !from_checkpoint.empty() ? absl::StrCat("checkpoint ", from_checkpoint)
        : resume == 0 ? "the initial state (seed)"
        : src->second.first == src->second.second ? absl::StrCat("DP replica ", src->second.first)
                                                  : absl::StrCat(src->second.first, "'s snapshot");
    described.push_back(absl::StrCat(Who(name), " -> ", replacement[name].name(), ", state of step ", resume,
                                     " from ", from));
    sources_described.push_back(absl::StrCat(name, ": ", from));
  }
  recovery_ = absl::StrCat("recovery ", restarts_, ": ", lost.empty() ? "all workers kept, " : "",
                           absl::StrJoin(described, "; "), lost.empty() ? "" : "; ", "rolling back to step ",
                           resume, " (", committed_ - resume, " steps replayed)");
  BATON_LOG(WARNING) << "job '" << job_.name() << "': " << recovery_;
  for (const auto& [name, src] : sources) {
    if (resume == 0 || !from_checkpoint.empty()) break;
    const std::string source = src.first, owner = src.second;
    mu_.Unlock();
    Expect(v1::WorkerMessage::kFetchedState, resume, std::make_shared<const WorkerSet>(WorkerSet{source}));
    v1::CoordinatorMessage fetch;
    fetch.mutable_fetch_state()->set_owner(owner);
    fetch.mutable_fetch_state()->set_step(resume);
    if (!workers_->Send(source, fetch)) OnWorkerLost(source, "its session was gone when its state was fetched");
    absl::StatusOr<std::map<std::string, v1::WorkerMessage>> got = Collect(options_.fetch_timeout, "state");
    mu_.Lock();
    if (got.status().code() == absl::StatusCode::kAborted) return JobState::kRecovering;  // another fault
    if (!got.ok()) return WithContext(got.status(), absl::StrCat("fetching the state of ", Who(name), " from ", source));
    const v1::ShardSnapshot& snap = got->at(source).fetched_state();
    if (!snap.error().empty()) {
      return absl::InternalError(absl::StrCat("recovering ", Who(name), ": ", source, " has no state of step ",
                                              resume, ": ", snap.error()));
    }
    states[replacement[name].name()] = snap.data();
  }

  // The new world: the same plan with the replacements in the lost slots.
  v1::Plan plan = plan_;
  mu_.Unlock();
  const int64_t generation = workers_->NextGeneration();
  mu_.Lock();
  plan.set_generation(generation);
  std::set<std::string> taken;
  for (v1::RankAssignment& r : *plan.mutable_ranks()) {
    auto it = replacement.find(r.worker_name());
    if (it == replacement.end()) continue;
    PlaceRank(it->second, &r);
    taken.insert(it->second.name());
  }
  plan.set_comm_backend(CommBackendOf(job_, plan));
  plan.clear_spares();
  for (const std::string& s : plan_.spares()) {
    if (!taken.count(s)) plan.add_spares(s);
  }
  const std::map<std::string, std::string> buddies = Buddies(plan);
  for (const std::string& name : lost) own_snapshots_.erase(name);
  for (auto& [w, steps] : own_snapshots_) TrimAbove(&steps, resume);
  for (auto it = held_snapshots_.begin(); it != held_snapshots_.end();) {
    TrimAbove(&it->second.steps, resume);
    it = lost.count(it->second.holder) ? held_snapshots_.erase(it) : std::next(it);
  }
  for (const auto& [name, w] : replacement) {
    if (resume > 0) own_snapshots_[w.name()] = {resume};
  }
  const int64_t replayed = committed_ - resume;
  replayed_ += replayed;
  replayed_metric_->Increment(static_cast<double>(replayed));
  AppendStepsLine(absl::StrCat("{\"recovery\": ", restarts_, ", \"cause\": ", JsonQuote(FaultCauseName(first_fault.cause)),
                               ", \"worker\": ", JsonQuote(first_fault.worker), ", \"error\": ",
                               JsonQuote(cause.message()), ", \"resume_step\": ", resume, ", \"replayed_steps\": ",
                               replayed, ", \"generation\": ", generation, ", \"detail\": ", JsonQuote(recovery_),
                               "}"));
  RecoveryMark mark;
  mark.number = restarts_;
  mark.cause = FaultCauseName(first_fault.cause);
  mark.worker = first_fault.worker;
  mark.stage = StageOf(first_fault.worker);
  mark.source = lost.empty() ? "every worker's own memory (none lost)"
                             : absl::StrCat(absl::StrJoin(sources_described, "; "), "; survivors: their own memory");
  mark.error = std::string(cause.message());
  mark.detail = recovery_;
  mark.resume_step = resume;
  mark.replayed_steps = replayed;
  mark.generation = generation;
  mark.started = recovery_started_.value_or(clock_->Now());
  MarkRecovery(std::move(mark));
  committed_ = resume;
  next_step_ = resume + 1;
  setup_ = Setup{std::move(plan), resume, std::move(states), from_checkpoint};
  return JobState::kConfiguring;
}

void JobRunner::MarkRecovery(RecoveryMark mark) {
  for (RecoveryMark& m : recovery_marks_) {
    if (m.ended) continue;  // a fault during that recovery started this one
    m.ended = mark.started > m.started ? mark.started : clock_->Now();
    m.outcome = absl::StrCat("superseded by recovery ", mark.number);
  }
  recovery_marks_.push_back(std::move(mark));
  while (recovery_marks_.size() > kKeptRecoveryMarks) recovery_marks_.pop_front();
}

const JobRunner::Fault* JobRunner::FirstCause() const {
  for (const Fault& f : faults_) {
    if (f.cause == FaultCause::kWorkerLost || f.cause == FaultCause::kWorkerHung) return &f;
  }
  return faults_.empty() ? nullptr : &faults_.front();
}

absl::Status JobRunner::FaultsToStatus() {
  const Fault* f = FirstCause();
  if (f == nullptr) return absl::OkStatus();
  return absl::Status(f->code, f->why);
}

std::set<std::string> JobRunner::LostWorkers(const std::vector<v1::WorkerInfo>& list) {
  std::set<std::string> lost;
  for (const auto& [name, a] : assigned_) {
    bool alive = false;
    for (const v1::WorkerInfo& w : list) {
      if (w.name() == name && w.state() == v1::READY && w.incarnation() == incarnation_[name]) alive = true;
    }
    if (!alive) lost.insert(name);
  }
  for (const Fault& f : faults_) {
    if ((f.cause == FaultCause::kWorkerLost || f.cause == FaultCause::kWorkerHung) && assigned_.count(f.worker)) {
      lost.insert(f.worker);
    }
  }
  return lost;
}

int64_t JobRunner::ChooseResumeStep(const std::set<std::string>& lost,
                                    std::map<std::string, std::pair<std::string, std::string>>* sources) {
  std::vector<std::string> survivors;
  for (const auto& [name, a] : assigned_) {
    if (!lost.count(name)) survivors.push_back(name);
  }
  // Without ZeRO every rank of a (pp, tp)'s data-parallel group (its dp*cp
  // ranks: the DP replicas and, with cp > 1, their CP peers) holds the same
  // parameters, gradients and AdamW state, so any of them is a source. With
  // ZeRO stage >= 1 each holds other AdamW moments than the lost rank (its
  // own 1/(dp*cp) shard), so none can stand in for the lost one: only the
  // buddy holding the lost rank's own snapshot (kept by SlotOf, which tells
  // the (dp, cp) shards apart) can. With expert parallelism (ep = G > 1) a
  // DP replica holds the lost rank's experts only on the same slot
  // (dp_rank % G); the others hold other experts.
  const ParallelDims d = DimsOf(job_);
  const bool dp_replicas_are_sources = !d.sharded_optimizer();
  const int ep = std::max(1, d.ep);
  for (int64_t s = committed_; s > 0; --s) {
    bool ok = true;
    for (const std::string& w : survivors) ok &= Holds(own_snapshots_[w], s);
    if (!ok) continue;
    sources->clear();
    for (const std::string& name : lost) {
      const v1::RankAssignment& a = assigned_[name];
      for (const std::string& w : survivors) {  // a DP replica (or CP peer) of the same shard
        const v1::RankAssignment& b = assigned_[w];
        if (dp_replicas_are_sources && b.pp_rank() == a.pp_rank() && b.tp_rank() == a.tp_rank() &&
            b.dp_rank() % ep == a.dp_rank() % ep && Holds(own_snapshots_[w], s)) {
          (*sources)[name] = {w, w};
          break;
        }
      }
      if (sources->count(name)) continue;
      auto held = held_snapshots_.find(SlotOf(name));
      if (held != held_snapshots_.end() && !lost.count(held->second.holder) && assigned_.count(held->second.holder) &&
          Holds(held->second.steps, s)) {
        (*sources)[name] = {held->second.holder, held->second.owner};
        continue;
      }
      ok = false;
      break;
    }
    if (ok) return s;
  }
  sources->clear();
  for (const std::string& name : lost) (*sources)[name] = {"", ""};
  return 0;
}

std::map<std::string, std::string> JobRunner::Buddies(const v1::Plan& plan) const {
  std::vector<const v1::RankAssignment*> ranks;
  for (const v1::RankAssignment& r : plan.ranks()) ranks.push_back(&r);
  std::sort(ranks.begin(), ranks.end(), [](auto* a, auto* b) { return a->global_rank() < b->global_rank(); });
  std::map<std::string, std::string> buddies;
  const size_t n = ranks.size();
  if (n < 2) return buddies;
  for (size_t i = 0; i < n; ++i) {
    const v1::RankAssignment* pick = ranks[(i + 1) % n];
    for (size_t k = 1; k < n; ++k) {  // prefer another host
      const v1::RankAssignment* c = ranks[(i + k) % n];
      if (c->host() != ranks[i]->host()) {
        pick = c;
        break;
      }
    }
    buddies[ranks[i]->worker_name()] = pick->worker_name();
  }
  return buddies;
}

// ---------------------------------------------------------------------------
// Worker messages.

void JobRunner::OnWorkerLost(const std::string& worker, const std::string& why, bool hung) {
  absl::MutexLock lock(&mu_);
  if (!assigned_.count(worker) || IsFinal(state_)) return;
  for (const Fault& f : faults_) {
    if (f.worker == worker && f.cause != FaultCause::kWorkerError) return;
  }
  Fault f;
  f.worker = worker;
  f.cause = hung ? FaultCause::kWorkerHung : FaultCause::kWorkerLost;
  f.code = absl::StatusCode::kUnavailable;
  f.generation = generation_;
  // The first step it did not finish: the one sent ahead once it answered
  // the verdict on the step before.
  const int64_t unfinished =
      ahead_ && expect_case_ == v1::WorkerMessage::kStepDone && inbox_.count(worker) ? ahead_->step : next_step_;
  f.why = absl::StrCat(Who(worker), " was lost: ", why, "; step ", unfinished, " did not finish");
  BATON_LOG(ERROR) << f.why;
  faults_.push_back(std::move(f));
}

std::string JobRunner::StageOf(const std::string& worker) const {
  auto it = assigned_.find(worker);
  if (it == assigned_.end()) return "a spare";
  const v1::RankAssignment& r = it->second;
  const std::string cp = std::max(1, plan_.cp()) > 1 ? absl::StrCat(", cp ", r.cp_rank()) : "";
  return absl::StrCat("stage ", r.pp_rank(), " (tp ", r.tp_rank(), ", dp ", r.dp_rank(), cp, ")");
}

std::string JobRunner::SlotOf(const std::string& worker) const {
  auto it = assigned_.find(worker);
  if (it == assigned_.end()) return "";
  // With cp > 1 the cp rank too: the cp peers of a (pp, tp, dp) are
  // distinct shards under ZeRO 1 (shard index dp_rank * cp + cp_rank), and
  // each one's snapshot is held apart from its peers' in any case.
  const v1::RankAssignment& r = it->second;
  if (std::max(1, plan_.cp()) == 1) return absl::StrCat(r.pp_rank(), ".", r.tp_rank(), ".", r.dp_rank());
  return absl::StrCat(r.pp_rank(), ".", r.tp_rank(), ".", r.dp_rank(), ".", r.cp_rank());
}

std::string JobRunner::Who(const std::string& worker) const {
  return absl::StrCat(StageOf(worker), " (worker ", worker, ")");
}

void JobRunner::AddWorkerError(const std::string& worker, const std::string& why, absl::StatusCode code) {
  Fault f;
  f.worker = worker;
  f.cause = FaultCause::kWorkerError;
  f.code = code;
  f.generation = generation_;
  f.why = absl::StrCat(Who(worker), " ", why);
  BATON_LOG(ERROR) << f.why;
  faults_.push_back(std::move(f));
}

void JobRunner::OnWorkerMessage(const std::string& worker, v1::WorkerMessage message) {
  std::string relay_to;
  v1::CoordinatorMessage relay;
  {
    absl::MutexLock lock(&mu_);
    if (!assigned_.count(worker)) return;
    if (message.has_report() && (message.report().members_size() > 0 || groups_.count(worker))) {
      HandleGroupReport(worker, std::move(message), &relay_to, &relay);
    } else if (message.has_report()) {
      HandleReport(worker, std::move(message), &relay_to, &relay);
    } else {
      Handle(worker, std::move(message), &relay_to, &relay);
    }
  }
  if (!relay_to.empty()) workers_->Send(relay_to, relay);
}

void JobRunner::HandleReport(const std::string& worker, v1::WorkerMessage message, std::string* relay_to,
                             v1::CoordinatorMessage* relay) {
  if (message.report().has_step_done()) {
    v1::WorkerMessage done;
    done.mutable_step_done()->Swap(message.mutable_report()->mutable_step_done());
    message.mutable_report()->clear_step_done();
    Handle(worker, std::move(done), relay_to, relay);
  }
  Handle(worker, std::move(message), relay_to, relay);
}

void JobRunner::HandleGroupReport(const std::string& worker, v1::WorkerMessage message, std::string* relay_to,
                                  v1::CoordinatorMessage* relay) {
  v1::StepReport* report = message.mutable_report();
  auto group = groups_.find(worker);
  std::string broken;
  if (group == groups_.end()) {
    broken = absl::StrCat("sent the reports of ", report->members_size(), " members but leads no report group");
  } else if (report->error().empty() && report->members_size() != static_cast<int>(group->second.size())) {
    broken = absl::StrCat("sent the reports of ", report->members_size(), " members for a report group of ",
                          group->second.size() + 1, " ranks");
  }
  if (!broken.empty()) {
    if (GenerationOf(message) != generation_) return;  // from a world that no longer exists
    AddWorkerError(worker, absl::StrCat(broken, " (step ", report->step(), ")"), absl::StatusCode::kInternal);
    return;
  }
  // A leader whose gather failed reports its error with the members it has;
  // the rest are missing, as a lost worker's.
  const int members = std::min<int>(report->members_size(), group->second.size());
  for (int i = 0; i < members; ++i) {
    v1::WorkerMessage m;
    m.set_worker_id(message.worker_id());
    m.mutable_report()->Swap(report->mutable_members(i));
    HandleReport(group->second[i], std::move(m), relay_to, relay);
  }
  report->clear_members();
  HandleReport(worker, std::move(message), relay_to, relay);
}

void JobRunner::Handle(const std::string& worker, v1::WorkerMessage message, std::string* relay_to,
                       v1::CoordinatorMessage* relay) {
  const int64_t generation = GenerationOf(message);
  // From a world that no longer exists (a fetched state is matched by its request instead).
  if (generation != 0 && generation != generation_ && !message.has_fetched_state()) return;
  auto error_fault = [&](const std::string& what, const std::string& error, int32_t code)
                         ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (error.empty()) return;
    AddWorkerError(worker, absl::StrCat(what, ": ", error), CodeOr(code, absl::StatusCode::kInternal));
  };
  switch (message.body_case()) {
    case v1::WorkerMessage::kConfigured:
      if (!message.configured().ok()) {
        error_fault("cannot start", message.configured().error(),
                    message.configured().code() == 0 ? static_cast<int>(absl::StatusCode::kFailedPrecondition)
                                                     : message.configured().code());
      }
      break;
    case v1::WorkerMessage::kReport:
      error_fault(absl::StrCat("failed step ", message.report().step()), message.report().error(),
                  message.report().code());
      break;
    case v1::WorkerMessage::kStepDone:
      error_fault(absl::StrCat("failed step ", message.step_done().step()), message.step_done().error(),
                  message.step_done().code());
      break;
    case v1::WorkerMessage::kEvalReport:
      error_fault(absl::StrCat("failed the evaluation after step ", message.eval_report().step()),
                  message.eval_report().error(), message.eval_report().code());
      break;
    case v1::WorkerMessage::kSaved: {
      const v1::Saved& saved = message.saved();
      const bool periodic =
          saved.step() > 0 && pending_checkpoint_ && pending_checkpoint_->step == saved.step();
      if (!saved.ok()) {
        // A disk problem: failing the job beats training on without the checkpoint.
        error_fault(periodic ? absl::StrCat("could not write checkpoint step ", saved.step()) : "could not save",
                    saved.error(),
                    periodic || saved.code() == 0 ? static_cast<int>(absl::StatusCode::kFailedPrecondition)
                                                  : saved.code());
        break;
      }
      if (periodic) {
        pending_checkpoint_->copying.erase(worker);  // the files imply the copy
        if (!saved.copied()) {
          pending_checkpoint_->waiting.erase(worker);
          for (const std::string& f : saved.files()) pending_checkpoint_->files.push_back(f);
        }
        return;
      }
      if (saved.copied()) return;  // the final save's copy: its files follow
      break;
    }
    case v1::WorkerMessage::kSnapshot: {
      const v1::ShardSnapshot& snap = message.snapshot();
      if (snap.owner() != worker || snap.step() <= 0) return;
      PushBounded(&own_snapshots_[worker], snap.step(), kOwnSnapshots);
      if (snap.step() > stall_step_) {
        stall_step_ = snap.step();
        snapshot_stall_seconds_ = 0;
      }
      if (snap.step() == stall_step_ && std::isfinite(snap.capture_seconds())) {
        snapshot_stall_seconds_ = std::max(snapshot_stall_seconds_, std::clamp(snap.capture_seconds(), 0.0, 3600.0));
      }
      auto buddy = buddy_.find(worker);
      if (buddy == buddy_.end() || snap.data().empty()) return;  // kept by its owner only
      // Any size the session took (a snapshot over 3 MiB came, and is relayed,
      // as fragments: docs/protocol.md, "Fragments").
      Held& held = held_snapshots_[SlotOf(worker)];
      if (held.holder != buddy->second || held.owner != worker) held = Held{buddy->second, worker, {}};
      PushBounded(&held.steps, snap.step(), kHeldSnapshots);
      *relay_to = buddy->second;
      *relay->mutable_hold_snapshot() = snap;
      break;
    }
    default:
      break;
  }
  if (message.body_case() == expect_case_ && expect_from_->contains(worker) &&
      (expect_step_ == 0 || StepOf(message) == expect_step_)) {
    inbox_[worker] = std::move(message);
  } else if (ahead_ && message.body_case() == v1::WorkerMessage::kReport && ahead_->from->contains(worker) &&
             StepOf(message) == ahead_->step) {
    ahead_->inbox[worker] = std::move(message);
  }
}

void JobRunner::SendAll(const v1::CoordinatorMessage& message) {
  std::vector<std::string> names;
  {
    absl::MutexLock lock(&mu_);
    names.reserve(assigned_.size());
    for (const auto& [name, a] : assigned_) names.push_back(name);
  }
  // Session sends only queue (coordinator_service.h): one thread sends to
  // every worker (the 16-thread fan-out this replaced measured no faster,
  // docs/BENCHMARKS.md "Control plane at scale").
  workers_->SendEach(names, message);
}

void JobRunner::SendRunStep(const v1::CoordinatorMessage& message) {
  std::vector<std::string> leaders;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [leader, members] : groups_) leaders.push_back(leader);
  }
  if (leaders.empty()) {
    SendAll(message);
  } else {
    workers_->SendEach(leaders, message);
  }
}

void JobRunner::Expect(v1::WorkerMessage::BodyCase what, int64_t step, std::shared_ptr<const WorkerSet> from) {
  absl::MutexLock lock(&mu_);
  expect_case_ = what;
  expect_step_ = step;
  expect_from_ = std::move(from);
  inbox_.clear();
  if (what != v1::WorkerMessage::kStepDone) ahead_.reset();
}

bool JobRunner::WaitUntil(const std::function<bool()>& cond, absl::Time deadline) {
  for (;;) {
    if (cond()) return true;
    const absl::Time now = clock_->Now();
    if (now >= deadline) return false;
    mu_.AwaitWithTimeout(absl::Condition(&cond), std::min(deadline - now, options_.poll));
  }
}

absl::StatusOr<std::map<std::string, v1::WorkerMessage>> JobRunner::Collect(absl::Duration timeout,
                                                                          const char* what, bool complete_wins) {
  absl::MutexLock lock(&mu_);
  WaitUntil(
      [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return !faults_.empty() || stopping_ || inbox_.size() >= expect_from_->size();
      },
      clock_->Now() + timeout);
  expect_case_ = v1::WorkerMessage::BODY_NOT_SET;
  if (stopping_) return absl::CancelledError("coordinator shutting down");
  if (!faults_.empty()) {
    // Every answer in, none failed: the fault is the next step's (sent
    // ahead), and this step stands.
    const bool stands = complete_wins && inbox_.size() >= expect_from_->size() &&
                        std::none_of(inbox_.begin(), inbox_.end(), [](const auto& kv) {
                          return kv.second.has_step_done() && !kv.second.step_done().error().empty();
                        });
    if (!stands) return absl::AbortedError("a worker failed");
  }
  if (inbox_.size() < expect_from_->size()) {
    std::vector<std::string> missing;
    for (const std::string& name : *expect_from_) {
      if (!inbox_.count(name)) missing.push_back(absl::StrCat(name, " (", StageOf(name), ")"));
    }
    std::sort(missing.begin(), missing.end());
    return absl::DeadlineExceededError(absl::StrCat("no ", what, " within ", absl::FormatDuration(timeout),
                                                    " from ", absl::StrJoin(missing, ", ")));
  }
  std::map<std::string, v1::WorkerMessage> out;
  out.swap(inbox_);
  return out;
}

// ---------------------------------------------------------------------------
// Step results.

double JobRunner::Aggregate(const std::map<std::string, v1::WorkerMessage>& reports, double* loss, int64_t* correct,
                            int64_t* predicted, bool* finite) {
  double sq = 0, loss_sum = 0;
  int losses = 0;
  // The gradients are reduced over the data-parallel group: the dp*cp ranks
  // of one (pp, tp) (with cp > 1 the CP ranks reduce with the DP replicas as
  // one group, averaging over dp*cp). Without ZeRO every rank of the group
  // holds the same averaged gradients, so the rank of dp 0 and cp 0 counts
  // for all; with ZeRO stage >= 1 each rank of the group reports the squared
  // norm of its own shard's averaged gradient only, and the shards together
  // are the whole: every rank counts (in the map's name order, the same
  // order every step).
  //
  // With expert parallelism (parallel.ep = G > 1, no ZeRO) the dense
  // parameters' gradients are the same on every rank of the group, but an
  // expert's only on the dp ranks of its slot (dp_rank % G): dp ranks 0 ..
  // G-1 (cp 0; MoE runs without cp) hold every expert between them. Each
  // of them reports its own experts' squared norm, dp 0 the dense
  // parameters' too; the ranks of the other expert groups report what must
  // not be added again.
  //
  // The loss: each last-stage rank's mean over its own scored tokens (one TP
  // rank of each counts, its TP peers hold the same). A DP replica's is its
  // ranks' mean; with cp > 1 a replica's CP ranks hold different tokens of
  // the same sequences, and not necessarily as many scored ones (ignored
  // targets), so its loss is their means weighted by their scored tokens
  // (`predicted`): the replica's mean over all its tokens, as the workers'
  // gradient scale (GptStage) counts them (the plain mean where none says
  // how many it scored). The replicas' losses are averaged.
  const bool every_rank = DimsOf(job_).sharded_optimizer();
  const bool cp = DimsOf(job_).cp > 1;
  const int norm_dp_ranks = every_rank ? 0 : DimsOf(job_).ep;  // dp ranks [0, this) count, cp rank 0
  struct Replica {
    double weighted = 0, plain = 0;  // Σ loss · tokens, Σ loss
    int64_t tokens = 0;
    int reporters = 0;
  };
  std::map<int, Replica> replicas;  // cp > 1, by dp rank
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [name, msg] : reports) {
      const v1::StepReport& r = msg.report();
      const v1::RankAssignment& rank = assigned_[name];
      *finite &= r.finite();
      if (every_rank || (rank.dp_rank() < norm_dp_ranks && rank.cp_rank() == 0)) sq += r.grad_sq_norm();
      if (r.has_loss() && rank.tp_rank() == 0) {
        if (cp) {
          Replica& replica = replicas[rank.dp_rank()];
          replica.weighted += r.loss() * static_cast<double>(r.predicted());
          replica.plain += r.loss();
          replica.tokens += r.predicted();
          ++replica.reporters;
        } else {
          loss_sum += r.loss();
          ++losses;
        }
        *correct += r.correct();
        *predicted += r.predicted();
      }
    }
  }
  for (const auto& [dp_rank, replica] : replicas) {
    loss_sum += replica.tokens > 0 ? replica.weighted / static_cast<double>(replica.tokens)
                                   : replica.plain / replica.reporters;
    ++losses;
  }
  *loss = losses > 0 ? loss_sum / losses : 0;
  const double norm = std::sqrt(sq);
  *finite &= std::isfinite(norm) && std::isfinite(*loss);
  return norm;
}

void JobRunner::RecordStep(int64_t step, bool committed, bool traced, double loss, double accuracy, double norm,
                           double clip, double wall, int64_t epoch,
                           const std::map<std::string, v1::WorkerMessage>& done) {
  const ParallelDims d = DimsOf(job_);
  const double tokens = static_cast<double>(job_.schedule().microbatches()) * job_.train().micro_batch_size() *
                        std::max(1, job_.model().seq_len()) * d.dp;
  StepRecord rec;
  rec.step = step;
  rec.committed = committed;
  rec.loss = loss;
  rec.accuracy = accuracy;
  rec.grad_norm = norm;
  rec.clip = clip;
  rec.wall = wall;
  rec.tokens_per_second = tokens / wall;
  rec.epoch = epoch;
  double bubble = 0, comm = 0, worker_wall = 0;
  // The most any one worker sent or holds (the rank that bounds the job).
  int64_t max_tp_bytes = 0, max_dp_bytes = 0, max_cp_bytes = 0, max_weights = 0, max_grads = 0, max_optimizer = 0, max_activations = 0;
  std::map<int, v1::StageStatus> stages;
  // Mixture of Experts (MoE jobs only; a dense job's line is as before).
  // Every TP rank of a stage routes the same tokens, so only TP rank 0's
  // counts and loss are taken: per expert index, the choices routed and
  // kept over every pipeline stage and DP replica; the load-balancing loss
  // summed over the stages of a replica, then averaged over the replicas
  // (as the cross-entropy). Per stage, the dropped share for GetStatus.
  const bool moe = job_.model().has_moe();
  std::vector<int64_t> moe_routed, moe_kept;
  double moe_aux = 0;
  std::map<int, std::pair<int64_t, int64_t>> stage_moe;  // pp rank -> (routed, kept)
  bool replay = false;
  std::optional<absl::Duration> recovered_in;
  {
    absl::MutexLock lock(&mu_);
    committed_ = step;
    next_step_ = step + 1;
    replay = step <= recorded_;
    if (recovery_started_) {
      recovered_in = clock_->Now() - *recovery_started_;
      recovery_started_.reset();
      for (RecoveryMark& m : recovery_marks_) {
        if (m.ended) continue;
        m.ended = clock_->Now();
        m.outcome = "recovered";
      }
    }
    if (replay) {
      // The replay must reproduce the record bit for bit (data and state are
      // pure functions of the seed and the step).
      for (const StepRecord& old : steps_) {
        if (old.step == step && (Num(old.loss) != Num(loss) || Num(old.grad_norm) != Num(norm))) {
          BATON_LOG(ERROR) << "replayed step " << step << " differs from its first run: loss " << Num(loss)
                           << " vs " << Num(old.loss) << ", grad norm " << Num(norm) << " vs " << Num(old.grad_norm);
        }
      }
    }
  }
  if (recovered_in) {
    recovery_seconds_metric_->Observe(absl::ToDoubleSeconds(*recovered_in));
    AppendStepsLine(absl::StrCat("{\"recovered\": ", step, ", \"seconds\": ", Num(absl::ToDoubleSeconds(*recovered_in)),
                                 "}"));
  }
  if (replay) return;
  {
    absl::MutexLock lock(&mu_);
    recorded_ = step;
    for (const auto& [name, msg] : done) {
      const v1::StepDone& s = msg.step_done();
      const double c = s.comm_p2p_seconds() + s.comm_tp_seconds() + s.comm_dp_seconds() + s.comm_cp_seconds() +
                       s.comm_all_to_all_seconds();
      bubble += s.bubble_seconds();
      comm += c;
      worker_wall += s.wall_seconds();
      max_tp_bytes = std::max(max_tp_bytes, s.comm_tp_bytes());
      max_dp_bytes = std::max(max_dp_bytes, s.comm_dp_bytes());
      max_cp_bytes = std::max(max_cp_bytes, s.comm_cp_bytes());
      max_weights = std::max(max_weights, s.weights_bytes());
      max_grads = std::max(max_grads, s.grads_bytes());
      max_optimizer = std::max(max_optimizer, s.optimizer_bytes());
      max_activations = std::max(max_activations, s.activation_bytes());
      v1::StageStatus& st = stages[assigned_[name].pp_rank()];
      st.set_pp_rank(assigned_[name].pp_rank());
      st.set_step(step);
      st.set_bubble_ratio(st.bubble_ratio() + s.bubble_seconds() / std::max(1e-9, s.wall_seconds()));
      st.set_comm_ratio(st.comm_ratio() + c / std::max(1e-9, s.wall_seconds()));
      st.set_weights_bytes(std::max(st.weights_bytes(), s.weights_bytes()));
      st.set_grads_bytes(std::max(st.grads_bytes(), s.grads_bytes()));
      st.set_optimizer_bytes(std::max(st.optimizer_bytes(), s.optimizer_bytes()));
      st.set_activation_bytes(std::max(st.activation_bytes(), s.activation_bytes()));
      st.add_workers(name);
      if (moe && assigned_[name].tp_rank() == 0) {
        auto add = [](std::vector<int64_t>& sum, const auto& v) {
          if (sum.size() < static_cast<size_t>(v.size())) sum.resize(v.size(), 0);
          for (int e = 0; e < v.size(); ++e) sum[e] += v[e];
        };
        add(moe_routed, s.moe_routed_tokens());
        add(moe_kept, s.moe_kept_tokens());
        moe_aux += s.moe_aux_loss();
        std::pair<int64_t, int64_t>& in_stage = stage_moe[assigned_[name].pp_rank()];
        for (int64_t n : s.moe_routed_tokens()) in_stage.first += n;
        for (int64_t n : s.moe_kept_tokens()) in_stage.second += n;
      }
    }
    for (const auto& [pp, counts] : stage_moe) {
      stages[pp].set_moe_dropped_ratio(DroppedRatio(counts.first, counts.second));
    }
    for (auto& [pp, st] : stages) {
      const double n = st.workers_size();
      st.set_bubble_ratio(st.bubble_ratio() / n);
      st.set_comm_ratio(st.comm_ratio() / n);
      st.set_tokens_per_second(rec.tokens_per_second);
      if (pp == d.pp - 1) st.set_loss(loss);
    }
    rec.bubble_ratio = worker_wall > 0 ? bubble / worker_wall : 0;
    rec.comm_ratio = worker_wall > 0 ? comm / worker_wall : 0;
    stage_status_.clear();
    for (auto& [pp, st] : stages) stage_status_.push_back(st);
    steps_.push_back(rec);
    total_tokens_ += tokens;
    total_wall_ += wall;
    sum_bubble_ += bubble;
    sum_comm_ += comm;
    sum_worker_wall_ += worker_wall;
    if (traced) {
      std::map<std::string, v1::StepDone> events;
      for (const auto& [name, msg] : done) events[name] = msg.step_done();
      traces_.emplace_back(step, std::move(events));
      while (static_cast<int>(traces_.size()) > std::max(1, options_.max_kept_traces)) traces_.pop_front();
    }
  }
  step_metric_->Set(static_cast<double>(step));
  if (committed) {
    loss_metric_->Set(loss);
  } else {
    discarded_metric_->Increment();
    BATON_LOG(WARNING) << "step " << step << " discarded: non-finite loss or gradient norm";
  }
  std::string moe_fields;
  if (moe) {
    int64_t routed = 0, kept = 0, most = 0;
    for (int64_t n : moe_routed) {
      routed += n;
      most = std::max(most, n);
    }
    for (int64_t n : moe_kept) kept += n;
    // The most loaded expert's routed choices over the mean expert's: 1 is
    // perfectly balanced, E when one expert gets every choice.
    const double mean = moe_routed.empty() ? 0 : static_cast<double>(routed) / static_cast<double>(moe_routed.size());
    moe_fields = absl::StrCat(", \"moe_aux_loss\": ", Num(moe_aux / std::max(1, d.dp)),
                              ", \"moe_dropped_ratio\": ", Num(DroppedRatio(routed, kept)),
                              ", \"moe_load_imbalance\": ", Num(mean > 0 ? static_cast<double>(most) / mean : 0));
  }
  AppendStepsLine(absl::StrCat(
      "{\"step\": ", step, ", \"committed\": ", committed ? "true" : "false", ", \"loss\": ", Num(loss),
      ", \"accuracy\": ", Num(rec.accuracy), ", \"grad_norm\": ", Num(norm), ", \"clip\": ", Num(clip),
      ", \"wall_seconds\": ", Num(wall), ", \"tokens_per_second\": ", Num(rec.tokens_per_second),
      ", \"bubble_ratio\": ", Num(rec.bubble_ratio), ", \"comm_ratio\": ", Num(rec.comm_ratio),
      ", \"epoch\": ", epoch, ", \"max_tp_bytes\": ", max_tp_bytes, ", \"max_dp_bytes\": ", max_dp_bytes,
      ", \"max_cp_bytes\": ", max_cp_bytes,
      ", \"max_weights_bytes\": ", max_weights, ", \"max_grads_bytes\": ", max_grads,
      ", \"max_optimizer_bytes\": ", max_optimizer, ", \"max_activation_bytes\": ", max_activations, moe_fields,
      "}"));
}

bool JobRunner::CheckpointDue(int64_t step) const {
  const int64_t every = job_.checkpoint().every_steps();
  return every > 0 && !job_.checkpoint().dir().empty() && step % every == 0;
}

bool JobRunner::MaybeStartCheckpoint(int64_t step) {
  if (!CheckpointDue(step)) return false;
  v1::CoordinatorMessage save;
  {
    absl::MutexLock lock(&mu_);
    if (step <= checkpoint_step_ || pending_checkpoint_) return false;  // saved already, or one is being written
    PendingCheckpoint p;
    p.step = step;
    p.dir = job_.checkpoint().dir() + "/" + checkpoint::StepDirName(step);
    // Every rank answers a save: the writers (dp rank 0, cp rank 0) first
    // that their state is copied, then with its files; the others (and under
    // ZeRO 1 the group's gatherers other than its rank 0) once, with no
    // files, which ends their wait at once (Handle).
    for (const auto& [name, a] : assigned_) p.waiting.insert(name);
    p.copying = p.waiting;
    save.mutable_save_weights()->set_dir(p.dir);
    pending_checkpoint_ = std::move(p);
  }
  save.mutable_save_weights()->set_step(step);
  save.mutable_save_weights()->set_with_state(true);
  SendAll(save);
  return true;
}

absl::Status JobRunner::FinishCheckpoint() {
  PendingCheckpoint p;
  {
    absl::MutexLock lock(&mu_);
    if (!pending_checkpoint_ || !pending_checkpoint_->waiting.empty()) return absl::OkStatus();
    p = std::move(*pending_checkpoint_);
    pending_checkpoint_.reset();
  }
  std::sort(p.files.begin(), p.files.end());
  BATON_RETURN_IF_ERROR_CTX(checkpoint::WriteManifest(p.dir, checkpoint::ManifestFor(job_, p.step, p.files)),
                            "checkpoint of step ", p.step);
  absl::StatusOr<std::vector<std::string>> pruned =
      checkpoint::PruneCheckpoints(job_.checkpoint().dir(), checkpoint::CheckpointKeep(job_));
  if (!pruned.ok()) BATON_LOG(WARNING) << "pruning checkpoints: " << pruned.status();
  BATON_LOG(INFO) << "job '" << job_.name() << "': checkpoint of step " << p.step << " complete in " << p.dir;
  AppendStepsLine(absl::StrCat("{\"checkpoint\": ", p.step, ", \"dir\": ", JsonQuote(p.dir), "}"));
  absl::MutexLock lock(&mu_);
  checkpoint_step_ = p.step;
  checkpoint_dir_ = p.dir;
  return absl::OkStatus();
}

void JobRunner::AppendStepsLine(const std::string& line) {
  if (options_.out_dir.empty()) return;
  std::ofstream out(options_.out_dir + "/steps.jsonl", std::ios::app);
  out << line << "\n";
}

absl::Status JobRunner::WriteOutputs() {
  std::string summary;
  {
    absl::MutexLock lock(&mu_);
    const StepRecord last = steps_.empty() ? StepRecord() : steps_.back();
    summary = absl::StrCat(
        "{\"job\": ", JsonQuote(job_.name()), ", \"state\": ", JsonQuote(JobStateName(state_ == JobState::kSaving ? JobState::kDone : state_)),
        ", \"steps\": ", steps_.size(), ", \"final_loss\": ", Num(last.loss),
        ", \"final_accuracy\": ", Num(last.accuracy),
        ", \"tokens_per_second\": ", Num(total_wall_ > 0 ? total_tokens_ / total_wall_ : 0),
        ", \"bubble_ratio\": ", Num(sum_worker_wall_ > 0 ? sum_bubble_ / sum_worker_wall_ : 0),
        ", \"comm_ratio\": ", Num(sum_worker_wall_ > 0 ? sum_comm_ / sum_worker_wall_ : 0),
        ", \"expected_bubble_ratio\": ", Num(expected_bubble_), ", \"wall_seconds\": ", Num(total_wall_),
        ", \"discarded_steps\": ", std::count_if(steps_.begin(), steps_.end(), [](const StepRecord& r) {
          return !r.committed;
        }),
        ", \"recoveries\": ", restarts_, ", \"replayed_steps\": ", replayed_,
        eval_step_ > 0 ? absl::StrCat(", \"eval_step\": ", eval_step_, ", \"eval_loss\": ", Num(eval_loss_),
                                      ", \"eval_perplexity\": ", Num(std::exp(eval_loss_)))
                       : std::string(),
        ", \"error\": ", JsonQuote(error_.message()), "}\n");
  }
  BATON_RETURN_IF_ERROR(
      WriteFileAtomically(options_.out_dir + "/trace.json", TraceJson(options_.traced_steps, absl::ZeroDuration())));
  return WriteFileAtomically(options_.out_dir + "/summary.json", summary);
}

void JobRunner::FillStatus(v1::GetStatusResponse* status) const {
  absl::MutexLock lock(&mu_);
  status->set_job_state(JobStateName(state_));
  if (!error_.ok()) status->set_job_error(std::string(error_.message()));
  status->set_total_steps(job_.train().steps());
  status->set_expected_bubble_ratio(expected_bubble_);
  if (!steps_.empty()) {
    const StepRecord& r = steps_.back();
    status->set_step(r.step);
    status->set_loss(r.loss);
    status->set_accuracy(r.accuracy);
    status->set_tokens_per_second(r.tokens_per_second);
    status->set_bubble_ratio(r.bubble_ratio);
    status->set_comm_ratio(r.comm_ratio);
    status->set_epoch(r.epoch);
  }
  for (const v1::StageStatus& s : stage_status_) *status->add_stages() = s;
  status->set_recovery(recovery_);
  status->set_recoveries(restarts_);
  status->set_replayed_steps(replayed_);
  if (eval_step_ > 0) {
    status->set_eval_step(eval_step_);
    status->set_eval_loss(eval_loss_);
    status->set_eval_perplexity(std::exp(eval_loss_));
  }
}

std::string JobRunner::TraceJson(int steps, absl::Duration wait) {
  absl::MutexLock lock(&mu_);
  steps = std::min(steps, options_.max_kept_traces);
  // Training: running, or saving a periodic checkpoint between two steps.
  auto training = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return state_ == JobState::kRunning || (state_ == JobState::kSaving && next_step_ <= job_.train().steps());
  };
  if (training() && wait > absl::ZeroDuration()) {
    const int64_t after = next_step_ - 1;  // steps are numbered from the checkpoint a job resumed at
    trace_requested_ = std::max(trace_requested_, steps);
    auto traced = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      int n = 0;
      for (const auto& t : traces_) n += t.first > after;
      return n >= steps || !training() || stopping_;
    };
    mu_.AwaitWithTimeout(absl::Condition(&traced), wait);
  }
  std::vector<TraceSpan> spans;
  const int skip = std::max(0, static_cast<int>(traces_.size()) - std::max(0, steps));
  int index = 0;
  for (const auto& [step, workers] : traces_) {
    if (index++ < skip) continue;
    for (const auto& [name, done] : workers) {
      const std::string process = absl::StrCat(StageOf(name), " / ", name);
      for (const v1::TraceEvent& e : done.events()) {
        const bool compute = e.cat() == "compute";
        spans.push_back({process, compute ? "compute" : "comm", e.name(), e.cat(), e.start_us(), e.duration_us()});
      }
    }
  }
  const absl::Time now = clock_->Now();
  for (const RecoveryMark& m : recovery_marks_) {
    const absl::Time end = m.ended.value_or(now);
    TraceSpan span{"coordinator", "recovery",
                   absl::StrCat("recovery ", m.number, ": ", m.cause, m.worker.empty() ? "" : " of ", m.worker),
                   "recovery", absl::ToUnixMicros(m.started), absl::ToInt64Microseconds(end - m.started)};
    span.args = {{"cause", m.cause},
                 {"lost_worker", m.worker},
                 {"stage", m.worker.empty() ? "" : m.stage},
                 {"state_from", m.source},
                 {"resume_step", absl::StrCat(m.resume_step)},
                 {"replayed_steps", absl::StrCat(m.replayed_steps)},
                 {"generation", absl::StrCat(m.generation)},
                 {"seconds", absl::StrFormat("%.3f", absl::ToDoubleSeconds(end - m.started))},
                 {"outcome", !m.outcome.empty()                 ? m.outcome
                             : state_ == JobState::kFailed ? "failed"
                                                           : "in progress"},
                 {"error", m.error},
                 {"detail", m.detail}};
    spans.push_back(std::move(span));
  }
  return ChromeTraceJson(spans);
}

}  // namespace baton
