#include "cli/generate_cmd.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iostream>
#include <set>

#include "absl/strings/str_cat.h"
#include "cli/args.h"
#include "cli/local_cmd.h"

namespace baton::cli {
namespace {

// The flags the worker takes, in the order they are passed on.
constexpr const char* kWorkerFlags[] = {"prompt_tokens", "max_new_tokens", "temperature", "top_k",
                                        "seed",          "device",         "format"};

}  // namespace

absl::StatusOr<std::vector<std::string>> GenerateWorkerArgs(const std::vector<std::string>& args,
                                                            std::string* bin_dir) {
  std::set<std::string> known = {"bin_dir"};
  for (const char* f : kWorkerFlags) known.insert(f);
  absl::StatusOr<Args> parsed = Args::Parse(args, known);
  if (!parsed.ok()) return parsed.status();
  if (parsed->positionals().size() != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("want one CHECKPOINT directory, got ", parsed->positionals().size()));
  }
  if (!parsed->Has("prompt_tokens")) return absl::InvalidArgumentError("--prompt_tokens=ID,ID,... is required");
  if (bin_dir != nullptr) *bin_dir = parsed->GetString("bin_dir", "");
  std::vector<std::string> out = {"generate", parsed->positionals()[0]};
  for (const char* f : kWorkerFlags) {
    if (parsed->Has(f)) out.push_back(absl::StrCat("--", f, "=", parsed->GetString(f, "")));
  }
  return out;
}

int RunGenerateCommand(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  std::string bin_dir;
  absl::StatusOr<std::vector<std::string>> worker_args = GenerateWorkerArgs(args, &bin_dir);
  if (!worker_args.ok()) {
    // One line; the usage is in `batonctl help`.
    err << "batonctl generate: " << worker_args.status().message() << "\n";
    return 2;
  }
  absl::StatusOr<std::string> worker = LocateBinary("worker", "baton-worker", bin_dir, SelfExe());
  if (!worker.ok()) {
    err << "batonctl generate: " << worker.status().message() << "\n";
    return 2;
  }
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(worker->c_str()));
  for (const std::string& a : *worker_args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  // Nothing of batonctl's own may be left in a buffer the exec discards.
  out.flush();
  err.flush();
  std::cout.flush();
  std::cerr.flush();
  execv(worker->c_str(), argv.data());
  err << "batonctl generate: cannot run " << *worker << ": " << std::strerror(errno) << "\n";
  return 2;
}

}  // namespace baton::cli
