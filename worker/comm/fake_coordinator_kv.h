// FakeCoordinatorKv: a test-only stand-in for the coordinator's KV RPCs
// (KvSet/KvGet/KvWait/KvAdd) over an InMemoryStore, served on a loopback
// port so that ranks in several processes can rendezvous. Like the real
// coordinator it rejects requests of a generation older than the newest it
// has seen for a job. Every other Coordinator RPC answers UNIMPLEMENTED.
#ifndef BATON_WORKER_COMM_FAKE_COORDINATOR_KV_H_
#define BATON_WORKER_COMM_FAKE_COORDINATOR_KV_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "baton/v1/coordinator.grpc.pb.h"
#include "grpcpp/server.h"
#include "worker/comm/store.h"

namespace baton::comm {

class FakeCoordinatorKv : public baton::v1::Coordinator::Service {
 public:
  grpc::Status KvSet(grpc::ServerContext* ctx, const baton::v1::KvSetRequest* req,
                     baton::v1::KvSetResponse* resp) override;
  grpc::Status KvGet(grpc::ServerContext* ctx, const baton::v1::KvGetRequest* req,
                     baton::v1::KvGetResponse* resp) override;
  grpc::Status KvWait(grpc::ServerContext* ctx, const baton::v1::KvWaitRequest* req,
                      baton::v1::KvWaitResponse* resp) override;
  grpc::Status KvAdd(grpc::ServerContext* ctx, const baton::v1::KvAddRequest* req,
                     baton::v1::KvAddResponse* resp) override;

  // Every key stored, as "<job>/<generation>/<key>", sorted.
  std::vector<std::string> Keys() const { return store_.Keys(); }

 private:
  // Records the generation; FAILED_PRECONDITION when it is older than the
  // newest seen for the job. On success sets `*flat` to the stored key.
  grpc::Status Admit(const baton::v1::KvKey& key, std::string* flat);

  absl::Mutex mu_;
  absl::flat_hash_map<std::string, int64_t> newest_generation_ ABSL_GUARDED_BY(mu_);
  InMemoryStore store_;
};

// Serves a FakeCoordinatorKv on 127.0.0.1 (an ephemeral port).
class FakeCoordinatorKvServer {
 public:
  static absl::StatusOr<std::unique_ptr<FakeCoordinatorKvServer>> Start();
  ~FakeCoordinatorKvServer();

  std::string address() const;  // "127.0.0.1:<port>"
  FakeCoordinatorKv& service() { return service_; }
  // Closes the port; in-flight RPCs end with CANCELLED/UNAVAILABLE.
  void Shutdown();

 private:
  FakeCoordinatorKvServer() = default;

  FakeCoordinatorKv service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

// A stub connected to `address` over an insecure loopback channel.
std::shared_ptr<baton::v1::Coordinator::StubInterface> ConnectCoordinator(
    const std::string& address);

}  // namespace baton::comm

#endif  // BATON_WORKER_COMM_FAKE_COORDINATOR_KV_H_
