#include "worker/checkpoint/async_writer.h"

#include <sys/stat.h>

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/file_io.h"
#include "common/status_macros.h"

namespace baton::checkpoint {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

int64_t FileBytes(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 ? static_cast<int64_t>(st.st_size) : 0;
}

}  // namespace

AsyncWriter::AsyncWriter(int max_pending) : max_pending_(max_pending < 1 ? 1 : max_pending) {
  thread_ = std::thread([this] { Run(); });
}

AsyncWriter::~AsyncWriter() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

absl::StatusOr<double> AsyncWriter::Save(const std::string& dir, int64_t step,
                                         const std::vector<ChunkToSave>& chunks, Callback done) {
  const auto start = std::chrono::steady_clock::now();
  Job job;
  job.dir = dir;
  job.step = step;
  job.done = std::move(done);
  for (const ChunkToSave& c : chunks) {
    if (c.model == nullptr) return absl::InvalidArgumentError(absl::StrCat("checkpoint: chunk ", c.chunk, " has no model"));
    BATON_ASSIGN_OR_RETURN(ChunkLayout layout, LayoutOfChunk(c.shards.has_value() ? *c.shards : c.model->Shards(),
                                                                 c.chunk, c.tp_rank, c.tp_size));
    ChunkState state = c.state.has_value() ? *c.state : c.model->CaptureState();
    if (state.values.size() != static_cast<size_t>(layout.elements())) {
      return absl::InternalError(absl::StrCat("checkpoint: chunk ", c.chunk, " captured ", state.values.size(),
                                              " values but its Shards() hold ", layout.elements(),
                                              "; Shards() must list the state's tensors in order"));
    }
    job.layouts.push_back(std::move(layout));
    job.states.push_back(std::move(state));
  }
  {
    absl::MutexLock lock(&mu_);
    auto room = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return static_cast<int>(queue_.size()) < max_pending_;
    };
    mu_.Await(absl::Condition(&room));
    job.stall_seconds = SecondsSince(start);
    stall_ += job.stall_seconds;
    const double stall = job.stall_seconds;
    queue_.push_back(std::move(job));
    return stall;
  }
}

void AsyncWriter::Flush() {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return queue_.empty() && !busy_; };
  mu_.Await(absl::Condition(&idle));
}

int64_t AsyncWriter::bytes_written() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

double AsyncWriter::stall_seconds() const {
  absl::MutexLock lock(&mu_);
  return stall_;
}

SaveResult AsyncWriter::Write(Job& job) {
  const auto start = std::chrono::steady_clock::now();
  SaveResult result;
  result.dir = job.dir;
  result.step = job.step;
  result.stall_seconds = job.stall_seconds;
  result.status = MakeDirectories(job.dir);
  for (size_t i = 0; result.status.ok() && i < job.layouts.size(); ++i) {
    absl::StatusOr<std::string> file = WriteStateShardFile(job.dir, job.layouts[i], job.states[i]);
    if (!file.ok()) {
      result.status = file.status();
      break;
    }
    result.bytes += FileBytes(absl::StrCat(job.dir, "/", *file));
    result.files.push_back(*file);
    job.states[i] = ChunkState();  // free the host copy as soon as it is on disk
  }
  if (!result.status.ok()) result.files.clear();
  result.write_seconds = SecondsSince(start);
  return result;
}

void AsyncWriter::Run() {
  for (;;) {
    Job job;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !queue_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopping, nothing left
      job = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    const SaveResult result = Write(job);
    if (job.done) job.done(result);  // outside the lock
    {
      absl::MutexLock lock(&mu_);
      bytes_ += result.bytes;
      busy_ = false;
    }
  }
}

}  // namespace baton::checkpoint
