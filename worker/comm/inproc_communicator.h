// InProcCommunicator: a Communicator whose ranks are threads of one process,
// for tests of logic that runs over a group (tensor-parallel layers, pipeline
// hand-offs) without sockets or devices.
//
// A group of N ranks shares one state. Collectives match by call order: the
// k-th collective a rank posts meets the k-th of every other rank (as with
// NCCL), and the last rank to arrive performs it. Reductions add the ranks'
// buffers in rank order (((r0 + r1) + r2) + ...) and copy that one result to
// every rank, so all ranks get identical bits, run after run. Send/Recv match
// on (sender, receiver, tag) in posting order and complete when both sides
// have posted. Host buffers only.
//
// Wait(timeout) returns DEADLINE_EXCEEDED naming the op; the op stays posted.
// Abort() on any rank completes with ABORTED every pending op that involves
// that rank (every pending collective, and point-to-point ops to or from it);
// later such ops fail at once. Thread-safe: one mutex guards the group.
#ifndef BATON_WORKER_COMM_INPROC_COMMUNICATOR_H_
#define BATON_WORKER_COMM_INPROC_COMMUNICATOR_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "worker/comm/communicator.h"

namespace baton::comm {

class InProcGroupState;

class InProcCommunicator : public Communicator {
 public:
  // Makes the `size` communicators of one group; element r is rank r.
  static std::vector<std::unique_ptr<InProcCommunicator>> CreateGroup(int size);

  InProcCommunicator(std::shared_ptr<InProcGroupState> group, int rank);

  int rank() const override { return rank_; }
  int size() const override;
  std::string backend() const override { return "inproc"; }

  std::shared_ptr<Work> Send(Buffer buf, int peer, uint64_t tag) override;
  std::shared_ptr<Work> Recv(Buffer buf, int peer, uint64_t tag) override;
  std::shared_ptr<Work> AllReduceSum(Buffer buf) override;
  std::shared_ptr<Work> AllGather(Buffer in, Buffer out) override;
  std::shared_ptr<Work> ReduceScatterSum(Buffer in, Buffer out) override;
  std::shared_ptr<Work> Broadcast(Buffer buf, int root) override;
  std::shared_ptr<Work> Barrier() override;
  // Checks that every pair of ranks agrees on its counts (INVALID_ARGUMENT
  // on every rank otherwise) before it copies.
  std::shared_ptr<Work> AllToAllV(Buffer in, std::vector<int64_t> send_counts, Buffer out,
                                  std::vector<int64_t> recv_counts) override;
  void Abort(absl::string_view reason) override;

 private:
  std::shared_ptr<InProcGroupState> group_;
  int rank_;
};

}  // namespace baton::comm

#endif  // BATON_WORKER_COMM_INPROC_COMMUNICATOR_H_
