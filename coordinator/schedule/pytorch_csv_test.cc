#include "coordinator/schedule/pytorch_csv.h"

#include "coordinator/schedule/builders.h"
#include "coordinator/schedule/lowering.h"
#include "gtest/gtest.h"

namespace baton::schedule {
namespace {

TEST(PytorchCsv, ExportsPytorchActionNames) {
  auto s = BuildSchedule({"zb-h1", 2, 2, 1});
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(ToPytorchCsv(*s), "0F0,0F1,0I0,0W0,0I1,0W1\n1F0,1I0,1F1,1I1,1W0,1W1\n");
}

TEST(PytorchCsv, RoundTripGivesTheSameProgram) {
  for (const ScheduleSpec& spec :
       {ScheduleSpec{"gpipe", 3, 5, 1}, ScheduleSpec{"1f1b", 4, 8, 1},
        ScheduleSpec{"interleaved", 4, 8, 2}, ScheduleSpec{"zb-h1", 4, 6, 1}}) {
    SCOPED_TRACE(spec.kind);
    auto built = BuildSchedule(spec);
    ASSERT_TRUE(built.ok());
    auto back = FromPytorchCsv(ToPytorchCsv(*built));
    ASSERT_TRUE(back.ok()) << back.status();
    back->kind = built->kind;  // the CSV carries no schedule name
    EXPECT_EQ(*back, *built);
    // A lowered schedule exports its compute actions.
    auto lowered = Lower(*built);
    ASSERT_TRUE(lowered.ok());
    EXPECT_EQ(ToPytorchCsv(*lowered), ToPytorchCsv(*built));
  }
}

TEST(PytorchCsv, ImportsIdleCellsAndWhitespace) {
  auto s = FromPytorchCsv("0F0,,0B0\r\n, 1F0 ,1B0\n\n");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->num_ranks, 2);
  EXPECT_EQ(s->virtual_stages, 1);
  EXPECT_EQ(s->microbatches, 1);
  EXPECT_EQ(s->kind, "");
  ASSERT_EQ(s->ranks[1].size(), 2u);
  EXPECT_EQ(s->ranks[1][0], (Action{ActionKind::kForward, 1, 0, 0}));
  EXPECT_EQ(s->ranks[1][1], (Action{ActionKind::kBackward, 1, 0, 0}));
}

TEST(PytorchCsv, MalformedInputSaysWhereAndWhat) {
  EXPECT_EQ(FromPytorchCsv("0F0,0X1\n").status().message(),
            "row 1 (rank 0), cell 2: '0X1' has kind 'X'; the compute-only format allows F, I, W "
            "and B");
  EXPECT_EQ(FromPytorchCsv("0F0\nF1\n").status().message(),
            "row 2 (rank 1), cell 1: 'F1' is not an action; write <stage><F|I|W|B><microbatch>, "
            "like 0F3");
  EXPECT_EQ(FromPytorchCsv("0SEND_F0\n").status().message(),
            "row 1 (rank 0), cell 1: '0SEND_F0' has kind 'SEND_F'; the compute-only format "
            "allows F, I, W and B");
  EXPECT_EQ(FromPytorchCsv("0F0,0B99999999\n").status().message(),
            "row 1 (rank 0), cell 2: '0B99999999' has a stage or microbatch outside [0, 262144)");
  EXPECT_EQ(FromPytorchCsv("0F0,1F199999\n").status().message(),
            "the CSV uses 2 stages and 200000 microbatches, more than the 262144 (stage, "
            "microbatch) cells supported");
  // Found by //coordinator/schedule:pytorch_csv_fuzz under UBSan: INT_MAX + 1.
  EXPECT_NE(FromPytorchCsv("0F2147483647\n").status().message().find("outside [0, 262144)"), std::string::npos);
  EXPECT_NE(FromPytorchCsv("2147483647F0\n").status().message().find("outside [0, 262144)"), std::string::npos);
  EXPECT_EQ(FromPytorchCsv("").status().message(),
            "the CSV is empty; expected one row of actions per rank");
  EXPECT_EQ(FromPytorchCsv("0F0,2F0\n1F0\n3F0\n").status().message(),
            "the CSV uses stages 0..3 on 3 ranks; the number of stages must be a multiple of the "
            "number of rows (one row per rank)");
}

}  // namespace
}  // namespace baton::schedule
