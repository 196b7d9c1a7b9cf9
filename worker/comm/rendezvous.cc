#include "worker/comm/rendezvous.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace baton::comm {
namespace {

std::string ArrivedKey(int rank) { return absl::StrCat("arrived/", rank); }

}  // namespace

std::string GroupKeyPrefix(absl::string_view group, int64_t generation) {
  return absl::StrCat("comm/", group, "/gen", generation);
}

absl::Status ArriveAll(Store& store, int rank, int size, absl::Time deadline,
                       absl::string_view label) {
  absl::Status set = store.Set(ArrivedKey(rank), "1");
  if (!set.ok()) {
    return absl::Status(set.code(), absl::StrCat(label, ": rank ", rank,
                                                 " cannot announce itself: ", set.message()));
  }
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(ArrivedKey(r));
  const absl::Duration timeout = std::max(deadline - absl::Now(), absl::ZeroDuration());
  absl::Status all = store.Wait(keys, timeout);
  if (all.ok()) return all;
  if (!absl::IsDeadlineExceeded(all)) {
    return absl::Status(all.code(), absl::StrCat(label, ": rendezvous failed: ", all.message()));
  }
  std::vector<int> missing;
  for (int r = 0; r < size; ++r) {
    if (!store.Wait({ArrivedKey(r)}, absl::ZeroDuration()).ok()) missing.push_back(r);
  }
  return absl::DeadlineExceededError(absl::StrCat(
      label, ": rank(s) ", absl::StrJoin(missing, ", "), " of ", size,
      " did not arrive within ", absl::FormatDuration(timeout),
      "; check that those workers are running and use the same group and generation"));
}

}  // namespace baton::comm
