#include "coordinator/kv_store.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace baton {

int64_t KvStore::GenerationLocked(const std::string& job) const {
  auto it = jobs_.find(job);
  return it == jobs_.end() ? 0 : it->second.generation;
}

absl::Status KvStore::CheckScopeLocked(const KvScope& scope, const std::string& key) {
  if (scope.job.empty() || scope.job.size() > kMaxKeyBytes) {
    return absl::InvalidArgumentError(absl::StrCat("kv: job must be 1..", kMaxKeyBytes, " bytes"));
  }
  if (scope.generation < 0) return absl::InvalidArgumentError("kv: generation must be >= 0");
  if (key.empty() || key.size() > kMaxKeyBytes) {
    return absl::InvalidArgumentError(absl::StrCat("kv: key must be 1..", kMaxKeyBytes, " bytes"));
  }
  if (!jobs_.count(scope.job) && jobs_.size() >= kMaxJobs) {
    return absl::ResourceExhaustedError(absl::StrCat("kv: this coordinator already holds keys of ", jobs_.size(),
                                                     " jobs (the limit); job '", scope.job.substr(0, 64),
                                                     "' is refused"));
  }
  const int64_t current = GenerationLocked(scope.job);
  if (scope.generation < current) {
    return absl::FailedPreconditionError(absl::StrCat("kv: generation ", scope.generation, " of job '", scope.job,
                                                      "' is superseded by generation ", current,
                                                      "; rejoin with the current plan"));
  }
  if (scope.generation > current + 1) {
    return absl::OutOfRangeError(absl::StrCat("kv: generation ", scope.generation, " of job '", scope.job,
                                              "' is ahead of the current generation ", current,
                                              " by more than one; only the current and the next are served"));
  }
  AdvanceLocked(scope.job, scope.generation);
  return absl::OkStatus();
}

void KvStore::AdvanceLocked(const std::string& job_name, int64_t generation) {
  Job& job = jobs_[job_name];
  if (generation <= job.generation) return;
  job.generation = generation;
  auto it = values_.lower_bound(FullKey(job_name, INT64_MIN, ""));
  while (it != values_.end() && std::get<0>(it->first) == job_name && std::get<1>(it->first) < generation) {
    job.keys -= 1;
    job.bytes -= static_cast<int64_t>(std::get<2>(it->first).size() + it->second.size());
    it = values_.erase(it);
  }
}

void KvStore::AdvanceGeneration(const std::string& job, int64_t generation) {
  absl::MutexLock lock(&mu_);
  AdvanceLocked(job, generation);
}

int64_t KvStore::CurrentGeneration(const std::string& job) const {
  absl::MutexLock lock(&mu_);
  return GenerationLocked(job);
}

absl::Status KvStore::PutLocked(const KvScope& scope, const std::string& key, std::string value) {
  Job& job = jobs_[scope.job];
  auto it = values_.find(FullKey(scope.job, scope.generation, key));
  const int64_t old_bytes = it == values_.end() ? 0 : static_cast<int64_t>(key.size() + it->second.size());
  const int64_t new_bytes = static_cast<int64_t>(key.size() + value.size());
  if (it == values_.end() && job.keys >= kMaxKeysPerJob) {
    return absl::ResourceExhaustedError(
        absl::StrCat("kv: job '", scope.job, "' already holds ", job.keys, " keys (the limit)"));
  }
  if (job.bytes - old_bytes + new_bytes > kMaxBytesPerJob) {
    return absl::ResourceExhaustedError(absl::StrCat("kv: job '", scope.job, "' would hold more than ",
                                                     kMaxBytesPerJob, " bytes of keys and values (the limit)"));
  }
  job.bytes += new_bytes - old_bytes;
  if (it == values_.end()) {
    job.keys += 1;
    values_.emplace(FullKey(scope.job, scope.generation, key), std::move(value));
  } else {
    it->second = std::move(value);
  }
  return absl::OkStatus();
}

absl::Status KvStore::Set(const KvScope& scope, const std::string& key, std::string value) {
  if (value.size() > kMaxValueBytes) {
    return absl::InvalidArgumentError(absl::StrCat("kv: value of ", value.size(), " bytes exceeds ", kMaxValueBytes));
  }
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckScopeLocked(scope, key); !s.ok()) return s;
  return PutLocked(scope, key, std::move(value));
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
  int64_t current = 0;
  auto it = values_.find(FullKey(scope.job, scope.generation, key));
  if (it != values_.end() && !it->second.empty() && !absl::SimpleAtoi(it->second, &current)) {
    return absl::InvalidArgumentError(absl::StrCat("kv: key '", key, "' does not hold an integer"));
  }
  int64_t sum;
  if (__builtin_add_overflow(current, delta, &sum)) {
    return absl::OutOfRangeError(
        absl::StrCat("kv: adding ", delta, " to key '", key, "' (", current, ") overflows a 64-bit integer"));
  }
  if (absl::Status s = PutLocked(scope, key, absl::StrCat(sum)); !s.ok()) return s;
  return sum;
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
    return GenerationLocked(scope.job) > scope.generation || missing().empty();
  };
  mu_.AwaitWithTimeout(absl::Condition(&done), timeout);
  if (GenerationLocked(scope.job) > scope.generation) {
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
