#include "worker/comm/timed_communicator.h"

#include "absl/time/clock.h"

namespace baton::comm {
namespace {

class TimedWork : public Work {
 public:
  TimedWork(std::shared_ptr<Work> inner, std::atomic<int64_t>* waited_ns)
      : inner_(std::move(inner)), waited_ns_(waited_ns) {}

  absl::Status Wait(absl::Duration timeout) override {
    const absl::Time start = absl::Now();
    absl::Status s = inner_->Wait(timeout);
    waited_ns_->fetch_add(absl::ToInt64Nanoseconds(absl::Now() - start));
    return s;
  }
  bool IsCompleted() override { return inner_->IsCompleted(); }

 private:
  std::shared_ptr<Work> inner_;
  std::atomic<int64_t>* waited_ns_;
};

}  // namespace

std::shared_ptr<Work> TimedCommunicator::Wrap(std::shared_ptr<Work> work) {
  return std::make_shared<TimedWork>(std::move(work), &waited_ns_);
}

}  // namespace baton::comm
