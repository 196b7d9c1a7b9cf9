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

  // Completes every pending op with ABORTED; later ops fail fast.
  virtual void Abort(absl::string_view reason) = 0;

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
  // GroupOnStream: AllReduceSum / AllGather enqueued on the caller's CUDA
  // stream. Others: a Work failed with UNIMPLEMENTED.
  virtual std::shared_ptr<Work> AllReduceSumOnStream(Buffer buf, void* stream);
  virtual std::shared_ptr<Work> AllGatherOnStream(Buffer in, Buffer out, void* stream);
};

}  // namespace baton::comm

#endif  // BATON_WORKER_COMM_COMMUNICATOR_H_
