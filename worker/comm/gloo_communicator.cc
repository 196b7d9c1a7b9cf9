#include "worker/comm/gloo_communicator.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <mutex>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <atomic>
#include <deque>
#include <exception>
#include <map>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "gloo/common/error.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/store.h"
#include "gloo/transport/tcp/device.h"
#include "gloo/transport/unbound_buffer.h"
#include "worker/comm/rendezvous.h"

namespace baton::comm {

using UnboundBuffer = ::gloo::transport::UnboundBuffer;

namespace {

// Gloo's own wait timeout closes every pair of the context when it expires,
// so Gloo waits are unbounded and our deadlines are enforced elsewhere
// (Work::Wait, the watchdog); Abort interrupts them.
constexpr std::chrono::milliseconds kNoGlooDeadline = std::chrono::hours(24 * 365);

// After a peer's connection breaks, how long its ops get to finish what Gloo
// already delivered before they fail (Gloo never signals a receive whose
// payload it was reading when the connection broke).
constexpr absl::Duration kBrokenPeerGrace = absl::Milliseconds(500);

// How long a posted point-to-point op may wait for a caller to claim its
// Gloo wait before the watchdog's sweep gives it to a pool thread.
constexpr absl::Duration kClaimWindow = absl::Milliseconds(2);

// Gloo slots: point-to-point uses the tag itself; collectives set the top
// bit and encode (collective sequence number, step).
constexpr uint64_t kCollectiveSlotBit = uint64_t{1} << 63;
constexpr int kStepBits = 20;

// Slot of the standing receives that detect broken connections; nothing is
// ever sent on it (collective sequence numbers stay far below).
constexpr uint64_t kSentinelSlot = ~uint64_t{0};

uint64_t CollectiveSlot(uint64_t seq, uint64_t step) {
  return kCollectiveSlotBit | (seq << kStepBits) | step;
}

template <typename T>
void AddInto(void* dst, const void* src, int64_t n) {
  T* d = static_cast<T*>(dst);
  const T* s = static_cast<const T*>(src);
  for (int64_t i = 0; i < n; ++i) d[i] += s[i];
}

void AddInto(DType dtype, void* dst, const void* src, int64_t n) {
  switch (dtype) {
    case DType::kFloat32:
      return AddInto<float>(dst, src, n);
    case DType::kInt32:
      return AddInto<int32_t>(dst, src, n);
    case DType::kInt64:
      return AddInto<int64_t>(dst, src, n);
    case DType::kUInt8:
      return AddInto<uint8_t>(dst, src, n);
  }
}

// Element ranges of `count` split into `parts` nearly equal chunks.
struct Chunks {
  Chunks(int64_t count, int parts) : offset(parts + 1, 0) {
    for (int i = 0; i < parts; ++i) {
      offset[i + 1] = offset[i] + count / parts + (i < count % parts ? 1 : 0);
    }
  }
  int64_t begin(int i) const { return offset[i]; }
  int64_t len(int i) const { return offset[i + 1] - offset[i]; }
  std::vector<int64_t> offset;
};

// Gloo's rendezvous record is its tcp::Address per pair: a sockaddr_storage
// (filled by getsockname, so only the address's own bytes are set) and a
// sequence number. Zero the rest of each sockaddr_storage so that what goes
// to the coordinator's KV holds only defined bytes (no stack contents).
void ZeroAddressPadding(std::vector<char>* record) {
  constexpr size_t kRecord = sizeof(sockaddr_storage) + sizeof(ssize_t);
  if (record->empty() || record->size() % kRecord != 0) return;
  for (size_t off = 0; off < record->size(); off += kRecord) {
    sa_family_t family;
    std::memcpy(&family, record->data() + off, sizeof(family));
    size_t used;
    if (family == AF_INET) {
      used = offsetof(sockaddr_in, sin_zero);
    } else if (family == AF_INET6) {
      used = sizeof(sockaddr_in6);
    } else {
      return;  // not an address record: leave it alone
    }
    std::memset(record->data() + off + used, 0, sizeof(sockaddr_storage) - used);
  }
}

// Adapts our Store to the one Gloo's connectFullMesh uses. Gloo expects
// exceptions; ours carry the Store's message. Waits end at `deadline`.
class GlooStoreAdapter : public ::gloo::rendezvous::Store {
 public:
  GlooStoreAdapter(baton::comm::Store& store, absl::Time deadline)
      : store_(store), deadline_(deadline) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    std::vector<char> defined = data;
    ZeroAddressPadding(&defined);
    Check(store_.Set(key, absl::string_view(defined.data(), defined.size())));
  }
  std::vector<char> get(const std::string& key) override {
    absl::StatusOr<std::string> v = store_.Get(key, Remaining());
    Check(v.status());
    return std::vector<char>(v->begin(), v->end());
  }
  void wait(const std::vector<std::string>& keys) override {
    Check(store_.Wait(keys, Remaining()));
  }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& /*gloo_timeout*/) override {
    Check(store_.Wait(keys, Remaining()));
  }

 private:
  absl::Duration Remaining() const {
    return std::max(deadline_ - absl::Now(), absl::ZeroDuration());
  }
  static void Check(const absl::Status& s) {
    if (!s.ok()) throw ::gloo::IoException(s.ToString());
  }

  baton::comm::Store& store_;
  const absl::Time deadline_;
};

}  // namespace

// Runs callbacks at given times on one thread. The thread sleeps at most
// kTimerNap at a time and is woken only for a callback due before it would
// wake anyway, so scheduling the usual far-off deadline costs no context
// switch. Callbacks run under the timer's lock, so they must be short and
// take only leaf locks; once Cancel() returns, its callback is not running
// and never will. After Shutdown() nothing runs.
class Timer {
 public:
  using Token = std::pair<absl::Time, uint64_t>;

  Timer() : thread_([this] { Loop(); }) {}
  ~Timer() { Shutdown(); }

  Token Schedule(absl::Time when, std::function<void()> fn) {
    absl::MutexLock lock(&mu_);
    Token token(when, next_id_++);
    if (stop_) return token;
    queue_.emplace(token, std::move(fn));
    if (when < wake_at_) ++version_;
    return token;
  }

  void Cancel(const Token& token) {
    absl::MutexLock lock(&mu_);
    queue_.erase(token);
  }

  void Shutdown() {
    {
      absl::MutexLock lock(&mu_);
      if (stop_) return;
      stop_ = true;
      queue_.clear();
    }
    thread_.join();
  }

 private:
  static constexpr absl::Duration kTimerNap = absl::Milliseconds(100);

  void Loop() {
    absl::MutexLock lock(&mu_);
    while (!stop_) {
      wake_at_ = absl::Now() + kTimerNap;
      if (!queue_.empty()) wake_at_ = std::min(wake_at_, queue_.begin()->first.first);
      const uint64_t seen = version_;
      auto changed = [this, seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || version_ != seen;
      };
      mu_.AwaitWithDeadline(absl::Condition(&changed), wake_at_);
      const absl::Time now = absl::Now();
      while (!stop_ && !queue_.empty() && queue_.begin()->first.first <= now) {
        queue_.begin()->second();
        queue_.erase(queue_.begin());
      }
    }
  }

  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t version_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time wake_at_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  std::map<Token, std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

// Runs each task on an idle thread, starting a new one when none is idle:
// a point-to-point op nobody waits for blocks one thread in a Gloo wait.
// Threads are kept until the pool is destroyed.
class WaiterPool {
 public:
  ~WaiterPool() {
    std::vector<std::thread> threads;
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
      threads.swap(threads_);
    }
    for (std::thread& t : threads) t.join();
  }

  void Run(std::function<void()> task) {
    absl::MutexLock lock(&mu_);
    queue_.push_back(std::move(task));
    if (static_cast<size_t>(idle_) < queue_.size()) {
      threads_.emplace_back([this] { Loop(); });
    }
  }

 private:
  void Loop() {
    absl::MutexLock lock(&mu_);
    for (;;) {
      ++idle_;
      mu_.Await(absl::Condition(
          +[](WaiterPool* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu_) {
            return p->stop_ || !p->queue_.empty();
          },
          this));
      --idle_;
      if (queue_.empty()) return;  // stopping
      std::function<void()> task = std::move(queue_.front());
      queue_.pop_front();
      mu_.Unlock();
      task();
      mu_.Lock();
    }
  }

  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int idle_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
};

namespace {

// Waits for one posted Gloo send or recv with `peer`; `*interrupted` when
// Gloo reports the wait aborted (by Abort or a Wait deadline).
absl::Status WaitGloo(absl::string_view what, UnboundBuffer* ub, bool recv, int peer,
                      bool* interrupted) {
  *interrupted = false;
  try {
    const bool done = recv ? ub->waitRecv(nullptr, kNoGlooDeadline)
                           : ub->waitSend(nullptr, kNoGlooDeadline);
    if (!done) {
      *interrupted = true;
      return absl::AbortedError(absl::StrCat(what, ": interrupted"));
    }
    return absl::OkStatus();
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat(what, ": ", recv ? "receiving from" : "sending to",
                                               " rank ", peer, " failed: Gloo: ", e.what()));
  }
}

}  // namespace

class PeerLink;

// One op. Owns the Gloo buffers (and scratch memory) it posted, so they live
// as long as anyone may still touch them.
//
// Who waits in Gloo for a point-to-point op: a thread that calls Wait()
// while nobody else does claims the op and waits in Gloo itself (no hand-off
// between threads; the timer interrupts it at the Wait deadline). An op
// asked IsCompleted(), or found unclaimed by the watchdog's sweep, is handed
// to a pool thread, so that it completes (and the watchdog sees it complete)
// even if nobody waits. A collective is completed by the executor.
class GlooWork : public Work, public std::enable_shared_from_this<GlooWork> {
 public:
  GlooWork(std::string what, absl::Time deadline, std::shared_ptr<Timer> timer)
      : what_(std::move(what)), deadline_(deadline), timer_(std::move(timer)) {}

  // Makes this a point-to-point op over `link` (a direct connection to
  // `peer`) of `bytes` at `data` with `tag`.
  void StartDirect(std::shared_ptr<PeerLink> link, bool recv, int peer, uint64_t tag,
                   void* data, size_t bytes) {
    absl::MutexLock lock(&mu_);
    waiting_for_ = peer;
    peer_ = peer;
    link_ = std::move(link);
    io_recv_ = recv;
    io_tag_ = tag;
    io_data_ = static_cast<char*>(data);
    io_bytes_ = bytes;
    posted_ = absl::Now();
  }

  // Direct point-to-point state (see PeerLink): set once by StartDirect
  // (under mu_: the watchdog may already see the op, and PeerBroken reads
  // link_ under mu_) before the op is posted; io_done_ belongs to whoever
  // moves its bytes.
  std::shared_ptr<PeerLink> link_;
  bool io_recv_ = false;
  uint64_t io_tag_ = 0;
  char* io_data_ = nullptr;
  size_t io_bytes_ = 0;
  size_t io_done_ = 0;  // sends: header + payload bytes written
  char io_header_[16] = {};

  // Whether the op has its final status, without a lock.
  bool settled() const { return settled_.load(std::memory_order_acquire); }

  // Makes this a point-to-point op on `ub` (owned by this op) with `peer`.
  void StartPointToPoint(UnboundBuffer* ub, bool recv, int peer, WaiterPool* pool) {
    absl::MutexLock lock(&mu_);
    waiting_for_ = peer;
    p2p_ub_ = ub;
    p2p_recv_ = recv;
    peer_ = peer;
    pool_ = pool;
    posted_ = absl::Now();
  }

  // `peer`'s connection broke (`why`). If this op involves it (a
  // point-to-point op with it, or any collective) and has not finished
  // within `grace`, it fails with `why`.
  void PeerBroken(int peer, const absl::Status& why, absl::Duration grace) {
    bool p2p;
    {
      // Under mu_: the watchdog can see the op (registered by Start) while
      // its owner is still in StartDirect writing link_ (ThreadSanitizer).
      absl::MutexLock lock(&mu_);
      if (link_ != nullptr) return;  // its link fails it when the connection breaks
      p2p = p2p_ub_ != nullptr;
      if (done_ || (p2p && peer_ != peer)) return;
      broken_ = absl::Status(why.code(), absl::StrCat(what_, ": ", why.message()));
    }
    timer_->Schedule(absl::Now() + grace, [self = shared_from_this()] {
      absl::MutexLock lock(&self->mu_);
      for (auto& ub : self->buffers_) {
        ub->abortWaitRecv();
        ub->abortWaitSend();
      }
    });
    if (p2p) ClaimForPool();  // resolves it even if nobody waits
  }

  // OK, or why a peer this op involves is gone.
  absl::Status Broken() {
    absl::MutexLock lock(&mu_);
    return broken_;
  }

  // Hands an unclaimed point-to-point op posted more than `window` ago to
  // the pool, so it completes even if nobody waits for it.
  void ClaimForPoolIfOlderThan(absl::Duration window) {
    {
      absl::MutexLock lock(&mu_);  // the watchdog may see the op before it is set up
      if (done_ || p2p_ub_ == nullptr || absl::Now() - posted_ <= window) return;
    }
    ClaimForPool();
  }

  absl::Status Wait(absl::Duration timeout) override {
    const absl::Time deadline = absl::Now() + timeout;
    if (link_ != nullptr) return WaitDirect(timeout, deadline);
    for (;;) {
      {
        absl::MutexLock lock(&mu_);
        if (done_) return status_;
      }
      if (p2p_ub_ != nullptr && Claim(kCaller)) {
        UnboundBuffer* ub = p2p_ub_;
        const bool recv = p2p_recv_;
        const Timer::Token token = timer_->Schedule(deadline, [ub, recv] {
          if (recv) {
            ub->abortWaitRecv();
          } else {
            ub->abortWaitSend();
          }
        });
        bool interrupted = false;
        absl::Status s = WaitGloo(what_, ub, recv, peer_, &interrupted);
        timer_->Cancel(token);
        if (!interrupted) {
          Complete(std::move(s));
          continue;
        }
        // Interrupted by Abort (then done), a broken peer or our deadline.
        {
          absl::MutexLock lock(&mu_);
          watcher_.store(kNone);
          if (!done_ && !broken_.ok()) CompleteLocked(broken_);
          if (done_) return status_;
        }
        if (absl::Now() >= deadline) {
          ClaimForPool();
          absl::MutexLock lock(&mu_);
          return TimedOut(timeout);
        }
        continue;
      }
      absl::MutexLock lock(&mu_);
      auto settled = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return done_ || (p2p_ub_ != nullptr && watcher_.load() == kNone);
      };
      if (!mu_.AwaitWithDeadline(absl::Condition(&settled), deadline)) return TimedOut(timeout);
    }
  }

  bool IsCompleted() override {
    if (link_ != nullptr) return IsCompletedDirect();
    {
      absl::MutexLock lock(&mu_);
      if (done_) return true;
    }
    if (p2p_ub_ != nullptr) ClaimForPool();
    return false;
  }

  // Whether the op has its final status (no side effects, unlike
  // IsCompleted, which hands an unwatched op to the pool).
  bool Done() {
    absl::MutexLock lock(&mu_);
    return done_;
  }

  // First completion wins.
  void Complete(absl::Status status) {
    absl::MutexLock lock(&mu_);
    CompleteLocked(std::move(status));
  }

  // The communicator is aborting: whoever completes the op from now on
  // completes it with `status` (the executor may see its Gloo calls fail as
  // the connections close, before AbortWith completes the op itself).
  void Aborting(absl::Status status) {
    absl::MutexLock lock(&mu_);
    if (!done_) aborting_ = std::move(status);
  }

  void SetWaitingFor(int rank) {
    absl::MutexLock lock(&mu_);
    waiting_for_ = rank;
  }

  int waiting_for() {
    absl::MutexLock lock(&mu_);
    return waiting_for_;
  }

  // A Gloo buffer over `data` that this op keeps alive and Interrupt()
  // reaches; nullptr once interrupted (the communicator is aborting).
  UnboundBuffer* NewBuffer(::gloo::Context& ctx, void* data, size_t bytes) {
    std::unique_ptr<UnboundBuffer> ub = ctx.createUnboundBuffer(data, bytes);
    absl::MutexLock lock(&mu_);
    if (interrupted_) return nullptr;
    buffers_.push_back(std::move(ub));
    return buffers_.back().get();
  }

  // Copies `bytes` from `src` to `dst` unless the op was interrupted (the
  // communicator aborts): once Abort() returns, no copy of this op touches a
  // caller's buffer. False when interrupted.
  bool CopyUnlessInterrupted(void* dst, const void* src, size_t bytes) {
    absl::MutexLock lock(&mu_);
    if (interrupted_) return false;
    if (bytes > 0) std::memcpy(dst, src, bytes);
    return true;
  }

  // Payload bytes this collective handed to the transport (only the thread
  // running it counts).
  void CountSent(size_t bytes) { sent_ += static_cast<int64_t>(bytes); }
  int64_t sent() const { return sent_; }

  // Zeroed scratch memory that lives as long as this op.
  char* Scratch(size_t bytes) {
    absl::MutexLock lock(&mu_);
    scratch_.emplace_back(bytes, 0);
    return scratch_.back().data();
  }

  // Releases every Gloo wait of this op for good (the communicator aborts).
  void Interrupt() {
    absl::MutexLock lock(&mu_);
    interrupted_ = true;
    for (auto& ub : buffers_) {
      ub->abortWaitRecv();
      ub->abortWaitSend();
    }
  }

  const std::string& what() const { return what_; }
  absl::Time deadline() const { return deadline_; }

 private:
  enum Watcher { kNone, kCaller, kPool };

  bool Claim(Watcher who) {
    int expected = kNone;
    return watcher_.compare_exchange_strong(expected, who);
  }

  // Hands the Gloo wait to a pool thread unless someone waits already. The
  // hand-off runs on the timer thread: the pool lives as long as it runs.
  void ClaimForPool() {
    if (!Claim(kPool)) return;
    timer_->Schedule(absl::Now(), [self = shared_from_this()] { self->HandToPool(); });
  }

  // On the timer thread, after claiming for the pool.
  void HandToPool() {
    pool_->Run([self = shared_from_this()] { self->PoolWait(); });
  }

  void PoolWait() {
    for (;;) {
      bool interrupted = false;
      absl::Status s = WaitGloo(what_, p2p_ub_, p2p_recv_, peer_, &interrupted);
      if (!interrupted) return Complete(std::move(s));
      // By Abort (done), a broken peer, or late by a caller's deadline.
      absl::MutexLock lock(&mu_);
      if (!done_ && !broken_.ok()) CompleteLocked(broken_);
      if (done_) return;
    }
  }

  void CompleteLocked(absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (done_) return;
    done_ = true;
    status_ = aborting_.ok() ? std::move(status) : aborting_;
    settled_.store(true, std::memory_order_release);
  }

  absl::Status WaitDirect(absl::Duration timeout, absl::Time deadline);
  bool IsCompletedDirect();

  absl::Status TimedOut(absl::Duration timeout) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return absl::DeadlineExceededError(absl::StrCat(
        what_, ": not complete after ", absl::FormatDuration(timeout),
        waiting_for_ >= 0 ? absl::StrCat("; waiting for rank ", waiting_for_) : "",
        " (the op is still pending: wait again or Abort the communicator)"));
  }

  const std::string what_;
  const absl::Time deadline_;
  const std::shared_ptr<Timer> timer_;
  // Point-to-point only; set once under mu_ by StartPointToPoint, before the
  // op reaches the caller, and read without the lock after that.
  UnboundBuffer* p2p_ub_ = nullptr;
  bool p2p_recv_ = false;
  int peer_ = -1;
  WaiterPool* pool_ = nullptr;
  absl::Time posted_;
  std::atomic<int> watcher_{kNone};
  std::atomic<bool> settled_{false};

  absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
  absl::Status aborting_ ABSL_GUARDED_BY(mu_);  // set by Aborting
  int waiting_for_ ABSL_GUARDED_BY(mu_) = -1;
  bool interrupted_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::unique_ptr<UnboundBuffer>> buffers_ ABSL_GUARDED_BY(mu_);
  std::deque<std::vector<char>> scratch_ ABSL_GUARDED_BY(mu_);
  int64_t sent_ = 0;  // CountSent: the collective's thread only
};

// A direct TCP connection to one peer that carries this communicator's
// point-to-point messages (collectives stay on Gloo). Gloo's unbound
// buffers cost a ready-to-receive notice per message and a hand-off from
// its I/O thread to the waiting thread; here a message is one frame
// (16-byte header: tag, length; then the payload) written at once by the
// thread that posts the send, and read by the thread that waits for the
// receive, straight into its buffer. Frames whose receive is not posted
// yet are kept (bounded) until it is.
//
// Who moves bytes: one "reader" and one "writer" at a time. A thread in
// Wait() on a receive (a send) takes the reader (writer) role when it is
// free; a reader that waits stops at the end of its own frame. The
// communicator's I/O thread takes either role when the socket is ready,
// nobody holds it and no thread waits for it (so ops nobody waits for
// complete, and a broken connection is seen), and gives it up as soon as
// a thread waits on the link: the thread that waits for a message moves it
// itself, with no hand-off between threads per message. Send() writes what
// the socket takes without blocking; the rest is written by the thread
// that waits for it, or the I/O thread if none does.
class PeerLink {
 public:
  static constexpr size_t kHeader = 16;
  static constexpr size_t kStage = 64 << 10;
  static constexpr size_t kStageRead = 4 << 10;
  static constexpr size_t kArmOnPost = 1 << 20;
  // Longest a blocking recv/send on a link lasts (its socket timeouts).
  static constexpr absl::Duration kBlockSlice = absl::Milliseconds(50);
  // Bytes of frames that arrived before their receive was posted.
  static constexpr uint64_t kMaxUnexpected = uint64_t{1} << 30;

  PeerLink(int peer, int fd, int epoll_fd, uint64_t id, std::string label)
      : peer_(peer), fd_(fd), wfd_(dup(fd)), epoll_fd_(epoll_fd), id_(id),
        label_(std::move(label)), stage_(kStage) {
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLONESHOT;
    ev.data.u64 = id_ << 1;
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd_, &ev);
    armed_ = true;
    epoll_event wev{};
    wev.events = EPOLLONESHOT;  // armed for EPOLLOUT only while frames wait
    wev.data.u64 = (id_ << 1) | 1;
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wfd_, &wev);
  }

  ~PeerLink() {
    close(wfd_);
    close(fd_);
  }

  int peer() const { return peer_; }

  void PostRecv(const std::shared_ptr<GlooWork>& op) {
    absl::MutexLock lock(&mu_);
    if (dead_) return FailOpLocked(*op);
    auto it = unexpected_.find(op->io_tag_);
    if (it != unexpected_.end()) {
      std::vector<char> msg = std::move(it->second.front());
      it->second.pop_front();
      if (it->second.empty()) unexpected_.erase(it);
      unexpected_bytes_ -= msg.size();
      op->Complete(Deliver(*op, msg.data(), msg.size()));
      return;
    }
    posted_[op->io_tag_].push_back(op);
    // A large message is read by the I/O thread if nobody waits for it
    // first (so its sender never stalls on a full socket). A small one is
    // left to the thread that will wait for it (waking the I/O thread too
    // would cost a hand-off), or to IsCompleted() or the watchdog's sweep.
    if (op->io_bytes_ >= kArmOnPost) {
      ++posted_large_;
      ArmReadLocked();
    }
  }

  void PostSend(const std::shared_ptr<GlooWork>& op) {
    const uint64_t header[2] = {op->io_tag_, op->io_bytes_};
    std::memcpy(op->io_header_, header, kHeader);
    {
      absl::MutexLock lock(&mu_);
      if (dead_) return FailOpLocked(*op);
      sendq_.push_back(op);
      if (writing_ || sendq_.size() > 1) return;  // the writer or the I/O thread takes it
      writing_ = true;
    }
    EndWrite(WriteSome(nullptr, absl::InfinitePast()));
  }

  // Waits until `op` completes or `deadline`; reads the socket itself when
  // `op` is a receive and nobody else does. True when complete.
  bool Wait(GlooWork& op, absl::Time deadline) {
    // While a thread waits here, the I/O thread leaves it the role it needs
    // (and hands it over as soon as it sees it): no hand-off per message.
    std::atomic<int>& waiters = op.io_recv_ ? read_waiters_ : write_waiters_;
    waiters.fetch_add(1, std::memory_order_relaxed);
    mu_.Lock();
    // One try at moving bytes even with no time left (Wait(0) polls).
    for (bool tried = false;; tried = true) {
      if (op.settled()) break;
      if (tried && absl::Now() >= deadline) break;
      if (op.io_recv_ && !reading_ && !dead_) {
        reading_ = true;
        if (armed_) {
          Rearm(/*read=*/true, /*on=*/false);
          armed_ = false;
        }
        mu_.Unlock();
        EndRead(ReadSome(&op, deadline));
        mu_.Lock();
        continue;
      }
      if (!op.io_recv_ && !writing_ && !dead_) {
        writing_ = true;
        mu_.Unlock();
        EndWrite(WriteSome(&op, deadline));
        mu_.Lock();
        continue;
      }
      if (absl::Now() >= deadline) break;
      auto settled = [this, &op]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return op.settled() || (!reading_ && !dead_ && op.io_recv_) ||
               (!writing_ && !dead_ && !op.io_recv_);
      };
      mu_.AwaitWithDeadline(absl::Condition(&settled), deadline);
    }
    const bool done = op.settled();
    waiters.fetch_sub(1, std::memory_order_relaxed);
    // If the I/O thread left the socket to this thread and it is leaving
    // without reading to the end, let the I/O thread have it again.
    if (op.io_recv_ && !reading_ && !dead_ && (posted_large_ > 0 || cur_op_ != nullptr)) {
      ArmReadLocked();
    }
    if (!op.io_recv_ && !writing_ && !dead_ && !sendq_.empty()) ArmWriteLocked();
    mu_.Unlock();
    return done;
  }

  // I/O thread: the socket is readable (or broke).
  void OnReadable() {
    {
      absl::MutexLock lock(&mu_);
      armed_ = false;  // one-shot: it fired
      // Whoever reads re-arms it; a thread waiting for a receive reads
      // itself.
      if (reading_ || dead_ || read_waiters_.load(std::memory_order_relaxed) > 0) return;
      reading_ = true;
    }
    EndRead(ReadSome(nullptr, absl::InfinitePast()));
  }

  // I/O thread: the socket takes more bytes.
  void OnWritable() {
    {
      absl::MutexLock lock(&mu_);
      write_armed_ = false;  // one-shot: it fired
      if (writing_ || dead_ || sendq_.empty()) return;
      // A thread waiting for a send writes itself (and re-arms this when it
      // leaves with frames still queued).
      if (write_waiters_.load(std::memory_order_relaxed) > 0) return;
      writing_ = true;
    }
    EndWrite(WriteSome(nullptr, absl::InfinitePast()));
  }

  // Stops all I/O: the connection is shut down (`graceful`: only our
  // sending side, after what was sent), later ops fail with `status`, and
  // once this returns no thread touches any op's buffer. Pending ops are
  // left to the caller (the communicator completes them).
  void Close(const absl::Status& status, bool graceful) {
    // Ops still queued on the link hold it (GlooWork::link_) and it holds
    // them: drop its references, after the lock, so neither leaks. Their
    // final status comes from the communicator (it completes its pending ops).
    std::vector<std::shared_ptr<GlooWork>> dropped;
    absl::MutexLock lock(&mu_);
    if (!dead_) {
      dead_ = true;
      status_ = status;
      shutdown(fd_, graceful ? SHUT_WR : SHUT_RDWR);
    }
    mu_.Await(absl::Condition(
        +[](PeerLink* l) ABSL_EXCLUSIVE_LOCKS_REQUIRED(l->mu_) {
          return !l->reading_ && !l->writing_;
        },
        this));
    for (auto& [tag, q] : posted_) {
      for (auto& op : q) dropped.push_back(std::move(op));
    }
    posted_.clear();
    posted_large_ = 0;
    for (auto& op : sendq_) dropped.push_back(std::move(op));
    sendq_.clear();
    if (cur_op_ != nullptr) dropped.push_back(std::move(cur_op_));
  }

  // Lets the I/O thread read an idle link, so that a broken connection or
  // a message nobody has posted a receive for yet is seen (the watchdog's
  // sweep calls it).
  void ArmIfIdle() {
    absl::MutexLock lock(&mu_);
    ArmReadLocked();
  }

  // Wakes threads waiting on the link (after ops completed elsewhere).
  void Kick() { absl::MutexLock lock(&mu_); }

 private:
  static absl::Status Deliver(GlooWork& op, const char* data, size_t n) {
    if (n != op.io_bytes_) {
      return absl::InvalidArgumentError(absl::StrCat(
          op.what(), ": the peer sent ", n, " bytes for this tag, the receive takes ",
          op.io_bytes_, " (sizes must match)"));
    }
    if (n > 0) std::memcpy(op.io_data_, data, n);
    return absl::OkStatus();
  }

  void FailOpLocked(GlooWork& op) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    op.Complete(absl::Status(status_.code(), absl::StrCat(op.what(), ": ", status_.message())));
  }

  void ArmReadLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (dead_ || reading_ || armed_) return;
    Rearm(/*read=*/true, /*on=*/true);
    armed_ = true;
  }

  // EPOLLOUT for the I/O thread, once until it fires (one syscall saved
  // per message when a waiting thread leaves frames queued each time).
  void ArmWriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (write_armed_) return;
    Rearm(/*read=*/false, /*on=*/true);
    write_armed_ = true;
  }

  void Rearm(bool read, bool on) {
    epoll_event ev{};
    ev.events = EPOLLONESHOT | (on ? static_cast<uint32_t>(read ? EPOLLIN : EPOLLOUT) : 0u);
    ev.data.u64 = (id_ << 1) | (read ? 0 : 1);
    epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, read ? fd_ : wfd_, &ev);
  }

  // The reader role ends with `st` (not OK: the connection failed).
  void EndRead(const absl::Status& st) {
    std::shared_ptr<GlooWork> orphan;
    {
      absl::MutexLock lock(&mu_);
      reading_ = false;
      if (st.ok()) {
        // Only large receives (which nobody may wait for before their
        // sender stalls) keep the I/O thread reading; the rest stays in the
        // socket for the thread that will wait for it, IsCompleted() or the
        // watchdog's sweep (ArmIfIdle): re-arming here would let the I/O
        // thread take the next message from the thread about to wait for
        // it (a hand-off per message).
        // A thread waiting for a receive arms it when it leaves (Wait).
        if ((posted_large_ > 0 || (cur_op_ != nullptr && cur_op_->io_bytes_ >= kArmOnPost)) &&
            read_waiters_.load(std::memory_order_relaxed) == 0) {
          ArmReadLocked();
        }
        return;
      }
      orphan = std::move(cur_op_);
    }
    Fail(st);
    absl::MutexLock lock(&mu_);
    if (orphan != nullptr) FailOpLocked(*orphan);
  }

  void EndWrite(const absl::Status& st) {
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (st.ok()) {
        // A thread waiting for a send re-arms it when it leaves (Wait).
        if (!dead_ && !sendq_.empty() && write_waiters_.load(std::memory_order_relaxed) == 0) {
          ArmWriteLocked();
        }
        return;
      }
    }
    Fail(st);
  }

  // The connection broke (`cause`): fail everything queued on it.
  void Fail(const absl::Status& cause) {
    std::vector<std::shared_ptr<GlooWork>> ops;
    {
      absl::MutexLock lock(&mu_);
      if (dead_) return;  // closed, or failed already
      dead_ = true;
      status_ = absl::UnavailableError(absl::StrCat(
          "rank ", peer_, " of ", label_,
          " is unreachable (its connection broke: the process died, left or aborted): ",
          cause.message()));
      shutdown(fd_, SHUT_RDWR);
      for (auto& [tag, q] : posted_) {
        for (auto& op : q) ops.push_back(op);
      }
      posted_.clear();
      posted_large_ = 0;
      for (auto& op : sendq_) ops.push_back(op);
      sendq_.clear();
      if (!reading_ && cur_op_ != nullptr) ops.push_back(std::move(cur_op_));
    }
    absl::MutexLock lock(&mu_);
    for (auto& op : ops) FailOpLocked(*op);
  }

  // Writer role: writes queued frames until the queue is empty, or the
  // socket is full and (`until` is null, complete, or `deadline` passed).
  absl::Status WriteSome(GlooWork* until, absl::Time deadline) {
    for (;;) {
      std::shared_ptr<GlooWork> op;
      {
        absl::MutexLock lock(&mu_);
        if (dead_ || sendq_.empty()) return absl::OkStatus();
        op = sendq_.front();
      }
      const size_t total = kHeader + op->io_bytes_;
      while (op->io_done_ < total) {
        iovec iov[2];
        int n = 0;
        if (op->io_done_ < kHeader) {
          iov[n++] = {op->io_header_ + op->io_done_, kHeader - op->io_done_};
          iov[n++] = {op->io_data_, op->io_bytes_};
        } else {
          const size_t off = op->io_done_ - kHeader;
          iov[n++] = {op->io_data_ + off, op->io_bytes_ - off};
        }
        msghdr msg{};
        msg.msg_iov = iov;
        msg.msg_iovlen = n;
        const bool block = until != nullptr && !until->settled() &&
                           deadline - absl::Now() > kBlockSlice;
        const ssize_t w = sendmsg(fd_, &msg, MSG_NOSIGNAL | (block ? 0 : MSG_DONTWAIT));
        if (w > 0) {
          op->io_done_ += static_cast<size_t>(w);
          // The I/O thread hands the role to a thread that waits for a send.
          if (until == nullptr && op->io_done_ < total &&
              write_waiters_.load(std::memory_order_relaxed) > 0) {
            return absl::OkStatus();
          }
          continue;
        }
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
          if (until == nullptr || until->settled()) return absl::OkStatus();
          const absl::Duration left = deadline - absl::Now();
          if (left <= absl::ZeroDuration()) return absl::OkStatus();
          if (left > kBlockSlice) continue;
          pollfd pfd{fd_, POLLOUT, 0};
          const timespec ts = absl::ToTimespec(std::min(left, absl::Seconds(1)));
          ppoll(&pfd, 1, &ts, nullptr);
          continue;
        }
        return absl::UnavailableError(
            absl::StrCat("connection to rank ", peer_, ": send: ", std::strerror(errno)));
      }
      absl::MutexLock lock(&mu_);
      if (!sendq_.empty() && sendq_.front() == op) sendq_.pop_front();
      op->Complete(absl::OkStatus());
    }
  }

  // Reader role: reads and dispatches frames until nothing is readable
  // and (`until` is null, complete, or `deadline` passed).
  absl::Status ReadSome(GlooWork* until, absl::Time deadline) {
    for (;;) {
      BATON_RETURN_IF_ERROR(Dispatch());
      // A waiter whose op is complete stops at the next frame boundary (or
      // in a frame nobody has posted a receive for): reading on would take
      // frames whose receives are not posted yet into memory of their own
      // (an allocation, zeroing and a second copy each; most of the
      // receiver's cost at 64 KiB) or the next frame from the thread about
      // to wait for it.
      if (until != nullptr && until->settled() && (in_header_ || frame_eager_)) {
        return absl::OkStatus();
      }
      char* dst;
      size_t want;
      const bool direct =
          !in_header_ && begin_ == end_ && target_ != nullptr && len_ - got_ >= kStageRead;
      if (direct) {
        dst = target_ + got_;  // large payload: straight into its buffer
        want = len_ - got_;
      } else {
        if (begin_ == end_) begin_ = end_ = 0;
        dst = stage_.data() + end_;
        // A header and a small payload (or several) in one call; the body
        // of a large message then goes straight to its buffer.
        want = std::min(kStage - end_, kStageRead);
      }
      // The waiting thread blocks in recv itself (at most kBlockSlice, the
      // socket's timeout, at a time); the I/O thread never blocks.
      const bool block = until != nullptr && !until->settled() &&
                         deadline - absl::Now() > kBlockSlice;
      const ssize_t r = recv(fd_, dst, want, block ? 0 : MSG_DONTWAIT);
      if (r > 0) {
        if (direct) {
          got_ += static_cast<size_t>(r);
          if (got_ == len_) BATON_RETURN_IF_ERROR(FinishFrame());
        } else {
          end_ += static_cast<size_t>(r);
        }
        // The I/O thread hands the role to a thread that waits for a
        // receive (the frame state stays with the link).
        if (until == nullptr && read_waiters_.load(std::memory_order_relaxed) > 0) {
          BATON_RETURN_IF_ERROR(Dispatch());
          return absl::OkStatus();
        }
        continue;
      }
      if (r == 0) {
        return absl::UnavailableError(
            absl::StrCat("connection to rank ", peer_, " closed by the peer"));
      }
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        return absl::UnavailableError(
            absl::StrCat("connection to rank ", peer_, ": recv: ", std::strerror(errno)));
      }
      if (until == nullptr || until->settled()) return absl::OkStatus();
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) return absl::OkStatus();
      if (left > kBlockSlice) continue;
      pollfd pfd{fd_, POLLIN, 0};
      const timespec ts = absl::ToTimespec(std::min(left, absl::Seconds(1)));
      ppoll(&pfd, 1, &ts, nullptr);
    }
  }

  // Consumes the bytes in the stage: headers start frames, payload bytes
  // go to the frame's target.
  absl::Status Dispatch() {
    while (begin_ < end_) {
      if (in_header_) {
        if (end_ - begin_ < kHeader) {
          std::memmove(stage_.data(), stage_.data() + begin_, end_ - begin_);
          end_ -= begin_;
          begin_ = 0;
          return absl::OkStatus();
        }
        uint64_t header[2];
        std::memcpy(header, stage_.data() + begin_, kHeader);
        begin_ += kHeader;
        BATON_RETURN_IF_ERROR(StartFrame(header[0], header[1]));
        continue;
      }
      const size_t n = std::min(end_ - begin_, len_ - got_);
      if (target_ != nullptr) std::memcpy(target_ + got_, stage_.data() + begin_, n);
      begin_ += n;
      got_ += n;
      if (got_ == len_) BATON_RETURN_IF_ERROR(FinishFrame());
    }
    return absl::OkStatus();
  }

  absl::Status StartFrame(uint64_t tag, uint64_t len) {
    in_header_ = false;
    tag_ = tag;
    len_ = len;
    got_ = 0;
    target_ = nullptr;
    bool eager = false;  // no receive posted yet: held in eager_
    {
      absl::MutexLock lock(&mu_);
      auto it = posted_.find(tag);
      if (it != posted_.end()) {
        cur_op_ = std::move(it->second.front());
        it->second.pop_front();
        if (it->second.empty()) posted_.erase(it);
        if (cur_op_->io_bytes_ >= kArmOnPost) --posted_large_;
        // A size mismatch drains the payload and fails the receive.
        if (cur_op_->io_bytes_ == len) target_ = cur_op_->io_data_;
      } else if (len > kMaxUnexpected - unexpected_bytes_) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "connection to rank ", peer_, ": a ", len, "-byte message (tag ", tag,
            ") arrived before its receive was posted, over the limit of ", kMaxUnexpected,
            " bytes held for receives not yet posted"));
      } else {
        unexpected_bytes_ += len;  // reserved now, so the bound holds
        eager = true;
      }
    }
    frame_eager_ = eager;
    if (eager) {
      eager_.assign(len, 0);
      target_ = eager_.data();
    }
    if (len == 0) return FinishFrame();
    return absl::OkStatus();
  }

  absl::Status FinishFrame() {
    in_header_ = true;
    frame_eager_ = false;
    target_ = nullptr;
    absl::MutexLock lock(&mu_);
    if (cur_op_ != nullptr) {
      std::shared_ptr<GlooWork> op = std::move(cur_op_);
      op->Complete(op->io_bytes_ == len_
                       ? absl::OkStatus()
                       : absl::InvalidArgumentError(absl::StrCat(
                             op->what(), ": the peer sent ", len_,
                             " bytes for this tag, the receive takes ", op->io_bytes_,
                             " (sizes must match)")));
      return absl::OkStatus();
    }
    auto it = posted_.find(tag_);
    if (it != posted_.end()) {  // posted while the payload was arriving
      std::shared_ptr<GlooWork> op = std::move(it->second.front());
      it->second.pop_front();
      if (it->second.empty()) posted_.erase(it);
      if (op->io_bytes_ >= kArmOnPost) --posted_large_;
      unexpected_bytes_ -= eager_.size();
      op->Complete(Deliver(*op, eager_.data(), eager_.size()));
      eager_.clear();
      return absl::OkStatus();
    }
    unexpected_[tag_].push_back(std::move(eager_));
    eager_ = std::vector<char>();
    return absl::OkStatus();
  }

  const int peer_;
  const int fd_;
  const int wfd_;  // a dup of fd_ so that epoll watches writability apart
  const int epoll_fd_;
  const uint64_t id_;
  const std::string label_;

  // Threads in Wait() for a receive / a send on this link.
  std::atomic<int> read_waiters_{0};
  std::atomic<int> write_waiters_{0};

  absl::Mutex mu_;
  bool dead_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  bool reading_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool armed_ ABSL_GUARDED_BY(mu_) = false;        // EPOLLIN
  bool write_armed_ ABSL_GUARDED_BY(mu_) = false;  // EPOLLOUT
  absl::flat_hash_map<uint64_t, std::deque<std::shared_ptr<GlooWork>>> posted_
      ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, std::deque<std::vector<char>>> unexpected_ ABSL_GUARDED_BY(mu_);
  uint64_t unexpected_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // Posted receives of kArmOnPost bytes or more (they keep the I/O thread
  // reading).
  size_t posted_large_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<std::shared_ptr<GlooWork>> sendq_ ABSL_GUARDED_BY(mu_);
  // The receive whose frame is being read (reader role, or under mu_ when
  // no one holds it).
  std::shared_ptr<GlooWork> cur_op_ ABSL_GUARDED_BY(mu_);

  // Reader role only.
  std::vector<char> stage_;
  size_t begin_ = 0, end_ = 0;
  bool in_header_ = true;
  uint64_t tag_ = 0, len_ = 0, got_ = 0;
  char* target_ = nullptr;
  bool frame_eager_ = false;  // the frame is read into eager_ (no receive posted)
  std::vector<char> eager_;
};

absl::Status GlooWork::WaitDirect(absl::Duration timeout, absl::Time deadline) {
  if (!link_->Wait(*this, deadline)) {
    absl::MutexLock lock(&mu_);
    if (!done_) return TimedOut(timeout);
  }
  absl::MutexLock lock(&mu_);
  return status_;
}

bool GlooWork::IsCompletedDirect() {
  if (settled()) return true;
  link_->ArmIfIdle();  // the I/O thread moves it on
  return false;
}

// The communicator's I/O thread: epoll over its links' sockets.
class LinkPoller {
 public:
  LinkPoller() : epoll_fd_(epoll_create1(EPOLL_CLOEXEC)), wake_fd_(eventfd(0, EFD_CLOEXEC)) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = ~uint64_t{0};
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
  }
  ~LinkPoller() {
    Stop();
    close(wake_fd_);
    close(epoll_fd_);
  }

  int epoll_fd() const { return epoll_fd_; }

  // Starts the thread over `links` (indexed by the ids they were made with).
  void Start(std::vector<PeerLink*> links) {
    links_ = std::move(links);
    thread_ = std::thread([this] { Loop(); });
  }

  void Stop() {
    if (!thread_.joinable()) return;
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
    thread_.join();
  }

 private:
  void Loop() {
    epoll_event events[32];
    for (;;) {
      const int n = epoll_wait(epoll_fd_, events, 32, -1);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return;
      for (int i = 0; i < n; ++i) {
        const uint64_t key = events[i].data.u64;
        if (key == ~uint64_t{0}) return;
        PeerLink* link = links_[key >> 1];
        if (link == nullptr) continue;
        if (key & 1) {
          link->OnWritable();
        } else {
          link->OnReadable();
        }
      }
    }
  }

  const int epoll_fd_;
  const int wake_fd_;
  std::vector<PeerLink*> links_;
  std::thread thread_;
};

// One thread running tasks in submission order (collectives must be issued
// in the same order on every rank). Drains its queue before it is destroyed.
class SerialExecutor {
 public:
  SerialExecutor() : thread_([this] { Loop(); }) {}
  ~SerialExecutor() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    thread_.join();
  }

  void Run(std::function<void()> task) {
    absl::MutexLock lock(&mu_);
    queue_.push_back(std::move(task));
  }

 private:
  void Loop() {
    absl::MutexLock lock(&mu_);
    for (;;) {
      mu_.Await(absl::Condition(
          +[](SerialExecutor* e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(e->mu_) {
            return e->stop_ || !e->queue_.empty();
          },
          this));
      if (queue_.empty()) return;  // stopping
      std::function<void()> task = std::move(queue_.front());
      queue_.pop_front();
      mu_.Unlock();
      task();
      mu_.Lock();
    }
  }

  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

namespace {

std::string Bytes(size_t n) { return absl::StrCat(n, " B"); }

// Waits for a posted send or recv of collective `w` with `peer`.
absl::Status WaitGloo(GlooWork& w, UnboundBuffer* ub, bool recv, int peer) {
  BATON_RETURN_IF_ERROR(w.Broken());
  w.SetWaitingFor(peer);
  bool interrupted = false;
  absl::Status s = WaitGloo(w.what(), ub, recv, peer, &interrupted);
  if (interrupted) {
    BATON_RETURN_IF_ERROR(w.Broken());
    return absl::AbortedError(absl::StrCat(w.what(), ": interrupted by Abort"));
  }
  return s;
}

absl::Status GlooError(GlooWork& w, const std::exception& e) {
  return absl::UnavailableError(absl::StrCat(w.what(), ": Gloo: ", e.what()));
}

// Posts a send of `send_n` bytes at `send_off` of `send_ub` to `to` and a
// receive of `recv_n` bytes into `recv_ub` at `recv_off` from `from`, both
// on `slot`, and waits for both. Zero-byte halves are skipped (both sides
// compute the same sizes).
absl::Status Exchange(GlooWork& w, UnboundBuffer* send_ub, size_t send_off, size_t send_n,
                      int to, UnboundBuffer* recv_ub, size_t recv_off, size_t recv_n,
                      int from, uint64_t slot) {
  try {
    if (recv_n > 0) recv_ub->recv(from, slot, recv_off, recv_n);
    if (send_n > 0) send_ub->send(to, slot, send_off, send_n);
    w.CountSent(send_n);
  } catch (const std::exception& e) {
    return GlooError(w, e);
  }
  if (recv_n > 0) BATON_RETURN_IF_ERROR(WaitGloo(w, recv_ub, /*recv=*/true, from));
  if (send_n > 0) BATON_RETURN_IF_ERROR(WaitGloo(w, send_ub, /*recv=*/false, to));
  return absl::OkStatus();
}

absl::Status CheckHost(const Buffer& b, absl::string_view what) {
  if (b.device >= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": the Gloo backend takes host memory; buffer is on CUDA device ", b.device,
        " (stage it through host memory or use the NCCL backend)"));
  }
  if (b.count < 0 || (b.count > 0 && b.data == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": invalid buffer (count ", b.count, ")"));
  }
  return absl::OkStatus();
}

std::shared_ptr<Work> Failed(std::string what, absl::Status status) {
  auto w = std::make_shared<GlooWork>(std::move(what), absl::InfiniteFuture(), nullptr);
  w->Complete(std::move(status));
  return w;
}

}  // namespace

namespace {

constexpr uint32_t kLinkHello = 0xBA701F2Bu;

void CloseAll(std::vector<int>& fds) {
  for (int& fd : fds) {
    if (fd >= 0) close(fd);
    fd = -1;
  }
}

absl::Status WaitFd(int fd, short events, absl::Time deadline, absl::string_view what) {
  for (;;) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(absl::StrCat(what, ": timed out"));
    }
    pollfd pfd{fd, events, 0};
    const timespec ts = absl::ToTimespec(left);
    const int n = ppoll(&pfd, 1, &ts, nullptr);
    if (n > 0) return absl::OkStatus();
    if (n < 0 && errno != EINTR) {
      return absl::UnavailableError(absl::StrCat(what, ": poll: ", std::strerror(errno)));
    }
  }
}

// Blocking-with-deadline transfer of a small fixed message.
absl::Status ExchangeHello(int fd, bool send, uint32_t* words, absl::Time deadline,
                           absl::string_view what) {
  char* p = reinterpret_cast<char*>(words);
  size_t left = 2 * sizeof(uint32_t);
  while (left > 0) {
    BATON_RETURN_IF_ERROR(WaitFd(fd, send ? POLLOUT : POLLIN, deadline, what));
    const ssize_t n = send ? ::send(fd, p, left, MSG_DONTWAIT | MSG_NOSIGNAL)
                           : recv(fd, p, left, MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      left -= static_cast<size_t>(n);
    } else if (n == 0) {
      return absl::UnavailableError(absl::StrCat(what, ": closed by the peer"));
    } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
    }
  }
  return absl::OkStatus();
}

// Blocking sockets (the I/O thread passes MSG_DONTWAIT) whose blocking
// calls end after PeerLink::kBlockSlice, so waits keep their deadlines.
void TuneLink(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  const timeval slice = absl::ToTimeval(PeerLink::kBlockSlice);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &slice, sizeof(slice));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &slice, sizeof(slice));
}

// The direct point-to-point connections of rank `o.rank` (see PeerLink):
// every rank listens on `o.hostname` and publishes "<rank>" = "host port";
// each connects to the lower ranks and accepts the higher ones, and the
// connecting side names itself first. Returns one socket per peer (-1 for
// this rank).
absl::StatusOr<std::vector<int>> ConnectLinks(Store& store, const GlooOptions& o,
                                              absl::Time deadline) {
  std::vector<int> fds(o.size, -1);
  if (o.size == 1) return fds;
  const std::string where = absl::StrCat(o.label, ": rank ", o.rank, " of ", o.size);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  if (int rc = getaddrinfo(o.hostname.c_str(), "0", &hints, &res); rc != 0 || res == nullptr) {
    return absl::UnavailableError(absl::StrCat(where, ": cannot resolve ", o.hostname, ": ",
                                               gai_strerror(rc)));
  }
  const int family = res->ai_family;
  int listener = socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const bool bound = listener >= 0 && bind(listener, res->ai_addr, res->ai_addrlen) == 0 &&
                     listen(listener, o.size) == 0;
  freeaddrinfo(res);
  if (!bound) {
    const std::string err = std::strerror(errno);
    if (listener >= 0) close(listener);
    return absl::UnavailableError(
        absl::StrCat(where, ": cannot listen on ", o.hostname, ": ", err));
  }
  sockaddr_storage addr{};
  socklen_t addr_len = sizeof(addr);
  getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &addr_len);
  const int port = ntohs(family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                            : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  auto fail = [&](absl::Status s) {
    close(listener);
    CloseAll(fds);
    return s;
  };
  PrefixStore keys(&store, "p2p");
  if (absl::Status s = keys.Set(absl::StrCat(o.rank), absl::StrCat(o.hostname, " ", port));
      !s.ok()) {
    return fail(s);
  }
  for (int peer = 0; peer < o.rank; ++peer) {
    const std::string what = absl::StrCat(where, ": connecting to rank ", peer);
    absl::StatusOr<std::string> value =
        keys.Get(absl::StrCat(peer), std::max(deadline - absl::Now(), absl::ZeroDuration()));
    if (!value.ok()) return fail(value.status());
    const size_t space = value->rfind(' ');
    if (space == std::string::npos) {
      return fail(absl::InvalidArgumentError(absl::StrCat(what, ": bad address ", *value)));
    }
    const std::string host = value->substr(0, space), service = value->substr(space + 1);
    addrinfo chints{};
    chints.ai_family = AF_UNSPEC;
    chints.ai_socktype = SOCK_STREAM;
    addrinfo* peer_addr = nullptr;
    if (getaddrinfo(host.c_str(), service.c_str(), &chints, &peer_addr) != 0 ||
        peer_addr == nullptr) {
      return fail(absl::UnavailableError(absl::StrCat(what, ": cannot resolve ", *value)));
    }
    int fd = socket(peer_addr->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    int rc = fd < 0 ? -1 : connect(fd, peer_addr->ai_addr, peer_addr->ai_addrlen);
    freeaddrinfo(peer_addr);
    if (fd < 0) return fail(absl::UnavailableError(absl::StrCat(what, ": socket")));
    fds[peer] = fd;
    if (rc != 0 && errno != EINPROGRESS) {
      return fail(absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno))));
    }
    if (absl::Status s = WaitFd(fd, POLLOUT, deadline, what); !s.ok()) return fail(s);
    int err = 0;
    socklen_t len = sizeof(err);
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) {
      return fail(absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(err))));
    }
    uint32_t hello[2] = {kLinkHello, static_cast<uint32_t>(o.rank)};
    if (absl::Status s = ExchangeHello(fd, /*send=*/true, hello, deadline, what); !s.ok()) {
      return fail(s);
    }
  }
  for (int accepted = o.rank + 1; accepted < o.size; ++accepted) {
    const std::string what = absl::StrCat(where, ": accepting ranks above ", o.rank);
    if (absl::Status s = WaitFd(listener, POLLIN, deadline, what); !s.ok()) return fail(s);
    int fd = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == ECONNABORTED) {
        --accepted;
        continue;
      }
      return fail(absl::UnavailableError(absl::StrCat(what, ": accept: ", std::strerror(errno))));
    }
    uint32_t hello[2] = {0, 0};
    absl::Status s = ExchangeHello(fd, /*send=*/false, hello, deadline, what);
    const int peer = static_cast<int>(hello[1]);
    if (s.ok() && (hello[0] != kLinkHello || peer <= o.rank || peer >= o.size ||
                   fds[peer] >= 0)) {
      s = absl::InvalidArgumentError(absl::StrCat(
          what, ": a connection that is not a new rank of this group (", hello[0], ", ",
          hello[1], ")"));
    }
    if (!s.ok()) {
      close(fd);
      return fail(s);
    }
    fds[peer] = fd;
  }
  close(listener);
  for (int fd : fds) {
    if (fd >= 0) TuneLink(fd);
  }
  return fds;
}

}  // namespace

absl::StatusOr<std::unique_ptr<GlooCommunicator>> GlooCommunicator::Create(
    Store& store, const GlooOptions& options) {
  // Gloo's TCP transport writes with writev, which cannot pass MSG_NOSIGNAL:
  // a collective that writes to a peer that just died would raise SIGPIPE
  // and kill the process. Ignore it (process-wide, as worker/main.cc does)
  // so the write fails with EPIPE and the op with UNAVAILABLE.
  static std::once_flag ignore_sigpipe;
  std::call_once(ignore_sigpipe, [] { signal(SIGPIPE, SIG_IGN); });
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size) {
    return absl::InvalidArgumentError(absl::StrCat(
        options.label, ": rank ", options.rank, " is not in a group of size ", options.size));
  }
  const absl::Time deadline = absl::Now() + options.rendezvous_timeout;
  BATON_RETURN_IF_ERROR(ArriveAll(store, options.rank, options.size, deadline, options.label));

  auto context = std::make_shared<::gloo::rendezvous::Context>(options.rank, options.size);
  try {
    ::gloo::transport::tcp::attr attr;
    attr.hostname = options.hostname;
    std::shared_ptr<::gloo::transport::Device> device =
        ::gloo::transport::tcp::CreateDevice(attr);
    // Gloo waits up to 5x its timeout for a pair to connect.
    const absl::Duration remaining = std::max(deadline - absl::Now(), absl::Milliseconds(5));
    context->setTimeout(absl::ToChronoMilliseconds(remaining / 5));
    PrefixStore gloo_keys(&store, "gloo");
    GlooStoreAdapter adapter(gloo_keys, deadline);
    context->connectFullMesh(adapter, device);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat(options.label, ": rank ", options.rank, " of ",
                                               options.size, " cannot connect: Gloo: ", e.what()));
  }
  BATON_ASSIGN_OR_RETURN(std::vector<int> link_fds, ConnectLinks(store, options, deadline));
  return std::unique_ptr<GlooCommunicator>(
      new GlooCommunicator(options, std::move(context), std::move(link_fds)));
}

GlooCommunicator::GlooCommunicator(const GlooOptions& options,
                                   std::shared_ptr<::gloo::rendezvous::Context> context,
                                   std::vector<int> link_fds)
    : options_(options),
      context_(std::move(context)),
      timer_(std::make_shared<Timer>()),
      waiters_(std::make_unique<WaiterPool>()),
      collectives_(std::make_unique<SerialExecutor>()),
      poller_(std::make_unique<LinkPoller>()),
      sentinel_bytes_(options.size) {
  links_.resize(options_.size);
  std::vector<PeerLink*> by_id(options_.size, nullptr);
  for (int peer = 0; peer < options_.size; ++peer) {
    if (link_fds[peer] < 0) continue;
    // A broken link fails its own ops and later ones with that peer; Gloo's
    // sentinels (WatchPeer) judge the collectives, which run on Gloo's pairs.
    links_[peer] = std::make_shared<PeerLink>(peer, link_fds[peer], poller_->epoll_fd(), peer,
                                              options_.label);
    by_id[peer] = links_[peer].get();
  }
  poller_->Start(std::move(by_id));
  // All sentinels exist before any can fire (AbortWith walks them).
  sentinels_.resize(options_.size);
  for (int peer = 0; peer < options_.size; ++peer) {
    if (peer != options_.rank) {
      sentinels_[peer] = context_->createUnboundBuffer(&sentinel_bytes_[peer], 1);
    }
  }
  for (int peer = 0; peer < options_.size; ++peer) {
    if (peer != options_.rank) WatchPeer(peer);
  }
  watchdog_ = std::thread([this] { WatchdogLoop(); });
}

void GlooCommunicator::WatchPeer(int peer) {
  UnboundBuffer* sentinel = sentinels_[peer].get();
  const std::string what = absl::StrCat("connection to rank ", peer);
  absl::Status broken;
  try {
    sentinel->recv(peer, kSentinelSlot);
  } catch (const std::exception& e) {
    broken = absl::UnavailableError(absl::StrCat(what, ": Gloo: ", e.what()));
  }
  auto on_break = [this, peer](const absl::Status& s) { PeerBroken(peer, s); };
  if (!broken.ok()) {
    on_break(broken);
    return;
  }
  waiters_->Run([sentinel, peer, what, on_break] {
    bool interrupted = false;
    absl::Status s = WaitGloo(what, sentinel, /*recv=*/true, peer, &interrupted);
    if (!interrupted) on_break(s);  // never completes normally: nothing is sent there
  });
}

void GlooCommunicator::PeerBroken(int peer, const absl::Status& cause) {
  const absl::Status why = absl::UnavailableError(
      absl::StrCat("rank ", peer, " of ", options_.label,
                   " is unreachable (its connection broke: the process died, left or aborted): ",
                   cause.message()));
  std::vector<std::shared_ptr<GlooWork>> pending;
  {
    absl::MutexLock lock(&mu_);
    if (aborted_ || broken_peers_.contains(peer)) return;
    broken_peers_.emplace(peer, why);
    for (auto& [ptr, work] : pending_) pending.push_back(work);
  }
  for (const std::shared_ptr<GlooWork>& work : pending) {
    work->PeerBroken(peer, why, kBrokenPeerGrace);
  }
}

GlooCommunicator::~GlooCommunicator() {
  bool idle;
  {
    absl::MutexLock lock(&mu_);
    PruneLocked();
    idle = !aborted_ && pending_.empty();
    if (idle) {
      aborted_ = true;
      abort_status_ = absl::AbortedError(absl::StrCat(options_.label, ": communicator destroyed"));
    }
  }
  if (idle) {
    // Close gently (data already sent still reaches the peers): the sockets
    // close with the Gloo context, once no Work holds its buffers.
    for (auto& sentinel : sentinels_) {
      if (sentinel != nullptr) sentinel->abortWaitRecv();
    }
    const absl::Status gone =
        absl::AbortedError(absl::StrCat(options_.label, ": communicator destroyed"));
    for (auto& link : links_) {
      if (link != nullptr) link->Close(gone, /*graceful=*/true);
    }
  } else {
    Abort("communicator destroyed with ops pending");
  }
  poller_->Stop();
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  watchdog_.join();
  collectives_.reset();  // drains: queued collectives fail fast (aborted)
  timer_->Shutdown();    // no more hand-offs to the pool
  waiters_.reset();      // every Gloo wait was interrupted by Abort
}

std::shared_ptr<GlooWork> GlooCommunicator::Start(std::string what, int peer) {
  auto work = std::make_shared<GlooWork>(
      absl::StrCat(what, " on rank ", options_.rank, " of ", options_.label),
      absl::Now() + options_.op_timeout, timer_);
  absl::MutexLock lock(&mu_);
  if (aborted_) {
    work->Complete(absl::AbortedError(
        absl::StrCat(work->what(), ": communicator was aborted (", abort_status_.message(), ")")));
    return work;
  }
  auto broken = peer >= 0 ? broken_peers_.find(peer) : broken_peers_.begin();
  if (broken != broken_peers_.end()) {
    work->Complete(absl::UnavailableError(
        absl::StrCat(work->what(), ": ", broken->second.message())));
    return work;
  }
  if (pending_.size() >= prune_at_) PruneLocked();
  pending_[work.get()] = work;
  return work;
}

void GlooCommunicator::PruneLocked() {
  absl::erase_if(pending_, [](const auto& entry) { return entry.second->Done(); });
  prune_at_ = std::max<size_t>(64, 2 * pending_.size());
}

void GlooCommunicator::Finish(const std::shared_ptr<GlooWork>& work, absl::Status status) {
  work->Complete(std::move(status));
  absl::MutexLock lock(&mu_);
  pending_.erase(work.get());
}

std::shared_ptr<Work> GlooCommunicator::Send(Buffer buf, int peer, uint64_t tag) {
  return PointToPoint(/*send=*/true, buf, peer, tag);
}

std::shared_ptr<Work> GlooCommunicator::Recv(Buffer buf, int peer, uint64_t tag) {
  return PointToPoint(/*send=*/false, buf, peer, tag);
}

std::shared_ptr<Work> GlooCommunicator::PointToPoint(bool send, Buffer buf, int peer,
                                                     uint64_t tag) {
  std::string what = absl::StrCat(send ? "Send to" : "Recv from", " rank ", peer, " (tag ", tag,
                                  ", ", Bytes(buf.bytes()), ")");
  absl::Status valid = CheckHost(buf, what);
  if (valid.ok() && (peer < 0 || peer >= options_.size || peer == options_.rank)) {
    valid = absl::InvalidArgumentError(absl::StrCat(what, ": peer must be another rank of 0..",
                                                    options_.size - 1));
  }
  if (valid.ok() && (tag & kCollectiveSlotBit) != 0) {
    valid = absl::InvalidArgumentError(absl::StrCat(what, ": tags must be below 2^63"));
  }
  if (!valid.ok()) return Failed(std::move(what), valid);

  std::shared_ptr<GlooWork> work = Start(std::move(what), peer);
  if (work->Done()) return work;
  if (buf.bytes() == 0) {
    Finish(work, absl::OkStatus());
    return work;
  }
  PeerLink* link = links_[peer].get();
  work->StartDirect(links_[peer], /*recv=*/!send, peer, tag, buf.data, buf.bytes());
  if (send) {
    link->PostSend(work);
  } else {
    link->PostRecv(work);
  }
  return work;
}

std::shared_ptr<Work> GlooCommunicator::EnqueueCollective(std::string what, Collective run) {
  std::shared_ptr<GlooWork> work = Start(std::move(what), /*peer=*/-1);
  if (work->Done()) return work;
  // Sequence numbers (and so Gloo slots) agree across ranks because every
  // rank issues collectives in the same order; the executor keeps it.
  absl::MutexLock lock(&mu_);
  const uint64_t seq = next_collective_++;
  collectives_->Run([this, work, seq, run = std::move(run)] {
    absl::Status status;
    {
      absl::MutexLock lock(&mu_);
      if (aborted_) {
        // Named as AbortWith names the ops it completes (it may not have
        // reached this one yet).
        status = absl::Status(abort_status_.code(),
                              absl::StrCat(work->what(), ": ", abort_status_.message()));
      } else if (!broken_peers_.empty()) {
        status = absl::UnavailableError(
            absl::StrCat(work->what(), ": ", broken_peers_.begin()->second.message()));
      }
    }
    if (!status.ok()) {
      Finish(work, std::move(status));
      return;
    }
    status = run(*work, seq);
    collective_bytes_sent_.fetch_add(work->sent(), std::memory_order_relaxed);
    if (!status.ok() && !absl::IsAborted(status)) {
      // A failed collective leaves the group out of step and Gloo may still
      // hold this op's buffers on other pairs: abort, so none is touched.
      AbortWith(absl::AbortedError(absl::StrCat(options_.label, ": aborted because ",
                                                work->what(), " failed: ", status.message())),
                work.get(), status);
    }
    Finish(work, std::move(status));
  });
  return work;
}

std::shared_ptr<Work> GlooCommunicator::AllReduceSum(Buffer buf) {
  std::string what = absl::StrCat("AllReduceSum(", buf.count, " elements)");
  absl::Status valid = CheckHost(buf, what);
  if (!valid.ok()) return Failed(std::move(what), valid);
  return EnqueueCollective(std::move(what), [this, buf](GlooWork& w, uint64_t seq) {
    return RingAllReduce(w, seq, buf);
  });
}

std::shared_ptr<Work> GlooCommunicator::AllGather(Buffer in, Buffer out) {
  std::string what = absl::StrCat("AllGather(", in.count, " elements per rank)");
  absl::Status valid = CheckHost(in, what);
  if (valid.ok()) valid = CheckHost(out, what);
  if (valid.ok() && (out.count != in.count * options_.size || out.dtype != in.dtype)) {
    valid = absl::InvalidArgumentError(absl::StrCat(
        what, ": output must hold size() * input elements of the same dtype, has ", out.count));
  }
  if (!valid.ok()) return Failed(std::move(what), valid);
  return EnqueueCollective(std::move(what), [this, in, out](GlooWork& w, uint64_t seq) {
    return RingAllGather(w, seq, in, out);
  });
}

std::shared_ptr<Work> GlooCommunicator::ReduceScatterSum(Buffer in, Buffer out) {
  std::string what = absl::StrCat("ReduceScatterSum(", out.count, " elements per rank)");
  absl::Status valid = CheckHost(in, what);
  if (valid.ok()) valid = CheckHost(out, what);
  if (valid.ok() && (in.count != out.count * options_.size || out.dtype != in.dtype)) {
    valid = absl::InvalidArgumentError(absl::StrCat(
        what, ": input must hold size() * output elements of the same dtype, has ", in.count));
  }
  if (!valid.ok()) return Failed(std::move(what), valid);
  return EnqueueCollective(std::move(what), [this, in, out](GlooWork& w, uint64_t seq) {
    return RingReduceScatter(w, seq, in, out);
  });
}

std::shared_ptr<Work> GlooCommunicator::Broadcast(Buffer buf, int root) {
  std::string what = absl::StrCat("Broadcast(", buf.count, " elements from rank ", root, ")");
  absl::Status valid = CheckHost(buf, what);
  if (valid.ok() && (root < 0 || root >= options_.size)) {
    valid = absl::InvalidArgumentError(absl::StrCat(what, ": no such root"));
  }
  if (!valid.ok()) return Failed(std::move(what), valid);
  return EnqueueCollective(std::move(what), [this, buf, root](GlooWork& w, uint64_t seq) {
    return DirectBroadcast(w, seq, buf, root);
  });
}

std::shared_ptr<Work> GlooCommunicator::Barrier() {
  return EnqueueCollective("Barrier", [this](GlooWork& w, uint64_t seq) {
    return AllToAllBarrier(w, seq);
  });
}

std::shared_ptr<Work> GlooCommunicator::AllToAllV(Buffer in, std::vector<int64_t> send_counts,
                                                  Buffer out, std::vector<int64_t> recv_counts) {
  std::string what =
      absl::StrCat("AllToAllV(", in.count, " elements out, ", out.count, " elements in)");
  absl::Status valid = CheckHost(in, what);
  if (valid.ok()) valid = CheckHost(out, what);
  if (valid.ok()) {
    valid = CheckAllToAllVArgs(what, in, send_counts, out, recv_counts, options_.rank,
                               options_.size);
  }
  if (!valid.ok()) return Failed(std::move(what), valid);
  return EnqueueCollective(
      std::move(what), [this, in, out, send_counts = std::move(send_counts),
                        recv_counts = std::move(recv_counts)](GlooWork& w, uint64_t seq) {
        return PairwiseAllToAllV(w, seq, in, send_counts, out, recv_counts);
      });
}

// Reduce-scatter then all-gather around the ring; rank r ends the first
// phase owning the full sum of chunk r.
absl::Status GlooCommunicator::RingAllReduce(GlooWork& w, uint64_t seq, Buffer buf) {
  const int n = options_.size, r = options_.rank;
  if (n == 1 || buf.count == 0) return absl::OkStatus();
  const size_t es = DTypeSize(buf.dtype);
  const Chunks chunks(buf.count, n);
  char* data = static_cast<char*>(buf.data);
  char* scratch = ExecutorScratch(0, static_cast<size_t>(chunks.len(0)) * es);
  UnboundBuffer* send_ub = w.NewBuffer(*context_, data, buf.bytes());
  UnboundBuffer* recv_ub = w.NewBuffer(*context_, data, buf.bytes());
  UnboundBuffer* scratch_ub = w.NewBuffer(*context_, scratch, chunks.len(0) * es);
  if (send_ub == nullptr || recv_ub == nullptr || scratch_ub == nullptr) {
    return absl::AbortedError(absl::StrCat(w.what(), ": aborted"));
  }
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  for (int s = 0; s < n - 1; ++s) {
    const int sc = (r - s - 1 + 2 * n) % n, rc = (r - s - 2 + 2 * n) % n;
    BATON_RETURN_IF_ERROR(Exchange(w, send_ub, chunks.begin(sc) * es, chunks.len(sc) * es, next,
                                   scratch_ub, 0, chunks.len(rc) * es, prev,
                                   CollectiveSlot(seq, s)));
    AddInto(buf.dtype, data + chunks.begin(rc) * es, scratch, chunks.len(rc));
  }
  for (int s = 0; s < n - 1; ++s) {
    const int sc = (r - s + n) % n, rc = (r - s - 1 + n) % n;
    BATON_RETURN_IF_ERROR(Exchange(w, send_ub, chunks.begin(sc) * es, chunks.len(sc) * es, next,
                                   recv_ub, chunks.begin(rc) * es, chunks.len(rc) * es, prev,
                                   CollectiveSlot(seq, n + s)));
  }
  return absl::OkStatus();
}

absl::Status GlooCommunicator::RingAllGather(GlooWork& w, uint64_t seq, Buffer in, Buffer out) {
  const int n = options_.size, r = options_.rank;
  const size_t block = in.bytes();
  char* data = static_cast<char*>(out.data);
  if (block > 0) std::memmove(data + r * block, in.data, block);
  if (n == 1 || block == 0) return absl::OkStatus();
  UnboundBuffer* send_ub = w.NewBuffer(*context_, data, out.bytes());
  UnboundBuffer* recv_ub = w.NewBuffer(*context_, data, out.bytes());
  if (send_ub == nullptr || recv_ub == nullptr) {
    return absl::AbortedError(absl::StrCat(w.what(), ": aborted"));
  }
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  for (int s = 0; s < n - 1; ++s) {
    const int sb = (r - s + n) % n, rb = (r - s - 1 + n) % n;
    BATON_RETURN_IF_ERROR(Exchange(w, send_ub, sb * block, block, next, recv_ub, rb * block,
                                   block, prev, CollectiveSlot(seq, s)));
  }
  return absl::OkStatus();
}

absl::Status GlooCommunicator::RingReduceScatter(GlooWork& w, uint64_t seq, Buffer in,
                                                 Buffer out) {
  const int n = options_.size, r = options_.rank;
  const size_t block = out.bytes();
  if (block == 0) return absl::OkStatus();
  if (n == 1) {
    std::memmove(out.data, in.data, block);
    return absl::OkStatus();
  }
  // Accumulate in a copy so that `in` is left as the caller gave it.
  char* acc = ExecutorScratch(0, in.bytes());
  std::memcpy(acc, in.data, in.bytes());
  char* scratch = ExecutorScratch(1, block);
  UnboundBuffer* send_ub = w.NewBuffer(*context_, acc, in.bytes());
  UnboundBuffer* scratch_ub = w.NewBuffer(*context_, scratch, block);
  if (send_ub == nullptr || scratch_ub == nullptr) {
    return absl::AbortedError(absl::StrCat(w.what(), ": aborted"));
  }
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  for (int s = 0; s < n - 1; ++s) {
    const int sb = (r - s - 1 + 2 * n) % n, rb = (r - s - 2 + 2 * n) % n;
    BATON_RETURN_IF_ERROR(Exchange(w, send_ub, sb * block, block, next, scratch_ub, 0, block,
                                   prev, CollectiveSlot(seq, s)));
    AddInto(out.dtype, acc + rb * block, scratch, out.count);
  }
  std::memcpy(out.data, acc + r * block, block);
  return absl::OkStatus();
}

absl::Status GlooCommunicator::DirectBroadcast(GlooWork& w, uint64_t seq, Buffer buf,
                                               int root) {
  const int n = options_.size, r = options_.rank;
  if (n == 1 || buf.bytes() == 0) return absl::OkStatus();
  const uint64_t slot = CollectiveSlot(seq, 0);
  if (r != root) {
    UnboundBuffer* ub = w.NewBuffer(*context_, buf.data, buf.bytes());
    if (ub == nullptr) return absl::AbortedError(absl::StrCat(w.what(), ": aborted"));
    try {
      ub->recv(root, slot);
    } catch (const std::exception& e) {
      return GlooError(w, e);
    }
    return WaitGloo(w, ub, /*recv=*/true, root);
  }
  std::vector<std::pair<int, UnboundBuffer*>> sends;
  for (int peer = 0; peer < n; ++peer) {
    if (peer == root) continue;
    UnboundBuffer* ub = w.NewBuffer(*context_, buf.data, buf.bytes());
    if (ub == nullptr) return absl::AbortedError(absl::StrCat(w.what(), ": aborted"));
    try {
      ub->send(peer, slot);
      w.CountSent(buf.bytes());
    } catch (const std::exception& e) {
      return GlooError(w, e);
    }
    sends.emplace_back(peer, ub);
  }
  for (auto& [peer, ub] : sends) BATON_RETURN_IF_ERROR(WaitGloo(w, ub, /*recv=*/false, peer));
  return absl::OkStatus();
}

// Every rank sends a one-byte token to every other and waits for theirs.
absl::Status GlooCommunicator::AllToAllBarrier(GlooWork& w, uint64_t seq) {
  const int n = options_.size, r = options_.rank;
  if (n == 1) return absl::OkStatus();
  char* tokens = w.Scratch(2 * n);
  const uint64_t slot = CollectiveSlot(seq, 0);
  std::vector<std::pair<int, UnboundBuffer*>> recvs, sends;
  for (int peer = 0; peer < n; ++peer) {
    if (peer == r) continue;
    UnboundBuffer* in = w.NewBuffer(*context_, tokens + peer, 1);
    UnboundBuffer* out = w.NewBuffer(*context_, tokens + n + peer, 1);
    if (in == nullptr || out == nullptr) {
      return absl::AbortedError(absl::StrCat(w.what(), ": aborted"));
    }
    try {
      in->recv(peer, slot);
      out->send(peer, slot);
      w.CountSent(1);
    } catch (const std::exception& e) {
      return GlooError(w, e);
    }
    recvs.emplace_back(peer, in);
    sends.emplace_back(peer, out);
  }
  for (auto& [peer, ub] : recvs) BATON_RETURN_IF_ERROR(WaitGloo(w, ub, /*recv=*/true, peer));
  for (auto& [peer, ub] : sends) BATON_RETURN_IF_ERROR(WaitGloo(w, ub, /*recv=*/false, peer));
  return absl::OkStatus();
}

// Step 0: every pair of ranks swaps what it will exchange, {elements this
// rank sends the peer, elements it expects from it, dtype}, all peers at
// once, so that a pair that disagrees fails before any payload reaches Gloo
// (whose I/O thread cannot take a message longer than its receive). Both
// ranks of such a pair see the disagreement; each sends the other a token
// once it has its counts and waits for the peer's before failing, so that
// neither aborts (and resets the connection) before the other has read its
// counts. Then step s = 1..n-1 sends to rank r + s and receives from rank
// r - s (mod n): every pair meets in exactly one step, and a step waits on
// one peer each way. Zero-element chunks are skipped (both ranks know them).
absl::Status GlooCommunicator::PairwiseAllToAllV(GlooWork& w, uint64_t seq, Buffer in,
                                                 const std::vector<int64_t>& send_counts,
                                                 Buffer out,
                                                 const std::vector<int64_t>& recv_counts) {
  const int n = options_.size, r = options_.rank;
  const size_t es = DTypeSize(in.dtype);
  const std::vector<int64_t> send_off = ChunkOffsets(send_counts);
  const std::vector<int64_t> recv_off = ChunkOffsets(recv_counts);
  char* src = static_cast<char*>(in.data);
  char* dst = static_cast<char*>(out.data);
  const absl::Status aborted = absl::AbortedError(absl::StrCat(w.what(), ": aborted"));
  if (recv_counts[r] > 0 &&
      !w.CopyUnlessInterrupted(dst + recv_off[r] * es, src + send_off[r] * es,
                               static_cast<size_t>(recv_counts[r]) * es)) {
    return aborted;
  }
  if (n == 1) return absl::OkStatus();

  constexpr size_t kWords = 3;  // sends, expects, dtype
  constexpr size_t kRecord = kWords * sizeof(int64_t);
  char* records = w.Scratch(2 * n * kRecord);  // this rank's, then the peers'
  char* theirs = records + n * kRecord;
  const uint64_t counts_slot = CollectiveSlot(seq, 0);
  std::vector<std::pair<int, UnboundBuffer*>> recvs, sends;
  for (int peer = 0; peer < n; ++peer) {
    if (peer == r) continue;
    const int64_t mine[kWords] = {send_counts[peer], recv_counts[peer],
                                  static_cast<int64_t>(in.dtype)};
    std::memcpy(records + peer * kRecord, mine, kRecord);
    UnboundBuffer* from = w.NewBuffer(*context_, theirs + peer * kRecord, kRecord);
    UnboundBuffer* to = w.NewBuffer(*context_, records + peer * kRecord, kRecord);
    if (from == nullptr || to == nullptr) return aborted;
    try {
      from->recv(peer, counts_slot);
      to->send(peer, counts_slot);
      w.CountSent(kRecord);
    } catch (const std::exception& e) {
      return GlooError(w, e);
    }
    recvs.emplace_back(peer, from);
    sends.emplace_back(peer, to);
  }
  for (auto& [peer, ub] : recvs) BATON_RETURN_IF_ERROR(WaitGloo(w, ub, /*recv=*/true, peer));
  for (auto& [peer, ub] : sends) BATON_RETURN_IF_ERROR(WaitGloo(w, ub, /*recv=*/false, peer));

  absl::Status disagreement;
  std::vector<int> disagree;
  for (int peer = 0; peer < n; ++peer) {
    if (peer == r) continue;
    int64_t got[kWords];
    std::memcpy(got, theirs + peer * kRecord, kRecord);
    if (got[0] == recv_counts[peer] && got[1] == send_counts[peer] &&
        got[2] == static_cast<int64_t>(in.dtype)) {
      continue;
    }
    disagree.push_back(peer);
    if (!disagreement.ok()) continue;
    disagreement = absl::InvalidArgumentError(
        got[2] != static_cast<int64_t>(in.dtype)
            ? absl::StrCat(w.what(), ": rank ", peer, " exchanges elements of ",
                           DTypeSize(static_cast<DType>(got[2])), " bytes, this rank of ", es,
                           "; every rank must pass one dtype")
            : absl::StrCat(w.what(), ": rank ", peer, " sends ", got[0],
                           " elements to this rank and expects ", got[1],
                           " from it; this rank expects ", recv_counts[peer], " (recv_counts[",
                           peer, "]) and sends ", send_counts[peer], " (send_counts[", peer,
                           "]): the ranks must agree on the counts (exchange them first: "
                           "ExchangeCounts)"));
  }
  if (!disagreement.ok()) {
    // The peer has this rank's counts once its token arrives; its own
    // failure (it aborted after ours arrived) changes nothing here.
    char* tokens = w.Scratch(2 * n);
    const uint64_t token_slot = CollectiveSlot(seq, n);
    std::vector<std::pair<int, UnboundBuffer*>> token_recvs, token_sends;
    for (int peer : disagree) {
      UnboundBuffer* from = w.NewBuffer(*context_, tokens + peer, 1);
      UnboundBuffer* to = w.NewBuffer(*context_, tokens + n + peer, 1);
      if (from == nullptr || to == nullptr) return disagreement;
      try {
        from->recv(peer, token_slot);
        to->send(peer, token_slot);
        w.CountSent(1);
      } catch (const std::exception&) {
        return disagreement;
      }
      token_recvs.emplace_back(peer, from);
      token_sends.emplace_back(peer, to);
    }
    for (auto& [peer, ub] : token_recvs) WaitGloo(w, ub, /*recv=*/true, peer).IgnoreError();
    for (auto& [peer, ub] : token_sends) WaitGloo(w, ub, /*recv=*/false, peer).IgnoreError();
    if (disagree.size() > 1) {
      return absl::InvalidArgumentError(absl::StrCat(disagreement.message(), " (and ",
                                                     disagree.size() - 1,
                                                     " more rank(s) disagree with this one)"));
    }
    return disagreement;
  }

  UnboundBuffer* send_ub = nullptr;
  UnboundBuffer* recv_ub = nullptr;
  if (in.bytes() > 0 && (send_ub = w.NewBuffer(*context_, src, in.bytes())) == nullptr) {
    return aborted;
  }
  if (out.bytes() > 0 && (recv_ub = w.NewBuffer(*context_, dst, out.bytes())) == nullptr) {
    return aborted;
  }
  for (int s = 1; s < n; ++s) {
    const int to = (r + s) % n, from = (r - s + n) % n;
    BATON_RETURN_IF_ERROR(Exchange(w, send_ub, send_off[to] * es, send_counts[to] * es, to,
                                   recv_ub, recv_off[from] * es, recv_counts[from] * es, from,
                                   CollectiveSlot(seq, s)));
  }
  return absl::OkStatus();
}

char* GlooCommunicator::ExecutorScratch(int which, size_t bytes) {
  std::vector<char>& scratch = executor_scratch_[which];
  if (scratch.size() < bytes) scratch.resize(bytes);
  return scratch.data();
}

void GlooCommunicator::Abort(absl::string_view reason) {
  const absl::Status status =
      absl::AbortedError(absl::StrCat(options_.label, ": aborted: ", reason));
  AbortWith(status, nullptr, status);
}

void GlooCommunicator::AbortWith(absl::Status status, const GlooWork* culprit,
                                 absl::Status culprit_status) {
  std::vector<std::shared_ptr<GlooWork>> pending;
  {
    absl::MutexLock lock(&mu_);
    if (aborted_) return;
    aborted_ = true;
    abort_status_ = status;
    for (auto& [ptr, work] : pending_) pending.push_back(work);
    pending_.clear();
  }
  auto final_status = [&](const GlooWork& work) {
    return &work == culprit
               ? culprit_status
               : absl::Status(status.code(), absl::StrCat(work.what(), ": ", status.message()));
  };
  // Before the connections close: an op whose thread sees its Gloo call fail
  // as they do still ends with the abort's status, not the Gloo error.
  for (const std::shared_ptr<GlooWork>& work : pending) work->Aborting(final_status(*work));
  // After this no Gloo I/O touches any buffer; peers see the connections
  // reset and fail their own pending ops at once.
  for (auto& link : links_) {
    if (link != nullptr) link->Close(status, /*graceful=*/false);
  }
  context_->closeConnections();
  for (auto& sentinel : sentinels_) {
    if (sentinel != nullptr) sentinel->abortWaitRecv();
  }
  for (const std::shared_ptr<GlooWork>& work : pending) {
    work->Complete(final_status(*work));
    work->Interrupt();
  }
  for (auto& link : links_) {
    if (link != nullptr) link->Kick();  // waiters see their ops completed
  }
}

void GlooCommunicator::WatchdogLoop() {
  const absl::Duration period =
      std::clamp(options_.op_timeout / 10, absl::Milliseconds(1), absl::Milliseconds(100));
  for (;;) {
    std::shared_ptr<GlooWork> expired;
    std::vector<std::shared_ptr<GlooWork>> open;
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stop_), period)) return;
      PruneLocked();
      const absl::Time now = absl::Now();
      for (auto& [ptr, work] : pending_) {
        open.push_back(work);
        if (expired == nullptr && work->deadline() < now) expired = work;
      }
    }
    for (auto& work : open) work->ClaimForPoolIfOlderThan(kClaimWindow);
    for (auto& link : links_) {
      if (link != nullptr) link->ArmIfIdle();
    }
    if (expired == nullptr) continue;
    const int peer = expired->waiting_for();
    std::string why = absl::StrCat(expired->what(), " did not complete within op_timeout ",
                                   absl::FormatDuration(options_.op_timeout),
                                   peer >= 0 ? absl::StrCat("; waiting for rank ", peer) : "");
    AbortWith(absl::AbortedError(absl::StrCat(options_.label, ": aborted by the watchdog: ", why)),
              expired.get(), absl::DeadlineExceededError(absl::StrCat(why, "; communicator aborted")));
  }
}

}  // namespace baton::comm
