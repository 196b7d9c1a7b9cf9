#include "worker/worker_job.h"

#include <algorithm>
#include <iterator>
#include <map>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/path_confinement.h"
#include "common/report_group.h"
#include "common/status_macros.h"
#include "kernels/backend.h"
#include "kernels/device.h"
#include "worker/agent.h"
#include "worker/checkpoint/checkpoint.h"
#include "worker/checkpoint/train_state.h"
#include "worker/checkpoint/async_writer.h"
#include "worker/comm/communicator_factory.h"
#include "worker/comm/coordinator_store.h"
#include "worker/comm/frame.h"
#include "worker/data/data_source.h"
#include "worker/data/make_data_source.h"
#include "worker/gpt_stage_model.h"
#include "worker/model/gpt_stage.h"
#include "worker/synthetic_stage.h"

namespace baton {

struct WorkerJob::Job {
  v1::Plan plan;
  v1::JobSpec spec;
  v1::RankAssignment rank;
  std::unique_ptr<comm::Store> store;
  // dp: the dp x cp ranks holding the same parameters (comm/job_groups.h);
  // cp: this replica's context-parallel ring (cp > 1).
  // ep: the expert group exchanging tokens (parallel.ep > 1); edp: the dp
  // ranks holding the same experts (ep > 1 and dp / ep > 1).
  std::unique_ptr<comm::Communicator> tp, pipeline, dp, tie, cp, ep, edp;
  std::unique_ptr<comm::TimedCommunicator> timed_tp, timed_cp, timed_ep;
  std::map<int, std::unique_ptr<StageModel>> chunks;
  std::unique_ptr<data::DataSource> data;
  std::unique_ptr<StepExecutor> executor;
  // train.eval_every_steps: the held-out data and a forward-only executor
  // over the same chunks and pipeline (WorkerJob::Evaluate).
  std::unique_ptr<data::DataSource> eval_data;
  std::unique_ptr<StepExecutor> evaluator;
  v1::StepReport last_report;
  prometheus::Labels labels;
  kernels::Device device;
  uint64_t id = 0;  // WorkerJob::next_job_id_ when built
  // Report groups (Plan.report_groups, docs/protocol.md): this rank's seat
  // (common/report_group.h), its group's communicator over Gloo (host
  // bytes, rank = seat), and on a member the thread that takes each step
  // from the leader (WorkerJob::TakeSteps).
  ReportGroupSeat seat;
  std::unique_ptr<comm::Communicator> group;
  std::thread group_reader;

  bool leads() const { return group != nullptr && seat.rank == 0; }
  bool reports_to_leader() const { return group != nullptr && seat.rank > 0; }
  // "rank (pp 1, tp 0, dp 2) of its report group", for messages.
  std::string Member(int at) const {
    const MeshRank r = ReportGroupMember(plan.pp(), plan.tp(), plan.report_group_columns(), seat.group, at);
    return absl::StrCat("rank (pp ", r.pp_rank, ", tp ", r.tp_rank, ", dp ", r.dp_rank, ") of its report group");
  }

  ~Job() {
    if (group != nullptr) group->Abort("the job was dropped");
    if (group_reader.joinable()) group_reader.join();
  }
};

namespace {

// Report groups: frame tags on the group's communicator (each frame uses two).
constexpr uint64_t kRunStepTag = 1;
constexpr uint64_t kReportTag = 3;
// Bounds of what a group carries: a RunStep (a verdict inside), and a
// member's report (its held StepDone's trace events included), under the
// session's 4 MiB messages.
constexpr size_t kMaxRunStepBytes = 64 << 10;
constexpr size_t kMaxMemberReportBytes = 4 << 20;
// A leader's report stays under the session's 4 MiB messages (it is never
// fragmented); past this its members' trace events are left out (their
// timings stay).
constexpr size_t kMaxGroupReportBytes = (4 << 20) - (64 << 10);
// The group has no watchdog of its own: the leader bounds its pass-on and
// gather by --op_timeout_s, and a member waits for its next step until the
// job is aborted (a checkpoint or a recovery elsewhere may come between).
constexpr absl::Duration kGroupWatchdog = absl::Hours(24 * 365);

// The daemon's session: the WorkerAgent.
class AgentSession : public JobSession {
 public:
  explicit AgentSession(WorkerAgent* agent) : agent_(agent) {}
  bool Send(v1::WorkerMessage message) override { return agent_->Send(std::move(message)); }
  void SetStep(int64_t step) override { agent_->SetStep(step); }
  int64_t CoordinatorNowMicros() const override { return agent_->CoordinatorNowMicros(); }

 private:
  WorkerAgent* const agent_;
};

}  // namespace

WorkerJob::WorkerJob(Options options, std::shared_ptr<v1::Coordinator::StubInterface> stub, WorkerAgent* agent,
                     prometheus::Registry& metrics)
    : WorkerJob(std::move(options), std::move(stub), std::make_unique<AgentSession>(agent), metrics) {}

WorkerJob::WorkerJob(Options options, std::shared_ptr<v1::Coordinator::StubInterface> stub,
                     std::unique_ptr<JobSession> session, prometheus::Registry& metrics)
    : options_(std::move(options)), stub_(std::move(stub)), session_(std::move(session)) {
  wall_family_ = &prometheus::BuildCounter()
                      .Name("baton_step_wall_seconds_total")
                      .Help("Wall time of training steps: step start to optimizer done")
                      .Register(metrics);
  compute_family_ = &prometheus::BuildCounter()
                         .Name("baton_compute_seconds_total")
                         .Help("Time in compute ops (forward, backward, optimizer)")
                         .Register(metrics);
  comm_family_ = &prometheus::BuildCounter()
                      .Name("baton_comm_seconds_total")
                      .Help("Time data was moving or a collective ran, by kind (p2p, tp, dp)")
                      .Register(metrics);
  comm_bytes_family_ = &prometheus::BuildCounter()
                            .Name("baton_comm_bytes_total")
                            .Help("Payload bytes this worker's collectives sent, by group (tp, dp)")
                            .Register(metrics);
  bubble_family_ = &prometheus::BuildCounter()
                        .Name("baton_bubble_seconds_total")
                        .Help("Time idle waiting for a peer: wall - compute - comm")
                        .Register(metrics);
  tokens_family_ = &prometheus::BuildCounter()
                        .Name("baton_tokens_total")
                        .Help("Tokens this worker's pipeline replica trained on")
                        .Register(metrics);
  loss_family_ = &prometheus::BuildGauge().Name("baton_loss").Help("Loss of the last step (last stage)").Register(metrics);
  step_family_ = &prometheus::BuildGauge().Name("baton_step").Help("Last step this worker finished").Register(metrics);
  snapshot_bytes_family_ = &prometheus::BuildCounter()
                                .Name("baton_snapshot_bytes_total")
                                .Help("Bytes of in-memory state snapshots captured for the buddy")
                                .Register(metrics);
  checkpoint_bytes_family_ = &prometheus::BuildCounter()
                                  .Name("baton_checkpoint_bytes_total")
                                  .Help("Bytes of checkpoint shard files written")
                                  .Register(metrics);
  checkpoint_stall_family_ = &prometheus::BuildCounter()
                                  .Name("baton_checkpoint_stall_seconds_total")
                                  .Help("Time training waited for checkpoint state to be copied to host memory")
                                  .Register(metrics);
  writer_ = std::make_unique<checkpoint::AsyncWriter>();
  snapshot_stall_family_ = &prometheus::BuildCounter()
                                .Name("baton_snapshot_stall_seconds_total")
                                .Help("Time the step loop spent capturing and encoding snapshots")
                                .Register(metrics);
  device_memory_family_ = &prometheus::BuildGauge()
                               .Name("baton_device_memory_bytes")
                               .Help("Memory of this worker's model state, by kind: weights, grads and "
                                     "optimizer (AdamW moments; sharded by parallel.zero_stage), on any device; "
                                     "and of its accelerator: in_use (tensors and the used part of arenas) and "
                                     "reserved (held from the device's allocator), absent on cpu workers")
                               .Register(metrics);
  // Mixture of Experts: series only for MoE jobs (RecordMetrics adds them
  // when a StepDone carries expert counts; a dense job exports none).
  moe_tokens_family_ = &prometheus::BuildCounter()
                            .Name("baton_moe_tokens_total")
                            .Help("MoE: top-k choices of the tokens per expert index, summed over this worker's "
                                  "MoE blocks; kind routed (before capacity drops) or kept (after)")
                            .Register(metrics);
  moe_dropped_family_ = &prometheus::BuildGauge()
                             .Name("baton_moe_dropped_ratio")
                             .Help("MoE: share of the last step's top-k choices dropped at capacity, 1 - kept / "
                                   "routed over this worker's MoE blocks")
                             .Register(metrics);
  moe_aux_loss_family_ = &prometheus::BuildGauge()
                              .Name("baton_moe_aux_loss")
                              .Help("MoE: the last step's load-balancing loss of this worker's MoE blocks, as it "
                                    "enters the objective")
                              .Register(metrics);
  host_syncs_family_ = &prometheus::BuildCounter()
                            .Name("baton_host_syncs_total")
                            .Help("Times the worker blocked on its device (stream or event waits), counted at "
                                  "each step's end")
                            .Register(metrics);
  thread_ = std::thread([this] { Loop(); });
}

WorkerJob::~WorkerJob() {
  AbortJob("worker shutting down");
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
  AwaitSnapshotSent();
}

void WorkerJob::Handle(const v1::CoordinatorMessage& message) {
  if (message.has_hold_snapshot()) return Hold(message.hold_snapshot());
  if (message.has_fetch_state()) return Fetch(message.fetch_state());
  if (message.has_abort()) AbortJob(message.abort().reason());
  absl::MutexLock lock(&mu_);
  queue_.push_back({message, 0});
}

void WorkerJob::SessionLost() {
  AbortJob("the session with the coordinator ended");
  v1::CoordinatorMessage drop;
  drop.mutable_abort()->set_reason("session ended");
  absl::MutexLock lock(&mu_);
  queue_.push_back({drop, 0});
}

void WorkerJob::Describe(v1::HeldJob* held) {
  absl::MutexLock lock(&snap_mu_);
  if (own_.empty() || held_job_.empty()) return;
  held->set_job(held_job_);
  held->set_generation(generation_);
  held->set_pp_rank(held_rank_.pp_rank());
  held->set_tp_rank(held_rank_.tp_rank());
  held->set_dp_rank(held_rank_.dp_rank());
  held->set_cp_rank(held_rank_.cp_rank());
  for (const auto& [step, state] : own_) held->add_steps(step);
}

void WorkerJob::AbortJob(const std::string& reason) {
  absl::MutexLock lock(&mu_);
  for (comm::Communicator* c : live_comms_) c->Abort(reason);
}

void WorkerJob::Reply(v1::WorkerMessage message) {
  AwaitSnapshotSent();
  if (!session_->Send(std::move(message))) {
    BATON_LOG(WARNING) << "could not reply to the coordinator: no session";
  }
}

void WorkerJob::SendSnapshot(v1::WorkerMessage snapshot) {
  absl::MutexLock lock(&send_mu_);
  if (snapshot_sender_.joinable()) snapshot_sender_.join();
  snapshot_sender_ = std::thread([this, message = std::move(snapshot)]() mutable {
    const int64_t step = message.snapshot().step();
    if (!session_->Send(std::move(message))) {
      BATON_LOG(WARNING) << "could not send the snapshot of step " << step << " to the coordinator: no session";
    }
  });
}

void WorkerJob::AwaitSnapshotSent() {
  absl::MutexLock lock(&send_mu_);
  if (snapshot_sender_.joinable()) snapshot_sender_.join();
}

void WorkerJob::Loop() {
  for (;;) {
    Queued item;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || !queue_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopping
      item = std::move(queue_.front());
      queue_.pop_front();
    }
    // A step taken from the leader of a job that is gone (aborted or
    // reconfigured since): the job it belonged to ran no further.
    if (item.group_job != 0 && (!job_ || job_->id != item.group_job)) continue;
    Process(item.message);
  }
}

void WorkerJob::Process(const v1::CoordinatorMessage& message) {
  v1::WorkerMessage reply;
  switch (message.body_case()) {
    case v1::CoordinatorMessage::kConfigure: {
      absl::Status s = Configure(message.configure());
      if (!s.ok()) {
        BATON_LOG(ERROR) << "configure failed: " << s;
        AbortJob("configure failed");
        job_.reset();
        {
          absl::MutexLock lock(&mu_);
          live_comms_.clear();
        }
      }
      reply.mutable_configured()->set_ok(s.ok());
      reply.mutable_configured()->set_error(std::string(s.message()));
      reply.mutable_configured()->set_code(static_cast<int>(s.code()));
      reply.mutable_configured()->set_generation(message.configure().plan().generation());
      Reply(reply);
      return;
    }
    case v1::CoordinatorMessage::kRunStep: {
      // Report groups: a leader passes the step on before anything else, so
      // the verdict inside reaches its members even if it dies next.
      const bool leader = job_ && job_->leads();
      const bool member = job_ && job_->reports_to_leader();
      const absl::Status passed = leader ? PassOn(message) : absl::OkStatus();
      // The previous step's verdict, sent ahead with this step, comes first;
      // its StepDone rides in this step's report where the coordinator
      // allows it.
      const bool hold = message.run_step().step_done_in_report();
      std::optional<v1::StepDone> held;
      if (message.run_step().has_commit()) {
        held = ApplyVerdict(&message.run_step().commit(), nullptr, hold);
      } else if (message.run_step().has_discard()) {
        held = ApplyVerdict(nullptr, &message.run_step().discard(), hold);
      }
      if (!job_) {
        reply.mutable_report()->set_step(message.run_step().step());
        reply.mutable_report()->set_error("no job is configured on this worker (it was aborted or never configured)");
        reply.mutable_report()->set_code(static_cast<int>(absl::StatusCode::kFailedPrecondition));
        Reply(reply);
        return;
      }
      absl::StatusOr<v1::StepReport> report =
          passed.ok() ? job_->executor->RunStep(message.run_step().step(), message.run_step().trace())
                      : absl::StatusOr<v1::StepReport>(passed);
      if (report.ok()) {
        if (job_->data != nullptr) report->set_epoch(std::max<int64_t>(0, job_->data->EpochOfStep(message.run_step().step())));
        session_->SetStep(message.run_step().step());
        job_->last_report = *report;
        *reply.mutable_report() = *report;
      } else {
        // Out of memory where the step's arena did not see it (an op's
        // scratch, reported by its stream) still says what to lower.
        const absl::Status failed = model::WithOutOfMemoryAdvice(report.status());
        BATON_LOG(ERROR) << "step " << message.run_step().step() << " failed: " << failed;
        reply.mutable_report()->set_step(message.run_step().step());
        reply.mutable_report()->set_error(std::string(failed.message()));
        reply.mutable_report()->set_code(static_cast<int>(failed.code()));
      }
      reply.mutable_report()->set_generation(job_->plan.generation());
      if (held) *reply.mutable_report()->mutable_step_done() = *std::move(held);
      if (member) return GiveToLeader(std::move(reply));
      if (leader && reply.report().error().empty()) GatherMembers(reply.mutable_report());
      Reply(reply);
      return;
    }
    case v1::CoordinatorMessage::kCommit:
      ApplyVerdict(&message.commit(), nullptr, /*hold=*/false);
      return;
    case v1::CoordinatorMessage::kDiscard:
      ApplyVerdict(nullptr, &message.discard(), /*hold=*/false);
      return;
    case v1::CoordinatorMessage::kSaveWeights: {
      if (!job_) return;
      if (message.save_weights().with_state()) return SaveCheckpoint(message.save_weights());
      reply.mutable_saved()->set_ok(true);
      reply.mutable_saved()->set_generation(job_->plan.generation());
      std::map<int, ChunkState> no_states;
      absl::StatusOr<std::map<int, GatheredExperts>> all_experts = GatherExpertsToReplicaZero(&no_states, true);
      if (!all_experts.ok()) {
        reply.mutable_saved()->set_ok(false);
        reply.mutable_saved()->set_error(absl::StrCat("saving the weights: ", all_experts.status().message()));
        reply.mutable_saved()->set_code(static_cast<int>(all_experts.status().code()));
        Reply(reply);
        return;
      }
      const std::map<int, GatheredExperts>& experts = *all_experts;
      if (job_->rank.dp_rank() == 0 && job_->rank.cp_rank() == 0) {  // dp and cp peers hold identical weights
        absl::StatusOr<std::string> dir =
            ConfineWritePath(message.save_weights().dir(), options_.output_dirs, "output_dir", "weights directory");
        if (!dir.ok()) {
          BATON_LOG(ERROR) << "refused to save weights: " << dir.status().message();
          reply.mutable_saved()->set_ok(false);
          reply.mutable_saved()->set_error(std::string(dir.status().message()));
          reply.mutable_saved()->set_code(static_cast<int>(dir.status().code()));
          Reply(reply);
          return;
        }
        const int tp_size = job_->plan.tp();
        for (auto& [chunk, model] : job_->chunks) {
          std::vector<float> host;  // the values of a device chunk, copied to the host
          auto gathered = experts.find(chunk);
          absl::StatusOr<std::vector<NamedShard>> shards =
              gathered != experts.end() ? gathered->second.shards : model->HostShards(&host);
          absl::StatusOr<std::string> file =
              shards.ok() ? checkpoint::WriteShardFile(*dir, chunk, job_->rank.tp_rank(),
                                                       tp_size, *shards)
                          : absl::StatusOr<std::string>(
                                WithContext(shards.status(), absl::StrCat("saving the weights of chunk ", chunk)));
          if (!file.ok()) {
            reply.mutable_saved()->set_ok(false);
            reply.mutable_saved()->set_error(std::string(file.status().message()));
            reply.mutable_saved()->set_code(static_cast<int>(file.status().code()));
            break;
          }
          reply.mutable_saved()->add_files(*file);
        }
      }
      Reply(reply);
      return;
    }
    case v1::CoordinatorMessage::kEvaluate:
      Reply(Evaluate(message.evaluate().step()));
      return;
    case v1::CoordinatorMessage::kAbort: {
      if (job_) BATON_LOG(WARNING) << "job aborted: " << message.abort().reason();
      {
        absl::MutexLock lock(&mu_);
        live_comms_.clear();
      }
      job_.reset();
      return;
    }
    default:
      return;
  }
}

v1::WorkerMessage WorkerJob::Evaluate(int64_t step) {
  v1::WorkerMessage reply;
  v1::EvalReport& r = *reply.mutable_eval_report();
  r.set_step(step);
  const absl::Time start = absl::Now();
  absl::Status status;
  if (!job_) {
    status = absl::FailedPreconditionError("no job is configured on this worker (it was aborted or never configured)");
  } else if (job_->evaluator == nullptr) {
    status = absl::FailedPreconditionError("the job has no train.eval_every_steps; nothing to evaluate");
  } else {
    r.set_generation(job_->plan.generation());
    const v1::TrainSpec& train = job_->spec.train();
    const int batches = train.has_eval_steps() ? train.eval_steps() : 1;
    double loss_sum = 0;
    int64_t tokens = 0;
    // Eval batch b is "step" b of the eval data: the same batches every time.
    for (int b = 1; b <= batches && status.ok(); ++b) {
      absl::StatusOr<v1::StepReport> report = job_->evaluator->RunStep(b, /*trace=*/false);
      if (!report.ok()) {
        status = WithContext(model::WithOutOfMemoryAdvice(report.status()),
                             absl::StrCat("evaluation batch ", b, " of ", batches));
        break;
      }
      if (report->has_loss()) {
        r.set_has_loss(true);
        loss_sum += report->loss() * static_cast<double>(report->predicted());
        tokens += report->predicted();
      }
    }
    r.set_loss_sum(loss_sum);
    r.set_tokens(tokens);
  }
  r.set_seconds(absl::ToDoubleSeconds(absl::Now() - start));
  if (!status.ok()) {
    BATON_LOG(ERROR) << "evaluation after step " << step << " failed: " << status;
    r.set_error(std::string(status.message()));
    r.set_code(static_cast<int>(status.code()));
  }
  return reply;
}

absl::Status WorkerJob::PassOn(const v1::CoordinatorMessage& run) {
  const std::string bytes = run.SerializeAsString();
  for (int member = 1; member < job_->seat.size; ++member) {
    BATON_RETURN_IF_ERROR(comm::SendFrame(*job_->group, member, kRunStepTag, bytes, options_.op_timeout,
                                          absl::StrCat("passing step ", run.run_step().step(), " on to ",
                                                       job_->Member(member))));
  }
  return absl::OkStatus();
}

void WorkerJob::GatherMembers(v1::StepReport* report) {
  for (int member = 1; member < job_->seat.size; ++member) {
    const std::string what = absl::StrCat("the report of step ", report->step(), " from ", job_->Member(member));
    absl::StatusOr<std::string> bytes =
        comm::RecvFrame(*job_->group, member, kReportTag, kMaxMemberReportBytes, options_.op_timeout, what);
    v1::StepReport* theirs = report->add_members();
    if (bytes.ok() && !theirs->ParseFromString(*bytes)) {
      bytes = absl::DataLossError(absl::StrCat(what, " does not parse"));
    }
    if (!bytes.ok()) {
      BATON_LOG(ERROR) << bytes.status();
      report->clear_members();
      report->set_error(std::string(bytes.status().message()));
      report->set_code(static_cast<int>(bytes.status().code()));
      return;
    }
  }
  if (report->ByteSizeLong() > kMaxGroupReportBytes) {
    BATON_LOG(WARNING) << "the report of step " << report->step() << " for the report group is "
                       << report->ByteSizeLong() << " bytes, over " << kMaxGroupReportBytes
                       << "; the members' trace events are left out";
    for (v1::StepReport& member : *report->mutable_members()) {
      if (member.has_step_done()) member.mutable_step_done()->clear_events();
    }
  }
}

void WorkerJob::TakeSteps(Job* job) {
  for (;;) {
    absl::StatusOr<std::string> bytes = comm::RecvFrame(*job->group, 0, kRunStepTag, kMaxRunStepBytes,
                                                        absl::InfiniteDuration(), "the next step from its leader");
    v1::CoordinatorMessage run;
    if (bytes.ok() && (!run.ParseFromString(*bytes) || !run.has_run_step())) {
      bytes = absl::DataLossError("a step from its leader does not parse as a RunStep");
      job->group->Abort(bytes.status().message());  // the leader's gather fails and says so
    }
    if (!bytes.ok()) {
      if (bytes.status().code() != absl::StatusCode::kAborted) BATON_LOG(ERROR) << bytes.status();
      return;
    }
    absl::MutexLock lock(&mu_);
    queue_.push_back({std::move(run), job->id});
  }
}

void WorkerJob::GiveToLeader(v1::WorkerMessage reply) {
  const absl::Status s =
      comm::SendFrame(*job_->group, 0, kReportTag, reply.report().SerializeAsString(), options_.op_timeout,
                      absl::StrCat("giving the report of step ", reply.report().step(), " to its group's leader"));
  if (s.ok()) return;
  BATON_LOG(WARNING) << s << "; reporting to the coordinator instead";
  Reply(std::move(reply));
}

std::optional<v1::StepDone> WorkerJob::ApplyVerdict(const v1::Commit* commit, const v1::Discard* discard,
                                                    bool hold) {
  if (!job_) return std::nullopt;
  absl::StatusOr<v1::StepDone> done =
      commit != nullptr ? job_->executor->Commit(commit->step(), static_cast<float>(commit->clip_factor()))
                        : absl::StatusOr<v1::StepDone>(job_->executor->Discard(discard->step()));
  v1::WorkerMessage reply;
  if (done.ok()) {
    RecordMetrics(*done, job_->last_report);
    *reply.mutable_step_done() = *done;
  } else {
    reply.mutable_step_done()->set_error(std::string(done.status().message()));
    reply.mutable_step_done()->set_code(static_cast<int>(done.status().code()));
  }
  reply.mutable_step_done()->set_generation(job_->plan.generation());
  const bool snapshot = done.ok() && commit != nullptr && commit->snapshot();
  // A failure is told at once; so is a snapshot step, which a recovery may
  // resume from only once the coordinator knows it committed.
  if (hold && done.ok() && !snapshot) return std::move(*reply.mutable_step_done());
  Reply(reply);
  // After the reply: the coordinator gathers the others meanwhile. It picks
  // the steps (every worker snapshots the same ones).
  if (snapshot) Snapshot(commit->step());
  return std::nullopt;
}

void WorkerJob::RecordMetrics(const v1::StepDone& done, const v1::StepReport& report) {
  const prometheus::Labels& l = job_->labels;
  wall_family_->Add(l).Increment(done.wall_seconds());
  compute_family_->Add(l).Increment(done.compute_seconds());
  auto with_kind = [&](const char* kind) {
    prometheus::Labels k = l;
    k["kind"] = kind;
    return k;
  };
  comm_family_->Add(with_kind("p2p")).Increment(done.comm_p2p_seconds());
  // TP's all-reduces as "tp"; its all-gathers and reduce-scatters (SP) apart.
  comm_family_->Add(with_kind("tp")).Increment(std::max(
      0.0, done.comm_tp_seconds() - done.comm_tp_all_gather_seconds() - done.comm_tp_reduce_scatter_seconds()));
  comm_family_->Add(with_kind("all_gather")).Increment(done.comm_tp_all_gather_seconds());
  comm_family_->Add(with_kind("reduce_scatter")).Increment(done.comm_tp_reduce_scatter_seconds());
  comm_family_->Add(with_kind("dp")).Increment(done.comm_dp_seconds());
  comm_family_->Add(with_kind("cp")).Increment(done.comm_cp_seconds());  // 0 without context parallelism
  comm_family_->Add(with_kind("all_to_all")).Increment(done.comm_all_to_all_seconds());  // 0 without ep
  bubble_family_->Add(l).Increment(done.bubble_seconds());
  tokens_family_->Add(l).Increment(static_cast<double>(report.tokens()));
  if (report.has_loss()) loss_family_->Add(l).Set(report.loss());
  step_family_->Add(l).Set(static_cast<double>(done.step()));
  const int64_t syncs = kernels::HostSyncCount();
  host_syncs_family_->Add(l).Increment(static_cast<double>(std::max<int64_t>(0, syncs - host_syncs_seen_)));
  host_syncs_seen_ = syncs;
  comm_bytes_family_->Add(with_kind("tp")).Increment(static_cast<double>(done.comm_tp_bytes()));
  comm_bytes_family_->Add(with_kind("dp")).Increment(static_cast<double>(done.comm_dp_bytes()));
  comm_bytes_family_->Add(with_kind("cp")).Increment(static_cast<double>(done.comm_cp_bytes()));
  comm_bytes_family_->Add(with_kind("all_to_all")).Increment(static_cast<double>(done.comm_all_to_all_bytes()));
  // The model state this worker holds, by kind, on any device (ZeRO-1
  // divides "optimizer" by dp).
  device_memory_family_->Add(with_kind("weights")).Set(static_cast<double>(done.weights_bytes()));
  device_memory_family_->Add(with_kind("grads")).Set(static_cast<double>(done.grads_bytes()));
  device_memory_family_->Add(with_kind("optimizer")).Set(static_cast<double>(done.optimizer_bytes()));
  device_memory_family_->Add(with_kind("activations")).Set(static_cast<double>(done.activation_bytes()));
  if (!job_->device.is_cpu()) {  // the CPU's memory is not counted by the backend
    const kernels::MemoryStats memory = kernels::GetMemoryStats(job_->device);
    device_memory_family_->Add(with_kind("in_use")).Set(static_cast<double>(memory.in_use_bytes));
    device_memory_family_->Add(with_kind("reserved")).Set(static_cast<double>(memory.reserved_bytes));
  }
  // MoE (a dense job's StepDone has no expert counts: no series). The
  // expert label is bounded by model.moe.experts (at most 1024, JobLimits).
  if (done.moe_routed_tokens_size() > 0) {
    int64_t routed = 0, kept = 0;
    for (int e = 0; e < done.moe_routed_tokens_size(); ++e) {
      prometheus::Labels expert = l;
      expert["expert"] = std::to_string(e);
      expert["kind"] = "routed";
      moe_tokens_family_->Add(expert).Increment(static_cast<double>(done.moe_routed_tokens(e)));
      routed += done.moe_routed_tokens(e);
      if (e < done.moe_kept_tokens_size()) {
        expert["kind"] = "kept";
        moe_tokens_family_->Add(expert).Increment(static_cast<double>(done.moe_kept_tokens(e)));
        kept += done.moe_kept_tokens(e);
      }
    }
    moe_dropped_family_->Add(l).Set(routed > 0 ? 1.0 - static_cast<double>(kept) / static_cast<double>(routed) : 0.0);
    moe_aux_loss_family_->Add(l).Set(done.moe_aux_loss());
  }
}

absl::Status WorkerJob::Configure(const v1::Configure& configure) {
  {
    absl::MutexLock lock(&mu_);
    live_comms_.clear();
  }
  job_.reset();
  auto job = std::make_unique<Job>();
  job->id = next_job_id_++;
  absl::Status s = Build(configure, job.get());
  if (!s.ok()) {
    absl::MutexLock lock(&mu_);
    live_comms_.clear();  // the half-built job's communicators die with it
    return s;
  }
  const std::string key = absl::StrCat(job->plan.job(), "/", job->rank.pp_rank(), ".", job->rank.tp_rank(), ".",
                                       job->rank.dp_rank(), "/", job->plan.tp(), "/", job->plan.pp(), "x",
                                       std::max(1, job->plan.virtual_stages()));
  {
    absl::MutexLock lock(&snap_mu_);
    if (own_key_ != key) own_.clear();  // another job or shard: the old snapshots are of no use
    own_key_ = key;
    generation_ = job->plan.generation();
    held_job_ = job->plan.job();
    held_rank_ = job->rank;
  }
  job_ = std::move(job);
  const int64_t resume = configure.resume_step();
  // A checkpoint of step 0 (batonctl checkpoint import-hf) is restored too:
  // its weights are not the seed's.
  if (resume > 0 || !configure.checkpoint_dir().empty()) {
    absl::Status s = configure.checkpoint_dir().empty() ? Restore(resume, configure.state())
                                                        : RestoreFromCheckpoint(resume, configure.checkpoint_dir());
    if (!s.ok()) {
      job_.reset();
      absl::MutexLock lock(&mu_);
      live_comms_.clear();
      return s;
    }
  }
  {
    absl::MutexLock lock(&snap_mu_);  // a rolled-back timeline: later snapshots are replayed
    own_.erase(own_.upper_bound(resume), own_.end());
  }
  session_->SetStep(resume);
  if (job_->reports_to_leader()) {  // a member: steps come from the leader
    Job* job = job_.get();
    job_->group_reader = std::thread([this, job] { TakeSteps(job); });
  }
  BATON_LOG(INFO) << "configured for job '" << job_->plan.job() << "' generation " << job_->plan.generation()
                  << ": stage " << job_->rank.pp_rank() << ", tp " << job_->rank.tp_rank() << ", dp "
                  << job_->rank.dp_rank()
                  << (job_->plan.cp() > 1 ? absl::StrCat(", cp ", job_->rank.cp_rank()) : std::string())
                  << ", " << job_->chunks.size() << " chunk(s)"
                  << (resume > 0 || !configure.checkpoint_dir().empty() ? absl::StrCat(", resumed at step ", resume,
                                                !configure.checkpoint_dir().empty()
                                                    ? absl::StrCat(" from checkpoint ", configure.checkpoint_dir())
                                                : configure.state().empty() ? " from its own snapshot"
                                                                            : " from the state sent")
                                 : "")
                  << (job_->leads()               ? absl::StrCat(", leading report group ", job_->seat.group, " (",
                                                                 job_->seat.size, " ranks)")
                      : job_->reports_to_leader() ? absl::StrCat(", reporting to the leader of report group ",
                                                                 job_->seat.group)
                                                  : "");
  return absl::OkStatus();
}

std::string WorkerJob::EncodeShardState(int64_t step) {
  v1::ShardState shard;
  shard.set_step(step);
  shard.set_pp_rank(job_->rank.pp_rank());
  shard.set_tp_rank(job_->rank.tp_rank());
  shard.set_tp_size(job_->plan.tp());
  for (auto& [c, model] : job_->chunks) {
    v1::ShardState::Chunk* chunk = shard.add_chunks();
    chunk->set_chunk(c);
    chunk->set_state(EncodeChunkState(model->CaptureState()));
  }
  return shard.SerializeAsString();  // the encoded chunks are freed on return
}

void WorkerJob::Snapshot(int64_t step) {
  const absl::Time start = absl::Now();
  std::string bytes = EncodeShardState(step);
  const size_t size = bytes.size();
  snapshot_bytes_family_->Add(job_->labels).Increment(static_cast<double>(size));
  v1::WorkerMessage msg;
  v1::ShardSnapshot* snap = msg.mutable_snapshot();
  snap->set_owner(options_.name);
  snap->set_step(step);
  snap->set_generation(job_->plan.generation());
  {
    // The oldest goes before the newest comes in, and the copy to send is
    // made from the one kept: one state-sized copy fewer at the peak.
    absl::MutexLock lock(&snap_mu_);
    if (std::distance(own_.upper_bound(step), own_.end()) >= kOwnSnapshots) {  // older than those kept
      if (size <= kMaxSnapshotBytes) snap->set_data(std::move(bytes));
    } else {
      own_.erase(step);
      while (own_.size() >= kOwnSnapshots) own_.erase(own_.begin());  // older than `step`
      const std::string& kept = own_.emplace(step, std::move(bytes)).first->second;
      if (size <= kMaxSnapshotBytes) snap->set_data(kept);
    }
  }
  if (size > kMaxSnapshotBytes) {
    snap->set_error(absl::StrCat("snapshot of ", size, " bytes is over the ", kMaxSnapshotBytes,
                                 "-byte limit of a (fragmented) session message; kept locally only"));
    snap->set_code(static_cast<int>(absl::StatusCode::kResourceExhausted));
  }
  const double stall = absl::ToDoubleSeconds(absl::Now() - start);
  snapshot_stall_family_->Add(job_->labels).Increment(stall);
  snap->set_capture_seconds(stall);  // the coordinator spaces snapshots by it
  SendSnapshot(std::move(msg));
}

absl::Status WorkerJob::Restore(int64_t step, const std::string& state) {
  std::string bytes = state;
  if (bytes.empty()) {
    absl::MutexLock lock(&snap_mu_);
    auto it = own_.find(step);
    if (it == own_.end()) {
      return absl::DataLossError(absl::StrCat("this worker holds no snapshot of step ", step, " (it holds ",
                                              own_.size(), " snapshot(s)", own_.empty() ? "" : ", newest of step ",
                                              own_.empty() ? 0 : own_.rbegin()->first, ")"));
    }
    bytes = it->second;
  }
  v1::ShardState shard;
  if (!shard.ParseFromString(bytes)) return absl::DataLossError("the state sent is not a ShardState");
  if (shard.step() != step || shard.pp_rank() != job_->rank.pp_rank() || shard.tp_rank() != job_->rank.tp_rank() ||
      shard.tp_size() != job_->plan.tp() || shard.chunks_size() != static_cast<int>(job_->chunks.size())) {
    return absl::DataLossError(absl::StrCat("the state sent is of step ", shard.step(), ", stage ", shard.pp_rank(),
                                            ", tp ", shard.tp_rank(), "/", shard.tp_size(), " with ",
                                            shard.chunks_size(), " chunk(s); this worker needs step ", step,
                                            ", stage ", job_->rank.pp_rank(), ", tp ", job_->rank.tp_rank(), "/",
                                            job_->plan.tp()));
  }
  for (const v1::ShardState::Chunk& chunk : shard.chunks()) {
    auto it = job_->chunks.find(chunk.chunk());
    if (it == job_->chunks.end()) return absl::DataLossError(absl::StrCat("the state has chunk ", chunk.chunk()));
    absl::StatusOr<ChunkState> decoded = DecodeChunkState(chunk.state());
    if (!decoded.ok()) return WithContext(decoded.status(), absl::StrCat("chunk ", chunk.chunk(), " of step ", step));
    BATON_RETURN_IF_ERROR_CTX(it->second->RestoreState(*decoded), "restoring chunk ", chunk.chunk());
  }
  absl::MutexLock lock(&snap_mu_);
  own_[step] = std::move(bytes);
  while (own_.size() > kOwnSnapshots) own_.erase(own_.begin());
  return absl::OkStatus();
}

absl::Status WorkerJob::RestoreFromCheckpoint(int64_t step, const std::string& dir) {
  for (auto& [c, model] : job_->chunks) {
    BATON_ASSIGN_OR_RETURN(checkpoint::ChunkLayout layout,
                           checkpoint::LayoutOfChunk(model->Shards(), c, job_->rank.tp_rank(), job_->plan.tp()));
    absl::StatusOr<ChunkState> state = checkpoint::LoadChunkState(dir, layout);
    if (!state.ok()) return WithContext(state.status(), absl::StrCat("loading chunk ", c, " from ", dir));
    if (state->optimizer_step != step) {
      BATON_LOG(WARNING) << "checkpoint " << dir << " holds optimizer step " << state->optimizer_step
                         << " for chunk " << c << ", resuming after job step " << step;
    }
    BATON_RETURN_IF_ERROR_CTX(model->RestoreFullState(*state), "restoring chunk ", c, " from ", dir);
  }
  KeepOwn(step);
  return absl::OkStatus();
}

void WorkerJob::KeepOwn(int64_t step) {
  std::string bytes = EncodeShardState(step);
  absl::MutexLock lock(&snap_mu_);
  own_[step] = std::move(bytes);
  while (own_.size() > kOwnSnapshots) own_.erase(own_.begin());
}

absl::StatusOr<std::map<int, GatheredExperts>> WorkerJob::GatherExpertsToReplicaZero(
    std::map<int, ChunkState>* states, bool weights_only) {
  std::map<int, GatheredExperts> experts;
  if (job_->ep == nullptr || job_->rank.dp_rank() >= job_->plan.ep()) return experts;
  for (auto& [c, model] : job_->chunks) {
    ChunkState state;
    if (auto it = states->find(c); it != states->end()) {
      state = std::move(it->second);
      states->erase(it);
    } else {
      state = model->CaptureState();
      if (weights_only) {
        state.adam_m.clear();
        state.adam_v.clear();
      }
    }
    absl::StatusOr<GatheredExperts> all = model->GatherExperts(job_->ep.get(), options_.op_timeout, std::move(state));
    if (!all.ok()) return WithContext(all.status(), absl::StrCat("chunk ", c));
    experts[c] = *std::move(all);
  }
  return experts;
}

void WorkerJob::SaveCheckpoint(const v1::SaveWeights& save) {
  v1::WorkerMessage reply;
  v1::Saved* saved = reply.mutable_saved();
  saved->set_ok(true);
  saved->set_step(save.step());
  saved->set_generation(job_->plan.generation());
  // ZeRO-1: every DP rank holds a shard of the moments; the group gathers
  // them (a collective, chunks in the same order on every rank) and replica
  // 0 writes the whole state, so the checkpoint is the same as without ZeRO
  // and resumes into any layout and zero_stage.
  auto fail = [&](const absl::Status& status) {
    const absl::Status failed = WithContext(status, absl::StrCat("checkpoint of step ", save.step()));
    BATON_LOG(ERROR) << failed;
    saved->set_ok(false);
    saved->set_error(std::string(failed.message()));
    saved->set_code(static_cast<int>(failed.code()));
    Reply(reply);
  };
  std::map<int, ChunkState> full;
  // The group the moments are sharded over: dp (x cp), or with ep the
  // ranks holding the same experts (none: not sharded).
  comm::Communicator* shard_group = job_->ep != nullptr ? job_->edp.get() : job_->dp.get();
  if (job_->spec.parallel().zero_stage() >= 1 && shard_group != nullptr) {
    for (auto& [c, model] : job_->chunks) {
      absl::StatusOr<ChunkState> state = model->CaptureFullState(shard_group, options_.op_timeout);
      if (!state.ok()) return fail(state.status());
      full[c] = *std::move(state);
    }
  }
  // Expert parallelism: the checkpoint is the same as without ep too.
  absl::StatusOr<std::map<int, GatheredExperts>> all_experts = GatherExpertsToReplicaZero(&full, false);
  if (!all_experts.ok()) return fail(all_experts.status());
  std::map<int, GatheredExperts>& experts = *all_experts;
  if (job_->rank.dp_rank() != 0 || job_->rank.cp_rank() != 0) {  // dp and cp peers hold identical state: one writes
    Reply(reply);
    return;
  }
  absl::StatusOr<std::string> dir = ConfineWritePath(save.dir(), options_.output_dirs, "output_dir",
                                                     absl::StrCat("checkpoint directory of step ", save.step()));
  if (!dir.ok()) {
    BATON_LOG(ERROR) << "refused to save a checkpoint: " << dir.status().message();
    saved->set_ok(false);
    saved->set_error(std::string(dir.status().message()));
    saved->set_code(static_cast<int>(dir.status().code()));
    Reply(reply);
    return;
  }
  std::vector<checkpoint::ChunkToSave> chunks;
  for (auto& [c, model] : job_->chunks) {
    chunks.push_back({c, job_->rank.tp_rank(), job_->plan.tp(), model.get(), {}, {}});
    if (auto it = full.find(c); it != full.end()) chunks.back().state = std::move(it->second);
    if (auto it = experts.find(c); it != experts.end()) {
      chunks.back().shards = it->second.shards;  // views into the state, which keeps its buffers when moved
      chunks.back().state = std::move(it->second.state);
    }
  }
  const prometheus::Labels labels = job_->labels;
  absl::StatusOr<double> stall = writer_->Save(
      *dir, save.step(), chunks, [this, reply, labels](const checkpoint::SaveResult& r) mutable {
        v1::Saved* s = reply.mutable_saved();
        if (r.status.ok()) {
          for (const std::string& f : r.files) s->add_files(f);
          checkpoint_bytes_family_->Add(labels).Increment(static_cast<double>(r.bytes));
        } else {
          s->set_ok(false);
          s->set_error(std::string(r.status.message()));
          s->set_code(static_cast<int>(r.status.code()));
        }
        Reply(reply);
      });
  if (!stall.ok()) {
    saved->set_ok(false);
    saved->set_error(std::string(stall.status().message()));
    saved->set_code(static_cast<int>(stall.status().code()));
    Reply(reply);
    return;
  }
  checkpoint_stall_family_->Add(labels).Increment(*stall);
  // The state is on the host: the coordinator's `saving` ends when every
  // worker said so (the files follow in the second Saved).
  saved->set_copied(true);
  saved->set_stall_seconds(*stall);
  Reply(reply);
}

void WorkerJob::Hold(const v1::ShardSnapshot& snapshot) {
  if (snapshot.data().empty() || snapshot.owner().empty()) return;  // its size: the session's reassembly bound
  absl::MutexLock lock(&snap_mu_);
  std::map<int64_t, std::string>& copies = held_[snapshot.owner()];
  // Older than every copy kept: not kept. Else the oldest goes before the
  // newest comes in (one state-sized copy fewer at the peak).
  if (std::distance(copies.upper_bound(snapshot.step()), copies.end()) >= kHeldSnapshots) return;
  copies.erase(snapshot.step());
  while (copies.size() >= kHeldSnapshots) copies.erase(copies.begin());
  copies.emplace(snapshot.step(), snapshot.data());
}

void WorkerJob::Fetch(const v1::FetchState& fetch) {
  v1::WorkerMessage reply;
  v1::ShardSnapshot* out = reply.mutable_fetched_state();
  out->set_owner(fetch.owner());
  out->set_step(fetch.step());
  {
    absl::MutexLock lock(&snap_mu_);
    out->set_generation(generation_);
    const std::map<int64_t, std::string>* from = nullptr;
    if (fetch.owner() == options_.name) {
      from = &own_;
    } else if (auto it = held_.find(fetch.owner()); it != held_.end()) {
      from = &it->second;
    }
    auto it = from == nullptr ? std::map<int64_t, std::string>::const_iterator() : from->find(fetch.step());
    if (from != nullptr && it != from->end()) {
      out->set_data(it->second);
    } else {
      out->set_error(absl::StrCat(options_.name, " holds no state of ", fetch.owner(), " at step ", fetch.step()));
      out->set_code(static_cast<int>(absl::StatusCode::kNotFound));
    }
  }
  Reply(std::move(reply));
}
namespace {

// train.precision on this worker's device. Every device runs bf16: CUDA with
// its bf16 kernels, the CPU (and the simulated device) with the CPU backend's
// bf16 reference ops (exact to their definition, slower than fp32 there).
// (The device itself was checked usable before.)
absl::StatusOr<kernels::Precision> CheckPrecision(const v1::TrainSpec& train) {
  return model::PrecisionFromSpec(train);
}

}  // namespace

absl::Status WorkerJob::Build(const v1::Configure& configure, Job* job) {
  job->plan = configure.plan();
  job->spec = configure.job();
  // The device first: a worker that cannot run the job says why before any
  // rendezvous (UNAVAILABLE naming the cause; the daemon stays up).
  BATON_ASSIGN_OR_RETURN(const kernels::Device device, kernels::ParseDevice(options_.device));
  BATON_RETURN_IF_ERROR_CTX(kernels::CheckDeviceUsable(device), "--device=", options_.device);
  BATON_ASSIGN_OR_RETURN(const kernels::Precision precision, CheckPrecision(job->spec.train()));
  job->device = device;
  const v1::Plan& plan = job->plan;
  bool found = false;
  for (const v1::RankAssignment& r : plan.ranks()) {
    if (r.worker_name() == options_.name) {
      job->rank = r;
      found = true;
    }
  }
  if (!found) return absl::InvalidArgumentError(absl::StrCat("the plan has no rank for worker '", options_.name, "'"));
  const int pp = plan.pp(), tp = plan.tp(), dp = plan.dp(), v = std::max(1, plan.virtual_stages());
  const int p = job->rank.pp_rank(), t = job->rank.tp_rank(), d = job->rank.dp_rank();
  const int cp = std::max(1, plan.cp()), cr = job->rank.cp_rank();
  const int ep = std::max(1, plan.ep());
  if (ep > 1 && (dp % ep != 0 || !job->spec.model().has_moe() ||
                 (job->spec.parallel().zero_stage() > 0 && (cp > 1 || dp == ep)))) {
    return absl::InvalidArgumentError(absl::StrCat("parallel.ep is ", ep, ": expert parallelism needs model.moe and ep "
                                                   "dividing dp (", dp, "); with zero_stage, cp 1 and dp > ep"));
  }
  if (cr < 0 || cr >= cp) {
    return absl::InvalidArgumentError(absl::StrCat("cp rank ", cr, " is outside the plan's cp ", cp));
  }
  if (cp > 1 && plan.report_groups()) {  // a coordinator that planned report groups over cp ranks
    return absl::InvalidArgumentError("the plan has report groups and parallel.cp > 1; report groups cover "
                                      "pp x tp x dp jobs only");
  }
  const int stages = pp * v;
  if (plan.stages_size() != stages) return absl::InvalidArgumentError("plan stages do not match pp * virtual_stages");
  job->labels = {{"training_job", plan.job()},
                 {"stage", std::to_string(p)},
                 {"tp_rank", std::to_string(t)},
                 {"dp_rank", std::to_string(d)},
                 {"worker", options_.name}};

  // Rendezvous: every worker creates its groups in the same order (tp,
  // pipeline, dp, tie; comm/job_groups.h), so no two groups can wait on each
  // other; over NCCL as splits of one parent communicator of the job.
  job->store = std::make_unique<comm::CoordinatorStore>(stub_, plan.job(), plan.generation());
  comm::JobCommSpec comm_spec;
  comm_spec.generation = plan.generation();
  // The schedule's placement (Program.stage_ranks, as in the plan; empty:
  // looped): the chunks this rank holds, and where the tied embedding's two
  // ends are.
  const auto& placement = configure.program().stage_ranks();
  if (!placement.empty() && placement.size() != stages) {
    return absl::InvalidArgumentError(absl::StrCat("the program places ", placement.size(), " stages, the plan has ",
                                                   stages));
  }
  auto rank_of = [&](int stage) { return placement.empty() ? stage % pp : placement.Get(stage); };
  comm_spec.layout = comm::JobLayout{pp, tp, dp, !job->spec.model().has_synthetic(), rank_of(0), rank_of(stages - 1)};
  comm_spec.layout.cp = cp;
  comm_spec.layout.ep = ep;
  comm_spec.rank = comm::RankCoords{p, t, d, cr};
  // The coordinator's choice for the whole generation (plan.proto
  // comm_backend): NCCL splits one parent communicator per generation
  // (comm::CreateJobCommunicators); Gloo stages CUDA tensors through host
  // memory.
  if (plan.comm_backend() == "nccl") {
    if (device.type != kernels::DeviceType::kCuda) {
      return absl::InvalidArgumentError(absl::StrCat("the plan's data plane is NCCL, but this worker's device is ",
                                                     options_.device, ": NCCL needs a CUDA device"));
    }
    comm_spec.backend = comm::Backend::kNccl;
  } else if (plan.comm_backend().empty() || plan.comm_backend() == "gloo") {
    comm_spec.backend = comm::Backend::kGloo;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("the plan's data plane '", plan.comm_backend(),
                                                   "' is unknown to this worker (gloo or nccl)"));
  }
  comm_spec.rendezvous_timeout = options_.rendezvous_timeout;
  comm_spec.op_timeout = options_.op_timeout;
  comm_spec.hostname = options_.comm_host;
  comm_spec.device = device.type == kernels::DeviceType::kCuda ? device.index : -1;  // stage CUDA memory
  BATON_ASSIGN_OR_RETURN(const std::vector<comm::GroupRound> rounds,
                         comm::PlanJobGroups(comm_spec.layout, comm_spec.rank));
  BATON_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<comm::Communicator>> comms,
                         comm::CreateJobCommunicators(*job->store, comm_spec));
  {
    absl::MutexLock lock(&mu_);
    for (const auto& c : comms) {
      if (c != nullptr) live_comms_.push_back(c.get());
    }
  }
  const ReportGroupSeat seat = ReportGroupSeatOf(pp, tp, dp, plan.report_group_columns(), p, t, d);
  if (plan.report_groups() && seat.size > 1) {
    // After the job's groups, in the same order on every rank of the group.
    comm::CommunicatorSpec group;
    group.group = ReportGroupName(seat.group);
    group.generation = plan.generation();
    group.rank = seat.rank;
    group.size = seat.size;
    group.backend = comm::Backend::kGloo;  // host bytes, whatever the data plane
    group.rendezvous_timeout = options_.rendezvous_timeout;
    group.op_timeout = kGroupWatchdog;
    group.hostname = options_.comm_host;
    absl::StatusOr<std::unique_ptr<comm::Communicator>> created = comm::CreateCommunicator(*job->store, group);
    if (!created.ok()) return WithContext(created.status(), absl::StrCat("report group ", seat.group));
    job->seat = seat;
    job->group = std::move(*created);
    absl::MutexLock lock(&mu_);
    live_comms_.push_back(job->group.get());
  }
  for (size_t i = 0; i < rounds.size(); ++i) {
    switch (rounds[i].kind) {
      case comm::GroupKind::kTp:
        job->tp = std::move(comms[i]);
        job->timed_tp = std::make_unique<comm::TimedCommunicator>(job->tp.get());
        break;
      case comm::GroupKind::kPipeline:
        job->pipeline = std::move(comms[i]);
        break;
      case comm::GroupKind::kDp:
        job->dp = std::move(comms[i]);
        break;
      case comm::GroupKind::kTie:
        job->tie = std::move(comms[i]);  // null on the middle pipeline ranks
        break;
      case comm::GroupKind::kCp:
        job->cp = std::move(comms[i]);
        job->timed_cp = std::make_unique<comm::TimedCommunicator>(job->cp.get());
        break;
      case comm::GroupKind::kEp:
        job->ep = std::move(comms[i]);
        job->timed_ep = std::make_unique<comm::TimedCommunicator>(job->ep.get());
        break;
      case comm::GroupKind::kExpertDp:
        job->edp = std::move(comms[i]);
        break;
    }
  }

  // An architecture or field this worker does not know is refused, never
  // trained as another model.
  if (!job->spec.model().has_synthetic()) BATON_RETURN_IF_ERROR(model::ValidateModelSpec(job->spec.model()));
  // Model chunks this rank holds: stages p, p + pp, p + 2pp, ... when looped.
  for (int c = 0; c < stages; ++c) {
    if (rank_of(c) != p) continue;
    const v1::StagePartition& part = plan.stages(c);
    if (job->spec.model().has_synthetic()) {
      BATON_ASSIGN_OR_RETURN(job->chunks[c], SyntheticStage::Create(job->spec.model().synthetic(), c, stages));
      continue;
    }
    BATON_ASSIGN_OR_RETURN(
        model::StageConfig config,
        model::MakeChunkConfig(model::GptConfigFromSpec(job->spec.model()), c, stages,
                               model::BlockRange{part.first_layer(), part.num_layers()}, t, tp,
                               job->spec.train().seed()));
    config.microbatches = job->spec.schedule().microbatches();
    config.comm_timeout = options_.op_timeout;
    config.device = device;
    config.precision = precision;
    config.sequence_parallel = job->spec.parallel().sequence_parallel();
    config.cp_rank = cr;
    config.cp_size = cp;
    config.ep_rank = d % ep;  // the slot in the expert group (comm/job_groups.h)
    config.ep_size = ep;
    if (job->spec.parallel().zero_stage() > 1) {  // a coordinator newer than this worker
      return absl::InvalidArgumentError(absl::StrCat("parallel.zero_stage is ", job->spec.parallel().zero_stage(),
                                                     "; this worker runs ZeRO stages 0 and 1 only"));
    }
    if (job->spec.parallel().zero_stage() >= 1) {
      // ZeRO-1: the moments sharded over the dp x cp group, or with ep over
      // the dp / ep ranks holding the same experts (the dense gradients are
      // summed over the expert group first: comm/job_groups.h).
      config.dp_rank = ep > 1 ? d / ep : d * cp + cr;
      config.dp_size = ep > 1 ? dp / ep : dp * cp;
    }
    BATON_ASSIGN_OR_RETURN(job->chunks[c], GptStageModel::Create(config, job->spec.train().micro_batch_size(),
                                                                 job->timed_tp.get(),
                                                                 c == 0 || c == stages - 1 ? job->tie.get() : nullptr,
                                                                 AdamWFromTrainSpec(job->spec.train()), job->timed_cp.get(),
                                                                 job->timed_ep.get()));
  }
  if (job->spec.parallel().zero_stage() >= 1) {
    for (const auto& [c, m] : job->chunks) {
      BATON_LOG(INFO) << "chunk " << c << ": AdamW moments sharded over " << (ep > 1 ? dp / ep : dp * cp)
                      << " data-parallel ranks (ZeRO-1): "
                      << m->MemoryBytes().optimizer << " bytes here";
    }
  }
  if (!job->spec.model().has_synthetic() && model::GptConfigFromSpec(job->spec.model()).tie_embeddings &&
      stages > 1 && rank_of(0) == p && rank_of(stages - 1) == p) {
    // Both ends of the tied embedding here (the V's rank 0): summed locally.
    BATON_RETURN_IF_ERROR(GptStageModel::TieLocally(static_cast<GptStageModel&>(*job->chunks.at(0)),
                                                    static_cast<GptStageModel&>(*job->chunks.at(stages - 1))));
  }
  if (!job->spec.model().has_synthetic()) {  // the synthetic cost model reads no data
    BATON_ASSIGN_OR_RETURN(job->data, data::MakeDataSource(job->spec, options_.data_dir));
  }

  ExecutorOptions eo;
  eo.num_stages = stages;
  eo.microbatches = job->spec.schedule().microbatches();
  eo.dp_rank = d;
  eo.dp_size = dp * cp;  // gradients are averaged over the dp x cp group
  eo.tokens_per_microbatch = static_cast<int64_t>(job->spec.train().micro_batch_size()) *
                             std::max(1, job->spec.model().seq_len());
  eo.op_timeout = options_.op_timeout;
  eo.clock_us = [session = session_.get()] { return session->CoordinatorNowMicros(); };
  std::map<int, StageModel*> chunks;
  for (auto& [c, m] : job->chunks) chunks[c] = m.get();
  const data::DataSource* data = job->data.get();
  job->executor = std::make_unique<StepExecutor>(
      configure.program(), eo, chunks,
      [data](int64_t step, int global_mb, MicrobatchData* out) {
        return data ? data->Fill(step, global_mb, 0, out) : absl::OkStatus();
      },
      job->pipeline.get(), job->timed_tp.get(), job->dp.get(), job->timed_cp.get(), job->edp.get(),
      job->timed_ep.get());
  if (job->spec.train().eval_every_steps() > 0 && !job->spec.model().has_synthetic()) {
    BATON_ASSIGN_OR_RETURN(job->eval_data, data::MakeEvalDataSource(job->spec, options_.data_dir));
    ExecutorOptions eval = eo;
    eval.forward_only = true;
    const data::DataSource* eval_data = job->eval_data.get();
    // No DP group: each replica scores its share of the batch, the
    // coordinator sums them.
    job->evaluator = std::make_unique<StepExecutor>(
        ForwardOnlyProgram(configure.program()), eval, chunks,
        [eval_data](int64_t step, int global_mb, MicrobatchData* out) {
          return eval_data->Fill(step, global_mb, 0, out);
        },
        job->pipeline.get(), job->timed_tp.get(), nullptr, job->timed_cp.get(), nullptr, job->timed_ep.get());
  }
  return absl::OkStatus();
}

}  // namespace baton
