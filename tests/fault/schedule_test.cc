// Seeded fault schedules against real daemons on loopback (`batonctl local`
// with --spares and --inject, a real coordinator, real workers, Gloo, the real
// GPT math), for the cases recovery_test does not cover:
//   - a worker frozen past its lease and thawed (SIGCONT) after it was
//     replaced: the old incarnation drops its stale job, registers again as a
//     spare, writes nothing into the job, and takes over at the next fault;
//   - kill -9 the moment a snapshot step commits, as every worker captures
//     and sends its buddy snapshot (the dead worker's own snapshot, and the
//     one it holds or receives as a buddy; whether the transfer is cut in
//     half is timing, see KillAtSnapshot);
//   - kill -9 while the background writer writes a periodic checkpoint: the
//     partial checkpoint has no manifest, the coordinator never recorded it,
//     and --resume takes the previous complete one, bitwise;
//   - kill -9 of a TP rank or a DP rank at a seeded point inside a seeded step
//     (--inject ...,after_ms=M lands in forward, backward, optimizer or
//     all-reduce) in PP=3xTP=2 and PP=2xTP=2xDP=2, 1F1B and interleaved,
//     and a DP rank under ZeRO-1 (parallel.zero_stage 1).
// Each run asserts that the job completes (bounded: nothing hangs), its
// per-step losses and final weights are bitwise equal to the fault-free run,
// and the survivors kept their processes (same PIDs).
#include <dirent.h>
#include <signal.h>

#include <algorithm>
#include <iostream>
#include <random>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "common/checkpoint_manifest.h"
#include "common/json.h"
#include "tests/fault/harness.h"

namespace baton {
namespace {

using fault::CountLines;
using fault::ExpectBitwiseEqual;
using fault::Job;
using fault::Layout;
using fault::LocalRun;
using fault::LossTexts;
using fault::ReadAll;
using fault::Reference;
using testing::RunCommand;
using testing::RunfilePath;
using testing::TempDir;

// Fixed, so that CI runs the same schedules every time; bench/chaos_bench.sh
// draws many more.
constexpr uint32_t kScheduleSeed = 20261130;

// The JSON lines of steps.jsonl that have `key`.
std::vector<JsonValue> StepsLines(const std::string& out, const std::string& key) {
  std::vector<JsonValue> lines;
  std::ifstream in(out + "/steps.jsonl");
  for (std::string line; std::getline(in, line);) {
    if (line.find("\"" + key + "\": ") == std::string::npos) continue;
    auto v = JsonValue::Parse(line);
    if (v.ok()) lines.push_back(*std::move(v));
  }
  return lines;
}

int64_t IntField(const JsonValue& v, const std::string& key) {
  const JsonValue* f = v.Find(key);
  return f != nullptr && f->integer() ? *f->integer() : -1;
}

// Waits (polling every millisecond) until steps.jsonl records step `n`: the
// moment the coordinator committed it, while the workers capture and send
// their snapshots and the periodic checkpoint starts.
void WaitForCommit(const LocalRun& run, int n) {
  const std::string needle = absl::StrCat("{\"step\": ", n, ",");
  const absl::Time deadline = absl::Now() + absl::Seconds(120);
  while (ReadAll(run.out() + "/steps.jsonl").find(needle) == std::string::npos) {
    ASSERT_LT(absl::Now(), deadline) << "step " << n << " was not committed:\n" << run.Log();
    absl::SleepFor(absl::Milliseconds(1));
  }
}

// PIDs of the workers of the first generation.
std::map<std::string, pid_t> PlanPids(const LocalRun& run) {
  std::map<std::string, pid_t> pids;
  for (const std::string& w : run.PlanWorkers()) pids[w] = run.Pid(w);
  return pids;
}

// While the job goes on after a recovery: the survivors are the same processes.
void ExpectSurvivorsKept(const LocalRun& run, const std::map<std::string, pid_t>& before,
                         const std::set<std::string>& lost) {
  for (const auto& [w, pid] : before) {
    if (lost.count(w)) continue;
    EXPECT_GT(pid, 0) << w;
    EXPECT_EQ(run.Pid(w), pid) << w << " was restarted";
  }
}

// Once the job is done: every survivor restored the recovery step from its own memory.
void ExpectSurvivorsRolledBackFromMemory(const LocalRun& run, const std::map<std::string, pid_t>& before,
                                         const std::set<std::string>& lost) {
  for (const auto& [w, pid] : before) {
    if (lost.count(w)) continue;
    EXPECT_NE(run.WorkerLog(w).find("from its own snapshot"), std::string::npos)
        << w << " did not roll back from its own memory:\n"
        << run.WorkerLog(w);
  }
}

// The `batonctl status --json` of a running `batonctl local`.
JsonValue Status(const LocalRun& run) {
  auto ports = testing::ReadPortFile(run.out() + "/coordinator.ports", absl::Seconds(5));
  EXPECT_TRUE(ports.ok()) << ports.status();
  if (!ports.ok()) return JsonValue();
  auto r = RunCommand(RunfilePath("cli/batonctl"),
                      {"status", absl::StrCat("--coordinator=127.0.0.1:", ports->first), "--json"});
  auto parsed = JsonValue::Parse(r.output);
  EXPECT_TRUE(parsed.ok()) << r.output;
  return parsed.ok() ? *parsed : JsonValue();
}

std::string WorkerState(const JsonValue& status, const std::string& name) {
  const JsonValue* workers = status.Find("workers");
  if (workers == nullptr) return "";
  for (const JsonValue& w : workers->items()) {
    if (w.Find("name") != nullptr && w.Find("name")->str() == name && w.Find("state") != nullptr) {
      return absl::AsciiStrToLower(w.Find("state")->str());
    }
  }
  return "";
}

bool InAStage(const JsonValue& status, const std::string& name) {
  const JsonValue* stages = status.Find("stages");
  if (stages == nullptr) return false;
  for (const JsonValue& st : stages->items()) {
    if (st.Find("workers") == nullptr) continue;
    for (const JsonValue& w : st.Find("workers")->items()) {
      if (w.str() == name) return true;
    }
  }
  return false;
}

// SIGSTOP past the lease, SIGCONT 5 s later (by `batonctl local --inject=
// stop:...,for=5`). The frozen incarnation is replaced by the spare; thawed,
// it finds its session gone, drops its job (its step fails against peers that
// moved on; its replies have no session to go to) and registers again under
// its name as a new incarnation: a READY spare outside the plan. When the
// worker that replaced it is killed, the thawed worker is that spare: it
// takes the slot back with the state sent from the buddy, and the job ends
// bitwise equal to the fault-free run.
TEST(FaultScheduleTest, AThawedFrozenWorkerRejoinsAsASpareAndTakesOverAtTheNextFault) {
  Layout layout;
  layout.steps = 2000;  // long enough to still run after the freeze, the thaw and a second fault
  const LocalRun& reference = Reference(layout);
  LocalRun run("thaw", Job(layout), {"--spares=1", "--inject=stop:stage=1@step=20,for=5"});
  run.Start();
  run.WaitForStep(5);
  const std::string victim = run.WorkerAt(1, 0, 0);
  ASSERT_FALSE(victim.empty()) << run.Log();
  const std::map<std::string, pid_t> before = PlanPids(run);
  std::string spare;
  for (int i = 0; i < 4; ++i) {
    const std::string w = absl::StrCat("worker-", i);
    if (!before.count(w)) spare = w;
  }
  ASSERT_FALSE(spare.empty());
  const pid_t spare_pid = run.Pid(spare);
  run.WaitForRecoveries(1);
  ExpectSurvivorsKept(run, before, {victim});

  // Thawed: the same process registers again (a second registration in its
  // log) and is a READY worker outside the plan.
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  std::string log;
  for (;;) {
    log = run.WorkerLog(victim);
    size_t n = 0;
    for (size_t at = log.find("registered with coordinator"); at != std::string::npos;
         at = log.find("registered with coordinator", at + 1)) {
      ++n;
    }
    if (n >= 2) break;
    ASSERT_LT(absl::Now(), deadline) << "the thawed worker did not register again:\n" << log << run.Log();
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_NE(run.Log().find(absl::StrCat("thawing ", victim, " (pid ", before.at(victim), ", SIGCONT)")),
            std::string::npos)
      << run.Log();
  EXPECT_EQ(run.Pid(victim), before.at(victim)) << "the thawed worker is the old process";
  EXPECT_NE(log.find("job aborted"), std::string::npos) << log;
  EXPECT_EQ(CountLines(run.out() + "/logs/" + victim + ".log", "configured for job"), 1)
      << "the thawed worker must not rejoin the job on its own:\n"
      << log;
  const JsonValue status = Status(run);
  EXPECT_EQ(WorkerState(status, victim), "ready") << victim;
  EXPECT_FALSE(InAStage(status, victim)) << victim << " is still in the plan";
  EXPECT_TRUE(InAStage(status, spare)) << spare << " did not replace " << victim;

  // The next fault: the thawed worker is the spare that takes over.
  kill(spare_pid, SIGKILL);
  run.WaitForRecoveries(2);
  ASSERT_EQ(run.Finish(), 0) << run.Log();
  ExpectBitwiseEqual(reference, run);
  ExpectSurvivorsRolledBackFromMemory(run, before, {victim});
  const std::vector<JsonValue> recoveries = StepsLines(run.out(), "recovery");
  ASSERT_EQ(recoveries.size(), 2u);
  EXPECT_EQ(recoveries[0].Find("cause")->str(), "worker_hung");
  EXPECT_EQ(recoveries[0].Find("worker")->str(), victim);
  EXPECT_EQ(recoveries[1].Find("worker")->str(), spare);
  EXPECT_NE(recoveries[1].Find("detail")->str().find("-> " + victim), std::string::npos)
      << recoveries[1].Find("detail")->str();
  EXPECT_NE(run.WorkerLog(victim).find("from the state sent"), std::string::npos) << run.WorkerLog(victim);
}

// kill -9 the moment step 30 commits (as seen in steps.jsonl, polled every
// millisecond), with snapshots every 10 steps: the workers are capturing and
// sending the snapshot of step 30 about then. If the dead worker's snapshot
// of 30 had not reached its buddy (or the snapshot it was receiving as a
// buddy is lost with it), the recovery step is 20 and 10 steps are replayed;
// else it is 30. Either way the replay is exact. Which one happens is timing:
// on this machine the snapshot (a few hundred KiB) had always arrived before
// the kill (resume step 30), so these runs exercise the kill right after a
// snapshot step and the buddy's loss, not reliably a transfer cut in half
// (that needs a worker-side hook that is not built).
void KillAtSnapshot(const std::string& name, int stage) {
  Layout layout;
  const LocalRun& reference = Reference(layout);
  LocalRun run(name, Job(layout, "fault_tolerance { snapshot_every_steps: 10 }"), {"--spares=1"});
  run.Start();
  run.WaitForStep(5);
  const std::string victim = run.WorkerAt(stage, 0, 0);
  ASSERT_FALSE(victim.empty()) << run.Log();
  const std::map<std::string, pid_t> before = PlanPids(run);
  WaitForCommit(run, 30);
  kill(before.at(victim), SIGKILL);
  run.WaitForRecoveries(1);
  ExpectSurvivorsKept(run, before, {victim});
  ASSERT_EQ(run.Finish(), 0) << run.Log();
  ExpectBitwiseEqual(reference, run);
  ExpectSurvivorsRolledBackFromMemory(run, before, {victim});
  const std::vector<JsonValue> recoveries = StepsLines(run.out(), "recovery");
  ASSERT_EQ(recoveries.size(), 1u);
  const int64_t resume = IntField(recoveries[0], "resume_step");
  // A step with a snapshot (how late the kill lands after the commit of step
  // 30 depends on the machine's load; the assertion does not).
  EXPECT_TRUE(resume >= 20 && resume % 10 == 0) << "resume step " << resume;
  std::cerr << name << ": killed " << victim << " once step 30 was committed; resumed at step " << resume << " ("
            << IntField(recoveries[0], "replayed_steps") << " steps replayed)\n";
}

TEST(FaultScheduleTest, AWorkerKilledAsItSendsASnapshot) { KillAtSnapshot("snapshot_owner", 1); }

// The last stage's buddy is stage 0; it is itself the buddy of stage 1, whose
// snapshot of step 30 it holds (or is receiving): stage 1 keeps its own copy.
TEST(FaultScheduleTest, ABuddyKilledAsItReceivesASnapshot) { KillAtSnapshot("snapshot_buddy", 2); }

// A checkpoint every step, and the worker that writes shard (0, 0) killed the
// moment step 25 commits (its background writer is writing that step) with
// no restart allowed: the job fails. Every checkpoint directory with a
// manifest is complete, the newest complete one is the last the coordinator
// recorded, a partial one has no manifest, and --resume of the checkpoint
// root continues from the newest complete step, bitwise equal to the
// uninterrupted run.
TEST(FaultScheduleTest, AKillDuringACheckpointWriteLeavesNothingThatLooksCompleteAndResumeTakesTheLastComplete) {
  Layout layout;
  layout.pp = 2;
  layout.tp = 2;
  layout.steps = 60;
  const LocalRun& reference = Reference(layout);
  const std::string root = TempDir("ck_fault");
  const std::string ck = absl::StrFormat("checkpoint { dir: \"%s\" every_steps: 1 keep: 3 }", root);
  LocalRun run("ck_fault_run", Job(layout, ck + " fault_tolerance { max_restarts: 0 }"));
  run.Start();
  run.WaitForStep(3);
  const std::string victim = run.WorkerAt(0, 0, 0);
  ASSERT_FALSE(victim.empty()) << run.Log();
  const pid_t pid = run.Pid(victim);
  WaitForCommit(run, 25);
  kill(pid, SIGKILL);
  ASSERT_EQ(run.Finish(), 1) << "max_restarts 0: the job fails\n" << run.Log();

  int64_t newest_complete = 0, partial = 0;
  DIR* d = opendir(root.c_str());
  ASSERT_NE(d, nullptr);
  while (dirent* e = readdir(d)) {
    int64_t step;
    if (!absl::StartsWith(e->d_name, "step-") || !absl::SimpleAtoi(e->d_name + 5, &step)) continue;
    const std::string dir = absl::StrCat(root, "/", e->d_name);
    if (ReadAll(dir + "/manifest.json").empty()) {
      ++partial;
      continue;
    }
    auto state = checkpoint::LoadFullState(dir);
    EXPECT_TRUE(state.ok()) << dir << " has a manifest but is not complete: " << state.status();
    newest_complete = std::max(newest_complete, step);
  }
  closedir(d);
  std::cerr << "checkpoints: newest complete step " << newest_complete << ", " << partial
            << " partial (no manifest)\n";
  ASSERT_GT(newest_complete, 0);
  const std::vector<JsonValue> recorded = StepsLines(run.out(), "checkpoint");
  ASSERT_FALSE(recorded.empty());
  EXPECT_EQ(IntField(recorded.back(), "checkpoint"), newest_complete)
      << "the newest complete checkpoint is the last the coordinator recorded";

  LocalRun resumed("ck_fault_resumed", Job(layout, ck), {"--resume=" + root});
  resumed.Start();
  ASSERT_EQ(resumed.Finish(), 0) << resumed.Log();
  const std::string coordinator_log = ReadAll(resumed.out() + "/logs/coordinator.log");
  EXPECT_NE(coordinator_log.find(absl::StrFormat("step-%08d (step %d)", newest_complete, newest_complete)),
            std::string::npos)
      << coordinator_log;
  const std::vector<std::string> all = LossTexts(reference.out()), tail = LossTexts(resumed.out());
  ASSERT_EQ(all.size(), 60u);
  EXPECT_EQ(tail, std::vector<std::string>(all.begin() + newest_complete, all.end()));
  auto wa = checkpoint::LoadFullWeights(reference.out() + "/final");
  auto wb = checkpoint::LoadFullWeights(resumed.out() + "/final");
  ASSERT_TRUE(wa.ok() && wb.ok()) << wa.status() << " " << wb.status();
  auto diff = checkpoint::CompareWeights(*wa, *wb);
  ASSERT_TRUE(diff.ok()) << diff.status();
  EXPECT_EQ(diff->max_abs_diff, 0.0) << "the resumed run's final weights differ from the uninterrupted run's";
}

// kill -9 of the worker at (stage, tp, dp) at a seeded step, a seeded number
// of milliseconds after `batonctl local` saw it commit: a point inside a later
// step (forward, backward, optimizer or the all-reduce; which one depends on
// timing, the schedule itself is fixed by the seed).
void KillAtSeededPoint(const std::string& name, const Layout& layout, int stage, int tp, int dp, uint32_t salt,
                       int cp = -1) {
  std::mt19937 rng(kScheduleSeed + salt);
  const int step = std::uniform_int_distribution<int>(8, 25)(rng);
  const int after_ms = std::uniform_int_distribution<int>(0, 40)(rng);
  const std::string inject = absl::StrFormat("--inject=kill:stage=%d,tp=%d,dp=%d%s@step=%d,after_ms=%d", stage, tp, dp,
                                             cp < 0 ? "" : absl::StrCat(",cp=", cp), step, after_ms);
  std::cerr << name << ": " << inject << "\n";
  const LocalRun& reference = Reference(layout);
  LocalRun run(name, Job(layout), {"--spares=1", inject});
  run.Start();
  run.WaitForStep(3);
  const std::string victim = run.WorkerAt(stage, tp, dp, cp);
  ASSERT_FALSE(victim.empty()) << run.Log();
  const std::map<std::string, pid_t> before = PlanPids(run);
  run.WaitForRecoveries(1);
  EXPECT_NE(run.Log().find(absl::StrCat("injecting SIGKILL into ", victim)), std::string::npos) << run.Log();
  ExpectSurvivorsKept(run, before, {victim});
  ASSERT_EQ(run.Finish(), 0) << run.Log();
  ExpectBitwiseEqual(reference, run);
  ExpectSurvivorsRolledBackFromMemory(run, before, {victim});
  const std::vector<JsonValue> recoveries = StepsLines(run.out(), "recovery");
  ASSERT_EQ(recoveries.size(), 1u);
  EXPECT_EQ(recoveries[0].Find("worker")->str(), victim);
  EXPECT_EQ(recoveries[0].Find("cause")->str(), "worker_lost");
}

Layout Pp3Tp2(const std::string& schedule, int v) {
  Layout l;
  l.pp = 3;
  l.tp = 2;
  l.v = v;
  l.microbatches = 6;  // interleaved: a multiple of pp
  l.schedule = schedule;
  l.steps = 60;
  return l;
}

Layout Pp2Tp2Dp2(const std::string& schedule, int v) {
  Layout l = Pp3Tp2(schedule, v);
  l.pp = 2;
  l.dp = 2;
  return l;
}

TEST(FaultScheduleTest, TensorParallelRankOfTheMiddleStagePp3Tp2OneFOneB) {
  KillAtSeededPoint("pp3tp2_1f1b_tp", Pp3Tp2("1f1b", 1), 1, 1, 0, 1);
}

TEST(FaultScheduleTest, TensorParallelRankOfTheLastStagePp3Tp2Interleaved) {
  KillAtSeededPoint("pp3tp2_interleaved_tp", Pp3Tp2("interleaved", 2), 2, 0, 0, 2);
}

TEST(FaultScheduleTest, DataParallelRankPp2Tp2Dp2Interleaved) {
  KillAtSeededPoint("pp2tp2dp2_interleaved_dp", Pp2Tp2Dp2("interleaved", 3), 1, 0, 1, 3);
}

TEST(FaultScheduleTest, DataParallelReplicaZeroPp2Tp2Dp2OneFOneB) {
  KillAtSeededPoint("pp2tp2dp2_1f1b_dp0", Pp2Tp2Dp2("1f1b", 1), 0, 1, 0, 4);
}

// Under ZeRO-1 the killed rank's moment shard exists only in its buddy's
// snapshot (no DP replica holds it); three chunks per rank, so the
// reduce-scatter and the all-gather run per chunk, and grad_clip uses the
// norm summed over the shards.
TEST(FaultScheduleTest, DataParallelRankUnderZeroStage1Pp2Tp2Dp2Interleaved) {
  Layout l = Pp2Tp2Dp2("interleaved", 3);
  l.parallel_extra = "zero_stage: 1";
  l.extra_name = "_zero1";
  KillAtSeededPoint("pp2tp2dp2_interleaved_zero1_dp", l, 1, 1, 1, 5);
}

// Under sequence parallelism a TP rank holds its rows of the residual
// stream and its share of the norm weights' gradient sum: the replacement
// (from the buddy snapshot) must rejoin both, on the first stage, where the
// embedding is scattered.
TEST(FaultScheduleTest, TensorParallelRankUnderSequenceParallelPp3Tp2Interleaved) {
  Layout l = Pp3Tp2("interleaved", 2);
  l.parallel_extra = "sequence_parallel: true";
  l.extra_name = "_sp";
  KillAtSeededPoint("pp3tp2_interleaved_sp_tp", l, 0, 1, 0, 6);
}

// Context parallelism: a cp rank of the first stage holds half of every
// sequence's activations and meets its peer in every attention; its
// replacement restores from the cp peer (without ZeRO the same state) and
// rejoins the ring, and the run ends bitwise equal to the fault-free one.
TEST(FaultScheduleTest, ContextParallelRankPp2Cp2OneFOneB) {
  Layout l;
  l.pp = 2;
  l.steps = 60;
  l.parallel_extra = "cp: 2";
  l.extra_name = "_cp2";
  KillAtSeededPoint("pp2cp2_1f1b_cp", l, 0, 0, 0, 7, /*cp=*/1);
}

// Under ZeRO-1 over the dp x cp group each cp rank holds its own shard of
// the moments: the lost one's exists only in its buddy's snapshot.
TEST(FaultScheduleTest, ContextParallelRankUnderZeroStage1Pp2Cp2Interleaved) {
  Layout l;
  l.pp = 2;
  l.v = 2;
  l.schedule = "interleaved";
  l.steps = 60;
  l.parallel_extra = "cp: 2 zero_stage: 1";
  l.extra_name = "_cp2_zero1";
  KillAtSeededPoint("pp2cp2_interleaved_zero1_cp", l, 1, 0, 0, 8, /*cp=*/0);
}

// Mixture of Experts under ZeRO-1: the killed rank holds its TP share of
// every expert of its blocks and its shard of their moments (only in its
// buddy's snapshot); routing depends on the replayed microbatches alone, so
// the run ends bitwise equal to the fault-free one.
TEST(FaultScheduleTest, ExpertHoldingRankUnderMoeAndZeroStage1Pp2Tp2Dp2OneFOneB) {
  Layout l = Pp2Tp2Dp2("1f1b", 1);
  l.model_extra = "moe { experts: 4 top_k: 2 capacity_factor: 1.25 }";
  l.parallel_extra = "zero_stage: 1";
  l.extra_name = "_moe_zero1";
  KillAtSeededPoint("pp2tp2dp2_1f1b_moe_zero1", l, 1, 1, 1, 9);
}

// Expert parallelism (dp 4 in two expert groups of ep 2): the killed rank
// holds experts 2 and 3 of every MoE block; only DP rank 3 holds the same
// experts (the same slot), so recovery takes its state from that replica or
// the buddy's snapshot, never from a replica holding other experts. The run
// ends bitwise equal to the fault-free one.
TEST(FaultScheduleTest, ExpertParallelRankPp2Dp4Ep2OneFOneB) {
  Layout l = Pp2Tp2Dp2("1f1b", 1);
  l.tp = 1;
  l.dp = 4;
  l.model_extra = "moe { experts: 4 top_k: 2 capacity_factor: 1.25 }";
  l.parallel_extra = "ep: 2";
  l.extra_name = "_moe_ep2";
  KillAtSeededPoint("pp2dp4_1f1b_moe_ep2", l, 1, 0, 1, 10);
}

}  // namespace
}  // namespace baton
