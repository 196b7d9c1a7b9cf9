#include "worker/comm/timed_communicator.h"

#include "absl/time/clock.h"

namespace baton::comm {
namespace {

class TimedWork : public Work {
 public:
  TimedWork(std::shared_ptr<Work> inner, std::atomic<int64_t>* waited_ns, std::atomic<int64_t>* also)
      : inner_(std::move(inner)), waited_ns_(waited_ns), also_(also) {}

  absl::Status Wait(absl::Duration timeout) override {
    const absl::Time start = absl::Now();
    absl::Status s = inner_->Wait(timeout);
    const int64_t ns = absl::ToInt64Nanoseconds(absl::Now() - start);
    waited_ns_->fetch_add(ns);
    if (also_ != nullptr) also_->fetch_add(ns);
    return s;
  }
  bool IsCompleted() override { return inner_->IsCompleted(); }

 private:
  std::shared_ptr<Work> inner_;
  std::atomic<int64_t>* waited_ns_;
  std::atomic<int64_t>* also_;
};

}  // namespace

std::shared_ptr<Work> TimedCommunicator::Wrap(std::shared_ptr<Work> work, std::atomic<int64_t>* also) {
  return std::make_shared<TimedWork>(std::move(work), &waited_ns_, also);
}

}  // namespace baton::comm
