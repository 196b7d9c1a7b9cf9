// TimedCommunicator: wraps a Communicator and adds up the time its callers
// spend blocked in Work::Wait, so code that communicates inside a compute op
// (Megatron's TP all-reduces inside a stage's forward) can report that time
// as communication rather than compute. Thread-safe.
#ifndef BATON_WORKER_COMM_TIMED_COMMUNICATOR_H_
#define BATON_WORKER_COMM_TIMED_COMMUNICATOR_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "worker/comm/communicator.h"
#include "worker/comm/forwarding_communicator.h"

namespace baton::comm {

class TimedCommunicator : public ForwardingCommunicator {
 public:
  explicit TimedCommunicator(Communicator* inner) : ForwardingCommunicator(inner) {}

  // Seconds spent in Wait() since construction.
  double waited_seconds() const { return waited_ns_.load() * 1e-9; }
  // The part of it spent waiting for all-gathers, and for reduce-scatters
  // (sequence parallelism's collectives, and the vocabulary-parallel loss's
  // gather), so they can be told apart from all-reduces.
  double all_gather_seconds() const { return all_gather_ns_.load() * 1e-9; }
  double reduce_scatter_seconds() const { return reduce_scatter_ns_.load() * 1e-9; }
  // Payload bytes posted with Send since construction (point-to-point
  // traffic, which collective_bytes_sent leaves out: context parallelism's
  // ring).
  int64_t p2p_bytes_sent() const { return p2p_bytes_.load(); }

  std::shared_ptr<Work> Send(Buffer buf, int peer, uint64_t tag) override {
    p2p_bytes_.fetch_add(static_cast<int64_t>(buf.bytes()));
    return Wrap(inner()->Send(buf, peer, tag));
  }
  std::shared_ptr<Work> Recv(Buffer buf, int peer, uint64_t tag) override { return Wrap(inner()->Recv(buf, peer, tag)); }
  std::shared_ptr<Work> AllReduceSum(Buffer buf) override { return Wrap(inner()->AllReduceSum(buf)); }
  std::shared_ptr<Work> AllGather(Buffer in, Buffer out) override {
    return Wrap(inner()->AllGather(in, out), &all_gather_ns_);
  }
  std::shared_ptr<Work> ReduceScatterSum(Buffer in, Buffer out) override {
    return Wrap(inner()->ReduceScatterSum(in, out), &reduce_scatter_ns_);
  }
  std::shared_ptr<Work> Broadcast(Buffer buf, int root) override { return Wrap(inner()->Broadcast(buf, root)); }
  std::shared_ptr<Work> Barrier() override { return Wrap(inner()->Barrier()); }
  std::shared_ptr<Work> AllToAllV(Buffer in, std::vector<int64_t> send_counts, Buffer out,
                                  std::vector<int64_t> recv_counts) override {
    return Wrap(inner()->AllToAllV(in, std::move(send_counts), out, std::move(recv_counts)));
  }
  // Stream-ordered ops pass through untimed (ForwardingCommunicator):
  // nothing waits for them on the host (their time is the stream's).

 private:
  // Its Wait adds to waited_ns_, and to `also` when not null.
  std::shared_ptr<Work> Wrap(std::shared_ptr<Work> work, std::atomic<int64_t>* also = nullptr);

  std::atomic<int64_t> waited_ns_{0};
  std::atomic<int64_t> all_gather_ns_{0}, reduce_scatter_ns_{0};
  std::atomic<int64_t> p2p_bytes_{0};
};

}  // namespace baton::comm

#endif  // BATON_WORKER_COMM_TIMED_COMMUNICATOR_H_
