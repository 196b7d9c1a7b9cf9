// `batonctl generate CHECKPOINT --prompt_tokens=1,2,3 [--max_new_tokens=16]
// [--temperature=0] [--top_k=0] [--seed=0] [--device=cpu] [--format=text|json]
// [--bin_dir=DIR]`: samples tokens from a checkpoint's GPT (docs/generate.md).
//
// batonctl links no model code (DESIGN.md §12), so the work is the worker
// binary's: this finds baton-worker as `batonctl local` does (beside
// batonctl, in its runfiles, or only in --bin_dir) and execs `baton-worker
// generate CHECKPOINT --flag=value ...`, which prints the tokens, validates
// every value (its messages start "baton-worker generate:") and gives the
// exit code: 0 ok, 1 the checkpoint cannot be read or the model cannot run,
// 2 bad usage. Here only the flag names, the one CHECKPOINT and
// --prompt_tokens' presence are checked (exit 2), and a worker binary that
// cannot be found or run exits 2 naming where it looked.
#ifndef BATON_CLI_GENERATE_CMD_H_
#define BATON_CLI_GENERATE_CMD_H_

#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace baton::cli {

// The worker's command line for `args` (batonctl's words after
// "generate"): {"generate", CHECKPOINT, "--name=value", ...} in a fixed flag
// order, --bin_dir left out (stored in `bin_dir` when given; "" if unset).
// INVALID_ARGUMENT naming the flag for an unknown flag, a missing or extra
// CHECKPOINT, or no --prompt_tokens.
absl::StatusOr<std::vector<std::string>> GenerateWorkerArgs(const std::vector<std::string>& args,
                                                            std::string* bin_dir = nullptr);

// Returns only on failure (the exit code, the message on `err`); on success
// the process becomes baton-worker, whose output and exit code are the
// command's.
int RunGenerateCommand(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

}  // namespace baton::cli

#endif  // BATON_CLI_GENERATE_CMD_H_
