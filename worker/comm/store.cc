#include "worker/comm/store.h"

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace baton::comm {

absl::Status MissingKeysError(absl::Span<const std::string> missing,
                              absl::Duration timeout) {
  return absl::DeadlineExceededError(
      absl::StrCat("store: key(s) [", absl::StrJoin(missing, ", "),
                   "] not set within ", absl::FormatDuration(timeout)));
}

absl::Status InMemoryStore::Set(absl::string_view key, absl::string_view value) {
  absl::MutexLock lock(&mu_);
  values_[key] = std::string(value);
  return absl::OkStatus();
}

absl::StatusOr<std::string> InMemoryStore::Get(absl::string_view key,
                                               absl::Duration timeout) {
  const std::string k(key);
  absl::MutexLock lock(&mu_);
  auto present = [this, &k]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return values_.contains(k);
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&present), timeout)) {
    return MissingKeysError({k}, timeout);
  }
  return values_.at(k);
}

absl::Status InMemoryStore::Wait(absl::Span<const std::string> keys,
                                 absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto all_present = [this, keys]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return std::all_of(keys.begin(), keys.end(),
                       [this](const std::string& k) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
                         return values_.contains(k);
                       });
  };
  if (mu_.AwaitWithTimeout(absl::Condition(&all_present), timeout)) {
    return absl::OkStatus();
  }
  std::vector<std::string> missing;
  for (const std::string& k : keys) {
    if (!values_.contains(k)) missing.push_back(k);
  }
  return MissingKeysError(missing, timeout);
}

absl::StatusOr<int64_t> InMemoryStore::Add(absl::string_view key, int64_t delta) {
  absl::MutexLock lock(&mu_);
  int64_t value = 0;
  auto it = values_.find(key);
  if (it != values_.end() && !absl::SimpleAtoi(it->second, &value)) {
    return absl::FailedPreconditionError(
        absl::StrCat("store: Add on key '", key, "' whose value is not an integer"));
  }
  value += delta;
  values_[key] = absl::StrCat(value);
  return value;
}

std::vector<std::string> InMemoryStore::Keys() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> keys;
  keys.reserve(values_.size());
  for (const auto& [k, v] : values_) keys.push_back(k);
  std::sort(keys.begin(), keys.end());
  return keys;
}

PrefixStore::PrefixStore(Store* base, absl::string_view prefix)
    : base_(base), prefix_(prefix) {}

std::string PrefixStore::Full(absl::string_view key) const {
  return absl::StrCat(prefix_, "/", key);
}

absl::Status PrefixStore::Set(absl::string_view key, absl::string_view value) {
  return base_->Set(Full(key), value);
}

absl::StatusOr<std::string> PrefixStore::Get(absl::string_view key,
                                             absl::Duration timeout) {
  return base_->Get(Full(key), timeout);
}

absl::Status PrefixStore::Wait(absl::Span<const std::string> keys,
                               absl::Duration timeout) {
  std::vector<std::string> full;
  full.reserve(keys.size());
  for (const std::string& k : keys) full.push_back(Full(k));
  return base_->Wait(full, timeout);
}

absl::StatusOr<int64_t> PrefixStore::Add(absl::string_view key, int64_t delta) {
  return base_->Add(Full(key), delta);
}

}  // namespace baton::comm
