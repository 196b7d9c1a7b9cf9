// WorkerRegistry: who the workers are, their incarnations and leases.
//
// States (proto WorkerState): JOINING after Register, READY once its Session
// stream is open and heartbeats arrive within the lease, LOST when the stream
// breaks or the lease expires, DRAINING after a goodbye, LEFT when a drained
// session closes. A LOST incarnation never comes back: the worker registers
// again (same name, new incarnation) and becomes READY.
//
// A name held by a live incarnation (JOINING, READY or DRAINING within its
// lease) is not taken over: Register is ALREADY_EXISTS naming the holder's
// host and pid. Once the holder's stream broke or its lease ran out, a new
// registration replaces it (so restarted workers come back by themselves).
// LOST and LEFT entries are forgotten `forget_after` after they ended, and
// at most `max_workers` names are held.
//
// Pause tolerance: if ExpireLeases runs after a gap longer than the lease
// (the coordinator itself was stopped: SIGSTOP, a VM migration, a long
// stall), every lease is extended instead of every worker being evicted.
//
// Thread-safe. Time comes from the injected Clock; sessions are closed by the
// caller (outside the lock) from the handles this class returns.
#ifndef BATON_COORDINATOR_WORKER_REGISTRY_H_
#define BATON_COORDINATOR_WORKER_REGISTRY_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "baton/v1/coordinator.pb.h"
#include "common/worker_identity.h"  // IsValidDevice, ValidateWorkerName
#include "common/clock.h"

namespace baton {

// The coordinator's end of one worker's Session stream.
class SessionHandle {
 public:
  virtual ~SessionHandle() = default;
  // Ends the stream; `reason` is logged. Safe to call more than once.
  virtual void Close(const absl::Status& reason) = 0;
  // Pushes a command; false when the stream is gone.
  virtual bool Send(const v1::CoordinatorMessage& message) = 0;
};

struct RegistryLimits {
  int max_workers = 4096;                           // names held at once, live or not
  absl::Duration forget_after = absl::Minutes(10);  // LOST/LEFT entries are dropped after this
};

class WorkerRegistry {
 public:
  // Ids and incarnations start at `first_id` (pass something time-based so a
  // restarted coordinator never reuses the ids of its previous life).
  using Limits = RegistryLimits;
  WorkerRegistry(Clock* clock, absl::Duration lease, int64_t first_id = 1, Limits limits = Limits());

  struct Registration {
    v1::RegisterResponse response;
    // The name's previous incarnation (its stream broke or its lease ran
    // out) was replaced; `replaced` is its session to close, if any.
    bool replaced_previous = false;
    std::shared_ptr<SessionHandle> replaced;
  };

  // INVALID_ARGUMENT for a malformed request (the field is named),
  // ALREADY_EXISTS when a live incarnation holds the name (the message names
  // its host and pid), RESOURCE_EXHAUSTED when `max_workers` names are held.
  absl::StatusOr<Registration> Register(const v1::RegisterRequest& request, absl::Duration heartbeat);

  // Binds a session to (worker_id, incarnation): JOINING -> READY.
  // NOT_FOUND for an unknown id, FAILED_PRECONDITION for a stale incarnation
  // or a LOST worker (it must register again).
  absl::Status OpenSession(int64_t worker_id, int64_t incarnation, std::shared_ptr<SessionHandle> session);

  // Renews the lease. Same errors as OpenSession.
  absl::Status Heartbeat(int64_t worker_id, int64_t incarnation, const v1::Heartbeat& heartbeat);
  // Renews the lease for any other message on the session (a worker leaves
  // heartbeats out while it sends others); `step` >= 0 is the worker's step
  // (a StepReport's). Same errors as OpenSession.
  absl::Status Renew(int64_t worker_id, int64_t incarnation, int64_t step);

  // The worker is leaving on purpose: READY -> DRAINING.
  absl::Status Goodbye(int64_t worker_id, int64_t incarnation);

  // The stream of `session` ended: READY/JOINING -> LOST, DRAINING -> LEFT.
  // Ignored when `session` is no longer the worker's current one. Returns the
  // worker's name when it became LOST or LEFT, else "".
  std::string SessionEnded(int64_t worker_id, int64_t incarnation, const SessionHandle* session);

  struct Expired {
    std::string name;
    std::shared_ptr<SessionHandle> session;  // to close; may be null
  };
  // Marks workers whose lease ran out LOST and returns them; forgets LOST
  // and LEFT entries older than `forget_after`. When the previous call was
  // longer than the lease ago (this process was paused), extends every lease
  // instead, returns nothing and sets *stalled to the gap.
  std::vector<Expired> ExpireLeases(absl::Duration* stalled = nullptr);

  // Name of a worker id ("" if unknown).
  std::string NameOf(int64_t worker_id) const;

  // The current session of worker `name` (null when it has none).
  std::shared_ptr<SessionHandle> SessionOf(const std::string& name) const;

  // The current sessions of `names`, in order (null where one has none);
  // one lock for all.
  std::vector<std::shared_ptr<SessionHandle>> SessionsOf(const std::vector<std::string>& names) const;

  // Every session (to tell all peers on shutdown).
  std::vector<std::shared_ptr<SessionHandle>> Sessions() const;

  std::vector<v1::WorkerInfo> List() const;
  std::map<v1::WorkerState, int> CountByState() const;
  absl::Duration lease() const { return lease_; }

 private:
  struct Worker {
    v1::WorkerInfo info;  // state, ids, host, device, step; age computed on List()
    int64_t pid = 0;
    absl::Time last_heartbeat;
    absl::Time ended;  // when it became LOST or LEFT
    std::shared_ptr<SessionHandle> session;
  };

  absl::StatusOr<Worker*> FindLocked(int64_t worker_id, int64_t incarnation) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Clock* const clock_;
  const absl::Duration lease_;
  const Limits limits_;
  mutable absl::Mutex mu_;
  int64_t next_id_ ABSL_GUARDED_BY(mu_);
  absl::Time last_sweep_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Worker> by_name_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<int64_t, std::string> name_of_id_ ABSL_GUARDED_BY(mu_);
};

}  // namespace baton

#endif  // BATON_COORDINATOR_WORKER_REGISTRY_H_
