// JobSpec loading and validation. Every error names the field and says what
// to change; the coordinator exits with code 2 on an invalid --job.
#ifndef BATON_COORDINATOR_JOB_SPEC_H_
#define BATON_COORDINATOR_JOB_SPEC_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "baton/v1/job.pb.h"

namespace baton {

// The effective parallel layout (unset fields mean 1).
struct ParallelDims {
  int pp = 1;
  int tp = 1;
  int dp = 1;
  int virtual_stages = 1;
  int world_size() const { return pp * tp * dp; }
};

ParallelDims DimsOf(const v1::JobSpec& job);

// Parses textproto, or JSON when the text starts with '{'. Unknown fields are
// errors. `source` names the input in messages (e.g. the file path).
absl::StatusOr<v1::JobSpec> ParseJobSpec(absl::string_view text, absl::string_view source);

// Reads, parses and validates a job file.
absl::StatusOr<v1::JobSpec> LoadJobSpec(const std::string& path);

// Checks that the spec is consistent and buildable (INVALID_ARGUMENT otherwise).
absl::Status ValidateJobSpec(const v1::JobSpec& job);

}  // namespace baton

#endif  // BATON_COORDINATOR_JOB_SPEC_H_
