// Report group seats (common/report_group.h): the placement both the
// coordinator and the workers compute.
#include "common/report_group.h"

#include <map>
#include <set>

#include "gtest/gtest.h"

namespace baton {
namespace {

TEST(ReportGroupTest, OneColumnPerGroupIsThePipelineColumn) {
  // pp 4, tp 2, dp 2, one column per group: 4 groups of 4, led by pp rank 0.
  EXPECT_EQ(ReportGroupCount(2, 2, 1), 4);
  const ReportGroupSeat s = ReportGroupSeatOf(4, 2, 2, 1, /*pp*/ 3, /*tp*/ 1, /*dp*/ 1);
  EXPECT_EQ(s.group, 3);  // column 1 * 2 + 1
  EXPECT_EQ(s.rank, 3);
  EXPECT_EQ(s.size, 4);
  EXPECT_EQ(ReportGroupSeatOf(4, 2, 2, 0, 0, 1, 0).group, 1) << "0 columns counts as 1";
}

TEST(ReportGroupTest, GroupsOfSeveralColumnsAreConsecutiveInDpThenTpOrder) {
  // pp 2, tp 2, dp 3: 6 columns; 4 per group: groups of 8 and 4 ranks.
  EXPECT_EQ(ReportGroupCount(2, 3, 4), 2);
  EXPECT_EQ(ReportGroupSeatOf(2, 2, 3, 4, 0, 0, 0).rank, 0);
  const ReportGroupSeat third = ReportGroupSeatOf(2, 2, 3, 4, /*pp*/ 1, /*tp*/ 0, /*dp*/ 1);  // column 2
  EXPECT_EQ(third.group, 0);
  EXPECT_EQ(third.rank, 5);
  EXPECT_EQ(third.size, 8);
  const ReportGroupSeat last = ReportGroupSeatOf(2, 2, 3, 4, 1, 1, 2);  // column 5
  EXPECT_EQ(last.group, 1);
  EXPECT_EQ(last.rank, 3);
  EXPECT_EQ(last.size, 4) << "the last group has the columns left over";
}

TEST(ReportGroupTest, EverySeatIsTakenOnceAndMapsBack) {
  for (int pp : {1, 2, 3, 16}) {
    for (int columns : {1, 2, 5, 16}) {
      const int tp = 2, dp = 5;
      std::map<int, std::set<int>> seats;
      std::map<int, int> sizes;
      for (int d = 0; d < dp; ++d) {
        for (int t = 0; t < tp; ++t) {
          for (int p = 0; p < pp; ++p) {
            const ReportGroupSeat s = ReportGroupSeatOf(pp, tp, dp, columns, p, t, d);
            ASSERT_GE(s.group, 0);
            ASSERT_LT(s.group, ReportGroupCount(tp, dp, columns));
            ASSERT_GE(s.rank, 0);
            ASSERT_LT(s.rank, s.size);
            EXPECT_TRUE(seats[s.group].insert(s.rank).second) << "seat taken twice";
            sizes[s.group] = s.size;
            const MeshRank back = ReportGroupMember(pp, tp, columns, s.group, s.rank);
            EXPECT_EQ(back.pp_rank, p);
            EXPECT_EQ(back.tp_rank, t);
            EXPECT_EQ(back.dp_rank, d);
          }
        }
      }
      for (const auto& [group, taken] : seats) {
        EXPECT_EQ(static_cast<int>(taken.size()), sizes[group]) << "seats 0 .. size-1, none missing";
        EXPECT_EQ(*taken.rbegin(), sizes[group] - 1);
      }
    }
  }
}

TEST(ReportGroupTest, ColumnsForATargetSize) {
  EXPECT_EQ(ReportGroupColumnsFor(1, 8, 128, 16), 16);  // pp 1: 16 single-rank columns
  EXPECT_EQ(ReportGroupColumnsFor(4, 8, 32, 16), 4);
  EXPECT_EQ(ReportGroupColumnsFor(3, 8, 32, 16), 6);   // 18 ranks: whole columns
  EXPECT_EQ(ReportGroupColumnsFor(16, 8, 8, 16), 1);
  EXPECT_EQ(ReportGroupColumnsFor(32, 8, 16, 16), 1);  // a column alone is over the target
  EXPECT_EQ(ReportGroupColumnsFor(1, 2, 2, 16), 4) << "at most every column";
  EXPECT_EQ(ReportGroupColumnsFor(2, 1, 1, 0), 1);
}

TEST(ReportGroupTest, Names) {
  EXPECT_EQ(ReportGroupName(0), "report-0");
  EXPECT_EQ(ReportGroupName(12), "report-12");
}

}  // namespace
}  // namespace baton
