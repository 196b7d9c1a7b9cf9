// DeviceStagingCommunicator: lets a host-memory communicator (Gloo) carry
// CUDA device buffers by staging them through pinned host memory: inputs are
// copied device-to-host before the op is posted, outputs host-to-device when
// Wait() first sees the op succeed. Host buffers pass straight through.
//
// Pinned buffers are reused across ops; one whose op is dropped unfinished
// is kept until that op completes (or the communicator is aborted), so the
// inner communicator never writes into reused memory. Thread-safe.
#ifndef BATON_WORKER_COMM_DEVICE_STAGING_COMMUNICATOR_H_
#define BATON_WORKER_COMM_DEVICE_STAGING_COMMUNICATOR_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "worker/comm/communicator.h"

namespace baton::comm {

class PinnedArena;

class DeviceStagingCommunicator : public Communicator {
 public:
  explicit DeviceStagingCommunicator(std::unique_ptr<Communicator> host);
  ~DeviceStagingCommunicator() override;

  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  std::string backend() const override { return host_->backend(); }

  std::shared_ptr<Work> Send(Buffer buf, int peer, uint64_t tag) override;
  std::shared_ptr<Work> Recv(Buffer buf, int peer, uint64_t tag) override;
  std::shared_ptr<Work> AllReduceSum(Buffer buf) override;
  std::shared_ptr<Work> AllGather(Buffer in, Buffer out) override;
  std::shared_ptr<Work> ReduceScatterSum(Buffer in, Buffer out) override;
  std::shared_ptr<Work> Broadcast(Buffer buf, int root) override;
  std::shared_ptr<Work> Barrier() override;
  // Checks the arguments (CheckAllToAllVArgs) before it stages, so that no
  // pinned buffer is sized from unchecked counts.
  std::shared_ptr<Work> AllToAllV(Buffer in, std::vector<int64_t> send_counts, Buffer out,
                                  std::vector<int64_t> recv_counts) override;
  void Abort(absl::string_view reason) override;
  int64_t collective_bytes_sent() const override { return host_->collective_bytes_sent(); }

 private:
  const std::unique_ptr<Communicator> host_;
  const std::shared_ptr<PinnedArena> arena_;
};

}  // namespace baton::comm

#endif  // BATON_WORKER_COMM_DEVICE_STAGING_COMMUNICATOR_H_
