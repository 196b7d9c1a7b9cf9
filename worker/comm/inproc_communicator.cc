#include "worker/comm/inproc_communicator.h"

#include <cstring>
#include <deque>
#include <map>
#include <tuple>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace baton::comm {
namespace {

// Completion of one posted op; guarded by the group's mutex.
struct OpState {
  bool done = false;
  absl::Status status;
};

enum class CollectiveKind {
  kAllReduceSum,
  kAllGather,
  kReduceScatterSum,
  kBroadcast,
  kBarrier,
  kAllToAllV
};

const char* KindName(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllReduceSum:
      return "AllReduceSum";
    case CollectiveKind::kAllGather:
      return "AllGather";
    case CollectiveKind::kReduceScatterSum:
      return "ReduceScatterSum";
    case CollectiveKind::kBroadcast:
      return "Broadcast";
    case CollectiveKind::kBarrier:
      return "Barrier";
    case CollectiveKind::kAllToAllV:
      return "AllToAllV";
  }
  return "?";
}

template <typename T>
void AddInto(void* acc, const void* x, int64_t n) {
  T* a = static_cast<T*>(acc);
  const T* b = static_cast<const T*>(x);
  for (int64_t i = 0; i < n; ++i) a[i] += b[i];
}

void AddInto(DType dtype, void* acc, const void* x, int64_t n) {
  switch (dtype) {
    case DType::kFloat32:
      return AddInto<float>(acc, x, n);
    case DType::kInt32:
      return AddInto<int32_t>(acc, x, n);
    case DType::kInt64:
      return AddInto<int64_t>(acc, x, n);
    case DType::kUInt8:
      return AddInto<uint8_t>(acc, x, n);
  }
}

void Complete(OpState& op, absl::Status status) {
  op.done = true;
  op.status = std::move(status);
}

}  // namespace

class InProcGroupState : public std::enable_shared_from_this<InProcGroupState> {
 public:
  explicit InProcGroupState(int size) : size_(size), next_seq_(size, 0), aborted_(size, false) {}

  int size() const { return size_; }

  // `send_counts` / `recv_counts`: AllToAllV's (already checked), else empty.
  std::shared_ptr<Work> PostCollective(int rank, CollectiveKind kind, Buffer in, Buffer out,
                                       int root, std::vector<int64_t> send_counts = {},
                                       std::vector<int64_t> recv_counts = {});
  std::shared_ptr<Work> PostP2P(int rank, bool is_send, Buffer buf, int peer, uint64_t tag);
  void Abort(int rank, absl::string_view reason);

 private:
  class InProcWork;
  struct Collective {
    CollectiveKind kind;
    int arrived = 0;
    int root = 0;
    bool mismatch = false;  // ranks posted different kinds or roots
    std::vector<Buffer> in, out;
    std::vector<std::vector<int64_t>> send_counts, recv_counts;  // AllToAllV, per rank
    std::vector<std::shared_ptr<OpState>> ops;
  };
  struct P2P {
    Buffer buf;
    std::shared_ptr<OpState> op;
  };
  using P2PKey = std::tuple<int, int, uint64_t>;  // sender, receiver, tag

  std::shared_ptr<Work> MakeWork(std::shared_ptr<OpState> op, std::string what);
  std::shared_ptr<Work> Failed(absl::Status status);
  absl::Status AbortedStatusLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RunLocked(Collective& c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // AllToAllV's checks across ranks (every pair agrees on its counts), then
  // its copies.
  absl::Status RunAllToAllVLocked(Collective& c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  const int size_;
  std::vector<int64_t> next_seq_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, Collective> collectives_ ABSL_GUARDED_BY(mu_);
  std::map<P2PKey, std::deque<P2P>> sends_ ABSL_GUARDED_BY(mu_);
  std::map<P2PKey, std::deque<P2P>> recvs_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> aborted_ ABSL_GUARDED_BY(mu_);
  std::string abort_reason_ ABSL_GUARDED_BY(mu_);
  int aborted_rank_ ABSL_GUARDED_BY(mu_) = -1;
};

class InProcGroupState::InProcWork : public Work {
 public:
  InProcWork(std::shared_ptr<InProcGroupState> group, std::shared_ptr<OpState> op, std::string what)
      : group_(group), op_(std::move(op)), what_(std::move(what)) {}

  absl::Status Wait(absl::Duration timeout) override {
    absl::MutexLock lock(&group_->mu_);
    OpState* op = op_.get();
    const absl::Condition done(
        +[](OpState* s) { return s->done; }, op);
    if (!group_->mu_.AwaitWithTimeout(done, timeout)) {
      return absl::DeadlineExceededError(absl::StrCat("inproc ", what_, " did not complete within ",
                                                      absl::FormatDuration(timeout),
                                                      "; a peer has not posted the matching op"));
    }
    return op->status;
  }

  bool IsCompleted() override {
    absl::MutexLock lock(&group_->mu_);
    return op_->done;
  }

 private:
  std::shared_ptr<InProcGroupState> group_;
  std::shared_ptr<OpState> op_;
  std::string what_;
};

std::shared_ptr<Work> InProcGroupState::MakeWork(std::shared_ptr<OpState> op, std::string what) {
  return std::make_shared<InProcWork>(shared_from_this(), std::move(op), std::move(what));
}

std::shared_ptr<Work> InProcGroupState::Failed(absl::Status status) {
  auto op = std::make_shared<OpState>();
  Complete(*op, std::move(status));
  return MakeWork(std::move(op), "failed op");
}

absl::Status InProcGroupState::AbortedStatusLocked() const {
  return absl::AbortedError(
      absl::StrCat("inproc group aborted by rank ", aborted_rank_, ": ", abort_reason_));
}

std::shared_ptr<Work> InProcGroupState::PostCollective(int rank, CollectiveKind kind, Buffer in,
                                                       Buffer out, int root,
                                                       std::vector<int64_t> send_counts,
                                                       std::vector<int64_t> recv_counts) {
  if (in.device >= 0 || out.device >= 0) {
    return Failed(absl::UnimplementedError("inproc communicator: host buffers only"));
  }
  if (root < 0 || root >= size_) {
    return Failed(absl::InvalidArgumentError(
        absl::StrCat("inproc Broadcast: root ", root, " outside a group of ", size_)));
  }
  absl::MutexLock lock(&mu_);
  if (aborted_rank_ >= 0) return Failed(AbortedStatusLocked());
  const int64_t seq = next_seq_[rank]++;
  Collective& c = collectives_[seq];
  if (c.arrived == 0) {
    c.kind = kind;
    c.root = root;
    c.in.resize(size_);
    c.out.resize(size_);
    c.send_counts.resize(size_);
    c.recv_counts.resize(size_);
    c.ops.resize(size_);
  }
  auto op = std::make_shared<OpState>();
  c.in[rank] = in;
  c.out[rank] = out;
  c.send_counts[rank] = std::move(send_counts);
  c.recv_counts[rank] = std::move(recv_counts);
  c.ops[rank] = op;
  ++c.arrived;
  if (c.kind != kind || c.root != root) c.mismatch = true;
  std::string what = absl::StrCat(KindName(kind), " #", seq, " on rank ", rank, " of ", size_);
  if (c.arrived == size_) {
    RunLocked(c);
    collectives_.erase(seq);
  }
  return MakeWork(std::move(op), std::move(what));
}

void InProcGroupState::RunLocked(Collective& c) {
  absl::Status status;
  const int64_t n = c.in[0].count;
  const DType dtype = c.in[0].dtype;
  if (c.kind == CollectiveKind::kAllToAllV && !c.mismatch) {
    status = RunAllToAllVLocked(c);
    for (auto& op : c.ops) Complete(*op, status);
    return;
  }
  for (int r = 0; r < size_ && status.ok(); ++r) {
    if (c.mismatch) {
      status = absl::InvalidArgumentError(
          absl::StrCat("inproc ", KindName(c.kind), ": ranks posted different collectives"));
    } else if (c.in[r].count != n || c.in[r].dtype != dtype) {
      status = absl::InvalidArgumentError(
          absl::StrCat("inproc ", KindName(c.kind), ": rank ", r, " posted ", c.in[r].count,
                       " elements, rank 0 posted ", n, " (or dtypes differ)"));
    } else if ((c.kind == CollectiveKind::kAllGather && c.out[r].count != n * size_) ||
               (c.kind == CollectiveKind::kReduceScatterSum && c.out[r].count * size_ != n)) {
      status = absl::InvalidArgumentError(absl::StrCat("inproc ", KindName(c.kind), ": rank ", r,
                                                       " output has ", c.out[r].count,
                                                       " elements for inputs of ", n));
    }
  }
  if (status.ok()) {
    const size_t bytes = c.in[0].bytes();
    switch (c.kind) {
      case CollectiveKind::kAllReduceSum:
        // Rank 0's buffer accumulates in rank order; the others copy it.
        for (int r = 1; r < size_; ++r) AddInto(dtype, c.in[0].data, c.in[r].data, n);
        for (int r = 1; r < size_; ++r) std::memcpy(c.in[r].data, c.in[0].data, bytes);
        break;
      case CollectiveKind::kAllGather:
        for (int r = 0; r < size_; ++r) {
          for (int q = 0; q < size_; ++q) {
            std::memmove(static_cast<char*>(c.out[r].data) + q * bytes, c.in[q].data, bytes);
          }
        }
        break;
      case CollectiveKind::kReduceScatterSum: {
        const int64_t chunk = n / size_;
        const size_t chunk_bytes = bytes / size_;
        std::vector<std::vector<char>> sums(size_, std::vector<char>(chunk_bytes));
        for (int r = 0; r < size_; ++r) {
          std::memcpy(sums[r].data(), static_cast<char*>(c.in[0].data) + r * chunk_bytes,
                      chunk_bytes);
          for (int q = 1; q < size_; ++q) {
            AddInto(dtype, sums[r].data(), static_cast<char*>(c.in[q].data) + r * chunk_bytes,
                    chunk);
          }
        }
        for (int r = 0; r < size_; ++r) std::memcpy(c.out[r].data, sums[r].data(), chunk_bytes);
        break;
      }
      case CollectiveKind::kBroadcast:
        for (int r = 0; r < size_; ++r) {
          if (r != c.root) std::memcpy(c.in[r].data, c.in[c.root].data, bytes);
        }
        break;
      case CollectiveKind::kBarrier:
      case CollectiveKind::kAllToAllV:  // mismatched: reported above; else RunAllToAllVLocked
        break;
    }
  }
  for (auto& op : c.ops) Complete(*op, status);
}

absl::Status InProcGroupState::RunAllToAllVLocked(Collective& c) {
  const DType dtype = c.in[0].dtype;
  for (int r = 0; r < size_; ++r) {
    if (c.in[r].dtype != dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          "inproc AllToAllV: rank ", r, " posted another dtype than rank 0; every rank must "
          "exchange one dtype"));
    }
    for (int q = 0; q < size_; ++q) {
      if (c.send_counts[q][r] != c.recv_counts[r][q]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "inproc AllToAllV: rank ", q, " sends ", c.send_counts[q][r], " elements to rank ", r,
            ", which expects ", c.recv_counts[r][q], " from it (recv_counts[", q,
            "]); exchange the counts first (ExchangeCounts)"));
      }
    }
  }
  const size_t es = DTypeSize(dtype);
  std::vector<std::vector<int64_t>> send_offsets(size_);
  for (int q = 0; q < size_; ++q) send_offsets[q] = ChunkOffsets(c.send_counts[q]);
  for (int r = 0; r < size_; ++r) {
    const std::vector<int64_t> recv_offsets = ChunkOffsets(c.recv_counts[r]);
    for (int q = 0; q < size_; ++q) {
      const size_t bytes = static_cast<size_t>(c.recv_counts[r][q]) * es;
      if (bytes == 0) continue;
      std::memcpy(static_cast<char*>(c.out[r].data) + recv_offsets[q] * es,
                  static_cast<const char*>(c.in[q].data) + send_offsets[q][r] * es, bytes);
    }
  }
  return absl::OkStatus();
}

std::shared_ptr<Work> InProcGroupState::PostP2P(int rank, bool is_send, Buffer buf, int peer,
                                                uint64_t tag) {
  if (buf.device >= 0) {
    return Failed(absl::UnimplementedError("inproc communicator: host buffers only"));
  }
  if (peer < 0 || peer >= size_ || peer == rank) {
    return Failed(absl::InvalidArgumentError(
        absl::StrCat("inproc ", is_send ? "Send" : "Recv", ": peer ", peer,
                     " is not another rank of a group of ", size_)));
  }
  absl::MutexLock lock(&mu_);
  if (aborted_[rank] || aborted_[peer]) return Failed(AbortedStatusLocked());
  const P2PKey key = is_send ? P2PKey{rank, peer, tag} : P2PKey{peer, rank, tag};
  auto op = std::make_shared<OpState>();
  std::string what = absl::StrCat(is_send ? "Send to rank " : "Recv from rank ", peer, " tag ", tag,
                                  " on rank ", rank);
  auto& partners = is_send ? recvs_[key] : sends_[key];
  if (partners.empty()) {
    (is_send ? sends_ : recvs_)[key].push_back(P2P{buf, op});
    return MakeWork(std::move(op), std::move(what));
  }
  P2P partner = std::move(partners.front());
  partners.pop_front();
  const Buffer& src = is_send ? buf : partner.buf;
  const Buffer& dst = is_send ? partner.buf : buf;
  absl::Status status;
  if (src.bytes() != dst.bytes()) {
    status =
        absl::InvalidArgumentError(absl::StrCat("inproc Send/Recv tag ", tag, ": sender has ",
                                                src.bytes(), " bytes, receiver ", dst.bytes()));
  } else {
    std::memcpy(dst.data, src.data, src.bytes());
  }
  Complete(*partner.op, status);
  Complete(*op, status);
  return MakeWork(std::move(op), std::move(what));
}

void InProcGroupState::Abort(int rank, absl::string_view reason) {
  absl::MutexLock lock(&mu_);
  aborted_[rank] = true;
  if (aborted_rank_ < 0) {
    aborted_rank_ = rank;
    abort_reason_ = std::string(reason);
  }
  const absl::Status status = AbortedStatusLocked();
  for (auto& [seq, c] : collectives_) {
    for (auto& op : c.ops) {
      if (op != nullptr) Complete(*op, status);
    }
  }
  collectives_.clear();
  for (auto* queues : {&sends_, &recvs_}) {
    for (auto& [key, queue] : *queues) {
      if (std::get<0>(key) != rank && std::get<1>(key) != rank) continue;
      for (P2P& p : queue) Complete(*p.op, status);
      queue.clear();
    }
  }
}

std::vector<std::unique_ptr<InProcCommunicator>> InProcCommunicator::CreateGroup(int size) {
  auto state = std::make_shared<InProcGroupState>(size);
  std::vector<std::unique_ptr<InProcCommunicator>> group;
  for (int r = 0; r < size; ++r) group.push_back(std::make_unique<InProcCommunicator>(state, r));
  return group;
}

InProcCommunicator::InProcCommunicator(std::shared_ptr<InProcGroupState> group, int rank)
    : group_(std::move(group)), rank_(rank) {}

int InProcCommunicator::size() const { return group_->size(); }

std::shared_ptr<Work> InProcCommunicator::Send(Buffer buf, int peer, uint64_t tag) {
  return group_->PostP2P(rank_, /*is_send=*/true, buf, peer, tag);
}

std::shared_ptr<Work> InProcCommunicator::Recv(Buffer buf, int peer, uint64_t tag) {
  return group_->PostP2P(rank_, /*is_send=*/false, buf, peer, tag);
}

std::shared_ptr<Work> InProcCommunicator::AllReduceSum(Buffer buf) {
  return group_->PostCollective(rank_, CollectiveKind::kAllReduceSum, buf, buf, 0);
}

std::shared_ptr<Work> InProcCommunicator::AllGather(Buffer in, Buffer out) {
  return group_->PostCollective(rank_, CollectiveKind::kAllGather, in, out, 0);
}

std::shared_ptr<Work> InProcCommunicator::ReduceScatterSum(Buffer in, Buffer out) {
  return group_->PostCollective(rank_, CollectiveKind::kReduceScatterSum, in, out, 0);
}

std::shared_ptr<Work> InProcCommunicator::Broadcast(Buffer buf, int root) {
  return group_->PostCollective(rank_, CollectiveKind::kBroadcast, buf, buf, root);
}

std::shared_ptr<Work> InProcCommunicator::Barrier() {
  return group_->PostCollective(rank_, CollectiveKind::kBarrier, Buffer{}, Buffer{}, 0);
}

std::shared_ptr<Work> InProcCommunicator::AllToAllV(Buffer in, std::vector<int64_t> send_counts,
                                                    Buffer out, std::vector<int64_t> recv_counts) {
  const absl::Status valid =
      CheckAllToAllVArgs(absl::StrCat("inproc AllToAllV on rank ", rank_), in, send_counts, out,
                         recv_counts, rank_, size());
  if (!valid.ok()) return CompletedWork(valid);
  return group_->PostCollective(rank_, CollectiveKind::kAllToAllV, in, out, 0,
                                std::move(send_counts), std::move(recv_counts));
}

void InProcCommunicator::Abort(absl::string_view reason) { group_->Abort(rank_, reason); }

}  // namespace baton::comm
