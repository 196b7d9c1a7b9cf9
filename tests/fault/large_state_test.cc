// Recovery of shard states far over gRPC's 4 MiB message limit, with real
// daemons on loopback (batonctl local): a d_model 256 GPT whose one stage
// holds ~3.2M parameters (a ~38 MB state with the AdamW moments) trains on
// DP 2; one DP rank is killed mid-training and a spare takes its place with
//   - its DP replica's state (FetchState -> fetched_state -> Configure.state),
//   - under ZeRO-1 (the moments sharded, so no replica has them) its buddy's
//     relayed snapshot (snapshot -> hold_snapshot -> fetched_state -> state).
// Each of those messages crosses the Session stream as fragments
// (docs/protocol.md, "Fragments"); the run must end with the fault-free
// run's losses and final weights, bit for bit.
#include <signal.h>
#include <sys/types.h>

#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "tests/fault/harness.h"
#include "tests/testing/process.h"

namespace baton {
namespace {

using fault::ExpectBitwiseEqual;
using fault::LocalRun;

// 4 layers of d_model 256: 4 * 12 * 256^2 = 3.1M parameters in the one stage.
std::string BigJob(const std::string& parallel_extra) {
  return absl::StrFormat(R"pb(
    name: "fault"
    model { layers: 4 d_model: 256 heads: 4 vocab: 16 seq_len: 16 }
    parallel { pp: 1 tp: 1 dp: 2 %s }
    schedule { kind: "1f1b" microbatches: 2 }
    train { steps: 40 micro_batch_size: 1 lr: 0.003 weight_decay: 0.01 grad_clip: 1.0 seed: 11 }
    data { synthetic { task: "addition" } }
  )pb",
                         parallel_extra);
}

void KillADataParallelRank(const std::string& name, const std::string& parallel_extra) {
  LocalRun reference("reference_" + name, BigJob(parallel_extra));
  reference.Start();
  ASSERT_EQ(reference.Finish(), 0) << reference.Log();

  LocalRun run(name, BigJob(parallel_extra), {"--spares=1"});
  run.Start();
  run.WaitForStep(6);
  const std::string victim = run.WorkerAt(0, 0, 1);
  ASSERT_FALSE(victim.empty()) << run.Log();
  std::map<std::string, pid_t> survivors;
  for (const std::string& w : run.PlanWorkers()) {
    if (w != victim) survivors[w] = run.Pid(w);
  }
  const pid_t victim_pid = run.Pid(victim);
  ASSERT_GT(victim_pid, 0);
  kill(victim_pid, SIGKILL);
  run.WaitForRecoveries(1);
  ASSERT_EQ(run.Finish(), 0) << run.Log();
  ExpectBitwiseEqual(reference, run);
  // Exactly one recovery: no survivor's session broke on a big message.
  EXPECT_NE(run.Log().find("recoveries               1"), std::string::npos) << run.Log();
  // Nothing was lost: the replacement took a copy, no one restarted from the seed.
  EXPECT_EQ(run.Log().find("from the initial state"), std::string::npos) << run.Log();
  EXPECT_NE(run.Log().find(parallel_extra.empty() ? "from DP replica" : "'s snapshot"), std::string::npos)
      << run.Log();
  for (const auto& [w, pid] : survivors) {
    EXPECT_NE(run.WorkerLog(w).find("from its own snapshot"), std::string::npos)
        << w << " did not roll back from its own memory:\n"
        << run.WorkerLog(w);
  }
}

TEST(LargeStateRecoveryTest, AKilledDataParallelRankTakesItsReplicasStateOverFourMiB) {
  KillADataParallelRank("big_kill_dp", "");
}

TEST(LargeStateRecoveryTest, AKilledDataParallelRankUnderZeroStage1IsRestoredFromItsBuddyOverFourMiB) {
  KillADataParallelRank("big_kill_zero1", "zero_stage: 1");
}

}  // namespace
}  // namespace baton
