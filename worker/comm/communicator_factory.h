// CreateCommunicator: builds the communicator of one group (TP group, DP
// group, pipeline pair) for one generation, rendezvousing through a Store.
// Keys live under "comm/<group>/gen<generation>/" (docs/comm.md), so a new
// generation after an abort never reads an older generation's keys.
#ifndef BATON_WORKER_COMM_COMMUNICATOR_FACTORY_H_
#define BATON_WORKER_COMM_COMMUNICATOR_FACTORY_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/comm/communicator.h"
#include "worker/comm/job_groups.h"
#include "worker/comm/store.h"

namespace baton::comm {

enum class Backend { kGloo, kNccl };

struct CommunicatorSpec {
  std::string group;        // e.g. "tp0", "dp1", "pp2-3"
  int64_t generation = 0;   // bumped by the coordinator on every membership change
  int rank = 0;             // within the group
  int size = 1;
  Backend backend = Backend::kGloo;
  absl::Duration rendezvous_timeout = absl::Seconds(60);
  absl::Duration op_timeout = absl::Minutes(5);  // watchdog: longer aborts the group
  std::string hostname = "127.0.0.1";            // Gloo: address to listen on
  // CUDA device ordinal of this rank's tensors; -1 = host memory. NCCL needs
  // one; Gloo then stages device tensors through pinned host memory.
  int device = -1;
};

// Rendezvous with the other `size - 1` ranks of `spec.group` and connect.
// DEADLINE_EXCEEDED names ranks that did not arrive; UNIMPLEMENTED for NCCL
// or device tensors in a build without CUDA.
absl::StatusOr<std::unique_ptr<Communicator>> CreateCommunicator(
    Store& store, const CommunicatorSpec& spec);

// The communicators of one rank's groups in a job generation.
struct JobCommSpec {
  int64_t generation = 0;
  JobLayout layout;
  RankCoords rank;
  Backend backend = Backend::kGloo;
  absl::Duration rendezvous_timeout = absl::Seconds(60);
  absl::Duration op_timeout = absl::Minutes(5);
  std::string hostname = "127.0.0.1";
  int device = -1;
};

// One communicator per round of PlanJobGroups(spec.layout, spec.rank), in
// that order; nullptr for a round this rank is in no group of.
//
// NCCL (CUDA builds with NCCL 2.18+): every rank joins one parent
// communicator over all the job's ranks (group "job": keys under
// "comm/job/gen<generation>/"), then derives each group with ncclCommSplit
// (NcclCommunicator::CreateSplit), one split per round on every rank. Where
// splitting is not possible (an older NCCL) and for Gloo: one
// CreateCommunicator per group, in the same order. Errors name the group
// ("rendezvous of group tp-d0-p1: ...").
absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateJobCommunicators(
    Store& store, const JobCommSpec& spec);

// Whether CreateJobCommunicators splits one parent for `backend` in this build.
bool SplitsParentCommunicator(Backend backend);

}  // namespace baton::comm

#endif  // BATON_WORKER_COMM_COMMUNICATOR_FACTORY_H_
