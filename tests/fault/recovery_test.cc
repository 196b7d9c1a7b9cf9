// Fault injection with real daemons on loopback (batonctl local: a real
// coordinator, real worker processes, Gloo, the real GPT math): a worker of
// the plan is killed (SIGKILL) or frozen past its lease (SIGSTOP, later
// SIGCONT) in the middle of training; a spare, or the same name registering
// again, takes its place with the state of its DP replica or of its buddy's
// in-memory snapshot. Every run asserts that
//   - the job completes (within a bounded time: nothing hangs),
//   - its per-step losses and final weights are bitwise equal to the
//     fault-free run of the same job,
//   - the survivors kept their processes (same PIDs) and rolled back from
//     their own memory.
#include <signal.h>
#include <sys/types.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/json.h"
#include "gtest/gtest.h"
#include "tests/fault/harness.h"
#include "tests/testing/process.h"
#include "worker/checkpoint/checkpoint.h"
#include "worker/checkpoint/weights_diff.h"

namespace baton {
namespace {

using fault::CountLines;
using fault::ExpectBitwiseEqual;
using fault::Job;
using fault::kRunLimit;
using fault::Layout;
using fault::LocalRun;
using fault::LossTexts;
using fault::ReadAll;
using fault::Reference;
using testing::RunCommand;
using testing::RunfilePath;
using testing::TempDir;

struct Fault {
  int stage = 0, tp = 0, dp = 0;
  int sig = SIGKILL;
  int at_step = 10;
};

// Runs `layout` with one spare, injects `fault` into the worker at
// (stage, tp, dp) after `at_step` steps, and checks the recovery.
void RunWithFault(const std::string& name, const Layout& layout, const Fault& fault, int spares = 1,
                  const std::string& fault_tolerance = "", std::vector<std::string> flags = {}) {
  const LocalRun& reference = Reference(layout);
  flags.push_back(absl::StrCat("--spares=", spares));
  LocalRun run(name, Job(layout, fault_tolerance), flags);
  run.Start();
  run.WaitForStep(fault.at_step);
  const std::string victim = run.WorkerAt(fault.stage, fault.tp, fault.dp);
  ASSERT_FALSE(victim.empty()) << run.Log();
  std::map<std::string, pid_t> survivors;
  for (const std::string& w : run.PlanWorkers()) {
    if (w != victim) survivors[w] = run.Pid(w);
  }
  const pid_t victim_pid = run.Pid(victim);
  ASSERT_GT(victim_pid, 0);
  kill(victim_pid, fault.sig);
  run.WaitForRecoveries(1);
  // While the job goes on: the survivors are the same processes, and the
  // operator's view says what happened.
  for (const auto& [w, pid] : survivors) EXPECT_EQ(run.Pid(w), pid) << w << " was restarted";
  auto ports = testing::ReadPortFile(run.out() + "/coordinator.ports", absl::Seconds(5));
  ASSERT_TRUE(ports.ok()) << ports.status();
  const std::string target = absl::StrCat("--coordinator=127.0.0.1:", ports->first);
  auto status = RunCommand(RunfilePath("cli/batonctl"), {"status", target});
  EXPECT_NE(status.output.find("recover"), std::string::npos) << status.output;
  EXPECT_NE(status.output.find("(worker " + victim + ")"), std::string::npos) << status.output;
  auto json = RunCommand(RunfilePath("cli/batonctl"), {"status", target, "--json"});
  auto parsed = JsonValue::Parse(json.output);
  ASSERT_TRUE(parsed.ok()) << json.output;
  ASSERT_NE(parsed->Find("recoveries"), nullptr) << json.output;
  EXPECT_EQ(parsed->Find("recoveries")->number(), 1) << json.output;
  if (fault.sig == SIGSTOP) kill(victim_pid, SIGCONT);  // the thawed old incarnation must not disturb anything
  ASSERT_EQ(run.Finish(), 0) << run.Log();
  ExpectBitwiseEqual(reference, run);
  if (std::any_of(flags.begin(), flags.end(),
                  [](const std::string& f) { return absl::StartsWith(f, "--report_groups_min_ranks="); })) {
    // Both generations, before the fault and after it, ran in report groups.
    EXPECT_GE(fault::CountLines(run.out() + "/logs/coordinator.log", ", steps reported by "), 2)
        << ReadAll(run.out() + "/logs/coordinator.log");
  }
  for (const auto& [w, pid] : survivors) {
    EXPECT_NE(run.WorkerLog(w).find("from its own snapshot"), std::string::npos)
        << w << " did not roll back from its own memory:\n"
        << run.WorkerLog(w);
  }
  const std::string steps = ReadAll(run.out() + "/steps.jsonl");
  EXPECT_NE(steps.find(absl::StrCat("\"worker\": \"", victim, "\"")), std::string::npos) << steps;
  EXPECT_NE(run.Log().find("recoveries               1"), std::string::npos) << run.Log();
  if (!fault_tolerance.empty()) {
    EXPECT_EQ(run.Log().find("replayed_steps           0\n"), std::string::npos) << "nothing was replayed:\n"
                                                                                 << run.Log();
  }
}

TEST(RecoveryTest, KilledFirstStageIsReplacedBySpareFromBuddySnapshot) {
  RunWithFault("kill_first", Layout{}, Fault{0, 0, 0});
}

TEST(RecoveryTest, KilledMiddleStageIsReplacedBySpareFromBuddySnapshot) {
  RunWithFault("kill_middle", Layout{}, Fault{1, 0, 0, SIGKILL, 25});
}

TEST(RecoveryTest, KilledLastStageIsReplacedBySpareFromBuddySnapshot) {
  RunWithFault("kill_last", Layout{}, Fault{2, 0, 0, SIGKILL, 40});
}

// Sparse snapshots: the job rolls back to the last snapshot step and replays
// the steps after it, exactly.
TEST(RecoveryTest, SparseSnapshotsRollBackAndReplayExactly) {
  // Snapshots at steps 50, 100, 150, ...; the kill lands somewhere after step
  // 55 (the injector polls, so a loaded machine lands it later), almost
  // surely before step 100, so the survivors roll back to 50 and replay.
  RunWithFault("sparse_snapshots", Layout{}, Fault{1, 0, 0, SIGKILL, 55}, 1,
               "fault_tolerance { snapshot_every_steps: 50 }");
}

TEST(RecoveryTest, KilledTensorParallelRankInterleaved) {
  Layout l;
  l.pp = 2;
  l.tp = 2;
  l.v = 3;
  l.schedule = "interleaved";
  l.steps = 80;
  RunWithFault("kill_tp", l, Fault{1, 1, 0, SIGKILL, 12});
}

// DualPipe-V: rank 0 holds the first and the last chunk (the loss and both
// ends of the tied embedding, summed locally); killed, its spare takes both
// from the buddy snapshot and the run ends in the fault-free weights.
TEST(RecoveryTest, KilledRankOfAVScheduleHoldingBothEndsIsReplaced) {
  Layout l;
  l.pp = 2;
  l.v = 2;
  l.layers = 4;
  l.schedule = "dualpipe-v";
  l.steps = 80;
  RunWithFault("kill_v", l, Fault{0, 0, 0, SIGKILL, 12});
}

// Evaluating every other step (three forward-only batches each): a worker
// killed mid-run, perhaps mid-evaluation, is replaced, and every evaluation
// appears once in steps.jsonl with the fault-free run's loss, bit for bit
// (LossTexts compares the eval lines' losses too).
TEST(RecoveryTest, AKilledWorkerOfAnEvaluatingJobIsReplacedAndEveryEvaluationIsKept) {
  Layout l;
  l.steps = 60;
  l.train_extra = R"pb(eval_every_steps: 2 eval_steps: 3 eval_data { synthetic { task: "addition" } })pb";
  l.extra_name = "_eval2";
  RunWithFault("kill_eval", l, Fault{2, 0, 0, SIGKILL, 11});
  const std::string steps = ReadAll(TempDir("kill_eval") + "/out/steps.jsonl");
  for (int s = 2; s <= l.steps; s += 2) {
    EXPECT_EQ(CountLines(TempDir("kill_eval") + "/out/steps.jsonl", absl::StrCat("{\"eval\": ", s, ",")), 1)
        << "eval " << s << ":\n" << steps;
  }
}

// A Llama (grouped-query attention, untied head, so no tie group) at
// pp 2 x tp 2: a killed worker is replaced and the run ends with the
// fault-free run's weights, bit for bit.
TEST(RecoveryTest, AKilledWorkerOfALlamaJobIsReplacedBitwise) {
  Layout l;
  l.pp = 2;
  l.tp = 2;
  l.steps = 60;
  l.model_extra = R"pb(arch: "llama" kv_heads: 2 ffn_dim: 48)pb";
  l.extra_name = "_llama";
  RunWithFault("kill_llama", l, Fault{1, 1, 0, SIGKILL, 12});
}

// pp 2 x tp 2 x dp 2, 60 steps (the data-parallel tests share its reference run).
Layout EightRanks() {
  Layout l;
  l.pp = 2;
  l.tp = 2;
  l.dp = 2;
  l.steps = 60;
  return l;
}

TEST(RecoveryTest, KilledDataParallelRankTakesItsReplicasState) {
  RunWithFault("kill_dp", EightRanks(), Fault{0, 1, 1, SIGKILL, 12});
}

// ZeRO-1: the killed DP rank's AdamW moment shard exists nowhere else; it
// comes back from its buddy's snapshot (not from the DP replica, whose shard
// is the other half), and the run ends with the fault-free run's weights.
TEST(RecoveryTest, AKilledDataParallelRankUnderZeroStage1IsRestoredFromItsBuddy) {
  Layout l;
  l.pp = 2;
  l.dp = 2;
  l.steps = 60;
  l.parallel_extra = "zero_stage: 1";
  l.extra_name = "_zero1";
  RunWithFault("kill_zero1", l, Fault{1, 0, 1, SIGKILL, 12});
}

TEST(RecoveryTest, FrozenWorkerPastItsLeaseIsReplacedAndItsThawDisturbsNothing) {
  RunWithFault("stop_middle", Layout{}, Fault{1, 0, 0, SIGSTOP, 15});
}

// Report groups (docs/protocol.md; on for this small job by
// --report_groups_min_ranks; one column of 3): RunStep goes to the group's leader, which
// passes it on, and the members' reports come inside its own. A killed
// member (its leader's gather fails), a killed leader (its members wait for
// a step that never comes) and a frozen leader are recovered like any lost
// worker, and the run ends with the weights of the fault-free run without
// groups, bit for bit.
TEST(RecoveryTest, InReportGroupsAKilledMemberIsReplaced) {
  RunWithFault("groups_kill_member", Layout{}, Fault{2, 0, 0, SIGKILL, 20}, 1, "", {"--report_groups_min_ranks=2"});
}

TEST(RecoveryTest, InReportGroupsAKilledLeaderIsReplaced) {
  RunWithFault("groups_kill_leader", Layout{}, Fault{0, 0, 0, SIGKILL, 20}, 1, "", {"--report_groups_min_ranks=2"});
}

TEST(RecoveryTest, InReportGroupsAFrozenLeaderIsReplaced) {
  RunWithFault("groups_stop_leader", Layout{}, Fault{0, 0, 0, SIGSTOP, 20}, 1, "", {"--report_groups_min_ranks=2"});
}

// A group of several columns (Plan.report_group_columns): pp 2 x tp 2 x
// dp 2 in one group of 8 ranks, both replicas led by pp 0, tp 0 of dp 0.
// A killed member of the other replica is replaced as any lost worker, and
// the weights are bit for bit those of the run without groups.
TEST(RecoveryTest, InAGroupOfSeveralColumnsAKilledMemberIsReplaced) {
  RunWithFault("groups_columns_kill_member", EightRanks(), Fault{1, 1, 1, SIGKILL, 12}, 1, "",
               {"--report_groups_min_ranks=2"});
}

// No spare: the same name registering again (systemd Restart=on-failure)
// takes its own slot back and gets its state from its buddy.
TEST(RecoveryTest, TheLostWorkerRegisteringAgainTakesItsSlotBack) {
  const Layout layout;
  const LocalRun& reference = Reference(layout);
  LocalRun run("same_name", Job(layout));
  run.Start();
  run.WaitForStep(20);
  const std::string victim = run.WorkerAt(2, 0, 0);
  ASSERT_FALSE(victim.empty());
  const pid_t pid = run.Pid(victim);
  ASSERT_GT(pid, 0);
  kill(pid, SIGKILL);
  auto ports = testing::ReadPortFile(run.out() + "/coordinator.ports", absl::Seconds(5));
  ASSERT_TRUE(ports.ok()) << ports.status();
  testing::Subprocess again(RunfilePath("worker/baton-worker"),
                            {absl::StrCat("--coordinator=127.0.0.1:", ports->first), "--name=" + victim,
                             "--output_dir=" + run.out()},
                            run.out() + "/logs/" + victim + ".again.log");
  ASSERT_TRUE(again.Start().ok());
  ASSERT_EQ(run.Finish(), 0) << run.Log() << "\n" << again.Log();
  ExpectBitwiseEqual(reference, run);
  EXPECT_NE(again.Log().find("from the state sent"), std::string::npos) << again.Log();
}

// A second fault while the first is being recovered from (the spare that
// took over dies at once): two recoveries, same result.
TEST(RecoveryTest, ASecondFaultDuringRecoveryStillEndsInTheSameWeights) {
  const Layout layout;
  const LocalRun& reference = Reference(layout);
  LocalRun run("second_fault", Job(layout), {"--spares=2"});
  run.Start();
  run.WaitForStep(15);
  const std::string victim = run.WorkerAt(1, 0, 0);
  std::vector<std::string> spares;
  const std::vector<std::string> plan = run.PlanWorkers();
  for (int i = 0; i < 5; ++i) {
    const std::string w = absl::StrCat("worker-", i);
    if (std::find(plan.begin(), plan.end(), w) == plan.end()) spares.push_back(w);
  }
  ASSERT_EQ(spares.size(), 2u);
  std::map<std::string, pid_t> spare_pids;
  for (const std::string& s : spares) spare_pids[s] = run.Pid(s);
  kill(run.Pid(victim), SIGKILL);
  // Kill whichever spare is configured first, as soon as it is.
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  std::string first;
  while (first.empty()) {
    ASSERT_LT(absl::Now(), deadline) << run.Log();
    for (const std::string& s : spares) {
      if (run.WorkerLog(s).find("configured for job") != std::string::npos) first = s;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  kill(spare_pids[first], SIGKILL);
  ASSERT_EQ(run.Finish(), 0) << run.Log();
  ExpectBitwiseEqual(reference, run);
  EXPECT_EQ(CountLines(run.out() + "/steps.jsonl", "\"recovery\": "), 2) << ReadAll(run.out() + "/steps.jsonl");
}

}  // namespace
}  // namespace baton

namespace baton {
namespace {

// kill -9 of the coordinator mid-run, restarted with the same flags: the
// workers (never restarted) register again and report what they hold; the
// new coordinator adopts the job and continues from the newest step every
// shard holds. steps.jsonl holds every step exactly once, and the final
// weights equal the fault-free run's.
TEST(RecoveryTest, AKilledCoordinatorRestartedWithTheSameFlagsAdoptsTheRunningJob) {
  const Layout layout;
  const LocalRun& reference = Reference(layout);
  const std::string dir = TempDir("coordinator_restart");
  const std::string out = dir + "/out";
  std::ofstream(dir + "/job.textproto") << Job(layout);
  auto coordinator_args = [&](const std::string& listen) {
    return std::vector<std::string>{"--listen=" + listen, "--http_listen=127.0.0.1:0",
                                    "--port_file=" + dir + "/coordinator.ports", "--job=" + dir + "/job.textproto",
                                    "--out=" + out};
  };
  auto first = std::make_unique<testing::Subprocess>(RunfilePath("coordinator/baton-coordinator"),
                                                     coordinator_args("127.0.0.1:0"), dir + "/coordinator.1.log");
  ASSERT_TRUE(first->Start().ok());
  auto ports = testing::ReadPortFile(dir + "/coordinator.ports", absl::Seconds(30));
  ASSERT_TRUE(ports.ok()) << ports.status();
  const std::string address = absl::StrCat("127.0.0.1:", ports->first);
  std::vector<std::unique_ptr<testing::Subprocess>> workers;
  for (int i = 0; i < layout.pp; ++i) {
    workers.push_back(std::make_unique<testing::Subprocess>(
        RunfilePath("worker/baton-worker"),
        std::vector<std::string>{"--coordinator=" + address, absl::StrCat("--name=w-", i), "--output_dir=" + out},
        absl::StrCat(dir, "/w-", i, ".log")));
    ASSERT_TRUE(workers.back()->Start().ok());
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(90);
  while (CountLines(out + "/steps.jsonl", "\"step\": ") < 30) {
    ASSERT_LT(absl::Now(), deadline) << first->Log();
    absl::SleepFor(absl::Milliseconds(10));
  }
  first->Signal(SIGKILL);
  ASSERT_TRUE(first->Wait(absl::Seconds(10)).has_value());
  std::remove((dir + "/coordinator.ports").c_str());
  testing::Subprocess second(RunfilePath("coordinator/baton-coordinator"), coordinator_args(address),
                             dir + "/coordinator.2.log");
  ASSERT_TRUE(second.Start().ok());
  const absl::Time done_by = absl::Now() + absl::Seconds(120);
  while (ReadAll(out + "/summary.json").find("\"state\": \"") == std::string::npos) {
    ASSERT_LT(absl::Now(), done_by) << "the adopted job did not finish:\n" << second.Log();
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_NE(ReadAll(out + "/summary.json").find("\"state\": \"done\""), std::string::npos)
      << ReadAll(out + "/summary.json") << second.Log();
  // Every step exactly once, the same as without the fault.
  EXPECT_EQ(LossTexts(out), LossTexts(reference.out()));
  auto wa = checkpoint::LoadFullWeights(reference.out() + "/final");
  auto wb = checkpoint::LoadFullWeights(out + "/final");
  ASSERT_TRUE(wa.ok() && wb.ok()) << wb.status();
  auto diff = checkpoint::CompareWeights(*wa, *wb);
  ASSERT_TRUE(diff.ok()) << diff.status();
  EXPECT_EQ(diff->max_abs_diff, 0.0);
  const std::string steps = ReadAll(out + "/steps.jsonl");
  EXPECT_EQ(CountLines(out + "/steps.jsonl", "\"cause\": \"coordinator_restart\""), 1) << steps;
  EXPECT_NE(second.Log().find("adopted the running job"), std::string::npos) << second.Log();
  // The workers were never restarted.
  for (auto& w : workers) {
    EXPECT_FALSE(w->Wait(absl::ZeroDuration()).has_value()) << w->Log();
    EXPECT_NE(w->Log().find("from its own snapshot"), std::string::npos) << w->Log();
    w->Signal(SIGTERM);
  }
  second.Signal(SIGTERM);
  for (auto& w : workers) EXPECT_TRUE(w->Wait(absl::Seconds(20)).has_value());
  EXPECT_TRUE(second.Wait(absl::Seconds(20)).has_value());
}

}  // namespace
}  // namespace baton

namespace baton {
namespace {

// checkpoint { dir every_steps keep }: complete checkpoints every N committed
// steps, the last `keep` kept; --resume continues bitwise equal to the
// uninterrupted run; a damaged checkpoint is refused before training.
TEST(RecoveryTest, PeriodicCheckpointsResumeBitwiseAndABadOneIsRefused) {
  Layout layout;
  layout.pp = 2;
  layout.tp = 2;
  layout.steps = 60;
  const std::string root = TempDir("checkpoints");
  const std::string ck = absl::StrFormat("checkpoint { dir: \"%s\" every_steps: 20 keep: 2 }", root);
  LocalRun full("checkpointed", Job(layout, ck));
  full.Start();
  ASSERT_EQ(full.Finish(), 0) << full.Log();
  for (const char* kept : {"step-00000040", "step-00000060"}) {
    EXPECT_FALSE(ReadAll(absl::StrCat(root, "/", kept, "/manifest.json")).empty()) << kept;
  }
  EXPECT_TRUE(ReadAll(root + "/step-00000020/manifest.json").empty()) << "keep: 2 should have pruned step 20";

  LocalRun resumed("resumed", Job(layout, ck), {"--resume=" + root + "/step-00000040"});
  resumed.Start();
  ASSERT_EQ(resumed.Finish(), 0) << resumed.Log();
  const std::vector<std::string> all = LossTexts(full.out()), tail = LossTexts(resumed.out());
  ASSERT_EQ(all.size(), 60u);
  EXPECT_EQ(tail, std::vector<std::string>(all.begin() + 40, all.end()));
  auto wa = checkpoint::LoadFullWeights(full.out() + "/final");
  auto wb = checkpoint::LoadFullWeights(resumed.out() + "/final");
  ASSERT_TRUE(wa.ok() && wb.ok());
  auto diff = checkpoint::CompareWeights(*wa, *wb);
  ASSERT_TRUE(diff.ok());
  EXPECT_EQ(diff->max_abs_diff, 0.0);

  // Truncate one shard of a copy: refused, naming the file, before any worker is configured.
  const std::string bad = TempDir("bad_checkpoint");
  ASSERT_EQ(RunCommand("cp", {"-r", root + "/step-00000060/.", bad}).exit_code, 0);
  ASSERT_EQ(RunCommand("truncate", {"-s", "100", bad + "/chunk1-tp1.safetensors"}).exit_code, 0);
  LocalRun refused("refused", Job(layout, ck), {"--resume=" + bad});
  refused.Start();
  EXPECT_EQ(refused.Finish(), 1) << refused.Log();
  EXPECT_NE(refused.Log().find("chunk1-tp1.safetensors"), std::string::npos) << refused.Log();
  EXPECT_EQ(CountLines(refused.out() + "/steps.jsonl", "\"step\": "), 0);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(refused.WorkerLog(absl::StrCat("worker-", i)).find("configured for job"), std::string::npos);
  }
}

}  // namespace
}  // namespace baton

namespace baton {
namespace {

// The trace marks the recovery (recovery-unit): a span on the coordinator's
// recovery track naming the cause, the lost worker and its stage.
TEST(RecoveryTest, TheTraceShowsTheRecoveryAsASpan) {
  Layout layout;
  layout.pp = 2;
  layout.steps = 300;  // long enough for the injector, which polls, to land the kill mid-run
  LocalRun run("trace_marks", Job(layout), {"--spares=1", "--inject=kill:stage=1@step=20"});
  run.Start();
  ASSERT_EQ(run.Finish(), 0) << run.Log();
  auto trace = JsonValue::Parse(ReadAll(run.out() + "/trace.json"));
  ASSERT_TRUE(trace.ok()) << trace.status();
  const JsonValue* span = nullptr;
  for (const JsonValue& e : trace->Find("traceEvents")->items()) {
    if (e.Find("cat") != nullptr && e.Find("cat")->str() == "recovery") span = &e;
  }
  ASSERT_NE(span, nullptr) << "no recovery span in trace.json";
  const JsonValue& args = *span->Find("args");
  EXPECT_EQ(args.Find("cause")->str(), "worker_lost");
  EXPECT_EQ(args.Find("stage")->str().rfind("stage 1 ", 0), 0u) << args.Find("stage")->str();
  EXPECT_EQ(args.Find("outcome")->str(), "recovered");
  EXPECT_GT(*span->Find("dur")->integer(), 0);
}

}  // namespace
}  // namespace baton
