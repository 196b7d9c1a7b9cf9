// KvStore: the coordinator's rendezvous store (Gloo store, NCCL unique ids).
//
// Keys are scoped by (job, generation). Each job has a current generation; a
// request for an older one is rejected with FAILED_PRECONDITION (its members
// belong to a world that no longer exists), and a request for a newer one
// advances the job and drops every key of older generations, so a new world
// never sees an old world's keys. Values are bytes; Add keeps a decimal
// integer (like c10d's store).
//
// Bounded: only the current generation or the next one is accepted (a
// generation further ahead is OUT_OF_RANGE, so no client can push a job's
// generation to INT64_MAX); at most kMaxJobs jobs, and per job kMaxKeysPerJob
// keys and kMaxBytesPerJob bytes of keys and values (RESOURCE_EXHAUSTED);
// Add refuses to overflow (OUT_OF_RANGE).
//
// Thread-safe; Wait blocks the caller up to its timeout, not the store.
#ifndef BATON_COORDINATOR_KV_STORE_H_
#define BATON_COORDINATOR_KV_STORE_H_

#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace baton {

struct KvScope {
  std::string job;
  int64_t generation = 0;
};

class KvStore {
 public:
  static constexpr size_t kMaxKeyBytes = 512;
  static constexpr size_t kMaxValueBytes = 4 << 20;
  static constexpr size_t kMaxJobs = 16;
  static constexpr int64_t kMaxKeysPerJob = 1 << 16;
  static constexpr int64_t kMaxBytesPerJob = 64 << 20;

  absl::Status Set(const KvScope& scope, const std::string& key, std::string value);
  // NOT_FOUND when absent.
  absl::StatusOr<std::string> Get(const KvScope& scope, const std::string& key);
  // Adds `delta` to the integer at key (absent = 0) and returns the new value.
  absl::StatusOr<int64_t> Add(const KvScope& scope, const std::string& key, int64_t delta);
  // Until every key exists: DEADLINE_EXCEEDED naming the missing keys, or
  // FAILED_PRECONDITION if the generation is superseded meanwhile.
  absl::Status Wait(const KvScope& scope, const std::vector<std::string>& keys, absl::Duration timeout);

  // Moves `job` to `generation` (no-op when already there or beyond).
  void AdvanceGeneration(const std::string& job, int64_t generation);
  int64_t CurrentGeneration(const std::string& job) const;

 private:
  using FullKey = std::tuple<std::string, int64_t, std::string>;
  struct Job {
    int64_t generation = 0;
    int64_t keys = 0;
    int64_t bytes = 0;  // of keys and values
  };
  absl::Status CheckScopeLocked(const KvScope& scope, const std::string& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AdvanceLocked(const std::string& job, int64_t generation) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Stores `value` at `key`, within the job's limits.
  absl::Status PutLocked(const KvScope& scope, const std::string& key, std::string value)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int64_t GenerationLocked(const std::string& job) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::map<std::string, Job> jobs_ ABSL_GUARDED_BY(mu_);
  std::map<FullKey, std::string> values_ ABSL_GUARDED_BY(mu_);
};

}  // namespace baton

#endif  // BATON_COORDINATOR_KV_STORE_H_
