// GlooCommunicator: the CPU backend of Communicator over Gloo's TCP
// transport (host memory only).
//
// Rendezvous: every rank announces itself in the Store (so a rank that never
// comes is named), then Gloo's connectFullMesh exchanges pair addresses
// through the same Store.
//
// Point-to-point ops bypass Gloo: one TCP connection of our own per pair of
// ranks carries them as frames (tag, length, payload). Send writes what the
// socket takes at once and the thread that calls Work::Wait on it the rest;
// the thread that calls Work::Wait on a receive reads the socket itself,
// straight into its buffer, up to its own frame's end (no notice round
// trip, no hand-off between threads); an I/O thread moves ops nobody waits
// for.
// Messages whose receive is not posted yet are held (bounded). Collectives (ring all-reduce,
// all-gather, reduce-scatter; direct broadcast; all-to-all barrier;
// pairwise all-to-all-v) run one at a time, in call order, on an executor
// thread over Gloo's unbound buffers, so every step knows which peer it
// waits on.
//
// Failure semantics:
//  - Work::Wait(timeout) that expires returns DEADLINE_EXCEEDED naming the
//    op and the rank it waits on; the op stays pending (wait again or Abort).
//  - An op pending longer than `op_timeout` trips the watchdog: that op gets
//    DEADLINE_EXCEEDED, the communicator is aborted.
//  - A peer whose connection breaks (process died, left or aborted) fails
//    the unfinished ops that need it (point-to-point ops with it, every
//    collective) with UNAVAILABLE naming that rank and carrying Gloo's own
//    message; later ops that need it fail fast; ops with other peers go on.
//    A standing receive on a reserved slot per peer notices the break even
//    when Gloo would not tell the op in flight (Gloo never signals a receive
//    whose payload it was reading); such an op fails after a short grace.
//  - Any other Gloo error fails the op with UNAVAILABLE and Gloo's message;
//    a failed collective also aborts the communicator (the group is out of
//    step).
//  - Abort() closes every connection (peers' ops fail at once), completes
//    every pending op with ABORTED at once, and makes later ops fail fast.
//    Once Abort() returns, no buffer is touched by Gloo again, so callers
//    may free them.
//  - Destroying a communicator with ops pending aborts it. Destroying an
//    idle one closes its connections gracefully (data already sent is still
//    delivered) once no Work holds its Gloo buffers.
//
// Thread-safe: ops, Wait and Abort may be called from any thread.
#ifndef BATON_WORKER_COMM_GLOO_COMMUNICATOR_H_
#define BATON_WORKER_COMM_GLOO_COMMUNICATOR_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "worker/comm/communicator.h"
#include "worker/comm/store.h"

namespace gloo::rendezvous {
class Context;
}  // namespace gloo::rendezvous
namespace gloo::transport {
class UnboundBuffer;
}  // namespace gloo::transport

namespace baton::comm {

struct GlooOptions {
  int rank = 0;
  int size = 1;
  std::string label = "gloo";           // names the group in errors
  std::string hostname = "127.0.0.1";   // address this rank listens on
  absl::Duration rendezvous_timeout = absl::Seconds(60);
  absl::Duration op_timeout = absl::Minutes(5);
};

class GlooWork;
class LinkPoller;
class PeerLink;
class Timer;
class WaiterPool;
class SerialExecutor;

class GlooCommunicator : public Communicator {
 public:
  // `store` is scoped to this group and generation (see rendezvous.h) and
  // is only used during Create.
  static absl::StatusOr<std::unique_ptr<GlooCommunicator>> Create(
      Store& store, const GlooOptions& options);
  ~GlooCommunicator() override;

  int rank() const override { return options_.rank; }
  int size() const override { return options_.size; }
  std::string backend() const override { return "gloo"; }

  std::shared_ptr<Work> Send(Buffer buf, int peer, uint64_t tag) override;
  std::shared_ptr<Work> Recv(Buffer buf, int peer, uint64_t tag) override;
  std::shared_ptr<Work> AllReduceSum(Buffer buf) override;
  std::shared_ptr<Work> AllGather(Buffer in, Buffer out) override;
  std::shared_ptr<Work> ReduceScatterSum(Buffer in, Buffer out) override;
  std::shared_ptr<Work> Broadcast(Buffer buf, int root) override;
  std::shared_ptr<Work> Barrier() override;
  // Every pair of ranks first swaps the counts it will exchange (16 bytes
  // each way), so a disagreement fails on both ranks with INVALID_ARGUMENT
  // naming the peer and both counts (and aborts, as any failed collective)
  // instead of reaching Gloo, which cannot take a message of another size.
  std::shared_ptr<Work> AllToAllV(Buffer in, std::vector<int64_t> send_counts, Buffer out,
                                  std::vector<int64_t> recv_counts) override;
  void Abort(absl::string_view reason) override;
  int64_t collective_bytes_sent() const override {
    return collective_bytes_sent_.load(std::memory_order_relaxed);
  }

 private:
  using Collective = std::function<absl::Status(GlooWork&, uint64_t seq)>;

  GlooCommunicator(const GlooOptions& options,
                   std::shared_ptr<gloo::rendezvous::Context> context,
                   std::vector<int> link_fds);

  // Registers a new pending op with `peer` (-1: a collective), or returns it
  // already failed (aborted, or a peer it needs is gone).
  std::shared_ptr<GlooWork> Start(std::string what, int peer);
  std::shared_ptr<Work> PointToPoint(bool send, Buffer buf, int peer, uint64_t tag);
  std::shared_ptr<Work> EnqueueCollective(std::string what, Collective run);
  void Finish(const std::shared_ptr<GlooWork>& work, absl::Status status);
  // Forgets completed ops (point-to-point ops complete in Work::Wait).
  void PruneLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Closes every connection and fails every pending op with `status`;
  // `culprit` (if any) gets `culprit_status` instead.
  void AbortWith(absl::Status status, const GlooWork* culprit,
                 absl::Status culprit_status);
  void WatchdogLoop();
  // Posts the standing receive from `peer` that fails when its connection
  // breaks, and waits for it on a pool thread.
  void WatchPeer(int peer);
  // `peer`'s connection broke: ops that need it fail (after a grace for what
  // Gloo already delivered) and later ones fail fast.
  void PeerBroken(int peer, const absl::Status& cause);

  // Scratch memory of the running collective, reused across collectives to
  // spare allocation and page faults. Executor thread only; a collective
  // that fails aborts the communicator before the next one starts, so Gloo
  // never writes into it late.
  char* ExecutorScratch(int which, size_t bytes);

  absl::Status RingAllReduce(GlooWork& w, uint64_t seq, Buffer buf);
  absl::Status RingAllGather(GlooWork& w, uint64_t seq, Buffer in, Buffer out);
  absl::Status RingReduceScatter(GlooWork& w, uint64_t seq, Buffer in, Buffer out);
  absl::Status DirectBroadcast(GlooWork& w, uint64_t seq, Buffer buf, int root);
  absl::Status AllToAllBarrier(GlooWork& w, uint64_t seq);
  absl::Status PairwiseAllToAllV(GlooWork& w, uint64_t seq, Buffer in,
                                 const std::vector<int64_t>& send_counts, Buffer out,
                                 const std::vector<int64_t>& recv_counts);

  const GlooOptions options_;
  const std::shared_ptr<gloo::rendezvous::Context> context_;

  absl::Mutex mu_;
  bool aborted_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status abort_status_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_collective_ ABSL_GUARDED_BY(mu_) = 0;
  size_t prune_at_ ABSL_GUARDED_BY(mu_) = 64;
  absl::flat_hash_map<const GlooWork*, std::shared_ptr<GlooWork>> pending_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<int, absl::Status> broken_peers_ ABSL_GUARDED_BY(mu_);

  std::shared_ptr<Timer> timer_;  // Wait deadlines and hand-offs to waiters_
  std::unique_ptr<WaiterPool> waiters_;
  std::unique_ptr<SerialExecutor> collectives_;
  // Point-to-point connections, indexed by peer (null for this rank), and
  // the I/O thread that serves them.
  std::unique_ptr<LinkPoller> poller_;
  std::vector<std::shared_ptr<PeerLink>> links_;
  std::vector<char> executor_scratch_[2];
  std::atomic<int64_t> collective_bytes_sent_{0};
  // Standing receives, indexed by peer (see WatchPeer), and their target.
  std::vector<char> sentinel_bytes_;
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> sentinels_;
  std::thread watchdog_;
};

}  // namespace baton::comm

#endif  // BATON_WORKER_COMM_GLOO_COMMUNICATOR_H_
