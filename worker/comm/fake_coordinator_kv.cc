#include "worker/comm/fake_coordinator_kv.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"

namespace baton::comm {
namespace {

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

}  // namespace

grpc::Status FakeCoordinatorKv::Admit(const baton::v1::KvKey& key, std::string* flat) {
  absl::MutexLock lock(&mu_);
  int64_t& newest = newest_generation_[key.job()];
  if (key.generation() < newest) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("generation ", key.generation(), " of job '", key.job(),
                                     "' is older than the current generation ", newest));
  }
  newest = key.generation();
  *flat = absl::StrCat(key.job(), "/", key.generation(), "/", key.key());
  return grpc::Status::OK;
}

grpc::Status FakeCoordinatorKv::KvSet(grpc::ServerContext*, const baton::v1::KvSetRequest* req,
                                      baton::v1::KvSetResponse*) {
  std::string key;
  grpc::Status admitted = Admit(req->key(), &key);
  if (!admitted.ok()) return admitted;
  return ToGrpc(store_.Set(key, req->value()));
}

grpc::Status FakeCoordinatorKv::KvGet(grpc::ServerContext*, const baton::v1::KvGetRequest* req,
                                      baton::v1::KvGetResponse* resp) {
  std::string key;
  grpc::Status admitted = Admit(req->key(), &key);
  if (!admitted.ok()) return admitted;
  absl::StatusOr<std::string> value = store_.Get(key, absl::ZeroDuration());
  if (!value.ok()) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND, absl::StrCat("no key '", key, "'"));
  }
  resp->set_value(*std::move(value));
  return grpc::Status::OK;
}

grpc::Status FakeCoordinatorKv::KvWait(grpc::ServerContext*, const baton::v1::KvWaitRequest* req,
                                       baton::v1::KvWaitResponse*) {
  std::vector<std::string> keys;
  for (const baton::v1::KvKey& k : req->keys()) {
    std::string key;
    grpc::Status admitted = Admit(k, &key);
    if (!admitted.ok()) return admitted;
    keys.push_back(std::move(key));
  }
  return ToGrpc(store_.Wait(keys, absl::Milliseconds(req->timeout_ms())));
}

grpc::Status FakeCoordinatorKv::KvAdd(grpc::ServerContext*, const baton::v1::KvAddRequest* req,
                                      baton::v1::KvAddResponse* resp) {
  std::string key;
  grpc::Status admitted = Admit(req->key(), &key);
  if (!admitted.ok()) return admitted;
  absl::StatusOr<int64_t> value = store_.Add(key, req->delta());
  if (!value.ok()) return ToGrpc(value.status());
  resp->set_value(*value);
  return grpc::Status::OK;
}

absl::StatusOr<std::unique_ptr<FakeCoordinatorKvServer>> FakeCoordinatorKvServer::Start() {
  std::unique_ptr<FakeCoordinatorKvServer> server(new FakeCoordinatorKvServer());
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &server->port_);
  builder.RegisterService(&server->service_);
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    return absl::UnavailableError("FakeCoordinatorKvServer: cannot listen on 127.0.0.1");
  }
  return server;
}

FakeCoordinatorKvServer::~FakeCoordinatorKvServer() { Shutdown(); }

void FakeCoordinatorKvServer::Shutdown() {
  if (server_ != nullptr) {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
    server_->Wait();
    server_.reset();
  }
}

std::string FakeCoordinatorKvServer::address() const {
  return absl::StrCat("127.0.0.1:", port_);
}

std::shared_ptr<baton::v1::Coordinator::StubInterface> ConnectCoordinator(
    const std::string& address) {
  return baton::v1::Coordinator::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
}

}  // namespace baton::comm
