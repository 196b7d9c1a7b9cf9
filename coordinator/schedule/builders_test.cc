#include "coordinator/schedule/builders.h"

#include "coordinator/schedule/test_util.h"
#include "gtest/gtest.h"

namespace baton::schedule {
namespace {

Schedule BuildOk(const ScheduleSpec& spec) {
  auto s = BuildSchedule(spec);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *s : Schedule();
}

TEST(Builders, GpipeRunsAllForwardsThenAllBackwards) {
  Schedule s = BuildOk({"gpipe", 2, 3, 1});
  EXPECT_EQ(Labels(s, 0), "F0 F1 F2 B0 B1 B2");
  EXPECT_EQ(Labels(s, 1), "F0 F1 F2 B0 B1 B2");
}

TEST(Builders, OneFOneBWarmsUpThenAlternates) {
  Schedule s = BuildOk({"1f1b", 4, 8, 1});
  EXPECT_EQ(Labels(s, 0), "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7");
  EXPECT_EQ(Labels(s, 3), "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7");
  // Fewer microbatches than ranks: warm-up is capped by m.
  EXPECT_EQ(Labels(BuildOk({"1f1b", 4, 2, 1}), 0), "F0 F1 B0 B1");
}

TEST(Builders, InterleavedFollowsMegatronOrder) {
  Schedule s = BuildOk({"interleaved", 2, 4, 2});
  EXPECT_EQ(s.num_stages(), 4);
  // Rank 0 holds stages 0 and 2; warm-up (2-0-1)*2 + (2-1)*2 = 4 chunk-forwards.
  EXPECT_EQ(Labels(s, 0), "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3");
  // Rank 1 (stages 1 and 3): warm-up 2.
  EXPECT_EQ(Labels(s, 1), "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3");
}

TEST(Builders, ZeroBubbleH1DefersWeightGradientsByRank) {
  Schedule s = BuildOk({"zb-h1", 2, 3, 1});
  EXPECT_EQ(Labels(s, 0), "F0 F1 I0 W0 F2 I1 W1 I2 W2");
  EXPECT_EQ(Labels(s, 1), "F0 I0 F1 I1 W0 F2 I2 W1 W2");
}

TEST(Builders, RejectsBadSpecsWithWhatToChange) {
  auto unknown = BuildSchedule({"zb-v", 4, 8, 1});
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.status().message().find("gpipe, 1f1b, interleaved, zb-h1"), std::string::npos);

  auto no_ranks = BuildSchedule({"1f1b", 0, 8, 1});
  EXPECT_NE(no_ranks.status().message().find("at least 1 (got 0)"), std::string::npos);

  auto no_mb = BuildSchedule({"gpipe", 2, 0, 1});
  EXPECT_NE(no_mb.status().message().find("microbatches must be at least 1"), std::string::npos);

  auto virtual_1f1b = BuildSchedule({"1f1b", 4, 8, 2});
  EXPECT_NE(virtual_1f1b.status().message().find("choose interleaved"), std::string::npos);

  auto few = BuildSchedule({"interleaved", 4, 6, 2});
  EXPECT_EQ(few.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(few.status().message().find("use 8 microbatches"), std::string::npos) << few.status();
}

TEST(Builders, ActivationBounds) {
  EXPECT_EQ(ActivationBound("1f1b", 4, 8, 1, 0), 4);
  EXPECT_EQ(ActivationBound("1f1b", 4, 8, 1, 3), 1);
  EXPECT_EQ(ActivationBound("1f1b", 4, 2, 1, 0), 2);
  EXPECT_EQ(ActivationBound("zb-h1", 4, 8, 1, 3), 4);
  EXPECT_EQ(ActivationBound("gpipe", 4, 8, 1, 3), 8);
  EXPECT_EQ(ActivationBound("interleaved", 4, 8, 2, 0), 11);  // warm-up 10, + 1
  EXPECT_EQ(ActivationBound("", 4, 8, 2, 0), 16);
}

}  // namespace
}  // namespace baton::schedule
