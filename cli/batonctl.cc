// batonctl: the operator's command line. Each subcommand is a function of its
// arguments and output streams, listed in one table below.
#include <iostream>
#include <string>
#include <vector>

#include "cli/schedule_cmd.h"

namespace {

struct Subcommand {
  const char* name;
  int (*run)(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);
  const char* summary;
};

constexpr Subcommand kSubcommands[] = {
    {"schedule", &baton::cli::RunScheduleCommand,
     "build, show, simulate and validate pipeline schedules"},
};

int Usage(std::ostream& err) {
  err << "usage: batonctl <subcommand> [args]\n";
  for (const Subcommand& s : kSubcommands) err << "  " << s.name << "  " << s.summary << "\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return Usage(std::cerr);
  const std::string name = argv[1];
  for (const Subcommand& s : kSubcommands) {
    if (name == s.name) {
      return s.run(std::vector<std::string>(argv + 2, argv + argc), std::cout, std::cerr);
    }
  }
  std::cerr << "batonctl: unknown subcommand '" << name << "'\n";
  return Usage(std::cerr);
}
