// Import and export of the schedule CSVs that PyTorch's
// torch.distributed.pipelining writes (`_dump_csv`) and reads (`_load_csv`):
// one row per rank, one cell per action.
//
// Cells:
//   "<stage><kind><microbatch>" with kind F, I, W or B (full backward):
//       "0F0", "1I3", "2W3", "0B1" (compute-only rows);
//   SEND_F, RECV_F, SEND_B, RECV_B: "0SEND_F0", "2RECV_F0" (compute + comms
//       rows, `_dump_csv(..., format="comms")`); RECV_F and RECV_B name the
//       receiving stage, SEND_F and SEND_B the sending one, as in baton's IR;
//   "(0F7;7B3)OVERLAP_F_B": a forward and a backward of another microbatch
//       issued together (DualPipe-V), an overlapped pair in baton's IR.
// Empty cells (idle steps in PyTorch's dumps) are skipped on import and
// never written.
//
// Naming: current PyTorch writes I (input backward), W (weight backward),
// B (full backward). Older dumps (and the ZB artifacts PyTorch's tests
// hold) wrote B for the input backward when a W of the same microbatch
// follows, and BW for the full backward. kAuto takes the older naming when
// a cell says BW, or when no cell says I and some (stage, microbatch) has
// both a B and a W; kCurrent and kLegacy force one.
//
// Placement: a stage lives on the row whose cells name it, so looped, V and
// any other table come from the file itself. Every stage must sit on one
// row, every row hold the same number of stages.
#ifndef BATON_COORDINATOR_SCHEDULE_PYTORCH_CSV_H_
#define BATON_COORDINATOR_SCHEDULE_PYTORCH_CSV_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "coordinator/schedule/ir.h"

namespace baton::schedule {

enum class CsvNaming { kAuto, kCurrent, kLegacy };

// "auto", "current", "legacy"; InvalidArgument naming the choices otherwise.
absl::StatusOr<CsvNaming> ParseCsvNaming(absl::string_view name);

// Compute actions (current naming, overlapped pairs as OVERLAP_F_B); with
// `comms`, the sends and receives of a lowered schedule too. Reductions and
// the optimizer step are never written (PyTorch has no cell for them).
std::string ToPytorchCsv(const Schedule& schedule, bool comms = false);

// Ranks = rows; stages, virtual stages, microbatches and the placement are
// inferred (the largest stage and microbatch seen, plus one). The schedule
// kind is left empty. A file with sends and receives gives a lowered
// schedule (peers from the placement). InvalidArgument naming the row and
// cell for anything malformed or inconsistent.
absl::StatusOr<Schedule> FromPytorchCsv(absl::string_view csv, CsvNaming naming = CsvNaming::kAuto);

}  // namespace baton::schedule

#endif  // BATON_COORDINATOR_SCHEDULE_PYTORCH_CSV_H_
