#include "cli/child_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

namespace baton::cli {

ChildProcess::ChildProcess(std::string name, std::string binary, std::vector<std::string> args,
                           std::string log_path)
    : name_(std::move(name)), binary_(std::move(binary)), args_(std::move(args)), log_path_(std::move(log_path)) {}

ChildProcess::~ChildProcess() {
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
}

absl::Status ChildProcess::Start() {
  const int log = open(log_path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (log < 0) return absl::InternalError(absl::StrCat("cannot open log ", log_path_, ": ", std::strerror(errno)));
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(binary_.c_str()));
  for (std::string& a : args_) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    close(log);
    return absl::InternalError(absl::StrCat("cannot start ", name_, ": fork: ", std::strerror(errno)));
  }
  if (pid == 0) {
    // Child: only async-signal-safe calls until exec.
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(127);  // batonctl died before prctl
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    const int null = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (null >= 0) dup2(null, 0);
    dup2(log, 1);
    dup2(log, 2);
    execv(argv[0], argv.data());
    const char msg[] = "batonctl: exec failed\n";
    if (write(2, msg, sizeof(msg) - 1) < 0) _exit(127);
    _exit(127);
  }
  close(log);
  pid_ = pid;
  return absl::OkStatus();
}

std::optional<int> ChildProcess::Poll() {
  if (pid_ <= 0) return std::nullopt;
  int status = 0;
  const pid_t r = waitpid(pid_, &status, WNOHANG);
  if (r != pid_) return std::nullopt;
  pid_ = -1;
  return status;
}

void ChildProcess::Signal(int sig) const {
  if (pid_ > 0) kill(pid_, sig);
}

std::string DescribeWaitStatus(int status) {
  if (WIFEXITED(status)) return absl::StrCat("exited with code ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return absl::StrCat("killed by signal ", WTERMSIG(status), " (", strsignal(WTERMSIG(status)), ")");
  }
  return absl::StrCat("ended with wait status ", status);
}

void StopAll(const std::vector<ChildProcess*>& children, absl::Duration grace) {
  for (ChildProcess* c : children) c->Signal(SIGTERM);
  const absl::Time deadline = absl::Now() + grace;
  for (;;) {
    bool any = false;
    for (ChildProcess* c : children) {
      c->Poll();
      any = any || c->running();
    }
    if (!any) return;
    if (absl::Now() > deadline) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  for (ChildProcess* c : children) {
    if (!c->running()) continue;
    c->Signal(SIGKILL);
    while (c->running()) {
      c->Poll();
      absl::SleepFor(absl::Milliseconds(5));
    }
  }
}

std::string TailOfFile(const std::string& path, int lines) {
  constexpr std::streamoff kMaxBytes = 64 << 10;  // logs of long runs can be large
  std::ifstream in(path, std::ios::binary);
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  if (!in || size <= 0) return "";
  in.seekg(size > kMaxBytes ? size - kMaxBytes : 0);
  std::stringstream s;
  s << in.rdbuf();
  std::vector<std::string> all = absl::StrSplit(s.str(), '\n');
  while (!all.empty() && all.back().empty()) all.pop_back();
  std::string out;
  for (size_t i = all.size() > static_cast<size_t>(lines) ? all.size() - lines : 0; i < all.size(); ++i) {
    absl::StrAppend(&out, all[i], "\n");
  }
  return out;
}

}  // namespace baton::cli
