#include "coordinator/schedule/simulator.h"

#include "coordinator/schedule/builders.h"
#include "coordinator/schedule/lowering.h"
#include "coordinator/schedule/test_util.h"
#include "gtest/gtest.h"

namespace baton::schedule {
namespace {

Schedule Built(const ScheduleSpec& spec) {
  auto s = BuildSchedule(spec);
  EXPECT_TRUE(s.ok()) << s.status();
  return *s;
}

Schedule LoweredOf(const Schedule& s) {
  auto lowered = Lower(s);
  EXPECT_TRUE(lowered.ok()) << lowered.status();
  return *lowered;
}

TEST(Simulator, CommunicationCostDelaysTheConsumer) {
  // p=2, m=1: F0 [0,1] -> message 0.5 -> F1 [1.5,2.5], B1 [2.5,4.5] ->
  // message -> B0 [5,7].
  const Schedule s = Built({"gpipe", 2, 1, 1});
  CostModel latency;
  latency.comm_latency = 0.5;
  CostModel bandwidth;
  bandwidth.activation_bytes = 100;
  bandwidth.comm_bandwidth = 200;
  for (const CostModel& costs : {latency, bandwidth}) {
    for (bool blocking : {false, true}) {
      CostModel c = costs;
      c.blocking_sends = blocking;
      for (const Schedule& variant : {s, LoweredOf(s)}) {
        auto sim = Simulate(variant, c);
        ASSERT_TRUE(sim.ok()) << sim.status();
        EXPECT_DOUBLE_EQ(sim->makespan, 7);
        EXPECT_DOUBLE_EQ(sim->ranks[0].busy, 3);
        EXPECT_DOUBLE_EQ(sim->bubble_ratio, 1 - 6.0 / 14);
      }
    }
  }
}

TEST(Simulator, StageMultipliersMakeStagesUneven) {
  // Rank 1 is twice as slow: F [1,3],[3,5]; B (cost 4) [5,9],[9,13];
  // rank 0 B0 [9,11], B1 [13,15].
  CostModel costs;
  costs.stage_multipliers = {1, 2};
  auto sim = Simulate(Built({"gpipe", 2, 2, 1}), costs);
  ASSERT_TRUE(sim.ok()) << sim.status();
  EXPECT_DOUBLE_EQ(sim->makespan, 15);
  EXPECT_DOUBLE_EQ(sim->ranks[0].busy, 6);
  EXPECT_DOUBLE_EQ(sim->ranks[1].busy, 12);
  EXPECT_DOUBLE_EQ(sim->bubble_ratio, 1 - 18.0 / 30);
  EXPECT_DOUBLE_EQ(sim->ranks[0].bubble_ratio, 1 - 6.0 / 15);
  EXPECT_DOUBLE_EQ(sim->timings[0][3].start, 13);  // B(0,1)
}

TEST(Simulator, SplitBackwardCostsAndFullBackwardOverride) {
  CostModel costs;
  costs.forward = 1;
  costs.backward_input = 2;
  costs.backward_weight = 3;
  auto zb = Simulate(Built({"zb-h1", 1, 2, 1}), costs);
  ASSERT_TRUE(zb.ok());
  EXPECT_DOUBLE_EQ(zb->makespan, 12);  // 2 * (1 + 2 + 3)
  auto full = Simulate(Built({"1f1b", 1, 2, 1}), costs);
  EXPECT_DOUBLE_EQ(full->makespan, 12);  // B = I + W
  costs.backward = 1;
  full = Simulate(Built({"1f1b", 1, 2, 1}), costs);
  EXPECT_DOUBLE_EQ(full->makespan, 4);
}

TEST(Simulator, ChunksCostAFractionOfAStage) {
  // One rank, v = 2: four chunk-forwards and backwards of 1/2 the cost.
  auto sim = Simulate(Built({"interleaved", 1, 1, 2}), CostModel());
  ASSERT_TRUE(sim.ok());
  EXPECT_DOUBLE_EQ(sim->makespan, 3);
  EXPECT_DOUBLE_EQ(sim->bubble_ratio, 0);
}

TEST(Simulator, PeakActivationsFollowProgramOrder) {
  auto sim = Simulate(Built({"zb-h1", 4, 8, 1}), CostModel());
  ASSERT_TRUE(sim.ok());
  for (const RankStats& r : sim->ranks) EXPECT_EQ(r.peak_activations, 4) << r.rank;
  sim = Simulate(Built({"gpipe", 4, 8, 1}), CostModel());
  for (const RankStats& r : sim->ranks) EXPECT_EQ(r.peak_activations, 8) << r.rank;
}

TEST(Simulator, RejectsBadInput) {
  const Schedule s = Built({"1f1b", 2, 2, 1});
  CostModel negative;
  negative.backward_input = -1;
  EXPECT_EQ(Simulate(s, negative).status().message(),
            "backward_input cost must be a finite number >= 0 (got -1)");
  CostModel multipliers;
  multipliers.stage_multipliers = {1, 1, 1};
  EXPECT_EQ(Simulate(s, multipliers).status().message(),
            "got 3 stage multipliers for 2 stages; give one per stage");
  CostModel no_bandwidth;
  no_bandwidth.comm_bandwidth = 0;
  EXPECT_EQ(Simulate(s, no_bandwidth).status().code(), absl::StatusCode::kInvalidArgument);

  Schedule out_of_range = s;
  out_of_range.ranks[0][0].microbatch = 7;
  EXPECT_EQ(Simulate(out_of_range, CostModel()).status().code(),
            absl::StatusCode::kInvalidArgument);

  Schedule cyclic =
      Make("", 2, 2, {{F(0, 0), B(0, 0), F(0, 1), B(0, 1)}, {F(1, 1), B(1, 1), F(1, 0), B(1, 0)}});
  EXPECT_EQ(Simulate(cyclic, CostModel()).status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(FindDeadlock(cyclic).has_value());
  EXPECT_EQ(FindDeadlock(cyclic)->rank, 0);
  EXPECT_EQ(FindDeadlock(cyclic)->action, 1);
  EXPECT_FALSE(FindDeadlock(s).has_value());
}

}  // namespace
}  // namespace baton::schedule
