// WorkerJob's logic against fakes: a fake session (collects the replies), the
// fake coordinator KV on loopback for the rendezvous, and two WorkerJobs in
// this process joined by real Gloo pairs, training a tiny GPT (pp=2) or one
// worker alone (pp=1). The coordinator's messages are built here as the
// coordinator builds them (planner + schedule lowering).
//
// Covered: configure, run a step, commit / discard, snapshots and
// Describe, an abort while a step is blocked on a lost peer (the in-memory
// state is kept and can be fetched), buddy copies, rolling back to step R
// and replaying bit for bit, a stale generation refused, periodic
// checkpoints (copied, then files), and a clear error for every bad message.
#include "worker/worker_job.h"

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/report_group.h"
#include "coordinator/planner.h"
#include "coordinator/schedule/builders.h"
#include "coordinator/schedule/ir.h"
#include "coordinator/schedule/lowering.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/sim/sim_backend.h"
#include "prometheus/registry.h"
#include "worker/checkpoint/train_state.h"
#include "worker/comm/fake_coordinator_kv.h"

namespace baton {
namespace {

constexpr absl::Duration kWait = absl::Seconds(60);  // a bound, not a timing assertion

// The session: every reply, in order.
class FakeSession : public JobSession {
 public:
  bool Send(v1::WorkerMessage message) override {
    absl::MutexLock lock(&mu_);
    if (message.has_snapshot()) {  // a slow link: held until released
      auto released = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !hold_snapshots_; };
      mu_.Await(absl::Condition(&released));
    }
    messages_.push_back(std::move(message));
    return true;
  }
  // While held, a snapshot's Send blocks (its transfer takes that long).
  void HoldSnapshots(bool hold) {
    absl::MutexLock lock(&mu_);
    hold_snapshots_ = hold;
  }
  // Waits (bounded) until the step heartbeats report is `step`.
  bool AwaitStep(int64_t step) {
    absl::MutexLock lock(&mu_);
    auto there = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return step_ == step; };
    return mu_.AwaitWithTimeout(absl::Condition(&there), kWait);
  }
  void SetStep(int64_t step) override {
    absl::MutexLock lock(&mu_);
    step_ = step;
  }
  int64_t CoordinatorNowMicros() const override { return absl::ToUnixMicros(absl::Now()); }

  // Takes the oldest reply of kind `what` (waits up to kWait).
  std::optional<v1::WorkerMessage> Next(v1::WorkerMessage::BodyCase what) {
    absl::MutexLock lock(&mu_);
    auto has = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      for (const auto& m : messages_) {
        if (m.body_case() == what) return true;
      }
      return false;
    };
    mu_.AwaitWithTimeout(absl::Condition(&has), kWait);
    for (auto it = messages_.begin(); it != messages_.end(); ++it) {
      if (it->body_case() != what) continue;
      v1::WorkerMessage m = std::move(*it);
      messages_.erase(it);
      return m;
    }
    return std::nullopt;
  }
  // The kinds of the waiting replies, in order, once one of kind `what` is
  // among them (waits up to kWait).
  std::vector<v1::WorkerMessage::BodyCase> KindsOnceThere(v1::WorkerMessage::BodyCase what) {
    absl::MutexLock lock(&mu_);
    auto has = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return std::any_of(messages_.begin(), messages_.end(), [&](const auto& m) { return m.body_case() == what; });
    };
    mu_.AwaitWithTimeout(absl::Condition(&has), kWait);
    std::vector<v1::WorkerMessage::BodyCase> kinds;
    for (const auto& m : messages_) kinds.push_back(m.body_case());
    return kinds;
  }
  // How many replies of kind `what` are waiting (no wait).
  int Count(v1::WorkerMessage::BodyCase what) {
    absl::MutexLock lock(&mu_);
    int n = 0;
    for (const auto& m : messages_) n += m.body_case() == what;
    return n;
  }
  int64_t step() {
    absl::MutexLock lock(&mu_);
    return step_;
  }

 private:
  absl::Mutex mu_;
  std::vector<v1::WorkerMessage> messages_ ABSL_GUARDED_BY(mu_);
  int64_t step_ ABSL_GUARDED_BY(mu_) = -1;
  bool hold_snapshots_ ABSL_GUARDED_BY(mu_) = false;
};

v1::JobSpec Spec(int pp) {
  v1::JobSpec job;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(R"pb(
    name: "wj"
    model { layers: 2 d_model: 16 heads: 2 vocab: 16 seq_len: 20 }
    schedule { kind: "1f1b" microbatches: 2 }
    train { steps: 10 micro_batch_size: 2 lr: 0.01 weight_decay: 0.01 grad_clip: 1.0 seed: 3 }
    data { synthetic { task: "addition" } }
  )pb",
                                                            &job));
  job.mutable_parallel()->set_pp(pp);
  return job;
}

struct Worker {
  std::string name;
  FakeSession* session = nullptr;  // owned by job
  std::unique_ptr<prometheus::Registry> metrics;
  std::unique_ptr<WorkerJob> job;
};

class WorkerJobTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = comm::FakeCoordinatorKvServer::Start();
    ASSERT_TRUE(server.ok()) << server.status();
    kv_ = std::move(*server);
  }

  // `n` workers "w0".."w<n-1>" for a job of pp = n.
  void StartWorkers(int n) {
    spec_ = Spec(n);
    for (int i = 0; i < n; ++i) workers_.push_back(MakeWorker(absl::StrCat("w", i)));
  }
  Worker MakeWorker(const std::string& name, const std::string& device = "cpu") {
    Worker w;
    w.name = name;
    auto session = std::make_unique<FakeSession>();
    w.session = session.get();
    w.metrics = std::make_unique<prometheus::Registry>();
    WorkerJob::Options o;
    o.name = name;
    o.device = device;
    o.op_timeout = absl::Seconds(60);
    o.rendezvous_timeout = absl::Seconds(30);
    o.output_dirs = {::testing::TempDir()};  // checkpoints are written only under --output_dir
    w.job = std::make_unique<WorkerJob>(o, comm::ConnectCoordinator(kv_->address()), std::move(session),
                                        *w.metrics);
    return w;
  }

  // Configure as the coordinator sends it (its own rank, the program of its stage).
  v1::CoordinatorMessage ConfigureFor(const Worker& w, int64_t generation, int64_t resume = 0,
                                      const std::string& state = "") {
    std::vector<v1::WorkerInfo> ready;
    for (const Worker& x : workers_) {
      v1::WorkerInfo info;
      info.set_name(x.name);
      info.set_host("127.0.0.1");
      info.set_device("cpu");
      info.set_state(v1::READY);
      ready.push_back(info);
    }
    absl::StatusOr<v1::Plan> plan = MakePlan(spec_, ready, generation);
    EXPECT_TRUE(plan.ok()) << plan.status();
    if (plan.ok()) {
      plan->set_report_groups(report_groups_);
      plan->set_report_group_columns(report_group_columns_);
    }
    const int pp = spec_.parallel().pp();
    absl::StatusOr<schedule::Schedule> compute =
        schedule::BuildSchedule({spec_.schedule().kind(), pp, spec_.schedule().microbatches(), 1});
    EXPECT_TRUE(compute.ok()) << compute.status();
    absl::StatusOr<schedule::Schedule> lowered = schedule::Lower(*compute);
    EXPECT_TRUE(lowered.ok()) << lowered.status();
    const std::vector<v1::Program> programs = schedule::ToPrograms(*lowered);
    v1::CoordinatorMessage m;
    v1::Configure* c = m.mutable_configure();
    *c->mutable_plan() = *plan;
    for (const v1::RankAssignment& r : plan->ranks()) {
      if (r.worker_name() == w.name) *c->mutable_program() = programs[r.pp_rank()];
    }
    *c->mutable_job() = spec_;
    c->set_resume_step(resume);
    c->set_state(state);
    return m;
  }

  // Configures every worker (states: a replacement's ShardState by name) and
  // returns their Configured replies.
  std::vector<v1::Configured> ConfigureAll(int64_t generation, int64_t resume = 0,
                                           const std::map<std::string, std::string>& states = {}) {
    for (Worker& w : workers_) {
      auto it = states.find(w.name);
      w.job->Handle(ConfigureFor(w, generation, resume, it == states.end() ? "" : it->second));
    }
    std::vector<v1::Configured> out;
    for (Worker& w : workers_) {
      std::optional<v1::WorkerMessage> m = w.session->Next(v1::WorkerMessage::kConfigured);
      EXPECT_TRUE(m.has_value()) << w.name << " did not answer Configure";
      out.push_back(m ? m->configured() : v1::Configured());
    }
    return out;
  }

  struct StepResult {
    std::map<std::string, v1::StepReport> reports;
    std::map<std::string, v1::StepDone> done;
    std::map<std::string, std::string> snapshots;  // ShardState bytes by worker
  };
  // RunStep(n) on every worker, then Commit(n) (or Discard), asking for a
  // snapshot when `snapshot`.
  StepResult Step(int64_t n, bool commit = true, bool snapshot = true) {
    StepResult r;
    v1::CoordinatorMessage run;
    run.mutable_run_step()->set_step(n);
    for (Worker& w : workers_) w.job->Handle(run);
    for (Worker& w : workers_) {
      std::optional<v1::WorkerMessage> m = w.session->Next(v1::WorkerMessage::kReport);
      EXPECT_TRUE(m.has_value()) << w.name << ": no report of step " << n;
      if (m) r.reports[w.name] = m->report();
    }
    v1::CoordinatorMessage verdict;
    if (commit) {
      verdict.mutable_commit()->set_step(n);
      verdict.mutable_commit()->set_clip_factor(1.0);
      verdict.mutable_commit()->set_snapshot(snapshot);
    } else {
      verdict.mutable_discard()->set_step(n);
    }
    for (Worker& w : workers_) w.job->Handle(verdict);
    for (Worker& w : workers_) {
      std::optional<v1::WorkerMessage> m = w.session->Next(v1::WorkerMessage::kStepDone);
      EXPECT_TRUE(m.has_value()) << w.name << ": no StepDone of step " << n;
      if (m) r.done[w.name] = m->step_done();
      if (!commit || !snapshot) continue;
      std::optional<v1::WorkerMessage> snap = w.session->Next(v1::WorkerMessage::kSnapshot);
      EXPECT_TRUE(snap.has_value()) << w.name << ": no snapshot of step " << n;
      if (snap) {
        EXPECT_EQ(snap->snapshot().owner(), w.name);
        EXPECT_EQ(snap->snapshot().step(), n);
        EXPECT_GT(snap->snapshot().capture_seconds(), 0) << "the coordinator spaces snapshots by their cost";
        r.snapshots[w.name] = snap->snapshot().data();
      }
    }
    return r;
  }

  v1::HeldJob Describe(Worker& w) {
    v1::HeldJob held;
    w.job->Describe(&held);
    return held;
  }

  v1::ShardSnapshot Fetch(Worker& w, const std::string& owner, int64_t step) {
    v1::CoordinatorMessage m;
    m.mutable_fetch_state()->set_owner(owner);
    m.mutable_fetch_state()->set_step(step);
    w.job->Handle(m);
    std::optional<v1::WorkerMessage> r = w.session->Next(v1::WorkerMessage::kFetchedState);
    EXPECT_TRUE(r.has_value());
    return r ? r->fetched_state() : v1::ShardSnapshot();
  }

  std::unique_ptr<comm::FakeCoordinatorKvServer> kv_;
  bool report_groups_ = false;  // the plans ConfigureFor makes run in report groups
  int report_group_columns_ = 0;  // of this many columns (0: one)
  v1::JobSpec spec_;
  std::vector<Worker> workers_;
};

std::vector<int64_t> Steps(const v1::HeldJob& held) { return {held.steps().begin(), held.steps().end()}; }

// The value of the series of `name` whose labels include `labels`; -1 when
// there is none. `series` counts the family's series.
double MetricValue(prometheus::Registry& registry, const std::string& name,
                   const std::map<std::string, std::string>& labels, int* series = nullptr) {
  if (series != nullptr) *series = 0;
  double value = -1;
  for (const prometheus::MetricFamily& f : registry.Collect()) {
    if (f.name != name) continue;
    if (series != nullptr) *series = static_cast<int>(f.metric.size());
    for (const prometheus::ClientMetric& m : f.metric) {
      int matched = 0;
      for (const prometheus::ClientMetric::Label& l : m.label) {
        auto it = labels.find(l.name);
        matched += it != labels.end() && it->second == l.value;
      }
      if (matched != static_cast<int>(labels.size())) continue;
      value = f.type == prometheus::MetricType::Counter ? m.counter.value : m.gauge.value;
    }
  }
  return value;
}

// An MoE job's StepDone carries each stage's routing counts per expert (its
// MoE block's, over the step's microbatches) and its load-balancing loss,
// discarded steps too; the worker exports them as
// baton_moe_tokens_total{expert,kind}, baton_moe_dropped_ratio and
// baton_moe_aux_loss with the step metrics' labels. A dense job exports no
// MoE series.
TEST_F(WorkerJobTest, AnMoeJobReportsItsExpertsLoadAndExportsItAsMetrics) {
  spec_ = Spec(2);
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(
      R"pb(experts: 4 top_k: 2 capacity_factor: 0.5 aux_loss_coef: 0.01)pb", spec_.mutable_model()->mutable_moe()));
  for (int i = 0; i < 2; ++i) workers_.push_back(MakeWorker(absl::StrCat("w", i)));
  for (const v1::Configured& c : ConfigureAll(1)) ASSERT_TRUE(c.ok()) << c.error();
  // One MoE block per stage: 2 microbatches of 2 x 20 tokens, two choices each.
  constexpr int64_t kChoices = 2 * 2 * 20 * 2;
  std::map<std::string, std::vector<int64_t>> routed_sum, kept_sum;
  for (int64_t step = 1; step <= 2; ++step) {
    StepResult r = Step(step, /*commit=*/step == 1, /*snapshot=*/false);
    for (Worker& w : workers_) {
      const v1::StepDone& done = r.done[w.name];
      SCOPED_TRACE(absl::StrCat(w.name, " step ", step));
      ASSERT_EQ(done.moe_routed_tokens_size(), 4);
      ASSERT_EQ(done.moe_kept_tokens_size(), 4);
      int64_t routed = 0, kept = 0;
      for (int e = 0; e < 4; ++e) {
        EXPECT_LE(done.moe_kept_tokens(e), done.moe_routed_tokens(e)) << "expert " << e;
        routed += done.moe_routed_tokens(e);
        kept += done.moe_kept_tokens(e);
      }
      EXPECT_EQ(routed, kChoices);
      EXPECT_LT(kept, routed) << "capacity 0.5 drops choices";
      EXPECT_GT(done.moe_aux_loss(), 0);
      EXPECT_LT(done.moe_aux_loss(), 0.05) << "coef 0.01 times at most E";
      routed_sum[w.name].resize(4);
      kept_sum[w.name].resize(4);
      for (int e = 0; e < 4; ++e) {
        routed_sum[w.name][e] += done.moe_routed_tokens(e);
        kept_sum[w.name][e] += done.moe_kept_tokens(e);
      }
      // The gauges hold the last step's.
      const std::map<std::string, std::string> labels = {
          {"training_job", "wj"}, {"stage", w.name == "w0" ? "0" : "1"}, {"worker", w.name}};
      EXPECT_DOUBLE_EQ(MetricValue(*w.metrics, "baton_moe_dropped_ratio", labels),
                       1.0 - static_cast<double>(kept) / static_cast<double>(routed));
      EXPECT_DOUBLE_EQ(MetricValue(*w.metrics, "baton_moe_aux_loss", labels), done.moe_aux_loss());
    }
  }
  for (Worker& w : workers_) {
    // The counters add up the steps, per expert and kind.
    int series = 0;
    for (int e = 0; e < 4; ++e) {
      std::map<std::string, std::string> labels = {
          {"training_job", "wj"}, {"worker", w.name}, {"expert", std::to_string(e)}, {"kind", "routed"}};
      EXPECT_EQ(MetricValue(*w.metrics, "baton_moe_tokens_total", labels, &series), routed_sum[w.name][e])
          << w.name << " expert " << e;
      labels["kind"] = "kept";
      EXPECT_EQ(MetricValue(*w.metrics, "baton_moe_tokens_total", labels), kept_sum[w.name][e])
          << w.name << " expert " << e;
    }
    EXPECT_EQ(series, 8) << w.name << ": 4 experts x routed, kept";
  }
}

TEST_F(WorkerJobTest, ADenseJobReportsNoExpertsAndExportsNoMoeSeries) {
  StartWorkers(1);
  for (const v1::Configured& c : ConfigureAll(1)) ASSERT_TRUE(c.ok()) << c.error();
  StepResult dense = Step(1, true, false);
  const v1::StepDone& done = dense.done["w0"];
  EXPECT_EQ(done.moe_routed_tokens_size(), 0);
  EXPECT_EQ(done.moe_aux_loss(), 0);
  for (const char* name : {"baton_moe_tokens_total", "baton_moe_dropped_ratio", "baton_moe_aux_loss"}) {
    int series = -1;
    MetricValue(*workers_[0].metrics, name, {}, &series);
    EXPECT_EQ(series, 0) << name;
  }
}

TEST_F(WorkerJobTest, ConfiguresRunsAStepCommitsAndSnapshotsItsState) {
  StartWorkers(2);
  for (const v1::Configured& c : ConfigureAll(1)) {
    EXPECT_TRUE(c.ok()) << c.error();
    EXPECT_EQ(c.generation(), 1);
  }
  StepResult s1 = Step(1);
  for (const auto& [name, report] : s1.reports) {
    EXPECT_TRUE(report.error().empty()) << name << ": " << report.error();
    EXPECT_EQ(report.step(), 1);
    EXPECT_EQ(report.generation(), 1);
    EXPECT_TRUE(report.finite());
    EXPECT_GT(report.grad_sq_norm(), 0) << name;
  }
  EXPECT_FALSE(s1.reports["w0"].has_loss()) << "only the last stage sees the loss";
  ASSERT_TRUE(s1.reports["w1"].has_loss());
  EXPECT_GT(s1.reports["w1"].loss(), 0);
  for (Worker& w : workers_) {
    const v1::StepDone& done = s1.done[w.name];
    EXPECT_TRUE(done.committed()) << w.name << ": " << done.error();
    EXPECT_EQ(done.step(), 1);
    EXPECT_EQ(done.generation(), 1);
    EXPECT_EQ(w.session->step(), 1);
    // The snapshot is the chunk's committed state: one AdamW step taken.
    v1::ShardState shard;
    ASSERT_TRUE(shard.ParseFromString(s1.snapshots[w.name]));
    EXPECT_EQ(shard.step(), 1);
    EXPECT_EQ(shard.pp_rank(), w.name == "w0" ? 0 : 1);
    ASSERT_EQ(shard.chunks_size(), 1);
    absl::StatusOr<ChunkState> state = DecodeChunkState(shard.chunks(0).state());
    ASSERT_TRUE(state.ok()) << state.status();
    EXPECT_EQ(state->optimizer_step, 1);
    EXPECT_EQ(state->adam_m.size(), state->values.size());
    EXPECT_FALSE(state->values.empty());
    // What a restarted coordinator would be told.
    const v1::HeldJob held = Describe(w);
    EXPECT_EQ(held.job(), "wj");
    EXPECT_EQ(held.generation(), 1);
    EXPECT_EQ(held.pp_rank(), shard.pp_rank());
    EXPECT_EQ(Steps(held), (std::vector<int64_t>{1}));
  }
  // A discarded step changes nothing and is not snapshotted.
  StepResult s2 = Step(2, /*commit=*/false);
  for (Worker& w : workers_) {
    EXPECT_FALSE(s2.done[w.name].committed()) << w.name;
    EXPECT_EQ(Steps(Describe(w)), (std::vector<int64_t>{1}));
    EXPECT_EQ(w.session->Count(v1::WorkerMessage::kSnapshot), 0);
  }
  // Committing step 2 after all gives a state that moved on from step 1's.
  StepResult again = Step(2);
  EXPECT_NE(again.snapshots["w0"], s1.snapshots["w0"]);
  EXPECT_EQ(Steps(Describe(workers_[0])), (std::vector<int64_t>{1, 2}));
  // A commit that does not ask for a snapshot takes none (the coordinator
  // picks the steps, the same on every worker).
  StepResult s3 = Step(3, /*commit=*/true, /*snapshot=*/false);
  for (Worker& w : workers_) {
    EXPECT_TRUE(s3.done[w.name].committed()) << w.name;
    EXPECT_EQ(w.session->Count(v1::WorkerMessage::kSnapshot), 0) << w.name;
    EXPECT_EQ(Steps(Describe(w)), (std::vector<int64_t>{1, 2})) << w.name;
  }
}

// A job too large for its device: the step fails with RESOURCE_EXHAUSTED in
// the step report (error and code, what the coordinator turns into the job's
// fault), the worker does not crash, and once the device has the memory the
// same job's next step runs and commits.
TEST_F(WorkerJobTest, AStepOutOfDeviceMemoryIsReportedAndTheWorkerStaysUsable) {
  spec_ = Spec(1);
  const kernels::Device device = kernels::Device::Sim(4);
  workers_.push_back(MakeWorker("w0", "sim:4"));
  for (const v1::Configured& c : ConfigureAll(1)) ASSERT_TRUE(c.ok()) << c.error();
  // Room for the step's small buffers, not for a 1 MiB activation arena.
  kernels::sim::SetSimDeviceMemoryLimitForTesting(kernels::GetMemoryStats(device).reserved_bytes +
                                                  (int64_t{64} << 10));
  StepResult failed = Step(1, /*commit=*/false);
  kernels::sim::SetSimDeviceMemoryLimitForTesting(0);
  const v1::StepReport& report = failed.reports["w0"];
  EXPECT_EQ(report.code(), static_cast<int>(absl::StatusCode::kResourceExhausted)) << report.error();
  EXPECT_NE(report.error().find("sim:4 is out of memory"), std::string::npos) << report.error();
  EXPECT_NE(report.error().find("lower train.micro_batch_size"), std::string::npos) << report.error();
  EXPECT_FALSE(failed.done["w0"].committed());

  StepResult ok = Step(1);
  EXPECT_TRUE(ok.reports["w0"].error().empty()) << ok.reports["w0"].error();
  EXPECT_TRUE(ok.reports["w0"].finite());
  EXPECT_TRUE(ok.done["w0"].committed()) << ok.done["w0"].error();
  EXPECT_EQ(Steps(Describe(workers_[0])), (std::vector<int64_t>{1}));
}

// An op that ran out of device memory inside the stream (CUDA: a scratch
// buffer that could not grow) leaves the stream's sticky error, which the
// step meets at its next stream call, outside any arena: the report still
// says RESOURCE_EXHAUSTED with the device's words and what to lower, once.
// The worker stays up, and a new Configure (fresh streams) runs again.
TEST_F(WorkerJobTest, AStreamOutOfMemoryErrorIsReportedWithWhatToLower) {
  spec_ = Spec(1);
  workers_.push_back(MakeWorker("w0", "sim:5"));
  for (const v1::Configured& c : ConfigureAll(1)) ASSERT_TRUE(c.ok()) << c.error();
  kernels::sim::SetSimStreamErrorForTesting(
      5, kernels::OutOfMemoryError("AttentionForward on sim:5: allocating 1073741824 bytes on sim:5: out of device "
                                   "memory"));
  StepResult failed = Step(1, /*commit=*/false);
  const v1::StepReport& report = failed.reports["w0"];
  EXPECT_EQ(report.code(), static_cast<int>(absl::StatusCode::kResourceExhausted)) << report.error();
  EXPECT_NE(report.error().find("AttentionForward on sim:5: allocating 1073741824 bytes"), std::string::npos)
      << report.error();
  const size_t advice = report.error().find("lower train.micro_batch_size");
  EXPECT_NE(advice, std::string::npos) << report.error();
  EXPECT_EQ(report.error().find("lower train.micro_batch_size", advice + 1), std::string::npos) << report.error();

  for (const v1::Configured& c : ConfigureAll(2)) ASSERT_TRUE(c.ok()) << c.error();
  StepResult ok = Step(1);
  EXPECT_TRUE(ok.reports["w0"].error().empty()) << ok.reports["w0"].error();
  EXPECT_TRUE(ok.done["w0"].committed()) << ok.done["w0"].error();
}

TEST_F(WorkerJobTest, AnAbortReleasesAStepBlockedOnALostPeerAndKeepsTheState) {
  StartWorkers(2);
  for (const v1::Configured& c : ConfigureAll(1)) ASSERT_TRUE(c.ok()) << c.error();
  StepResult s1 = Step(1), s2 = Step(2);
  // Only w0 runs step 3: its peer w1 never answers (it "died"), so w0 blocks
  // on the pipeline until the coordinator's Abort releases it.
  Worker& w0 = workers_[0];
  v1::CoordinatorMessage run;
  run.mutable_run_step()->set_step(3);
  w0.job->Handle(run);
  v1::CoordinatorMessage abort;
  abort.mutable_abort()->set_reason("worker w1 was lost; recovering");
  w0.job->Handle(abort);
  std::optional<v1::WorkerMessage> report = w0.session->Next(v1::WorkerMessage::kReport);
  ASSERT_TRUE(report.has_value()) << "the blocked step was not released";
  EXPECT_EQ(report->report().step(), 3);
  EXPECT_FALSE(report->report().error().empty());
  EXPECT_NE(report->report().code(), 0);
  // The process keeps its in-memory state: both snapshots, fetchable as sent.
  EXPECT_EQ(Steps(Describe(w0)), (std::vector<int64_t>{1, 2}));
  const v1::ShardSnapshot fetched = Fetch(w0, "w0", 2);
  EXPECT_TRUE(fetched.error().empty()) << fetched.error();
  EXPECT_EQ(fetched.data(), s2.snapshots["w0"]);
  EXPECT_EQ(fetched.generation(), 1);
  // But the live job is gone.
  run.mutable_run_step()->set_step(4);
  w0.job->Handle(run);
  report = w0.session->Next(v1::WorkerMessage::kReport);
  ASSERT_TRUE(report.has_value());
  EXPECT_NE(report->report().error().find("no job is configured"), std::string::npos) << report->report().error();
  EXPECT_EQ(report->report().code(), static_cast<int>(absl::StatusCode::kFailedPrecondition));
  // As a buddy it holds another worker's copies (the last kHeldSnapshots) and gives them back.
  for (int64_t step : {1, 2, 3}) {
    v1::CoordinatorMessage hold;
    hold.mutable_hold_snapshot()->set_owner("w1");
    hold.mutable_hold_snapshot()->set_step(step);
    hold.mutable_hold_snapshot()->set_data(absl::StrCat("state of w1 at ", step));
    w0.job->Handle(hold);
  }
  EXPECT_EQ(Fetch(w0, "w1", 3).data(), "state of w1 at 3");
  EXPECT_EQ(Fetch(w0, "w1", 2).data(), "state of w1 at 2");
  const v1::ShardSnapshot dropped = Fetch(w0, "w1", 1);
  EXPECT_TRUE(dropped.data().empty());
  EXPECT_EQ(dropped.error(), "w0 holds no state of w1 at step 1");
  EXPECT_EQ(dropped.code(), static_cast<int>(absl::StatusCode::kNotFound));
  // A copy over gRPC's 4 MiB message limit is held and given back whole too
  // (the session carries it as fragments; there is no 4 MiB cap).
  const std::string big((size_t{4} << 20) + 1, 'b');
  v1::CoordinatorMessage hold;
  hold.mutable_hold_snapshot()->set_owner("w1");
  hold.mutable_hold_snapshot()->set_step(4);
  hold.mutable_hold_snapshot()->set_data(big);
  w0.job->Handle(hold);
  EXPECT_TRUE(Fetch(w0, "w1", 4).data() == big);
}

TEST_F(WorkerJobTest, RollsBackToStepRAndReplaysBitForBit) {
  StartWorkers(2);
  for (const v1::Configured& c : ConfigureAll(1)) ASSERT_TRUE(c.ok()) << c.error();
  std::vector<StepResult> first;
  for (int64_t n = 1; n <= 3; ++n) first.push_back(Step(n));
  // A new generation resuming at R = 1: w0 (a survivor) from its own memory,
  // w1 as a replacement from the state sent (its step-1 snapshot).
  for (const v1::Configured& c : ConfigureAll(2, 1, {{"w1", first[0].snapshots["w1"]}})) {
    EXPECT_TRUE(c.ok()) << c.error();
    EXPECT_EQ(c.generation(), 2);
  }
  EXPECT_EQ(Steps(Describe(workers_[0])), (std::vector<int64_t>{1})) << "snapshots after R belong to the old timeline";
  EXPECT_EQ(Describe(workers_[0]).generation(), 2);
  EXPECT_EQ(workers_[0].session->step(), 1);
  for (int64_t n = 2; n <= 3; ++n) {
    StepResult replay = Step(n);
    for (Worker& w : workers_) {
      EXPECT_EQ(replay.snapshots[w.name], first[n - 1].snapshots[w.name]) << w.name << " step " << n;
      EXPECT_EQ(replay.reports[w.name].grad_sq_norm(), first[n - 1].reports[w.name].grad_sq_norm());
      EXPECT_EQ(replay.reports[w.name].generation(), 2);
    }
    EXPECT_EQ(replay.reports["w1"].loss(), first[n - 1].reports["w1"].loss()) << "step " << n;
  }
}

// The verdict on step n inside RunStep(n+1) (RunStep.commit, what the
// coordinator sends workers that register verdict_in_run_step) is applied
// first, answered as a Commit message is (StepDone, then the snapshot it
// asks for), and only then does step n+1 run: the same bits as the two
// messages apart.
TEST_F(WorkerJobTest, AVerdictInsideRunStepIsAnsweredBeforeTheStepRuns) {
  StartWorkers(2);
  for (const v1::Configured& c : ConfigureAll(1)) ASSERT_TRUE(c.ok()) << c.error();
  std::vector<StepResult> apart;
  for (int64_t n = 1; n <= 3; ++n) apart.push_back(Step(n));
  // The same steps again from the seed, each verdict inside the next RunStep.
  for (const v1::Configured& c : ConfigureAll(2)) ASSERT_TRUE(c.ok()) << c.error();
  v1::CoordinatorMessage run;
  run.mutable_run_step()->set_step(1);
  for (Worker& w : workers_) w.job->Handle(run);
  for (int64_t n = 2; n <= 3; ++n) {
    run.mutable_run_step()->set_step(n);
    v1::Commit* commit = run.mutable_run_step()->mutable_commit();
    commit->set_step(n - 1);
    commit->set_clip_factor(1.0);
    commit->set_snapshot(true);
    for (Worker& w : workers_) w.job->Handle(run);
    for (Worker& w : workers_) {
      using M = v1::WorkerMessage;
      // Step n-1's report first; then, in order, what RunStep(n) brought.
      std::optional<M> report = w.session->Next(M::kReport);
      ASSERT_TRUE(report.has_value());
      EXPECT_EQ(report->report().step(), n - 1);
      EXPECT_EQ(report->report().grad_sq_norm(), apart[n - 2].reports[w.name].grad_sq_norm()) << w.name;
      EXPECT_EQ(w.session->KindsOnceThere(M::kReport),
                (std::vector<M::BodyCase>{M::kStepDone, M::kSnapshot, M::kReport}))
          << w.name << " step " << n;
      std::optional<M> done = w.session->Next(M::kStepDone);
      ASSERT_TRUE(done.has_value());
      EXPECT_EQ(done->step_done().step(), n - 1);
      EXPECT_TRUE(done->step_done().committed()) << done->step_done().error();
      std::optional<M> snap = w.session->Next(M::kSnapshot);
      ASSERT_TRUE(snap.has_value());
      EXPECT_EQ(snap->snapshot().step(), n - 1);
      EXPECT_EQ(snap->snapshot().data(), apart[n - 2].snapshots[w.name]) << w.name << " step " << n - 1;
    }
  }
  for (Worker& w : workers_) {
    std::optional<v1::WorkerMessage> report = w.session->Next(v1::WorkerMessage::kReport);
    ASSERT_TRUE(report.has_value());
    EXPECT_EQ(report->report().step(), 3);
    EXPECT_EQ(report->report().grad_sq_norm(), apart[2].reports[w.name].grad_sq_norm()) << w.name;
  }
}

TEST_F(WorkerJobTest, AStepDoneRidesInTheNextReportUnlessItsStepIsSnapshotted) {
  StartWorkers(2);
  for (const v1::Configured& c : ConfigureAll(1)) ASSERT_TRUE(c.ok()) << c.error();
  // Every verdict apart; step 2 snapshotted.
  std::vector<StepResult> apart;
  for (int64_t n = 1; n <= 4; ++n) apart.push_back(Step(n, /*commit=*/true, /*snapshot=*/n == 2));
  // The same steps from the seed, each verdict inside the next RunStep, whose
  // StepDone the coordinator takes inside the report.
  for (const v1::Configured& c : ConfigureAll(2)) ASSERT_TRUE(c.ok()) << c.error();
  v1::CoordinatorMessage run;
  run.mutable_run_step()->set_step(1);
  for (Worker& w : workers_) w.job->Handle(run);
  using M = v1::WorkerMessage;
  for (Worker& w : workers_) ASSERT_TRUE(w.session->Next(M::kReport).has_value()) << w.name;
  for (int64_t n = 2; n <= 4; ++n) {
    const bool snapshot = n - 1 == 2;
    run.mutable_run_step()->set_step(n);
    run.mutable_run_step()->set_step_done_in_report(true);
    v1::Commit* commit = run.mutable_run_step()->mutable_commit();
    commit->set_step(n - 1);
    commit->set_clip_factor(1.0);
    commit->set_snapshot(snapshot);
    for (Worker& w : workers_) w.job->Handle(run);
    for (Worker& w : workers_) {
      const std::string at = absl::StrCat(w.name, " step ", n);
      if (snapshot) {  // the snapshot step's StepDone at once, then the snapshot, then the report
        EXPECT_EQ(w.session->KindsOnceThere(M::kReport),
                  (std::vector<M::BodyCase>{M::kStepDone, M::kSnapshot, M::kReport}))
            << at;
        std::optional<M> done = w.session->Next(M::kStepDone);
        ASSERT_TRUE(done.has_value()) << at;
        EXPECT_EQ(done->step_done().step(), n - 1);
        EXPECT_TRUE(done->step_done().committed()) << done->step_done().error();
        std::optional<M> snap = w.session->Next(M::kSnapshot);
        ASSERT_TRUE(snap.has_value()) << at;
        EXPECT_EQ(snap->snapshot().data(), apart[n - 2].snapshots[w.name]) << at;
      } else {  // one message: the report, with the StepDone inside
        EXPECT_EQ(w.session->KindsOnceThere(M::kReport), (std::vector<M::BodyCase>{M::kReport})) << at;
      }
      std::optional<M> report = w.session->Next(M::kReport);
      ASSERT_TRUE(report.has_value()) << at;
      EXPECT_EQ(report->report().step(), n);
      EXPECT_EQ(report->report().grad_sq_norm(), apart[n - 1].reports[w.name].grad_sq_norm()) << at;
      EXPECT_EQ(report->report().loss(), apart[n - 1].reports[w.name].loss()) << at;
      EXPECT_EQ(report->report().has_step_done(), !snapshot) << at;
      if (!snapshot) {
        const v1::StepDone& done = report->report().step_done();
        EXPECT_EQ(done.step(), n - 1) << at;
        EXPECT_TRUE(done.committed()) << at << ": " << done.error();
        EXPECT_EQ(done.generation(), 2) << at;
        EXPECT_TRUE(done.error().empty()) << done.error();
      }
    }
  }
}

// A snapshot crosses to the coordinator on a thread of its own: the next
// step runs while it is still being sent (a big state on a slow link), and
// that step's report waits for it, so the session carries the snapshot
// before the report as before.
TEST_F(WorkerJobTest, TheNextStepRunsWhileTheSnapshotIsStillBeingSent) {
  StartWorkers(2);
  for (const v1::Configured& c : ConfigureAll(1)) ASSERT_TRUE(c.ok()) << c.error();
  using M = v1::WorkerMessage;
  v1::CoordinatorMessage run;
  run.mutable_run_step()->set_step(1);
  for (Worker& w : workers_) w.job->Handle(run);
  for (Worker& w : workers_) ASSERT_TRUE(w.session->Next(M::kReport).has_value()) << w.name;
  for (Worker& w : workers_) w.session->HoldSnapshots(true);
  run.mutable_run_step()->set_step(2);
  v1::Commit* commit = run.mutable_run_step()->mutable_commit();
  commit->set_step(1);
  commit->set_clip_factor(1.0);
  commit->set_snapshot(true);
  for (Worker& w : workers_) w.job->Handle(run);
  for (Worker& w : workers_) {
    EXPECT_TRUE(w.session->AwaitStep(2)) << w.name << " did not run step 2 while its snapshot was being sent";
    EXPECT_EQ(w.session->Count(M::kReport), 0) << w.name << ": the report went ahead of the snapshot";
  }
  for (Worker& w : workers_) w.session->HoldSnapshots(false);
  for (Worker& w : workers_) {
    EXPECT_EQ(w.session->KindsOnceThere(M::kReport), (std::vector<M::BodyCase>{M::kStepDone, M::kSnapshot, M::kReport}))
        << w.name;
    std::optional<M> snap = w.session->Next(M::kSnapshot);
    ASSERT_TRUE(snap.has_value()) << w.name;
    EXPECT_EQ(snap->snapshot().step(), 1);
    std::optional<M> report = w.session->Next(M::kReport);
    ASSERT_TRUE(report.has_value()) << w.name;
    EXPECT_EQ(report->report().step(), 2);
    EXPECT_TRUE(report->report().error().empty()) << report->report().error();
  }
}

// Report groups (docs/protocol.md): RunStep to the group's leader only
// (a group of one column here), which passes it on (over the group's
// communicator, real Gloo on loopback); the members'
// reports come inside the leader's, each with its held StepDone, and are
// the reports they send when each reports alone, bit for bit.
TEST_F(WorkerJobTest, InReportGroupsTheLeaderCarriesItsMembersReportsUnchanged) {
  StartWorkers(3);
  spec_.mutable_model()->set_layers(3);
  for (const v1::Configured& c : ConfigureAll(1)) ASSERT_TRUE(c.ok()) << c.error();
  std::vector<StepResult> alone;
  for (int64_t n = 1; n <= 3; ++n) alone.push_back(Step(n, /*commit=*/true, /*snapshot=*/false));
  // The same steps from the seed in report groups: w0 leads.
  report_groups_ = true;
  for (const v1::Configured& c : ConfigureAll(2)) ASSERT_TRUE(c.ok()) << c.error();
  using M = v1::WorkerMessage;
  auto same = [](v1::StepReport got, v1::StepReport want) {  // but the generation, held StepDone and members
    got.clear_generation();
    got.clear_step_done();
    got.clear_members();
    want.clear_generation();
    want.clear_step_done();
    return got.SerializeAsString() == want.SerializeAsString();
  };
  v1::CoordinatorMessage run;
  for (int64_t n = 1; n <= 3; ++n) {
    run.mutable_run_step()->set_step(n);
    if (n > 1) {
      run.mutable_run_step()->set_step_done_in_report(true);
      v1::Commit* commit = run.mutable_run_step()->mutable_commit();
      commit->set_step(n - 1);
      commit->set_clip_factor(1.0);
    }
    workers_[0].job->Handle(run);
    std::optional<M> report = workers_[0].session->Next(M::kReport);
    ASSERT_TRUE(report.has_value()) << "step " << n;
    const v1::StepReport& r = report->report();
    ASSERT_TRUE(r.error().empty()) << r.error();
    EXPECT_EQ(r.generation(), 2);
    EXPECT_TRUE(same(r, alone[n - 1].reports["w0"])) << "step " << n << ": " << r.ShortDebugString();
    ASSERT_EQ(r.members_size(), 2) << "step " << n;
    for (int k = 1; k <= 2; ++k) {
      const v1::StepReport& member = r.members(k - 1);
      const std::string name = absl::StrCat("w", k);
      EXPECT_TRUE(same(member, alone[n - 1].reports[name]))
          << name << " step " << n << ": " << member.ShortDebugString() << " vs "
          << alone[n - 1].reports[name].ShortDebugString();
      EXPECT_EQ(member.generation(), 2);
      EXPECT_EQ(member.has_step_done(), n > 1) << name;
      if (n > 1) {
        EXPECT_EQ(member.step_done().step(), n - 1) << name;
        EXPECT_TRUE(member.step_done().committed()) << name << ": " << member.step_done().error();
      }
    }
    EXPECT_EQ(r.has_step_done(), n > 1);
  }
  // The members sent nothing to the coordinator themselves.
  for (int k = 1; k <= 2; ++k) {
    EXPECT_EQ(workers_[k].session->Count(M::kReport), 0) << workers_[k].name;
    EXPECT_EQ(workers_[k].session->Count(M::kStepDone), 0) << workers_[k].name;
  }
  // A verdict apart (the last step's) reaches every worker on its session.
  v1::CoordinatorMessage last;
  last.mutable_commit()->set_step(3);
  last.mutable_commit()->set_clip_factor(1.0);
  for (Worker& w : workers_) w.job->Handle(last);
  for (Worker& w : workers_) {
    std::optional<M> done = w.session->Next(M::kStepDone);
    ASSERT_TRUE(done.has_value()) << w.name;
    EXPECT_EQ(done->step_done().step(), 3);
    EXPECT_TRUE(done->step_done().committed()) << w.name << ": " << done->step_done().error();
  }
}

// A group of two columns (Plan.report_group_columns = 2): pp 2 x dp 2 in
// one group of 4, led by pp rank 0 of dp 0, which carries the reports of
// its own column's member and of the other replica's two ranks, in seat
// order, bit for bit the reports each sends alone.
TEST_F(WorkerJobTest, AGroupOfTwoColumnsCarriesBothReplicasReports) {
  StartWorkers(4);
  spec_.mutable_parallel()->set_pp(2);
  spec_.mutable_parallel()->set_dp(2);
  for (const v1::Configured& c : ConfigureAll(1)) ASSERT_TRUE(c.ok()) << c.error();
  std::vector<StepResult> alone;
  for (int64_t n = 1; n <= 2; ++n) alone.push_back(Step(n, /*commit=*/true, /*snapshot=*/false));
  report_groups_ = true;
  report_group_columns_ = 2;
  for (const v1::Configured& c : ConfigureAll(2)) ASSERT_TRUE(c.ok()) << c.error();
  const v1::Plan plan = ConfigureFor(workers_[0], 2).configure().plan();
  std::map<int, std::string> by_seat;
  std::map<std::string, Worker*> by_name;
  for (Worker& w : workers_) by_name[w.name] = &w;
  for (const v1::RankAssignment& r : plan.ranks()) {
    const ReportGroupSeat seat = ReportGroupSeatOf(2, 1, 2, 2, r.pp_rank(), r.tp_rank(), r.dp_rank());
    ASSERT_EQ(seat.group, 0);
    ASSERT_EQ(seat.size, 4);
    by_seat[seat.rank] = r.worker_name();
  }
  ASSERT_EQ(by_seat.size(), 4u);
  Worker& leader = *by_name[by_seat[0]];
  using M = v1::WorkerMessage;
  auto same = [](v1::StepReport got, v1::StepReport want) {  // but the generation and members
    got.clear_generation();
    got.clear_members();
    want.clear_generation();
    return got.SerializeAsString() == want.SerializeAsString();
  };
  for (int64_t n = 1; n <= 2; ++n) {
    v1::CoordinatorMessage run;
    run.mutable_run_step()->set_step(n);
    leader.job->Handle(run);
    std::optional<M> report = leader.session->Next(M::kReport);
    ASSERT_TRUE(report.has_value()) << "step " << n;
    const v1::StepReport& r = report->report();
    ASSERT_TRUE(r.error().empty()) << r.error();
    EXPECT_TRUE(same(r, alone[n - 1].reports[leader.name])) << "step " << n;
    ASSERT_EQ(r.members_size(), 3) << "step " << n;
    for (int seat = 1; seat <= 3; ++seat) {
      const std::string& name = by_seat[seat];
      EXPECT_TRUE(same(r.members(seat - 1), alone[n - 1].reports[name]))
          << name << " (seat " << seat << ") step " << n << ": " << r.members(seat - 1).ShortDebugString();
      EXPECT_EQ(by_name[name]->session->Count(M::kReport), 0) << name << " reported to the coordinator itself";
    }
    v1::CoordinatorMessage commit;
    commit.mutable_commit()->set_step(n);
    commit.mutable_commit()->set_clip_factor(1.0);
    for (Worker& w : workers_) w.job->Handle(commit);
    for (Worker& w : workers_) {
      std::optional<M> done = w.session->Next(M::kStepDone);
      ASSERT_TRUE(done.has_value()) << w.name;
      EXPECT_TRUE(done->step_done().committed()) << w.name << ": " << done->step_done().error();
    }
  }
}

// A member whose job is aborted (its group with it) fails its leader's
// next step at once, with an error that names the member's mesh rank; the
// leader stays usable.
TEST_F(WorkerJobTest, ALeaderThatCannotReachAMemberReportsWhichOne) {
  report_groups_ = true;
  StartWorkers(3);
  spec_.mutable_model()->set_layers(3);
  for (const v1::Configured& c : ConfigureAll(1)) ASSERT_TRUE(c.ok()) << c.error();
  workers_[2].job.reset();  // its process ends: its sockets close
  v1::CoordinatorMessage run;
  run.mutable_run_step()->set_step(1);
  workers_[0].job->Handle(run);
  std::optional<v1::WorkerMessage> report = workers_[0].session->Next(v1::WorkerMessage::kReport);
  ASSERT_TRUE(report.has_value());
  EXPECT_NE(report->report().error().find("rank (pp 2, tp 0, dp 0) of its report group"), std::string::npos)
      << report->report().ShortDebugString();
  EXPECT_NE(report->report().code(), 0);
  EXPECT_EQ(report->report().members_size(), 0);
  // Usable: a new generation without the lost member configures.
  workers_.pop_back();
  report_groups_ = false;
  spec_ = Spec(2);
  for (const v1::Configured& c : ConfigureAll(2)) EXPECT_TRUE(c.ok()) << c.error();
}

TEST_F(WorkerJobTest, AStaleGenerationIsRefused) {
  StartWorkers(2);
  for (const v1::Configured& c : ConfigureAll(2)) ASSERT_TRUE(c.ok()) << c.error();
  // A Configure of an older world (delayed, from a superseded coordinator decision).
  for (const v1::Configured& c : ConfigureAll(1)) {
    EXPECT_FALSE(c.ok());
    EXPECT_EQ(c.generation(), 1);
    EXPECT_EQ(c.code(), static_cast<int>(absl::StatusCode::kFailedPrecondition)) << c.error();
    EXPECT_NE(c.error().find("generation 1 of job 'wj' is older than the current generation 2"), std::string::npos)
        << c.error();
  }
  // The refused configure left no live job behind.
  v1::CoordinatorMessage run;
  run.mutable_run_step()->set_step(1);
  workers_[0].job->Handle(run);
  std::optional<v1::WorkerMessage> report = workers_[0].session->Next(v1::WorkerMessage::kReport);
  ASSERT_TRUE(report.has_value());
  EXPECT_NE(report->report().error().find("no job is configured"), std::string::npos);
}

TEST_F(WorkerJobTest, APeriodicCheckpointAnswersCopiedThenItsFiles) {
  StartWorkers(1);
  for (const v1::Configured& c : ConfigureAll(1)) ASSERT_TRUE(c.ok()) << c.error();
  Step(1);
  const std::string dir = absl::StrCat(::testing::TempDir(), "/worker_job_checkpoint/step-00000001");
  v1::CoordinatorMessage save;
  save.mutable_save_weights()->set_dir(dir);
  save.mutable_save_weights()->set_step(1);
  save.mutable_save_weights()->set_with_state(true);
  Worker& w = workers_[0];
  w.job->Handle(save);
  std::optional<v1::WorkerMessage> copied = w.session->Next(v1::WorkerMessage::kSaved);
  ASSERT_TRUE(copied.has_value());
  EXPECT_TRUE(copied->saved().ok()) << copied->saved().error();
  EXPECT_TRUE(copied->saved().copied());
  EXPECT_EQ(copied->saved().step(), 1);
  EXPECT_EQ(copied->saved().files_size(), 0);
  std::optional<v1::WorkerMessage> files = w.session->Next(v1::WorkerMessage::kSaved);
  ASSERT_TRUE(files.has_value());
  EXPECT_TRUE(files->saved().ok()) << files->saved().error();
  EXPECT_FALSE(files->saved().copied());
  EXPECT_EQ(std::vector<std::string>(files->saved().files().begin(), files->saved().files().end()),
            std::vector<std::string>{"chunk0-tp0.safetensors"});
  // A save the disk refuses is an error naming it, in the files answer.
  save.mutable_save_weights()->set_dir("/proc/no_such_dir/step-00000001");
  w.job->Handle(save);
  std::optional<v1::WorkerMessage> first = w.session->Next(v1::WorkerMessage::kSaved);
  ASSERT_TRUE(first.has_value());
  std::optional<v1::WorkerMessage> failed = first->saved().copied() ? w.session->Next(v1::WorkerMessage::kSaved)
                                                                    : first;
  ASSERT_TRUE(failed.has_value());
  EXPECT_FALSE(failed->saved().ok());
  EXPECT_NE(failed->saved().error().find("/proc/no_such_dir"), std::string::npos) << failed->saved().error();
}

TEST_F(WorkerJobTest, BadMessagesGetAClearErrorAndTheWorkerStaysUsable) {
  StartWorkers(1);
  Worker& w = workers_[0];
  auto configured = [&](const v1::CoordinatorMessage& m) {
    w.job->Handle(m);
    std::optional<v1::WorkerMessage> r = w.session->Next(v1::WorkerMessage::kConfigured);
    EXPECT_TRUE(r.has_value());
    return r ? r->configured() : v1::Configured();
  };
  // A step before any Configure.
  v1::CoordinatorMessage run;
  run.mutable_run_step()->set_step(1);
  w.job->Handle(run);
  std::optional<v1::WorkerMessage> report = w.session->Next(v1::WorkerMessage::kReport);
  ASSERT_TRUE(report.has_value());
  EXPECT_NE(report->report().error().find("no job is configured on this worker"), std::string::npos);

  // A plan without this worker.
  v1::CoordinatorMessage other = ConfigureFor(w, 1);
  other.mutable_configure()->mutable_plan()->mutable_ranks(0)->set_worker_name("w9");
  v1::Configured c = configured(other);
  EXPECT_FALSE(c.ok());
  EXPECT_EQ(c.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(c.error(), "the plan has no rank for worker 'w0'");

  // Resuming a step it holds no snapshot of.
  c = configured(ConfigureFor(w, 2, 5));
  EXPECT_FALSE(c.ok());
  EXPECT_EQ(c.code(), static_cast<int>(absl::StatusCode::kDataLoss));
  EXPECT_NE(c.error().find("this worker holds no snapshot of step 5"), std::string::npos) << c.error();

  // A state that is not a ShardState, one of another shard, one corrupted.
  c = configured(ConfigureFor(w, 3, 1, "garbage"));
  EXPECT_FALSE(c.ok());
  EXPECT_NE(c.error().find("not a ShardState"), std::string::npos) << c.error();

  ASSERT_TRUE(configured(ConfigureFor(w, 4)).ok());
  const std::string good = Step(1).snapshots["w0"];
  v1::ShardState shard;
  ASSERT_TRUE(shard.ParseFromString(good));
  v1::ShardState foreign = shard;
  foreign.set_pp_rank(1);
  c = configured(ConfigureFor(w, 5, 1, foreign.SerializeAsString()));
  EXPECT_FALSE(c.ok());
  EXPECT_NE(c.error().find("the state sent is of step 1, stage 1, tp 0/1 with 1 chunk(s); this worker needs step 1, "
                           "stage 0, tp 0/1"),
            std::string::npos)
      << c.error();
  v1::ShardState corrupted = shard;
  std::string* blob = corrupted.mutable_chunks(0)->mutable_state();
  (*blob)[blob->size() / 2] ^= 0x40;
  c = configured(ConfigureFor(w, 6, 1, corrupted.SerializeAsString()));
  EXPECT_FALSE(c.ok());
  EXPECT_NE(c.error().find("chunk 0 of step 1"), std::string::npos) << c.error();

  // Fetching what it does not hold.
  const v1::ShardSnapshot none = Fetch(w, "w7", 1);
  EXPECT_EQ(none.error(), "w0 holds no state of w7 at step 1");

  // A data plane this worker cannot run: NCCL on a CPU device, an unknown one.
  v1::CoordinatorMessage nccl = ConfigureFor(w, 7, 1, good);
  nccl.mutable_configure()->mutable_plan()->set_comm_backend("nccl");
  c = configured(nccl);
  EXPECT_FALSE(c.ok());
  EXPECT_EQ(c.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(c.error().find("the plan's data plane is NCCL, but this worker's device is cpu"), std::string::npos)
      << c.error();
  v1::CoordinatorMessage mpi = ConfigureFor(w, 8, 1, good);
  mpi.mutable_configure()->mutable_plan()->set_comm_backend("mpi");
  c = configured(mpi);
  EXPECT_FALSE(c.ok());
  EXPECT_NE(c.error().find("the plan's data plane 'mpi' is unknown to this worker (gloo or nccl)"),
            std::string::npos)
      << c.error();

  // After all that, the good state still restores and training goes on.
  c = configured(ConfigureFor(w, 9, 1, good));
  EXPECT_TRUE(c.ok()) << c.error();
  StepResult s2 = Step(2);
  EXPECT_TRUE(s2.done["w0"].committed()) << s2.done["w0"].error();
}

}  // namespace
}  // namespace baton
