// Tests of `batonctl local`: the real batonctl and baton-worker binaries with
// fake_local_coordinator standing in for the coordinator.
#include "cli/local_cmd.h"

#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/process.h"

namespace baton::cli {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void Touch(const std::string& path, bool executable) {
  std::ofstream(path) << "#!/bin/sh\n";
  chmod(path.c_str(), executable ? 0755 : 0644);
}

// Pids of processes whose command line contains `needle`.
std::vector<pid_t> ProcessesWith(const std::string& needle) {
  std::vector<pid_t> out;
  DIR* proc = opendir("/proc");
  while (dirent* e = proc ? readdir(proc) : nullptr) {
    const pid_t pid = static_cast<pid_t>(std::atoi(e->d_name));
    if (pid <= 0) continue;
    std::string cmdline = Slurp(absl::StrCat("/proc/", pid, "/cmdline"));
    for (char& c : cmdline) c = c == '\0' ? ' ' : c;
    if (cmdline.find(needle) != std::string::npos) out.push_back(pid);
  }
  if (proc) closedir(proc);
  return out;
}

TEST(LocateBinariesTest, FindsTheDaemonsBesideBatonctl) {
  const std::string root = testing::TempDir("locate");
  for (const char* d : {"/bin", "/bin/cli", "/bin/coordinator", "/bin/worker", "/flat", "/empty"}) {
    mkdir((root + d).c_str(), 0755);
  }
  Touch(root + "/bin/coordinator/baton-coordinator", true);
  Touch(root + "/bin/worker/baton-worker", true);
  auto bins = LocateBinaries("", root + "/bin/cli/batonctl");  // the bazel-bin layout
  ASSERT_TRUE(bins.ok()) << bins.status();
  EXPECT_EQ(bins->coordinator, root + "/bin/coordinator/baton-coordinator");
  EXPECT_EQ(bins->worker, root + "/bin/worker/baton-worker");

  Touch(root + "/flat/baton-coordinator", true);
  Touch(root + "/flat/baton-worker", false);  // not executable
  auto flat = LocateBinaries("", root + "/flat/batonctl");
  ASSERT_FALSE(flat.ok());
  EXPECT_THAT(std::string(flat.status().message()), HasSubstr("cannot find baton-worker"));
  chmod((root + "/flat/baton-worker").c_str(), 0755);
  EXPECT_EQ(LocateBinaries("", root + "/flat/batonctl")->worker, root + "/flat/baton-worker");
  EXPECT_EQ(LocateBinaries(root + "/flat", "/nowhere/batonctl")->coordinator, root + "/flat/baton-coordinator");
  EXPECT_THAT(std::string(LocateBinaries(root + "/empty", "").status().message()), HasSubstr("--bin_dir"));
}

class LocalCommandTest : public ::testing::Test {
 protected:
  void SetUp() override {
    unsetenv("BATON_FAKE_FAIL_AT_STEP");
    const std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    dir_ = testing::TempDir(name);
    // A bin dir holding the fake coordinator and the real worker.
    const std::string bin = dir_ + "/bin";
    mkdir(bin.c_str(), 0755);
    ASSERT_EQ(symlink(Absolute(testing::RunfilePath("cli/fake_local_coordinator")).c_str(),
                      (bin + "/baton-coordinator").c_str()),
              0);
    ASSERT_EQ(symlink(Absolute(testing::RunfilePath("worker/baton-worker")).c_str(), (bin + "/baton-worker").c_str()),
              0);
    out_ = dir_ + "/out";
  }

  static std::string Absolute(const std::string& path) {
    char buf[4096];
    return realpath(path.c_str(), buf) ? buf : path;
  }

  std::string WriteJob(const std::string& text) {
    const std::string path = dir_ + "/job.textproto";
    std::ofstream(path) << text;
    return path;
  }

  std::string Job(int pp, int steps) {
    return WriteJob(absl::StrCat("name: \"t\"\nmodel { layers: 2 d_model: 16 heads: 2 vocab: 16 seq_len: 8 }\n",
                                 "parallel { pp: ", pp, " }\nschedule { kind: \"1f1b\" microbatches: 2 }\n",
                                 "train { steps: ", steps, " micro_batch_size: 1 lr: 0.001 }\n"));
  }

  std::vector<std::string> Args(const std::string& job) {
    return {"local", "--job=" + job, "--out=" + out_, "--bin_dir=" + dir_ + "/bin", "--timeout_s=60"};
  }

  // Starts batonctl in the background; output goes to dir_/batonctl.log.
  std::unique_ptr<testing::Subprocess> StartBatonctl(const std::vector<std::string>& args) {
    auto p = std::make_unique<testing::Subprocess>(testing::RunfilePath("cli/batonctl"), args,
                                                   dir_ + "/batonctl.log");
    EXPECT_TRUE(p->Start().ok());
    return p;
  }

  // Waits until batonctl's output contains `text`.
  bool WaitForOutput(const testing::Subprocess& p, const std::string& text) {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (absl::Now() < deadline) {
      if (p.Log().find(text) != std::string::npos) return true;
      absl::SleepFor(absl::Milliseconds(50));
    }
    return false;
  }

  void ExpectNoChildrenLeft() {
    EXPECT_THAT(ProcessesWith("--port_file=" + out_), ::testing::IsEmpty());
  }

  std::string dir_, out_;
};

TEST_F(LocalCommandTest, RunsTheJobToTheEndAndPrintsTheSummary) {
  testing::CommandResult r = testing::RunCommand(testing::RunfilePath("cli/batonctl"), Args(Job(2, 6)),
                                                 absl::Seconds(60));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("2 workers; logs in " + out_ + "/logs/"));
  EXPECT_THAT(r.output, HasSubstr("waiting for workers: "));
  // One line per committed step (output is not a terminal), with the fake's numbers.
  EXPECT_THAT(r.output, HasSubstr("step 6/6  loss 0.571  acc 6.0%  tok/s 1000  bubble 25.0%  comm 5.0%\n"));
  EXPECT_THAT(r.output, Not(HasSubstr("\r")));
  EXPECT_THAT(r.output, HasSubstr("done: job t\n"));
  EXPECT_THAT(r.output, HasSubstr("  steps                    6\n"));
  EXPECT_THAT(r.output, HasSubstr("  bubble_ratio             25.0% (0.25)\n"));
  EXPECT_THAT(r.output, HasSubstr("  expected_bubble_ratio    20.0% (0.2)\n"));
  EXPECT_THAT(r.output, HasSubstr("  note                     fake\n"));
  // Both workers ran, registered, and were stopped with SIGTERM.
  for (const char* w : {"worker-0", "worker-1"}) {
    const std::string log = Slurp(absl::StrCat(out_, "/logs/", w, ".log"));
    EXPECT_THAT(log, HasSubstr("received SIGTERM")) << w;
    EXPECT_THAT(log, HasSubstr("stopped")) << w;
  }
  EXPECT_THAT(Slurp(out_ + "/logs/coordinator.log"), HasSubstr("stopping on signal 15"));
  ExpectNoChildrenLeft();
}

// A dead worker is reported at once but does not end the run: the
// coordinator recovers (or fails the job, which ends it).
TEST_F(LocalCommandTest, AKilledWorkerIsReportedAndTheRunGoesOn) {
  auto batonctl = StartBatonctl(Args(Job(2, 100000)));
  ASSERT_TRUE(WaitForOutput(*batonctl, "step ")) << batonctl->Log();
  const std::vector<pid_t> worker = ProcessesWith("--port_file=" + out_ + "/worker-1.ports");
  ASSERT_EQ(worker.size(), 1u);
  kill(worker[0], SIGKILL);
  ASSERT_TRUE(WaitForOutput(*batonctl,
                            "worker-1 (pipeline stage 1) killed by signal 9 (Killed); the coordinator replaces it"))
      << batonctl->Log();
  EXPECT_FALSE(batonctl->Wait(absl::Seconds(1)).has_value()) << "the run ended:\n" << batonctl->Log();
  batonctl->Signal(SIGINT);
  std::optional<int> code = batonctl->Wait(absl::Seconds(20));
  ASSERT_TRUE(code.has_value()) << batonctl->Log();
  EXPECT_EQ(*code, 130);
  ExpectNoChildrenLeft();
}

TEST_F(LocalCommandTest, InjectKillsAWorkerOfTheStageAtTheStepAndSparesAreStarted) {
  std::vector<std::string> args = Args(Job(2, 100000));
  args.push_back("--spares=1");
  args.push_back("--inject=kill:stage=1@step=3");
  auto batonctl = StartBatonctl(args);
  ASSERT_TRUE(WaitForOutput(*batonctl, "3 workers; logs in")) << batonctl->Log();
  ASSERT_TRUE(WaitForOutput(*batonctl, "injecting SIGKILL into worker-1 (pipeline stage 1)")) << batonctl->Log();
  ASSERT_TRUE(WaitForOutput(*batonctl, "worker-1 (pipeline stage 1) killed by signal 9")) << batonctl->Log();
  EXPECT_THAT(ProcessesWith("--port_file=" + out_ + "/worker-1.ports"), ::testing::IsEmpty());
  EXPECT_THAT(ProcessesWith("--port_file=" + out_ + "/worker-2.ports"), ::testing::SizeIs(1));
  batonctl->Signal(SIGINT);
  ASSERT_TRUE(batonctl->Wait(absl::Seconds(20)).has_value());
  ExpectNoChildrenLeft();
}

// stop:...,for=S freezes the worker and thaws it S seconds later; both lines
// carry the wall time.
TEST_F(LocalCommandTest, InjectStopWithForThawsTheWorkerLater) {
  std::vector<std::string> args = Args(Job(2, 100000));
  args.push_back("--inject=stop:stage=1@step=3,after_ms=20,for=0.5");
  auto batonctl = StartBatonctl(args);
  ASSERT_TRUE(WaitForOutput(*batonctl, "injecting SIGSTOP into worker-1 (pipeline stage 1)")) << batonctl->Log();
  const std::vector<pid_t> worker = ProcessesWith("--port_file=" + out_ + "/worker-1.ports");
  ASSERT_EQ(worker.size(), 1u);
  EXPECT_THAT(batonctl->Log(), ::testing::ContainsRegex(" \\+ 20 ms at 20[0-9-]+T[0-9:.]+Z\n"));
  ASSERT_TRUE(WaitForOutput(*batonctl, absl::StrCat("thawing worker-1 (pid ", worker[0], ", SIGCONT) at ")))
      << batonctl->Log();
  // Running (or sleeping) again, not stopped: /proc/PID/stat's state after "(name) ".
  const std::string stat = Slurp(absl::StrCat("/proc/", worker[0], "/stat"));
  const size_t paren = stat.rfind(") ");
  ASSERT_NE(paren, std::string::npos) << stat;
  EXPECT_NE(stat[paren + 2], 'T') << stat;
  batonctl->Signal(SIGINT);
  ASSERT_TRUE(batonctl->Wait(absl::Seconds(20)).has_value());
  ExpectNoChildrenLeft();
}

// A worker left frozen by --inject=stop is thawed when batonctl stops, so it
// leaves on SIGTERM like the others (no SIGKILL after the grace period).
TEST_F(LocalCommandTest, AWorkerLeftFrozenIsThawedToStopCleanly) {
  std::vector<std::string> args = Args(Job(2, 100000));
  args.push_back("--inject=stop:worker=worker-1@step=3");
  auto batonctl = StartBatonctl(args);
  ASSERT_TRUE(WaitForOutput(*batonctl, "injecting SIGSTOP into worker-1")) << batonctl->Log();
  batonctl->Signal(SIGINT);
  std::optional<int> code = batonctl->Wait(absl::Seconds(20));
  ASSERT_TRUE(code.has_value()) << batonctl->Log();
  EXPECT_EQ(*code, 130) << batonctl->Log();
  EXPECT_THAT(Slurp(out_ + "/logs/worker-1.log"), HasSubstr("received SIGTERM"));
  ExpectNoChildrenLeft();
}

TEST_F(LocalCommandTest, AFailedJobExitsOneWithTheErrorAndTheWorkersLog) {
  setenv("BATON_FAKE_FAIL_AT_STEP", "3", 1);
  testing::CommandResult r = testing::RunCommand(testing::RunfilePath("cli/batonctl"), Args(Job(2, 100)),
                                                 absl::Seconds(60));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("job failed: stage 1 (worker-1) reported a non-finite loss at step 3"));
  EXPECT_THAT(r.output, HasSubstr("--- last lines of " + out_ + "/logs/worker-1.log ---"));
  EXPECT_THAT(r.output, Not(HasSubstr("worker-0.log")));
  ExpectNoChildrenLeft();
}

TEST_F(LocalCommandTest, TooFewWorkersShowsTheCoordinatorsReasonWhileWaiting) {
  std::vector<std::string> args = Args(Job(2, 10));
  args.push_back("--workers=1");
  auto batonctl = StartBatonctl(args);
  ASSERT_TRUE(WaitForOutput(*batonctl, "coordinator: needs pp*tp*dp = 2 ready workers, 1 are ready; start 1 more"))
      << batonctl->Log();
  batonctl->Signal(SIGINT);
  std::optional<int> code = batonctl->Wait(absl::Seconds(20));
  ASSERT_TRUE(code.has_value());
  EXPECT_EQ(*code, 130) << batonctl->Log();
  ExpectNoChildrenLeft();
}

TEST_F(LocalCommandTest, InterruptStopsEverythingAndExits130) {
  auto batonctl = StartBatonctl(Args(Job(1, 100000)));
  ASSERT_TRUE(WaitForOutput(*batonctl, "step ")) << batonctl->Log();
  batonctl->Signal(SIGINT);
  std::optional<int> code = batonctl->Wait(absl::Seconds(20));
  ASSERT_TRUE(code.has_value());
  EXPECT_EQ(*code, 130) << batonctl->Log();
  EXPECT_THAT(batonctl->Log(), HasSubstr("Interrupt; stopping the coordinator and 1 worker\n"));
  EXPECT_THAT(Slurp(out_ + "/logs/worker-0.log"), HasSubstr("received SIGTERM"));
  ExpectNoChildrenLeft();
}

TEST_F(LocalCommandTest, BadJobsAndFlagsExitTwoBeforeStartingAnything) {
  testing::CommandResult r = testing::RunCommand(
      testing::RunfilePath("cli/batonctl"),
      Args(WriteJob("name: \"t\"\nmodel { layers: 2 d_model: 16 heads: 2 vocab: 16 seq_len: 8 }\n"
                    "parallel { pp: 0 }\ntrain { steps: 1 micro_batch_size: 1 }\n")));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_THAT(r.output, HasSubstr("parallel.pp"));
  r = testing::RunCommand(testing::RunfilePath("cli/batonctl"), Args(dir_ + "/no-such-job.textproto"));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, HasSubstr("no-such-job.textproto"));
  r = testing::RunCommand(testing::RunfilePath("cli/batonctl"), {"local", "--job=" + Job(1, 1)});  // no --out
  EXPECT_EQ(r.exit_code, 2);
  r = testing::RunCommand(testing::RunfilePath("cli/batonctl"),
                          {"local", "--job=" + Job(1, 1), "--out=" + out_, "--bin_dir=" + dir_});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.output, HasSubstr("cannot find baton-coordinator"));
  for (const char* bad : {"--inject=kill:stage=1", "--inject=explode:stage=0@step=3", "--inject=kill:stage=5@step=3",
                          "--inject=kill:node=1@step=3", "--spares=-1",
                          "--inject=kill:stage=0@step=3,for=5", "--inject=stop:stage=0@step=3,for=0",
                          "--inject=kill:stage=0,tp=1@step=3", "--inject=kill:stage=0,dp=0,dp=0@step=3",
                          "--inject=kill:stage=0@step=3,after_ms=-1", "--inject=kill:stage=0@after_ms=3",
                          "--inject=stop:stage=0@step=3,soon=1"}) {
    std::vector<std::string> args = Args(Job(2, 1));
    args.push_back(bad);
    r = testing::RunCommand(testing::RunfilePath("cli/batonctl"), args);
    EXPECT_EQ(r.exit_code, 2) << bad << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr(std::string(bad).substr(2, 6))) << bad << ": " << r.output;
  }
  struct stat st;
  EXPECT_NE(stat(out_.c_str(), &st), 0);  // nothing was created
}

}  // namespace
}  // namespace baton::cli
