// Subprocess: starts a program of this repository as a real child process for
// multi-process tests on loopback, with its stderr/stdout going to a log file.
// The destructor kills (SIGKILL) whatever is still running.
#ifndef BATON_TESTS_TESTING_PROCESS_H_
#define BATON_TESTS_TESTING_PROCESS_H_

#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace baton::testing {

// Path of a binary in this workspace's runfiles, e.g. "coordinator/baton-coordinator".
std::string RunfilePath(const std::string& workspace_relative);

// A fresh directory under TEST_TMPDIR.
std::string TempDir(const std::string& name);

class Subprocess {
 public:
  Subprocess(std::string binary, std::vector<std::string> args, std::string log_path);
  ~Subprocess();
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;

  absl::Status Start();
  void Signal(int sig);
  // Exit code (or 128+signal) once it exits within `timeout`, else nullopt.
  std::optional<int> Wait(absl::Duration timeout);
  bool running() const { return pid_ > 0; }
  pid_t pid() const { return pid_; }
  std::string Log() const;

 private:
  std::string binary_;
  std::vector<std::string> args_;
  std::string log_path_;
  pid_t pid_ = -1;
};

// Runs a command to completion; returns exit code and combined output.
struct CommandResult {
  int exit_code = -1;
  std::string output;
};
CommandResult RunCommand(const std::string& binary, const std::vector<std::string>& args,
                         absl::Duration timeout = absl::Seconds(30), const std::string& stdin_text = "");

// Reads {"grpc": N, "http": M} written by --port_file, waiting up to `timeout`.
absl::StatusOr<std::pair<int, int>> ReadPortFile(const std::string& path, absl::Duration timeout);

}  // namespace baton::testing

#endif  // BATON_TESTS_TESTING_PROCESS_H_
