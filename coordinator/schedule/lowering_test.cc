#include "coordinator/schedule/lowering.h"

#include "coordinator/schedule/builders.h"
#include "coordinator/schedule/test_util.h"
#include "coordinator/schedule/validator.h"
#include "gtest/gtest.h"

namespace baton::schedule {
namespace {

Schedule Built(const ScheduleSpec& spec) {
  auto s = BuildSchedule(spec);
  EXPECT_TRUE(s.ok()) << s.status();
  return *s;
}

TEST(Lowering, GpipeTwoRanks) {
  auto lowered = Lower(Built({"gpipe", 2, 2, 1}));
  ASSERT_TRUE(lowered.ok()) << lowered.status();
  EXPECT_EQ(Actions(*lowered, 0),
            "F(0,0) SEND_F(0,0)->1 F(0,1) SEND_F(0,1)->1 RECV_B(0,0)<-1 B(0,0) "
            "RECV_B(0,1)<-1 B(0,1) REDUCE_GRADS OPTIMIZER_STEP");
  EXPECT_EQ(Actions(*lowered, 1),
            "RECV_F(1,0)<-0 F(1,0) RECV_F(1,1)<-0 F(1,1) B(1,0) SEND_B(1,0)->0 B(1,1) "
            "SEND_B(1,1)->0 REDUCE_GRADS OPTIMIZER_STEP");
}

TEST(Lowering, SingleRankNeedsNoMessages) {
  auto lowered = Lower(Built({"interleaved", 1, 2, 2}));
  ASSERT_TRUE(lowered.ok()) << lowered.status();
  EXPECT_FALSE(HasCommunication(*lowered));
  // Groups of p = 1 microbatch: warm-up of one chunk-forward, then 1F1B over
  // the chunks.
  EXPECT_EQ(Actions(*lowered, 0),
            "F(0,0) F(1,0) B(1,0) F(0,1) B(0,0) F(1,1) B(1,1) B(0,1) REDUCE_GRADS "
            "OPTIMIZER_STEP");
}

// In the 1F1B steady state a send and the receive from the same peer in the
// other direction share a batch (one round trip).
TEST(Lowering, PairsSteadyStateSendsWithReceives) {
  const int p = 4, m = 8;
  auto lowered = Lower(Built({"1f1b", p, m, 1}));
  ASSERT_TRUE(lowered.ok()) << lowered.status();
  const auto& program = lowered->ranks[1];
  int paired = 0;
  for (size_t i = 0; i + 1 < program.size(); ++i) {
    const Action& a = program[i];
    const Action& b = program[i + 1];
    const bool send_then_recv = a.kind == ActionKind::kSendF && b.kind == ActionKind::kRecvB;
    const bool recv_then_send = a.kind == ActionKind::kRecvB && b.kind == ActionKind::kSendF;
    if ((send_then_recv || recv_then_send) && a.peer == 2 && b.peer == 2) ++paired;
  }
  // Rank 1 runs m - (p - 2) steady F/B pairs; each but the first pairs up.
  EXPECT_GE(paired, m - (p - 2) - 1) << Actions(*lowered, 1);
}

TEST(Lowering, AnyCostModelGivesAValidProgram) {
  CostModel uneven;
  uneven.forward = 1.3;
  uneven.backward_input = 0.7;
  uneven.backward_weight = 2.1;
  uneven.comm_latency = 0.4;
  for (const ScheduleSpec& spec :
       {ScheduleSpec{"gpipe", 5, 7, 1}, ScheduleSpec{"1f1b", 5, 7, 1},
        ScheduleSpec{"zb-h1", 5, 7, 1}, ScheduleSpec{"interleaved", 3, 6, 2}}) {
    SCOPED_TRACE(spec.kind);
    CostModel costs = uneven;
    for (int st = 0; st < spec.num_ranks * spec.virtual_stages; ++st) {
      costs.stage_multipliers.push_back(1 + 0.37 * ((st * 7) % 5));
    }
    costs.backward_weight = spec.kind == "zb-h1" ? 0 : uneven.backward_weight;  // a zero cost
    auto lowered = Lower(Built(spec), costs);
    ASSERT_TRUE(lowered.ok()) << lowered.status();
    EXPECT_TRUE(Validate(*lowered).ok()) << Validate(*lowered);
  }
}

TEST(Lowering, RejectsLoweredInputAndDeadlocks) {
  auto lowered = Lower(Built({"1f1b", 2, 2, 1}));
  ASSERT_TRUE(lowered.ok());
  EXPECT_EQ(Lower(*lowered).status().code(), absl::StatusCode::kInvalidArgument);

  // Rank 1 runs microbatch 1 before 0 while rank 0 waits for B(1,0) before
  // F(0,1): a cycle.
  Schedule cyclic =
      Make("", 2, 2, {{F(0, 0), B(0, 0), F(0, 1), B(0, 1)}, {F(1, 1), B(1, 1), F(1, 0), B(1, 0)}});
  auto status = Lower(cyclic).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(status.message().find("cannot lower: deadlock"), std::string::npos) << status;
}

}  // namespace
}  // namespace baton::schedule
