// AsyncWriter: writes a worker's checkpoint shards without stalling training
// for longer than copying the state to host memory. Save() captures every
// chunk's state and layout synchronously (StageModel::CaptureState, between
// steps), then returns; one background thread writes the v2 shard files
// (worker/checkpoint/checkpoint.h) and reports the result through a callback.
// The coordinator writes the manifest once every worker reported its files.
//
// At most `max_pending` saves wait for the writer (default 1, so host memory
// holds at most two copies of the state besides the model); a Save() beyond
// that waits for the writer, and that wait counts as stall. Destruction
// finishes the queued saves.
#ifndef BATON_WORKER_CHECKPOINT_ASYNC_WRITER_H_
#define BATON_WORKER_CHECKPOINT_ASYNC_WRITER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "worker/checkpoint/checkpoint.h"
#include "worker/stage_model.h"

namespace baton::checkpoint {

// One chunk a worker holds: its model and where it sits.
struct ChunkToSave {
  int chunk = 0;
  int tp_rank = 0;
  int tp_size = 1;
  StageModel* model = nullptr;
  // The state to write, captured by the caller (a DP-sharded chunk's, whose
  // moments were gathered: StageModel::CaptureFullState); unset: the writer
  // captures model->CaptureState().
  std::optional<ChunkState> state;
  // The tensors of `state`, in order, when they are not the model's
  // Shards() (an expert-parallel chunk's gathered experts:
  // StageModel::GatherExperts); only their names, shapes and splits are read,
  // during Save.
  std::optional<std::vector<NamedShard>> shards;
};

// What one save did, passed to its callback on the writer thread.
struct SaveResult {
  std::string dir;
  int64_t step = 0;
  absl::Status status;             // the first error, if any
  std::vector<std::string> files;  // names inside dir, when ok
  int64_t bytes = 0;               // bytes of the files written
  double stall_seconds = 0;        // time Save() blocked the caller
  double write_seconds = 0;        // time the writer thread spent on it
};

class AsyncWriter {
 public:
  using Callback = std::function<void(const SaveResult&)>;

  explicit AsyncWriter(int max_pending = 1);
  ~AsyncWriter();
  AsyncWriter(const AsyncWriter&) = delete;
  AsyncWriter& operator=(const AsyncWriter&) = delete;

  // Copies every chunk's state to host memory now and queues writing it to
  // `dir` (created if missing) as the state of committed `step`. `done` runs
  // on the writer thread (it must not call Save). Returns the stall (seconds
  // the call took), or INVALID_ARGUMENT for a chunk whose layout cannot be
  // written (nothing is queued then).
  absl::StatusOr<double> Save(const std::string& dir, int64_t step, const std::vector<ChunkToSave>& chunks,
                              Callback done);
  // Blocks until every queued save has been written and its callback run.
  void Flush();

  // Totals over all saves so far (for the checkpoint metrics).
  int64_t bytes_written() const;
  double stall_seconds() const;

 private:
  struct Job {
    std::string dir;
    int64_t step = 0;
    std::vector<ChunkLayout> layouts;
    std::vector<ChunkState> states;
    double stall_seconds = 0;
    Callback done;
  };
  void Run();
  SaveResult Write(Job& job);

  const int max_pending_;
  mutable absl::Mutex mu_;
  std::deque<Job> queue_ ABSL_GUARDED_BY(mu_);
  bool busy_ ABSL_GUARDED_BY(mu_) = false;  // the writer holds a job
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  double stall_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace baton::checkpoint

#endif  // BATON_WORKER_CHECKPOINT_ASYNC_WRITER_H_
