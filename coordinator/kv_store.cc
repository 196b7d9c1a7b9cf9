#include "coordinator/kv_store.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace baton {

absl::Status KvStore::CheckScopeLocked(const KvScope& scope, const std::string& key) {
  if (scope.job.empty()) return absl::InvalidArgumentError("kv: job must be set");
  if (scope.generation < 0) return absl::InvalidArgumentError("kv: generation must be >= 0");
  if (key.empty() || key.size() > kMaxKeyBytes) {
    return absl::InvalidArgumentError(absl::StrCat("kv: key must be 1..", kMaxKeyBytes, " bytes"));
  }
  auto it = generation_.find(scope.job);
  const int64_t current = it == generation_.end() ? 0 : it->second;
  if (scope.generation < current) {
    return absl::FailedPreconditionError(absl::StrCat("kv: generation ", scope.generation, " of job '", scope.job,
                                                      "' is superseded by generation ", current,
                                                      "; rejoin with the current plan"));
  }
  AdvanceLocked(scope.job, scope.generation);
  return absl::OkStatus();
}

void KvStore::AdvanceLocked(const std::string& job, int64_t generation) {
  int64_t& current = generation_[job];
  if (generation <= current) return;
  current = generation;
  auto it = values_.lower_bound(FullKey(job, INT64_MIN, ""));
  while (it != values_.end() && std::get<0>(it->first) == job && std::get<1>(it->first) < generation) {
    it = values_.erase(it);
  }
}

void KvStore::AdvanceGeneration(const std::string& job, int64_t generation) {
  absl::MutexLock lock(&mu_);
  AdvanceLocked(job, generation);
}

int64_t KvStore::CurrentGeneration(const std::string& job) const {
  absl::MutexLock lock(&mu_);
  auto it = generation_.find(job);
  return it == generation_.end() ? 0 : it->second;
}

absl::Status KvStore::Set(const KvScope& scope, const std::string& key, std::string value) {
  if (value.size() > kMaxValueBytes) {
    return absl::InvalidArgumentError(absl::StrCat("kv: value of ", value.size(), " bytes exceeds ", kMaxValueBytes));
  }
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckScopeLocked(scope, key); !s.ok()) return s;
  if (values_.size() >= kMaxKeys) return absl::ResourceExhaustedError("kv: too many keys");
  values_[FullKey(scope.job, scope.generation, key)] = std::move(value);
  return absl::OkStatus();
}

absl::StatusOr<std::string> KvStore::Get(const KvScope& scope, const std::string& key) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckScopeLocked(scope, key); !s.ok()) return s;
  auto it = values_.find(FullKey(scope.job, scope.generation, key));
  if (it == values_.end()) return absl::NotFoundError(absl::StrCat("kv: no key '", key, "'"));
  return it->second;
}

absl::StatusOr<int64_t> KvStore::Add(const KvScope& scope, const std::string& key, int64_t delta) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckScopeLocked(scope, key); !s.ok()) return s;
  std::string& value = values_[FullKey(scope.job, scope.generation, key)];
  int64_t current = 0;
  if (!value.empty() && !absl::SimpleAtoi(value, &current)) {
    return absl::InvalidArgumentError(absl::StrCat("kv: key '", key, "' does not hold an integer"));
  }
  current += delta;
  value = absl::StrCat(current);
  return current;
}

absl::Status KvStore::Wait(const KvScope& scope, const std::vector<std::string>& keys, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  for (const std::string& key : keys) {
    if (absl::Status s = CheckScopeLocked(scope, key); !s.ok()) return s;
  }
  auto missing = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<std::string> out;
    for (const std::string& key : keys) {
      if (!values_.count(FullKey(scope.job, scope.generation, key))) out.push_back(key);
    }
    return out;
  };
  auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return generation_[scope.job] > scope.generation || missing().empty();
  };
  mu_.AwaitWithTimeout(absl::Condition(&done), timeout);
  if (generation_[scope.job] > scope.generation) {
    return absl::FailedPreconditionError(absl::StrCat("kv: generation ", scope.generation, " of job '", scope.job,
                                                      "' was superseded while waiting"));
  }
  std::vector<std::string> left = missing();
  if (!left.empty()) {
    return absl::DeadlineExceededError(absl::StrCat("kv: timed out after ", absl::FormatDuration(timeout),
                                                    " waiting for keys: ", absl::StrJoin(left, ", ")));
  }
  return absl::OkStatus();
}

}  // namespace baton
