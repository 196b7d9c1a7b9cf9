#include "coordinator/job_runner.h"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <sys/stat.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/chrome_trace.h"
#include "common/file_io.h"
#include "common/json.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "coordinator/job_spec.h"
#include "coordinator/planner.h"
#include "coordinator/schedule/builders.h"
#include "coordinator/schedule/ir.h"
#include "coordinator/schedule/lowering.h"
#include "coordinator/schedule/simulator.h"
#include "coordinator/schedule/validator.h"
#include "prometheus/counter.h"
#include "worker/checkpoint/checkpoint.h"
#include "prometheus/gauge.h"

namespace baton {
namespace {

std::string Num(double v) { return std::isfinite(v) ? absl::StrFormat("%.9g", v) : "null"; }

// Simulator costs for the live plan: the synthetic model's own times, or
// F = I = W = 1 per block with per-stage multipliers from the partition.
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
    cost.push_back(p.num_layers() + (p.has_embedding() ? lc.embedding : 0) + (p.has_head() ? lc.head : 0));
    total += cost.back();
  }
  for (double c : cost) costs.stage_multipliers.push_back(c * cost.size() / total);
  return costs;
}

}  // namespace

JobRunner::JobRunner(v1::JobSpec job, WorkerRegistry* registry, KvStore* kv, Options options,
                     prometheus::Registry& metrics)
    : job_(std::move(job)), registry_(registry), kv_(kv), options_(std::move(options)) {
  const prometheus::Labels labels = {{"job", job_.name()}};
  expected_bubble_metric_ = &prometheus::BuildGauge()
                                 .Name("baton_expected_bubble_ratio")
                                 .Help("Bubble ratio the simulator expects for the live plan (0-1)")
                                 .Register(metrics)
                                 .Add(labels);
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

void JobRunner::Run() {
  absl::Status s = RunJob();
  if (!s.ok()) {
    Fail(s);
    return;
  }
  absl::MutexLock lock(&mu_);
  state_ = "done";
  BATON_LOG(INFO) << "job '" << job_.name() << "' done after " << steps_.size() << " steps";
}

void JobRunner::Fail(const absl::Status& why) {
  {
    absl::MutexLock lock(&mu_);
    if (state_ == "failed") return;
    state_ = "failed";
    failed_ = true;
    error_ = why;
  }
  BATON_LOG(ERROR) << "job '" << job_.name() << "' failed: " << why.message();
  v1::CoordinatorMessage abort;
  abort.mutable_abort()->set_reason(std::string(why.message()));
  SendAll(abort);
  if (!options_.out_dir.empty()) WriteOutputs().IgnoreError();
}

void JobRunner::OnWorkerLost(const std::string& worker, const std::string& why) {
  absl::Status failure;
  {
    absl::MutexLock lock(&mu_);
    if (!assigned_.count(worker) || state_ == "done" || state_ == "failed") return;
    failure = absl::UnavailableError(
        absl::StrCat(StageOf(worker), " (worker ", worker, ") was lost: ", why, "; step ", steps_.size() + 1,
                     " did not finish (replace the worker and run the job again)"));
    failed_ = true;
    error_ = failure;
  }
  BATON_LOG(ERROR) << failure.message();
}

std::string JobRunner::StageOf(const std::string& worker) const {
  auto it = assigned_.find(worker);
  if (it == assigned_.end()) return "a spare";
  const v1::RankAssignment& r = it->second;
  return absl::StrCat("stage ", r.pp_rank(), " (tp ", r.tp_rank(), ", dp ", r.dp_rank(), ")");
}

void JobRunner::OnWorkerMessage(const std::string& worker, const v1::WorkerMessage& message) {
  absl::MutexLock lock(&mu_);
  if (!assigned_.count(worker)) return;
  switch (message.body_case()) {
    case v1::WorkerMessage::kConfigured:
      configured_[worker] = message;
      if (!message.configured().ok()) {
        failed_ = true;
        error_ = absl::FailedPreconditionError(
            absl::StrCat(StageOf(worker), " (worker ", worker, ") cannot start: ", message.configured().error()));
      }
      break;
    case v1::WorkerMessage::kReport:
      reports_[worker] = message;
      if (!message.report().error().empty()) {
        failed_ = true;
        error_ = absl::InternalError(absl::StrCat(StageOf(worker), " (worker ", worker, ") failed step ",
                                                  message.report().step(), ": ", message.report().error()));
      }
      break;
    case v1::WorkerMessage::kStepDone:
      done_[worker] = message;
      if (!message.step_done().error().empty()) {
        failed_ = true;
        error_ = absl::InternalError(absl::StrCat(StageOf(worker), " (worker ", worker, ") failed step ",
                                                  message.step_done().step(), ": ", message.step_done().error()));
      }
      break;
    case v1::WorkerMessage::kSaved:
      saved_[worker] = message;
      if (!message.saved().ok()) {
        failed_ = true;
        error_ = absl::InternalError(
            absl::StrCat(StageOf(worker), " (worker ", worker, ") could not save: ", message.saved().error()));
      }
      break;
    default:
      break;
  }
}

void JobRunner::SendAll(const v1::CoordinatorMessage& message) {
  std::vector<std::string> names;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [name, a] : assigned_) names.push_back(name);
  }
  fan_out_.Run(names.size(), [&](size_t i) {
    if (auto session = registry_->SessionOf(names[i])) session->Send(message);
  });
}

absl::StatusOr<std::map<std::string, v1::WorkerMessage>> JobRunner::Collect(
    std::map<std::string, v1::WorkerMessage>* inbox, absl::Duration timeout, const char* what) {
  absl::MutexLock lock(&mu_);
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return failed_ || stopping_ || inbox->size() >= assigned_.size();
  };
  mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
  if (failed_) return error_;
  if (stopping_) return absl::CancelledError("coordinator shutting down");
  if (inbox->size() < assigned_.size()) {
    std::vector<std::string> missing;
    for (const auto& [name, a] : assigned_) {
      if (!inbox->count(name)) missing.push_back(absl::StrCat(name, " (", StageOf(name), ")"));
    }
    return absl::DeadlineExceededError(absl::StrCat("no ", what, " within ", absl::FormatDuration(timeout),
                                                    " from ", absl::StrJoin(missing, ", ")));
  }
  std::map<std::string, v1::WorkerMessage> out;
  out.swap(*inbox);
  return out;
}

absl::Status JobRunner::WaitForWorkers(std::vector<v1::WorkerInfo>* ready) {
  const int world = DimsOf(job_).world_size();
  const absl::Time start = absl::Now();
  bool reported = false;
  for (;;) {
    ready->clear();
    for (v1::WorkerInfo& w : registry_->List()) {
      if (w.state() == v1::READY) ready->push_back(std::move(w));
    }
    if (static_cast<int>(ready->size()) >= world) {
      absl::MutexLock lock(&mu_);
      error_ = absl::OkStatus();
      return absl::OkStatus();
    }
    absl::MutexLock lock(&mu_);
    if (!reported && absl::Now() - start > options_.ready_timeout) {
      reported = true;
      error_ = absl::FailedPreconditionError(
          absl::StrCat("job '", job_.name(), "' needs pp*tp*dp = ", world, " ready workers, ", ready->size(),
                       " are ready after ", absl::FormatDuration(options_.ready_timeout), "; start ",
                       world - static_cast<int>(ready->size()), " more workers (still waiting)"));
      BATON_LOG(WARNING) << error_.message();
    }
    auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_; };
    if (mu_.AwaitWithTimeout(absl::Condition(&stop), absl::Milliseconds(100))) {
      return absl::CancelledError("coordinator shutting down");
    }
  }
}

absl::Status JobRunner::Configure(const std::vector<v1::WorkerInfo>& ready) {
  const int64_t generation = kv_->CurrentGeneration(job_.name()) + 1;
  kv_->AdvanceGeneration(job_.name(), generation);
  BATON_ASSIGN_OR_RETURN(v1::Plan plan, MakePlan(job_, ready, generation));
  const ParallelDims d = DimsOf(job_);
  schedule::ScheduleSpec spec{job_.schedule().kind(), d.pp, job_.schedule().microbatches(), d.virtual_stages};
  BATON_ASSIGN_OR_RETURN(schedule::Schedule compute, schedule::BuildSchedule(spec));
  const schedule::CostModel costs = CostsFor(job_, plan);
  BATON_ASSIGN_OR_RETURN(schedule::Schedule lowered, schedule::Lower(compute, costs));
  BATON_RETURN_IF_ERROR_CTX(schedule::Validate(lowered), "the schedule failed validation");
  BATON_ASSIGN_OR_RETURN(schedule::SimulationResult sim, schedule::Simulate(lowered, costs));
  std::vector<v1::Program> programs = schedule::ToPrograms(lowered);
  {
    absl::MutexLock lock(&mu_);
    plan_ = plan;
    expected_bubble_ = sim.bubble_ratio;
    assigned_.clear();
    for (const v1::RankAssignment& r : plan.ranks()) assigned_[r.worker_name()] = r;
    state_ = "configuring";
  }
  expected_bubble_metric_->Set(sim.bubble_ratio);
  BATON_LOG(INFO) << "job '" << job_.name() << "' generation " << generation << ": " << plan.ranks_size()
                  << " workers, schedule " << spec.kind << " (expected bubble "
                  << absl::StrFormat("%.1f%%", 100 * sim.bubble_ratio) << "), " << plan.spares_size()
                  << " spares";
  // Each worker gets the plan with its own rank only (a worker reads nothing
  // else of plan.ranks): the full list in every Configure would make
  // configuring quadratic in the workers (547 MB of messages at 4096).
  v1::Plan shared = plan;
  shared.clear_ranks();
  shared.clear_spares();
  absl::Mutex gone_mu;
  std::string gone;
  fan_out_.Run(plan.ranks_size(), [&](size_t i) {
    const v1::RankAssignment& r = plan.ranks(static_cast<int>(i));
    v1::CoordinatorMessage msg;
    *msg.mutable_configure()->mutable_plan() = shared;
    *msg.mutable_configure()->mutable_plan()->add_ranks() = r;
    *msg.mutable_configure()->mutable_program() = programs[r.pp_rank()];
    *msg.mutable_configure()->mutable_job() = job_;
    auto session = registry_->SessionOf(r.worker_name());
    if (session == nullptr || !session->Send(msg)) {
      absl::MutexLock lock(&gone_mu);
      if (gone.empty()) gone = r.worker_name();
    }
  });
  if (!gone.empty()) {
    return absl::UnavailableError(absl::StrCat("worker ", gone, " went away before it was configured"));
  }
  absl::StatusOr<std::map<std::string, v1::WorkerMessage>> configured =
      Collect(&configured_, options_.configure_timeout, "Configured");
  return configured.status();
}

absl::Status JobRunner::RunStep(int64_t step) {
  const absl::Time start = absl::Now();
  v1::CoordinatorMessage run;
  run.mutable_run_step()->set_step(step);
  {
    absl::MutexLock lock(&mu_);
    const bool requested = trace_requested_ > 0;
    if (requested) --trace_requested_;
    run.mutable_run_step()->set_trace(requested || step > job_.train().steps() - options_.traced_steps);
  }
  SendAll(run);
  BATON_ASSIGN_OR_RETURN(auto reports, Collect(&reports_, options_.step_timeout, "GradsReady"));

  double sq = 0, loss = 0;
  int losses = 0;
  int64_t correct = 0, predicted = 0;
  bool finite = true;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [name, msg] : reports) {
      const v1::StepReport& r = msg.report();
      const v1::RankAssignment& rank = assigned_[name];
      finite &= r.finite();
      if (rank.dp_rank() == 0) sq += r.grad_sq_norm();  // DP replicas hold the same averaged gradients
      if (r.has_loss() && rank.tp_rank() == 0) {
        loss += r.loss();
        ++losses;
        correct += r.correct();
        predicted += r.predicted();
      }
    }
  }
  loss = losses > 0 ? loss / losses : 0;
  const double norm = std::sqrt(sq);
  finite &= std::isfinite(norm) && std::isfinite(loss);
  const double max_norm = job_.train().grad_clip();
  const double clip = max_norm > 0 && norm > max_norm ? max_norm / norm : 1.0;
  v1::CoordinatorMessage verdict;
  if (finite) {
    verdict.mutable_commit()->set_step(step);
    verdict.mutable_commit()->set_clip_factor(clip);
  } else {
    verdict.mutable_discard()->set_step(step);
    verdict.mutable_discard()->set_reason("non-finite loss or gradient");
    discarded_metric_->Increment();
    BATON_LOG(WARNING) << "step " << step << " discarded: non-finite loss or gradient norm";
  }
  SendAll(verdict);
  BATON_ASSIGN_OR_RETURN(auto done, Collect(&done_, options_.step_timeout, "StepDone"));
  const double wall = absl::ToDoubleSeconds(absl::Now() - start);

  const ParallelDims d = DimsOf(job_);
  const double tokens = static_cast<double>(job_.schedule().microbatches()) * job_.train().micro_batch_size() *
                        std::max(1, job_.model().seq_len()) * d.dp;
  StepRecord rec;
  rec.step = step;
  rec.committed = finite;
  rec.loss = loss;
  rec.accuracy = predicted > 0 ? static_cast<double>(correct) / predicted : 0;
  rec.grad_norm = norm;
  rec.clip = clip;
  rec.wall = wall;
  rec.tokens_per_second = tokens / wall;
  double bubble = 0, comm = 0, worker_wall = 0;
  std::map<int, v1::StageStatus> stages;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [name, msg] : done) {
      const v1::StepDone& s = msg.step_done();
      const double c = s.comm_p2p_seconds() + s.comm_tp_seconds() + s.comm_dp_seconds();
      bubble += s.bubble_seconds();
      comm += c;
      worker_wall += s.wall_seconds();
      v1::StageStatus& st = stages[assigned_[name].pp_rank()];
      st.set_pp_rank(assigned_[name].pp_rank());
      st.set_step(step);
      st.set_bubble_ratio(st.bubble_ratio() + s.bubble_seconds() / std::max(1e-9, s.wall_seconds()));
      st.set_comm_ratio(st.comm_ratio() + c / std::max(1e-9, s.wall_seconds()));
      st.add_workers(name);
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
    if (run.run_step().trace()) {
      std::map<std::string, v1::StepDone> events;
      for (const auto& [name, msg] : done) events[name] = msg.step_done();
      traces_.emplace_back(step, std::move(events));
      while (static_cast<int>(traces_.size()) > std::max(1, options_.max_kept_traces)) traces_.pop_front();
    }
  }
  step_metric_->Set(static_cast<double>(step));
  if (finite) loss_metric_->Set(loss);
  if (!options_.out_dir.empty()) {
    std::ofstream out(options_.out_dir + "/steps.jsonl", std::ios::app);
    out << "{\"step\": " << step << ", \"committed\": " << (finite ? "true" : "false") << ", \"loss\": " << Num(loss)
        << ", \"accuracy\": " << Num(rec.accuracy) << ", \"grad_norm\": " << Num(norm) << ", \"clip\": " << Num(clip)
        << ", \"wall_seconds\": " << Num(wall) << ", \"tokens_per_second\": " << Num(rec.tokens_per_second)
        << ", \"bubble_ratio\": " << Num(rec.bubble_ratio) << ", \"comm_ratio\": " << Num(rec.comm_ratio) << "}\n";
  }
  return absl::OkStatus();
}

absl::Status JobRunner::Save() {
  {
    absl::MutexLock lock(&mu_);
    state_ = "saving";
  }
  const std::string dir = options_.out_dir + "/final";
  BATON_RETURN_IF_ERROR(MakeDirectories(dir));
  v1::CoordinatorMessage save;
  save.mutable_save_weights()->set_dir(dir);
  SendAll(save);
  BATON_ASSIGN_OR_RETURN(auto saved, Collect(&saved_, options_.configure_timeout, "Saved"));
  std::vector<std::string> files;
  for (const auto& [name, msg] : saved) {
    for (const std::string& f : msg.saved().files()) files.push_back(f);
  }
  std::sort(files.begin(), files.end());
  return checkpoint::WriteManifest(dir, files, job_.name(), job_.train().steps());
}

absl::Status JobRunner::RunJob() {
  if (!options_.out_dir.empty()) {
    BATON_RETURN_IF_ERROR(MakeDirectories(options_.out_dir));
    std::remove((options_.out_dir + "/steps.jsonl").c_str());
  }
  std::vector<v1::WorkerInfo> ready;
  BATON_RETURN_IF_ERROR(WaitForWorkers(&ready));
  BATON_RETURN_IF_ERROR_CTX(Configure(ready), "configuring the job");
  {
    absl::MutexLock lock(&mu_);
    state_ = "running";
  }
  for (int64_t step = 1; step <= job_.train().steps(); ++step) {
    BATON_RETURN_IF_ERROR_CTX(RunStep(step), "step ", step);
  }
  if (!options_.out_dir.empty()) {
    BATON_RETURN_IF_ERROR_CTX(Save(), "saving the final weights");
    BATON_RETURN_IF_ERROR(WriteOutputs());
  }
  return absl::OkStatus();
}

absl::Status JobRunner::WriteOutputs() {
  std::string summary;
  {
    absl::MutexLock lock(&mu_);
    const StepRecord last = steps_.empty() ? StepRecord() : steps_.back();
    summary = absl::StrCat(
        "{\"job\": ", JsonQuote(job_.name()), ", \"state\": ", JsonQuote(state_ == "saving" ? "done" : state_),
        ", \"steps\": ", steps_.size(), ", \"final_loss\": ", Num(last.loss),
        ", \"final_accuracy\": ", Num(last.accuracy),
        ", \"tokens_per_second\": ", Num(total_wall_ > 0 ? total_tokens_ / total_wall_ : 0),
        ", \"bubble_ratio\": ", Num(sum_worker_wall_ > 0 ? sum_bubble_ / sum_worker_wall_ : 0),
        ", \"comm_ratio\": ", Num(sum_worker_wall_ > 0 ? sum_comm_ / sum_worker_wall_ : 0),
        ", \"expected_bubble_ratio\": ", Num(expected_bubble_), ", \"wall_seconds\": ", Num(total_wall_),
        ", \"discarded_steps\": ", std::count_if(steps_.begin(), steps_.end(), [](const StepRecord& r) {
          return !r.committed;
        }),
        ", \"error\": ", JsonQuote(error_.message()), "}\n");
  }
  BATON_RETURN_IF_ERROR(
      WriteFileAtomically(options_.out_dir + "/trace.json", TraceJson(options_.traced_steps, absl::ZeroDuration())));
  return WriteFileAtomically(options_.out_dir + "/summary.json", summary);
}

void JobRunner::FillStatus(v1::GetStatusResponse* status) const {
  absl::MutexLock lock(&mu_);
  status->set_job_state(state_);
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
  }
  for (const v1::StageStatus& s : stage_status_) *status->add_stages() = s;
}

std::string JobRunner::TraceJson(int steps, absl::Duration wait) {
  absl::MutexLock lock(&mu_);
  steps = std::min(steps, options_.max_kept_traces);
  if (state_ == "running" && wait > absl::ZeroDuration()) {
    const int64_t after = static_cast<int64_t>(steps_.size());
    trace_requested_ = std::max(trace_requested_, steps);
    auto traced = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      int n = 0;
      for (const auto& t : traces_) n += t.first > after;
      return n >= steps || state_ != "running" || stopping_;
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
  return ChromeTraceJson(spans);
}

}  // namespace baton
