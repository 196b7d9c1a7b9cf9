#include "worker/comm/stream_collectives.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace baton::comm {
namespace {

struct Registry {
  absl::Mutex mu;
  absl::flat_hash_map<const Communicator*, std::weak_ptr<StreamCollectives>> live ABSL_GUARDED_BY(mu);
};

Registry& GetRegistry() {
  static Registry* registry = new Registry();
  return *registry;
}

// The outcome of one host-path op, when it has run.
struct Outcome {
  absl::Mutex mu;
  bool done ABSL_GUARDED_BY(mu) = false;
  absl::Status status ABSL_GUARDED_BY(mu);
};

}  // namespace

std::shared_ptr<StreamCollectives> StreamCollectives::For(Communicator& comm) {
  Registry& r = GetRegistry();
  absl::MutexLock lock(&r.mu);
  std::weak_ptr<StreamCollectives>& slot = r.live[&comm];
  std::shared_ptr<StreamCollectives> live = slot.lock();
  if (live == nullptr) {
    live = std::make_shared<StreamCollectives>(comm);
    slot = live;
  }
  return live;
}

std::shared_ptr<StreamCollectives> StreamCollectives::Find(const Communicator& comm) {
  Registry& r = GetRegistry();
  absl::MutexLock lock(&r.mu);
  auto it = r.live.find(&comm);
  return it == r.live.end() ? nullptr : it->second.lock();
}

bool StreamCollectives::CanEnqueue(const Buffer& buf) const {
  return comm_.RunsOnStreams() ? buf.device >= 0 : buf.device < 0;
}

absl::Status StreamCollectives::AllReduceSum(Buffer buf, std::string name, kernels::Stream& stream,
                                             absl::Duration timeout,
                                             const std::shared_ptr<StreamCommStatus>& status) {
  if (!CanEnqueue(buf)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": a ", comm_.backend(), " communicator cannot sum this buffer from a stream"));
  }
  Communicator& comm = comm_;
  return Enqueue(
      stream, std::move(name), timeout, status, [&comm, buf] { return comm.AllReduceSum(buf); },
      [&comm, buf](void* native) { return comm.AllReduceSumOnStream(buf, native); });
}

absl::Status StreamCollectives::AllGather(Buffer in, Buffer out, std::string name, kernels::Stream& stream,
                                          absl::Duration timeout,
                                          const std::shared_ptr<StreamCommStatus>& status) {
  if (!CanEnqueue(in) || !CanEnqueue(out)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": a ", comm_.backend(), " communicator cannot gather these buffers from a stream"));
  }
  Communicator& comm = comm_;
  return Enqueue(
      stream, std::move(name), timeout, status, [&comm, in, out] { return comm.AllGather(in, out); },
      [&comm, in, out](void* native) { return comm.AllGatherOnStream(in, out, native); });
}

absl::Status StreamCollectives::ReduceScatterSum(Buffer in, Buffer out, std::string name,
                                                 kernels::Stream& stream, absl::Duration timeout,
                                                 const std::shared_ptr<StreamCommStatus>& status) {
  if (!CanEnqueue(in) || !CanEnqueue(out)) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": a ", comm_.backend(),
                                                   " communicator cannot reduce-scatter these buffers from a stream"));
  }
  Communicator& comm = comm_;
  return Enqueue(
      stream, std::move(name), timeout, status, [&comm, in, out] { return comm.ReduceScatterSum(in, out); },
      [&comm, in, out](void* native) { return comm.ReduceScatterSumOnStream(in, out, native); });
}

absl::Status StreamCollectives::FollowLastStream(kernels::Stream& stream) {
  if (last_stream_ != nullptr && last_stream_ != &stream) {
    if (handoff_ == nullptr) {
      absl::StatusOr<std::unique_ptr<kernels::Event>> e = kernels::Event::Create(stream.device());
      if (!e.ok()) return e.status();
      handoff_ = std::move(*e);
    }
    BATON_RETURN_IF_ERROR(handoff_->Record(*last_stream_));
    BATON_RETURN_IF_ERROR(handoff_->StreamWait(stream));
  }
  last_stream_ = &stream;
  return absl::OkStatus();
}

void StreamCollectives::TimeOpsOnStreams() {
  absl::MutexLock lock(&mu_);
  timed_ = true;
}

size_t StreamCollectives::event_pairs() const {
  absl::MutexLock lock(&mu_);
  return timers_.size();
}

absl::StatusOr<StreamCollectives::Timer*> StreamCollectives::NextTimer(kernels::Device device) {
  if (timers_used_ == timers_.size()) {
    Timer t;
    BATON_ASSIGN_OR_RETURN(t.start, kernels::Event::Create(device));
    BATON_ASSIGN_OR_RETURN(t.end, kernels::Event::Create(device));
    timers_.push_back(std::move(t));
  }
  return &timers_[timers_used_++];
}

absl::StatusOr<double> StreamCollectives::TakeStreamSeconds() {
  absl::MutexLock lock(&mu_);
  double seconds = 0;
  const size_t used = timers_used_;
  timers_used_ = 0;
  for (size_t i = 0; i < used; ++i) {
    BATON_ASSIGN_OR_RETURN(const double s, timers_[i].end->SecondsSince(*timers_[i].start));
    seconds += std::max(0.0, s);
  }
  return seconds;
}

void StreamCollectives::ForgetStreamSeconds() {
  absl::MutexLock lock(&mu_);
  timers_used_ = 0;
}

absl::Status StreamCollectives::Enqueue(kernels::Stream& stream, std::string name, absl::Duration timeout,
                                        const std::shared_ptr<StreamCommStatus>& status,
                                        std::function<std::shared_ptr<Work>()> post,
                                        const std::function<std::shared_ptr<Work>(void*)>& post_on_stream) {
  absl::MutexLock lock(&mu_);
  BATON_RETURN_IF_ERROR_CTX(FollowLastStream(stream), name, ": ordering after the previous collective's stream");
  if (comm_.RunsOnStreams()) {
    Timer* timer = nullptr;
    if (timed_) {
      absl::StatusOr<Timer*> timer_or = NextTimer(stream.device());
      if (!timer_or.ok()) return WithContext(timer_or.status(), absl::StrCat(name, ": timing it"));
      timer = *timer_or;
      BATON_RETURN_IF_ERROR_CTX(timer->start->Record(stream), name, ": timing it");
    }
    std::shared_ptr<Work> work = post_on_stream(stream.native());
    if (timer != nullptr) BATON_RETURN_IF_ERROR_CTX(timer->end->Record(stream), name, ": timing it");
    if (work->IsCompleted()) {  // refused at once (validation, an aborted communicator)
      absl::Status s = WithContext(work->Wait(absl::ZeroDuration()), name);
      status->Fail(s);
      return s;
    }
    status->Track(std::move(work));
    return absl::OkStatus();
  }
  auto outcome = std::make_shared<Outcome>();
  BATON_RETURN_IF_ERROR_CTX(
      stream.LaunchHostFunc([post = std::move(post), name, timeout, status, outcome] {
        // An earlier op failed: post nothing. (failed() reads only the kept
        // error, never a tracked group still in flight.)
        absl::Status s = status->failed() ? status->status() : absl::OkStatus();
        if (s.ok()) {
          s = WithContext(post()->Wait(timeout), name);
          status->Fail(s);
        }
        absl::MutexLock lock(&outcome->mu);
        outcome->done = true;
        outcome->status = std::move(s);
      }),
      name);
  absl::MutexLock done(&outcome->mu);
  return outcome->done ? outcome->status : absl::OkStatus();
}

}  // namespace baton::comm
