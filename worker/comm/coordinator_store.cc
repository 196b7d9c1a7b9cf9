#include "worker/comm/coordinator_store.h"

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "grpcpp/client_context.h"

namespace baton::comm {
namespace {

void SetDeadline(grpc::ClientContext* ctx, absl::Duration d) {
  ctx->set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(d));
}

// gRPC and Abseil share status code numbers; the message says which RPC.
absl::Status FromGrpc(const grpc::Status& s, absl::string_view what) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat("coordinator ", what, ": ", s.error_message()));
}

}  // namespace

CoordinatorStore::CoordinatorStore(
    std::shared_ptr<baton::v1::Coordinator::StubInterface> stub, std::string job,
    int64_t generation, absl::Duration rpc_timeout)
    : stub_(std::move(stub)),
      job_(std::move(job)),
      generation_(generation),
      rpc_timeout_(rpc_timeout) {}

void CoordinatorStore::FillKey(absl::string_view key, baton::v1::KvKey* out) const {
  out->set_job(job_);
  out->set_generation(generation_);
  out->set_key(std::string(key));
}

absl::Status CoordinatorStore::Set(absl::string_view key, absl::string_view value) {
  baton::v1::KvSetRequest req;
  FillKey(key, req.mutable_key());
  req.set_value(std::string(value));
  baton::v1::KvSetResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(&ctx, rpc_timeout_);
  return FromGrpc(stub_->KvSet(&ctx, req, &resp), absl::StrCat("KvSet '", key, "'"));
}

absl::StatusOr<std::string> CoordinatorStore::Get(absl::string_view key,
                                                  absl::Duration timeout) {
  const std::string k(key);
  absl::Status waited = Wait({k}, timeout);
  if (!waited.ok()) return waited;
  baton::v1::KvGetRequest req;
  FillKey(key, req.mutable_key());
  baton::v1::KvGetResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(&ctx, rpc_timeout_);
  absl::Status s =
      FromGrpc(stub_->KvGet(&ctx, req, &resp), absl::StrCat("KvGet '", key, "'"));
  if (!s.ok()) return s;
  return std::move(*resp.mutable_value());
}

absl::Status CoordinatorStore::Wait(absl::Span<const std::string> keys,
                                    absl::Duration timeout) {
  baton::v1::KvWaitRequest req;
  for (const std::string& k : keys) FillKey(k, req.add_keys());
  req.set_timeout_ms(absl::ToInt64Milliseconds(timeout));
  baton::v1::KvWaitResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(&ctx, timeout + rpc_timeout_);
  grpc::Status s = stub_->KvWait(&ctx, req, &resp);
  if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    // The coordinator names the missing keys when it can; say which we
    // asked for either way.
    return absl::DeadlineExceededError(absl::StrCat(
        "store: key(s) [", absl::StrJoin(keys, ", "), "] of job '", job_,
        "' generation ", generation_, " not all set within ",
        absl::FormatDuration(timeout), " (coordinator: ", s.error_message(), ")"));
  }
  return FromGrpc(s, "KvWait");
}

absl::StatusOr<int64_t> CoordinatorStore::Add(absl::string_view key, int64_t delta) {
  baton::v1::KvAddRequest req;
  FillKey(key, req.mutable_key());
  req.set_delta(delta);
  baton::v1::KvAddResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(&ctx, rpc_timeout_);
  absl::Status s =
      FromGrpc(stub_->KvAdd(&ctx, req, &resp), absl::StrCat("KvAdd '", key, "'"));
  if (!s.ok()) return s;
  return resp.value();
}

}  // namespace baton::comm
