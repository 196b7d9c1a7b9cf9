#include "worker/executor.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "kernels/ops.h"
#include "worker/model/comm_buffer.h"

namespace baton {
namespace {

using v1::Action;

// The side message with a payload's post time uses the payload's tag plus
// this bit (pipeline tags are far below it; Gloo takes tags below 2^63).
constexpr uint64_t kStampTagBit = uint64_t{1} << 62;

bool IsComm(Action::Kind k) {
  return k == Action::SEND_F || k == Action::RECV_F || k == Action::SEND_B || k == Action::RECV_B;
}

// Stamp slots a program needs on the stream path: one per batch (a maximal
// run of communication actions) and one per receive.
int64_t StampSlots(const v1::Program& program) {
  int64_t slots = 0;
  bool in_batch = false;
  for (const Action& a : program.actions()) {
    const bool comm = IsComm(a.kind());
    if (comm && !in_batch) ++slots;
    if (a.kind() == Action::RECV_F || a.kind() == Action::RECV_B) ++slots;
    in_batch = comm;
  }
  return slots;
}

// Moves a microbatch's tokens and targets into pinned host memory of
// `device` (once per buffer: the data source refills them in place at later
// steps), so that the stage's copy of them waits for nothing on the host.
absl::Status PinData(kernels::Device device, MicrobatchData* data) {
  for (kernels::Tensor* t : {&data->tokens, &data->targets}) {
    if (!t->defined() || kernels::IsPinnedHost(*t)) continue;
    absl::StatusOr<kernels::Tensor> pinned = kernels::PinnedHostZeros(device, t->shape(), t->dtype());
    if (!pinned.ok()) return WithContext(pinned.status(), "pinning a microbatch's tokens and targets");
    std::memcpy(pinned->raw(), t->raw(), t->bytes());
    *t = std::move(*pinned);
  }
  return absl::OkStatus();
}

uint64_t Tag(bool forward, int stage, int mb, int num_stages, int microbatches) {
  return (static_cast<uint64_t>(forward ? 0 : 1) * num_stages + stage) * microbatches + mb;
}

const char* Name(Action::Kind k) {
  switch (k) {
    case Action::FORWARD: return "F";
    case Action::BACKWARD: return "B";
    case Action::BACKWARD_INPUT: return "I";
    case Action::BACKWARD_WEIGHT: return "W";
    case Action::SEND_F: return "SEND_F";
    case Action::RECV_F: return "RECV_F";
    case Action::SEND_B: return "SEND_B";
    case Action::RECV_B: return "RECV_B";
    case Action::REDUCE_GRADS: return "REDUCE_GRADS";
    case Action::OPTIMIZER_STEP: return "OPTIMIZER_STEP";
    default: return "?";
  }
}

}  // namespace

v1::Program ForwardOnlyProgram(const v1::Program& program) {
  v1::Program out = program;
  out.clear_actions();
  for (const Action& a : program.actions()) {
    if (a.kind() != Action::FORWARD && a.kind() != Action::SEND_F && a.kind() != Action::RECV_F) continue;
    Action* kept = out.add_actions();
    *kept = a;
    kept->set_overlap_with_next(false);
  }
  return out;
}

StepExecutor::StepExecutor(v1::Program program, ExecutorOptions options, std::map<int, StageModel*> chunks,
                           BatchFn batch, comm::Communicator* pipeline, comm::TimedCommunicator* tp,
                           comm::Communicator* dp, comm::TimedCommunicator* cp, comm::Communicator* edp,
                           comm::TimedCommunicator* ep)
    : program_(std::move(program)),
      options_(std::move(options)),
      chunks_(std::move(chunks)),
      batch_(std::move(batch)),
      pipeline_(pipeline),
      tp_(tp),
      dp_(dp),
      cp_(cp),
      edp_(edp),
      ep_(ep),
      dp_collectives_(dp != nullptr ? std::make_shared<comm::StreamCollectives>(*dp) : nullptr) {
  for (int i = 0; i < program_.actions_size(); ++i) {
    const Action& a = program_.actions(i);
    if (a.kind() == Action::BACKWARD || a.kind() == Action::BACKWARD_INPUT || a.kind() == Action::BACKWARD_WEIGHT) {
      last_backward_[a.stage()] = i;
    }
  }
}

StepExecutor::~StepExecutor() {
  if (comm_stream_ != nullptr) (void)comm_stream_->Synchronize();
  if (dp_stream_ != nullptr) (void)dp_stream_->Synchronize();
}

absl::Status StepExecutor::EnsureDpStream(kernels::Device device) {
  if (dp_stream_ != nullptr) return absl::OkStatus();
  absl::StatusOr<std::unique_ptr<kernels::Stream>> stream = kernels::Stream::Create(device);
  if (!stream.ok()) return WithContext(stream.status(), "creating the data-parallel stream");
  dp_stream_ = std::move(*stream);
  return absl::OkStatus();
}

absl::StatusOr<StepExecutor::Message*> StepExecutor::Buffer(std::map<Key, Message>& map, int stage, int mb) {
  auto chunk = chunks_.find(stage);
  if (chunk == chunks_.end()) return absl::InternalError(absl::StrCat("this rank does not hold stage ", stage));
  const int64_t n = chunk->second->activation_elements();
  const kernels::DType dtype = chunk->second->activation_dtype();
  const kernels::Device device = chunk->second->context().device;
  Message& m = map[{stage, mb}];
  auto fits = [&](const kernels::Tensor& t) {
    return t.defined() && t.numel() == n && t.dtype() == dtype && t.device() == device;
  };
  if (fits(m.payload)) return &m;
  for (size_t i = 0; i < pool_.size(); ++i) {
    if (fits(pool_[i])) {
      m.payload = std::move(pool_[i]);
      pool_.erase(pool_.begin() + static_cast<std::ptrdiff_t>(i));
      return &m;
    }
  }
  BATON_ASSIGN_OR_RETURN(m.payload, kernels::ZerosOn(device, {n}, dtype));
  return &m;
}

absl::Status StepExecutor::ReleaseMessages(bool chunks_idle) {
  const bool any = !filled_.empty() || !act_out_.empty() || !act_in_.empty() || !grad_out_.empty() ||
                   !grad_in_.empty();
  if (!any) return absl::OkStatus();
  absl::Status status;
  if (!chunks_idle) {
    for (auto& [stage, model] : chunks_) {
      absl::Status s = model->Synchronize();
      if (status.ok() && !s.ok()) status = WithContext(s, absl::StrCat("synchronising stage ", stage));
    }
    // Its ops end within the op timeout (after a failure it posts nothing).
    if (comm_stream_ != nullptr) {
      absl::Status s = comm_stream_->Synchronize();
      if (status.ok() && !s.ok()) status = WithContext(s, "synchronising the communication stream");
    }
  }
  if (!status.ok()) return status;  // the device may still use the buffers: keep them out of the pool
  filled_.clear();  // data_ keeps its buffers: the next step refills them in place
  for (auto* map : {&act_out_, &act_in_, &grad_out_, &grad_in_}) {
    for (auto& [key, m] : *map) pool_.push_back(std::move(m.payload));
    map->clear();
  }
  return absl::OkStatus();
}

void StepExecutor::Record(const std::string& name, const char* cat, absl::Time start, absl::Time end) {
  if (!trace_) return;
  v1::TraceEvent& e = events_.emplace_back();
  e.set_name(name);
  e.set_cat(cat);
  // Local wall time -> coordinator clock: shift by the current offset.
  const int64_t offset = options_.clock_us() - absl::ToUnixMicros(absl::Now());
  e.set_start_us(absl::ToUnixMicros(start) + offset);
  e.set_duration_us(absl::ToInt64Microseconds(end - start));
}

absl::StatusOr<kernels::Event*> StepExecutor::RecordEvent(kernels::Stream* stream, int key) {
  const std::string owner = key == kCommStream ? "the communication stream"
                            : key == kDpStream  ? "the data-parallel stream"
                                                : absl::StrCat("stage ", key);
  ChunkEvents& ce = chunk_events_[key];
  if (ce.used == ce.pool.size()) {
    absl::StatusOr<std::unique_ptr<kernels::Event>> e = kernels::Event::Create(stream->device());
    if (!e.ok()) return WithContext(e.status(), absl::StrCat("creating an event for ", owner));
    ce.pool.push_back(std::move(*e));
  }
  kernels::Event* e = ce.pool[ce.used++].get();
  BATON_RETURN_IF_ERROR_CTX(e->Record(*stream), "recording an event on ", owner);
  return e;
}

absl::Status StepExecutor::StartSpans() {
  spans_.clear();
  dp_spans_.clear();
  comm_spans_.clear();
  stamps_used_ = 0;
  for (auto& [stage, model] : chunks_) {
    kernels::Stream* stream = model->context().stream;
    if (stream == nullptr) continue;
    if (comm_stream_ == nullptr && pipeline_ != nullptr) {
      absl::StatusOr<std::unique_ptr<kernels::Stream>> cs = kernels::Stream::Create(stream->device());
      if (!cs.ok()) return WithContext(cs.status(), "creating the communication stream");
      const int64_t slots = std::max<int64_t>(1, StampSlots(program_));
      absl::StatusOr<kernels::Tensor> stamps = kernels::ZerosOn(stream->device(), {slots}, kernels::DType::kInt64);
      if (!stamps.ok()) return WithContext(stamps.status(), "allocating the pipeline's post-time stamps");
      stamps_ = std::move(*stamps);
      absl::StatusOr<kernels::Tensor> host = kernels::PinnedHostZeros(stream->device(), {slots}, kernels::DType::kInt64);
      if (!host.ok()) return WithContext(host.status(), "allocating the host copy of the post-time stamps");
      stamps_host_ = std::move(*host);
      comm_stream_ = std::move(*cs);
    }
    ChunkEvents& ce = chunk_events_[stage];
    ce.used = 0;
    BATON_ASSIGN_OR_RETURN(ce.anchor, RecordEvent(stream, stage));
    ce.anchor_host = absl::Now();
  }
  chunk_events_[kDpStream].used = 0;  // its spans of the last step (or Commit) are resolved
  if (comm_stream_ != nullptr) {
    ChunkEvents& ce = chunk_events_[kCommStream];
    ce.used = 0;
    BATON_ASSIGN_OR_RETURN(ce.anchor, RecordEvent(comm_stream_.get(), kCommStream));
    ce.anchor_host = absl::Now();
  }
  return absl::OkStatus();
}

absl::Status StepExecutor::BeginSpan(StageModel* model, int stage) {
  BATON_ASSIGN_OR_RETURN(kernels::Event * start, RecordEvent(model->context().stream, stage));
  Span& span = spans_.emplace_back();
  span.stage = stage;
  span.start = start;
  return absl::OkStatus();
}

absl::Status StepExecutor::EndSpan(StageModel* model, int stage, std::string name, double tp_wait) {
  BATON_ASSIGN_OR_RETURN(kernels::Event * end, RecordEvent(model->context().stream, stage));
  Span& span = spans_.back();
  span.end = end;
  span.name = std::move(name);
  span.tp_wait = tp_wait;
  return absl::OkStatus();
}

absl::Status StepExecutor::ResolveSpans() {
  // DP time is the exposed part of each reduction (DESIGN.md section 7): a
  // DP all-reduce started early, while other chunks of the rank compute, is
  // hidden where they overlap.
  for (const auto& [start, end] : dp_spans_) {
    BATON_ASSIGN_OR_RETURN(const double total, end->SecondsSince(*start));
    std::vector<std::pair<double, double>> hidden;  // compute inside [0, total] after `start`
    for (const Span& span : spans_) {
      if (span.end == nullptr) continue;
      BATON_ASSIGN_OR_RETURN(const double a, span.start->SecondsSince(*start));
      BATON_ASSIGN_OR_RETURN(const double b, span.end->SecondsSince(*start));
      if (std::min(total, b) > std::max(0.0, a)) hidden.emplace_back(std::max(0.0, a), std::min(total, b));
    }
    std::sort(hidden.begin(), hidden.end());
    double covered = 0, reach = 0;
    for (const auto& [lo, hi] : hidden) {
      const double from = std::max(lo, reach);
      if (hi > from) covered += hi - from;
      reach = std::max(reach, hi);
    }
    dp_comm_ += std::max(0.0, total - covered);
  }
  dp_spans_.clear();
  for (const Span& span : spans_) {
    if (span.end == nullptr) continue;  // its action failed
    BATON_ASSIGN_OR_RETURN(const double seconds, span.end->SecondsSince(*span.start));
    compute_ += std::max(0.0, seconds - span.tp_wait);
    if (!trace_) continue;
    // The anchor ran when it was recorded (the stream was idle: the previous
    // step or Commit ended with a wait), so its host time places the span.
    const ChunkEvents& ce = chunk_events_.at(span.stage);
    absl::StatusOr<double> offset = span.start->SecondsSince(*ce.anchor);
    const absl::Time start = ce.anchor_host + absl::Seconds(offset.ok() ? std::max(0.0, *offset) : 0.0);
    Record(span.name, "compute", start, start + absl::Seconds(seconds));
  }
  spans_.clear();
  return absl::OkStatus();
}

absl::StatusOr<v1::StepReport> StepExecutor::RunStep(int64_t step, bool trace) {
  step_start_ = absl::Now();
  compute_ = p2p_ = tp_comm_ = dp_comm_ = cp_comm_ = ep_comm_ = 0;
  moe_ = MoeStats();  // a failed step reports none
  cp_bytes_at_start_ = cp_ != nullptr ? cp_->p2p_bytes_sent() : 0;
  ep_bytes_at_start_ = ep_ != nullptr ? ep_->collective_bytes_sent() : 0;
  edp_bytes_at_start_ = edp_ != nullptr ? edp_->collective_bytes_sent() : 0;
  tp_waited_at_start_ = tp_ != nullptr ? tp_->waited_seconds() : 0;
  tp_gather_at_start_ = tp_ != nullptr ? tp_->all_gather_seconds() : 0;
  tp_scatter_at_start_ = tp_ != nullptr ? tp_->reduce_scatter_seconds() : 0;
  tp_bytes_at_start_ = tp_ != nullptr ? tp_->collective_bytes_sent() : 0;
  dp_bytes_at_start_ = dp_ != nullptr ? dp_->collective_bytes_sent() : 0;
  if (tp_ != nullptr) {
    // What a failed step's collectives left (they may never have run).
    if (std::shared_ptr<comm::StreamCollectives> coll = comm::StreamCollectives::Find(*tp_)) coll->ForgetStreamSeconds();
  }
  trace_ = trace;
  events_.clear();
  BATON_RETURN_IF_ERROR(ReleaseMessages(false));  // after a failed step (no wait otherwise)
  comm_status_->Reset();  // the communication stream is idle: a failed step was waited for above
  dp_status_->Reset();    // so is the data-parallel stream (the chunks waited for its end events)
  BATON_RETURN_IF_ERROR(StartSpans());
  for (auto& [stage, model] : chunks_) {
    model->DropInFlight();  // what a failed step left, when no Discard came
    model->ZeroGrad();
  }

  const auto& actions = program_.actions();
  dp_started_.clear();
  early_sends_.clear();  // a failed step's (its communicator was aborted)
  for (int i = 0; i < actions.size();) {
    const Action& a = actions[i];
    if (IsComm(a.kind())) {
      std::vector<const Action*> batch;
      while (i < actions.size() && IsComm(actions[i].kind())) batch.push_back(&actions[i++]);
      BATON_RETURN_IF_ERROR(RunCommBatch(batch));
      continue;
    }
    ++i;
    if (a.kind() == Action::REDUCE_GRADS) {
      BATON_RETURN_IF_ERROR(ReduceGrads());
    } else if (a.kind() != Action::OPTIMIZER_STEP) {  // the optimizer waits for Commit
      BATON_RETURN_IF_ERROR_CTX(RunCompute(a, step),
                                absl::StrCat(Name(a.kind()), "(stage ", a.stage(), ", mb ", a.microbatch(), ")"));
      // The forward half of an overlapped pair: its activations go out now,
      // moving while the backward half computes (host path; Gloo matches
      // messages by tag, so posting one send early changes no matching).
      if (a.overlap_with_next() && pipeline_ != nullptr) BATON_RETURN_IF_ERROR(PostEarlySend(i - 1));
      // Evaluation: no backward reads the activations (the output went to
      // the executor's message buffer; on a stream, later work reusing the
      // memory is ordered after this forward).
      if (options_.forward_only) chunks_.at(a.stage())->DropInFlight();
      // The chunk's gradients are final: its DP all-reduce (ZeRO-1: its
      // reduce-scatter) may start now, overlapping the rank's other chunks'
      // backward (the chunk's stream waits for it at REDUCE_GRADS). Not for
      // the chunks of the tied embedding, whose sum comes first.
      auto last = last_backward_.find(a.stage());
      if (dp_ != nullptr && last != last_backward_.end() && last->second == i - 1 && a.stage() != 0 &&
          a.stage() != options_.num_stages - 1) {
        BATON_ASSIGN_OR_RETURN(dp_started_[a.stage()], StartDpReduce(a.stage(), chunks_.at(a.stage())));
      }
    }
  }
  if (!options_.forward_only && std::none_of(actions.begin(), actions.end(), [](const Action& a) {
        return a.kind() == Action::REDUCE_GRADS;
      })) {
    BATON_RETURN_IF_ERROR(ReduceGrads());
  }

  if (!comm_spans_.empty()) {
    // Every chunk's stream waits for the communication stream's last batch,
    // so reading the step's results below waits for it too.
    BATON_ASSIGN_OR_RETURN(kernels::Event * comm_end, RecordEvent(comm_stream_.get(), kCommStream));
    for (auto& [stage, model] : chunks_) {
      BATON_RETURN_IF_ERROR_CTX(comm_end->StreamWait(*model->context().stream), "stage ", stage,
                                " waiting for the communication stream");
    }
  }

  v1::StepReport report;
  report.set_step(step);
  model::StepScore loss;
  double sq = 0;
  // The chunks that split the read enqueue it; then the host waits once for
  // all of them: the first one's stream waits for the others' reads.
  std::vector<int> enqueued;
  for (auto& [stage, model] : chunks_) {
    if (model->EnqueueStepResults()) enqueued.push_back(stage);
  }
  if (!enqueued.empty()) {
    StageModel* first = chunks_.at(enqueued.front());
    for (size_t i = 1; i < enqueued.size(); ++i) {
      StageModel* other = chunks_.at(enqueued[i]);
      BATON_ASSIGN_OR_RETURN(kernels::Event * read, RecordEvent(other->context().stream, enqueued[i]));
      BATON_RETURN_IF_ERROR_CTX(read->StreamWait(*first->context().stream), "stage ", enqueued.front(),
                                " waiting for stage ", enqueued[i], "'s results");
    }
    // The batches' post-time stamps come back with the results (the stream
    // waited for the communication stream above): no wait of their own. (On
    // CUDA the copy into pageable host memory returns once the stream got
    // there, which is the wait below.)
    if (!comm_spans_.empty()) ReadStamps(first->context().stream);
    std::string stages;
    for (int stage : enqueued) absl::StrAppend(&stages, stages.empty() ? "" : ", ", stage);
    BATON_RETURN_IF_ERROR_CTX(first->Synchronize(), "reading the step's loss and gradient norm of stage ", stages);
  } else if (!comm_spans_.empty()) {
    ReadStamps(chunks_.begin()->second->context().stream);  // waited for by its TakeStepResults below
  }
  for (auto& [stage, model] : chunks_) {
    // Afterwards the chunk is idle (a chunk that did not split its read
    // waits for its own stream here).
    model::StepScore s;
    double chunk_sq = 0;
    BATON_RETURN_IF_ERROR_CTX(model->TakeStepResults(&s, &chunk_sq), "stage ", stage);
    loss.loss_sum += s.loss_sum;
    loss.tokens += s.tokens;
    loss.correct += s.correct;
    sq += chunk_sq;
    if (stage == options_.num_stages - 1) report.set_has_loss(true);
  }
  // MoE counts and load-balancing loss, summed over the chunks: read now,
  // while every chunk is idle (the loss's read waits for nothing), and kept
  // for the StepDone of this step, whether committed or discarded.
  if (!options_.forward_only) {
    for (auto& [stage, model] : chunks_) AddMoeStats(model->ReadMoeStats());
  }
  // The data-parallel stream's work is done too (each chunk waited for it).
  if (absl::Status dp = dp_status_->status(); !dp.ok()) {
    dp_status_->Reset();
    return dp;
  }
  BATON_RETURN_IF_ERROR(ResolveComm());   // the communication stream's work is done now (uses spans_)
  BATON_RETURN_IF_ERROR(ResolveSpans());  // every chunk's work is done now
  if (tp_ != nullptr) {
    // TP collectives run on the chunks' streams as host functions may wait
    // outside the action that enqueued them: the step's whole TP wait is TP
    // comm, and not compute (the device spans include it).
    double outside = tp_->waited_seconds() - tp_waited_at_start_ - tp_comm_;
    // Over NCCL nothing waits on the host: the collectives' own events time
    // them (every chunk's stream was waited for above).
    if (std::shared_ptr<comm::StreamCollectives> coll = comm::StreamCollectives::Find(*tp_); coll != nullptr) {
      BATON_ASSIGN_OR_RETURN(const double on_streams, coll->TakeStreamSeconds());
      outside = std::max(0.0, outside) + on_streams;
    }
    if (outside > 0) {
      tp_comm_ += outside;
      compute_ = std::max(0.0, compute_ - outside);
    }
  }
  report.set_grad_sq_norm(sq);
  if (report.has_loss()) {
    report.set_loss(loss.tokens > 0 ? loss.loss_sum / loss.tokens : 0.0);
    report.set_correct(loss.correct);
    report.set_predicted(loss.tokens);
  }
  report.set_tokens(options_.tokens_per_microbatch * options_.microbatches);
  report.set_finite(std::isfinite(sq) && std::isfinite(report.loss()));
  // Activations, data and messages of this step are no longer needed, and
  // every chunk finished its work when its results were read.
  BATON_RETURN_IF_ERROR(ReleaseMessages(true));
  return report;
}

absl::Status StepExecutor::RunCompute(const Action& a, int64_t step) {
  auto it = chunks_.find(a.stage());
  if (it == chunks_.end()) return absl::InternalError("this rank does not hold that stage");
  StageModel* model = it->second;
  const int s = a.stage(), mb = a.microbatch();
  const bool first = s == 0, last = s == options_.num_stages - 1;
  const bool on_stream = model->context().stream != nullptr;
  const absl::Time start = absl::Now();
  const double tp_before = tp_ ? tp_->waited_seconds() : 0;
  const double cp_before = cp_ ? cp_->waited_seconds() : 0;
  const double ep_before = ep_ ? ep_->waited_seconds() : 0;
  if (on_stream) BATON_RETURN_IF_ERROR(BeginSpan(model, s));

  absl::Status status;
  if (a.kind() == Action::FORWARD) {
    MicrobatchData* data = nullptr;
    if (first || last) {
      data = &data_[mb];
      if (filled_.insert(mb).second) {
        BATON_RETURN_IF_ERROR(batch_(step, options_.dp_rank * options_.microbatches + mb, data));
        if (on_stream) BATON_RETURN_IF_ERROR(PinData(model->context().device, data));
      }
    }
    kernels::Tensor input, output;
    if (!first) {
      // The previous stage is on this rank at pp == 1 and at the tip of a V:
      // its output is handed over without the network.
      auto local = act_out_.find({s - 1, mb});
      if (local != act_out_.end()) {
        BATON_RETURN_IF_ERROR(AwaitLocalProducer(s - 1, model));
        input = local->second.payload;
      } else {
        BATON_ASSIGN_OR_RETURN(Message * m, Buffer(act_in_, s, mb));
        input = m->payload;
      }
    }
    if (!last) {
      BATON_ASSIGN_OR_RETURN(Message * m, Buffer(act_out_, s, mb));
      output = m->payload;
    }
    // The data stays unchanged in data_ until the step ends: a device stage
    // may still be copying from it.
    status = model->Forward(mb, data ? *data : MicrobatchData(), input, output);
  } else if (a.kind() == Action::BACKWARD || a.kind() == Action::BACKWARD_INPUT) {
    kernels::Tensor grad_output, grad_input;
    if (!last) {
      auto local = grad_out_.find({s + 1, mb});
      if (local != grad_out_.end()) {
        BATON_RETURN_IF_ERROR(AwaitLocalProducer(s + 1, model));
        grad_output = local->second.payload;
      } else {
        BATON_ASSIGN_OR_RETURN(Message * m, Buffer(grad_in_, s, mb));
        grad_output = m->payload;
      }
    }
    if (!first) {
      BATON_ASSIGN_OR_RETURN(Message * m, Buffer(grad_out_, s, mb));
      grad_input = m->payload;
    }
    status = model->BackwardInput(mb, grad_output, grad_input);
    if (status.ok() && a.kind() == Action::BACKWARD) status = model->BackwardWeight(mb);
  } else if (a.kind() == Action::BACKWARD_WEIGHT) {
    status = model->BackwardWeight(mb);
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unexpected action kind ", a.kind()));
  }
  const absl::Time end = absl::Now();
  const double tp_wait = tp_ ? tp_->waited_seconds() - tp_before : 0;
  const double cp_wait = cp_ ? cp_->waited_seconds() - cp_before : 0;
  const double ep_wait = ep_ ? ep_->waited_seconds() - ep_before : 0;
  tp_comm_ += tp_wait;
  cp_comm_ += cp_wait;
  ep_comm_ += ep_wait;
  if (on_stream) {
    if (status.ok()) {
      status = EndSpan(model, s, absl::StrCat(Name(a.kind()), s, " mb", mb), tp_wait + cp_wait + ep_wait);
    }
    return status;
  }
  compute_ += absl::ToDoubleSeconds(end - start) - tp_wait - cp_wait - ep_wait;
  Record(absl::StrCat(Name(a.kind()), s, " mb", mb), "compute", start, end);
  return status;
}

absl::StatusOr<StepExecutor::CommOp> StepExecutor::MakeCommOp(const Action* a) {
  const int s = a->stage(), mb = a->microbatch();
  auto chunk = chunks_.find(s);
  if (chunk == chunks_.end()) return absl::InternalError(absl::StrCat("this rank does not hold stage ", s));
  absl::StatusOr<Message*> m;
  uint64_t tag = 0;
  switch (a->kind()) {
    case Action::SEND_F:  // activations of s, consumed by s + 1
      m = Buffer(act_out_, s, mb);
      tag = Tag(true, s + 1, mb, options_.num_stages, options_.microbatches);
      break;
    case Action::RECV_F:
      m = Buffer(act_in_, s, mb);
      tag = Tag(true, s, mb, options_.num_stages, options_.microbatches);
      break;
    case Action::SEND_B:  // input gradient of s, consumed by s - 1
      m = Buffer(grad_out_, s, mb);
      tag = Tag(false, s - 1, mb, options_.num_stages, options_.microbatches);
      break;
    default:  // RECV_B
      m = Buffer(grad_in_, s, mb);
      tag = Tag(false, s, mb, options_.num_stages, options_.microbatches);
      break;
  }
  if (!m.ok()) return m.status();
  const bool send = a->kind() == Action::SEND_F || a->kind() == Action::SEND_B;
  return CommOp{a, *m, tag, send, chunk->second};
}

absl::Status StepExecutor::AwaitLocalProducer(int producer, StageModel* consumer) {
  kernels::Stream* from = chunks_.at(producer)->context().stream;
  kernels::Stream* to = consumer->context().stream;
  if (from == nullptr || to == nullptr || from == to) return absl::OkStatus();
  // Covers the producing action: it was enqueued on `from` before now.
  BATON_ASSIGN_OR_RETURN(kernels::Event * produced, RecordEvent(from, producer));
  BATON_RETURN_IF_ERROR_CTX(produced->StreamWait(*to), "waiting for stage ", producer, "'s output on this rank");
  return absl::OkStatus();
}

absl::Status StepExecutor::RunCommBatch(const std::vector<const Action*>& batch) {
  if (pipeline_ == nullptr) return absl::InternalError("program sends or receives, but pp == 1");
  std::vector<CommOp> ops;
  // Stream-ordered when the communicator can carry the chunks' buffers and
  // the stamps from the communication stream: host functions over a host
  // communicator (the simulated device), one NCCL group over NCCL (CUDA).
  bool on_stream = comm_stream_ != nullptr && comm::CanEnqueueP2P(*pipeline_, model::CommBuffer(stamps_));
  for (const Action* a : batch) {
    BATON_ASSIGN_OR_RETURN(CommOp op, MakeCommOp(a));
    on_stream = on_stream && op.model->context().stream != nullptr &&
                comm::CanEnqueueP2P(*pipeline_, model::CommBuffer(op.message->payload));
    ops.push_back(op);
  }
  std::string name;
  for (const Action* a : batch) {
    absl::StrAppend(&name, name.empty() ? "" : " ", Name(a->kind()), a->stage(), ".", a->microbatch());
  }
  return on_stream ? EnqueueCommBatch(ops, name) : WaitCommBatch(ops, name);
}

namespace {

std::string OpName(const Action& a) {
  return absl::StrCat(Name(a.kind()), "(stage ", a.stage(), ", mb ", a.microbatch(), ") with pipeline rank ",
                      a.peer());
}

}  // namespace

absl::Status StepExecutor::EnqueueCommBatch(const std::vector<CommOp>& ops, const std::string& name) {
  // The batch starts after the actions that filled its send buffers.
  std::set<int> waited;
  for (const CommOp& op : ops) {
    if (!op.send || !waited.insert(op.action->stage()).second) continue;
    BATON_ASSIGN_OR_RETURN(kernels::Event * produced, RecordEvent(op.model->context().stream, op.action->stage()));
    BATON_RETURN_IF_ERROR_CTX(produced->StreamWait(*comm_stream_), "communication stream waiting for stage ",
                              op.action->stage());
  }
  CommSpan span;
  span.name = name;
  BATON_ASSIGN_OR_RETURN(span.start, RecordEvent(comm_stream_.get(), kCommStream));
  // The batch's post time, written on the communication stream just before
  // the batch by the device (its clock when the stream gets there, shifted
  // onto the coordinator clock) and sent after each payload of the batch.
  BATON_ASSIGN_OR_RETURN(const kernels::Tensor posted, StampSlot(&span.posted_slot));
  kernels::StampTime(kernels::ExecContext::On(comm_stream_.get()), posted,
                     options_.clock_us() - absl::ToUnixMicros(absl::Now()));
  std::vector<comm::P2POp> p2p;
  for (const CommOp& op : ops) {
    const std::string op_name = OpName(*op.action);
    kernels::Tensor stamp = posted;
    if (!op.send) {
      int64_t slot = 0;
      BATON_ASSIGN_OR_RETURN(stamp, StampSlot(&slot));
      span.received_slots.push_back(slot);
    }
    p2p.push_back({op.send, model::CommBuffer(op.message->payload), op.action->peer(), op.tag, op_name});
    p2p.push_back({op.send, model::CommBuffer(stamp), op.action->peer(), op.tag | kStampTagBit,
                   op_name + " (post time)"});
  }
  BATON_RETURN_IF_ERROR_CTX(comm::EnqueueP2P(*pipeline_, std::move(p2p), *comm_stream_, options_.op_timeout,
                                             comm_status_),
                            "enqueueing ", name);
  BATON_ASSIGN_OR_RETURN(span.end, RecordEvent(comm_stream_.get(), kCommStream));
  // The actions after the batch that read what it received start after it.
  waited.clear();
  for (const CommOp& op : ops) {
    if (op.send || !waited.insert(op.action->stage()).second) continue;
    BATON_RETURN_IF_ERROR_CTX(span.end->StreamWait(*op.model->context().stream), "stage ", op.action->stage(),
                              " waiting for ", name);
  }
  comm_spans_.push_back(std::move(span));
  return absl::OkStatus();
}

absl::StatusOr<kernels::Tensor> StepExecutor::StampSlot(int64_t* slot) {
  if (stamps_used_ >= stamps_.numel()) {
    return absl::InternalError(absl::StrCat("the program needs more than ", stamps_.numel(), " post-time stamps"));
  }
  *slot = stamps_used_++;
  return stamps_.Rows(*slot, *slot + 1);
}

void StepExecutor::ReadStamps(kernels::Stream* stream) {
  if (stamps_used_ == 0) return;
  kernels::Copy(kernels::ExecContext::On(stream), stamps_host_.Rows(0, stamps_used_), stamps_.Rows(0, stamps_used_));
}

absl::Status StepExecutor::ResolveComm() {
  BATON_RETURN_IF_ERROR_CTX(comm_status_->status(), "pipeline communication");
  if (comm_spans_.empty()) return absl::OkStatus();
  // Everything on one timeline: seconds after the communication stream's
  // anchor (events of one device compare across its streams).
  const ChunkEvents& ce = chunk_events_.at(kCommStream);
  using Interval = std::pair<double, double>;
  auto merge = [](std::vector<Interval> v) {
    std::sort(v.begin(), v.end());
    std::vector<Interval> out;
    for (const Interval& i : v) {
      if (i.second <= i.first) continue;
      if (!out.empty() && i.first <= out.back().second) {
        out.back().second = std::max(out.back().second, i.second);
      } else {
        out.push_back(i);
      }
    }
    return out;
  };
  std::vector<Interval> compute, moving;
  for (const Span& span : spans_) {
    if (span.end == nullptr) continue;
    BATON_ASSIGN_OR_RETURN(const double a, span.start->SecondsSince(*ce.anchor));
    BATON_ASSIGN_OR_RETURN(const double b, span.end->SecondsSince(*ce.anchor));
    compute.emplace_back(a, b);
  }
  for (const CommSpan& span : comm_spans_) {
    BATON_ASSIGN_OR_RETURN(const double offset, span.start->SecondsSince(*ce.anchor));
    BATON_ASSIGN_OR_RETURN(const double total, span.end->SecondsSince(*span.start));
    const int64_t* stamps = stamps_host_.data<int64_t>();  // copied with the step's results
    const int64_t posted_us = stamps[span.posted_slot];
    int64_t ready_us = posted_us;  // when the last awaited peer posted its send
    for (int64_t slot : span.received_slots) ready_us = std::max(ready_us, stamps[slot]);
    const double busy = std::max(0.0, total);
    // Before the peer posted: bubble; after: data moving.
    const double waiting = std::clamp((ready_us - posted_us) * 1e-6, 0.0, busy);
    moving.emplace_back(offset + waiting, offset + busy);
    if (!trace_) continue;
    const absl::Time start = ce.anchor_host + absl::Seconds(std::max(0.0, offset));
    const absl::Time data_ready = start + absl::Seconds(waiting);
    if (waiting > 0) Record("wait " + span.name, "bubble", start, data_ready);
    Record(span.name, "p2p", data_ready, start + absl::Seconds(busy));
  }
  // Comm is the exposed part (DESIGN.md section 7): data moving while no
  // chunk of this rank computes. A send that overlaps the next action is
  // hidden; the rest of the step is bubble (wall - compute - comm).
  compute = merge(std::move(compute));
  for (const Interval& m : merge(std::move(moving))) {
    double exposed = m.second - m.first;
    for (const Interval& c : compute) {
      exposed -= std::max(0.0, std::min(m.second, c.second) - std::max(m.first, c.first));
    }
    p2p_ += std::max(0.0, exposed);
  }
  comm_spans_.clear();
  return absl::OkStatus();
}

absl::Status StepExecutor::PostEarlySend(int pair) {
  const auto& actions = program_.actions();
  const Action& f = actions[pair];
  // The batch right after the pair's backward half.
  for (int i = pair + 2; i < actions.size() && IsComm(actions[i].kind()); ++i) {
    const Action& a = actions[i];
    if (a.kind() != Action::SEND_F || a.stage() != f.stage() || a.microbatch() != f.microbatch()) continue;
    BATON_ASSIGN_OR_RETURN(const CommOp op, MakeCommOp(&a));
    if (op.model->context().stream != nullptr) return absl::OkStatus();  // stream-ordered: the batch as it is
    BATON_RETURN_IF_ERROR_CTX(op.model->Synchronize(), "stage ", a.stage(), " before sending");
    op.message->sent_us = options_.clock_us();
    const comm::Buffer stamp{&op.message->sent_us, 1, comm::DType::kInt64, -1};
    early_sends_[&a] = {pipeline_->Send(model::CommBuffer(op.message->payload), a.peer(), op.tag),
                        pipeline_->Send(stamp, a.peer(), op.tag | kStampTagBit)};
    return absl::OkStatus();
  }
  return absl::OkStatus();
}

absl::Status StepExecutor::WaitCommBatch(const std::vector<CommOp>& ops, const std::string& name) {
  struct Pending {
    std::shared_ptr<comm::Work> work;
    Message* recv = nullptr;  // set on the side message of a receive
    const Action* action;
  };
  // Sent data must be complete on the device before the communicator reads
  // it: one wait per sending chunk of the batch.
  std::set<int> sending;
  for (const CommOp& op : ops) {
    if (!op.send || !sending.insert(op.action->stage()).second) continue;
    BATON_RETURN_IF_ERROR_CTX(op.model->Synchronize(), "stage ", op.action->stage(), " before sending");
  }
  // Comm time starts here: the wait above was for compute, counted as such.
  const absl::Time start = absl::Now();
  const int64_t posted_us = options_.clock_us();
  std::vector<Pending> pending;
  for (const CommOp& op : ops) {
    Message* m = op.message;
    const Action* a = op.action;
    const comm::Buffer payload = model::CommBuffer(m->payload);
    const comm::Buffer stamp{&m->sent_us, 1, comm::DType::kInt64, -1};
    if (auto early = early_sends_.find(a); early != early_sends_.end()) {
      // Posted while the overlapped pair's backward ran (PostEarlySend).
      pending.push_back({early->second.first, nullptr, a});
      pending.push_back({early->second.second, nullptr, a});
      early_sends_.erase(early);
      continue;
    }
    if (op.send) {
      m->sent_us = posted_us;
      pending.push_back({pipeline_->Send(payload, a->peer(), op.tag), nullptr, a});
      pending.push_back({pipeline_->Send(stamp, a->peer(), op.tag | kStampTagBit), nullptr, a});
    } else {
      pending.push_back({pipeline_->Recv(payload, a->peer(), op.tag), nullptr, a});
      pending.push_back({pipeline_->Recv(stamp, a->peer(), op.tag | kStampTagBit), m, a});
    }
  }
  int64_t ready_us = posted_us;  // when the last awaited peer posted its send
  for (Pending& p : pending) {
    absl::Status s = p.work->Wait(options_.op_timeout);
    if (!s.ok()) return WithContext(s, OpName(*p.action));
    if (p.recv != nullptr) ready_us = std::max(ready_us, p.recv->sent_us);
  }
  const absl::Time end = absl::Now();
  const double total = absl::ToDoubleSeconds(end - start);
  const double waiting = std::clamp((ready_us - posted_us) * 1e-6, 0.0, total);
  p2p_ += total - waiting;  // the rest is bubble: wall - compute - comm
  if (trace_) {
    const absl::Time data_ready = start + absl::Seconds(waiting);
    if (waiting > 0) Record("wait " + name, "bubble", start, data_ready);
    Record(name, "p2p", data_ready, end);
  }
  return absl::OkStatus();
}

absl::StatusOr<kernels::Event*> StepExecutor::StartDpReduce(int stage, StageModel* model) {
  kernels::Stream* chunk_stream = model->context().stream;
  // Expert parallelism's two sums (dense over dp, experts over edp) run in
  // ReduceGrads, after the chunk's stream.
  if (model->expert_elements() > 0) return nullptr;
  // ZeRO-1: the padded gradients reduce-scattered into the shard's.
  const DpShardBuffers shard = model->DpShard();
  const comm::Buffer grads = model::CommBuffer(shard.sharded() ? shard.padded_grads : model->Gradients());
  const comm::Buffer shard_grads = shard.sharded() ? model::CommBuffer(shard.shard_grads) : comm::Buffer();
  if (chunk_stream == nullptr || !dp_collectives_->CanEnqueue(grads) ||
      (shard.sharded() && !dp_collectives_->CanEnqueue(shard_grads))) {
    return nullptr;
  }
  BATON_RETURN_IF_ERROR(EnsureDpStream(chunk_stream->device()));
  BATON_ASSIGN_OR_RETURN(kernels::Event * grads_ready, RecordEvent(chunk_stream, stage));
  BATON_RETURN_IF_ERROR_CTX(grads_ready->StreamWait(*dp_stream_), "data-parallel stream waiting for stage ", stage);
  BATON_ASSIGN_OR_RETURN(kernels::Event * before, RecordEvent(dp_stream_.get(), kDpStream));
  if (shard.sharded()) {
    BATON_RETURN_IF_ERROR(dp_collectives_->ReduceScatterSum(
        grads, shard_grads, absl::StrCat("data-parallel gradient reduce-scatter of stage ", stage), *dp_stream_,
        options_.op_timeout, dp_status_));
  } else {
    BATON_RETURN_IF_ERROR(dp_collectives_->AllReduceSum(
        grads, absl::StrCat("data-parallel gradient all-reduce of stage ", stage), *dp_stream_, options_.op_timeout,
        dp_status_));
  }
  BATON_ASSIGN_OR_RETURN(kernels::Event * after, RecordEvent(dp_stream_.get(), kDpStream));
  dp_spans_.push_back({before, after});
  return after;
}

absl::Status StepExecutor::ReduceGrads() {
  const absl::Time start = absl::Now();
  absl::Duration waited_for_compute;  // and the tied sums timed by events
  // The tied embedding's two copies (first and last chunk) must stay
  // bitwise equal. A DP reduction's summation order depends on where an
  // element sits in the buffer (a ring's segments), and the two chunks' flat
  // buffers differ, so with dp > 2 the copies would round apart. So the
  // copies are summed after the DP reduction, as Megatron does: both ends
  // then add the same two replica-identical values. A ZeRO-sharded chunk
  // keeps only its shard of the reduced gradients; its copies are summed
  // first and the tied gradient then reduced on its own (same size on both
  // ends, so the same order), see below.
  auto sum_tied = [&](int stage, StageModel* model) -> absl::Status {
    kernels::Stream* stream = pipeline_ != nullptr ? model->context().stream : nullptr;
    // The wait for the tie's other holder (its last backward) is bubble, not
    // dp: AwaitTiedPeer, outside the dp span, then the sum itself.
    if (stream != nullptr) {
      // The sum may run on the chunk's stream (GptStageModel on the
      // simulated device): an event pair times it as dp.
      const absl::Time tie_start = absl::Now();
      BATON_RETURN_IF_ERROR_CTX(model->AwaitTiedPeer(), "tied embedding gradient sum");
      BATON_ASSIGN_OR_RETURN(kernels::Event * before, RecordEvent(stream, stage));
      BATON_RETURN_IF_ERROR_CTX(model->SyncTiedGradients(), "tied embedding gradient sum");
      BATON_ASSIGN_OR_RETURN(kernels::Event * after, RecordEvent(stream, stage));
      dp_spans_.push_back({before, after});
      waited_for_compute += absl::Now() - tie_start;
    } else {
      const absl::Time wait_start = absl::Now();
      BATON_RETURN_IF_ERROR_CTX(model->AwaitTiedPeer(), "tied embedding gradient sum");
      const absl::Time arrived = absl::Now();
      waited_for_compute += arrived - wait_start;
      if (arrived - wait_start >= absl::Microseconds(1)) {  // a chunk without the tie returns at once
        Record("wait for the tied embedding's peer", "bubble", wait_start, arrived);
      }
      BATON_RETURN_IF_ERROR_CTX(model->SyncTiedGradients(), "tied embedding gradient sum");
    }
    return absl::OkStatus();
  };
  // Before a collective on the data-parallel communicator from the host:
  // another chunk's reduction started on the data-parallel stream must be
  // done, so the group's collectives run one at a time, in the same order on
  // every rank (a host wait, only where an MoE chunk meets such a chunk).
  auto await_dp_stream = [&]() -> absl::Status {
    if (dp_stream_ == nullptr || dp_started_.empty()) return absl::OkStatus();
    const absl::Time wait_start = absl::Now();
    absl::Status s = dp_stream_->Synchronize();
    waited_for_compute += absl::Now() - wait_start;
    return WithContext(s, "the data-parallel stream");
  };
  for (auto& [stage, model] : chunks_) {
    const DpShardBuffers shard = model->DpShard();
    if (dp_ == nullptr || shard.sharded()) BATON_RETURN_IF_ERROR(sum_tied(stage, model));
    if (dp_ == nullptr) continue;
    if (const kernels::Tensor tied = model->TiedGradient(); shard.sharded() && tied.defined()) {
      // ZeRO: the summed tied gradient all-reduced alone, then left on DP
      // rank 0 only, so the reduce-scatter below adds zeros to it (exact).
      // On the chunk's stream where it can sum there (no host wait).
      const std::string what = absl::StrCat("data-parallel all-reduce of the tied embedding gradient of stage ", stage);
      const comm::Buffer buf = model::CommBuffer(tied);
      if (kernels::Stream* stream = model->context().stream; stream != nullptr && dp_collectives_->CanEnqueue(buf)) {
        // dp_collectives_ orders it after the reductions started on the
        // data-parallel stream.
        BATON_RETURN_IF_ERROR(dp_collectives_->AllReduceSum(buf, what, *stream, options_.op_timeout, dp_status_));
      } else {
        BATON_RETURN_IF_ERROR(await_dp_stream());
        const absl::Time wait_start = absl::Now();
        BATON_RETURN_IF_ERROR_CTX(model->Synchronize(), "stage ", stage, " before the tied embedding's all-reduce");
        waited_for_compute += absl::Now() - wait_start;
        BATON_RETURN_IF_ERROR_CTX(dp_->AllReduceSum(buf)->Wait(options_.op_timeout), what);
      }
      if (dp_->rank() != 0) kernels::FillZero(model->context(), tied);
    }
    auto started = dp_started_.find(stage);
    kernels::Event* reduced = started != dp_started_.end() ? started->second : nullptr;
    if (reduced == nullptr) {
      const absl::Time enqueue_start = absl::Now();
      BATON_ASSIGN_OR_RETURN(reduced, StartDpReduce(stage, model));
      waited_for_compute += absl::Now() - enqueue_start;  // timed by its events
    }
    if (shard.sharded() && reduced != nullptr) {
      // ZeRO-1 on the DP stream: this rank keeps the sum of its shard only.
      BATON_RETURN_IF_ERROR_CTX(reduced->StreamWait(*model->context().stream), "stage ", stage,
                                " waiting for the data-parallel stream");
      kernels::Scale(model->context(), shard.shard_grads, 1.0f / static_cast<float>(options_.dp_size));
      continue;
    }
    if (shard.sharded()) {
      // ZeRO-1 on the host (CUDA memory over a host communicator, or an
      // expert-parallel chunk): this rank keeps the sum of its shard only
      // (host wait: the communicator reads what the chunk's stream wrote).
      // With expert parallelism the moments are sharded over the ranks
      // holding the same experts (edp): the dense gradients are summed over
      // the expert group (the other slots) first, so the reduce-scatter over
      // edp sums every dp rank's; the experts' over edp.
      const int64_t tail = model->expert_elements();
      if (tail > 0) BATON_RETURN_IF_ERROR(await_dp_stream());
      const absl::Time wait_start = absl::Now();
      BATON_RETURN_IF_ERROR_CTX(model->Synchronize(), "stage ", stage, " before the gradient reduce-scatter");
      waited_for_compute += absl::Now() - wait_start;
      if (tail > 0) {
        const int64_t dense = model->Gradients().numel() - tail;
        BATON_RETURN_IF_ERROR_CTX(
            ep_->AllReduceSum(model::CommBuffer(shard.padded_grads.Rows(0, dense)))->Wait(options_.op_timeout),
            "expert-group sum of the dense gradients of stage ", stage);
      }
      BATON_RETURN_IF_ERROR_CTX(
          (tail > 0 ? edp_ : dp_)
              ->ReduceScatterSum(model::CommBuffer(shard.padded_grads), model::CommBuffer(shard.shard_grads))
              ->Wait(options_.op_timeout),
          "data-parallel gradient reduce-scatter of stage ", stage);
      kernels::Scale(model->context(), shard.shard_grads, 1.0f / static_cast<float>(options_.dp_size));
      continue;
    }
    kernels::Tensor g = model->Gradients();
    if (const int64_t tail = model->expert_elements(); tail > 0) {
      // Expert parallelism: the dense parameters summed over dp (x cp), this
      // rank's experts over the ranks holding the same experts (none when
      // dp == ep), then over cp. Every rank's expert gradient already holds
      // its expert group's tokens, so the sum covers all dp ranks' tokens and
      // both divide by dp x cp.
      BATON_RETURN_IF_ERROR(await_dp_stream());
      const absl::Time wait_start = absl::Now();
      BATON_RETURN_IF_ERROR_CTX(model->Synchronize(), "stage ", stage, " before the gradient all-reduce");
      waited_for_compute += absl::Now() - wait_start;
      const int64_t n = g.numel();
      std::shared_ptr<comm::Work> dense = dp_->AllReduceSum(model::CommBuffer(g.Rows(0, n - tail)));
      std::shared_ptr<comm::Work> experts =
          edp_ != nullptr ? edp_->AllReduceSum(model::CommBuffer(g.Rows(n - tail, n))) : nullptr;
      BATON_RETURN_IF_ERROR_CTX(dense->Wait(options_.op_timeout), "data-parallel gradient all-reduce");
      if (experts != nullptr) {
        BATON_RETURN_IF_ERROR_CTX(experts->Wait(options_.op_timeout),
                                  "expert-data-parallel gradient all-reduce of stage ", stage);
      }
      if (cp_ != nullptr) {
        // With context parallelism the ranks holding an expert are also the
        // cp ranks of each of those dp ranks: the sum goes on over the ring.
        BATON_RETURN_IF_ERROR_CTX(cp_->AllReduceSum(model::CommBuffer(g.Rows(n - tail, n)))->Wait(options_.op_timeout),
                                  "context-parallel sum of the expert gradients of stage ", stage);
      }
      kernels::Scale(model->context(), g, 1.0f / static_cast<float>(options_.dp_size));
      continue;
    }
    if (reduced != nullptr) {
      BATON_RETURN_IF_ERROR_CTX(reduced->StreamWait(*model->context().stream), "stage ", stage,
                                " waiting for the data-parallel stream");
    } else {
      // CUDA memory over a host communicator: it reads what the stream wrote.
      const absl::Time wait_start = absl::Now();
      BATON_RETURN_IF_ERROR_CTX(model->Synchronize(), "stage ", stage, " before the gradient all-reduce");
      waited_for_compute += absl::Now() - wait_start;
      BATON_RETURN_IF_ERROR_CTX(dp_->AllReduceSum(model::CommBuffer(g))->Wait(options_.op_timeout),
                                "data-parallel gradient all-reduce");
    }
    kernels::Scale(model->context(), g, 1.0f / static_cast<float>(options_.dp_size));
  }
  if (dp_ != nullptr) {
    for (auto& [stage, model] : chunks_) {
      if (!model->DpShard().sharded()) BATON_RETURN_IF_ERROR(sum_tied(stage, model));
    }
  }
  const absl::Time end = absl::Now();
  dp_comm_ += absl::ToDoubleSeconds(end - start - waited_for_compute);
  Record("reduce grads", "dp", start, end);
  return absl::OkStatus();
}

void StepExecutor::AddMoeStats(const MoeStats& chunk) {
  // Expert e of every chunk adds to index e (the chunks of a job have the
  // same experts).
  auto add = [](std::vector<int64_t>& sum, const std::vector<int64_t>& v) {
    if (sum.size() < v.size()) sum.resize(v.size(), 0);
    for (size_t e = 0; e < v.size(); ++e) sum[e] += v[e];
  };
  add(moe_.routed, chunk.routed);
  add(moe_.kept, chunk.kept);
  moe_.aux_loss += chunk.aux_loss;
}

v1::StepDone StepExecutor::Finish(int64_t step, bool committed) {
  const double wall = absl::ToDoubleSeconds(absl::Now() - step_start_);
  v1::StepDone done;
  done.set_step(step);
  done.set_committed(committed);
  done.set_wall_seconds(wall);
  done.set_compute_seconds(compute_);
  done.set_comm_p2p_seconds(p2p_);
  done.set_comm_tp_seconds(tp_comm_);
  if (tp_ != nullptr) {
    // The host waits' split by collective; on NCCL streams nothing waits on
    // the host and all of TP's time stays with the all-reduces.
    done.set_comm_tp_all_gather_seconds(std::min(tp_comm_, tp_->all_gather_seconds() - tp_gather_at_start_));
    done.set_comm_tp_reduce_scatter_seconds(
        std::min(tp_comm_ - done.comm_tp_all_gather_seconds(), tp_->reduce_scatter_seconds() - tp_scatter_at_start_));
  }
  done.set_comm_dp_seconds(dp_comm_);
  done.set_comm_cp_seconds(cp_comm_);
  done.set_comm_all_to_all_seconds(ep_comm_);
  done.set_bubble_seconds(std::max(0.0, wall - compute_ - p2p_ - tp_comm_ - dp_comm_ - cp_comm_ - ep_comm_));
  if (ep_ != nullptr) done.set_comm_all_to_all_bytes(ep_->collective_bytes_sent() - ep_bytes_at_start_);
  if (cp_ != nullptr) done.set_comm_cp_bytes(cp_->p2p_bytes_sent() - cp_bytes_at_start_);
  if (tp_ != nullptr) done.set_comm_tp_bytes(tp_->collective_bytes_sent() - tp_bytes_at_start_);
  if (dp_ != nullptr) {
    // The expert gradients' sums over the expert-data-parallel group too.
    done.set_comm_dp_bytes(dp_->collective_bytes_sent() - dp_bytes_at_start_ +
                           (edp_ != nullptr ? edp_->collective_bytes_sent() - edp_bytes_at_start_ : 0));
  }
  int64_t weights = 0, grads = 0, optimizer = 0, activations = 0;
  for (const auto& [stage, model] : chunks_) {
    const model::ParameterStore::MemoryBytes m = model->MemoryBytes();
    weights += m.weights;
    grads += m.grads;
    optimizer += m.optimizer;
    activations += model->activation_bytes();
  }
  done.set_activation_bytes(activations);
  done.set_weights_bytes(weights);
  done.set_grads_bytes(grads);
  done.set_optimizer_bytes(optimizer);
  for (int64_t n : moe_.routed) done.add_moe_routed_tokens(n);
  for (int64_t n : moe_.kept) done.add_moe_kept_tokens(n);
  done.set_moe_aux_loss(moe_.aux_loss);
  for (v1::TraceEvent& e : events_) *done.add_events() = std::move(e);
  events_.clear();
  return done;
}

absl::StatusOr<v1::StepDone> StepExecutor::Commit(int64_t step, float clip_factor) {
  BATON_RETURN_IF_ERROR(StartSpans());
  for (auto& [stage, model] : chunks_) {
    const bool on_stream = model->context().stream != nullptr;
    const absl::Time start = absl::Now();
    if (on_stream) BATON_RETURN_IF_ERROR(BeginSpan(model, stage));
    BATON_RETURN_IF_ERROR_CTX(model->OptimizerStep(clip_factor), "optimizer step of stage ", stage);
    if (on_stream) {
      BATON_RETURN_IF_ERROR(EndSpan(model, stage, "optimizer", 0));
      continue;
    }
    const absl::Time end = absl::Now();
    compute_ += absl::ToDoubleSeconds(end - start);
    Record("optimizer", "compute", start, end);
  }
  // ZeRO: the updated shards all-gathered on the chunks' streams where the
  // data-parallel group can run there, after the optimizer (no host wait).
  std::set<int> gathered_on_stream;
  BATON_RETURN_IF_ERROR(EnqueueValueGathers(&gathered_on_stream));
  // One wait on the device, so the optimizer's (and those all-gathers')
  // device time counts in this step and its errors are reported here: with
  // several chunks on streams, the first one's stream waits for the others'
  // ends first.
  if (!spans_.empty()) {
    std::string stages;
    for (const Span& span : spans_) absl::StrAppend(&stages, stages.empty() ? "" : ", ", span.stage);
    kernels::Stream* stream = chunks_.at(spans_.front().stage)->context().stream;
    for (size_t i = 1; i < spans_.size(); ++i) {
      kernels::Stream* other = chunks_.at(spans_[i].stage)->context().stream;
      BATON_ASSIGN_OR_RETURN(kernels::Event * end, RecordEvent(other, spans_[i].stage));
      BATON_RETURN_IF_ERROR_CTX(end->StreamWait(*stream), "optimizer step of stage ", spans_[i].stage);
    }
    BATON_ASSIGN_OR_RETURN(kernels::Event * done, RecordEvent(stream, spans_.front().stage));
    BATON_RETURN_IF_ERROR_CTX(done->Synchronize(), "optimizer step of stage ", stages);
  }
  if (absl::Status dp = dp_status_->status(); !dp.ok()) {  // an all-gather enqueued above failed
    dp_status_->Reset();
    return dp;
  }
  BATON_RETURN_IF_ERROR(ResolveSpans());
  BATON_RETURN_IF_ERROR(GatherShardedValues(gathered_on_stream));
  return Finish(step, true);
}

absl::Status StepExecutor::EnqueueValueGathers(std::set<int>* gathered) {
  if (dp_ == nullptr) return absl::OkStatus();
  for (auto& [stage, model] : chunks_) {
    const DpShardBuffers shard = model->DpShard();
    kernels::Stream* stream = model->context().stream;
    if (!shard.sharded() || stream == nullptr || model->expert_elements() > 0 ||
        !dp_collectives_->CanEnqueue(model::CommBuffer(shard.shard_grads)) ||
        !dp_collectives_->CanEnqueue(model::CommBuffer(shard.padded_values))) {
      continue;
    }
    // Sent from the shard's gradient buffer (spent by the optimizer step), so
    // the all-gather's input does not alias its output.
    kernels::Copy(model->context(), shard.shard_grads, shard.shard_values);
    BATON_ASSIGN_OR_RETURN(kernels::Event * before, RecordEvent(stream, stage));
    BATON_RETURN_IF_ERROR(dp_collectives_->AllGather(
        model::CommBuffer(shard.shard_grads), model::CommBuffer(shard.padded_values),
        absl::StrCat("data-parallel all-gather of stage ", stage, "'s updated values"), *stream, options_.op_timeout,
        dp_status_));
    BATON_ASSIGN_OR_RETURN(kernels::Event * after, RecordEvent(stream, stage));
    dp_spans_.push_back({before, after});
    model->ValuesGathered();
    gathered->insert(stage);
  }
  return absl::OkStatus();
}

absl::Status StepExecutor::GatherShardedValues(const std::set<int>& gathered_on_stream) {
  if (dp_ == nullptr) return absl::OkStatus();
  const absl::Time start = absl::Now();
  bool gathered = false;
  for (auto& [stage, model] : chunks_) {
    const DpShardBuffers shard = model->DpShard();
    if (!shard.sharded() || gathered_on_stream.count(stage)) continue;
    gathered = true;
    // The all-gather sends from the shard's gradient buffer (spent by the
    // optimizer step), so its input does not alias its output.
    kernels::Copy(model->context(), shard.shard_grads, shard.shard_values);
    BATON_RETURN_IF_ERROR_CTX(model->Synchronize(), "stage ", stage, " before the all-gather of its values");
    // With expert parallelism the shards are over the ranks holding the same
    // experts.
    comm::Communicator* group = model->expert_elements() > 0 ? edp_ : dp_;
    BATON_RETURN_IF_ERROR_CTX(
        group->AllGather(model::CommBuffer(shard.shard_grads), model::CommBuffer(shard.padded_values))
            ->Wait(options_.op_timeout),
        "data-parallel all-gather of stage ", stage, "'s updated values");
    model->ValuesGathered();
  }
  if (!gathered) return absl::OkStatus();
  const absl::Time end = absl::Now();
  dp_comm_ += absl::ToDoubleSeconds(end - start);
  Record("gather values", "dp", start, end);
  return absl::OkStatus();
}

v1::StepDone StepExecutor::Discard(int64_t step) {
  for (auto& [stage, model] : chunks_) {
    model->DropInFlight();
    model->ZeroGrad();
  }
  return Finish(step, false);
}

}  // namespace baton
