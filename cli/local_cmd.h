// `batonctl local --job=FILE --out=DIR [--workers=N]`: runs a whole job on
// this machine. Validates the job, starts baton-coordinator and N workers
// (default pp·tp·dp) as child processes on loopback with logs in DIR/logs/,
// prints one progress line per committed step, and when the coordinator says
// the job is done prints DIR/summary.json and stops everything.
//
// Exit codes: 0 the job finished; 1 it failed (the job failed, a child
// exited unexpectedly, the coordinator stopped answering, --timeout_s
// passed); 2 bad usage or an invalid job; 130 interrupted by SIGINT or
// SIGTERM. Children always get SIGTERM (SIGKILL after 5 s) before batonctl
// exits. Installs its own SIGINT/SIGTERM handlers while it runs.
#ifndef BATON_CLI_LOCAL_CMD_H_
#define BATON_CLI_LOCAL_CMD_H_

#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace baton::cli {

struct LocalBinaries {
  std::string coordinator;
  std::string worker;
};

// Finds baton-coordinator and baton-worker. With `bin_dir`, only there
// (as bin_dir/coordinator/baton-coordinator, as in bazel-bin, or
// bin_dir/baton-coordinator); otherwise beside `self_exe` (batonctl): in the
// bazel-bin layout (.../bin/cli/batonctl → .../bin/coordinator/...), side by
// side, or in batonctl's runfiles. NOT_FOUND lists where it looked.
absl::StatusOr<LocalBinaries> LocateBinaries(const std::string& bin_dir, const std::string& self_exe);
// One of them, the same way: `subdir`/`name` as in bazel-bin ("worker",
// "baton-worker"). For the subcommands that run a binary (generate).
absl::StatusOr<std::string> LocateBinary(const std::string& subdir, const std::string& name,
                                         const std::string& bin_dir, const std::string& self_exe);
// The running executable (/proc/self/exe), "" when unreadable.
std::string SelfExe();

// Flags: --job, --out (required), --workers, --spares, --inject, --resume,
// --bin_dir, --timeout_s (3600). --inject=KIND:TARGET@step=N[,after_ms=M][,for=S]
// injects one fault (docs/cli.md): KIND kill (SIGKILL) or stop (SIGSTOP; for=S
// sends SIGCONT S seconds later), TARGET stage=P[,tp=T][,dp=D] or worker=NAME,
// after_ms=M delays it M ms past the moment step N was seen committed. The
// injection and thaw lines carry the wall time (UTC, ms) to measure detection.
int RunLocalCommand(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

}  // namespace baton::cli

#endif  // BATON_CLI_LOCAL_CMD_H_
