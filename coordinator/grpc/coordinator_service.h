// CoordinatorService: the gRPC skin over WorkerRegistry and KvStore. It
// validates wire fields and translates; the logic lives in those classes.
//
// The Session stream runs on gRPC's callback API: no thread per stream. A
// read completes on one of gRPC's threads and is handled there (heartbeat:
// renew the lease and queue the ack; job messages: JobObserver). Sending to
// a worker (SessionHandle::Send) never blocks: messages are queued, one
// write is in flight per stream, and a worker that stops reading while its
// queue passes `max_session_queue_messages` / `max_session_queue_bytes` has
// its session ended (it is then a lost worker) instead of growing memory.
// Messages over 3 MiB cross as fragments both ways (common/
// session_fragments.h): a worker's are joined (at most
// `max_session_message_bytes`, one at a time per session; a bad fragment
// stream ends the session with INVALID_ARGUMENT saying what was wrong), and
// each fragment renews the worker's lease.
//
// Who may call which RPC (certificate roles, join token) is not decided
// here: coordinator/grpc/rpc_authorization.h checks every call before it
// reaches a handler. The service only keeps a worker's KV calls to the
// configured job.
#ifndef BATON_COORDINATOR_GRPC_COORDINATOR_SERVICE_H_
#define BATON_COORDINATOR_GRPC_COORDINATOR_SERVICE_H_

#include <atomic>
#include <functional>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "baton/v1/coordinator.grpc.pb.h"
#include "common/session_fragments.h"
#include "coordinator/grpc/job_observer.h"
#include "coordinator/kv_store.h"
#include "coordinator/worker_registry.h"
#include "prometheus/counter.h"
#include "prometheus/registry.h"

namespace baton {

class CoordinatorService final : public v1::Coordinator::WithCallbackMethod_Session<v1::Coordinator::Service> {
 public:
  struct Options {
    absl::Duration heartbeat = absl::Milliseconds(500);
    absl::Duration max_kv_wait = absl::Minutes(10);
    std::string job_name;  // empty when no job was given
    JobObserver* job = nullptr;  // null when no job was given
    int max_pending_kv_waits = 256;
    int max_pending_traces = 4;
    prometheus::Registry* metrics = nullptr;  // baton_registrations_total, baton_rpc_refused_total
    // Messages waiting to be written on one Session stream (beyond the one
    // in flight); past either bound the worker is not reading and its
    // session is ended.
    size_t max_session_queue_messages = 4096;
    // Of messages up to this size each; one larger message (a relayed
    // snapshot or a Configure.state over it) may wait beyond it.
    size_t max_session_queue_bytes = size_t{64} << 20;
    // The largest message a worker may send as fragments (a snapshot, a
    // fetched state); a session holds at most one in assembly.
    int64_t max_session_message_bytes = kMaxFragmentedMessageBytes;
  };
  CoordinatorService(WorkerRegistry* registry, KvStore* kv, Options options);

  grpc::Status Register(grpc::ServerContext* ctx, const v1::RegisterRequest* req, v1::RegisterResponse* resp) override;
  grpc::ServerBidiReactor<v1::WorkerMessage, v1::CoordinatorMessage>* Session(
      grpc::CallbackServerContext* ctx) override;
  grpc::Status KvSet(grpc::ServerContext* ctx, const v1::KvSetRequest* req, v1::KvSetResponse* resp) override;
  grpc::Status KvGet(grpc::ServerContext* ctx, const v1::KvGetRequest* req, v1::KvGetResponse* resp) override;
  grpc::Status KvWait(grpc::ServerContext* ctx, const v1::KvWaitRequest* req, v1::KvWaitResponse* resp) override;
  grpc::Status KvAdd(grpc::ServerContext* ctx, const v1::KvAddRequest* req, v1::KvAddResponse* resp) override;
  grpc::Status GetStatus(grpc::ServerContext* ctx, const v1::GetStatusRequest* req,
                         v1::GetStatusResponse* resp) override;
  grpc::Status ListWorkers(grpc::ServerContext* ctx, const v1::ListWorkersRequest* req,
                           v1::ListWorkersResponse* resp) override;
  grpc::Status GetTrace(grpc::ServerContext* ctx, const v1::GetTraceRequest* req,
                        v1::GetTraceResponse* resp) override;

  // Counts a call the authorizer refused before it reached a handler
  // (baton_rpc_refused_total{reason}; a refused Register is also an
  // "unauthorized" registration). Thread-safe.
  void CountRefusedRpc(const std::string& method, const std::string& reason);

  // Waits until every Session stream this service accepted is done (gRPC
  // has called its OnDone); false after `timeout`. The service must outlive
  // its streams: a server that is shut down waits for them itself.
  bool AwaitSessionsDone(absl::Duration timeout);

 private:
  class SessionReactor;
  void SessionDone();

  // INVALID_ARGUMENT unless `job` is the configured job (when there is one).
  grpc::Status CheckJob(const std::string& job, const char* rpc);
  void CountRegistration(const std::string& result);
  void CountRefused(const std::string& reason);

  WorkerRegistry* const registry_;
  KvStore* const kv_;
  const Options options_;
  std::atomic<int> pending_kv_waits_{0};
  std::atomic<int> pending_traces_{0};
  absl::Mutex sessions_mu_;
  int live_sessions_ ABSL_GUARDED_BY(sessions_mu_) = 0;
  prometheus::Family<prometheus::Counter>* registrations_ = nullptr;
  prometheus::Family<prometheus::Counter>* refused_ = nullptr;
};

}  // namespace baton

#endif  // BATON_COORDINATOR_GRPC_COORDINATOR_SERVICE_H_
