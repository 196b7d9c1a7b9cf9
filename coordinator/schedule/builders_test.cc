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
  auto unknown = BuildSchedule({"zb-w", 4, 8, 1});
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.status().message().find("gpipe, 1f1b, interleaved, zb-h1, zb-v, dualpipe-v"), std::string::npos);

  auto odd_v = BuildSchedule({"zb-v", 4, 8, 3});
  EXPECT_EQ(odd_v.status().message(),
            "zb-v places two chunks on every rank in a V; use virtual stages 2 (got 3: a V needs an even chunk count)");
  auto one_chunk = BuildSchedule({"dualpipe-v", 4, 8, 1});
  EXPECT_EQ(one_chunk.status().message(), "dualpipe-v places two chunks on every rank in a V; use virtual stages 2 (got 1: a V needs an even chunk count)");
  auto few_dualpipe = BuildSchedule({"dualpipe-v", 4, 7, 2});
  EXPECT_EQ(few_dualpipe.status().message(),
            "dualpipe-v needs at least 2 x the pipeline size = 8 microbatches (got 7); use 8 microbatches or more");

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
  EXPECT_EQ(ActivationBound("zb-v", 4, 8, 2, 3), 8);
  EXPECT_EQ(ActivationBound("dualpipe-v", 4, 8, 2, 0), 9);
}

TEST(Builders, VShapedKindsPlaceTwoChunksInAV) {
  EXPECT_EQ(VPlacement(4, 2), (std::vector<int>{0, 1, 2, 3, 3, 2, 1, 0}));
  EXPECT_EQ(VPlacement(2, 4), (std::vector<int>{0, 1, 1, 0, 0, 1, 1, 0}));
  EXPECT_EQ(PlacementOf("zb-v", 3, 2), VPlacement(3, 2));
  EXPECT_EQ(PlacementOf("dualpipe-v", 3, 2), VPlacement(3, 2));
  EXPECT_TRUE(PlacementOf("interleaved", 3, 2).empty());
  Schedule s = BuildOk({"zb-v", 2, 3, 2});
  EXPECT_EQ(s.stage_ranks, (std::vector<int>{0, 1, 1, 0}));
  EXPECT_EQ(StagesOfRank(s.stage_ranks, 2, 4, 0), (std::vector<int>{0, 3}));
  // Rank 1 holds chunks 1 and 2, the tip of the V: 2F0 follows 1F0 on the
  // same rank, and the first backward (of the last chunk, 3) is on rank 0.
  EXPECT_EQ(Labels(s, 0), "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 3F2 3I2 3W2 0I1 0W1 0I2 0W2");
  EXPECT_EQ(Labels(s, 1), "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1I1 2I2 1I2 1W1 2W2 1W2");
}

// The DualPipe-V test artifact of PyTorch (test/distributed/pipelining/
// artifacts/dualpipev_4rank_10mb.csv, rank 0's row): our builder writes the
// same order, overlapped pairs included.
TEST(Builders, DualPipeVMatchesPytorchsOrder) {
  Schedule s = BuildOk({"dualpipe-v", 4, 10, 2});
  EXPECT_EQ(Labels(s, 0),
            "0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7I0 7W0 7F1 7I1 7W1 7F2 7I2 7W2 7F3 0F7& 7B3 7F4& 0B0 0F8& 7B4 "
            "7F5& 0B1 0F9& 7B5 7F6& 0B2 7B6 7F7& 0B3 7B7 7F8& 0B4 7B8 7F9& 0B5 7B9 0I6 0W6 0I7 0W7 0I8 0W8 "
            "0I9 0W9");
  EXPECT_EQ(Labels(s, 3),
            "3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 3F4 4B0 4F4& 3B0 3F5& 4B1 4F5& 3B1 3F6& 4B2 4F6& 3B2 3F7& 4B3 "
            "4F7& 3B3 3F8& 4B4 4F8& 3B4 3F9& 4B5 4F9& 3B5 4B6 3B6 4B7 3B7 4I8 3I8 4I9 3I9 4W8 3W8 4W9 3W9");
}

}  // namespace
}  // namespace baton::schedule
