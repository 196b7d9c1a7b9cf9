// Store: the small key-value interface rendezvous runs on (shaped like
// c10d's Store): Gloo publishes its pair addresses here and NCCL its unique
// id. Implementations: InMemoryStore (threads of one process, tests),
// PrefixStore (scopes keys of one group and generation) and CoordinatorStore
// (the coordinator's KV RPCs, across processes and hosts).
//
// Every blocking call takes a timeout and returns DEADLINE_EXCEEDED naming
// the keys that were missing when it expired. Implementations are
// thread-safe.
#ifndef BATON_WORKER_COMM_STORE_H_
#define BATON_WORKER_COMM_STORE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace baton::comm {

class Store {
 public:
  virtual ~Store() = default;

  // Sets `key` to `value`, replacing any earlier value.
  virtual absl::Status Set(absl::string_view key, absl::string_view value) = 0;
  // Returns the value of `key`, waiting up to `timeout` for it to be set.
  virtual absl::StatusOr<std::string> Get(absl::string_view key,
                                          absl::Duration timeout) = 0;
  // Waits until every key in `keys` is set; DEADLINE_EXCEEDED names the
  // keys still missing.
  virtual absl::Status Wait(absl::Span<const std::string> keys,
                            absl::Duration timeout) = 0;
  // Adds `delta` to the integer stored at `key` (0 when unset) and returns
  // the new value.
  virtual absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) = 0;
};

// Keys live in this process only; for ranks that are threads.
class InMemoryStore : public Store {
 public:
  absl::Status Set(absl::string_view key, absl::string_view value) override;
  absl::StatusOr<std::string> Get(absl::string_view key,
                                  absl::Duration timeout) override;
  absl::Status Wait(absl::Span<const std::string> keys,
                    absl::Duration timeout) override;
  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) override;

  // Every key currently set, sorted (for tests and debugging).
  std::vector<std::string> Keys() const;

 private:
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::string> values_ ABSL_GUARDED_BY(mu_);
};

// Prepends "<prefix>/" to every key of `base` (which must outlive it).
class PrefixStore : public Store {
 public:
  PrefixStore(Store* base, absl::string_view prefix);

  absl::Status Set(absl::string_view key, absl::string_view value) override;
  absl::StatusOr<std::string> Get(absl::string_view key,
                                  absl::Duration timeout) override;
  absl::Status Wait(absl::Span<const std::string> keys,
                    absl::Duration timeout) override;
  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) override;

  const std::string& prefix() const { return prefix_; }

 private:
  std::string Full(absl::string_view key) const;

  Store* const base_;
  const std::string prefix_;
};

// DEADLINE_EXCEEDED for a wait on `missing` keys that ran `timeout`.
absl::Status MissingKeysError(absl::Span<const std::string> missing,
                              absl::Duration timeout);

}  // namespace baton::comm

#endif  // BATON_WORKER_COMM_STORE_H_
