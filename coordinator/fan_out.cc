#include "coordinator/fan_out.h"

namespace baton {

FanOut::FanOut(int threads) {
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Loop(); });
}

FanOut::~FanOut() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  for (std::thread& t : threads_) t.join();
}

void FanOut::Run(size_t n, const std::function<void(size_t)>& fn) {
  absl::MutexLock run_lock(&run_mu_);
  absl::MutexLock lock(&mu_);
  fn_ = &fn;
  next_ = 0;
  n_ = n;
  done_ = 0;
  ++batch_;
  Drain();
  mu_.Await(absl::Condition(
      +[](FanOut* f) ABSL_EXCLUSIVE_LOCKS_REQUIRED(f->mu_) { return f->done_ == f->n_; }, this));
  fn_ = nullptr;
}

void FanOut::Drain() {
  while (next_ < n_) {
    const size_t i = next_++;
    const std::function<void(size_t)>* fn = fn_;
    mu_.Unlock();
    (*fn)(i);
    mu_.Lock();
    ++done_;
  }
}

void FanOut::Loop() {
  absl::MutexLock lock(&mu_);
  uint64_t seen = 0;
  for (;;) {
    auto work = [this, &seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return stop_ || (batch_ != seen && next_ < n_);
    };
    mu_.Await(absl::Condition(&work));
    if (stop_) return;
    seen = batch_;
    Drain();
  }
}

}  // namespace baton
