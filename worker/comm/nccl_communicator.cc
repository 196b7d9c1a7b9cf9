#include "worker/comm/nccl_communicator.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_status.h"
#include "worker/comm/rendezvous.h"

namespace baton::comm {
namespace {

constexpr char kUniqueIdKey[] = "nccl/unique_id";
constexpr absl::Duration kPollInterval = absl::Microseconds(50);

absl::Status NcclError(ncclResult_t r, ncclComm_t comm, absl::string_view what) {
  absl::StatusCode code = absl::StatusCode::kInternal;
  if (r == ncclInvalidArgument || r == ncclInvalidUsage) code = absl::StatusCode::kInvalidArgument;
  if (r == ncclRemoteError || r == ncclSystemError) code = absl::StatusCode::kUnavailable;
  const char* last = comm != nullptr ? ncclGetLastError(comm) : nullptr;
  return absl::Status(code, absl::StrCat(what, ": NCCL: ", ncclGetErrorString(r),
                                         last != nullptr && last[0] != '\0'
                                             ? absl::StrCat(" (", last, ")")
                                             : ""));
}

ncclDataType_t NcclType(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return ncclFloat32;
    case DType::kInt32:
      return ncclInt32;
    case DType::kInt64:
      return ncclInt64;
    case DType::kUInt8:
      return ncclUint8;
  }
  return ncclUint8;
}

}  // namespace

// One op: a CUDA event recorded after its NCCL kernels on the stream.
class NcclWork : public Work {
 public:
  NcclWork(std::string what, int peer, absl::Time deadline)
      : what_(std::move(what)), peer_(peer), deadline_(deadline) {}
  ~NcclWork() override {
    if (event_ != nullptr) cudaEventDestroy(event_);
  }

  absl::Status CreateEvent() {
    return cuda::CudaStatus(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming),
                            "cudaEventCreateWithFlags", __FILE__, __LINE__);
  }
  cudaEvent_t event() const { return event_; }

  // Polls the event: true once the op finished (successfully or not).
  bool Poll() {
    if (IsCompleted()) return true;
    cudaError_t e = cudaEventQuery(event_);
    if (e == cudaErrorNotReady) return false;
    Complete(cuda::CudaStatus(e, "cudaEventQuery", __FILE__, __LINE__));
    return true;
  }

  absl::Status Wait(absl::Duration timeout) override {
    const absl::Time deadline = absl::Now() + timeout;
    for (;;) {
      if (Poll()) break;
      absl::MutexLock lock(&mu_);
      // Abort or the watchdog may complete the op while we sleep.
      if (mu_.AwaitWithDeadline(absl::Condition(&done_),
                                std::min(deadline, absl::Now() + kPollInterval))) {
        break;
      }
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            what_, ": not complete after ", absl::FormatDuration(timeout),
            peer_ >= 0 ? absl::StrCat("; waiting for rank ", peer_) : "",
            " (the op is still pending: wait again or Abort the communicator)"));
      }
    }
    absl::MutexLock lock(&mu_);
    return status_;
  }

  bool IsCompleted() override {
    absl::MutexLock lock(&mu_);
    return done_;
  }

  void Complete(absl::Status status) {
    absl::MutexLock lock(&mu_);
    if (done_) return;
    done_ = true;
    status_ = std::move(status);
  }

  const std::string& what() const { return what_; }
  int peer() const { return peer_; }
  absl::Time deadline() const { return deadline_; }

 private:
  const std::string what_;
  const int peer_;
  const absl::Time deadline_;
  cudaEvent_t event_ = nullptr;
  absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

namespace {

std::shared_ptr<Work> Failed(std::string what, absl::Status status) {
  auto w = std::make_shared<NcclWork>(std::move(what), -1, absl::InfiniteFuture());
  w->Complete(std::move(status));
  return w;
}

}  // namespace

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Wrap(const NcclOptions& options,
                                                                           ncclComm_t comm) {
  cudaStream_t stream = nullptr;
  void* barrier_word = nullptr;
  absl::Status ready = cuda::CudaStatus(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                                        "cudaStreamCreateWithFlags", __FILE__, __LINE__);
  if (ready.ok()) {
    ready = cuda::CudaStatus(cudaMalloc(&barrier_word, sizeof(float)), "cudaMalloc", __FILE__, __LINE__);
  }
  if (!ready.ok()) {
    ncclCommAbort(comm);
    if (stream != nullptr) cudaStreamDestroy(stream);
    return ready;
  }
  return std::unique_ptr<NcclCommunicator>(new NcclCommunicator(options, comm, stream, barrier_word));
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(
    Store& store, const NcclOptions& options) {
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size) {
    return absl::InvalidArgumentError(absl::StrCat(
        options.label, ": rank ", options.rank, " is not in a group of size ", options.size));
  }
  const absl::Time deadline = absl::Now() + options.rendezvous_timeout;
  BATON_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.device));
  BATON_RETURN_IF_ERROR(ArriveAll(store, options.rank, options.size, deadline, options.label));

  ncclUniqueId id;
  if (options.rank == 0) {
    ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) return NcclError(r, nullptr, options.label + ": ncclGetUniqueId");
    BATON_RETURN_IF_ERROR(store.Set(kUniqueIdKey, absl::string_view(id.internal, sizeof(id))));
  } else {
    absl::StatusOr<std::string> bytes =
        store.Get(kUniqueIdKey, std::max(deadline - absl::Now(), absl::ZeroDuration()));
    if (!bytes.ok()) {
      return absl::Status(bytes.status().code(),
                          absl::StrCat(options.label, ": no NCCL unique id from rank 0: ",
                                       bytes.status().message()));
    }
    if (bytes->size() != sizeof(id)) {
      return absl::DataLossError(absl::StrCat(options.label, ": NCCL unique id has ",
                                              bytes->size(), " bytes, want ", sizeof(id)));
    }
    std::memcpy(id.internal, bytes->data(), sizeof(id));
  }

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  ncclResult_t r = ncclCommInitRankConfig(&comm, options.size, id, options.rank, &config);
  while (r == ncclInProgress) {
    if (absl::Now() > deadline) {
      ncclCommAbort(comm);
      return absl::DeadlineExceededError(absl::StrCat(
          options.label, ": NCCL communicator of ", options.size,
          " ranks not ready within the rendezvous timeout (all ranks had arrived; check the "
          "network between them and NCCL_DEBUG=WARN output)"));
    }
    absl::SleepFor(absl::Milliseconds(1));
    if (ncclCommGetAsyncError(comm, &r) != ncclSuccess) break;
  }
  if (r != ncclSuccess) {
    absl::Status s = NcclError(r, comm, absl::StrCat(options.label, ": ncclCommInitRankConfig"));
    if (comm != nullptr) ncclCommAbort(comm);
    return s;
  }
  return Wrap(options, comm);
}

NcclCommunicator::NcclCommunicator(const NcclOptions& options, ncclComm_t comm,
                                   cudaStream_t stream, void* barrier_word)
    : options_(options),
      barrier_word_(barrier_word),
      comm_(comm),
      stream_(stream),
      watchdog_([this] { WatchdogLoop(); }) {}

NcclCommunicator::~NcclCommunicator() {
  bool clean;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    pending_.erase(std::remove_if(pending_.begin(), pending_.end(),
                                  [](const std::shared_ptr<NcclWork>& w) { return w->Poll(); }),
                   pending_.end());
    clean = !aborted_ && pending_.empty();
  }
  watchdog_.join();
  if (clean) {
    // Flush and free a healthy communicator; abort it if that hangs.
    absl::MutexLock lock(&mu_);
    cudaSetDevice(options_.device);
    ncclResult_t r = AwaitReady(ncclCommFinalize(comm_), absl::Now() + absl::Seconds(10));
    if (r == ncclSuccess) {
      ncclCommDestroy(comm_);
      aborted_ = true;  // the handle is gone
    } else {
      clean = false;
    }
  }
  Abort("communicator destroyed");
  absl::MutexLock lock(&mu_);
  if (clean) {
    cudaStreamDestroy(stream_);
    cudaFree(barrier_word_);
  } else {  // ops may still be queued behind other work on the device
    ReleaseOffThread(nullptr, stream_, barrier_word_, options_.device);
  }
}

ncclResult_t NcclCommunicator::AwaitReady(ncclResult_t result, absl::Time deadline) {
  while (result == ncclInProgress) {
    if (abort_requested_.load() || absl::Now() > deadline) return ncclInProgress;
    absl::SleepFor(kPollInterval);
    if (ncclCommGetAsyncError(comm_, &result) != ncclSuccess) return ncclInternalError;
  }
  return result;
}

absl::Status NcclCommunicator::CheckDevice(const Buffer& b, absl::string_view what) const {
  if (b.device != options_.device) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": the NCCL backend takes memory on CUDA device ", options_.device, ", buffer is ",
        b.device < 0 ? std::string("host memory") : absl::StrCat("on device ", b.device)));
  }
  if (b.count < 0 || (b.count > 0 && b.data == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": invalid buffer (count ", b.count, ")"));
  }
  return absl::OkStatus();
}

absl::Status NcclCommunicator::CheckPieces(const Buffer& in, const Buffer& out, absl::string_view what,
                                           bool gather) const {
  absl::Status valid = CheckDevice(in, what);
  if (valid.ok()) valid = CheckDevice(out, what);
  const Buffer& part = gather ? in : out;
  const Buffer& whole = gather ? out : in;
  if (valid.ok() && (whole.count != part.count * options_.size || out.dtype != in.dtype)) {
    valid = absl::InvalidArgumentError(absl::StrCat(what, gather ? ": output must hold size() * input elements"
                                                                 : ": input must hold size() * output elements",
                                                    " of the same dtype"));
  }
  return valid;
}

std::shared_ptr<Work> NcclCommunicator::Issue(std::string what, int peer,
                                              const std::function<ncclResult_t()>& launch,
                                              cudaStream_t stream) {
  what = absl::StrCat(what, " on rank ", options_.rank, " of ", options_.label);
  const absl::Time deadline = absl::Now() + options_.op_timeout;
  auto work = std::make_shared<NcclWork>(what, peer, deadline);
  absl::Status created = work->CreateEvent();
  if (!created.ok()) return Failed(what, created);
  absl::Status failure;
  {
    absl::MutexLock lock(&mu_);
    if (aborted_) {
      work->Complete(absl::AbortedError(
          absl::StrCat(what, ": communicator was aborted (", abort_status_.message(), ")")));
      return work;
    }
    cudaSetDevice(options_.device);
    ncclResult_t r = AwaitReady(launch(), deadline);
    if (r == ncclInProgress && abort_requested_.load()) {
      failure = absl::AbortedError(absl::StrCat(what, ": aborted while NCCL was accepting it"));
    } else if (r == ncclInProgress) {
      failure = absl::DeadlineExceededError(absl::StrCat(
          what, ": NCCL did not accept the op within op_timeout",
          peer >= 0 ? absl::StrCat("; waiting for rank ", peer) : ""));
    } else if (r != ncclSuccess) {
      failure = NcclError(r, comm_, what);
    } else {
      failure = cuda::CudaStatus(cudaEventRecord(work->event(), stream != nullptr ? stream : stream_),
                                 "cudaEventRecord", __FILE__, __LINE__);
    }
    if (failure.ok()) {
      pending_.push_back(work);
      return work;
    }
  }
  // An NCCL error leaves the communicator unusable.
  AbortWith(absl::AbortedError(absl::StrCat(options_.label, ": aborted because ", what,
                                            " failed: ", failure.message())),
            work.get(), failure);
  work->Complete(failure);
  return work;
}

std::shared_ptr<Work> NcclCommunicator::Send(Buffer buf, int peer, uint64_t tag) {
  std::string what = absl::StrCat("Send to rank ", peer, " (tag ", tag, ", ", buf.bytes(), " B)");
  absl::Status valid = CheckDevice(buf, what);
  if (valid.ok() && (peer < 0 || peer >= options_.size || peer == options_.rank)) {
    valid = absl::InvalidArgumentError(absl::StrCat(what, ": peer must be another rank"));
  }
  if (!valid.ok()) return Failed(std::move(what), valid);
  return Issue(std::move(what), peer, [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess) return r;
    r = ncclSend(buf.data, buf.count, NcclType(buf.dtype), peer, comm_, stream_);
    ncclResult_t end = ncclGroupEnd();
    return r != ncclSuccess ? r : end;
  });
}

std::shared_ptr<Work> NcclCommunicator::Recv(Buffer buf, int peer, uint64_t tag) {
  std::string what =
      absl::StrCat("Recv from rank ", peer, " (tag ", tag, ", ", buf.bytes(), " B)");
  absl::Status valid = CheckDevice(buf, what);
  if (valid.ok() && (peer < 0 || peer >= options_.size || peer == options_.rank)) {
    valid = absl::InvalidArgumentError(absl::StrCat(what, ": peer must be another rank"));
  }
  if (!valid.ok()) return Failed(std::move(what), valid);
  return Issue(std::move(what), peer, [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess) return r;
    r = ncclRecv(buf.data, buf.count, NcclType(buf.dtype), peer, comm_, stream_);
    ncclResult_t end = ncclGroupEnd();
    return r != ncclSuccess ? r : end;
  });
}

std::shared_ptr<Work> NcclCommunicator::GroupOnStream(const std::vector<P2POp>& ops, void* stream) {
  std::string what = absl::StrCat("group of ", ops.size(), " p2p ops");
  int peer = ops.empty() ? -1 : ops[0].peer;
  for (const P2POp& op : ops) {
    absl::StrAppend(&what, op.name.empty() ? "" : (&op == &ops[0] ? " (" : ", "), op.name);
    if (op.peer != peer) peer = -1;
  }
  if (!ops.empty() && !ops[0].name.empty()) absl::StrAppend(&what, ")");
  absl::Status valid = stream == nullptr ? absl::InvalidArgumentError(absl::StrCat(what, ": no stream"))
                                         : absl::OkStatus();
  for (const P2POp& op : ops) {
    if (!valid.ok()) break;
    valid = CheckDevice(op.buf, absl::StrCat(what, ": ", op.name));
    if (valid.ok() && (op.peer < 0 || op.peer >= options_.size || op.peer == options_.rank)) {
      valid = absl::InvalidArgumentError(absl::StrCat(what, ": ", op.name, ": peer must be another rank"));
    }
  }
  if (!valid.ok()) return Failed(std::move(what), valid);
  cudaStream_t on = static_cast<cudaStream_t>(stream);
  return Issue(
      std::move(what), peer,
      [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
        ncclResult_t r = ncclGroupStart();
        if (r != ncclSuccess) return r;
        for (const P2POp& op : ops) {
          r = op.send ? ncclSend(op.buf.data, op.buf.count, NcclType(op.buf.dtype), op.peer, comm_, on)
                      : ncclRecv(op.buf.data, op.buf.count, NcclType(op.buf.dtype), op.peer, comm_, on);
          if (r != ncclSuccess) break;
        }
        ncclResult_t end = ncclGroupEnd();
        return r != ncclSuccess ? r : end;
      },
      on);
}

std::shared_ptr<Work> NcclCommunicator::AllReduceSum(Buffer buf) {
  std::string what = absl::StrCat("AllReduceSum(", buf.count, " elements)");
  absl::Status valid = CheckDevice(buf, what);
  if (!valid.ok()) return Failed(std::move(what), valid);
  CountAllReduceBytes(buf.bytes());
  return Issue(std::move(what), -1, [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return ncclAllReduce(buf.data, buf.data, buf.count, NcclType(buf.dtype), ncclSum, comm_,
                         stream_);
  });
}

std::shared_ptr<Work> NcclCommunicator::AllGather(Buffer in, Buffer out) {
  std::string what = absl::StrCat("AllGather(", in.count, " elements per rank)");
  const absl::Status valid = CheckPieces(in, out, what, /*gather=*/true);
  if (!valid.ok()) return Failed(std::move(what), valid);
  CountAllGatherBytes(in.bytes());
  return Issue(std::move(what), -1, [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return ncclAllGather(in.data, out.data, in.count, NcclType(in.dtype), comm_, stream_);
  });
}

std::shared_ptr<Work> NcclCommunicator::ReduceScatterSum(Buffer in, Buffer out) {
  std::string what = absl::StrCat("ReduceScatterSum(", out.count, " elements per rank)");
  const absl::Status valid = CheckPieces(in, out, what, /*gather=*/false);
  if (!valid.ok()) return Failed(std::move(what), valid);
  CountAllGatherBytes(out.bytes());  // the reduce-scatter's ring volume is the all-gather's
  return Issue(std::move(what), -1, [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return ncclReduceScatter(in.data, out.data, out.count, NcclType(in.dtype), ncclSum, comm_,
                             stream_);
  });
}

std::shared_ptr<Work> NcclCommunicator::Broadcast(Buffer buf, int root) {
  std::string what = absl::StrCat("Broadcast(", buf.count, " elements from rank ", root, ")");
  absl::Status valid = CheckDevice(buf, what);
  if (valid.ok() && (root < 0 || root >= options_.size)) {
    valid = absl::InvalidArgumentError(absl::StrCat(what, ": no such root"));
  }
  if (!valid.ok()) return Failed(std::move(what), valid);
  if (root == options_.rank && options_.size > 1) CountBusBytes(static_cast<int64_t>(buf.bytes()));
  return Issue(std::move(what), root == options_.rank ? -1 : root,
               [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
                 return ncclBroadcast(buf.data, buf.data, buf.count, NcclType(buf.dtype), root,
                                      comm_, stream_);
               });
}

std::shared_ptr<Work> NcclCommunicator::Barrier() {
  return Issue("Barrier", -1, [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return ncclAllReduce(barrier_word_, barrier_word_, 1, ncclFloat32, ncclSum, comm_, stream_);
  });
}

std::shared_ptr<Work> NcclCommunicator::AllToAllV(Buffer in, std::vector<int64_t> send_counts,
                                                  Buffer out, std::vector<int64_t> recv_counts) {
  std::string what =
      absl::StrCat("AllToAllV(", in.count, " elements out, ", out.count, " elements in)");
  absl::Status valid = CheckDevice(in, what);
  if (valid.ok()) valid = CheckDevice(out, what);
  if (valid.ok()) {
    valid = CheckAllToAllVArgs(what, in, send_counts, out, recv_counts, options_.rank,
                               options_.size);
  }
  if (!valid.ok()) return Failed(std::move(what), valid);
  const size_t es = DTypeSize(in.dtype);
  const std::vector<int64_t> send_off = ChunkOffsets(send_counts);
  const std::vector<int64_t> recv_off = ChunkOffsets(recv_counts);
  int64_t sent = 0;
  for (int peer = 0; peer < options_.size; ++peer) {
    if (peer != options_.rank) sent += send_counts[peer] * static_cast<int64_t>(es);
  }
  CountBusBytes(sent);
  const ncclDataType_t type = NcclType(in.dtype);
  char* src = static_cast<char*>(in.data);
  char* dst = static_cast<char*>(out.data);
  return Issue(std::move(what), -1, [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess) return r;
    for (int peer = 0; peer < options_.size && r == ncclSuccess; ++peer) {
      if (send_counts[peer] > 0) {
        r = ncclSend(src + send_off[peer] * es, static_cast<size_t>(send_counts[peer]), type, peer,
                     comm_, stream_);
      }
      if (r == ncclSuccess && recv_counts[peer] > 0) {
        r = ncclRecv(dst + recv_off[peer] * es, static_cast<size_t>(recv_counts[peer]), type, peer,
                     comm_, stream_);
      }
    }
    ncclResult_t end = ncclGroupEnd();
    return r != ncclSuccess ? r : end;
  });
}

void NcclCommunicator::Abort(absl::string_view reason) {
  const absl::Status status =
      absl::AbortedError(absl::StrCat(options_.label, ": aborted: ", reason));
  AbortWith(status, nullptr, status);
}

void NcclCommunicator::AbortWith(absl::Status status, const NcclWork* culprit,
                                 absl::Status culprit_status) {
  abort_requested_.store(true);  // an Issue polling under mu_ lets go
  std::vector<std::shared_ptr<NcclWork>> pending;
  {
    absl::MutexLock lock(&mu_);
    if (aborted_) return;
    aborted_ = true;
    abort_status_ = status;
    pending.swap(pending_);
    // Kills in-flight kernels; ones still queued behind other work exit when
    // they start. Off this thread: it would wait for that work.
    ReleaseOffThread(comm_, nullptr, nullptr, options_.device);
  }
  for (const std::shared_ptr<NcclWork>& work : pending) {
    work->Complete(work.get() == culprit
                       ? culprit_status
                       : absl::Status(status.code(),
                                      absl::StrCat(work->what(), ": ", status.message())));
  }
}

void NcclCommunicator::WatchdogLoop() {
  const absl::Duration period =
      std::clamp(options_.op_timeout / 10, absl::Milliseconds(1), absl::Milliseconds(10));
  cudaSetDevice(options_.device);  // events and NCCL calls of this thread
  for (;;) {
    absl::Status error;
    std::shared_ptr<NcclWork> culprit;
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stop_), period)) return;
      if (aborted_) continue;
      ncclResult_t async = ncclSuccess;
      ncclResult_t r = ncclCommGetAsyncError(comm_, &async);
      if (r != ncclSuccess || (async != ncclSuccess && async != ncclInProgress)) {
        error = NcclError(r != ncclSuccess ? r : async, comm_,
                          absl::StrCat(options_.label, ": asynchronous NCCL error"));
      }
      const absl::Time now = absl::Now();
      std::vector<std::shared_ptr<NcclWork>> still;
      for (std::shared_ptr<NcclWork>& work : pending_) {
        if (work->Poll()) continue;  // done: drop it
        if (error.ok() && culprit == nullptr && work->deadline() < now) culprit = work;
        still.push_back(std::move(work));
      }
      pending_.swap(still);
    }
    if (!error.ok()) {
      AbortWith(absl::UnavailableError(error.message()), nullptr, absl::OkStatus());
    } else if (culprit != nullptr) {
      std::string why = absl::StrCat(
          culprit->what(), " did not complete within op_timeout ",
          absl::FormatDuration(options_.op_timeout),
          culprit->peer() >= 0 ? absl::StrCat("; waiting for rank ", culprit->peer()) : "");
      AbortWith(absl::AbortedError(absl::StrCat(options_.label, ": aborted by the watchdog: ", why)),
                culprit.get(), absl::DeadlineExceededError(absl::StrCat(why, "; communicator aborted")));
    }
  }
}

// Stream-ordered collectives (added for comm/stream_collectives.h): the
// plain ops' checks, the NCCL op on the caller's stream, watched like any op.
std::shared_ptr<Work> NcclCommunicator::AllReduceSumOnStream(Buffer buf, void* stream) {
  std::string what = absl::StrCat("AllReduceSum(", buf.count, " elements) on the caller's stream");
  absl::Status valid = stream == nullptr ? absl::InvalidArgumentError(absl::StrCat(what, ": no stream"))
                                         : CheckDevice(buf, what);
  if (!valid.ok()) return Failed(std::move(what), valid);
  cudaStream_t on = static_cast<cudaStream_t>(stream);
  CountAllReduceBytes(buf.bytes());
  return Issue(
      std::move(what), -1,
      [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return ncclAllReduce(buf.data, buf.data, buf.count, NcclType(buf.dtype), ncclSum, comm_, on);
      },
      on);
}

std::shared_ptr<Work> NcclCommunicator::AllGatherOnStream(Buffer in, Buffer out, void* stream) {
  std::string what = absl::StrCat("AllGather(", in.count, " elements per rank) on the caller's stream");
  const absl::Status valid = stream == nullptr ? absl::InvalidArgumentError(absl::StrCat(what, ": no stream"))
                                               : CheckPieces(in, out, what, /*gather=*/true);
  if (!valid.ok()) return Failed(std::move(what), valid);
  cudaStream_t on = static_cast<cudaStream_t>(stream);
  CountAllGatherBytes(in.bytes());
  return Issue(
      std::move(what), -1,
      [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return ncclAllGather(in.data, out.data, in.count, NcclType(in.dtype), comm_, on);
      },
      on);
}

std::shared_ptr<Work> NcclCommunicator::ReduceScatterSumOnStream(Buffer in, Buffer out, void* stream) {
  std::string what = absl::StrCat("ReduceScatterSum(", out.count, " elements per rank) on the caller's stream");
  const absl::Status valid = stream == nullptr ? absl::InvalidArgumentError(absl::StrCat(what, ": no stream"))
                                               : CheckPieces(in, out, what, /*gather=*/false);
  if (!valid.ok()) return Failed(std::move(what), valid);
  cudaStream_t on = static_cast<cudaStream_t>(stream);
  CountAllGatherBytes(out.bytes());  // the reduce-scatter's ring volume is the all-gather's
  return Issue(
      std::move(what), -1,
      [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return ncclReduceScatter(in.data, out.data, out.count, NcclType(in.dtype), ncclSum, comm_, on);
      },
      on);
}

// --- Parent + split per job generation; abort off the caller's thread ---

namespace {

// The release threads still running. At exit the process waits for them (at
// most kReleaseWaitAtExit) before CUDA and NCCL tear down their state under
// them; the count itself is never freed, so a thread still stuck behind a
// kernel after that may still touch it.
struct ReleaseThreads {
  absl::Mutex mu;
  int running ABSL_GUARDED_BY(mu) = 0;
};
constexpr absl::Duration kReleaseWaitAtExit = absl::Seconds(30);

ReleaseThreads& Releases() {
  static ReleaseThreads* const threads = new ReleaseThreads;
  // Constructed after the first release thread's CUDA calls began, so
  // destroyed before CUDA's own state at exit.
  static struct WaitAtExit {
    ~WaitAtExit() {
      absl::MutexLock lock(&threads->mu);
      threads->mu.AwaitWithTimeout(
          absl::Condition(
              +[](int* running) { return *running == 0; }, &threads->running),
          kReleaseWaitAtExit);
    }
  } wait_at_exit;
  return *threads;
}

}  // namespace

void NcclCommunicator::ReleaseOffThread(ncclComm_t comm, cudaStream_t stream, void* word,
                                        int device) {
  ReleaseThreads& threads = Releases();
  {
    absl::MutexLock lock(&threads.mu);
    ++threads.running;
  }
  std::thread([comm, stream, word, device, &threads] {
    cudaSetDevice(device);
    if (comm != nullptr) ncclCommAbort(comm);
    if (stream != nullptr) cudaStreamDestroy(stream);
    if (word != nullptr) cudaFree(word);
    absl::MutexLock lock(&threads.mu);
    --threads.running;
  }).detach();
}

absl::StatusOr<std::vector<std::unique_ptr<NcclCommunicator>>> NcclCommunicator::CreateSplit(
    Store& store, const NcclOptions& parent_options, const std::vector<Split>& splits) {
#if NCCL_VERSION_CODE < NCCL_VERSION(2, 18, 0)
  return absl::UnimplementedError(absl::StrCat(parent_options.label, ": NCCL ", NCCL_MAJOR, ".",
                                               NCCL_MINOR, " has no ncclCommSplit (2.18+)"));
#else
  BATON_ASSIGN_OR_RETURN(std::unique_ptr<NcclCommunicator> parent, Create(store, parent_options));
  NcclCommunicator* const p = parent.get();
  std::vector<std::unique_ptr<NcclCommunicator>> children;
  for (size_t i = 0; i < splits.size(); ++i) {
    const Split& split = splits[i];
    const NcclOptions& o = split.options;
    const std::string what = absl::StrCat(
        o.label, ": split ", i + 1, " of ", splits.size(), " of the parent communicator ",
        parent_options.label, " (color ",
        split.color == NCCL_SPLIT_NOCOLOR ? std::string("none") : absl::StrCat(split.color),
        ", key ", split.key, ")");
    const absl::Time deadline = absl::Now() + parent_options.rendezvous_timeout;
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    // NCCL writes the child from its init thread when the split completes;
    // that thread is joined (by polling or by ncclCommAbort) before we leave.
    ncclComm_t child = nullptr;
    ncclResult_t r;
    absl::Status failure;
    {
      absl::MutexLock lock(&p->mu_);
      cudaSetDevice(parent_options.device);
      r = p->AwaitReady(ncclCommSplit(p->comm_, split.color, split.key, &child, &config), deadline);
      if (r == ncclSuccess && child != nullptr) {
        // The child's own state (ready once the parent's split is).
        ncclResult_t state = ncclInProgress;
        while (ncclCommGetAsyncError(child, &state) == ncclSuccess && state == ncclInProgress &&
               absl::Now() <= deadline) {
          absl::SleepFor(kPollInterval);
        }
        r = state;
      }
      if (r == ncclInProgress) {
        failure = absl::DeadlineExceededError(absl::StrCat(
            what, " not complete within the rendezvous timeout ",
            absl::FormatDuration(parent_options.rendezvous_timeout),
            "; every rank of the job must make the same splits in the same order: check that "
            "all the job's workers run this generation, and NCCL_DEBUG=WARN output"));
      } else if (r != ncclSuccess) {
        failure = NcclError(r, child != nullptr ? child : p->comm_, what);
      } else if (split.color == NCCL_SPLIT_NOCOLOR) {
        if (child != nullptr) failure = absl::InternalError(absl::StrCat(what, ": NCCL made a child"));
      } else if (child == nullptr) {
        failure = absl::InternalError(absl::StrCat(what, ": NCCL made no child"));
      } else {
        int rank = -1, count = -1;
        ncclCommUserRank(child, &rank);
        ncclCommCount(child, &count);
        if (rank != o.rank || count != o.size) {
          failure = absl::InternalError(absl::StrCat(
              what, ": NCCL made rank ", rank, " of ", count, ", the plan says rank ", o.rank,
              " of ", o.size, " (the ranks of the job disagree on the groups)"));
        }
      }
      if (!failure.ok()) {
        // Ends NCCL's init thread (it honours the abort flag) and frees the
        // parent; no op ever ran on it, so this waits for no stream.
        p->abort_requested_.store(true);
        p->aborted_ = true;
        p->abort_status_ = absl::AbortedError(failure.message());
        ncclCommAbort(p->comm_);
      }
    }
    if (!failure.ok()) {
      if (child != nullptr) ncclCommAbort(child);
      return failure;
    }
    if (child == nullptr) {
      children.push_back(nullptr);
      continue;
    }
    NcclOptions options = o;
    options.device = parent_options.device;
    absl::StatusOr<std::unique_ptr<NcclCommunicator>> wrapped = Wrap(options, child);
    if (!wrapped.ok()) return WithContext(wrapped.status(), o.label);
    children.push_back(std::move(*wrapped));
  }
  // The parent's bootstrap connections carried the splits: free it only once
  // every rank has all its children.
  PrefixStore done(&store, "split-done");
  BATON_RETURN_IF_ERROR(ArriveAll(done, parent_options.rank, parent_options.size,
                                  absl::Now() + parent_options.rendezvous_timeout,
                                  absl::StrCat(parent_options.label, " (splits done)")));
  parent.reset();
  return children;
#endif
}

}  // namespace baton::comm
