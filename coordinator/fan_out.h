// FanOut: runs fn(0..n-1) on a few persistent threads and returns when all
// are done. The job runner sends each command to every worker through it:
// a Session write on the synchronous gRPC server blocks until gRPC has
// taken the message (a thread hand-off, ~50-70 us on a loaded 2-core
// machine), so writing to 1024 workers one after another cost ~200 ms per
// step (bench/control_plane_bench); in parallel the waits overlap.
#ifndef BATON_COORDINATOR_FAN_OUT_H_
#define BATON_COORDINATOR_FAN_OUT_H_

#include <cstddef>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace baton {

class FanOut {
 public:
  explicit FanOut(int threads);
  ~FanOut();

  // Calls fn(i) for every i in [0, n), on the pool and the calling thread;
  // returns when every call has returned. One Run at a time per FanOut.
  void Run(size_t n, const std::function<void(size_t)>& fn);

 private:
  void Loop();
  // Takes indices of the current batch until none is left.
  void Drain() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex run_mu_;  // one Run at a time
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t batch_ ABSL_GUARDED_BY(mu_) = 0;
  const std::function<void(size_t)>* fn_ ABSL_GUARDED_BY(mu_) = nullptr;
  size_t next_ ABSL_GUARDED_BY(mu_) = 0, n_ ABSL_GUARDED_BY(mu_) = 0, done_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::thread> threads_;
};

}  // namespace baton

#endif  // BATON_COORDINATOR_FAN_OUT_H_
