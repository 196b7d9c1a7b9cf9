// FakeStreamCommunicator: a test communicator whose ops run on streams, as
// NCCL's do (RunsOnStreams), for the stream-ordered p2p and collectives
// without a GPU. Host ops are refused (counted in `refused`).
#ifndef BATON_WORKER_COMM_FAKE_STREAM_COMMUNICATOR_H_
#define BATON_WORKER_COMM_FAKE_STREAM_COMMUNICATOR_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kernels/backend.h"
#include "worker/comm/communicator.h"

namespace baton::comm {

class FakeStreamCommunicator : public Communicator {
 public:
  // A group or collective the device has not finished yet (as an NCCL op
  // behind a long kernel): waiting for it times out until `done` is set.
  class InFlightWork : public Work {
   public:
    absl::Status Wait(absl::Duration) override {
      if (done) return absl::OkStatus();
      return absl::DeadlineExceededError("the group is still running");
    }
    bool IsCompleted() override { return done; }
    bool done = false;
  };

  int rank() const override { return 0; }
  int size() const override { return 2; }
  std::string backend() const override { return "fake-stream"; }
  std::shared_ptr<Work> Send(Buffer, int, uint64_t) override { return Refuse(); }
  std::shared_ptr<Work> Recv(Buffer, int, uint64_t) override { return Refuse(); }
  std::shared_ptr<Work> AllReduceSum(Buffer) override { return Refuse(); }
  std::shared_ptr<Work> AllGather(Buffer, Buffer) override { return Refuse(); }
  std::shared_ptr<Work> ReduceScatterSum(Buffer, Buffer) override { return Refuse(); }
  std::shared_ptr<Work> Broadcast(Buffer, int) override { return Refuse(); }
  std::shared_ptr<Work> Barrier() override { return Refuse(); }
  std::shared_ptr<Work> AllToAllV(Buffer, std::vector<int64_t>, Buffer, std::vector<int64_t>) override {
    return Refuse();
  }
  void Abort(absl::string_view) override {}
  bool RunsOnStreams() const override { return true; }

  // Records the group and its stream; complete at once unless `in_flight`.
  std::shared_ptr<Work> GroupOnStream(const std::vector<P2POp>& ops, void* stream) override {
    groups.push_back(ops);
    streams.push_back(stream);
    return Posted();
  }
  // Work of `op_time` on `kernel_stream` (a host function standing for the
  // NCCL kernel; `stream` must be its native handle).
  std::shared_ptr<Work> AllReduceSumOnStream(Buffer, void* stream) override {
    streams.push_back(stream);
    if (kernel_stream != nullptr) {
      const absl::Duration takes = op_time;
      (void)kernel_stream->LaunchHostFunc([takes] { absl::SleepFor(takes); });
    }
    return Posted();
  }

  bool in_flight = false;  // ops stay in flight until their `done` is set
  kernels::Stream* kernel_stream = nullptr;
  absl::Duration op_time;
  std::vector<std::shared_ptr<InFlightWork>> works;
  std::vector<std::vector<P2POp>> groups;
  std::vector<void*> streams;
  int refused = 0;

 private:
  std::shared_ptr<Work> Posted() {
    if (!in_flight) return CompletedWork(absl::OkStatus());
    auto work = std::make_shared<InFlightWork>();
    works.push_back(work);
    return work;
  }
  std::shared_ptr<Work> Refuse() {
    ++refused;
    return CompletedWork(absl::UnimplementedError("host op on a stream communicator"));
  }
};

}  // namespace baton::comm

#endif  // BATON_WORKER_COMM_FAKE_STREAM_COMMUNICATOR_H_
