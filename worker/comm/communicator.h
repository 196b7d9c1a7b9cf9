// Communicator: the backend-neutral data plane (shaped like c10d's
// Backend/Work, kept to the ops baton uses).
//
// Every op is asynchronous and returns a Work; Wait(timeout) blocks until the
// op completes, fails, times out (DEADLINE_EXCEEDED naming the op and peer) or
// the communicator is aborted (ABORTED). Abort() may be called from any thread
// and completes every pending op; later ops fail fast.
//
// Backends: in-process over threads (tests of logic), Gloo (CPU, TCP) and
// NCCL (GPU). A communicator is one group: the TP group, the DP group or a
// pipeline pair; `rank`/`size` are within that group.
#ifndef BATON_WORKER_COMM_COMMUNICATOR_H_
#define BATON_WORKER_COMM_COMMUNICATOR_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace baton::comm {

enum class DType { kFloat32, kInt32, kInt64, kUInt8 };

size_t DTypeSize(DType dtype);

// A view of contiguous memory: host memory, or device memory when `device`
// is >= 0 (CUDA device ordinal). The caller keeps it alive until Wait().
struct Buffer {
  void* data = nullptr;
  int64_t count = 0;  // elements of `dtype`
  DType dtype = DType::kFloat32;
  int device = -1;    // -1 = host

  size_t bytes() const { return static_cast<size_t>(count) * DTypeSize(dtype); }
  static Buffer Host(float* p, int64_t n) { return Buffer{p, n, DType::kFloat32, -1}; }
  static Buffer Host(const float* p, int64_t n) {
    return Buffer{const_cast<float*>(p), n, DType::kFloat32, -1};
  }
};

// One operation of a stream-ordered group (Communicator::GroupOnStream,
// comm/stream_p2p.h).
struct P2POp {
  bool send = false;
  Buffer buf;
  int peer = 0;
  uint64_t tag = 0;
  std::string name;  // for errors, e.g. "RECV_F(stage 1, mb 0) with pipeline rank 0"
};

class Work {
 public:
  virtual ~Work() = default;
  // Blocks until done; OK, the op's error, DEADLINE_EXCEEDED or ABORTED.
  virtual absl::Status Wait(absl::Duration timeout) = 0;
  virtual bool IsCompleted() = 0;
};

// A Work that is already complete with `status` (an op refused before it
// was posted).
std::shared_ptr<Work> CompletedWork(absl::Status status);

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string backend() const = 0;  // "inproc", "gloo", "nccl"

  // Point-to-point. A Send matches the Recv on `peer` with the same tag; many
  // may be in flight at once. Sizes must match.
  virtual std::shared_ptr<Work> Send(Buffer buf, int peer, uint64_t tag) = 0;
  virtual std::shared_ptr<Work> Recv(Buffer buf, int peer, uint64_t tag) = 0;

  // Collectives over the whole group, in place where shapes allow.
  virtual std::shared_ptr<Work> AllReduceSum(Buffer buf) = 0;
  // out.count == size() * in.count; rank r's input lands at r * in.count.
  virtual std::shared_ptr<Work> AllGather(Buffer in, Buffer out) = 0;
  // in.count == size() * out.count; rank r gets the sum of chunk r.
  virtual std::shared_ptr<Work> ReduceScatterSum(Buffer in, Buffer out) = 0;
  virtual std::shared_ptr<Work> Broadcast(Buffer buf, int root) = 0;
  virtual std::shared_ptr<Work> Barrier() = 0;
  // All-to-all with variable counts (MoE expert parallelism): rank r sends
  // chunk j of `in` (send_counts[j] elements; chunks in rank order) to rank
  // j and receives recv_counts[j] elements from rank j into `out`, chunks in
  // rank order. send_counts.size() == recv_counts.size() == size();
  // in.count == sum(send_counts); out.count == sum(recv_counts); counts may
  // be zero; in and out have the same dtype and must not overlap. Arguments
  // are checked by CheckAllToAllVArgs (INVALID_ARGUMENT). Rank j's
  // send_counts[r] must equal rank r's recv_counts[j] (ExchangeCounts gets
  // them): Gloo and inproc fail a disagreement with INVALID_ARGUMENT naming
  // the peer; NCCL does not check it.
  virtual std::shared_ptr<Work> AllToAllV(Buffer in, std::vector<int64_t> send_counts, Buffer out,
                                          std::vector<int64_t> recv_counts) = 0;

  // Completes every pending op with ABORTED; later ops fail fast.
  virtual void Abort(absl::string_view reason) = 0;

  // Payload bytes this rank's collectives (not Send/Recv) have sent since
  // the communicator was made, counted when a collective completes. Gloo
  // counts what its rings hand to the transport (a ring all-reduce of S
  // bytes sends 2(n-1)/n S; reduce-scatter and all-gather (n-1)/n S, S the
  // whole buffer); NCCL counts the same ring volume (nccl-tests' bus bytes:
  // its own algorithm choice is not visible); wrappers pass it through;
  // inproc counts nothing.
  virtual int64_t collective_bytes_sent() const { return 0; }

  // Stream-ordered point-to-point, for communicators whose ops run on CUDA
  // streams (NCCL; RunsOnStreams()): enqueues `ops` as one group on the
  // caller's CUDA stream `stream` (a cudaStream_t), after the work already
  // enqueued on it and before the work enqueued later, without a host wait.
  // The Work completes with the group; the op timeout bounds it (the
  // communicator aborts a group older than that, which ends its kernels and
  // lets the stream go on). Check it after a host wait that covers the
  // stream. Others: a Work failed with UNIMPLEMENTED.
  virtual bool RunsOnStreams() const { return false; }
  virtual std::shared_ptr<Work> GroupOnStream(const std::vector<P2POp>& ops, void* stream);
  // Stream-ordered collectives (comm/stream_collectives.h), same contract as
  // GroupOnStream: AllReduceSum / AllGather / ReduceScatterSum enqueued on
  // the caller's CUDA stream. Others: a Work failed with UNIMPLEMENTED.
  virtual std::shared_ptr<Work> AllReduceSumOnStream(Buffer buf, void* stream);
  virtual std::shared_ptr<Work> AllGatherOnStream(Buffer in, Buffer out, void* stream);
  virtual std::shared_ptr<Work> ReduceScatterSumOnStream(Buffer in, Buffer out, void* stream);
};

// The argument checks of AllToAllV on rank `rank` of a group of `size`,
// shared by every backend: OK, or INVALID_ARGUMENT starting with `what` and
// saying what to fix (a counts vector of the wrong size, a negative count,
// counts whose sum is not the buffer's count, or whose bytes would not fit
// in int64, dtypes that differ, a null buffer, send_counts[rank] !=
// recv_counts[rank]). A backend checks where its buffers live itself.
absl::Status CheckAllToAllVArgs(absl::string_view what, const Buffer& in,
                                const std::vector<int64_t>& send_counts, const Buffer& out,
                                const std::vector<int64_t>& recv_counts, int rank, int size);

// Where each chunk of counts `counts` starts: element j is the sum of
// counts[0..j) (call after CheckAllToAllVArgs, which bounds the sum).
std::vector<int64_t> ChunkOffsets(const std::vector<int64_t>& counts);

// The first step of an MoE dispatch: every rank tells every other how many
// elements it will send it, by an AllToAllV of one int64 per peer over host
// memory. Returns recv_counts (element j: what rank j will send this rank),
// ready for AllToAllV. Collective: every rank of the group calls it, in
// the same order as the group's other collectives.
//
// Errors: INVALID_ARGUMENT for bad `send_counts` (size, negative);
// UNIMPLEMENTED over a communicator whose ops run on CUDA streams (NCCL
// takes device memory only: exchange device counts with AllToAllV);
// DATA_LOSS if a peer announces a negative count; the op's error
// otherwise. If the exchange has not completed within `timeout`, it returns
// DEADLINE_EXCEEDED naming the peer it waited for, and ABORTS `comm`: the
// op's buffers are this function's own and cannot outlive it, and a group
// whose counts never arrived is out of step anyway.
absl::StatusOr<std::vector<int64_t>> ExchangeCounts(Communicator& comm,
                                                    const std::vector<int64_t>& send_counts,
                                                    absl::Duration timeout);

}  // namespace baton::comm

#endif  // BATON_WORKER_COMM_COMMUNICATOR_H_
