#include "coordinator/grpc/coordinator_service.h"

#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_status.h"
#include "common/log.h"
#include "common/version.h"

namespace baton {
namespace {

using Stream = grpc::ServerReaderWriter<v1::CoordinatorMessage, v1::WorkerMessage>;

// The server end of one Session stream. Writes are serialised; Close cancels
// the RPC so the handler's blocking Read returns.
class GrpcSession : public SessionHandle {
 public:
  GrpcSession(grpc::ServerContext* ctx, Stream* stream) : ctx_(ctx), stream_(stream) {}

  void Close(const absl::Status& reason) override {
    absl::MutexLock lock(&mu_);
    if (done_) return;
    BATON_LOG(INFO) << "closing session of " << ctx_->peer() << ": " << reason;
    ctx_->TryCancel();
  }

  bool Send(const v1::CoordinatorMessage& message) override {
    absl::MutexLock lock(&mu_);
    return !done_ && stream_->Write(message);
  }

  // Called by the handler before it returns; later Close/Send are no-ops.
  void Finish() {
    absl::MutexLock lock(&mu_);
    done_ = true;
  }

 private:
  absl::Mutex mu_;
  grpc::ServerContext* const ctx_;
  Stream* const stream_ ABSL_PT_GUARDED_BY(mu_);
  bool done_ ABSL_GUARDED_BY(mu_) = false;
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
  BATON_LOG(INFO) << "worker '" << req->name() << "' registered from " << req->host() << " (" << req->device()
                  << ", baton " << req->version().substr(0, 64) << "), id " << resp->worker_id();
  if (req->version() != kVersion) {
    BATON_LOG(WARNING) << "worker '" << req->name() << "' runs baton " << req->version().substr(0, 64)
                       << ", this coordinator " << kVersion << ": upgrade them together";
  }
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::Session(grpc::ServerContext* ctx, Stream* stream) {
  v1::WorkerMessage first;
  if (!stream->Read(&first)) return grpc::Status(grpc::StatusCode::CANCELLED, "stream closed before hello");
  if (first.worker_id() == 0 || first.incarnation() == 0 || !first.has_heartbeat()) {
    return Invalid("Session: the first message must be a heartbeat with worker_id and incarnation from Register");
  }
  const int64_t id = first.worker_id(), incarnation = first.incarnation();
  auto session = std::make_shared<GrpcSession>(ctx, stream);
  if (absl::Status s = registry_->OpenSession(id, incarnation, session); !s.ok()) {
    session->Finish();
    return ToGrpcStatus(s);
  }
  grpc::Status result = grpc::Status::OK;
  v1::WorkerMessage msg = first;
  do {
    if (msg.worker_id() != id || msg.incarnation() != incarnation) {
      result = Invalid("Session: worker_id/incarnation changed within one session");
      break;
    }
    absl::Status s;
    if (msg.has_heartbeat()) {
      s = registry_->Heartbeat(id, incarnation, msg.heartbeat());
      if (s.ok()) {
        v1::CoordinatorMessage ack;
        ack.mutable_ack()->set_worker_send_time_us(msg.heartbeat().send_time_us());
        ack.mutable_ack()->set_coordinator_time_us(NowMicros());
        session->Send(ack);
      }
    } else if (msg.has_goodbye()) {
      s = registry_->Goodbye(id, incarnation);
      BATON_LOG(INFO) << "worker '" << registry_->NameOf(id) << "' says goodbye: " << msg.goodbye().reason();
    } else if (options_.job != nullptr) {
      options_.job->OnWorkerMessage(registry_->NameOf(id), msg);
    }
    if (!s.ok()) {
      result = ToGrpcStatus(s);
      break;
    }
  } while (stream->Read(&msg));
  session->Finish();
  const std::string gone = registry_->SessionEnded(id, incarnation, session.get());
  if (!gone.empty()) {
    BATON_LOG(WARNING) << "worker '" << gone << "' session ended (" << (result.ok() ? "stream closed" : result.error_message())
                       << ")";
    if (options_.job != nullptr) options_.job->OnWorkerLost(gone, "its session ended");
  }
  return result;
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
