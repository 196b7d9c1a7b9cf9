// Rendezvous steps shared by the backends: the arrival barrier that names
// missing ranks, and the store key layout of one communicator
// ("comm/<group>/gen<generation>/..."; see docs/comm.md).
#ifndef BATON_WORKER_COMM_RENDEZVOUS_H_
#define BATON_WORKER_COMM_RENDEZVOUS_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "worker/comm/store.h"

namespace baton::comm {

// Key prefix of one communicator: "comm/<group>/gen<generation>".
std::string GroupKeyPrefix(absl::string_view group, int64_t generation);

// Publishes "arrived/<rank>" in `store` and waits until all `size` ranks
// have. On timeout returns DEADLINE_EXCEEDED that names the missing ranks,
// e.g. "tp0 gen 3: rank(s) 2, 3 of 4 did not arrive within 2s".
absl::Status ArriveAll(Store& store, int rank, int size, absl::Time deadline,
                       absl::string_view label);

}  // namespace baton::comm

#endif  // BATON_WORKER_COMM_RENDEZVOUS_H_
