// batonctl: the operator's command line for baton.
//
//   batonctl local --job=FILE --out=DIR [--workers=N]   (docs/cli.md)
//   batonctl [--coordinator=HOST:PORT] status [--json]
//   batonctl schedule show|simulate|validate ...   (docs/schedules.md)
//   batonctl trace --coordinator=HOST:PORT --out=FILE [--steps=N]
//   batonctl checkpoint diff|import-hf|export-hf ...   (docs/cli.md, docs/checkpoints.md)
//   batonctl generate CHECKPOINT --prompt_tokens=1,2,3 [...]   (docs/generate.md)
//
// Flags may come before or after the subcommand. Exit codes: 0 ok, 1 the
// operation failed, 2 bad usage (the message says what to change).
#include <iostream>
#include <string>
#include <vector>

#include "cli/checkpoint_cmd.h"
#include "cli/generate_cmd.h"
#include "cli/local_cmd.h"
#include "cli/schedule_cmd.h"
#include "cli/status_cmd.h"
#include "cli/trace_cmd.h"

namespace {

struct Subcommand {
  const char* name;
  const char* help;
  int (*run)(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);
};

constexpr Subcommand kSubcommands[] = {
    {"local", "--job=FILE --out=DIR [--workers=N] [--timeout_s=3600]: run a job on this machine with live progress",
     &baton::cli::RunLocalCommand},
    {"status",
     "--coordinator=HOST:PORT [--json] [--timeout_ms=5000] [--tls_cert=F --tls_key=F --tls_ca=F]: workers and "
     "their state",
     &baton::cli::RunStatusCommand},
    {"schedule", "show|simulate|validate [flags]: build, show, simulate and validate pipeline schedules",
     &baton::cli::RunScheduleCommand},
    {"trace",
     "--coordinator=HOST:PORT --out=FILE [--steps=1] [--tls_cert=F --tls_key=F --tls_ca=F]: Chrome/Perfetto "
     "trace of the last steps",
     &baton::cli::RunTraceCommand},
    {"checkpoint",
     "diff DIR_A DIR_B [--json]: compare two checkpoints of any layouts (max |a-b|; rel = ||a-b||/||b|| per "
     "tensor) | import-hf HF_DIR --out=CKPT [--seq_len=N] [--force]: a transformers GPT-2 as a resumable "
     "checkpoint | export-hf CKPT --out=HF_DIR [--force]: a checkpoint as a transformers GPT-2",
     &baton::cli::RunCheckpointCommand},
    {"generate",
     "CHECKPOINT --prompt_tokens=ID,ID,... [--max_new_tokens=16] [--temperature=0] [--top_k=0] [--seed=0] "
     "[--device=cpu] [--format=text|json]: sample tokens from a checkpoint's model (runs baton-worker generate)",
     &baton::cli::RunGenerateCommand},
};

int Usage(std::ostream& err) {
  err << "usage: batonctl <subcommand> [flags]\n";
  for (const Subcommand& s : kSubcommands) err << "  " << s.name << " " << s.help << "\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  // The subcommand is the first word that is not a flag; every other word is
  // passed on to it in order.
  std::vector<std::string> args;
  std::string command;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (command.empty() && a.rfind("--", 0) != 0) {
      command = a;
    } else {
      args.push_back(a);
    }
  }
  if (command.empty() || command == "help") return Usage(std::cerr);
  for (const Subcommand& s : kSubcommands) {
    if (command == s.name) return s.run(args, std::cout, std::cerr);
  }
  std::cerr << "batonctl: unknown subcommand '" << command << "'\n";
  return Usage(std::cerr);
}
