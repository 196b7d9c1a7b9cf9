// Import and export of the compute-only CSV that PyTorch's
// torch.distributed.pipelining writes (`_dump_csv`) and reads (`_load_csv`):
// one row per rank, one cell per action, each "<stage><kind><microbatch>"
// with kind F, I, W or B ("0F0", "1I3", "2W3", "0B1"). Empty cells (idle
// steps in PyTorch's dumps) are skipped on import and never written.
#ifndef BATON_COORDINATOR_SCHEDULE_PYTORCH_CSV_H_
#define BATON_COORDINATOR_SCHEDULE_PYTORCH_CSV_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "coordinator/schedule/ir.h"

namespace baton::schedule {

// Compute actions only; sends, receives and reductions are dropped.
std::string ToPytorchCsv(const Schedule& schedule);

// Ranks = rows; stages, virtual stages and microbatches are inferred (the
// largest stage and microbatch seen, plus one). The schedule kind is left
// empty. InvalidArgument naming the row and cell for anything malformed.
absl::StatusOr<Schedule> FromPytorchCsv(absl::string_view csv);

}  // namespace baton::schedule

#endif  // BATON_COORDINATOR_SCHEDULE_PYTORCH_CSV_H_
