// Collectives ordered on a stream (DESIGN.md section 10): the tensor-parallel
// all-reduces and all-gathers inside a stage's forward and backward, the
// tied-embedding sum and the data-parallel gradient reduction run as work on
// a stream, after the work enqueued on it before and before the work enqueued
// after, with no host wait.
//
// Over a host communicator (Gloo, in-process) the op is one host function on
// the stream (kernels::Stream::LaunchHostFunc: the CPU runs it inline, the
// simulated device on the stream's thread) that posts the op and waits for
// it, at most the op timeout. Over a communicator whose ops run on CUDA
// streams (NCCL) it is the NCCL op on the stream
// (Communicator::AllReduceSumOnStream / AllGatherOnStream /
// ReduceScatterSumOnStream), its Work kept in
// the StreamCommStatus. CUDA memory over a host communicator (Gloo staging
// through pinned memory) cannot be reached from a stream: CanEnqueue refuses
// it, and the caller synchronises and waits on the host instead.
//
// Order: every rank must post a communicator's collectives in the same
// order. One stream keeps its own order; callers that enqueue on one
// communicator from several streams (the chunks of an interleaved rank share
// its TP group) share its StreamCollectives (For), which, when the stream
// changes, makes the new stream wait for the previous one's work enqueued so
// far, so the collectives run in call order (a wait only on earlier-enqueued
// work: no cycle).
//
// Errors (as comm/stream_p2p.h): the first failing op's status
// (DEADLINE_EXCEEDED after the op timeout, ABORTED, ...) prefixed with the
// op's `name` goes to the StreamCommStatus, which the caller reads after a
// host wait that covers the stream; once it holds an error, later host ops
// of it post nothing (the peers time out rather than pair with the wrong
// op). An op whose outcome is already known when it is enqueued (run inline,
// as on the CPU; refused at once; after an earlier failure of `status` on the
// host path) also returns its error, so a CPU step fails where it did when
// collectives waited on the host.
//
// Thread-safe; the streams' own rule holds (one thread enqueues on a stream
// at a time). The communicator must outlive the streams' work.
#ifndef BATON_WORKER_COMM_STREAM_COLLECTIVES_H_
#define BATON_WORKER_COMM_STREAM_COLLECTIVES_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/backend.h"
#include "worker/comm/communicator.h"
#include "worker/comm/stream_p2p.h"

namespace baton::comm {

class StreamCollectives {
 public:
  // The instance of `comm` shared by every caller holding one (a new one
  // when none is alive).
  static std::shared_ptr<StreamCollectives> For(Communicator& comm);
  // The live instance of `comm`, or null when nobody holds one.
  static std::shared_ptr<StreamCollectives> Find(const Communicator& comm);
  explicit StreamCollectives(Communicator& comm) : comm_(comm) {}

  Communicator& communicator() const { return comm_; }
  // Whether `buf` can be reduced from a stream over this communicator: host
  // memory over a host communicator, CUDA memory over one that runs on CUDA
  // streams.
  bool CanEnqueue(const Buffer& buf) const;

  // In-place sum of `buf` over the group, on `stream`. INVALID_ARGUMENT
  // (nothing enqueued) where CanEnqueue refuses; see Errors above.
  absl::Status AllReduceSum(Buffer buf, std::string name, kernels::Stream& stream, absl::Duration timeout,
                            const std::shared_ptr<StreamCommStatus>& status);
  // `out` (size() * in.count elements) receives every rank's `in`, on `stream`.
  absl::Status AllGather(Buffer in, Buffer out, std::string name, kernels::Stream& stream,
                         absl::Duration timeout, const std::shared_ptr<StreamCommStatus>& status);
  // `out` receives rank()'s part of the sum of every rank's `in` (size() *
  // out.count elements), on `stream`.
  absl::Status ReduceScatterSum(Buffer in, Buffer out, std::string name, kernels::Stream& stream,
                                absl::Duration timeout, const std::shared_ptr<StreamCommStatus>& status);

  // From now on, times every op enqueued on a CUDA stream (NCCL) by an event
  // pair around it on its stream, for TakeStreamSeconds. Off by default: the
  // pairs are reused only once taken or forgotten, so whoever turns it on
  // (the TP group's owner) must take or forget them after every step. Groups
  // timed otherwise (the DP all-reduce by its own stream's events) or not at
  // all leave it off and create no event.
  void TimeOpsOnStreams();
  // Event pairs held (created once, reused step after step), for tests.
  size_t event_pairs() const;

  // Seconds the timed ops enqueued on CUDA streams took, since the last
  // call; forgets them. Their
  // time is in no host wait, so the communicator's own clock
  // (TimedCommunicator) never sees it. Call after a host wait that covers
  // every stream they were enqueued on. The host path's ops are not counted
  // here: their host function's wait is the communicator's.
  absl::StatusOr<double> TakeStreamSeconds();
  // Forgets the timed ops unread (after a failed step, whose ops may never
  // have run).
  void ForgetStreamSeconds();

 private:
  absl::Status Enqueue(kernels::Stream& stream, std::string name, absl::Duration timeout,
                       const std::shared_ptr<StreamCommStatus>& status,
                       std::function<std::shared_ptr<Work>()> post,
                       const std::function<std::shared_ptr<Work>(void*)>& post_on_stream);
  // Makes `stream` wait for the previous stream's work when it changes.
  absl::Status FollowLastStream(kernels::Stream& stream) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  struct Timer {
    std::unique_ptr<kernels::Event> start, end;
  };
  // The next unused event pair (reused step after step: no event is created
  // once the first step has run).
  absl::StatusOr<Timer*> NextTimer(kernels::Device device) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Communicator& comm_;
  mutable absl::Mutex mu_;  // held while enqueuing, so the order is the call order
  kernels::Stream* last_stream_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::unique_ptr<kernels::Event> handoff_ ABSL_GUARDED_BY(mu_);
  bool timed_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<Timer> timers_ ABSL_GUARDED_BY(mu_);
  size_t timers_used_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace baton::comm

#endif  // BATON_WORKER_COMM_STREAM_COLLECTIVES_H_
