#include "worker/comm/device_staging_communicator.h"

#include <cuda_runtime.h>

#include <functional>
#include <map>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kernels/cuda/cuda_status.h"

namespace baton::comm {

// Pinned host buffers for staging, reused by size.
class PinnedArena {
 public:
  ~PinnedArena() {
    absl::MutexLock lock(&mu_);
    for (auto& [bytes, p] : free_) cudaFreeHost(p);
    for (auto& r : retired_) cudaFreeHost(r.memory);
  }

  absl::StatusOr<void*> Take(size_t bytes) {
    absl::MutexLock lock(&mu_);
    ReclaimLocked();
    auto it = free_.find(bytes);
    if (it != free_.end()) {
      void* p = it->second;
      free_.erase(it);
      return p;
    }
    void* p = nullptr;
    absl::Status s = cuda::CudaStatus(cudaHostAlloc(&p, bytes == 0 ? 1 : bytes, cudaHostAllocDefault),
                                      "cudaHostAlloc", __FILE__, __LINE__);
    if (!s.ok()) return s;
    return p;
  }

  // Returns `p`; kept apart until `inner` completes if it has not yet.
  void Give(void* p, size_t bytes, std::shared_ptr<Work> inner) {
    absl::MutexLock lock(&mu_);
    if (inner == nullptr || inner->IsCompleted()) {
      free_.emplace(bytes, p);
    } else {
      retired_.push_back(Retired{p, bytes, std::move(inner)});
    }
  }

  // After the inner communicator aborted nothing writes into staging memory.
  void ReleaseRetired() {
    absl::MutexLock lock(&mu_);
    for (auto& r : retired_) free_.emplace(r.bytes, r.memory);
    retired_.clear();
  }

 private:
  struct Retired {
    void* memory;
    size_t bytes;
    std::shared_ptr<Work> inner;
  };

  void ReclaimLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<Retired> still;
    for (auto& r : retired_) {
      if (r.inner->IsCompleted()) {
        free_.emplace(r.bytes, r.memory);
      } else {
        still.push_back(std::move(r));
      }
    }
    retired_.swap(still);
  }

  absl::Mutex mu_;
  std::multimap<size_t, void*> free_ ABSL_GUARDED_BY(mu_);
  std::vector<Retired> retired_ ABSL_GUARDED_BY(mu_);
};

namespace {

// What an op does with a buffer: read it, write it, or both.
enum class Role { kIn, kOut, kInOut };

// One staged device buffer: its pinned host twin.
struct Staged {
  Buffer device;  // the caller's buffer
  void* host = nullptr;
  bool copy_back = false;  // written by the op: copy host-to-device after it

  Buffer HostView() const { return Buffer{host, device.count, device.dtype, -1}; }
};

absl::Status Copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, int device) {
  if (bytes == 0) return absl::OkStatus();
  BATON_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  BATON_CUDA_RETURN_IF_ERROR(cudaMemcpy(dst, src, bytes, kind));
  return absl::OkStatus();
}


// The inner op plus the copies back to device memory, done once by the
// first Wait that sees the inner op succeed.
class StagedWork : public Work {
 public:
  StagedWork(std::shared_ptr<Work> inner, std::vector<Staged> staged,
             std::shared_ptr<PinnedArena> arena)
      : inner_(std::move(inner)), staged_(std::move(staged)), arena_(std::move(arena)) {}

  ~StagedWork() override {
    for (const Staged& s : staged_) arena_->Give(s.host, s.device.bytes(), inner_);
  }

  absl::Status Wait(absl::Duration timeout) override {
    absl::Status s = inner_->Wait(timeout);
    if (!s.ok()) return s;
    absl::MutexLock lock(&mu_);
    if (!copied_) {
      copied_ = true;
      for (const Staged& st : staged_) {
        if (!st.copy_back) continue;
        copy_status_ = Copy(st.device.data, st.host, st.device.bytes(), cudaMemcpyHostToDevice,
                            st.device.device);
        if (!copy_status_.ok()) break;
      }
    }
    return copy_status_;
  }

  bool IsCompleted() override { return inner_->IsCompleted(); }

 private:
  const std::shared_ptr<Work> inner_;
  const std::vector<Staged> staged_;
  const std::shared_ptr<PinnedArena> arena_;
  absl::Mutex mu_;
  bool copied_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status copy_status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

DeviceStagingCommunicator::DeviceStagingCommunicator(std::unique_ptr<Communicator> host)
    : host_(std::move(host)), arena_(std::make_shared<PinnedArena>()) {}

DeviceStagingCommunicator::~DeviceStagingCommunicator() {
  host_->Abort("communicator destroyed");
  arena_->ReleaseRetired();
}

namespace {

// Stages the device buffers among `bufs` (inputs copied to host now), runs
// `post` on the host views, and wraps the result. Host buffers pass through.
std::shared_ptr<Work> Staging(
    const std::shared_ptr<PinnedArena>& arena, const std::vector<std::pair<Buffer, Role>>& bufs,
    const std::function<std::shared_ptr<Work>(const std::vector<Buffer>&)>& post) {
  std::vector<Buffer> views;
  std::vector<Staged> staged;
  absl::Status status;
  for (const auto& [buf, role] : bufs) {
    if (buf.device < 0) {
      views.push_back(buf);
      continue;
    }
    absl::StatusOr<void*> host = arena->Take(buf.bytes());
    if (!host.ok()) {
      status = host.status();
      break;
    }
    Staged s{buf, *host, role != Role::kIn};
    staged.push_back(s);
    views.push_back(s.HostView());
    if (role != Role::kOut) {
      status = Copy(s.host, buf.data, buf.bytes(), cudaMemcpyDeviceToHost, buf.device);
      if (!status.ok()) break;
    }
  }
  if (!status.ok()) {
    for (const Staged& s : staged) arena->Give(s.host, s.device.bytes(), nullptr);
    return CompletedWork(
        absl::Status(status.code(), absl::StrCat("staging device memory: ", status.message())));
  }
  if (staged.empty()) return post(views);
  return std::make_shared<StagedWork>(post(views), std::move(staged), arena);
}

}  // namespace

std::shared_ptr<Work> DeviceStagingCommunicator::Send(Buffer buf, int peer, uint64_t tag) {
  return Staging(arena_, {{buf, Role::kIn}}, [&](const std::vector<Buffer>& v) {
    return host_->Send(v[0], peer, tag);
  });
}

std::shared_ptr<Work> DeviceStagingCommunicator::Recv(Buffer buf, int peer, uint64_t tag) {
  return Staging(arena_, {{buf, Role::kOut}}, [&](const std::vector<Buffer>& v) {
    return host_->Recv(v[0], peer, tag);
  });
}

std::shared_ptr<Work> DeviceStagingCommunicator::AllReduceSum(Buffer buf) {
  return Staging(arena_, {{buf, Role::kInOut}},
                 [&](const std::vector<Buffer>& v) { return host_->AllReduceSum(v[0]); });
}

std::shared_ptr<Work> DeviceStagingCommunicator::AllGather(Buffer in, Buffer out) {
  return Staging(arena_, {{in, Role::kIn}, {out, Role::kOut}}, [&](const std::vector<Buffer>& v) {
    return host_->AllGather(v[0], v[1]);
  });
}

std::shared_ptr<Work> DeviceStagingCommunicator::ReduceScatterSum(Buffer in, Buffer out) {
  return Staging(arena_, {{in, Role::kIn}, {out, Role::kOut}}, [&](const std::vector<Buffer>& v) {
    return host_->ReduceScatterSum(v[0], v[1]);
  });
}

std::shared_ptr<Work> DeviceStagingCommunicator::Broadcast(Buffer buf, int root) {
  return Staging(arena_, {{buf, Role::kInOut}},
                 [&](const std::vector<Buffer>& v) { return host_->Broadcast(v[0], root); });
}

std::shared_ptr<Work> DeviceStagingCommunicator::Barrier() { return host_->Barrier(); }

std::shared_ptr<Work> DeviceStagingCommunicator::AllToAllV(Buffer in,
                                                           std::vector<int64_t> send_counts,
                                                           Buffer out,
                                                           std::vector<int64_t> recv_counts) {
  const absl::Status valid = CheckAllToAllVArgs(
      absl::StrCat("AllToAllV(", in.count, " elements out, ", out.count, " elements in) on rank ",
                   rank(), " (staging device memory)"),
      in, send_counts, out, recv_counts, rank(), size());
  if (!valid.ok()) return CompletedWork(valid);
  return Staging(arena_, {{in, Role::kIn}, {out, Role::kOut}}, [&](const std::vector<Buffer>& v) {
    return host_->AllToAllV(v[0], std::move(send_counts), v[1], std::move(recv_counts));
  });
}

void DeviceStagingCommunicator::Abort(absl::string_view reason) {
  host_->Abort(reason);
  arena_->ReleaseRetired();
}

}  // namespace baton::comm
