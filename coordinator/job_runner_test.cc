// The job driver's transitions against fake workers and a fake clock: the
// happy path, recovery from a lost worker (spare, same name returning, DP
// replica, buddy snapshot), the replacement timeout, max_restarts, a second
// fault during recovery and "the first cause wins".
#include "coordinator/job_runner.h"

#include <cmath>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/strings/str_split.h"
#include "common/file_io.h"
#include "common/json.h"
#include "common/report_group.h"
#include "gtest/gtest.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"

namespace baton {
namespace {

// Workers that answer every command at once (synchronously, from Send).
class FakeWorkers : public JobWorkers {
 public:
  // Runs before a command is answered; return false to swallow it (the
  // worker does not answer, e.g. because the hook killed it).
  using Hook = std::function<bool(const std::string& worker, const v1::CoordinatorMessage& m)>;

  explicit FakeWorkers(int n) {
    for (int i = 0; i < n; ++i) Add(absl::StrCat("worker-", i));
  }
  void Add(const std::string& name) {
    absl::MutexLock lock(&mu_);
    v1::WorkerInfo w;
    w.set_name(name);
    w.set_worker_id(next_id_++);
    w.set_incarnation(next_id_++);
    w.set_host("host");
    w.set_device("cpu");
    w.set_state(v1::READY);
    w.set_verdict_in_run_step(true);  // as every baton worker registers
    workers_[name] = w;
  }
  // `name` registers as a worker from before RunStep carried verdicts: it
  // ignores RunStep.commit / discard, as an older binary ignores fields it
  // does not know.
  void SetOldProtocol(const std::string& name) {
    absl::MutexLock lock(&mu_);
    workers_[name].set_verdict_in_run_step(false);
  }
  // `name` answers every StepDone apart, as a worker from before
  // RunStep.step_done_in_report (it ignores the field).
  void SetStepDoneApart(const std::string& name) {
    absl::MutexLock lock(&mu_);
    done_apart_.insert(name);
  }
  // Every worker registers report_groups: under a plan with report groups
  // a leader passes RunStep on to its group's members (as over the group's
  // communicator; the hook sees each) and sends their reports inside its
  // own. `drop_members` makes leaders leave them out (a broken leader);
  // `columns`: the workers also register report_group_columns (groups of
  // several columns), as baton-worker does.
  void SetReportGroups(bool drop_members = false, bool columns = false) {
    absl::MutexLock lock(&mu_);
    for (auto& [name, w] : workers_) {
      w.set_report_groups(true);
      w.set_report_group_columns(columns);
    }
    drop_members_ = drop_members;
  }
  // Reports whose numbers depend on the rank (grad_sq_norm by pp, dp and cp
  // rank, the loss from the last stage only, by dp and cp rank), so a report
  // counted under the wrong worker or left out changes the step's record.
  void SetRankDependentReports() {
    absl::MutexLock lock(&mu_);
    rank_dependent_ = true;
  }
  // Each StepDone counts `seconds` of expert-parallel exchanges
  // (comm_all_to_all_seconds) in its wall time.
  void SetAllToAllSeconds(double seconds) {
    absl::MutexLock lock(&mu_);
    all_to_all_seconds_ = seconds;
  }
  // The RunStep steps `worker` got from its leader, in order.
  std::vector<int64_t> StepsPassedOn(const std::string& worker) const {
    absl::MutexLock lock(&mu_);
    auto it = passed_.find(worker);
    return it == passed_.end() ? std::vector<int64_t>() : it->second;
  }
  // How many StepDone messages of their own `worker` sent, and how many
  // rode inside a report.
  int StepDonesApart(const std::string& worker) const {
    absl::MutexLock lock(&mu_);
    auto it = dones_apart_.find(worker);
    return it == dones_apart_.end() ? 0 : it->second;
  }
  int StepDonesInReports(const std::string& worker) const {
    absl::MutexLock lock(&mu_);
    auto it = dones_in_reports_.find(worker);
    return it == dones_in_reports_.end() ? 0 : it->second;
  }
  void SetDevice(const std::string& name, const std::string& device, const std::string& uuid = "") {
    absl::MutexLock lock(&mu_);
    workers_[name].set_device(device);
    workers_[name].set_device_uuid(uuid);
  }
  // `name` held shard (pp, 0, dp) of job "unit" at `generation` with snapshots of `steps`.
  void SetHeld(const std::string& name, int pp, int dp, int64_t generation, std::vector<int64_t> steps,
               int cp = 0) {
    absl::MutexLock lock(&mu_);
    v1::HeldJob* h = workers_[name].mutable_held();
    h->set_job("unit");
    h->set_generation(generation);
    h->set_pp_rank(pp);
    h->set_dp_rank(dp);
    h->set_cp_rank(cp);
    for (int64_t s : steps) {
      h->add_steps(s);
      own_[name][s] = absl::StrCat(pp, ".0@", s);
    }
  }
  void set_runner(JobRunner* runner) { runner_ = runner; }
  // What each snapshot reports as its capture stall.
  void set_capture_seconds(double seconds) {
    absl::MutexLock lock(&mu_);
    capture_seconds_ = seconds;
  }
  // Pads every snapshot's state to `bytes` (a big stage's state).
  void set_state_padding(size_t bytes) {
    absl::MutexLock lock(&mu_);
    state_padding_ = bytes;
  }
  // The steps whose Commit (a message or inside RunStep) asked `worker` for
  // a snapshot, in order.
  std::vector<int64_t> SnapshotSteps(const std::string& worker) const {
    std::vector<int64_t> steps;
    for (const auto& m : Sent(worker)) {
      const v1::Commit* c = m.has_commit() ? &m.commit() : m.run_step().has_commit() ? &m.run_step().commit() : nullptr;
      if (c != nullptr && c->snapshot()) steps.push_back(c->step());
    }
    return steps;
  }
  void set_hook(Hook hook) {
    absl::MutexLock lock(&mu_);
    hook_ = std::move(hook);
  }

  // The worker's process dies: its session ends.
  void Kill(const std::string& name) {
    {
      absl::MutexLock lock(&mu_);
      workers_[name].set_state(v1::LOST);
      own_.erase(name);
      held_.erase(name);
    }
    runner_->OnWorkerLost(name, "its session ended");
  }
  // The same name registers again (a new process, no state).
  void Restart(const std::string& name) {
    absl::MutexLock lock(&mu_);
    workers_[name].set_state(v1::READY);
    workers_[name].set_incarnation(next_id_++);
  }

  std::vector<v1::WorkerInfo> List() const override {
    absl::MutexLock lock(&mu_);
    std::vector<v1::WorkerInfo> out;
    for (const auto& [name, w] : workers_) out.push_back(w);
    return out;
  }
  int64_t NextGeneration() override {
    absl::MutexLock lock(&mu_);
    return ++generation_;
  }

  // A RunStep that carries the previous step's verdict reaches the hook and
  // is answered as the two messages it stands for, the verdict first (what
  // WorkerJob does; with step_done_in_report the StepDone of a verdict that
  // asks no snapshot rides in the report); a worker of the old protocol sees
  // only the RunStep.
  bool Send(const std::string& worker, const v1::CoordinatorMessage& m) override {
    std::vector<std::string> members;
    {
      absl::MutexLock lock(&mu_);
      if (workers_[worker].state() != v1::READY) return false;
      sent_[worker].push_back(m);
      if (m.has_run_step()) members = MembersLedBy(worker);
    }
    if (members.empty()) return Deliver(worker, m, nullptr);
    // A leader: passes the RunStep on to each member in pp order first (so
    // the verdict reaches them even if the leader then dies), runs its own
    // step and sends the members' reports inside its own.
    std::vector<v1::StepReport> theirs;
    std::string missing;
    for (const std::string& member : members) {
      {
        absl::MutexLock lock(&mu_);
        if (workers_[member].state() == v1::READY) passed_[member].push_back(m.run_step().step());
      }
      std::optional<v1::WorkerMessage> report;
      Deliver(member, m, &report);
      if (!report) {
        if (missing.empty()) missing = member;
        continue;
      }
      theirs.push_back(report->report());
    }
    std::optional<v1::WorkerMessage> report;
    Deliver(worker, m, &report);
    if (!report) return true;  // the leader died
    if (!missing.empty()) {  // as a leader's gather from a dead member fails
      report->mutable_report()->set_error(absl::StrCat("no report from ", missing));
      report->mutable_report()->set_code(static_cast<int>(absl::StatusCode::kUnavailable));
    } else {
      absl::MutexLock lock(&mu_);
      if (!drop_members_) {
        for (v1::StepReport& r : theirs) *report->mutable_report()->add_members() = std::move(r);
      }
    }
    runner_->OnWorkerMessage(worker, *report);
    return true;
  }

  std::vector<v1::CoordinatorMessage> Sent(const std::string& worker) const {
    absl::MutexLock lock(&mu_);
    auto it = sent_.find(worker);
    return it == sent_.end() ? std::vector<v1::CoordinatorMessage>() : it->second;
  }
  // The RunStep steps `worker` was asked to run, in order.
  std::vector<int64_t> StepsRun(const std::string& worker) const {
    std::vector<int64_t> steps;
    for (const auto& m : Sent(worker)) {
      if (m.has_run_step()) steps.push_back(m.run_step().step());
    }
    return steps;
  }
  std::vector<v1::Configure> Configures(const std::string& worker) const {
    std::vector<v1::Configure> out;
    for (const auto& m : Sent(worker)) {
      if (m.has_configure()) out.push_back(m.configure());
    }
    return out;
  }
  // The committed step `worker`'s model is at.
  int64_t ModelStep(const std::string& worker) const {
    absl::MutexLock lock(&mu_);
    auto it = model_step_.find(worker);
    return it == model_step_.end() ? 0 : it->second;
  }

 private:
  // The members `worker` leads when the live plan has report groups (none
  // otherwise): the other ranks of its group (common/report_group.h) by seat.
  std::vector<std::string> MembersLedBy(const std::string& worker) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto leader = rank_.find(worker);
    if (leader == rank_.end() || !plan_of_[worker].report_groups()) return {};
    const v1::Plan& plan = plan_of_[worker];
    auto seat = [&plan](const v1::RankAssignment& r) {
      return ReportGroupSeatOf(plan.pp(), plan.tp(), plan.dp(), plan.report_group_columns(), r.pp_rank(),
                               r.tp_rank(), r.dp_rank());
    };
    const ReportGroupSeat mine = seat(leader->second);
    if (mine.rank != 0) return {};
    std::map<int, std::string> group;
    for (const auto& [name, r] : rank_) {
      const ReportGroupSeat theirs = seat(r);
      if (generation_of_[name] == generation_of_[worker] && theirs.group == mine.group && theirs.rank > 0) {
        group[theirs.rank] = name;
      }
    }
    std::vector<std::string> members;
    for (const auto& [at, name] : group) members.push_back(name);
    return members;
  }

  // `m` reaches `worker`: a RunStep carrying the previous step's verdict as
  // the two messages it stands for, the verdict first (what WorkerJob does;
  // with step_done_in_report the StepDone of a verdict that asks no snapshot
  // rides in the report); a worker of the old protocol sees only the
  // RunStep. The step's report goes into `report` when set (a leader
  // gathers it), else to the coordinator.
  bool Deliver(const std::string& worker, const v1::CoordinatorMessage& m, std::optional<v1::WorkerMessage>* report) {
    bool folds;
    {
      absl::MutexLock lock(&mu_);
      folds = workers_[worker].verdict_in_run_step();
      hold_done_[worker] = folds && m.has_run_step() && m.run_step().step_done_in_report() &&
                           !done_apart_.count(worker) && !m.run_step().commit().snapshot();
    }
    if (!m.has_run_step() || !(m.run_step().has_commit() || m.run_step().has_discard())) {
      return Take(worker, m, report);
    }
    v1::CoordinatorMessage verdict, run = m;
    if (m.run_step().has_commit()) *verdict.mutable_commit() = m.run_step().commit();
    if (m.run_step().has_discard()) *verdict.mutable_discard() = m.run_step().discard();
    run.mutable_run_step()->clear_commit();
    run.mutable_run_step()->clear_discard();
    if (folds) Take(worker, verdict, nullptr);
    return Take(worker, run, report);
  }

  // One message reaches the worker: the hook, then its answers (a report
  // into `report` when set).
  bool Take(const std::string& worker, const v1::CoordinatorMessage& m, std::optional<v1::WorkerMessage>* report) {
    Hook hook;
    {
      absl::MutexLock lock(&mu_);
      if (workers_[worker].state() != v1::READY) return true;
      hook = hook_;
    }
    if (hook && !hook(worker, m)) return true;
    std::vector<v1::WorkerMessage> replies;
    {
      absl::MutexLock lock(&mu_);
      if (workers_[worker].state() != v1::READY) return true;
      Answer(worker, m, &replies);
    }
    for (const v1::WorkerMessage& r : replies) {
      if (report != nullptr && r.has_report()) {
        *report = r;
      } else {
        runner_->OnWorkerMessage(worker, r);
      }
    }
    return true;
  }

  // A worker's state after step s is the string "<pp>.<tp>@<s>" (DP replicas
  // equal); with parallel.ep = G > 1 "<pp>.<tp>.e<dp % G>@<s>" (only the DP
  // replicas of the same expert slot hold the same experts).
  void Answer(const std::string& worker, const v1::CoordinatorMessage& m, std::vector<v1::WorkerMessage>* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    v1::WorkerMessage r;
    switch (m.body_case()) {
      case v1::CoordinatorMessage::kConfigure: {
        const v1::Configure& c = m.configure();
        generation_of_[worker] = c.plan().generation();
        for (const auto& rank : c.plan().ranks()) {
          if (rank.worker_name() != worker) continue;
          shard_[worker] = absl::StrCat(rank.pp_rank(), ".", rank.tp_rank());
          if (c.plan().ep() > 1) absl::StrAppend(&shard_[worker], ".e", rank.dp_rank() % c.plan().ep());
          rank_[worker] = rank;
        }
        plan_of_[worker] = c.plan();
        plan_of_[worker].clear_ranks();
        r.mutable_configured()->set_generation(c.plan().generation());
        std::string want = absl::StrCat(shard_[worker], "@", c.resume_step());
        if (c.resume_step() != 0 && state_padding_ > want.size()) want.resize(state_padding_, '.');
        std::string have;
        if (c.resume_step() == 0) {
          have = want;
        } else if (!c.state().empty()) {
          have = c.state();
        } else if (own_[worker].count(c.resume_step())) {
          have = own_[worker][c.resume_step()];
        }
        r.mutable_configured()->set_ok(have == want);
        if (have != want) {
          r.mutable_configured()->set_error(
              absl::StrCat("wrong state '", have.substr(0, 64), "', want ", want.substr(0, 64)));
        }
        model_step_[worker] = c.resume_step();
        break;
      }
      case v1::CoordinatorMessage::kRunStep: {
        v1::StepReport* rep = r.mutable_report();
        auto held = held_done_.find(worker);
        if (held != held_done_.end()) {
          *rep->mutable_step_done() = std::move(held->second);
          held_done_.erase(held);
          ++dones_in_reports_[worker];
        }
        rep->set_step(m.run_step().step());
        rep->set_generation(generation_of_[worker]);
        rep->set_finite(true);
        rep->set_grad_sq_norm(0.25);
        rep->set_has_loss(true);
        rep->set_loss(10.0 / m.run_step().step());
        if (rank_dependent_) {
          const v1::RankAssignment& rank = rank_[worker];
          rep->set_grad_sq_norm(0.25 + 0.5 * rank.pp_rank() + 1.0 * rank.dp_rank() + 2.0 * rank.cp_rank());
          rep->set_has_loss(rank.pp_rank() == plan_of_[worker].pp() - 1);
          rep->set_loss(rep->has_loss() ? 10.0 / m.run_step().step() + 0.1 * rank.dp_rank() + 0.01 * rank.cp_rank()
                                        : 0);
          rep->set_predicted(rep->has_loss() ? 10 + 30 * rank.cp_rank() : 0);  // CP ranks score unevenly
        }
        traced_[worker] = m.run_step().trace();
        break;
      }
      case v1::CoordinatorMessage::kCommit: {
        const int64_t step = m.commit().step();
        r.mutable_step_done()->set_step(step);
        r.mutable_step_done()->set_committed(true);
        r.mutable_step_done()->set_generation(generation_of_[worker]);
        r.mutable_step_done()->set_wall_seconds(0.01);
        r.mutable_step_done()->set_comm_all_to_all_seconds(all_to_all_seconds_);
        if (traced_[worker]) {  // one event per traced step
          v1::TraceEvent* e = r.mutable_step_done()->add_events();
          e->set_name(rank_dependent_ ? absl::StrCat("step ", step, " by ", worker) : absl::StrCat("step ", step));
          e->set_cat("compute");
          e->set_start_us(step * 1000);
          e->set_duration_us(10);
        }
        model_step_[worker] = step;
        if (hold_done_[worker]) {  // for the report of the RunStep it came in
          held_done_[worker] = r.step_done();
          return;
        }
        ++dones_apart_[worker];
        out->push_back(r);
        if (!m.commit().snapshot()) return;
        std::string state = absl::StrCat(shard_[worker], "@", step);
        if (state_padding_ > state.size()) state.resize(state_padding_, '.');
        own_[worker][step] = state;
        v1::WorkerMessage snap;
        snap.mutable_snapshot()->set_owner(worker);
        snap.mutable_snapshot()->set_step(step);
        snap.mutable_snapshot()->set_generation(generation_of_[worker]);
        snap.mutable_snapshot()->set_data(state);
        snap.mutable_snapshot()->set_capture_seconds(capture_seconds_);
        out->push_back(snap);
        return;
      }
      case v1::CoordinatorMessage::kSaveWeights: {
        r.mutable_saved()->set_step(m.save_weights().step());
        r.mutable_saved()->set_generation(generation_of_[worker]);
        if (m.save_weights().with_state()) {  // the copy to host memory is answered first
          v1::WorkerMessage copied = r;
          copied.mutable_saved()->set_ok(true);
          copied.mutable_saved()->set_copied(true);
          out->push_back(copied);
        }
        // A real (empty) shard file, so the coordinator's manifest can list it.
        const std::string file = absl::StrCat(worker, ".safetensors");
        r.mutable_saved()->set_ok(MakeDirectories(m.save_weights().dir()).ok() &&
                                  WriteFileAtomically(m.save_weights().dir() + "/" + file, "").ok());
        r.mutable_saved()->add_files(file);
        break;
      }
      case v1::CoordinatorMessage::kHoldSnapshot:
        held_[worker][m.hold_snapshot().owner()][m.hold_snapshot().step()] = m.hold_snapshot().data();
        return;
      case v1::CoordinatorMessage::kEvaluate: {
        // The last stage scores 10 tokens; its loss sum says which weights
        // (step) it evaluated and that the worker held them.
        v1::EvalReport* e = r.mutable_eval_report();
        e->set_step(m.evaluate().step());
        e->set_generation(generation_of_[worker]);
        const v1::RankAssignment& rank = rank_[worker];
        if (rank.pp_rank() == plan_of_[worker].pp() - 1) {
          e->set_has_loss(true);
          e->set_tokens(10);
          e->set_loss_sum(model_step_[worker] == m.evaluate().step() ? 10.0 / m.evaluate().step() : -1.0);
        }
        break;
      }
      case v1::CoordinatorMessage::kFetchState: {
        const std::string& owner = m.fetch_state().owner();
        const int64_t step = m.fetch_state().step();
        auto& from = owner == worker ? own_[worker] : held_[worker][owner];
        v1::ShardSnapshot* s = r.mutable_fetched_state();
        s->set_owner(owner);
        s->set_step(step);
        s->set_generation(generation_of_[worker]);
        if (from.count(step)) {
          s->set_data(from[step]);
        } else {
          s->set_error("not held");
        }
        break;
      }
      default:
        return;
    }
    out->push_back(r);
  }

  mutable absl::Mutex mu_;
  JobRunner* runner_ = nullptr;
  Hook hook_ ABSL_GUARDED_BY(mu_);
  int64_t next_id_ ABSL_GUARDED_BY(mu_) = 100;
  double capture_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  size_t state_padding_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, v1::WorkerInfo> workers_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::vector<v1::CoordinatorMessage>> sent_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t> generation_of_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> shard_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t> model_step_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, bool> traced_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::map<int64_t, std::string>> own_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::map<std::string, std::map<int64_t, std::string>>> held_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> done_apart_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, v1::RankAssignment> rank_ ABSL_GUARDED_BY(mu_);  // as configured
  std::map<std::string, v1::Plan> plan_of_ ABSL_GUARDED_BY(mu_);         // its plan, without the ranks
  std::map<std::string, std::vector<int64_t>> passed_ ABSL_GUARDED_BY(mu_);
  bool drop_members_ ABSL_GUARDED_BY(mu_) = false;
  bool rank_dependent_ ABSL_GUARDED_BY(mu_) = false;
  double all_to_all_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, bool> hold_done_ ABSL_GUARDED_BY(mu_);  // the RunStep being answered allows it
  std::map<std::string, v1::StepDone> held_done_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int> dones_apart_ ABSL_GUARDED_BY(mu_), dones_in_reports_ ABSL_GUARDED_BY(mu_);
};

v1::JobSpec Job(int pp, int dp, int steps, const std::string& /*extra*/ = "") {
  v1::JobSpec job;
  job.set_name("unit");
  job.mutable_model()->set_layers(4);
  auto* syn = job.mutable_model()->mutable_synthetic();
  syn->set_forward_ms(1);
  syn->set_backward_input_ms(1);
  syn->set_backward_weight_ms(1);
  syn->set_activation_bytes(64);
  job.mutable_parallel()->set_pp(pp);
  job.mutable_parallel()->set_dp(dp);
  job.mutable_schedule()->set_kind("1f1b");
  job.mutable_schedule()->set_microbatches(2);
  job.mutable_train()->set_steps(steps);
  job.mutable_train()->set_micro_batch_size(1);
  job.mutable_train()->set_lr(0.001);
  job.mutable_fault_tolerance()->set_replacement_timeout_s(5);
  return job;
}

class JobRunnerTest : public ::testing::Test {
 protected:
  void Start(v1::JobSpec job, int workers, std::function<void(FakeWorkers*)> setup = nullptr,
             const std::string& out_dir = "") {
    fake_ = std::make_unique<FakeWorkers>(workers);
    if (setup) setup(fake_.get());
    JobRunner::Options options;
    options.out_dir = out_dir;
    options.report_groups_min_ranks = report_groups_min_ranks_;
    options.report_group_ranks = report_group_ranks_;
    runner_ = std::make_unique<JobRunner>(std::move(job), fake_.get(), &clock_, options, metrics_);
    fake_->set_runner(runner_.get());
    // The runner starts in Finish(), after the test installed its hooks: the
    // fake workers answer at once, so a runner started here could run past
    // the step a hook waits for before the hook exists.
  }
  // Advances the fake clock until the job is done or failed (bounded).
  JobState Finish() {
    if (!started_) {
      started_ = true;
      runner_->Start();
    }
    for (int i = 0; i < 20000 && !IsFinal(runner_->state()); ++i) {
      clock_.Advance(absl::Milliseconds(50));
      absl::SleepFor(absl::Microseconds(200));
    }
    return runner_->state();
  }
  // The steps, verdicts and saves sent to `worker`, in order.
  std::vector<std::string> MessageOrder(const std::string& worker) {
    std::vector<std::string> order;
    for (const v1::CoordinatorMessage& m : fake_->Sent(worker)) {
      if (m.has_run_step()) {
        order.push_back(absl::StrCat("run ", m.run_step().step()));
        if (m.run_step().has_commit()) absl::StrAppend(&order.back(), " with commit ", m.run_step().commit().step());
        if (m.run_step().has_discard()) absl::StrAppend(&order.back(), " with discard ", m.run_step().discard().step());
      }
      if (m.has_commit()) order.push_back(absl::StrCat("commit ", m.commit().step()));
      if (m.has_discard()) order.push_back(absl::StrCat("discard ", m.discard().step()));
      if (m.has_save_weights()) order.push_back(absl::StrCat("save ", m.save_weights().step()));
    }
    return order;
  }
  v1::GetStatusResponse Status() {
    v1::GetStatusResponse s;
    runner_->FillStatus(&s);
    return s;
  }
  std::string Metrics() {
    prometheus::TextSerializer text;
    return text.Serialize(metrics_.Collect());
  }
  // The steps on record in `out_dir`/steps.jsonl (lines with a loss), in
  // order; `uncommitted` gets those whose "committed" is not true.
  std::vector<int64_t> RecordedSteps(const std::string& out_dir, std::vector<int64_t>* uncommitted = nullptr) {
    std::vector<int64_t> recorded;
    absl::StatusOr<std::string> steps = ReadFile(out_dir + "/steps.jsonl");
    EXPECT_TRUE(steps.ok()) << steps.status();
    if (!steps.ok()) return recorded;
    for (absl::string_view line : absl::StrSplit(*steps, '\n', absl::SkipEmpty())) {
      auto v = JsonValue::Parse(line);
      EXPECT_TRUE(v.ok()) << line;
      if (!v.ok()) continue;
      const JsonValue* step = v->Find("step");
      if (step == nullptr || v->Find("loss") == nullptr) continue;
      recorded.push_back(static_cast<int64_t>(step->number()));
      const JsonValue* committed = v->Find("committed");
      if (uncommitted != nullptr && (committed == nullptr || !committed->bool_value())) {
        uncommitted->push_back(recorded.back());
      }
    }
    return recorded;
  }
  // Kills `victim` when it is asked to run step `step` (once; a verdict
  // inside that RunStep reaches it first); with `restart` the same name
  // registers again at once (systemd Restart=on-failure).
  void KillAt(const std::string& victim, int64_t step, bool restart = false) {
    auto fired = std::make_shared<bool>(false);
    fake_->set_hook([this, victim, step, restart, fired](const std::string& w, const v1::CoordinatorMessage& m) {
      if (w == victim && m.has_run_step() && m.run_step().step() == step && !*fired) {
        *fired = true;
        fake_->Kill(victim);
        if (restart) fake_->Restart(victim);
        return false;
      }
      return true;
    });
  }

  int report_groups_min_ranks_ = JobRunner::Options().report_groups_min_ranks;
  int report_group_ranks_ = JobRunner::Options().report_group_ranks;
  FakeClock clock_;
  prometheus::Registry metrics_;
  std::unique_ptr<FakeWorkers> fake_;
  std::unique_ptr<JobRunner> runner_;
  bool started_ = false;
};

TEST(SnapshotDueTest, EveryNStepsWhenSetElseByWhatASnapshotCosts) {
  std::vector<int64_t> due;
  for (int64_t s = 1; s <= 6; ++s) {
    if (SnapshotDue(2, s, 0, 0, 0)) due.push_back(s);
  }
  EXPECT_EQ(due, (std::vector<int64_t>{2, 4, 6}));
  for (int64_t s = 1; s <= 6; ++s) EXPECT_FALSE(SnapshotDue(0, s, 0, 0, 0)) << "0: no snapshots";
  // Unset: the first step measures the cost.
  EXPECT_TRUE(SnapshotDue(std::nullopt, 1, 0, 100.0, 0.01));
  // Cheap (4 ms against a 100 ms step, under 5%) or not measured: every step.
  EXPECT_TRUE(SnapshotDue(std::nullopt, 8, 7, 0.004, 0.1));
  EXPECT_TRUE(SnapshotDue(std::nullopt, 8, 7, 0.0, 0.1));
  EXPECT_TRUE(SnapshotDue(std::nullopt, 8, 7, 0.5, 0.0));
  // 100 ms against a 100 ms step: every 20th step keeps it at 5%.
  EXPECT_FALSE(SnapshotDue(std::nullopt, 26, 7, 0.1, 0.1));
  EXPECT_TRUE(SnapshotDue(std::nullopt, 27, 7, 0.1, 0.1));
}

// A worker's snapshot that stalls it far longer than a step is not taken at
// every step: after the first (which measures it), the next one is due only
// once 5% of the steps' time since covers it, the same steps on every
// worker. Set explicitly, snapshot_every_steps wins.
TEST_F(JobRunnerTest, SnapshotsAreSpacedByWhatTheyCost) {
  Start(Job(2, 1, 6), 2, [](FakeWorkers* f) { f->set_capture_seconds(1000); });
  ASSERT_EQ(Finish(), JobState::kDone) << runner_->error();
  for (const char* w : {"worker-0", "worker-1"}) {
    EXPECT_EQ(fake_->StepsRun(w), (std::vector<int64_t>{1, 2, 3, 4, 5, 6})) << w;
    EXPECT_EQ(fake_->SnapshotSteps(w), (std::vector<int64_t>{1})) << w;
  }
}

TEST_F(JobRunnerTest, CheapSnapshotsAreTakenEveryStep) {
  Start(Job(2, 1, 4), 2);  // the fakes' snapshots cost nothing
  ASSERT_EQ(Finish(), JobState::kDone) << runner_->error();
  for (const char* w : {"worker-0", "worker-1"}) {
    EXPECT_EQ(fake_->SnapshotSteps(w), (std::vector<int64_t>{1, 2, 3, 4})) << w;
  }
}

TEST_F(JobRunnerTest, AnExplicitSnapshotIntervalWinsOverTheCost) {
  v1::JobSpec job = Job(2, 1, 6);
  job.mutable_fault_tolerance()->set_snapshot_every_steps(3);
  Start(job, 2, [](FakeWorkers* f) { f->set_capture_seconds(1000); });
  ASSERT_EQ(Finish(), JobState::kDone) << runner_->error();
  for (const char* w : {"worker-0", "worker-1"}) {
    EXPECT_EQ(fake_->SnapshotSteps(w), (std::vector<int64_t>{3, 6})) << w;
  }
}

TEST_F(JobRunnerTest, RunsEveryStepOnceAndEndsDone) {
  Start(Job(2, 1, 5), 2);
  ASSERT_EQ(Finish(), JobState::kDone) << runner_->error();
  for (const char* w : {"worker-0", "worker-1"}) {
    EXPECT_EQ(fake_->StepsRun(w), (std::vector<int64_t>{1, 2, 3, 4, 5})) << w;
    EXPECT_EQ(fake_->Configures(w).size(), 1u);
    EXPECT_EQ(fake_->ModelStep(w), 5);
  }
  const v1::GetStatusResponse s = Status();
  EXPECT_EQ(s.job_state(), "done");
  EXPECT_EQ(s.step(), 5);
  EXPECT_EQ(s.recoveries(), 0);
  EXPECT_EQ(s.eval_step(), 0);
  const std::string m = Metrics();
  EXPECT_NE(m.find("baton_job_eval_loss{training_job=\"unit\"} Nan"), std::string::npos) << m;
  EXPECT_NE(m.find("baton_job_state{state=\"done\",training_job=\"unit\"} 1"), std::string::npos) << m;
  EXPECT_NE(m.find("baton_job_state{state=\"running\",training_job=\"unit\"} 0"), std::string::npos) << m;
  EXPECT_NE(m.find("baton_expected_bubble_ratio{stage=\"1\",training_job=\"unit\"}"), std::string::npos) << m;
  EXPECT_EQ(m.find("job=\"unit\""), m.find("training_job=\"unit\"") + 9) << "no label named job";
}

// A worker is sent the next step right behind the verdict of the last one:
// it does not wait a round trip to the coordinator between steps. Here
// worker-0 answers Commit(2) only when RunStep(3) has reached it; a
// coordinator that waited for every StepDone first would time out.
TEST_F(JobRunnerTest, TheNextStepGoesOutBeforeTheCommitIsAnswered) {
  Start(Job(2, 1, 4), 2);
  auto held = std::make_shared<std::optional<v1::WorkerMessage>>();
  fake_->set_hook([this, held](const std::string& w, const v1::CoordinatorMessage& m) {
    if (w != "worker-0") return true;
    if (m.has_commit() && m.commit().step() == 2) {
      v1::WorkerMessage done;
      done.mutable_step_done()->set_step(2);
      done.mutable_step_done()->set_committed(true);
      done.mutable_step_done()->set_wall_seconds(0.01);
      done.mutable_step_done()->set_generation(Status().generation());
      *held = done;
      return false;  // answered below, once RunStep(3) is here
    }
    if (m.has_run_step() && m.run_step().step() == 3 && held->has_value()) {
      runner_->OnWorkerMessage(w, **held);
      held->reset();
    }
    return true;
  });
  ASSERT_EQ(Finish(), JobState::kDone) << runner_->error();
  EXPECT_FALSE(held->has_value());
  for (const char* w : {"worker-0", "worker-1"}) {
    EXPECT_EQ(fake_->StepsRun(w), (std::vector<int64_t>{1, 2, 3, 4})) << w;
  }
  EXPECT_EQ(Status().recoveries(), 0);
  EXPECT_EQ(Status().step(), 4);
}

// What a worker is sent, in order: each verdict followed at once by the next
// step, except before a periodic checkpoint (its SaveWeights comes first)
// and after the last step (the final save).
TEST_F(JobRunnerTest, TheNextStepFollowsEachVerdictExceptBeforeASave) {
  const std::string root = absl::StrCat(::testing::TempDir(), "/ahead_order");
  v1::JobSpec job = Job(1, 1, 4);
  job.mutable_checkpoint()->set_dir(root);
  job.mutable_checkpoint()->set_every_steps(2);
  Start(job, 1, nullptr, root + "/out");
  ASSERT_EQ(Finish(), JobState::kDone) << runner_->error();
  // The verdict rides inside the next RunStep: one message, not two.
  EXPECT_EQ(MessageOrder("worker-0"), (std::vector<std::string>{"run 1", "run 2 with commit 1", "commit 2", "save 2",
                                                                "run 3", "run 4 with commit 3", "commit 4", "save 4",
                                                                "save 4"}));
}

// A worker that registered without verdict_in_run_step (an older binary,
// which would ignore RunStep.commit and never commit) gets each verdict as a
// message of its own, right before the next step; the others in the same
// job get it inside the RunStep. Both commit every step.
TEST_F(JobRunnerTest, AnOlderWorkerGetsTheVerdictApart) {
  Start(Job(2, 1, 3), 2, [](FakeWorkers* f) { f->SetOldProtocol("worker-1"); });
  ASSERT_EQ(Finish(), JobState::kDone) << runner_->error();
  EXPECT_EQ(MessageOrder("worker-0"), (std::vector<std::string>{"run 1", "run 2 with commit 1", "run 3 with commit 2",
                                                                "commit 3"}));
  EXPECT_EQ(MessageOrder("worker-1"),
            (std::vector<std::string>{"run 1", "commit 1", "run 2", "commit 2", "run 3", "commit 3"}));
  for (const char* w : {"worker-0", "worker-1"}) EXPECT_EQ(fake_->ModelStep(w), 3) << w;
  EXPECT_EQ(Status().step(), 3);
  EXPECT_EQ(Status().recoveries(), 0);
}

// The StepDone of a verdict sent inside RunStep rides in that step's report,
// except a snapshot step's (and the last step's, whose verdict goes alone);
// a worker that answers it apart (an older release) is taken as well.
TEST_F(JobRunnerTest, AStepDoneRidesInTheNextReportUnlessItsStepIsSnapshotted) {
  const std::string out = absl::StrCat(::testing::TempDir(), "/step_done_in_report");
  v1::JobSpec job = Job(2, 1, 6);
  job.mutable_fault_tolerance()->set_snapshot_every_steps(3);
  Start(job, 2, [](FakeWorkers* f) { f->SetStepDoneApart("worker-1"); }, out);
  ASSERT_EQ(Finish(), JobState::kDone) << runner_->error();
  EXPECT_EQ(fake_->StepDonesInReports("worker-0"), 4);  // steps 1, 2, 4, 5
  EXPECT_EQ(fake_->StepDonesApart("worker-0"), 2);      // 3 (snapshot) and 6 (last)
  EXPECT_EQ(fake_->StepDonesInReports("worker-1"), 0);
  EXPECT_EQ(fake_->StepDonesApart("worker-1"), 6);
  for (const char* w : {"worker-0", "worker-1"}) {
    EXPECT_EQ(fake_->StepsRun(w), (std::vector<int64_t>{1, 2, 3, 4, 5, 6})) << w;
    EXPECT_EQ(fake_->ModelStep(w), 6) << w;
  }
  EXPECT_EQ(Status().step(), 6);
  // Every step on record once, committed.
  std::vector<int64_t> uncommitted;
  EXPECT_EQ(RecordedSteps(out, &uncommitted), (std::vector<int64_t>{1, 2, 3, 4, 5, 6}));
  EXPECT_TRUE(uncommitted.empty());
}

// A worker lost while it holds a StepDone for its report resumes the job
// from the same step as when every StepDone comes apart: the newest
// snapshot, which the coordinator knew committed at once.
class HeldStepDoneTest : public JobRunnerTest, public ::testing::WithParamInterface<bool> {};

TEST_P(HeldStepDoneTest, AWorkerLostWhileItHoldsAStepDoneResumesFromTheNewestSnapshot) {
  const bool apart = GetParam();
  v1::JobSpec job = Job(2, 1, 6);
  job.mutable_fault_tolerance()->set_snapshot_every_steps(2);
  Start(job, 2, [apart](FakeWorkers* f) {
    if (apart) {
      f->SetStepDoneApart("worker-0");
      f->SetStepDoneApart("worker-1");
    }
  });
  // RunStep(4) carries the commit of step 3 (no snapshot): worker-1
  // applies it and dies computing step 4.
  KillAt("worker-1", 4, /*restart=*/true);
  ASSERT_EQ(Finish(), JobState::kDone) << runner_->error();
  const std::vector<v1::Configure> c = fake_->Configures("worker-1");
  ASSERT_EQ(c.size(), 2u);
  EXPECT_EQ(c[1].resume_step(), 2);
  EXPECT_EQ(c[1].state(), "1.0@2");
  EXPECT_EQ(fake_->StepDonesInReports("worker-0") > 0, !apart);
  for (const char* w : {"worker-0", "worker-1"}) {
    EXPECT_EQ(fake_->StepsRun(w), (std::vector<int64_t>{1, 2, 3, 4, 3, 4, 5, 6})) << w;
    EXPECT_EQ(fake_->ModelStep(w), 6) << w;
  }
  EXPECT_EQ(Status().recoveries(), 1);
}

INSTANTIATE_TEST_SUITE_P(StepDone, HeldStepDoneTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "Apart" : "InTheReport"; });

// A worker lost in the step sent ahead does not undo the step before it when
// every worker had answered that one's Commit: the job resumes after it.
TEST_F(JobRunnerTest, AFailureInTheStepSentAheadKeepsTheCommittedStep) {
  const std::string out = absl::StrCat(::testing::TempDir(), "/ahead_failure");
  Start(Job(2, 1, 5), 2, nullptr, out);
  auto fired = std::make_shared<bool>(false);
  fake_->set_hook([this, fired](const std::string& w, const v1::CoordinatorMessage& m) {
    if (w == "worker-1" && m.has_run_step() && m.run_step().step() == 4 && !*fired) {
      *fired = true;
      v1::WorkerMessage failed;
      failed.mutable_report()->set_step(4);
      failed.mutable_report()->set_error("device lost");
      failed.mutable_report()->set_code(static_cast<int>(absl::StatusCode::kInternal));
      failed.mutable_report()->set_generation(Status().generation());
      runner_->OnWorkerMessage(w, failed);
      return false;
    }
    return true;
  });
  ASSERT_EQ(Finish(), JobState::kDone) << runner_->error();
  EXPECT_EQ(Status().recoveries(), 1);
  for (const char* w : {"worker-0", "worker-1"}) {
    // Step 3 stood: the retry starts at step 4, not earlier.
    EXPECT_EQ(fake_->StepsRun(w), (std::vector<int64_t>{1, 2, 3, 4, 4, 5})) << w;
    EXPECT_EQ(fake_->ModelStep(w), 5) << w;
  }
  // ...and it is on record, once.
  EXPECT_EQ(RecordedSteps(out), (std::vector<int64_t>{1, 2, 3, 4, 5}));
}

// The data plane is chosen again when a rank changes hands: a GPU job on two
// GPUs runs NCCL; once the spare sharing worker-0's GPU takes the lost rank,
// Gloo.
TEST_F(JobRunnerTest, TheDataPlaneIsChosenAgainWhenARankChangesHands) {
  v1::JobSpec job = Job(2, 1, 6);
  job.mutable_model()->clear_synthetic();
  job.mutable_model()->set_d_model(32);
  job.mutable_model()->set_heads(4);
  job.mutable_model()->set_vocab(64);
  job.mutable_model()->set_seq_len(8);
  Start(job, 3, [](FakeWorkers* f) {  // worker-2 is a spare
    f->SetDevice("worker-0", "cuda:0");
    f->SetDevice("worker-1", "cuda:1");
    f->SetDevice("worker-2", "cuda:0");
  });
  KillAt("worker-1", 4);
  ASSERT_EQ(Finish(), JobState::kDone) << runner_->error();
  const std::vector<v1::Configure> survivor = fake_->Configures("worker-0");
  ASSERT_EQ(survivor.size(), 2u);
  EXPECT_EQ(survivor[0].plan().comm_backend(), "nccl");
  EXPECT_EQ(survivor[1].plan().comm_backend(), "gloo");
  const std::vector<v1::Configure> spare = fake_->Configures("worker-2");
  ASSERT_EQ(spare.size(), 1u);
  EXPECT_EQ(spare[0].plan().comm_backend(), "gloo");
  EXPECT_EQ(spare[0].plan().ranks(0).device(), "cuda:0");
}

TEST_F(JobRunnerTest, ALostWorkerIsReplacedByASpareFromItsBuddysSnapshot) {
  Start(Job(2, 1, 6), 3);  // worker-2 is a spare
  KillAt("worker-1", 4);
  ASSERT_EQ(Finish(), JobState::kDone) << runner_->error();
  // The spare got the lost shard's state of step 3 (held by its buddy worker-0).
  const std::vector<v1::Configure> spare = fake_->Configures("worker-2");
  ASSERT_EQ(spare.size(), 1u);
  EXPECT_EQ(spare[0].resume_step(), 3);
  EXPECT_EQ(spare[0].state(), "1.0@3");
  EXPECT_EQ(fake_->StepsRun("worker-2"), (std::vector<int64_t>{4, 5, 6}));
  // The survivor rolled back from its own memory (no state sent) and went on.
  const std::vector<v1::Configure> survivor = fake_->Configures("worker-0");
  ASSERT_EQ(survivor.size(), 2u);
  EXPECT_EQ(survivor[1].resume_step(), 3);
  EXPECT_TRUE(survivor[1].state().empty());
  EXPECT_GT(survivor[1].plan().generation(), survivor[0].plan().generation());
  EXPECT_EQ(fake_->StepsRun("worker-0"), (std::vector<int64_t>{1, 2, 3, 4, 4, 5, 6}));
  const v1::GetStatusResponse s = Status();
  EXPECT_EQ(s.recoveries(), 1);
  EXPECT_NE(s.recovery().find("worker-1"), std::string::npos) << s.recovery();
  EXPECT_NE(s.recovery().find("worker-2"), std::string::npos) << s.recovery();
  const std::string m = Metrics();
  EXPECT_NE(m.find("baton_recoveries_total{cause=\"worker_lost\",training_job=\"unit\"} 1"), std::string::npos) << m;
  EXPECT_NE(m.find("baton_recovery_seconds_count{training_job=\"unit\"} 1"), std::string::npos) << m;
}

TEST_F(JobRunnerTest, TheLostNameRegisteringAgainIsItsOwnReplacement) {
  Start(Job(2, 1, 5), 2);
  KillAt("worker-1", 3, /*restart=*/true);
  ASSERT_EQ(Finish(), JobState::kDone) << runner_->error();
  const std::vector<v1::Configure> c = fake_->Configures("worker-1");
  ASSERT_EQ(c.size(), 2u);
  EXPECT_EQ(c[1].resume_step(), 2);
  EXPECT_EQ(c[1].state(), "1.0@2");
  EXPECT_EQ(fake_->ModelStep("worker-1"), 5);
}

TEST_F(JobRunnerTest, ADataParallelReplicaIsTheSourceOfTheLostShard) {
  Start(Job(1, 2, 4), 3);
  KillAt("worker-1", 3);
  ASSERT_EQ(Finish(), JobState::kDone) << runner_->error();
  const std::vector<v1::Configure> spare = fake_->Configures("worker-2");
  ASSERT_EQ(spare.size(), 1u);
  EXPECT_EQ(spare[0].resume_step(), 2);
  EXPECT_EQ(spare[0].state(), "0.0@2");
  // Fetched from the replica's own copy, not from a buddy copy.
  bool fetched_own = false;
  for (const auto& m : fake_->Sent("worker-0")) {
    if (m.has_fetch_state()) fetched_own = m.fetch_state().owner() == "worker-0";
  }
  EXPECT_TRUE(fetched_own);
  EXPECT_NE(Status().recovery().find("DP replica worker-0"), std::string::npos) << Status().recovery();
}

// Job(pp, dp, steps) on a small real model (ZeRO needs optimizer state)
// with parallel.zero_stage `zero_stage`.
v1::JobSpec ZeroJob(int pp, int dp, int steps, int zero_stage) {
  v1::JobSpec job = Job(pp, dp, steps);
  v1::ModelSpec* m = job.mutable_model();
  m->clear_synthetic();
  m->set_d_model(16);
  m->set_heads(2);
  m->set_vocab(16);
  m->set_seq_len(8);
  job.mutable_parallel()->set_zero_stage(zero_stage);
  return job;
}

// Under ZeRO stage 1 a DP replica holds another shard of the AdamW moments
// than the lost worker: the spare gets the lost worker's own snapshot from
// its buddy, never the replica's state.
TEST_F(JobRunnerTest, UnderZeroTheLostShardComesFromItsBuddyNotADataParallelReplica) {
  Start(ZeroJob(1, 2, 4, 1), 3);
  KillAt("worker-1", 3);
  ASSERT_EQ(Finish(), JobState::kDone) << runner_->error();
  const std::vector<v1::Configure> spare = fake_->Configures("worker-2");
  ASSERT_EQ(spare.size(), 1u);
  EXPECT_EQ(spare[0].resume_step(), 2);
  EXPECT_EQ(spare[0].state(), "0.0@2");
  // worker-0 (the replica, and worker-1's buddy) was asked for worker-1's copy.
  std::vector<std::string> owners;
  for (const auto& m : fake_->Sent("worker-0")) {
    if (m.has_fetch_state()) owners.push_back(m.fetch_state().owner());
  }
  EXPECT_EQ(owners, (std::vector<std::string>{"worker-1"}));
  EXPECT_NE(Status().recovery().find("from worker-0's snapshot"), std::string::npos) << Status().recovery();
  EXPECT_EQ(Status().recovery().find("DP replica"), std::string::npos) << Status().recovery();
}

// A snapshot over gRPC's 4 MiB message limit is relayed to the buddy like
// any other (the session carries it as fragments; there is no relay cap):
// under ZeRO the lost shard still comes back from the buddy's copy.
TEST_F(JobRunnerTest, ASnapshotOverFourMiBIsRelayedAndRestoresTheLostShard) {
  constexpr size_t kBig = (size_t{4} << 20) + 1;
  Start(ZeroJob(1, 2, 4, 1), 3, [](FakeWorkers* f) { f->set_state_padding(kBig); });
  KillAt("worker-1", 3);
  ASSERT_EQ(Finish(), JobState::kDone) << runner_->error();
  size_t relayed = 0;
  for (const auto& m : fake_->Sent("worker-0")) {
    if (m.has_hold_snapshot() && m.hold_snapshot().owner() == "worker-1") {
      EXPECT_EQ(m.hold_snapshot().data().size(), kBig);
      ++relayed;
    }
  }
  EXPECT_GE(relayed, 2u) << "worker-1's snapshots of steps 1 and 2 went to its buddy";
  const std::vector<v1::Configure> spare = fake_->Configures("worker-2");
  ASSERT_EQ(spare.size(), 1u);
  EXPECT_EQ(spare[0].resume_step(), 2);
  ASSERT_EQ(spare[0].state().size(), kBig);
  EXPECT_EQ(spare[0].state().substr(0, 6), "0.0@2.");
  EXPECT_NE(Status().recovery().find("from worker-0's snapshot"), std::string::npos) << Status().recovery();
}

// The step's gradient norm: without ZeRO the DP replicas hold the same
// averaged gradients and only DP rank 0's column counts; with zero_stage 1
// each DP rank reports its own shard and every rank counts.
class ZeroGradNormTest : public JobRunnerTest, public ::testing::WithParamInterface<int> {};

TEST_P(ZeroGradNormTest, TheGlobalNormSumsDpRankZeroOrEveryShard) {
  const int zero_stage = GetParam();
  const std::string out = absl::StrCat(::testing::TempDir(), "/zero_grad_norm_", zero_stage);
  Start(ZeroJob(2, 2, 3, zero_stage), 4, [](FakeWorkers* f) { f->SetRankDependentReports(); }, out);
  ASSERT_EQ(Finish(), JobState::kDone) << runner_->error();
  absl::StatusOr<std::string> steps = ReadFile(out + "/steps.jsonl");
  ASSERT_TRUE(steps.ok()) << steps.status();
  std::vector<double> norms;
  for (absl::string_view line : absl::StrSplit(*steps, '\n', absl::SkipEmpty())) {
    absl::StatusOr<JsonValue> v = JsonValue::Parse(line);
    ASSERT_TRUE(v.ok()) << line;
    if (v->Find("grad_norm") != nullptr) norms.push_back(v->Find("grad_norm")->number());
  }
  // Squared norms 0.25 + 0.5 pp + dp: dp 0's column 0.25 + 0.75 = 1; all
  // four ranks 0.25 + 0.75 + 1.25 + 1.75 = 4.
  const double want = zero_stage == 0 ? 1.0 : 2.0;
  EXPECT_EQ(norms, (std::vector<double>{want, want, want}));
}

INSTANTIATE_TEST_SUITE_P(WithoutAndWithZeroStageOne, ZeroGradNormTest, ::testing::Values(0, 1));

// ZeroJob with parallel.cp `cp` (seq_len 8: 2*cp divides it for cp 2 and 4).
v1::JobSpec CpJob(int pp, int dp, int cp, int steps, int zero_stage) {
  v1::JobSpec job = ZeroJob(pp, dp, steps, zero_stage);
  job.mutable_parallel()->set_cp(cp);
  return job;
}

// The values of `key` in `out`/steps.jsonl's step lines, in order.
std::vector<double> StepValues(const std::string& out, const char* key) {
  std::vector<double> values;
  absl::StatusOr<std::string> steps = ReadFile(out + "/steps.jsonl");
  EXPECT_TRUE(steps.ok()) << steps.status();
  if (!steps.ok()) return values;
  for (absl::string_view line : absl::StrSplit(*steps, '\n', absl::SkipEmpty())) {
    absl::StatusOr<JsonValue> v = JsonValue::Parse(line);
    EXPECT_TRUE(v.ok()) << line;
    if (v.ok() && v->Find("step") != nullptr && v->Find(key) != nullptr) values.push_back(v->Find(key)->number());
  }
  return values;
}

// With cp > 1 the gradients are reduced over the dp*cp ranks of a (pp, tp):
// without ZeRO only the rank of dp 0 and cp 0 counts toward the norm (its
// CP peers and DP replicas hold the same gradients); with ZeRO 1 every
// rank's shard counts. The loss is a replica's CP ranks' losses weighted by
// the tokens each scored, averaged over the replicas. A context-parallel job
// forms no report groups even where every worker takes them.
class ContextParallelStepTest : public JobRunnerTest, public ::testing::WithParamInterface<int> {};

TEST_P(ContextParallelStepTest, TheNormCountsOneRankOfTheGroupOrEveryShardAndTheLossWeighsTheCpRanks) {
  const int zero_stage = GetParam();
  const std::string out = absl::StrCat(::testing::TempDir(), "/cp_step_", zero_stage);
  report_groups_min_ranks_ = 1;
  Start(CpJob(2, 2, 2, 3, zero_stage), 8,
        [](FakeWorkers* f) {
          f->SetRankDependentReports();
          f->SetReportGroups(false, /*columns=*/true);
        },
        out);
  ASSERT_EQ(Finish(), JobState::kDone) << runner_->error();
  // Squared norms 0.25 + 0.5 pp + dp + 2 cp: the (dp 0, cp 0) column 0.25 +
  // 0.75 = 1; all eight ranks 8 * 0.25 + 4 * 0.5 + 4 * 1 + 4 * 2 = 16.
  const double norm = zero_stage == 0 ? 1.0 : 4.0;
  EXPECT_EQ(StepValues(out, "grad_norm"), (std::vector<double>{norm, norm, norm}));
  // Last-stage losses 10/step + 0.1 dp + 0.01 cp over dp, cp in {0, 1}, of
  // 10 and 40 scored tokens (cp 0, 1): a replica's is 10/step + 0.1 dp +
  // 0.01 * 40/50; their mean 10/step + 0.05 + 0.008.
  const std::vector<double> losses = StepValues(out, "loss");
  ASSERT_EQ(losses.size(), 3u);
  // (steps.jsonl keeps 9 digits.)
  for (int step = 1; step <= 3; ++step) EXPECT_NEAR(losses[step - 1], 10.0 / step + 0.058, 1e-7) << step;
  for (int i = 0; i < 8; ++i) {
    const std::string w = absl::StrCat("worker-", i);
    const std::vector<v1::Configure> c = fake_->Configures(w);
    ASSERT_EQ(c.size(), 1u) << w;
    EXPECT_EQ(c[0].plan().cp(), 2);
    EXPECT_FALSE(c[0].plan().report_groups()) << "no report groups with cp > 1";
    EXPECT_EQ(fake_->StepsRun(w), (std::vector<int64_t>{1, 2, 3})) << w << ": every rank is sent its steps";
    EXPECT_TRUE(fake_->StepsPassedOn(w).empty()) << w;
  }
}

INSTANTIATE_TEST_SUITE_P(WithoutAndWithZeroStageOne, ContextParallelStepTest, ::testing::Values(0, 1));

// ZeroJob (zero_stage 0) as a Mixture-of-Experts model of 4 experts with
// parallel.ep `ep`.
v1::JobSpec EpJob(int pp, int dp, int ep, int steps) {
  v1::JobSpec job = ZeroJob(pp, dp, steps, 0);
  job.mutable_model()->mutable_moe()->set_experts(4);
  job.mutable_model()->mutable_moe()->set_top_k(1);
  job.mutable_parallel()->set_ep(ep);
  return job;
}

// With expert parallelism (ep = G) each expert's gradients live only on the
// dp ranks of its slot (dp % G): the norm sums dp ranks 0 .. G-1, where dp 0
// reports the dense parameters with its experts and the others their
// experts; the other expert groups' reports are not added. Their exchanges
// (comm_all_to_all_seconds) are communication time. Through report groups.
class ExpertParallelStepTest : public JobRunnerTest, public ::testing::WithParamInterface<int> {};

TEST_P(ExpertParallelStepTest, TheNormSumsTheFirstExpertGroupAndTheExchangesAreComm) {
  const int ep = GetParam();
  const std::string out = absl::StrCat(::testing::TempDir(), "/ep_step_", ep);
  report_groups_min_ranks_ = 1;
  Start(EpJob(2, 4, ep, 3), 8,
        [](FakeWorkers* f) {
          f->SetRankDependentReports();
          f->SetReportGroups(false, /*columns=*/true);
          f->SetAllToAllSeconds(0.004);  // of each worker's 0.01 s
        },
        out);
  ASSERT_EQ(Finish(), JobState::kDone) << runner_->error();
  // Squared norms 0.25 + 0.5 pp + dp; a dp column's two stages 1 + 2 dp:
  // ep 1: dp 0's 1; ep 2: dp 0 and 1, 1 + 3 = 4; ep 4: every rank, 16.
  const double norm = ep == 1 ? 1.0 : ep == 2 ? 2.0 : 4.0;
  EXPECT_EQ(StepValues(out, "grad_norm"), (std::vector<double>{norm, norm, norm}));
  for (double ratio : StepValues(out, "comm_ratio")) EXPECT_NEAR(ratio, 0.4, 1e-9);
  EXPECT_EQ(StepValues(out, "comm_ratio").size(), 3u);
  const std::vector<v1::Configure> c = fake_->Configures("worker-0");
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].plan().ep(), ep);
  EXPECT_TRUE(c[0].plan().report_groups());
}

INSTANTIATE_TEST_SUITE_P(OneTwoAndFourExpertSlots, ExpertParallelStepTest, ::testing::Values(1, 2, 4));

// A lost rank's experts are held by the DP replicas of its expert slot only
// (dp % ep): with dp 4 and ep 2, dp 1's replacement gets the state of dp 3
// (not dp 0, the first replica, whose experts differ); with dp 2 no replica
// shares its slot, and the buddy holding its own snapshot is the source.
class ExpertParallelRecoveryTest : public JobRunnerTest, public ::testing::WithParamInterface<int> {};

TEST_P(ExpertParallelRecoveryTest, ALostRanksExpertsComeFromItsSlotsReplicaOrItsBuddy) {
  const int dp = GetParam();
  Start(EpJob(1, dp, 2, 4), dp + 1);  // worker-i: dp rank i; worker-<dp> a spare
  KillAt("worker-1", 3);
  ASSERT_EQ(Finish(), JobState::kDone) << runner_->error();
  const std::string spare_name = absl::StrCat("worker-", dp);
  const std::vector<v1::Configure> spare = fake_->Configures(spare_name);
  ASSERT_EQ(spare.size(), 1u);
  EXPECT_EQ(spare[0].resume_step(), 2) << "not the seed: a source of step 2 was found";
  EXPECT_EQ(spare[0].state(), "0.0.e1@2") << "expert slot 1's state";
  ASSERT_EQ(spare[0].plan().ranks_size(), 1);
  EXPECT_EQ(spare[0].plan().ranks(0).dp_rank(), 1);
  std::map<std::string, std::vector<std::string>> owners;  // asked -> owners asked for
  for (int i = 0; i < dp; ++i) {
    const std::string w = absl::StrCat("worker-", i);
    for (const auto& m : fake_->Sent(w)) {
      if (m.has_fetch_state()) owners[w].push_back(m.fetch_state().owner());
    }
  }
  const std::string recovery = Status().recovery();
  if (dp == 4) {
    EXPECT_EQ(owners, (std::map<std::string, std::vector<std::string>>{{"worker-3", {"worker-3"}}}))
        << "the replica of slot 1's own state";
    EXPECT_NE(recovery.find("DP replica worker-3"), std::string::npos) << recovery;
  } else {
    EXPECT_EQ(owners, (std::map<std::string, std::vector<std::string>>{{"worker-0", {"worker-1"}}}))
        << "the lost rank's snapshot, held by its buddy";
    EXPECT_NE(recovery.find("from worker-0's snapshot"), std::string::npos) << recovery;
    EXPECT_EQ(recovery.find("DP replica"), std::string::npos) << recovery;
  }
  EXPECT_EQ(fake_->StepsRun(spare_name), (std::vector<int64_t>{3, 4}));
}

INSTANTIATE_TEST_SUITE_P(WithAndWithoutAReplicaOfTheSlot, ExpertParallelRecoveryTest, ::testing::Values(4, 2));

// A lost CP rank's replacement gets the state of its own shard: without
// ZeRO from a CP peer (the same parameters and AdamW state), under ZeRO 1
// from the buddy holding its own snapshot, kept apart from its CP peer's
// (the peers of one (pp, tp, dp) are distinct shards).
class ContextParallelRecoveryTest : public JobRunnerTest, public ::testing::WithParamInterface<int> {};

TEST_P(ContextParallelRecoveryTest, ALostCpRankGetsItsOwnShardsState) {
  const int zero_stage = GetParam();
  Start(CpJob(1, 1, 2, 4, zero_stage), 3);  // worker-0: cp rank 0, worker-1: cp rank 1, worker-2 a spare
  KillAt("worker-0", 3);
  ASSERT_EQ(Finish(), JobState::kDone) << runner_->error();
  const std::vector<v1::Configure> spare = fake_->Configures("worker-2");
  ASSERT_EQ(spare.size(), 1u);
  EXPECT_EQ(spare[0].resume_step(), 2) << "not the seed: a source of step 2 was found";
  EXPECT_EQ(spare[0].state(), "0.0@2");
  ASSERT_EQ(spare[0].plan().ranks_size(), 1);
  EXPECT_EQ(spare[0].plan().ranks(0).cp_rank(), 0);
  std::vector<std::string> owners;
  for (const auto& m : fake_->Sent("worker-1")) {
    if (m.has_fetch_state()) owners.push_back(m.fetch_state().owner());
  }
  const std::string recovery = Status().recovery();
  if (zero_stage == 0) {
    EXPECT_EQ(owners, (std::vector<std::string>{"worker-1"})) << "the CP peer's own state";
    EXPECT_NE(recovery.find("DP replica worker-1"), std::string::npos) << recovery;
  } else {
    EXPECT_EQ(owners, (std::vector<std::string>{"worker-0"})) << "the lost rank's snapshot, held by its buddy";
    EXPECT_NE(recovery.find("from worker-1's snapshot"), std::string::npos) << recovery;
  }
  EXPECT_NE(recovery.find("stage 0 (tp 0, dp 0, cp 0) (worker worker-0)"), std::string::npos) << recovery;
}

INSTANTIATE_TEST_SUITE_P(WithoutAndWithZeroStageOne, ContextParallelRecoveryTest, ::testing::Values(0, 1));

TEST_F(JobRunnerTest, ALostCpRankIsNamedWithItsCpRank) {
  Start(CpJob(2, 1, 2, 6, 0), 4);
  KillAt("worker-3", 2);  // global rank 3: pp 1, cp 1
  ASSERT_EQ(Finish(), JobState::kFailed);
  const std::string error(runner_->error().message());
  EXPECT_NE(error.find("stage 1 (tp 0, dp 0, cp 1) (worker worker-3) was lost"), std::string::npos) << error;
}

// Workers holding a context-parallel job from an earlier coordinator report
// no cp rank (HeldJob has none): the job starts over instead of adopting
// two workers into one slot.
// A restarted coordinator adopts a context-parallel job by each worker's
// held cp rank (swapped against a fresh plan's), and resumes it where the
// workers are.
TEST_F(JobRunnerTest, AContextParallelJobIsAdoptedByItsWorkersCpRanks) {
  Start(CpJob(1, 1, 2, 3, 0), 2, [](FakeWorkers* f) {
    f->SetHeld("worker-0", 0, 0, 7, {1, 2}, /*cp=*/1);
    f->SetHeld("worker-1", 0, 0, 7, {1, 2}, /*cp=*/0);
  });
  ASSERT_EQ(Finish(), JobState::kDone) << runner_->error();
  for (const auto& [w, cp] : {std::pair<const char*, int>{"worker-0", 1}, {"worker-1", 0}}) {
    const std::vector<v1::Configure> c = fake_->Configures(w);
    ASSERT_EQ(c.size(), 1u) << w;
    EXPECT_EQ(c[0].resume_step(), 2) << w;
    ASSERT_EQ(c[0].plan().ranks_size(), 1) << w;
    EXPECT_EQ(c[0].plan().ranks(0).cp_rank(), cp) << w << " keeps the cp rank it holds";
    EXPECT_EQ(fake_->StepsRun(w), (std::vector<int64_t>{3})) << w;
  }
  // Two workers claiming one cp rank are no adoptable job: it starts over.
}

TEST_F(JobRunnerTest, AContextParallelJobWhoseWorkersClaimOneCpRankStartsOver) {
  Start(CpJob(1, 1, 2, 3, 0), 2, [](FakeWorkers* f) {
    f->SetHeld("worker-0", 0, 0, 7, {2});
    f->SetHeld("worker-1", 0, 0, 7, {2});
  });
  ASSERT_EQ(Finish(), JobState::kDone) << runner_->error();
  for (const char* w : {"worker-0", "worker-1"}) {
    const std::vector<v1::Configure> c = fake_->Configures(w);
    ASSERT_EQ(c.size(), 1u) << w;
    EXPECT_EQ(c[0].resume_step(), 0) << w;
    EXPECT_EQ(fake_->StepsRun(w), (std::vector<int64_t>{1, 2, 3})) << w;
  }
}

TEST_F(JobRunnerTest, WithoutAReplacementTheJobFailsAfterTheTimeoutNamingTheWorker) {
  Start(Job(2, 1, 6), 2);
  KillAt("worker-1", 2);
  ASSERT_EQ(Finish(), JobState::kFailed);
  const std::string error(runner_->error().message());
  EXPECT_NE(error.find("stage 1 (tp 0, dp 0) (worker worker-1) was lost"), std::string::npos) << error;
  EXPECT_NE(error.find("no replacement"), std::string::npos) << error;
  EXPECT_NE(error.find("replacement_timeout_s"), std::string::npos) << error;
  EXPECT_EQ(Status().job_state(), "failed");
  // The survivor was told to stop.
  bool aborted = false;
  for (const auto& m : fake_->Sent("worker-0")) aborted |= m.has_abort();
  EXPECT_TRUE(aborted);
}

v1::Plan GroupPlan(int pp, int dp) {
  v1::Plan plan;
  plan.set_pp(pp);
  plan.set_tp(1);
  plan.set_dp(dp);
  for (int d = 0; d < dp; ++d) {
    for (int p = 0; p < pp; ++p) {
      v1::RankAssignment* r = plan.add_ranks();
      r->set_worker_name(absl::StrCat("w", d, p));
      r->set_pp_rank(p);
      r->set_dp_rank(d);
      r->set_report_groups(true);
      r->set_verdict_in_run_step(true);
    }
  }
  return plan;
}

TEST(ReportGroupsOfTest, ColumnsByPipelineRankLedByStageZero) {
  const v1::Plan plan = GroupPlan(3, 2);
  EXPECT_EQ(ReportGroupColumns(plan, 6, 16), 1) << "workers without report_group_columns: one column each";
  EXPECT_EQ(ReportGroupColumns(plan, 7, 16), 0) << "below --report_groups_min_ranks";
  EXPECT_EQ(ReportGroupColumns(GroupPlan(1, 8), 1, 16), 0) << "pp 1 in single columns: every rank alone";
  v1::Plan old = plan;
  old.mutable_ranks(4)->set_report_groups(false);  // one worker from before report groups
  EXPECT_EQ(ReportGroupColumns(old, 1, 16), 0);
  absl::StatusOr<std::map<std::string, std::vector<std::string>>> groups = ReportGroupsOf(plan);
  ASSERT_TRUE(groups.ok()) << groups.status();
  EXPECT_EQ(*groups, (std::map<std::string, std::vector<std::string>>{{"w00", {"w01", "w02"}},
                                                                       {"w10", {"w11", "w12"}}}));
  v1::Plan twice = plan;
  twice.mutable_ranks(2)->set_pp_rank(1);
  EXPECT_EQ(ReportGroupsOf(twice).status().code(), absl::StatusCode::kInvalidArgument);
  v1::Plan outside = plan;
  outside.mutable_ranks(2)->set_pp_rank(3);
  EXPECT_EQ(ReportGroupsOf(outside).status().code(), absl::StatusCode::kInvalidArgument);
}

// A plan of pp 2, tp 1, cp 2, dp 2 in global-rank order.
v1::Plan CpPlan() {
  v1::Plan plan = GroupPlan(2, 2);
  plan.clear_ranks();
  plan.set_cp(2);
  for (int d = 0; d < 2; ++d) {
    for (int p = 0; p < 2; ++p) {
      for (int c = 0; c < 2; ++c) {
        v1::RankAssignment* r = plan.add_ranks();
        r->set_worker_name(absl::StrCat("w", d, p, c));
        r->set_global_rank(plan.ranks_size() - 1);
        r->set_pp_rank(p);
        r->set_dp_rank(d);
        r->set_cp_rank(c);
        r->set_report_groups(true);
        r->set_verdict_in_run_step(true);
        r->set_report_group_columns(true);
      }
    }
  }
  return plan;
}

TEST(ValidatePlanMeshTest, AContextParallelPlanHasPpTimesTpTimesCpTimesDpRanks) {
  EXPECT_TRUE(ValidatePlanMesh(GroupPlan(3, 2)).ok()) << "cp unset (0) is 1";
  const v1::Plan plan = CpPlan();
  EXPECT_TRUE(ValidatePlanMesh(plan).ok()) << ValidatePlanMesh(plan);
  v1::Plan short_of_cp = plan;
  short_of_cp.set_cp(1);  // 8 ranks for a mesh of 4
  absl::Status s = ValidatePlanMesh(short_of_cp);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("has 8 ranks"), std::string::npos) << s;
  v1::Plan outside = plan;
  outside.mutable_ranks(3)->set_cp_rank(2);
  s = ValidatePlanMesh(outside);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("rank of w011 (pp 1, tp 0, cp 2, dp 0) is outside the plan's mesh"), std::string::npos)
      << s;
  v1::Plan twice = plan;
  twice.mutable_ranks(3)->set_cp_rank(0);  // w011 on w010's coordinates
  s = ValidatePlanMesh(twice);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("pp 1, tp 0, cp 0, dp 0 is held twice"), std::string::npos) << s;
  // No report groups: their seats know no cp rank.
  EXPECT_EQ(ReportGroupColumns(plan, 1, 4), 0);
  EXPECT_EQ(ReportGroupsOf(plan).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ReportGroupsOfTest, SeveralColumnsWhereEveryWorkerTakesThem) {
  v1::Plan plan = GroupPlan(2, 3);
  for (v1::RankAssignment& r : *plan.mutable_ranks()) r.set_report_group_columns(true);
  EXPECT_EQ(ReportGroupColumns(plan, 1, 4), 2) << "groups of 4 ranks: 2 columns of pp 2";
  EXPECT_EQ(ReportGroupColumns(plan, 1, 16), 3) << "at most every column";
  v1::Plan pp1 = GroupPlan(1, 8);
  for (v1::RankAssignment& r : *pp1.mutable_ranks()) r.set_report_group_columns(true);
  EXPECT_EQ(ReportGroupColumns(pp1, 1, 16), 8) << "pp 1 groups whole columns of one rank";
  v1::Plan mixed = plan;
  mixed.mutable_ranks(5)->set_report_group_columns(false);  // one worker from before it
  EXPECT_EQ(ReportGroupColumns(mixed, 1, 4), 1);
  plan.set_report_group_columns(2);
  absl::StatusOr<std::map<std::string, std::vector<std::string>>> groups = ReportGroupsOf(plan);
  ASSERT_TRUE(groups.ok()) << groups.status();
  // Columns dp 0 and dp 1 in one group (by column, then pp rank), dp 2 in the last.
  EXPECT_EQ(*groups, (std::map<std::string, std::vector<std::string>>{{"w00", {"w01", "w10", "w11"}},
                                                                       {"w20", {"w21"}}}));
}

// The job records the same losses and gradient norms as when every worker
// reports on its own (the reports' numbers depend on the rank: a member's
// report lost or counted as another's would show).
// Param: 0 without groups, 1 one pipeline column per group (workers
// without report_group_columns), 2 both columns in one group.
class ReportGroupsTest : public JobRunnerTest, public ::testing::WithParamInterface<int> {};

TEST_P(ReportGroupsTest, LeadersCarryTheirGroupsReportsAndTheStepsAreTheSame) {
  const int mode = GetParam();
  const bool groups = mode > 0;
  const std::string out = absl::StrCat(::testing::TempDir(), "/report_groups_", mode);
  report_groups_min_ranks_ = 6;
  report_group_ranks_ = 4;  // pp 3: two columns
  v1::JobSpec job = Job(3, 2, 4);
  job.mutable_fault_tolerance()->set_snapshot_every_steps(0);  // every StepDone but the last rides in a report
  Start(job, 6, [mode](FakeWorkers* f) {
    f->SetRankDependentReports();
    if (mode > 0) f->SetReportGroups(/*drop_members=*/false, /*columns=*/mode == 2);
  }, out);
  ASSERT_EQ(Finish(), JobState::kDone) << runner_->error();
  ASSERT_EQ(fake_->Configures("worker-1").size(), 1u);
  EXPECT_EQ(fake_->Configures("worker-1")[0].plan().report_groups(), groups);
  EXPECT_EQ(fake_->Configures("worker-1")[0].plan().report_group_columns(), mode);
  const std::vector<int64_t> all = {1, 2, 3, 4}, none;
  // pp rank 0 of dp 0 leads; so does dp 1's unless both columns are one group.
  std::set<std::string> leaders = {"worker-0"};
  if (mode < 2) leaders.insert("worker-3");
  for (int w = 0; w < 6; ++w) {
    const std::string name = absl::StrCat("worker-", w);
    const bool runs = !groups || leaders.count(name) > 0;
    EXPECT_EQ(fake_->StepsRun(name), runs ? all : none) << name;
    EXPECT_EQ(fake_->StepsPassedOn(name), runs ? none : all) << name;
    EXPECT_EQ(fake_->ModelStep(name), 4) << name;
  }
  absl::StatusOr<std::string> steps = ReadFile(out + "/steps.jsonl");
  ASSERT_TRUE(steps.ok()) << steps.status();
  std::vector<std::string> got, want;
  for (absl::string_view line : absl::StrSplit(*steps, '\n', absl::SkipEmpty())) {
    absl::StatusOr<JsonValue> v = JsonValue::Parse(line);
    ASSERT_TRUE(v.ok()) << line;
    if (v->Find("loss") == nullptr) continue;
    got.push_back(absl::StrCat(v->Find("step")->number(), ": loss ", v->Find("loss")->number(), ", norm ",
                               v->Find("grad_norm")->number()));
  }
  for (int s = 1; s <= 4; ++s) {
    // The last stage's losses averaged over dp; squared norms 0.25 + 0.75 + 1.25 of dp 0's column.
    const double loss = (10.0 / s + (10.0 / s + 0.1)) / 2;
    want.push_back(absl::StrCat(s, ": loss ", std::stod(absl::StrFormat("%.9g", loss)), ", norm 1.5"));
  }
  EXPECT_EQ(got, want);
  // Each member's timings are its stage's.
  std::vector<std::string> stages;
  const v1::GetStatusResponse status = Status();
  for (const v1::StageStatus& st : status.stages()) {
    stages.push_back(absl::StrCat(st.pp_rank(), ": ", absl::StrJoin(st.workers(), " ")));
  }
  EXPECT_EQ(stages, (std::vector<std::string>{"0: worker-0 worker-3", "1: worker-1 worker-4", "2: worker-2 worker-5"}));
  // The traced steps (2 and 3 rode in reports, 4 came apart): every
  // worker's events under its own name.
  absl::StatusOr<JsonValue> trace = JsonValue::Parse(runner_->TraceJson(3, absl::ZeroDuration()));
  ASSERT_TRUE(trace.ok()) << trace.status();
  std::map<int64_t, std::string> process;  // pid -> "stage ... / worker-K"
  std::vector<std::string> events;
  for (const JsonValue& e : trace->Find("traceEvents")->items()) {
    const int64_t pid = e.Find("pid")->integer().value_or(-1);
    if (e.Find("name")->str() == "process_name") process[pid] = e.Find("args")->Find("name")->str();
    if (e.Find("ph")->str() == "X") events.push_back(absl::StrCat(e.Find("name")->str(), " in ", pid));
  }
  ASSERT_EQ(events.size(), 18u);  // 3 steps x 6 workers
  for (std::string& e : events) {
    const std::vector<std::string> parts = absl::StrSplit(e, " in ");
    const std::string by = parts[0].substr(parts[0].rfind(' ') + 1);
    EXPECT_TRUE(absl::EndsWith(process[std::stoll(parts[1])], "/ " + by)) << parts[0] << " shown under "
                                                                         << process[std::stoll(parts[1])];
  }
}

INSTANTIATE_TEST_SUITE_P(WithoutOneAndTwoColumns, ReportGroupsTest, ::testing::Values(0, 1, 2));

// A member lost in a grouped step (its leader's gather fails) or a leader
// lost (its members never get the step) is recovered as any lost worker:
// the first cause is the lost worker, the spare takes its rank, and the
// job ends with every step run.
class ReportGroupsLossTest : public JobRunnerTest, public ::testing::WithParamInterface<const char*> {};

TEST_P(ReportGroupsLossTest, ALostLeaderOrMemberIsReplaced) {
  const std::string victim = GetParam();
  report_groups_min_ranks_ = 4;
  Start(Job(2, 2, 6), 5, [](FakeWorkers* f) { f->SetReportGroups(); });  // worker-4 is a spare
  KillAt(victim, 4);
  ASSERT_EQ(Finish(), JobState::kDone) << runner_->error();
  const v1::GetStatusResponse s = Status();
  EXPECT_EQ(s.recoveries(), 1);
  EXPECT_NE(s.recovery().find(victim), std::string::npos) << s.recovery();
  EXPECT_NE(s.recovery().find("worker-4"), std::string::npos) << s.recovery();
  const std::string m = Metrics();
  EXPECT_NE(m.find("baton_recoveries_total{cause=\"worker_lost\",training_job=\"unit\"} 1"), std::string::npos) << m;
  const std::vector<v1::Configure> spare = fake_->Configures("worker-4");
  ASSERT_EQ(spare.size(), 1u);
  EXPECT_TRUE(spare[0].plan().report_groups());
  EXPECT_EQ(spare[0].resume_step(), 3);
  // The spare runs the replayed steps as the victim's stage did: from the
  // coordinator as a leader, from its leader as a member.
  const std::vector<int64_t> replayed = {4, 5, 6};
  EXPECT_EQ(victim == "worker-2" ? fake_->StepsRun("worker-4") : fake_->StepsPassedOn("worker-4"), replayed);
  EXPECT_EQ(fake_->ModelStep("worker-4"), 6);
}

INSTANTIATE_TEST_SUITE_P(MemberAndLeader, ReportGroupsLossTest, ::testing::Values("worker-3", "worker-2"));

TEST_F(JobRunnerTest, ALeaderThatLeavesOutItsMembersReportsIsTheFaultNamed) {
  report_groups_min_ranks_ = 4;
  v1::JobSpec job = Job(2, 2, 4);
  job.mutable_fault_tolerance()->set_max_restarts(0);
  Start(job, 4, [](FakeWorkers* f) { f->SetReportGroups(/*drop_members=*/true); });
  ASSERT_EQ(Finish(), JobState::kFailed);
  const std::string error(runner_->error().message());
  EXPECT_NE(error.find("stage 0 (tp 0, dp 0) (worker worker-0) sent the reports of 0 members for a report group "
                       "of 2 ranks (step 1)"),
            std::string::npos)
      << error;
}

TEST_F(JobRunnerTest, TheFirstCauseWinsOverAPeersConnectionError) {
  v1::JobSpec job = Job(2, 1, 6);
  job.mutable_fault_tolerance()->set_max_restarts(0);
  Start(job, 2);
  // worker-0 sees the broken connection (and reports it) before the
  // coordinator notices that worker-1's session ended.
  fake_->set_hook([this](const std::string& w, const v1::CoordinatorMessage& m) {
    if (w == "worker-0" && m.has_run_step() && m.run_step().step() == 2) {
      v1::WorkerMessage r;
      r.mutable_report()->set_step(2);
      r.mutable_report()->set_generation(1);
      r.mutable_report()->set_error("recv from rank 1: connection reset by peer");
      r.mutable_report()->set_code(static_cast<int>(absl::StatusCode::kUnavailable));
      runner_->OnWorkerMessage("worker-0", r);
      fake_->Kill("worker-1");
      return false;
    }
    return true;
  });
  ASSERT_EQ(Finish(), JobState::kFailed);
  const absl::Status error = runner_->error();
  EXPECT_EQ(error.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(error.message().find("stage 1 (tp 0, dp 0) (worker worker-1) was lost"), 0u) << error;
  EXPECT_NE(error.message().find("max_restarts"), std::string::npos) << error;
}

// Job() with a GPT (the synthetic cost model has no loss to evaluate) and
// an evaluation every `every` steps on the addition task.
v1::JobSpec EvalJob(int pp, int dp, int steps, int every) {
  v1::JobSpec job = Job(pp, dp, steps);
  job.clear_model();
  job.mutable_model()->set_layers(4);
  job.mutable_model()->set_d_model(16);
  job.mutable_model()->set_heads(2);
  job.mutable_model()->set_vocab(16);
  job.mutable_model()->set_seq_len(8);
  job.mutable_train()->set_eval_every_steps(every);
  job.mutable_train()->mutable_eval_data()->mutable_synthetic()->set_task("addition");
  return job;
}

// The eval lines of `out_dir`/steps.jsonl: step -> loss.
std::map<int64_t, double> EvalLines(const std::string& out_dir, int* lines) {
  std::map<int64_t, double> evals;
  *lines = 0;
  absl::StatusOr<std::string> steps = ReadFile(out_dir + "/steps.jsonl");
  if (!steps.ok()) return evals;
  for (absl::string_view line : absl::StrSplit(*steps, '\n', absl::SkipEmpty())) {
    auto v = JsonValue::Parse(line);
    if (!v.ok() || v->Find("eval") == nullptr) continue;
    ++*lines;
    evals[static_cast<int64_t>(v->Find("eval")->number())] = v->Find("loss")->number();
  }
  return evals;
}

// train.eval_every_steps 2 of 5 steps: Evaluate(2), (4) and (5) go to every
// worker after the step's Commit and before the next RunStep; the held-out
// loss is the last stages' summed loss over their tokens (both DP replicas).
TEST_F(JobRunnerTest, EvaluationsFollowTheirStepsCommitAndAreRecorded) {
  v1::JobSpec job = EvalJob(2, 2, 5, 2);
  const std::string out = testing::TempDir() + "/eval_recorded";
  Start(job, 4, nullptr, out);
  ASSERT_EQ(Finish(), JobState::kDone) << runner_->error();
  for (const char* w : {"worker-0", "worker-1", "worker-2", "worker-3"}) {
    std::vector<std::string> order;
    for (const v1::CoordinatorMessage& m : fake_->Sent(w)) {
      if (m.has_evaluate()) order.push_back(absl::StrCat("E", m.evaluate().step()));
      if (m.has_commit()) order.push_back(absl::StrCat("C", m.commit().step()));
      if (m.has_run_step()) {
        if (m.run_step().has_commit()) order.push_back(absl::StrCat("C", m.run_step().commit().step()));
        order.push_back(absl::StrCat("R", m.run_step().step()));
      }
    }
    EXPECT_EQ(absl::StrJoin(order, " "), "R1 C1 R2 C2 E2 R3 C3 R4 C4 E4 R5 C5 E5") << w;
  }
  int lines = 0;
  const std::map<int64_t, double> evals = EvalLines(out, &lines);
  EXPECT_EQ(lines, 3);
  ASSERT_EQ(evals.size(), 3u);
  EXPECT_DOUBLE_EQ(evals.at(2), 0.5);  // (10 / 2) per replica over 10 tokens each
  EXPECT_DOUBLE_EQ(evals.at(4), 0.25);
  EXPECT_DOUBLE_EQ(evals.at(5), 0.2);
  const v1::GetStatusResponse s = Status();
  EXPECT_EQ(s.eval_step(), 5);
  EXPECT_DOUBLE_EQ(s.eval_loss(), 0.2);
  EXPECT_DOUBLE_EQ(s.eval_perplexity(), std::exp(0.2));
  const std::string m = Metrics();
  EXPECT_NE(m.find("baton_job_eval_loss{training_job=\"unit\"} 0.2"), std::string::npos) << m;
  EXPECT_NE(m.find("baton_job_eval_perplexity{training_job=\"unit\"} 1.22"), std::string::npos) << m;
}

// A worker that fails an evaluation is a fault like a failed step: after the
// recovery (back to its own snapshot of the step) the evaluation runs again
// on the same weights before the next step, and is recorded once.
TEST_F(JobRunnerTest, AFailedEvaluationRecoversAndRunsAgainOnTheSameStep) {
  v1::JobSpec job = EvalJob(2, 1, 5, 2);
  job.mutable_fault_tolerance()->set_snapshot_every_steps(1);
  const std::string out = testing::TempDir() + "/eval_failed";
  Start(job, 2, nullptr, out);
  auto fired = std::make_shared<bool>(false);
  fake_->set_hook([this, fired](const std::string& w, const v1::CoordinatorMessage& m) {
    if (w == "worker-1" && m.has_evaluate() && m.evaluate().step() == 4 && !*fired) {
      *fired = true;
      v1::WorkerMessage r;
      r.mutable_eval_report()->set_step(4);
      r.mutable_eval_report()->set_generation(1);
      r.mutable_eval_report()->set_error("evaluation batch 1 of 1: collective timed out");
      r.mutable_eval_report()->set_code(static_cast<int>(absl::StatusCode::kDeadlineExceeded));
      runner_->OnWorkerMessage("worker-1", r);
      return false;
    }
    return true;
  });
  ASSERT_EQ(Finish(), JobState::kDone) << runner_->error();
  EXPECT_EQ(fake_->Configures("worker-1").back().resume_step(), 4);
  std::vector<int64_t> evaluated;
  for (const v1::CoordinatorMessage& m : fake_->Sent("worker-1")) {
    if (m.has_evaluate()) evaluated.push_back(m.evaluate().step());
  }
  EXPECT_EQ(evaluated, (std::vector<int64_t>{2, 4, 4, 5}));
  EXPECT_EQ(fake_->StepsRun("worker-1"), (std::vector<int64_t>{1, 2, 3, 4, 5}));  // step 4 stood
  int lines = 0;
  const std::map<int64_t, double> evals = EvalLines(out, &lines);
  EXPECT_EQ(lines, 3);
  ASSERT_EQ(evals.count(4), 1u);
  EXPECT_DOUBLE_EQ(evals.at(4), 0.25);  // on step 4's weights, not -1
  EXPECT_NE(Metrics().find("baton_recoveries_total{cause=\"worker_error\",training_job=\"unit\"} 1"),
            std::string::npos);
}

TEST_F(JobRunnerTest, AWorkerErrorWithEveryoneAliveRetriesFromTheSurvivorsOwnState) {
  Start(Job(2, 1, 5), 2);
  auto fired = std::make_shared<bool>(false);
  fake_->set_hook([this, fired](const std::string& w, const v1::CoordinatorMessage& m) {
    if (w == "worker-1" && m.has_run_step() && m.run_step().step() == 3 && !*fired) {
      *fired = true;
      v1::WorkerMessage r;
      r.mutable_report()->set_step(3);
      r.mutable_report()->set_generation(1);
      r.mutable_report()->set_error("collective timed out");
      r.mutable_report()->set_code(static_cast<int>(absl::StatusCode::kDeadlineExceeded));
      runner_->OnWorkerMessage("worker-1", r);
      return false;
    }
    return true;
  });
  ASSERT_EQ(Finish(), JobState::kDone) << runner_->error();
  EXPECT_EQ(fake_->StepsRun("worker-1"), (std::vector<int64_t>{1, 2, 3, 3, 4, 5}));
  EXPECT_EQ(fake_->Configures("worker-1").back().resume_step(), 2);
  EXPECT_NE(Metrics().find("baton_recoveries_total{cause=\"worker_error\",training_job=\"unit\"} 1"),
            std::string::npos);
}

TEST_F(JobRunnerTest, AConfigurationErrorIsNotRetried) {
  Start(Job(2, 1, 5), 2);
  fake_->set_hook([this](const std::string& w, const v1::CoordinatorMessage& m) {
    if (w == "worker-1" && m.has_configure()) {
      v1::WorkerMessage r;
      r.mutable_configured()->set_generation(m.configure().plan().generation());
      r.mutable_configured()->set_error("d_model must be divisible by tp");
      r.mutable_configured()->set_code(static_cast<int>(absl::StatusCode::kInvalidArgument));
      runner_->OnWorkerMessage("worker-1", r);
      return false;
    }
    return true;
  });
  ASSERT_EQ(Finish(), JobState::kFailed);
  EXPECT_EQ(runner_->error().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(runner_->error().message().find("worker-1) cannot start: d_model"), std::string::npos)
      << runner_->error();
  EXPECT_EQ(Status().recoveries(), 0);
}

// A worker whose step runs out of memory (the arena's RESOURCE_EXHAUSTED)
// would run out again at the same step after any number of replays: the
// job fails at once with the worker's message, which says what to lower.
TEST_F(JobRunnerTest, AWorkerOutOfMemoryFailsTheJobWithoutReplaying) {
  Start(Job(2, 1, 5), 2);
  fake_->set_hook([this](const std::string& w, const v1::CoordinatorMessage& m) {
    if (w == "worker-1" && m.has_run_step() && m.run_step().step() == 2) {
      v1::WorkerMessage r;
      r.mutable_report()->set_step(2);
      r.mutable_report()->set_generation(1);
      r.mutable_report()->set_error("cuda:0 is out of memory: an activation arena needs 512.0 MiB more; lower "
                                    "train.micro_batch_size");
      r.mutable_report()->set_code(static_cast<int>(absl::StatusCode::kResourceExhausted));
      runner_->OnWorkerMessage("worker-1", r);
      return false;
    }
    return true;
  });
  ASSERT_EQ(Finish(), JobState::kFailed);
  EXPECT_EQ(runner_->error().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(runner_->error().message().find("failed step 2: cuda:0 is out of memory"), std::string::npos)
      << runner_->error();
  EXPECT_NE(runner_->error().message().find("not recovering: the job does not fit"), std::string::npos)
      << runner_->error();
  EXPECT_EQ(Status().recoveries(), 0);
  EXPECT_EQ(fake_->StepsRun("worker-1"), (std::vector<int64_t>{1, 2}));
}

TEST_F(JobRunnerTest, TooManyFaultsFailTheJobNamingTheLimit) {
  v1::JobSpec job = Job(2, 1, 8);
  job.mutable_fault_tolerance()->set_max_restarts(1);
  Start(job, 4);
  fake_->set_hook([this](const std::string& w, const v1::CoordinatorMessage& m) {
    if (m.has_run_step() && m.run_step().step() == 3 && w != "worker-0") {
      fake_->Kill(w);
      return false;
    }
    return true;
  });
  ASSERT_EQ(Finish(), JobState::kFailed);
  EXPECT_NE(runner_->error().message().find("fault_tolerance.max_restarts = 1"), std::string::npos)
      << runner_->error();
  EXPECT_EQ(Status().recoveries(), 1);
}

TEST_F(JobRunnerTest, ASecondFaultDuringRecoveryEndsInACompletedRecovery) {
  Start(Job(2, 1, 6), 4);  // two spares
  auto fired = std::make_shared<int>(0);
  fake_->set_hook([this, fired](const std::string& w, const v1::CoordinatorMessage& m) {
    if (w == "worker-1" && m.has_run_step() && m.run_step().step() == 4 && *fired == 0) {
      *fired = 1;
      fake_->Kill("worker-1");
      return false;
    }
    if (w == "worker-2" && m.has_configure() && *fired == 1) {  // the first spare dies while configured
      *fired = 2;
      fake_->Kill("worker-2");
      return false;
    }
    return true;
  });
  ASSERT_EQ(Finish(), JobState::kDone) << runner_->error();
  EXPECT_EQ(Status().recoveries(), 2);
  const std::vector<v1::Configure> c = fake_->Configures("worker-3");
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].resume_step(), 3);
  EXPECT_EQ(c[0].state(), "1.0@3");
  EXPECT_EQ(fake_->ModelStep("worker-3"), 6);
  EXPECT_EQ(fake_->ModelStep("worker-0"), 6);
}

// A restarted coordinator finds workers holding the job: it keeps their
// slots and continues from the newest step every shard holds.
TEST_F(JobRunnerTest, ARestartedCoordinatorAdoptsTheJobTheWorkersHold) {
  Start(Job(2, 1, 8), 3, [](FakeWorkers* f) {
    f->SetHeld("worker-0", 1, 0, 3, {4, 5, 6});  // slots swapped w.r.t. a fresh plan
    f->SetHeld("worker-1", 0, 0, 3, {3, 4, 5});
  });
  ASSERT_EQ(Finish(), JobState::kDone) << runner_->error();
  const std::vector<v1::Configure> c0 = fake_->Configures("worker-0"), c1 = fake_->Configures("worker-1");
  ASSERT_EQ(c0.size(), 1u);
  ASSERT_EQ(c1.size(), 1u);
  EXPECT_EQ(c0[0].resume_step(), 5);
  EXPECT_TRUE(c0[0].state().empty());  // from its own memory
  EXPECT_GT(c0[0].plan().generation(), 3);
  // Each Configure's plan holds the worker's own rank only: the slots it held.
  ASSERT_EQ(c0[0].plan().ranks_size(), 1);
  ASSERT_EQ(c1[0].plan().ranks_size(), 1);
  EXPECT_EQ(c0[0].plan().ranks(0).worker_name(), "worker-0");
  EXPECT_EQ(c0[0].plan().ranks(0).pp_rank(), 1);
  EXPECT_EQ(c1[0].plan().ranks(0).worker_name(), "worker-1");
  EXPECT_EQ(c1[0].plan().ranks(0).pp_rank(), 0);
  EXPECT_EQ(fake_->StepsRun("worker-0"), (std::vector<int64_t>{6, 7, 8}));
  EXPECT_TRUE(fake_->Configures("worker-2").empty()) << "the spare stays a spare";
  EXPECT_NE(Metrics().find("baton_recoveries_total{cause=\"coordinator_restart\",training_job=\"unit\"} 1"),
            std::string::npos);
}

// An adopted worker keeps its slot, and the plan says where it really runs:
// its own device and GPU, and the data plane chosen for those (not for the
// placement a fresh plan would have made: worker-0 and worker-1, one a CPU).
TEST_F(JobRunnerTest, AnAdoptedPlanNamesEachWorkersOwnDeviceAndDataPlane) {
  v1::JobSpec job = Job(2, 1, 8);
  job.mutable_model()->clear_synthetic();
  job.mutable_model()->set_d_model(32);
  job.mutable_model()->set_heads(4);
  job.mutable_model()->set_vocab(64);
  job.mutable_model()->set_seq_len(8);
  Start(job, 3, [](FakeWorkers* f) {
    f->SetDevice("worker-0", "cuda:0", "GPU-a");
    f->SetDevice("worker-1", "cpu");
    f->SetDevice("worker-2", "cuda:1", "GPU-b");
    f->SetHeld("worker-0", 1, 0, 3, {4, 5, 6});
    f->SetHeld("worker-2", 0, 0, 3, {4, 5, 6});
  });
  ASSERT_EQ(Finish(), JobState::kDone) << runner_->error();
  const std::vector<v1::Configure> c0 = fake_->Configures("worker-0"), c2 = fake_->Configures("worker-2");
  ASSERT_EQ(c0.size(), 1u);
  ASSERT_EQ(c2.size(), 1u);
  ASSERT_EQ(c0[0].plan().ranks_size(), 1);
  EXPECT_EQ(c0[0].plan().ranks(0).pp_rank(), 1);
  EXPECT_EQ(c0[0].plan().ranks(0).device(), "cuda:0");
  EXPECT_EQ(c0[0].plan().ranks(0).device_uuid(), "GPU-a");
  EXPECT_EQ(c2[0].plan().ranks(0).device(), "cuda:1");
  EXPECT_EQ(c2[0].plan().ranks(0).device_uuid(), "GPU-b");
  EXPECT_EQ(c0[0].plan().comm_backend(), "nccl");
  EXPECT_TRUE(fake_->Configures("worker-1").empty()) << "the CPU worker stays a spare";
}

// The old coordinator died after the workers committed step 5 but before it
// wrote step 5's line: the new one resumes from the newest step it recorded
// (4), so step 5 is replayed and steps.jsonl holds every step exactly once.
TEST_F(JobRunnerTest, AnAdoptedJobReplaysCommittedStepsTheOldCoordinatorNeverRecorded) {
  const std::string out = absl::StrCat(::testing::TempDir(), "/adopt_unrecorded");
  ASSERT_TRUE(MakeDirectories(out).ok());
  std::string lines;
  for (int s = 1; s <= 4; ++s) {
    absl::StrAppend(&lines, "{\"step\": ", s, ", \"committed\": true, \"loss\": 1}\n");
  }
  absl::StrAppend(&lines, "{\"step\": 5, \"comm");  // torn by the crash
  ASSERT_TRUE(WriteFileAtomically(out + "/steps.jsonl", lines).ok());
  Start(
      Job(2, 1, 8), 2,
      [](FakeWorkers* f) {
        f->SetHeld("worker-0", 0, 0, 3, {3, 4, 5});
        f->SetHeld("worker-1", 1, 0, 3, {3, 4, 5});
      },
      out);
  ASSERT_EQ(Finish(), JobState::kDone) << runner_->error();
  EXPECT_EQ(fake_->Configures("worker-0")[0].resume_step(), 4);
  EXPECT_EQ(fake_->StepsRun("worker-0"), (std::vector<int64_t>{5, 6, 7, 8}));
  absl::StatusOr<std::string> written = ReadFile(out + "/steps.jsonl");
  ASSERT_TRUE(written.ok());
  for (int s = 1; s <= 8; ++s) {
    const std::string key = absl::StrCat("{\"step\": ", s, ", ");
    const size_t first = written->find(key);
    EXPECT_NE(first, std::string::npos) << "step " << s << " missing:\n" << *written;
    EXPECT_EQ(written->find(key, first + 1), std::string::npos) << "step " << s << " twice:\n" << *written;
  }
}

// Reports that do not cover every shard (here: one worker of two) are not
// adopted; after the grace period the job starts over.
TEST_F(JobRunnerTest, IncompleteReportsStartTheJobOverAfterTheGrace) {
  Start(Job(2, 1, 3), 2, [](FakeWorkers* f) { f->SetHeld("worker-0", 0, 0, 2, {7}); });
  ASSERT_EQ(Finish(), JobState::kDone) << runner_->error();
  EXPECT_EQ(fake_->Configures("worker-0")[0].resume_step(), 0);
  EXPECT_EQ(fake_->StepsRun("worker-1"), (std::vector<int64_t>{1, 2, 3}));
}

}  // namespace
}  // namespace baton

namespace baton {
namespace {

// A periodic checkpoint puts the job in `saving` from the SaveWeights request
// until every worker copied its state to host memory; the files are written
// in the background while training goes on (running), and the manifest is
// written once every worker reported them.
TEST_F(JobRunnerTest, APeriodicCheckpointIsSavingUntilEveryWorkerCopiedItsState) {
  const std::string root = absl::StrCat(::testing::TempDir(), "/saving_state");
  v1::JobSpec job = Job(2, 1, 6);
  job.mutable_checkpoint()->set_dir(root);
  job.mutable_checkpoint()->set_every_steps(2);
  Start(job, 2);
  absl::Mutex mu;
  std::optional<v1::CoordinatorMessage> held;  // worker-1's SaveWeights of step 4, answered by the test
  std::vector<std::string> states_at_save;
  std::string metrics_at_save;
  fake_->set_hook([&](const std::string& w, const v1::CoordinatorMessage& m) {
    if (m.has_save_weights()) {
      absl::MutexLock lock(&mu);
      states_at_save.push_back(JobStateName(runner_->state()));
      if (w == "worker-1" && m.save_weights().step() == 4) {
        metrics_at_save = Metrics();
        held = m;
        return false;
      }
    }
    if (w == "worker-0" && m.has_run_step() && m.run_step().step() == 6) {
      // worker-1's background write of step 4 finishes during step 6.
      v1::WorkerMessage files;
      files.mutable_saved()->set_ok(true);
      files.mutable_saved()->set_step(4);
      files.mutable_saved()->set_generation(1);
      files.mutable_saved()->add_files("worker-1.safetensors");
      EXPECT_TRUE(MakeDirectories(root + "/step-00000004").ok());
      EXPECT_TRUE(WriteFileAtomically(root + "/step-00000004/worker-1.safetensors", "").ok());
      runner_->OnWorkerMessage("worker-1", files);
    }
    return true;
  });
  started_ = true;
  runner_->Start();
  for (int i = 0; i < 20000; ++i) {
    absl::MutexLock lock(&mu);
    if (held) break;
    mu.AwaitWithTimeout(absl::Condition(+[](std::optional<v1::CoordinatorMessage>* h) { return h->has_value(); },
                                        &held),
                        absl::Milliseconds(1));
  }
  {
    absl::MutexLock lock(&mu);
    ASSERT_TRUE(held.has_value()) << "no checkpoint of step 4 was requested";
    EXPECT_NE(metrics_at_save.find("baton_job_state{state=\"saving\",training_job=\"unit\"} 1"), std::string::npos)
        << metrics_at_save;
    EXPECT_NE(metrics_at_save.find("baton_job_state{state=\"running\",training_job=\"unit\"} 0"), std::string::npos);
  }
  // worker-1 has not copied its state: the job stays in saving and step 5 waits.
  clock_.Advance(absl::Seconds(10));
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(runner_->state(), JobState::kSaving);
  EXPECT_EQ(Status().job_state(), "saving");
  EXPECT_EQ(fake_->StepsRun("worker-0"), (std::vector<int64_t>{1, 2, 3, 4}));
  // The copy is done: training goes on while the files are written.
  v1::WorkerMessage copied;
  copied.mutable_saved()->set_ok(true);
  copied.mutable_saved()->set_copied(true);
  copied.mutable_saved()->set_step(4);
  copied.mutable_saved()->set_generation(1);
  runner_->OnWorkerMessage("worker-1", copied);
  ASSERT_EQ(Finish(), JobState::kDone) << runner_->error();
  EXPECT_EQ(fake_->StepsRun("worker-0"), (std::vector<int64_t>{1, 2, 3, 4, 5, 6}));
  {
    absl::MutexLock lock(&mu);
    // Every save request (steps 2, 4 and 6, both workers) went out in saving.
    EXPECT_EQ(states_at_save, std::vector<std::string>(6, "saving"));
  }
  // Step 4 became complete once its files were reported; keep: 2 pruned step 2.
  EXPECT_TRUE(ReadFile(root + "/step-00000004/manifest.json").ok());
  EXPECT_TRUE(ReadFile(root + "/step-00000006/manifest.json").ok());
  EXPECT_FALSE(ReadFile(root + "/step-00000002/manifest.json").ok());
}

// A worker that never copies its state fails the job after the bound, naming it.
TEST_F(JobRunnerTest, AWorkerThatNeverCopiesItsStateFailsTheJobNamingIt) {
  v1::JobSpec job = Job(2, 1, 4);
  job.mutable_checkpoint()->set_dir(absl::StrCat(::testing::TempDir(), "/never_copied"));
  job.mutable_checkpoint()->set_every_steps(2);
  Start(job, 2);
  fake_->set_hook([](const std::string& w, const v1::CoordinatorMessage& m) {
    return !(w == "worker-1" && m.has_save_weights());
  });
  ASSERT_EQ(Finish(), JobState::kFailed);
  const std::string error(runner_->error().message());
  EXPECT_NE(error.find("checkpoint of step 2: stage 1 (tp 0, dp 0) (worker worker-1) did not copy its state"),
            std::string::npos)
      << error;
  EXPECT_EQ(fake_->StepsRun("worker-0"), (std::vector<int64_t>{1, 2}));
}

}  // namespace
}  // namespace baton

namespace baton {
namespace {

const JsonValue* RecoverySpan(const JsonValue& trace) {
  for (const JsonValue& e : trace.Find("traceEvents")->items()) {
    if (e.Find("ph")->str() == "X" && e.Find("cat")->str() == "recovery") return &e;
  }
  return nullptr;
}

// steps.jsonl and the trace mark a recovery: what was lost, where the state
// came from, the step rolled back to, the replayed steps, how long it took.
TEST_F(JobRunnerTest, StepsJsonlAndTheTraceMarkARecovery) {
  const std::string out = absl::StrCat(::testing::TempDir(), "/recovery_marks");
  Start(Job(2, 1, 6), 3, nullptr, out);
  // While the recovery runs, the trace shows it in progress.
  std::string trace_during;
  auto fired = std::make_shared<bool>(false);
  fake_->set_hook([&, fired](const std::string& w, const v1::CoordinatorMessage& m) {
    if (w == "worker-1" && m.has_run_step() && m.run_step().step() == 4 && !*fired) {
      *fired = true;
      fake_->Kill("worker-1");
      return false;
    }
    if (w == "worker-2" && m.has_configure()) trace_during = runner_->TraceJson(3, absl::ZeroDuration());
    return true;
  });
  ASSERT_EQ(Finish(), JobState::kDone) << runner_->error();

  absl::StatusOr<std::string> steps = ReadFile(out + "/steps.jsonl");
  ASSERT_TRUE(steps.ok());
  std::vector<JsonValue> recovery, recovered;
  for (absl::string_view line : absl::StrSplit(*steps, '\n', absl::SkipEmpty())) {
    auto v = JsonValue::Parse(line);
    ASSERT_TRUE(v.ok()) << line;
    if (v->Find("recovery") != nullptr) recovery.push_back(*v);
    if (v->Find("recovered") != nullptr) recovered.push_back(*v);
  }
  ASSERT_EQ(recovery.size(), 1u) << *steps;
  EXPECT_EQ(recovery[0].Find("cause")->str(), "worker_lost");
  EXPECT_EQ(recovery[0].Find("worker")->str(), "worker-1");
  // It answered the verdict on step 3 (inside RunStep(4)) and was lost in step 4.
  EXPECT_NE(recovery[0].Find("error")->str().find("was lost: its session ended; step 4 did not finish"),
            std::string::npos)
      << *steps;
  EXPECT_EQ(recovery[0].Find("resume_step")->number(), 3);
  EXPECT_EQ(recovery[0].Find("replayed_steps")->number(), 0);
  EXPECT_NE(recovery[0].Find("detail")->str().find("worker-0's snapshot"), std::string::npos) << *steps;
  ASSERT_EQ(recovered.size(), 1u) << *steps;
  EXPECT_EQ(recovered[0].Find("recovered")->number(), 4);
  EXPECT_GT(recovered[0].Find("seconds")->number(), 0);

  // The trace (GetTrace and out/trace.json) shows it as a span with its facts.
  for (const std::string& json : {runner_->TraceJson(3, absl::ZeroDuration()), *ReadFile(out + "/trace.json")}) {
    auto trace = JsonValue::Parse(json);
    ASSERT_TRUE(trace.ok()) << json;
    const JsonValue* span = RecoverySpan(*trace);
    ASSERT_NE(span, nullptr) << json;
    EXPECT_EQ(span->Find("name")->str(), "recovery 1: worker_lost of worker-1");
    const JsonValue& args = *span->Find("args");
    EXPECT_EQ(args.Find("cause")->str(), "worker_lost");
    EXPECT_EQ(args.Find("lost_worker")->str(), "worker-1");
    EXPECT_EQ(args.Find("stage")->str(), "stage 1 (tp 0, dp 0)");
    EXPECT_EQ(args.Find("state_from")->str(), "worker-1: worker-0's snapshot; survivors: their own memory");
    EXPECT_EQ(args.Find("resume_step")->str(), "3");
    EXPECT_EQ(args.Find("replayed_steps")->str(), "0");
    EXPECT_EQ(args.Find("outcome")->str(), "recovered");
    // Fault to the first step after it, as baton_recovery_seconds.
    EXPECT_EQ(*span->Find("dur")->integer(),
              static_cast<int64_t>(std::llround(recovered[0].Find("seconds")->number() * 1e6)));
    EXPECT_GT(*span->Find("dur")->integer(), 0);
  }
  auto during = JsonValue::Parse(trace_during);
  ASSERT_TRUE(during.ok()) << trace_during;
  ASSERT_NE(RecoverySpan(*during), nullptr) << trace_during;
  EXPECT_EQ(RecoverySpan(*during)->Find("args")->Find("outcome")->str(), "in progress");
}

}  // namespace
}  // namespace baton

namespace baton {
namespace {

// --resume of something that is not a complete checkpoint fails the job
// before any worker is configured, naming the directory and the problem.
TEST_F(JobRunnerTest, AResumeFromABrokenCheckpointFailsBeforeAnyWorkerIsConfigured) {
  const std::string dir = absl::StrCat(::testing::TempDir(), "/not_a_checkpoint");
  ASSERT_TRUE(MakeDirectories(dir).ok());
  ASSERT_TRUE(WriteFileAtomically(dir + "/chunk0-tp0.safetensors", "truncated").ok());
  fake_ = std::make_unique<FakeWorkers>(2);
  JobRunner::Options options;
  options.resume_dir = dir;
  runner_ = std::make_unique<JobRunner>(Job(2, 1, 5), fake_.get(), &clock_, options, metrics_);
  fake_->set_runner(runner_.get());
  ASSERT_EQ(Finish(), JobState::kFailed);
  const std::string error(runner_->error().message());
  EXPECT_NE(error.find("--resume"), std::string::npos) << error;
  EXPECT_NE(error.find(dir), std::string::npos) << error;
  EXPECT_NE(error.find("manifest"), std::string::npos) << error;
  for (const char* w : {"worker-0", "worker-1"}) EXPECT_TRUE(fake_->Configures(w).empty()) << w;
}

}  // namespace
}  // namespace baton

namespace baton {
namespace {

// GetTrace waits for the next N steps across the saving periods between
// them (a checkpoint after every step here), not just until the job leaves
// `running` for the first time.
TEST_F(JobRunnerTest, GetTraceWaitsForItsStepsAcrossPeriodicSaves) {
  v1::JobSpec job = Job(2, 1, 12);
  job.mutable_checkpoint()->set_dir(absl::StrCat(::testing::TempDir(), "/trace_across_saves"));
  job.mutable_checkpoint()->set_every_steps(1);
  Start(job, 2);
  absl::Mutex mu;
  bool at_step_3 = false, go = false;
  fake_->set_hook([&](const std::string& w, const v1::CoordinatorMessage& m) {
    if (w == "worker-0" && m.has_run_step() && m.run_step().step() == 3) {
      absl::MutexLock lock(&mu);
      at_step_3 = true;
      mu.Await(absl::Condition(&go));  // the job holds here until the trace was requested
    }
    return true;
  });
  started_ = true;
  runner_->Start();
  {
    absl::MutexLock lock(&mu);
    ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&at_step_3), absl::Seconds(30)));
  }
  std::string trace;
  std::thread requester([&] { trace = runner_->TraceJson(2, absl::Seconds(60)); });
  absl::SleepFor(absl::Milliseconds(200));  // ordering only: the request is made before the job goes on
  {
    absl::MutexLock lock(&mu);
    go = true;
  }
  ASSERT_EQ(Finish(), JobState::kDone) << runner_->error();
  requester.join();
  auto parsed = JsonValue::Parse(trace);
  ASSERT_TRUE(parsed.ok()) << trace;
  std::set<std::string> names;
  for (const JsonValue& e : parsed->Find("traceEvents")->items()) {
    if (e.Find("ph")->str() == "X") names.insert(e.Find("name")->str());
  }
  // Steps 4 and 5: the first two sent after the request (step 3 was already out).
  EXPECT_EQ(names, (std::set<std::string>{"step 4", "step 5"})) << trace;
}

}  // namespace
}  // namespace baton
