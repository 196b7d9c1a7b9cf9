#include "coordinator/schedule/ir.h"

#include <algorithm>

#include "coordinator/schedule/builders.h"
#include "coordinator/schedule/lowering.h"
#include "coordinator/schedule/test_util.h"
#include "gtest/gtest.h"

namespace baton::schedule {
namespace {

Schedule LoweredInterleaved() {
  auto built = BuildSchedule({"interleaved", 2, 4, 2});
  EXPECT_TRUE(built.ok()) << built.status();
  auto lowered = Lower(*built);
  EXPECT_TRUE(lowered.ok()) << lowered.status();
  return *lowered;
}

TEST(Ir, ActionNames) {
  EXPECT_EQ(ActionToString(F(1, 3)), "F(1,3)");
  EXPECT_EQ(ActionToString(SendF(1, 3, 2)), "SEND_F(1,3)->2");
  EXPECT_EQ(ActionToString(RecvB(0, 3, 1)), "RECV_B(0,3)<-1");
  EXPECT_EQ(ActionToString(Action{ActionKind::kReduceGrads, 0, 0, 0}), "REDUCE_GRADS");
  EXPECT_EQ(CellLabel(F(5, 3), 1), "F3");
  EXPECT_EQ(CellLabel(F(5, 3), 2), "5F3");
}

TEST(Ir, ProgramsRoundTripInAnyOrder) {
  const Schedule s = LoweredInterleaved();
  std::vector<v1::Program> programs = ToPrograms(s);
  ASSERT_EQ(programs.size(), 2u);
  EXPECT_EQ(programs[1].rank(), 1);
  EXPECT_EQ(programs[1].num_stages(), 4);
  EXPECT_EQ(programs[1].schedule(), "interleaved");
  std::reverse(programs.begin(), programs.end());
  auto back = FromPrograms(programs);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, s);
}

TEST(Ir, JsonRoundTrip) {
  const Schedule s = LoweredInterleaved();
  const std::string json = ToProgramsJson(s);
  EXPECT_NE(json.find("\"kind\":\"SEND_F\""), std::string::npos) << json;
  auto back = FromProgramsJson(json);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, s);
}

TEST(Ir, RejectsInconsistentPrograms) {
  std::vector<v1::Program> programs = ToPrograms(LoweredInterleaved());
  std::vector<v1::Program> one = {programs[0]};
  EXPECT_NE(FromPrograms(one).status().message().find("exactly one program per rank"),
            std::string::npos);
  programs[1].set_rank(0);
  EXPECT_NE(FromPrograms(programs).status().message().find("out of range or repeated"),
            std::string::npos);
  programs[1].set_rank(1);
  programs[1].set_microbatches(5);
  EXPECT_NE(FromPrograms(programs).status().message().find("disagrees"), std::string::npos);
  EXPECT_EQ(FromProgramsJson("{not json").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Ir, ComputeOnlyDropsCommunication) {
  const Schedule s = LoweredInterleaved();
  ASSERT_TRUE(HasCommunication(s));
  const Schedule c = ComputeOnly(s);
  EXPECT_FALSE(HasCommunication(c));
  EXPECT_EQ(c.ranks[0].size(), 16u);
  EXPECT_EQ(c.ranks[0].back(), B(0, 3));
}

}  // namespace
}  // namespace baton::schedule
