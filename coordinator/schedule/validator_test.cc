#include "coordinator/schedule/validator.h"

#include <utility>

#include "coordinator/schedule/builders.h"
#include "coordinator/schedule/lowering.h"
#include "coordinator/schedule/test_util.h"
#include "gtest/gtest.h"

namespace baton::schedule {
namespace {

Schedule Lowered(const ScheduleSpec& spec) {
  auto built = BuildSchedule(spec);
  EXPECT_TRUE(built.ok()) << built.status();
  auto lowered = Lower(*built);
  EXPECT_TRUE(lowered.ok()) << lowered.status();
  return *lowered;
}

// The first violation's message; fails the test when there is none.
std::string ViolationOf(const Schedule& s) {
  std::optional<Violation> v = FindViolation(s);
  EXPECT_TRUE(v.has_value()) << "schedule unexpectedly valid";
  return v ? v->message : "";
}

int IndexOf(const Schedule& s, int rank, const Action& a) {
  for (size_t i = 0; i < s.ranks[rank].size(); ++i) {
    if (s.ranks[rank][i] == a) return static_cast<int>(i);
  }
  ADD_FAILURE() << ActionToString(a) << " not on rank " << rank;
  return 0;
}

TEST(Validator, MissingWeightBackwardIsNamedAndMarked) {
  Schedule s = Lowered({"zb-h1", 2, 2, 1});
  auto& program = s.ranks[1];
  program.erase(program.begin() + IndexOf(s, 1, {ActionKind::kBackwardWeight, 1, 1, 0}));
  EXPECT_EQ(ViolationOf(s),
            "missing W(1,1): I(1,1) on rank 1 (action " +
                std::to_string(IndexOf(s, 1, {ActionKind::kBackwardInput, 1, 1, 0})) +
                ") has no weight backward");
  const absl::Status status = Validate(s);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  // The grid follows the message, with the I that lacks its W marked.
  EXPECT_NE(status.message().find("\nrank 0 | F0  F1  I0  W0  I1  W1\n"
                                  "rank 1 | F0  I0  F1 [I1] W0\n"),
            std::string::npos)
      << status;
}

TEST(Validator, SwappedReceivesLeaveAConsumerWithoutInput) {
  Schedule s = Lowered({"gpipe", 2, 2, 1});
  const int a = IndexOf(s, 1, RecvF(1, 0, 0)), b = IndexOf(s, 1, RecvF(1, 1, 0));
  std::swap(s.ranks[1][a], s.ranks[1][b]);
  EXPECT_EQ(ViolationOf(s),
            "F(1,0) on rank 1 (action 1) runs before its input arrives: "
            "RECV_F(1,0)<-0 on rank 1 (action 2) comes after it");
  EXPECT_NE(Validate(s).message().find("rank 1 |[F0] F1  B0  B1"), std::string::npos)
      << Validate(s);
}

// Both receives before both consumers, in the wrong order: NCCL would hand
// microbatch 0's activations to the receive for microbatch 1.
TEST(Validator, ReceivesOutOfSendOrderAreRejected) {
  auto program = [](Action first, Action second) {
    return Make(
        "gpipe", 2, 2,
        {{F(0, 0), SendF(0, 0, 1), F(0, 1), SendF(0, 1, 1), RecvB(0, 0, 1), B(0, 0), RecvB(0, 1, 1),
          B(0, 1)},
         {first, second, F(1, 0), F(1, 1), B(1, 0), SendB(1, 0, 0), B(1, 1), SendB(1, 1, 0)}});
  };
  EXPECT_FALSE(FindViolation(program(RecvF(1, 0, 0), RecvF(1, 1, 0))).has_value());
  EXPECT_EQ(ViolationOf(program(RecvF(1, 1, 0), RecvF(1, 0, 0))),
            "rank 1 receives from rank 0 in a different order than it sends: receive #1 is "
            "RECV_F(1,1)<-0 (action 0) but send #1 is SEND_F(0,0)->1 (action 1); messages "
            "between two ranks match in posting order");
}

TEST(Validator, ReceiveBatchedTooEarlyDeadlocks) {
  // Rank 1 posts RECV_B(1,0) together with RECV_F(1,1), before it has sent
  // F(1,0) to rank 2, which needs that forward to produce the gradient.
  Schedule s =
      Make("", 3, 2,
           {{F(0, 0), SendF(0, 0, 1), F(0, 1), SendF(0, 1, 1), RecvB(0, 0, 1), B(0, 0),
             RecvB(0, 1, 1), B(0, 1)},
            {RecvF(1, 0, 0), F(1, 0), RecvB(1, 0, 2), RecvF(1, 1, 0), F(1, 1), SendF(1, 0, 2),
             SendF(1, 1, 2), B(1, 0), SendB(1, 0, 0), RecvB(1, 1, 2), B(1, 1), SendB(1, 1, 0)},
            {RecvF(2, 0, 1), F(2, 0), B(2, 0), SendB(2, 0, 1), RecvF(2, 1, 1), F(2, 1), B(2, 1),
             SendB(2, 1, 1)}});
  EXPECT_EQ(ViolationOf(s),
            "deadlock: rank 0 is stuck at RECV_B(0,0)<-1 (action 4) waiting for rank 1 to post "
            "SEND_B(1,0)->0; rank 1 is stuck at RECV_B(1,0)<-2 (action 2) waiting for rank 2 "
            "to post SEND_B(2,0)->1; rank 2 is stuck at RECV_F(2,0)<-1 (action 0) waiting for "
            "rank 1 to post SEND_F(1,0)->2");
  // Rank 0 is marked at the compute action after its stuck receive.
  EXPECT_NE(Validate(s).message().find("rank 0 | F0  F1 [B0] B1"), std::string::npos)
      << Validate(s);
}

TEST(Validator, CrossRankCycleInComputeOrderDeadlocks) {
  Schedule s =
      Make("", 2, 2, {{F(0, 0), B(0, 0), F(0, 1), B(0, 1)}, {F(1, 1), B(1, 1), F(1, 0), B(1, 0)}});
  EXPECT_EQ(ViolationOf(s),
            "deadlock: rank 0 is stuck at B(0,0) (action 1) waiting for B/I(1,0) on rank 1; "
            "rank 1 is stuck at F(1,1) (action 0) waiting for F(0,1) on rank 0");
}

TEST(Validator, ShapeViolations) {
  Schedule wrong_rank = Make("", 2, 1, {{F(0, 0), F(1, 0), B(1, 0), B(0, 0)}, {}});
  EXPECT_EQ(
      ViolationOf(wrong_rank),
      "F(1,0) on rank 0 (action 1) is on the wrong rank: stage 1 lives on rank 1 (looped placement)");

  Schedule s = Lowered({"1f1b", 2, 1, 1});
  s.ranks[0][1].peer = 0;  // SEND_F(0,0) to itself
  EXPECT_EQ(ViolationOf(s),
            "SEND_F(0,0)->0 on rank 0 (action 1) names peer 0, but stage 1 lives on rank 1");

  Schedule dup = Make("", 1, 1, {{F(0, 0), F(0, 0), B(0, 0)}});
  EXPECT_EQ(ViolationOf(dup),
            "duplicate F(0,0) on rank 0 (actions 0 and 1); each must appear exactly once");

  Schedule late = Make("", 1, 1, {{F(0, 0), {ActionKind::kReduceGrads, 0, 0, 0}, B(0, 0)}});
  EXPECT_EQ(ViolationOf(late),
            "B(0,0) on rank 0 (action 2) comes after "
            "REDUCE_GRADS/OPTIMIZER_STEP; those must end the program");
}

TEST(Validator, OrderOnARank) {
  Schedule backward_first = Make("", 1, 1, {{B(0, 0), F(0, 0)}});
  EXPECT_EQ(ViolationOf(backward_first),
            "B(0,0) on rank 0 (action 0) comes before its forward F(0,0) on rank 0 (action 1)");
  Schedule w_first = Make(
      "", 1, 1,
      {{F(0, 0), {ActionKind::kBackwardWeight, 0, 0, 0}, {ActionKind::kBackwardInput, 0, 0, 0}}});
  EXPECT_EQ(ViolationOf(w_first),
            "W(0,0) on rank 0 (action 1) comes before I(0,0) on rank 0 "
            "(action 2); I must precede W");
  // One rank holding stages 0 and 1 must run F(0,.) before F(1,.).
  Schedule chunks = Make("", 1, 1, {{F(1, 0), F(0, 0), B(1, 0), B(0, 0)}});
  chunks.virtual_stages = 2;
  EXPECT_EQ(ViolationOf(chunks),
            "F(1,0) on rank 0 (action 0) comes before the upstream F(0,0) "
            "on rank 0 (action 1) that feeds it");
}

TEST(Validator, LoweredScheduleNeedsEveryMessage) {
  Schedule s = Lowered({"gpipe", 2, 1, 1});
  auto& program = s.ranks[0];
  program.erase(program.begin() + IndexOf(s, 0, SendF(0, 0, 1)));
  EXPECT_EQ(ViolationOf(s),
            "F(0,0) on rank 0 (action 0) has no SEND_F(0,0) after it; rank 1 "
            "needs its output");
}

TEST(Validator, ActivationBoundOfTheScheduleKind) {
  auto gpipe = BuildSchedule({"gpipe", 4, 8, 1});
  ASSERT_TRUE(gpipe.ok());
  EXPECT_FALSE(FindViolation(*gpipe).has_value());
  Schedule relabeled = *gpipe;
  relabeled.kind = "1f1b";
  EXPECT_EQ(ViolationOf(relabeled),
            "rank 0 stores 5 activations after F(0,4) (action 4), above "
            "the bound of 4 for 1f1b schedules on rank 0");
}

TEST(Validator, LargeGridIsCutAroundTheMark) {
  auto built = BuildSchedule({"1f1b", 32, 128, 1});
  ASSERT_TRUE(built.ok());
  built->ranks[20].pop_back();  // drop the last B on rank 20
  const std::string message(Validate(*built).message());
  EXPECT_NE(message.find("missing B(20,127)"), std::string::npos) << message;
  EXPECT_NE(message.find("(ranks 0..11 not shown)"), std::string::npos) << message;
  EXPECT_NE(message.find("rank 20 | ..."), std::string::npos) << message;
  EXPECT_LT(message.size(), 8000u);
}

}  // namespace
}  // namespace baton::schedule
