// `batonctl schedule`: build, show, simulate and validate pipeline schedules
// from the command line (coordinator/schedule/ does the work).
//
//   schedule show     --schedule=1f1b --pp=4 --microbatches=8 [--virtual=2]
//                     [--format=grid|json|csv]
//   schedule simulate (--schedule=... | --file=PATH) [--forward=1
//                     --backward_input=1 --backward_weight=1
//                     --stage_multipliers=1,1.5,... --comm_latency=0
//                     --comm_bandwidth=inf --activation_bytes=0
//                     --blocking_sends] --format=text|json|chrome|csv
//                     (csv writes the schedule in PyTorch's compute-only CSV)
//   schedule validate --file=PATH   (PyTorch compute-only CSV or our JSON)
#ifndef BATON_CLI_SCHEDULE_CMD_H_
#define BATON_CLI_SCHEDULE_CMD_H_

#include <ostream>
#include <string>
#include <vector>

namespace baton::cli {

// `args` are the words after `batonctl schedule`. Returns the exit code:
// 0 success, 1 the schedule is invalid (the violation goes to `err`), 2 bad
// input (a message on `err` says what to change).
int RunScheduleCommand(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

}  // namespace baton::cli

#endif  // BATON_CLI_SCHEDULE_CMD_H_
