// CoordinatorStore: the rendezvous Store over the coordinator's KV RPCs
// (KvSet/KvGet/KvWait/KvAdd), scoped by job and generation so that keys of
// an older generation are never read again; the coordinator rejects RPCs of
// an older generation. Every RPC carries a deadline: `rpc_timeout` for
// Set/Add, the caller's timeout plus `rpc_timeout` for Get/Wait.
#ifndef BATON_WORKER_COMM_COORDINATOR_STORE_H_
#define BATON_WORKER_COMM_COORDINATOR_STORE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/time/time.h"
#include "baton/v1/coordinator.grpc.pb.h"
#include "worker/comm/store.h"

namespace baton::comm {

class CoordinatorStore : public Store {
 public:
  // `stub` talks to the coordinator; thread-safe, shared.
  CoordinatorStore(std::shared_ptr<baton::v1::Coordinator::StubInterface> stub,
                   std::string job, int64_t generation,
                   absl::Duration rpc_timeout = absl::Seconds(10));

  absl::Status Set(absl::string_view key, absl::string_view value) override;
  absl::StatusOr<std::string> Get(absl::string_view key,
                                  absl::Duration timeout) override;
  absl::Status Wait(absl::Span<const std::string> keys,
                    absl::Duration timeout) override;
  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) override;

  int64_t generation() const { return generation_; }

 private:
  void FillKey(absl::string_view key, baton::v1::KvKey* out) const;

  const std::shared_ptr<baton::v1::Coordinator::StubInterface> stub_;
  const std::string job_;
  const int64_t generation_;
  const absl::Duration rpc_timeout_;
};

}  // namespace baton::comm

#endif  // BATON_WORKER_COMM_COORDINATOR_STORE_H_
