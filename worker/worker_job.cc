#include "worker/worker_job.h"

#include <map>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "kernels/device.h"
#include "worker/agent.h"
#include "worker/checkpoint/checkpoint.h"
#include "worker/comm/communicator_factory.h"
#include "worker/comm/coordinator_store.h"
#include "worker/data/data_source.h"
#include "worker/data/make_data_source.h"
#include "worker/gpt_stage_model.h"
#include "worker/synthetic_stage.h"

namespace baton {

struct WorkerJob::Job {
  v1::Plan plan;
  v1::JobSpec spec;
  v1::RankAssignment rank;
  std::unique_ptr<comm::Store> store;
  std::unique_ptr<comm::Communicator> tp, pipeline, dp, tie;
  std::unique_ptr<comm::TimedCommunicator> timed_tp;
  std::map<int, std::unique_ptr<StageModel>> chunks;
  std::unique_ptr<data::DataSource> data;
  std::unique_ptr<StepExecutor> executor;
  v1::StepReport last_report;
  prometheus::Labels labels;
};

WorkerJob::WorkerJob(Options options, std::shared_ptr<v1::Coordinator::StubInterface> stub, WorkerAgent* agent,
                     prometheus::Registry& metrics)
    : options_(std::move(options)), stub_(std::move(stub)), agent_(agent) {
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
  thread_ = std::thread([this] { Loop(); });
}

WorkerJob::~WorkerJob() {
  AbortJob("worker shutting down");
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

void WorkerJob::Handle(const v1::CoordinatorMessage& message) {
  if (message.has_abort()) AbortJob(message.abort().reason());
  absl::MutexLock lock(&mu_);
  queue_.push_back(message);
}

void WorkerJob::SessionLost() {
  AbortJob("the session with the coordinator ended");
  v1::CoordinatorMessage drop;
  drop.mutable_abort()->set_reason("session ended");
  absl::MutexLock lock(&mu_);
  queue_.push_back(drop);
}

void WorkerJob::AbortJob(const std::string& reason) {
  absl::MutexLock lock(&mu_);
  for (comm::Communicator* c : live_comms_) c->Abort(reason);
}

void WorkerJob::Reply(v1::WorkerMessage message) {
  if (!agent_->Send(std::move(message))) {
    BATON_LOG(WARNING) << "could not reply to the coordinator: no session";
  }
}

void WorkerJob::Loop() {
  for (;;) {
    v1::CoordinatorMessage message;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || !queue_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopping
      message = std::move(queue_.front());
      queue_.pop_front();
    }
    Process(message);
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
      if (!job_) {
        reply.mutable_report()->set_step(message.run_step().step());
        reply.mutable_report()->set_error("no job is configured on this worker (it was aborted or never configured)");
        reply.mutable_report()->set_code(static_cast<int>(absl::StatusCode::kFailedPrecondition));
        Reply(reply);
        return;
      }
      absl::StatusOr<v1::StepReport> report = job_->executor->RunStep(message.run_step().step(),
                                                                       message.run_step().trace());
      if (report.ok()) {
        agent_->SetStep(message.run_step().step());
        job_->last_report = *report;
        *reply.mutable_report() = *report;
      } else {
        BATON_LOG(ERROR) << "step " << message.run_step().step() << " failed: " << report.status();
        reply.mutable_report()->set_step(message.run_step().step());
        reply.mutable_report()->set_error(std::string(report.status().message()));
        reply.mutable_report()->set_code(static_cast<int>(report.status().code()));
      }
      reply.mutable_report()->set_generation(job_->plan.generation());
      Reply(reply);
      return;
    }
    case v1::CoordinatorMessage::kCommit:
    case v1::CoordinatorMessage::kDiscard: {
      if (!job_) return;
      absl::StatusOr<v1::StepDone> done =
          message.has_commit()
              ? job_->executor->Commit(message.commit().step(), static_cast<float>(message.commit().clip_factor()))
              : absl::StatusOr<v1::StepDone>(job_->executor->Discard(message.discard().step()));
      if (done.ok()) {
        RecordMetrics(*done, job_->last_report);
        *reply.mutable_step_done() = *done;
      } else {
        reply.mutable_step_done()->set_error(std::string(done.status().message()));
        reply.mutable_step_done()->set_code(static_cast<int>(done.status().code()));
      }
      reply.mutable_step_done()->set_generation(job_->plan.generation());
      Reply(reply);
      return;
    }
    case v1::CoordinatorMessage::kSaveWeights: {
      if (!job_) return;
      reply.mutable_saved()->set_ok(true);
      reply.mutable_saved()->set_generation(job_->plan.generation());
      if (job_->rank.dp_rank() == 0) {  // DP replicas hold identical weights
        const int tp_size = job_->plan.tp();
        for (auto& [chunk, model] : job_->chunks) {
          absl::StatusOr<std::string> file = checkpoint::WriteShardFile(
              message.save_weights().dir(), chunk, job_->rank.tp_rank(), tp_size, model->Shards());
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
  comm_family_->Add(with_kind("tp")).Increment(done.comm_tp_seconds());
  comm_family_->Add(with_kind("dp")).Increment(done.comm_dp_seconds());
  bubble_family_->Add(l).Increment(done.bubble_seconds());
  tokens_family_->Add(l).Increment(static_cast<double>(report.tokens()));
  if (report.has_loss()) loss_family_->Add(l).Set(report.loss());
  step_family_->Add(l).Set(static_cast<double>(done.step()));
}

absl::Status WorkerJob::Configure(const v1::Configure& configure) {
  if (configure.resume_step() > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot resume at step ", configure.resume_step(), ": this worker cannot restore model state yet"));
  }
  {
    absl::MutexLock lock(&mu_);
    live_comms_.clear();
  }
  job_.reset();
  auto job = std::make_unique<Job>();
  absl::Status s = Build(configure, job.get());
  if (!s.ok()) {
    absl::MutexLock lock(&mu_);
    live_comms_.clear();  // the half-built job's communicators die with it
    return s;
  }
  BATON_LOG(INFO) << "configured for job '" << job->plan.job() << "' generation " << job->plan.generation()
                  << ": stage " << job->rank.pp_rank() << ", tp " << job->rank.tp_rank() << ", dp "
                  << job->rank.dp_rank() << ", " << job->chunks.size() << " chunk(s)";
  job_ = std::move(job);
  return absl::OkStatus();
}

namespace {

absl::Status CheckPrecision(const v1::TrainSpec& train, kernels::Device device) {
  if (train.precision().empty() || train.precision() == "fp32") return absl::OkStatus();
  if (train.precision() != "bf16") {
    return absl::InvalidArgumentError(
        absl::StrCat("train.precision: is \"", train.precision(), "\"; want \"fp32\" or \"bf16\""));
  }
  if (device.is_cpu()) {
    return absl::InvalidArgumentError(
        "train.precision = bf16 needs CUDA workers (--device=cuda:N); this worker runs on cpu");
  }
  return absl::UnimplementedError(
      "train.precision = bf16: the model does not keep bf16 copies of its parameters yet; use fp32");
}

}  // namespace

absl::Status WorkerJob::Build(const v1::Configure& configure, Job* job) {
  job->plan = configure.plan();
  job->spec = configure.job();
  // The device first: a worker that cannot run the job says why before any
  // rendezvous (UNAVAILABLE naming the cause; the daemon stays up).
  BATON_ASSIGN_OR_RETURN(const kernels::Device device, kernels::ParseDevice(options_.device));
  BATON_RETURN_IF_ERROR_CTX(kernels::CheckDeviceUsable(device), "--device=", options_.device);
  BATON_RETURN_IF_ERROR(CheckPrecision(job->spec.train(), device));
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
  const int stages = pp * v;
  if (plan.stages_size() != stages) return absl::InvalidArgumentError("plan stages do not match pp * virtual_stages");
  job->labels = {{"training_job", plan.job()},
                 {"stage", std::to_string(p)},
                 {"tp_rank", std::to_string(t)},
                 {"dp_rank", std::to_string(d)},
                 {"worker", options_.name}};

  // Rendezvous: every worker creates its groups in the same order (tp,
  // pipeline, dp, tie), so no two groups can wait on each other.
  job->store = std::make_unique<comm::CoordinatorStore>(stub_, plan.job(), plan.generation());
  auto make = [&](const std::string& group, int rank, int size) -> absl::StatusOr<std::unique_ptr<comm::Communicator>> {
    comm::CommunicatorSpec spec;
    spec.group = group;
    spec.generation = plan.generation();
    spec.rank = rank;
    spec.size = size;
    spec.hostname = options_.comm_host;
    spec.rendezvous_timeout = options_.rendezvous_timeout;
    spec.op_timeout = options_.op_timeout;
    spec.device = device.type == kernels::DeviceType::kCuda ? device.index : -1;  // stage CUDA memory
    auto c = comm::CreateCommunicator(*job->store, spec);
    if (!c.ok()) return WithContext(c.status(), absl::StrCat("rendezvous of group ", group));
    absl::MutexLock lock(&mu_);
    live_comms_.push_back(c->get());
    return c;
  };
  if (tp > 1) {
    BATON_ASSIGN_OR_RETURN(job->tp, make(absl::StrCat("tp-d", d, "-p", p), t, tp));
    job->timed_tp = std::make_unique<comm::TimedCommunicator>(job->tp.get());
  }
  if (pp > 1) {
    BATON_ASSIGN_OR_RETURN(job->pipeline, make(absl::StrCat("pp-d", d, "-t", t), p, pp));
  }
  if (dp > 1) {
    BATON_ASSIGN_OR_RETURN(job->dp, make(absl::StrCat("dp-p", p, "-t", t), d, dp));
  }
  const bool holds_first = p == 0, holds_last = (stages - 1) % pp == p;
  if (pp > 1 && !job->spec.model().has_synthetic() && (holds_first || holds_last)) {
    BATON_ASSIGN_OR_RETURN(job->tie, make(absl::StrCat("tie-d", d, "-t", t), holds_first ? 0 : 1, 2));
  }

  // Model chunks this rank holds: stages p, p + pp, p + 2pp, ...
  for (int c = p; c < stages; c += pp) {
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
    BATON_ASSIGN_OR_RETURN(job->chunks[c], GptStageModel::Create(config, job->spec.train().micro_batch_size(),
                                                                 job->timed_tp.get(),
                                                                 c == 0 || c == stages - 1 ? job->tie.get() : nullptr,
                                                                 AdamWFromTrainSpec(job->spec.train())));
  }
  if (!job->spec.model().has_synthetic()) {  // the synthetic cost model reads no data
    BATON_ASSIGN_OR_RETURN(job->data, data::MakeDataSource(job->spec));
  }

  ExecutorOptions eo;
  eo.num_stages = stages;
  eo.microbatches = job->spec.schedule().microbatches();
  eo.dp_rank = d;
  eo.dp_size = dp;
  eo.tokens_per_microbatch = static_cast<int64_t>(job->spec.train().micro_batch_size()) *
                             std::max(1, job->spec.model().seq_len());
  eo.op_timeout = options_.op_timeout;
  eo.clock_us = [agent = agent_] { return agent->CoordinatorNowMicros(); };
  std::map<int, StageModel*> chunks;
  for (auto& [c, m] : job->chunks) chunks[c] = m.get();
  const data::DataSource* data = job->data.get();
  job->executor = std::make_unique<StepExecutor>(
      configure.program(), eo, chunks,
      [data](int64_t step, int global_mb, MicrobatchData* out) {
        return data ? data->Fill(step, global_mb, 0, out) : absl::OkStatus();
      },
      job->pipeline.get(), job->timed_tp.get(), job->dp.get());
  return absl::OkStatus();
}

}  // namespace baton
