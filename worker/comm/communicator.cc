#include "worker/comm/communicator.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace baton::comm {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kInt64:
      return 8;
    case DType::kUInt8:
      return 1;
  }
  return 1;
}

namespace {

class FailedWork : public Work {
 public:
  explicit FailedWork(absl::Status status) : status_(std::move(status)) {}
  absl::Status Wait(absl::Duration) override { return status_; }
  bool IsCompleted() override { return true; }

 private:
  const absl::Status status_;
};

}  // namespace

std::shared_ptr<Work> CompletedWork(absl::Status status) { return std::make_shared<FailedWork>(std::move(status)); }

std::shared_ptr<Work> Communicator::GroupOnStream(const std::vector<P2POp>&, void*) {
  return CompletedWork(absl::UnimplementedError(
      absl::StrCat("the ", backend(), " communicator does not run ops on CUDA streams")));
}

std::shared_ptr<Work> Communicator::AllReduceSumOnStream(Buffer, void*) {
  return CompletedWork(absl::UnimplementedError(
      absl::StrCat("the ", backend(), " communicator does not run ops on CUDA streams")));
}

std::shared_ptr<Work> Communicator::AllGatherOnStream(Buffer, Buffer, void*) {
  return CompletedWork(absl::UnimplementedError(
      absl::StrCat("the ", backend(), " communicator does not run ops on CUDA streams")));
}

}  // namespace baton::comm
