#include "worker/comm/stream_p2p.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace baton::comm {

void StreamCommStatus::Fail(absl::Status status) {
  if (status.ok()) return;
  absl::MutexLock lock(&mu_);
  if (status_.ok()) status_ = std::move(status);
}

bool StreamCommStatus::failed() const {
  absl::MutexLock lock(&mu_);
  return !status_.ok();
}

absl::Status StreamCommStatus::status() const {
  absl::MutexLock lock(&mu_);
  for (const std::shared_ptr<Work>& work : tracked_) {
    // Complete after the host wait that covered its stream.
    absl::Status s = work->Wait(absl::ZeroDuration());
    if (status_.ok() && !s.ok()) status_ = std::move(s);
  }
  tracked_.clear();
  return status_;
}

void StreamCommStatus::Track(std::shared_ptr<Work> work) {
  absl::MutexLock lock(&mu_);
  tracked_.push_back(std::move(work));
}

void StreamCommStatus::Reset() {
  absl::MutexLock lock(&mu_);
  status_ = absl::OkStatus();
  tracked_.clear();
}

bool CanEnqueueP2P(const Communicator& comm, const Buffer& buf) {
  return comm.RunsOnStreams() ? buf.device >= 0 : buf.device < 0;
}

absl::Status EnqueueP2P(Communicator& comm, std::vector<P2POp> ops, kernels::Stream& stream,
                        absl::Duration timeout, std::shared_ptr<StreamCommStatus> status) {
  for (const P2POp& op : ops) {
    if (!CanEnqueueP2P(comm, op.buf)) {
      return absl::InvalidArgumentError(absl::StrCat(
          op.name, ": a ", comm.backend(), " communicator cannot carry ",
          op.buf.device < 0 ? "host memory from a stream (its groups take CUDA memory only)"
                            : "CUDA memory from a stream (stream-ordered p2p of CUDA memory needs NCCL)"));
    }
  }
  if (comm.RunsOnStreams()) {
    if (status->failed()) return absl::OkStatus();  // an earlier batch failed: post nothing
    std::string names;
    for (const P2POp& op : ops) absl::StrAppend(&names, names.empty() ? "" : ", ", op.name);
    std::shared_ptr<Work> group = comm.GroupOnStream(ops, stream.native());
    if (group->IsCompleted()) {  // refused at once (validation, an aborted communicator)
      absl::Status s = group->Wait(absl::ZeroDuration());
      if (!s.ok()) status->Fail(absl::Status(s.code(), absl::StrCat(names, ": ", s.message())));
      return absl::OkStatus();
    }
    status->Track(std::move(group));
    return absl::OkStatus();
  }
  return stream.LaunchHostFunc([&comm, ops = std::move(ops), timeout, status = std::move(status)] {
    if (status->failed()) return;  // an earlier batch failed: post nothing
    std::vector<std::shared_ptr<Work>> works;
    works.reserve(ops.size());
    for (const P2POp& op : ops) {
      works.push_back(op.send ? comm.Send(op.buf, op.peer, op.tag) : comm.Recv(op.buf, op.peer, op.tag));
    }
    for (size_t i = 0; i < ops.size(); ++i) {
      absl::Status s = works[i]->Wait(timeout);
      if (!s.ok()) {
        status->Fail(absl::Status(s.code(), absl::StrCat(ops[i].name, ": ", s.message())));
        return;
      }
    }
  });
}

bool CanEnqueueAllReduce(const Communicator& comm, const Buffer& buf) {
  return !comm.RunsOnStreams() && buf.device < 0;
}

absl::Status EnqueueAllReduce(Communicator& comm, Buffer buf, std::string name, kernels::Stream& stream,
                              absl::Duration timeout, std::shared_ptr<StreamCommStatus> status) {
  if (!CanEnqueueAllReduce(comm, buf)) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": a ", comm.backend(), " communicator cannot sum this buffer from a stream"));
  }
  return stream.LaunchHostFunc([&comm, buf, name = std::move(name), timeout, status = std::move(status)] {
    if (status->failed()) return;
    absl::Status s = comm.AllReduceSum(buf)->Wait(timeout);
    if (!s.ok()) status->Fail(absl::Status(s.code(), absl::StrCat(name, ": ", s.message())));
  });
}

}  // namespace baton::comm
