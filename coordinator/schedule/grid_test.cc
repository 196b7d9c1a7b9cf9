#include "coordinator/schedule/grid.h"

#include "coordinator/schedule/builders.h"
#include "coordinator/schedule/lowering.h"
#include "gtest/gtest.h"

namespace baton::schedule {
namespace {

TEST(Grid, TimeGridShowsIdleSlots) {
  auto s = BuildSchedule({"1f1b", 2, 3, 1});
  ASSERT_TRUE(s.ok());
  auto grid = RenderTimeGrid(*s);
  ASSERT_TRUE(grid.ok()) << grid.status();
  EXPECT_EQ(*grid,
            "rank 0 | F0  F1  .   B0  F2  B1  .   B2\n"
            "rank 1 | .   F0  B0  F1  B1  F2  B2  .\n");
  // Lowering does not change the picture.
  auto lowered = Lower(*s);
  ASSERT_TRUE(lowered.ok());
  EXPECT_EQ(*RenderTimeGrid(*lowered), *grid);
}

TEST(Grid, StagesLabelChunksWhenInterleaved) {
  auto s = BuildSchedule({"interleaved", 2, 2, 2});
  ASSERT_TRUE(s.ok());
  auto grid = RenderTimeGrid(*s);
  ASSERT_TRUE(grid.ok());
  EXPECT_EQ(grid->substr(0, grid->find('\n')),
            "rank 0 | 0F0  0F1  2F0  2F1  .    2B0  .    2B1  0B0  0B1");
}

TEST(Grid, ProgramGridMarksACell) {
  auto s = BuildSchedule({"gpipe", 2, 2, 1});
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(RenderProgramGrid(*s, CellRef{1, 2}),
            "rank 0 | F0  F1  B0  B1\n"
            "rank 1 | F0  F1 [B0] B1\n");
}

}  // namespace
}  // namespace baton::schedule
