// ChildProcess: a daemon that `batonctl local` starts and owns. The child
// runs in its own process group (so a terminal's Ctrl-C reaches batonctl
// alone, which then stops the children in order), with stdout and stderr
// appended to a log file and stdin from /dev/null, and gets SIGTERM if
// batonctl itself dies. Not thread-safe: one thread owns the children.
#ifndef BATON_CLI_CHILD_PROCESS_H_
#define BATON_CLI_CHILD_PROCESS_H_

#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace baton::cli {

class ChildProcess {
 public:
  // `name` labels the child in messages ("coordinator", "worker-3").
  ChildProcess(std::string name, std::string binary, std::vector<std::string> args, std::string log_path);
  // Kills (SIGKILL) and reaps a child still running.
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  absl::Status Start();
  // The wait status once the child has exited (reaped here); nullopt while
  // it runs.
  std::optional<int> Poll();
  bool running() const { return pid_ > 0; }
  pid_t pid() const { return pid_; }
  const std::string& name() const { return name_; }
  const std::string& log_path() const { return log_path_; }
  void Signal(int sig) const;

 private:
  std::string name_, binary_;
  std::vector<std::string> args_;
  std::string log_path_;
  pid_t pid_ = -1;
};

// "exited with code 3" or "killed by signal 9 (Killed)".
std::string DescribeWaitStatus(int status);

// SIGTERM to every running child, then SIGKILL to those still running after
// `grace`; returns once all are reaped.
void StopAll(const std::vector<ChildProcess*>& children, absl::Duration grace);

// The last `lines` lines of a text file ("" when unreadable).
std::string TailOfFile(const std::string& path, int lines);

}  // namespace baton::cli

#endif  // BATON_CLI_CHILD_PROCESS_H_
