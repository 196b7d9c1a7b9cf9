// Shared by the fault-injection tests: one `batonctl local` run driven from
// a test (real coordinator and worker daemons on loopback), the fault-free
// reference run of a layout, and the bitwise comparison against it.
#ifndef BATON_TESTS_FAULT_HARNESS_H_
#define BATON_TESTS_FAULT_HARNESS_H_

#include <signal.h>
#include <sys/types.h>

#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/testing/process.h"
#include "worker/checkpoint/checkpoint.h"
#include "worker/checkpoint/weights_diff.h"

namespace baton {
namespace fault {

using testing::RunCommand;
using testing::RunfilePath;
using testing::TempDir;

inline constexpr absl::Duration kRunLimit = absl::Seconds(240);

struct Layout {
  int layers = 6, microbatches = 4;
  int pp = 3, tp = 1, dp = 1, v = 1, steps = 300;  // long enough to still run while a test looks at a recovery
  std::string schedule = "1f1b";
  // More train { } fields (the evaluation's), and a name for them.
  std::string train_extra, extra_name;
  std::string model_extra;  // more model { } fields (Llama's); name them in extra_name
  std::string parallel_extra;  // more parallel { } fields (zero_stage); name them in extra_name
  std::string Name() const {
    return absl::StrFormat("%s_pp%d_tp%d_dp%d_v%d_m%d_s%d%s", schedule, pp, tp, dp, v, microbatches, steps,
                           extra_name);
  }
};

inline std::string Job(const Layout& l, const std::string& extra = "") {
  return absl::StrFormat(R"pb(
    name: "fault"
    model { layers: %d d_model: 32 heads: 4 vocab: 16 seq_len: 20 %s }
    parallel { pp: %d tp: %d dp: %d virtual_stages: %d %s }
    schedule { kind: "%s" microbatches: %d }
    train { steps: %d micro_batch_size: 2 lr: 0.003 weight_decay: 0.01 grad_clip: 1.0 seed: 11 %s }
    data { synthetic { task: "addition" } }
    %s
  )pb",
                         l.layers, l.model_extra, l.pp, l.tp, l.dp, l.v, l.parallel_extra, l.schedule, l.microbatches,
                         l.steps, l.train_extra, extra);
}

inline std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The per-step "loss" texts of steps.jsonl (exact, for bitwise checks).
inline std::vector<std::string> LossTexts(const std::string& out) {
  std::vector<std::string> losses;
  std::ifstream steps(out + "/steps.jsonl");
  for (std::string line; std::getline(steps, line);) {
    const size_t at = line.find("\"loss\": ");
    if (at == std::string::npos) continue;
    losses.push_back(line.substr(at, line.find(',', at) - at));
  }
  return losses;
}

inline int CountLines(const std::string& path, const std::string& needle) {
  int n = 0;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) n += line.find(needle) != std::string::npos;
  return n;
}

// One `batonctl local` run, driven from the test.
class LocalRun {
 public:
  LocalRun(const std::string& name, const std::string& job, std::vector<std::string> extra = {}) {
    dir_ = TempDir(name);
    out_ = dir_ + "/out";
    std::ofstream(dir_ + "/job.textproto") << job;
    std::vector<std::string> args = {"local", "--job=" + dir_ + "/job.textproto", "--out=" + out_,
                                     absl::StrCat("--timeout_s=", absl::ToInt64Seconds(kRunLimit))};
    for (std::string& a : extra) args.push_back(std::move(a));
    local_ = std::make_unique<testing::Subprocess>(RunfilePath("cli/batonctl"), args, dir_ + "/local.log");
  }

  void Start() { ASSERT_TRUE(local_->Start().ok()); }
  // Exit code; fails the test when the run does not end in time.
  int Finish() {
    auto code = local_->Wait(kRunLimit + absl::Seconds(30));
    EXPECT_TRUE(code.has_value()) << "batonctl local hung:\n" << local_->Log();
    return code.value_or(-1);
  }
  std::string Log() const { return local_->Log(); }
  const std::string& out() const { return out_; }

  // Waits until `n` steps were recorded.
  void WaitForStep(int n) {
    const absl::Time deadline = absl::Now() + absl::Seconds(90);
    while (CountLines(out_ + "/steps.jsonl", "\"step\": ") < n) {
      ASSERT_LT(absl::Now(), deadline) << "training did not reach step " << n << ":\n" << Log();
      absl::SleepFor(absl::Milliseconds(20));
    }
  }
  // Waits until steps.jsonl records `n` recoveries.
  void WaitForRecoveries(int n) {
    const absl::Time deadline = absl::Now() + absl::Seconds(90);
    while (CountLines(out_ + "/steps.jsonl", "\"recovery\": ") < n) {
      ASSERT_LT(absl::Now(), deadline) << "no recovery " << n << " recorded:\n" << Log();
      absl::SleepFor(absl::Milliseconds(20));
    }
  }

  // The worker configured (first generation) as (stage, tp, dp).
  // The worker of (stage, tp, dp) in generation 1, and of cp rank `cp` when
  // >= 0 (a context-parallel job).
  std::string WorkerAt(int stage, int tp, int dp, int cp = -1) const {
    const std::string want = cp < 0 ? absl::StrFormat("generation 1: stage %d, tp %d, dp %d,", stage, tp, dp)
                                    : absl::StrFormat("generation 1: stage %d, tp %d, dp %d, cp %d,", stage, tp, dp, cp);
    for (int i = 0; i < 32; ++i) {
      const std::string name = absl::StrCat("worker-", i);
      if (ReadAll(absl::StrCat(out_, "/logs/", name, ".log")).find(want) != std::string::npos) return name;
    }
    return "";
  }
  // Workers configured in the first generation.
  std::vector<std::string> PlanWorkers() const {
    std::vector<std::string> names;
    for (int i = 0; i < 32; ++i) {
      const std::string name = absl::StrCat("worker-", i);
      if (ReadAll(absl::StrCat(out_, "/logs/", name, ".log")).find("generation 1: stage") != std::string::npos) {
        names.push_back(name);
      }
    }
    return names;
  }
  // PID of a running worker daemon (-1 when none).
  pid_t Pid(const std::string& worker) const {
    auto r = RunCommand("pgrep", {"-f", "--", absl::StrCat("--port_file=", out_, "/", worker, ".ports")});
    pid_t pid = -1;
    for (absl::string_view line : absl::StrSplit(r.output, '\n', absl::SkipEmpty())) {
      int v;
      if (absl::SimpleAtoi(line, &v)) pid = v;
    }
    return pid;
  }
  std::string WorkerLog(const std::string& worker) const {
    return ReadAll(absl::StrCat(out_, "/logs/", worker, ".log"));
  }

 private:
  std::string dir_, out_;
  std::unique_ptr<testing::Subprocess> local_;
};

// The fault-free run of a layout (computed once per layout).
inline const LocalRun& Reference(const Layout& l) {
  static auto* runs = new std::map<std::string, std::unique_ptr<LocalRun>>();
  auto& run = (*runs)[l.Name()];
  if (run == nullptr) {
    run = std::make_unique<LocalRun>("reference_" + l.Name(), Job(l));
    run->Start();
    EXPECT_EQ(run->Finish(), 0) << run->Log();
  }
  return *run;
}

inline void ExpectBitwiseEqual(const LocalRun& reference, const LocalRun& run) {
  const std::vector<std::string> a = LossTexts(reference.out()), b = LossTexts(run.out());
  EXPECT_GT(a.size(), 0u);
  EXPECT_EQ(a, b) << "per-step losses differ from the fault-free run";
  auto wa = checkpoint::LoadFullWeights(reference.out() + "/final");
  auto wb = checkpoint::LoadFullWeights(run.out() + "/final");
  ASSERT_TRUE(wa.ok()) << wa.status();
  ASSERT_TRUE(wb.ok()) << wb.status();
  auto diff = checkpoint::CompareWeights(*wa, *wb);
  ASSERT_TRUE(diff.ok()) << diff.status();
  EXPECT_EQ(diff->max_abs_diff, 0.0) << "final weights differ from the fault-free run";
}

}  // namespace fault
}  // namespace baton

#endif  // BATON_TESTS_FAULT_HARNESS_H_
