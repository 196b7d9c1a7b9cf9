#include "coordinator/grpc/coordinator_service.h"

#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/base/config.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_status.h"
#include "common/log.h"
#include "common/session_fragments.h"
#include "common/version.h"

#ifdef ABSL_HAVE_THREAD_SANITIZER
#include <sanitizer/tsan_interface.h>
#endif

namespace baton {
namespace {

// The coordinator's end of one Session stream, shared by the stream's reactor
// (which lives until gRPC's OnDone) and the registry (which may keep it
// longer). Writes are queued: at most one StartWrite is in flight; the next
// starts from OnWriteDone. A message over kFragmentPayloadBytes is written
// as its fragments, one after another, before the next queued message
// (docs/protocol.md, "Fragments"). The queue holds at most max_messages
// messages and max_bytes bytes of messages up to max_bytes each, plus at
// most one message larger than max_bytes (a big relayed snapshot or state):
// a session's write memory is bounded by max_bytes + the largest message the
// job sends (a state it received under max_session_message_bytes) + the one
// being written. gRPC is called under mu_ only where it never
// calls back inline (StartWrite and TryCancel: their completions run on
// gRPC's threads); Finish, whose completion may run inline, is called
// outside it.
class GrpcSession final : public SessionHandle {
 public:
  GrpcSession(grpc::CallbackServerContext* ctx,
              grpc::ServerBidiReactor<v1::WorkerMessage, v1::CoordinatorMessage>* reactor, size_t max_messages,
              size_t max_bytes)
      : peer_(ctx->peer()), max_messages_(max_messages), max_bytes_(max_bytes), ctx_(ctx), reactor_(reactor) {}

  void Close(const absl::Status& reason) override {
    {
      absl::MutexLock lock(&mu_);
      if (ended_ || closing_) return;
      closing_ = true;
      DropQueueLocked();
      // Not finished yet, so the context is alive; the read fails and the
      // reactor ends the session (SessionEnded, OnWorkerLost) as before.
      ctx_->TryCancel();
    }
    BATON_LOG(INFO) << "closing session of " << peer_ << ": " << reason;
  }

  bool Send(const v1::CoordinatorMessage& message) override { return Push(v1::CoordinatorMessage(message)); }

  // Send without a copy (the heartbeat acks).
  bool Push(v1::CoordinatorMessage&& message) {
    std::string overflow;
    {
      absl::MutexLock lock(&mu_);
      if (ended_ || closing_) return false;
      const size_t bytes = message.ByteSizeLong();
      if (!writing_) {
        StartLocked(std::move(message), bytes);
        return true;
      }
      const bool oversize = bytes > max_bytes_;
      if (queue_.size() + 1 <= max_messages_ &&
          (oversize ? oversize_waiting_ == 0 : queued_bytes_ - oversize_waiting_ + bytes <= max_bytes_)) {
        queue_.emplace_back(std::move(message), bytes);
        queued_bytes_ += bytes;
        if (oversize) oversize_waiting_ = bytes;
        return true;
      }
      overflow = absl::StrCat("the worker does not read its session: ", queue_.size(), " messages (",
                              queued_bytes_, " bytes) wait to be written, the limit is ", max_messages_,
                              " messages / ", max_bytes_, " bytes (plus one larger message)");
      closing_ = true;
      reason_ = overflow;
      DropQueueLocked();
      ctx_->TryCancel();
    }
    BATON_LOG(WARNING) << "ending session of " << peer_ << ": " << overflow;
    return false;
  }

  // The reactor's write completed. Starts the next one, or finishes the
  // stream when it has ended and this was the last write.
  void WriteDone(bool ok) {
    grpc::Status finish;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (!ok && !closing_) {
        closing_ = true;  // the stream broke; the read fails too and ends it
        DropQueueLocked();
      }
      if (!closing_ && !ended_ && next_fragment_ < fragment_count_) {
        WriteNextFragmentLocked();  // the rest of a fragmented message first
        return;
      }
      if (!closing_ && !ended_ && !queue_.empty()) {
        v1::CoordinatorMessage next = std::move(queue_.front().first);
        const size_t bytes = queue_.front().second;
        queued_bytes_ -= bytes;
        if (bytes > max_bytes_) oversize_waiting_ = 0;
        queue_.pop_front();
        StartLocked(std::move(next), bytes);
        return;
      }
      if (!ended_ || finish_called_) return;
      finish_called_ = true;
      finish = status_;
    }
    reactor_->Finish(finish);
  }

  // The read side ended with `status` (called once, from the reactor's read
  // path). No Send succeeds after it. Returns true when the caller is to
  // Finish the stream now (no write in flight); else the last WriteDone does.
  bool End(const grpc::Status& status, std::string* reason) {
    absl::MutexLock lock(&mu_);
    ended_ = true;
    DropQueueLocked();
    status_ = status;
    *reason = reason_;
    finish_called_ = !writing_;
    return finish_called_;
  }

  const std::string& peer() const { return peer_; }

 private:
  void DropQueueLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    queue_.clear();
    queued_bytes_ = 0;
    oversize_waiting_ = 0;
    std::string().swap(outgoing_);
    next_fragment_ = fragment_count_ = 0;
  }

  // Starts writing `message` (of `bytes` serialized): whole, or its first
  // fragment.
  void StartLocked(v1::CoordinatorMessage&& message, size_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    writing_ = true;
    if (!NeedsFragments(bytes)) {
      in_flight_ = std::move(message);
      reactor_->StartWrite(&in_flight_);
      return;
    }
    outgoing_ = message.SerializeAsString();
    message.Clear();
    fragment_count_ = static_cast<int32_t>(FragmentCount(static_cast<int64_t>(outgoing_.size())));
    next_fragment_ = 0;
    WriteNextFragmentLocked();
  }

  void WriteNextFragmentLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    writing_ = true;
    in_flight_.Clear();
    *in_flight_.mutable_fragment() = FragmentOf(outgoing_, next_fragment_++);
    if (next_fragment_ == fragment_count_) {
      std::string().swap(outgoing_);  // the last one is copied out
      next_fragment_ = fragment_count_ = 0;
    }
    reactor_->StartWrite(&in_flight_);
  }

  const std::string peer_;
  const size_t max_messages_, max_bytes_;
  absl::Mutex mu_;
  grpc::CallbackServerContext* const ctx_ ABSL_PT_GUARDED_BY(mu_);  // valid until finished
  // Writes start under mu_; Finish (once, after the last write) outside it.
  grpc::ServerBidiReactor<v1::WorkerMessage, v1::CoordinatorMessage>* const reactor_;
  v1::CoordinatorMessage in_flight_ ABSL_GUARDED_BY(mu_);  // the write in flight reads it
  std::deque<std::pair<v1::CoordinatorMessage, size_t>> queue_ ABSL_GUARDED_BY(mu_);  // with its size
  size_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  size_t oversize_waiting_ ABSL_GUARDED_BY(mu_) = 0;  // bytes of the one queued message over max_bytes_
  // The message being written as fragments: its bytes and the next to write
  // (fragment_count_ 0: none).
  std::string outgoing_ ABSL_GUARDED_BY(mu_);
  int32_t next_fragment_ ABSL_GUARDED_BY(mu_) = 0;
  int32_t fragment_count_ ABSL_GUARDED_BY(mu_) = 0;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;  // a StartWrite is in flight
  bool closing_ ABSL_GUARDED_BY(mu_) = false;  // Close, an overflow or a broken write: no more writes
  bool ended_ ABSL_GUARDED_BY(mu_) = false;    // the read side ended (End)
  bool finish_called_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
  std::string reason_ ABSL_GUARDED_BY(mu_);  // why the coordinator ended it, if it did
};

grpc::Status Invalid(const std::string& message) {
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, message);
}

absl::Status CheckKey(const v1::KvKey& key) {
  if (key.job().empty()) return absl::InvalidArgumentError("kv: key.job must be set");
  if (key.key().empty()) return absl::InvalidArgumentError("kv: key.key must be set");
  return absl::OkStatus();
}

KvScope ScopeOf(const v1::KvKey& key) { return KvScope{key.job(), key.generation()}; }

// Decrements on scope exit; the increment is the caller's.
class CountGuard {
 public:
  explicit CountGuard(std::atomic<int>* n) : n_(n) {}
  ~CountGuard() { n_->fetch_sub(1); }

 private:
  std::atomic<int>* n_;
};

int64_t NowMicros() { return absl::ToUnixMicros(absl::Now()); }

}  // namespace

CoordinatorService::CoordinatorService(WorkerRegistry* registry, KvStore* kv, Options options)
    : registry_(registry), kv_(kv), options_(std::move(options)) {
  if (options_.metrics != nullptr) {
    registrations_ = &prometheus::BuildCounter()
                          .Name("baton_registrations_total")
                          .Help("Register calls by result: accepted (new name), replaced (a lost incarnation "
                                "of the name), refused_live (the name is held by a live worker), invalid, "
                                "full, unauthorized")
                          .Register(*options_.metrics);
    refused_ = &prometheus::BuildCounter()
                    .Name("baton_rpc_refused_total")
                    .Help("RPCs refused before they ran, by reason: role (wrong certificate role), token (missing "
                          "or wrong join token), unknown_method (not in the authorization table), job (another "
                          "job's KV), busy (too many pending waits)")
                    .Register(*options_.metrics);
    for (const char* r : {"accepted", "replaced", "refused_live", "invalid", "full", "unauthorized"}) {
      registrations_->Add({{"result", r}});
    }
    for (const char* r : {"role", "token", "unknown_method", "job", "busy"}) refused_->Add({{"reason", r}});
  }
}

void CoordinatorService::CountRegistration(const std::string& result) {
  if (registrations_ != nullptr) registrations_->Add({{"result", result}}).Increment();
}

void CoordinatorService::CountRefused(const std::string& reason) {
  if (refused_ != nullptr) refused_->Add({{"reason", reason}}).Increment();
}

void CoordinatorService::CountRefusedRpc(const std::string& method, const std::string& reason) {
  CountRefused(reason);
  if (method == "/baton.v1.Coordinator/Register") CountRegistration("unauthorized");
}

grpc::Status CoordinatorService::CheckJob(const std::string& job, const char* rpc) {
  if (options_.job_name.empty() || job == options_.job_name) return grpc::Status::OK;
  CountRefused("job");
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                      absl::StrCat(rpc, ": key.job '", job.substr(0, 128), "' is not this coordinator's job '",
                                   options_.job_name, "'"));
}

grpc::Status CoordinatorService::Register(grpc::ServerContext* ctx, const v1::RegisterRequest* req,
                                          v1::RegisterResponse* resp) {
  absl::StatusOr<WorkerRegistry::Registration> reg = registry_->Register(*req, options_.heartbeat);
  if (!reg.ok()) {
    switch (reg.status().code()) {
      case absl::StatusCode::kAlreadyExists: CountRegistration("refused_live"); break;
      case absl::StatusCode::kResourceExhausted: CountRegistration("full"); break;
      default: CountRegistration("invalid"); break;
    }
    BATON_LOG(WARNING) << "refused Register from " << ctx->peer() << " (host '" << req->host().substr(0, 128)
                       << "' pid " << req->pid() << "): " << reg.status().message();
    return ToGrpcStatus(reg.status());
  }
  CountRegistration(reg->replaced_previous ? "replaced" : "accepted");
  if (reg->replaced != nullptr) {
    reg->replaced->Close(absl::AbortedError(absl::StrCat("replaced by a new incarnation of ", req->name())));
  }
  *resp = reg->response;
  resp->set_any_message_renews_lease(true);  // SessionReactor::Handle renews on every message
  BATON_LOG(INFO) << "worker '" << req->name() << "' registered from " << req->host() << " (" << req->device()
                  << ", baton " << req->version().substr(0, 64) << "), id " << resp->worker_id();
  if (req->version() != kVersion) {
    BATON_LOG(WARNING) << "worker '" << req->name() << "' runs baton " << req->version().substr(0, 64)
                       << ", this coordinator " << kVersion << ": upgrade them together";
  }
  return grpc::Status::OK;
}

// gRPC runs every reaction of a stream (OnReadDone, OnWriteDone) before its
// OnDone, ordered through its completion queue. libgrpc is not instrumented,
// so ThreadSanitizer cannot see that order, and it takes what a reaction
// did (the session's state, the registry) and what OnDone lets go of (the
// reactor, the last reference to the session) for a race. These two mark
// the order for it; in other builds they are nothing.
namespace {

void ReactionEnded(const void* reactor) {
#ifdef ABSL_HAVE_THREAD_SANITIZER
  __tsan_release(const_cast<void*>(reactor));
#else
  (void)reactor;
#endif
}
void AfterAllReactions(const void* reactor) {
#ifdef ABSL_HAVE_THREAD_SANITIZER
  __tsan_acquire(const_cast<void*>(reactor));
#else
  (void)reactor;
#endif
}

}  // namespace

// One Session stream. Reads are handled one at a time on gRPC's threads,
// in order; the next read starts when the previous message was handled.
class CoordinatorService::SessionReactor final
    : public grpc::ServerBidiReactor<v1::WorkerMessage, v1::CoordinatorMessage> {
 public:
  SessionReactor(CoordinatorService* service, grpc::CallbackServerContext* ctx)
      : service_(service),
        session_(std::make_shared<GrpcSession>(ctx, this, service->options_.max_session_queue_messages,
                                               service->options_.max_session_queue_bytes)),
        assembler_(service->options_.max_session_message_bytes) {
    StartRead(&msg_);
  }

  void OnReadDone(bool ok) override {
    struct Mark {
      const void* reactor;
      ~Mark() { ReactionEnded(reactor); }
    } mark{this};
    if (!ok) {
      End(opened_ ? grpc::Status::OK : grpc::Status(grpc::StatusCode::CANCELLED, "stream closed before hello"));
      return;
    }
    if (!opened_) {
      if (msg_.worker_id() == 0 || msg_.incarnation() == 0 || !msg_.has_heartbeat()) {
        End(Invalid("Session: the first message must be a heartbeat with worker_id and incarnation from Register"));
        return;
      }
      id_ = msg_.worker_id();
      incarnation_ = msg_.incarnation();
      if (absl::Status s = service_->registry_->OpenSession(id_, incarnation_, session_); !s.ok()) {
        End(ToGrpcStatus(s));
        return;
      }
      opened_ = true;
      name_ = service_->registry_->NameOf(id_);  // fixed for the session's life
    }
    if (grpc::Status s = Handle(); !s.ok()) {
      End(s);
      return;
    }
    StartRead(&msg_);
  }

  void OnWriteDone(bool ok) override {
    session_->WriteDone(ok);
    ReactionEnded(this);
  }

  void OnDone() override {
    AfterAllReactions(this);
    service_->SessionDone();
    delete this;
  }

 private:
  grpc::Status Handle() {
    if (msg_.worker_id() != id_ || msg_.incarnation() != incarnation_) {
      return Invalid("Session: worker_id/incarnation changed within one session");
    }
    if (msg_.has_fragment()) {
      // A fragment renews the lease like any message: a long transfer is not
      // a hung worker.
      service_->registry_->Renew(id_, incarnation_, -1).IgnoreError();
      absl::StatusOr<std::optional<std::string>> got = assembler_.Add(std::move(*msg_.mutable_fragment()));
      if (!got.ok()) return Invalid(absl::StrCat("Session: ", got.status().message()));
      if (!got->has_value()) return grpc::Status::OK;
      if (!msg_.ParseFromString(**got)) {
        return Invalid(absl::StrCat("Session: bad session fragment: the ", (*got)->size(),
                                    " joined bytes are not a WorkerMessage"));
      }
      if (msg_.has_fragment()) return Invalid("Session: bad session fragment: the joined message is itself a fragment");
      // Handled as if it had come whole.
    } else if (assembler_.in_progress()) {
      return Invalid(absl::StrCat("Session: bad session fragment: a whole message arrived while ",
                                  assembler_.buffered_bytes(),
                                  " bytes of a fragmented one were received and more were due"));
    }
    if (msg_.worker_id() != id_ || msg_.incarnation() != incarnation_) {
      return Invalid("Session: worker_id/incarnation changed within one session");
    }
    absl::Status s;
    if (msg_.has_heartbeat()) {
      s = service_->registry_->Heartbeat(id_, incarnation_, msg_.heartbeat());
      if (s.ok()) {
        v1::CoordinatorMessage ack;
        ack.mutable_ack()->set_worker_send_time_us(msg_.heartbeat().send_time_us());
        ack.mutable_ack()->set_coordinator_time_us(NowMicros());
        session_->Push(std::move(ack));
      }
    } else if (msg_.has_goodbye()) {
      s = service_->registry_->Goodbye(id_, incarnation_);
      BATON_LOG(INFO) << "worker '" << name_ << "' says goodbye: " << msg_.goodbye().reason();
    } else {
      // Any message renews the lease: a worker leaves heartbeats out while
      // it sends others (worker/agent.h). Not refused here when stale: the
      // job judges its messages by generation.
      service_->registry_->Renew(id_, incarnation_, msg_.has_report() ? msg_.report().step() : -1).IgnoreError();
      if (service_->options_.job != nullptr) service_->options_.job->OnWorkerMessage(name_, std::move(msg_));
    }
    return ToGrpcStatus(s);
  }

  // The read side is over: the session ends (no Send succeeds after this),
  // the registry and the job hear of it, and the stream is finished with
  // `result` once no write is in flight.
  void End(const grpc::Status& result) {
    std::string reason;
    const bool finish_now = session_->End(result, &reason);
    if (opened_) {
      const std::string gone = service_->registry_->SessionEnded(id_, incarnation_, session_.get());
      if (!gone.empty()) {
        const std::string why = !result.ok() ? result.error_message() : reason.empty() ? "stream closed" : reason;
        BATON_LOG(WARNING) << "worker '" << gone << "' session ended (" << why << ")";
        if (service_->options_.job != nullptr) {
          service_->options_.job->OnWorkerLost(
              gone, reason.empty() ? "its session ended" : absl::StrCat("its session ended: ", reason));
        }
      }
    }
    if (finish_now) Finish(result);
  }

  CoordinatorService* const service_;
  const std::shared_ptr<GrpcSession> session_;
  v1::WorkerMessage msg_;  // the read in flight fills it
  FragmentAssembler assembler_;  // joins the worker's fragmented messages
  bool opened_ = false;    // the registry holds session_
  int64_t id_ = 0, incarnation_ = 0;
  std::string name_;
};

grpc::ServerBidiReactor<v1::WorkerMessage, v1::CoordinatorMessage>* CoordinatorService::Session(
    grpc::CallbackServerContext* ctx) {
  {
    absl::MutexLock lock(&sessions_mu_);
    ++live_sessions_;
  }
  return new SessionReactor(this, ctx);
}

void CoordinatorService::SessionDone() {
  absl::MutexLock lock(&sessions_mu_);
  --live_sessions_;
}

bool CoordinatorService::AwaitSessionsDone(absl::Duration timeout) {
  absl::MutexLock lock(&sessions_mu_);
  auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(sessions_mu_) { return live_sessions_ == 0; };
  return sessions_mu_.AwaitWithTimeout(absl::Condition(&done), timeout);
}

grpc::Status CoordinatorService::KvSet(grpc::ServerContext* /*ctx*/, const v1::KvSetRequest* req, v1::KvSetResponse*) {
  if (absl::Status s = CheckKey(req->key()); !s.ok()) return ToGrpcStatus(s);
  if (grpc::Status s = CheckJob(req->key().job(), "KvSet"); !s.ok()) return s;
  return ToGrpcStatus(kv_->Set(ScopeOf(req->key()), req->key().key(), req->value()));
}

grpc::Status CoordinatorService::KvGet(grpc::ServerContext* /*ctx*/, const v1::KvGetRequest* req, v1::KvGetResponse* resp) {
  if (absl::Status s = CheckKey(req->key()); !s.ok()) return ToGrpcStatus(s);
  if (grpc::Status s = CheckJob(req->key().job(), "KvGet"); !s.ok()) return s;
  absl::StatusOr<std::string> value = kv_->Get(ScopeOf(req->key()), req->key().key());
  if (!value.ok()) return ToGrpcStatus(value.status());
  resp->set_value(std::move(*value));
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::KvWait(grpc::ServerContext* ctx, const v1::KvWaitRequest* req, v1::KvWaitResponse*) {
  if (req->keys().empty()) return Invalid("KvWait: keys must not be empty");
  if (req->keys_size() > 4096) return Invalid("KvWait: at most 4096 keys per call");
  if (grpc::Status s = CheckJob(req->keys(0).job(), "KvWait"); !s.ok()) return s;
  if (req->timeout_ms() < 0) return Invalid("KvWait: timeout_ms must be >= 0");
  std::vector<std::string> keys;
  for (const v1::KvKey& key : req->keys()) {
    if (absl::Status s = CheckKey(key); !s.ok()) return ToGrpcStatus(s);
    if (key.job() != req->keys(0).job() || key.generation() != req->keys(0).generation()) {
      return Invalid("KvWait: all keys must share one job and generation");
    }
    keys.push_back(key.key());
  }
  absl::Duration timeout = std::min(absl::Milliseconds(req->timeout_ms()), options_.max_kv_wait);
  // Never wait past the caller's own deadline.
  const absl::Duration until_deadline = absl::FromChrono(ctx->deadline()) - absl::Now();
  timeout = std::max(absl::ZeroDuration(), std::min(timeout, until_deadline));
  if (pending_kv_waits_.fetch_add(1) >= options_.max_pending_kv_waits) {
    pending_kv_waits_.fetch_sub(1);
    CountRefused("busy");
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrCat("KvWait: ", options_.max_pending_kv_waits,
                                     " waits are already pending on this coordinator; retry later"));
  }
  CountGuard guard(&pending_kv_waits_);
  return ToGrpcStatus(kv_->Wait(ScopeOf(req->keys(0)), keys, timeout));
}

grpc::Status CoordinatorService::KvAdd(grpc::ServerContext* /*ctx*/, const v1::KvAddRequest* req, v1::KvAddResponse* resp) {
  if (absl::Status s = CheckKey(req->key()); !s.ok()) return ToGrpcStatus(s);
  if (grpc::Status s = CheckJob(req->key().job(), "KvAdd"); !s.ok()) return s;
  absl::StatusOr<int64_t> value = kv_->Add(ScopeOf(req->key()), req->key().key(), req->delta());
  if (!value.ok()) return ToGrpcStatus(value.status());
  resp->set_value(*value);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::GetStatus(grpc::ServerContext* /*ctx*/, const v1::GetStatusRequest*,
                                           v1::GetStatusResponse* resp) {
  resp->set_version(kVersion);
  resp->set_job(options_.job_name);
  if (!options_.job_name.empty()) resp->set_generation(kv_->CurrentGeneration(options_.job_name));
  for (v1::WorkerInfo& w : registry_->List()) *resp->add_workers() = std::move(w);
  if (options_.job != nullptr) options_.job->FillStatus(resp);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::GetTrace(grpc::ServerContext* ctx, const v1::GetTraceRequest* req,
                                          v1::GetTraceResponse* resp) {
  if (options_.job == nullptr) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "this coordinator runs no job (start it with --job)");
  }
  if (req->steps() < 1) return Invalid("GetTrace: steps must be >= 1");
  if (req->steps() > 1000) return Invalid("GetTrace: steps must be <= 1000");
  const absl::Duration wait = std::min(absl::Minutes(5), absl::FromChrono(ctx->deadline()) - absl::Now() - absl::Seconds(1));
  if (pending_traces_.fetch_add(1) >= options_.max_pending_traces) {
    pending_traces_.fetch_sub(1);
    CountRefused("busy");
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrCat("GetTrace: ", options_.max_pending_traces,
                                     " traces are already being taken; retry when one finishes"));
  }
  CountGuard guard(&pending_traces_);
  resp->set_chrome_trace_json(options_.job->TraceJson(req->steps(), wait));
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::ListWorkers(grpc::ServerContext* /*ctx*/, const v1::ListWorkersRequest*,
                                             v1::ListWorkersResponse* resp) {
  for (v1::WorkerInfo& w : registry_->List()) *resp->add_workers() = std::move(w);
  return grpc::Status::OK;
}

}  // namespace baton
