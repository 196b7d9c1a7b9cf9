// NcclCommunicator: the GPU backend of Communicator over NCCL. Buffers are
// device memory on `device`; every op runs on one CUDA stream owned by the
// communicator, in call order.
//
// Rendezvous: all ranks announce themselves in the Store (so a missing rank
// is named), rank 0 creates the NCCL unique id and publishes it under
// "nccl/unique_id", and every rank joins with ncclCommInitRankConfig in
// non-blocking mode (blocking = 0), polled until ready or the rendezvous
// deadline.
//
// AllToAllV is one ncclGroupStart/End of an ncclSend and an ncclRecv per
// peer with a non-zero count (this rank's own chunk included), as c10d's
// all-to-all; the ranks' counts must agree, which NCCL does not check.
//
// Point-to-point ops each run in a ncclGroupStart/End; NCCL matches them by
// issue order per peer, not by tag, so both sides must post their sends and
// receives to one peer in the same order (the schedule's lowering does).
// GroupOnStream posts a batch of them as one group on the caller's stream
// (stream-ordered p2p, comm/stream_p2p.h); its Work is watched like any op.
//
// Failure semantics (as in gloo_communicator.h): Wait(timeout) that expires
// returns DEADLINE_EXCEEDED naming the op (and peer); a watchdog thread
// polls ncclCommGetAsyncError and each op's age, and on an NCCL error or an
// op older than `op_timeout` it calls ncclCommAbort and fails every pending
// op. Abort() does the same at once; later ops fail fast.
//
// Thread-safe.
#ifndef BATON_WORKER_COMM_NCCL_COMMUNICATOR_H_
#define BATON_WORKER_COMM_NCCL_COMMUNICATOR_H_

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "worker/comm/communicator.h"
#include "worker/comm/store.h"

namespace baton::comm {

struct NcclOptions {
  int rank = 0;
  int size = 1;
  int device = 0;  // CUDA device ordinal this rank's buffers live on
  std::string label = "nccl";
  absl::Duration rendezvous_timeout = absl::Seconds(60);
  absl::Duration op_timeout = absl::Minutes(5);
};

class NcclWork;

class NcclCommunicator : public Communicator {
 public:
  // `store` is scoped to this group and generation; only used during Create.
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(Store& store,
                                                                  const NcclOptions& options);
  ~NcclCommunicator() override;

  int rank() const override { return options_.rank; }
  int size() const override { return options_.size; }
  std::string backend() const override { return "nccl"; }

  std::shared_ptr<Work> Send(Buffer buf, int peer, uint64_t tag) override;
  std::shared_ptr<Work> Recv(Buffer buf, int peer, uint64_t tag) override;
  std::shared_ptr<Work> AllReduceSum(Buffer buf) override;
  std::shared_ptr<Work> AllGather(Buffer in, Buffer out) override;
  std::shared_ptr<Work> ReduceScatterSum(Buffer in, Buffer out) override;
  std::shared_ptr<Work> Broadcast(Buffer buf, int root) override;
  std::shared_ptr<Work> Barrier() override;
  std::shared_ptr<Work> AllToAllV(Buffer in, std::vector<int64_t> send_counts, Buffer out,
                                  std::vector<int64_t> recv_counts) override;
  void Abort(absl::string_view reason) override;
  // Counted when a collective is enqueued, as the ring volume (bus bytes).
  int64_t collective_bytes_sent() const override { return bus_bytes_.load(std::memory_order_relaxed); }

  bool RunsOnStreams() const override { return true; }
  std::shared_ptr<Work> GroupOnStream(const std::vector<P2POp>& ops, void* stream) override;
  // On the caller's stream (comm/stream_collectives.h); in place / out.count
  // == size() * in.count as AllReduceSum / AllGather; in.count == size() *
  // out.count as ReduceScatterSum.
  std::shared_ptr<Work> AllReduceSumOnStream(Buffer buf, void* stream) override;
  std::shared_ptr<Work> AllGatherOnStream(Buffer in, Buffer out, void* stream) override;
  std::shared_ptr<Work> ReduceScatterSumOnStream(Buffer in, Buffer out, void* stream) override;

 private:
  NcclCommunicator(const NcclOptions& options, ncclComm_t comm, cudaStream_t stream,
                   void* barrier_word);
  // The communicator over an initialised `comm`: creates its stream and
  // barrier word; on failure aborts `comm` and frees what it made.
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Wrap(const NcclOptions& options,
                                                                 ncclComm_t comm);

  // Runs `launch` (NCCL calls on `stream`, by default stream_) and records
  // the op's completion event on it; `peer` is -1 for collectives.
  std::shared_ptr<Work> Issue(std::string what, int peer,
                              const std::function<ncclResult_t()>& launch,
                              cudaStream_t stream = nullptr);
  // Polls a non-blocking communicator until it leaves ncclInProgress, an
  // abort is requested or `deadline` passes.
  ncclResult_t AwaitReady(ncclResult_t result, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckDevice(const Buffer& b, absl::string_view what) const;
  // An all-gather's (`gather`: out holds size() pieces of in) or a
  // reduce-scatter's (in holds size() pieces of out) buffers: both on this
  // device, of one dtype.
  absl::Status CheckPieces(const Buffer& in, const Buffer& out, absl::string_view what, bool gather) const;
  void CountBusBytes(int64_t bytes) { bus_bytes_.fetch_add(bytes, std::memory_order_relaxed); }
  // Ring volume: an all-reduce of `bytes` sends 2(n-1)/n of them; an
  // all-gather (and a reduce-scatter) of `per_rank` bytes a rank (n-1) times.
  void CountAllReduceBytes(size_t bytes) {
    CountBusBytes(2 * static_cast<int64_t>(options_.size - 1) * static_cast<int64_t>(bytes) / options_.size);
  }
  void CountAllGatherBytes(size_t per_rank) {
    CountBusBytes(static_cast<int64_t>(options_.size - 1) * static_cast<int64_t>(per_rank));
  }
  void AbortWith(absl::Status status, const NcclWork* culprit, absl::Status culprit_status);
  void WatchdogLoop();

  const NcclOptions options_;
  void* const barrier_word_;  // one device float Barrier all-reduces

  // Serializes NCCL calls on comm_ and its teardown.
  absl::Mutex mu_;
  ncclComm_t comm_ ABSL_GUARDED_BY(mu_);
  cudaStream_t stream_ ABSL_GUARDED_BY(mu_);
  bool aborted_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status abort_status_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::shared_ptr<NcclWork>> pending_ ABSL_GUARDED_BY(mu_);
  // Lets Abort() and the watchdog cut short a poll that holds mu_.
  std::atomic<bool> abort_requested_{false};
  std::atomic<int64_t> bus_bytes_{0};  // collective_bytes_sent()
  std::thread watchdog_;

  // --- Parent + split per job generation (communicator_factory.h) ---
 public:
  // One child of the job's parent communicator.
  struct Split {
    int color = NCCL_SPLIT_NOCOLOR;  // ranks of one group share it; NOCOLOR: in no group
    int key = 0;                     // rank within the group (NCCL orders by key)
    NcclOptions options;             // the child's rank, size, label and op timeout
  };
  // Joins one parent communicator over `parent.size` ranks (Create's
  // rendezvous in `store`), then calls ncclCommSplit once per element of
  // `splits`, in order: each split is collective over the parent, so every
  // rank must pass as many splits in the same order (comm/job_groups.h).
  // Parent and children are non-blocking; each step is polled until ready
  // and bounded by the rendezvous timeout (DEADLINE_EXCEEDED naming the
  // child's label, then the parent and that child are aborted: no hang).
  // Then every rank waits in `store` ("split-done/") for the others to have
  // their children and frees the parent. Element i of the result is the
  // child of splits[i]; nullptr where splits[i].color is NOCOLOR.
  static absl::StatusOr<std::vector<std::unique_ptr<NcclCommunicator>>> CreateSplit(
      Store& store, const NcclOptions& parent, const std::vector<Split>& splits);

 private:
  friend class NcclCommunicatorTestPeer;  // tests reach stream_
  // ncclCommAbort on a thread of its own, then frees `stream` and `word`
  // (each may be null): NCCL's abort synchronises the communicator's
  // internal streams, which wait for the user streams its kernels were
  // enqueued on (so for any kernel queued before them), and cudaFree waits
  // for the whole device; neither may hold up Abort, the watchdog or the
  // destructor.
  static void ReleaseOffThread(ncclComm_t comm, cudaStream_t stream, void* word, int device);
};

}  // namespace baton::comm

#endif  // BATON_WORKER_COMM_NCCL_COMMUNICATOR_H_
