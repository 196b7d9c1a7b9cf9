// Stream-ordered point-to-point (DESIGN.md section 10): a batch of sends and
// receives runs as work on a communication stream, after the producers'
// events the caller made that stream wait for, and before the work the
// caller enqueues after it (consumers wait on an event recorded after the
// batch). The host does not wait for the batch.
//
// Over a communicator whose ops run on CUDA streams (NCCL) the batch is one
// group on the stream (Communicator::GroupOnStream), its Work kept in the
// StreamCommStatus. Over a host communicator (Gloo, in-process) the batch is one host function
// on the stream (kernels::Stream::LaunchHostFunc): it posts every op, then
// waits for each, every wait bounded by the op timeout. That carries host
// memory only, the simulated device's included (host memory that only its
// streams touch, which is what runs the function); CUDA memory needs a
// communicator whose ops run on CUDA streams (NCCL); every buffer of an NCCL
// group (the post-time stamps too) must be CUDA memory. Nothing of a batch
// runs on the host over NCCL: what the ops carry (the executor's post-time
// stamps included, kernels::StampTime) is written by work on the stream.
//
// Errors: the first failing op's status (DEADLINE_EXCEEDED, ABORTED, ...,
// with the op's name as context) is kept in a StreamCommStatus, which the
// caller reads after a host wait that covers the batch. Once it holds an
// error, later batches on it post nothing (their peers time out instead of
// receiving garbage), so a stream never blocks for more than about one op
// timeout after a failure.
#ifndef BATON_WORKER_COMM_STREAM_P2P_H_
#define BATON_WORKER_COMM_STREAM_P2P_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/backend.h"
#include "worker/comm/communicator.h"

namespace baton::comm {

// The first error of the ops run on a stream. Thread-safe.
class StreamCommStatus {
 public:
  // Keeps `status` unless an error is already kept (or it is OK).
  void Fail(absl::Status status);
  absl::Status status() const;
  // Whether an error is kept already: a failed host batch or a group refused
  // at once. It does not look at tracked groups (they may still be in
  // flight), so it may be called at any time.
  bool failed() const;
  // Keeps a stream-ordered group's Work (NCCL); status() includes its
  // outcome, so read status() only after a host wait that covers the stream.
  void Track(std::shared_ptr<Work> work);
  // Forgets the error and the tracked groups; call only while no op of it is
  // enqueued.
  void Reset();

 private:
  mutable absl::Mutex mu_;
  mutable absl::Status status_ ABSL_GUARDED_BY(mu_);
  mutable std::vector<std::shared_ptr<Work>> tracked_ ABSL_GUARDED_BY(mu_);
};

// Whether EnqueueP2P can carry `buf` over `comm`: host memory over a host
// communicator, CUDA memory over one that runs on CUDA streams.
bool CanEnqueueP2P(const Communicator& comm, const Buffer& buf);

// Enqueues `ops` as one batch on `stream`: over NCCL one group
// (Communicator::GroupOnStream), else one host function. When the stream
// reaches it every op is posted and each is waited for (at most `timeout`
// each); the first failure goes to `status`. `comm` must outlive the
// stream's work.
// INVALID_ARGUMENT (nothing enqueued) for a buffer CanEnqueueP2P refuses; the
// stream's error if the function could not be enqueued.
absl::Status EnqueueP2P(Communicator& comm, std::vector<P2POp> ops, kernels::Stream& stream,
                        absl::Duration timeout, std::shared_ptr<StreamCommStatus> status);

// Whether EnqueueAllReduce can sum `buf` over `comm`: host memory over a host
// communicator (an NCCL all-reduce on a caller's stream is not wired).
bool CanEnqueueAllReduce(const Communicator& comm, const Buffer& buf);

// A host communicator's in-place sum of `buf` as one host function on
// `stream`, waited for at most `timeout`; its failure goes to `status`
// with `name` as context. INVALID_ARGUMENT (nothing enqueued) where
// CanEnqueueAllReduce refuses. `comm` must outlive the stream's work.
absl::Status EnqueueAllReduce(Communicator& comm, Buffer buf, std::string name, kernels::Stream& stream,
                              absl::Duration timeout, std::shared_ptr<StreamCommStatus> status);

}  // namespace baton::comm

#endif  // BATON_WORKER_COMM_STREAM_P2P_H_
