#include "tests/testing/process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace baton::testing {

std::string RunfilePath(const std::string& workspace_relative) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  return absl::StrCat(srcdir ? srcdir : ".", "/", workspace ? workspace : "baton", "/", workspace_relative);
}

std::string TempDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string dir = absl::StrCat(tmp ? tmp : "/tmp", "/", name);
  mkdir(dir.c_str(), 0755);
  return dir;
}

Subprocess::Subprocess(std::string binary, std::vector<std::string> args, std::string log_path)
    : binary_(std::move(binary)), args_(std::move(args)), log_path_(std::move(log_path)) {}

Subprocess::~Subprocess() {
  if (pid_ > 0) {
    kill(pid_, SIGCONT);
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
}

absl::Status Subprocess::Start() {
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(binary_.c_str()));
  for (std::string& a : args_) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = fork();
  if (pid < 0) return absl::InternalError("fork failed");
  if (pid == 0) {
    int fd = open(log_path_.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      close(fd);
    }
    execv(argv[0], argv.data());
    _exit(127);
  }
  pid_ = pid;
  return absl::OkStatus();
}

void Subprocess::Signal(int sig) {
  if (pid_ > 0) kill(pid_, sig);
}

std::optional<int> Subprocess::Wait(absl::Duration timeout) {
  if (pid_ <= 0) return std::nullopt;
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    int status = 0;
    pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      pid_ = -1;
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    if (absl::Now() > deadline) return std::nullopt;
    absl::SleepFor(absl::Milliseconds(10));
  }
}

std::string Subprocess::Log() const {
  std::ifstream in(log_path_);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

CommandResult RunCommand(const std::string& binary, const std::vector<std::string>& args, absl::Duration timeout,
                         const std::string& stdin_text) {
  static int counter = 0;
  std::string dir = TempDir("commands");
  std::string log = absl::StrCat(dir, "/cmd", ++counter, ".log");
  std::string in_path = absl::StrCat(dir, "/cmd", counter, ".in");
  std::ofstream(in_path) << stdin_text;
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(binary.c_str()));
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  CommandResult result;
  pid_t pid = fork();
  if (pid == 0) {
    int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int in = open(in_path.c_str(), O_RDONLY);
    dup2(fd, 1);
    dup2(fd, 2);
    dup2(in, 0);
    execvp(argv[0], argv.data());
    _exit(127);
  }
  const absl::Time deadline = absl::Now() + timeout;
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) != pid) {
    if (absl::Now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      result.output = "(timed out)";
      return result;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  std::ifstream f(log);
  std::stringstream s;
  s << f.rdbuf();
  result.output = s.str();
  return result;
}

absl::StatusOr<std::pair<int, int>> ReadPortFile(const std::string& path, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  static const std::regex kPorts("\\{\"grpc\": ([0-9]+), \"http\": ([0-9]+)\\}");
  while (absl::Now() < deadline) {
    std::ifstream in(path);
    std::stringstream s;
    s << in.rdbuf();
    std::smatch m;
    std::string text = s.str();
    if (std::regex_search(text, m, kPorts)) return std::make_pair(std::stoi(m[1]), std::stoi(m[2]));
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::DeadlineExceededError(absl::StrCat("no port file at ", path));
}

}  // namespace baton::testing
