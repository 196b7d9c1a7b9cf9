// The job driver's states and fault causes (CONTRACTS.md C). The names are
// what GetStatus.job_state, batonctl status and the baton_job_state metric
// show; inside the coordinator the enums are used.
#ifndef BATON_COORDINATOR_JOB_STATE_H_
#define BATON_COORDINATOR_JOB_STATE_H_

#include <array>

namespace baton {

enum class JobState { kWaiting, kConfiguring, kRunning, kRecovering, kSaving, kDone, kFailed };
inline constexpr std::array<JobState, 7> kAllJobStates = {JobState::kWaiting,    JobState::kConfiguring,
                                                          JobState::kRunning,    JobState::kRecovering,
                                                          JobState::kSaving,     JobState::kDone,
                                                          JobState::kFailed};

inline const char* JobStateName(JobState s) {
  switch (s) {
    case JobState::kWaiting: return "waiting";
    case JobState::kConfiguring: return "configuring";
    case JobState::kRunning: return "running";
    case JobState::kRecovering: return "recovering";
    case JobState::kSaving: return "saving";
    case JobState::kDone: return "done";
    case JobState::kFailed: return "failed";
  }
  return "unknown";
}

inline bool IsFinal(JobState s) { return s == JobState::kDone || s == JobState::kFailed; }

// Why a recovery started (the `cause` label of baton_recoveries_total).
enum class FaultCause { kWorkerLost, kWorkerHung, kWorkerError, kCoordinatorRestart };
inline constexpr std::array<FaultCause, 4> kAllFaultCauses = {FaultCause::kWorkerLost, FaultCause::kWorkerHung,
                                                               FaultCause::kWorkerError,
                                                               FaultCause::kCoordinatorRestart};

inline const char* FaultCauseName(FaultCause c) {
  switch (c) {
    case FaultCause::kWorkerLost: return "worker_lost";
    case FaultCause::kWorkerHung: return "worker_hung";
    case FaultCause::kWorkerError: return "worker_error";
    case FaultCause::kCoordinatorRestart: return "coordinator_restart";
  }
  return "unknown";
}

}  // namespace baton

#endif  // BATON_COORDINATOR_JOB_STATE_H_
