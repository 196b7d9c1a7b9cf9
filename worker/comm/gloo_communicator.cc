#include "worker/comm/gloo_communicator.h"

#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
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
      absl::MutexLock lock(&mu_);
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
    status_ = std::move(status);
  }

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

  absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
  int waiting_for_ ABSL_GUARDED_BY(mu_) = -1;
  bool interrupted_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::unique_ptr<UnboundBuffer>> buffers_ ABSL_GUARDED_BY(mu_);
  std::deque<std::vector<char>> scratch_ ABSL_GUARDED_BY(mu_);
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

absl::StatusOr<std::unique_ptr<GlooCommunicator>> GlooCommunicator::Create(
    Store& store, const GlooOptions& options) {
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
  return std::unique_ptr<GlooCommunicator>(new GlooCommunicator(options, std::move(context)));
}

GlooCommunicator::GlooCommunicator(const GlooOptions& options,
                                   std::shared_ptr<::gloo::rendezvous::Context> context)
    : options_(options),
      context_(std::move(context)),
      timer_(std::make_shared<Timer>()),
      waiters_(std::make_unique<WaiterPool>()),
      collectives_(std::make_unique<SerialExecutor>()),
      sentinel_bytes_(options.size),
      watchdog_([this] { WatchdogLoop(); }) {
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
  } else {
    Abort("communicator destroyed with ops pending");
  }
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
  UnboundBuffer* ub = work->NewBuffer(*context_, buf.data, buf.bytes());
  if (ub == nullptr) return work;  // aborted meanwhile; already completed
  try {
    if (send) {
      ub->send(peer, tag);
    } else {
      ub->recv(peer, tag);
    }
  } catch (const std::exception& e) {
    Finish(work, GlooError(*work, e));
    return work;
  }
  work->StartPointToPoint(ub, /*recv=*/!send, peer, waiters_.get());
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
        status = abort_status_;
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
  // After this no Gloo I/O touches any buffer; peers see the connections
  // reset and fail their own pending ops at once.
  context_->closeConnections();
  for (auto& sentinel : sentinels_) {
    if (sentinel != nullptr) sentinel->abortWaitRecv();
  }
  for (const std::shared_ptr<GlooWork>& work : pending) {
    work->Complete(work.get() == culprit ? culprit_status
                                         : absl::Status(status.code(), absl::StrCat(
                                                                           work->what(), ": ",
                                                                           status.message())));
    work->Interrupt();
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
