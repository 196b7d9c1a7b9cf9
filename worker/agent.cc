#include "worker/agent.h"

#include <unistd.h>

#include <optional>
#include <random>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/log.h"
#include "common/session_fragments.h"
#include "common/version.h"

namespace baton {
namespace {

using Stream = grpc::ClientReaderWriter<v1::WorkerMessage, v1::CoordinatorMessage>;

int64_t NowMicros() { return absl::ToUnixMicros(absl::Now()); }

}  // namespace

WorkerAgent::WorkerAgent(Options options, std::shared_ptr<grpc::Channel> channel, prometheus::Registry& metrics,
                         CommandHandler on_command, std::function<void()> on_session_end)
    : options_(std::move(options)),
      stub_(v1::Coordinator::NewStub(channel)),
      on_command_(std::move(on_command)),
      on_session_end_(std::move(on_session_end)) {
  heartbeats_ = &prometheus::BuildCounter()
                     .Name("baton_heartbeats_total")
                     .Help("Heartbeats sent to the coordinator")
                     .Register(metrics)
                     .Add({});
  heartbeats_left_out_ = &prometheus::BuildCounter()
                              .Name("baton_heartbeats_left_out_total")
                              .Help("Heartbeats left out because another message went out on the session within "
                                    "the heartbeat period (only with a coordinator that renews the lease on any "
                                    "message)")
                              .Register(metrics)
                              .Add({});
  reconnects_ = &prometheus::BuildCounter()
                     .Name("baton_session_reconnects_total")
                     .Help("Sessions with the coordinator re-established after one ended")
                     .Register(metrics)
                     .Add({});
  unresponsive_total_ = &prometheus::BuildCounter()
                       .Name("baton_coordinator_unresponsive_total")
                       .Help("Times the coordinator stopped answering heartbeats for a whole lease while the "
                             "session was open (the worker is not ready meanwhile)")
                       .Register(metrics)
                       .Add({});
  connected_ = &prometheus::BuildGauge()
                    .Name("baton_coordinator_connected")
                    .Help("1 while a session with the coordinator is open")
                    .Register(metrics)
                    .Add({});
}

absl::Status WorkerAgent::Readiness() const {
  absl::MutexLock lock(&mu_);
  if (session_open_) {
    const absl::Duration silent = absl::Now() - last_heard_;
    if (silent <= lease_) return absl::OkStatus();
    return absl::UnavailableError(absl::StrCat("coordinator ", options_.coordinator, " has not been heard from for ",
                                               absl::FormatDuration(absl::Trunc(silent, absl::Milliseconds(100))),
                                               " (lease ", absl::FormatDuration(lease_), ")"));
  }
  return not_ready_;
}

void WorkerAgent::Run() {
  std::mt19937_64 rng(std::hash<std::string>()(options_.name) ^ static_cast<uint64_t>(NowMicros()));
  std::uniform_real_distribution<double> jitter(0.8, 1.2);
  absl::Duration backoff = options_.backoff_min;
  for (;;) {
    bool opened = false;
    absl::Status ended = RunSession(&opened);
    if (opened && on_session_end_) on_session_end_();
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    session_open_ = false;
    unresponsive_ = false;
    not_ready_ = ended;
    connected_->Set(0);
    absl::Duration wait;
    if (opened) {
      // The coordinator knew us: come back quickly (it restarted, or fenced us).
      backoff = options_.backoff_min;
      wait = options_.backoff_min;
      BATON_LOG(WARNING) << "session with coordinator " << options_.coordinator << " ended: " << ended
                         << "; registering again";
    } else {
      wait = backoff * jitter(rng);
      backoff = std::min(backoff * 2, options_.backoff_max);
      BATON_LOG(WARNING) << "cannot register with coordinator " << options_.coordinator << ": " << ended
                         << "; retrying in " << wait;
    }
    auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_; };
    mu_.AwaitWithTimeout(absl::Condition(&stop), wait);
    if (stopping_) return;
  }
}

absl::Status WorkerAgent::RunSession(bool* opened) {
  v1::RegisterRequest req;
  req.set_name(options_.name);
  req.set_host(options_.host);
  req.set_device(options_.device);
  req.set_http_port(options_.http_port);
  req.set_memory_bytes(options_.memory_bytes);
  req.set_device_uuid(options_.device_uuid);
  req.set_fused_attention_bf16(options_.fused_attention_bf16);
  req.set_verdict_in_run_step(true);    // WorkerJob applies RunStep.commit / discard
  req.set_report_groups(true);         // WorkerJob leads or reports to its group (docs/protocol.md)
  req.set_report_group_columns(true);  // of Plan.report_group_columns columns
  req.set_version(kVersion);
  req.set_pid(getpid());
  if (options_.describe) options_.describe(&req);
  v1::RegisterResponse reg;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
    {
      absl::MutexLock lock(&stream_mu_);
      session_ctx_ = &ctx;  // so that Stop() can cancel a pending Register
    }
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) ctx.TryCancel();
    }
    grpc::Status s = stub_->Register(&ctx, req, &reg);
    {
      absl::MutexLock lock(&stream_mu_);
      session_ctx_ = nullptr;
    }
    if (!s.ok()) {
      absl::Status err = FromGrpcStatus(s, absl::StrCat("Register at ", options_.coordinator));
      switch (err.code()) {
        case absl::StatusCode::kInvalidArgument:     // our flags are wrong
        case absl::StatusCode::kAlreadyExists:       // another live worker holds our name
        case absl::StatusCode::kUnauthenticated:     // join token
        case absl::StatusCode::kPermissionDenied:    // certificate role
        case absl::StatusCode::kResourceExhausted:   // the coordinator is full
          return err;                                // logged by Run, shown by /readyz
        default:
          return absl::UnavailableError(absl::StrCat("coordinator unreachable: ", err.message()));
      }
    }
  }
  grpc::ClientContext ctx;
  std::unique_ptr<Stream> stream = stub_->Session(&ctx);
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::CancelledError("stopping");
    in_session_ = true;
  }
  {
    absl::MutexLock lock(&stream_mu_);
    registration_ = reg;
    session_ctx_ = &ctx;
    stream_ = stream.get();
    last_sent_ = absl::InfinitePast();  // the first message must be a heartbeat
  }
  const absl::Duration period = absl::Milliseconds(std::max<int64_t>(10, reg.heartbeat_ms()));
  std::thread beats([&]() { Heartbeats(stream.get(), reg, period); });
  v1::CoordinatorMessage msg;
  // Messages over kFragmentPayloadBytes come as fragments (docs/protocol.md,
  // "Fragments"); a bad fragment stream ends the session like a broken one.
  FragmentAssembler assembler;
  absl::Status broken;
  while (stream->Read(&msg)) {
    const bool joined = msg.has_fragment() || assembler.in_progress();
    if (joined) {
      {
        absl::MutexLock lock(&mu_);
        last_heard_ = absl::Now();  // a long transfer is the coordinator talking
      }
      if (!msg.has_fragment()) {
        broken = absl::InvalidArgumentError(
            absl::StrCat("bad session fragment: a whole message arrived while ", assembler.buffered_bytes(),
                         " bytes of a fragmented one were received and more were due"));
      } else if (absl::StatusOr<std::optional<std::string>> got = assembler.Add(std::move(*msg.mutable_fragment()));
                 !got.ok()) {
        broken = got.status();
      } else if (!got->has_value()) {
        continue;
      } else if (!msg.ParseFromString(**got)) {
        broken = absl::InvalidArgumentError(
            absl::StrCat("bad session fragment: the ", (*got)->size(), " joined bytes are not a CoordinatorMessage"));
      } else if (msg.has_fragment()) {
        broken = absl::InvalidArgumentError("bad session fragment: the joined message is itself a fragment");
      }
      if (!broken.ok()) {
        BATON_LOG(ERROR) << "session with coordinator " << options_.coordinator << ": " << broken
                         << "; ending it as broken";
        ctx.TryCancel();
        break;
      }
    }
    {
      absl::MutexLock lock(&mu_);
      last_heard_ = absl::Now();
      if (unresponsive_ && session_open_) {
        unresponsive_ = false;
        BATON_LOG(INFO) << "coordinator " << options_.coordinator << " is heard from again";
      }
      if (msg.has_ack()) {
        const int64_t now = NowMicros(), sent = msg.ack().worker_send_time_us();
        const int64_t rtt = now - sent;
        // Prefer the fastest round trip (least asymmetric delay); forget it after a minute.
        if (sent > 0 && rtt >= 0 && (rtt <= best_rtt_us_ || absl::Now() - best_rtt_at_ > absl::Minutes(1))) {
          best_rtt_us_ = rtt;
          best_rtt_at_ = absl::Now();
          clock_offset_us_ = msg.ack().coordinator_time_us() - (sent + now) / 2;
        }
        if (!session_open_) {
          session_open_ = true;
          lease_ = absl::Milliseconds(std::max<int64_t>(1, reg.lease_ms()));
          *opened = true;
          if (sessions_opened_++ > 0) reconnects_->Increment();
          connected_->Set(1);
          BATON_LOG(INFO) << "registered with coordinator " << options_.coordinator << " as '" << options_.name
                          << "' (id " << reg.worker_id() << ", lease " << reg.lease_ms() << " ms)";
        }
      }
    }
    if (msg.has_ack()) continue;
    if (on_command_) on_command_(msg);
    // A joined (big) message's buffers would stay allocated in `msg` for
    // every later Read: freed instead (the handler kept what it needs).
    if (joined) msg = v1::CoordinatorMessage();
  }
  {
    absl::MutexLock lock(&mu_);
    in_session_ = false;
  }
  beats.join();
  {
    absl::MutexLock lock(&stream_mu_);
    session_ctx_ = nullptr;
    stream_ = nullptr;
    registration_.Clear();
  }
  grpc::Status status = stream->Finish();
  if (!broken.ok()) return broken;
  if (status.ok()) return absl::UnavailableError("coordinator closed the session");
  return FromGrpcStatus(status, "session");
}

void WorkerAgent::SetStep(int64_t step) {
  absl::MutexLock lock(&mu_);
  step_ = step;
}

int64_t WorkerAgent::CoordinatorNowMicros() const {
  absl::MutexLock lock(&mu_);
  return NowMicros() + clock_offset_us_;
}

bool WorkerAgent::Send(v1::WorkerMessage message) {
  absl::MutexLock lock(&stream_mu_);
  if (stream_ == nullptr) return false;
  message.set_worker_id(registration_.worker_id());
  message.set_incarnation(registration_.incarnation());
  const size_t bytes = message.ByteSizeLong();
  if (!NeedsFragments(bytes)) {
    if (!stream_->Write(message)) return false;
    last_sent_ = absl::Now();
    return true;
  }
  if (bytes > static_cast<size_t>(kMaxFragmentedMessageBytes)) {
    BATON_LOG(ERROR) << "not sending a session message of " << bytes << " bytes: over the "
                     << kMaxFragmentedMessageBytes << "-byte bound of a fragmented message";
    return false;
  }
  // Its fragments in a row, under stream_mu_ (nothing else goes between);
  // each one renews the lease at the coordinator. The message's own copy is
  // freed first: a snapshot is one state-sized copy less while it crosses.
  const std::string serialized = message.SerializeAsString();
  const int64_t worker_id = message.worker_id(), incarnation = message.incarnation();
  message = v1::WorkerMessage();
  const int64_t count = FragmentCount(static_cast<int64_t>(serialized.size()));
  for (int64_t i = 0; i < count; ++i) {
    v1::WorkerMessage piece;
    piece.set_worker_id(worker_id);
    piece.set_incarnation(incarnation);
    *piece.mutable_fragment() = FragmentOf(serialized, static_cast<int32_t>(i));
    if (!stream_->Write(piece)) return false;
    last_sent_ = absl::Now();
  }
  return true;
}

void WorkerAgent::Heartbeats(Stream* stream, const v1::RegisterResponse& reg, absl::Duration period) {
  for (int skipped = 0;;) {
    v1::WorkerMessage beat;
    beat.set_worker_id(reg.worker_id());
    beat.set_incarnation(reg.incarnation());
    {
      absl::MutexLock lock(&mu_);
      if (!in_session_ || stopping_) return;
      beat.mutable_heartbeat()->set_step(step_);
    }
    beat.mutable_heartbeat()->set_send_time_us(NowMicros());
    bool sent = false;
    {
      absl::MutexLock lock(&stream_mu_);
      // Any message renews the lease: while the job keeps the session busy
      // (a report or StepDone within the last period) the heartbeat is left
      // out, but not more than kMaxSkippedHeartbeats in a row (its ack
      // keeps the clock offset fresh).
      if (HeartbeatDue(reg.any_message_renews_lease(), absl::Now() - last_sent_, period, skipped)) {
        if (!stream->Write(beat)) return;  // the reader sees the stream end
        sent = true;
      }
    }
    skipped = sent ? 0 : skipped + 1;
    (sent ? heartbeats_ : heartbeats_left_out_)->Increment();
    absl::MutexLock lock(&mu_);
    if (session_open_ && !unresponsive_ && absl::Now() - last_heard_ > lease_) {
      unresponsive_ = true;
      unresponsive_total_->Increment();
      BATON_LOG(WARNING) << "coordinator " << options_.coordinator << " has not been heard from for a lease ("
                         << lease_ << "); not ready until it is";
    }
    auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !in_session_ || stopping_; };
    if (mu_.AwaitWithTimeout(absl::Condition(&done), period)) return;
  }
}

void WorkerAgent::Stop(absl::Duration grace) {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  {
    absl::MutexLock lock(&stream_mu_);
    if (stream_ != nullptr) {
      v1::WorkerMessage bye;
      bye.set_worker_id(registration_.worker_id());
      bye.set_incarnation(registration_.incarnation());
      bye.mutable_goodbye()->set_reason("worker shutting down");
      stream_->Write(bye);
      stream_->WritesDone();
    } else if (session_ctx_ != nullptr) {
      session_ctx_->TryCancel();  // still registering
    }
  }
  absl::MutexLock lock(&mu_);
  auto closed = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !in_session_; };
  if (!mu_.AwaitWithTimeout(absl::Condition(&closed), grace)) {
    absl::MutexLock stream_lock(&stream_mu_);
    if (session_ctx_ != nullptr) session_ctx_->TryCancel();
  }
}

}  // namespace baton
