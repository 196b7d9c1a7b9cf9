// ForwardingCommunicator: a Communicator that hands every op to another one,
// for wrappers that watch or change a few ops (record them, time them) and
// pass the rest through. Thread-safety: that of `inner`.
#ifndef BATON_WORKER_COMM_FORWARDING_COMMUNICATOR_H_
#define BATON_WORKER_COMM_FORWARDING_COMMUNICATOR_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "worker/comm/communicator.h"

namespace baton::comm {

class ForwardingCommunicator : public Communicator {
 public:
  // `inner` must outlive this.
  explicit ForwardingCommunicator(Communicator* inner) : inner_(inner) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string backend() const override { return inner_->backend(); }
  std::shared_ptr<Work> Send(Buffer buf, int peer, uint64_t tag) override { return inner_->Send(buf, peer, tag); }
  std::shared_ptr<Work> Recv(Buffer buf, int peer, uint64_t tag) override { return inner_->Recv(buf, peer, tag); }
  std::shared_ptr<Work> AllReduceSum(Buffer buf) override { return inner_->AllReduceSum(buf); }
  std::shared_ptr<Work> AllGather(Buffer in, Buffer out) override { return inner_->AllGather(in, out); }
  std::shared_ptr<Work> ReduceScatterSum(Buffer in, Buffer out) override { return inner_->ReduceScatterSum(in, out); }
  std::shared_ptr<Work> Broadcast(Buffer buf, int root) override { return inner_->Broadcast(buf, root); }
  std::shared_ptr<Work> Barrier() override { return inner_->Barrier(); }
  std::shared_ptr<Work> AllToAllV(Buffer in, std::vector<int64_t> send_counts, Buffer out,
                                  std::vector<int64_t> recv_counts) override {
    return inner_->AllToAllV(in, std::move(send_counts), out, std::move(recv_counts));
  }
  void Abort(absl::string_view reason) override { inner_->Abort(reason); }
  int64_t collective_bytes_sent() const override { return inner_->collective_bytes_sent(); }
  bool RunsOnStreams() const override { return inner_->RunsOnStreams(); }
  std::shared_ptr<Work> GroupOnStream(const std::vector<P2POp>& ops, void* stream) override {
    return inner_->GroupOnStream(ops, stream);
  }
  std::shared_ptr<Work> AllReduceSumOnStream(Buffer buf, void* stream) override {
    return inner_->AllReduceSumOnStream(buf, stream);
  }
  std::shared_ptr<Work> AllGatherOnStream(Buffer in, Buffer out, void* stream) override {
    return inner_->AllGatherOnStream(in, out, stream);
  }
  std::shared_ptr<Work> ReduceScatterSumOnStream(Buffer in, Buffer out, void* stream) override {
    return inner_->ReduceScatterSumOnStream(in, out, stream);
  }

 protected:
  Communicator* inner() const { return inner_; }

 private:
  Communicator* const inner_;
};

}  // namespace baton::comm

#endif  // BATON_WORKER_COMM_FORWARDING_COMMUNICATOR_H_
