#include "coordinator/schedule/pytorch_csv.h"

#include <fstream>
#include <sstream>

#include "coordinator/schedule/builders.h"
#include "coordinator/schedule/lowering.h"
#include "coordinator/schedule/simulator.h"
#include "coordinator/schedule/validator.h"
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
            "row 1 (rank 0), cell 2: '0X1' has kind 'X'; the format allows F, I, W, B (BW in the older "
            "naming), SEND_F, RECV_F, SEND_B, RECV_B and (F;B)OVERLAP_F_B");
  EXPECT_EQ(FromPytorchCsv("0F0\nF1\n").status().message(),
            "row 2 (rank 1), cell 1: 'F1' is not an action; write <stage><kind><microbatch>, like 0F3");
  EXPECT_EQ(FromPytorchCsv("0SEND_F0\n").status().message(),
            "row 1 (rank 0), cell 1: '0SEND_F0' has no partner: stage 1 does not exist");
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

std::string ReadTestdata(const std::string& name) {
  std::ifstream in("coordinator/schedule/testdata/" + name);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_FALSE(text.str().empty()) << name;
  return text.str();
}

// Every schedule PyTorch's own tests hold imports, validates and simulates.
TEST(PytorchCsv, PytorchsArtifactsImportValidateAndSimulate) {
  for (const char* name :
       {"dualpipev_4rank_10mb.csv", "zb1p_2rank_2stagep_compute.csv", "zb1p_2rank_2stagep_comms.csv"}) {
    SCOPED_TRACE(name);
    auto s = FromPytorchCsv(ReadTestdata(name));
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_TRUE(Validate(*s).ok()) << Validate(*s);
    auto sim = Simulate(*s, CostModel());
    EXPECT_TRUE(sim.ok()) << sim.status();
    if (!HasCommunication(*s)) {
      auto lowered = Lower(*s);
      ASSERT_TRUE(lowered.ok()) << lowered.status();
      EXPECT_TRUE(Validate(*lowered).ok()) << Validate(*lowered);
    }
  }
}

TEST(PytorchCsv, DualPipeVArtifactIsOurBuilderWithItsVPlacement) {
  auto s = FromPytorchCsv(ReadTestdata("dualpipev_4rank_10mb.csv"));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->num_ranks, 4);
  EXPECT_EQ(s->virtual_stages, 2);
  EXPECT_EQ(s->microbatches, 10);
  EXPECT_EQ(s->stage_ranks, VPlacement(4, 2));
  EXPECT_EQ(PlacementName(*s), "V");
  auto built = BuildSchedule({"dualpipe-v", 4, 10, 2});
  ASSERT_TRUE(built.ok());
  s->kind = built->kind;
  EXPECT_EQ(*s, *built);
  // Exported again, it is PyTorch's file, cell for cell.
  EXPECT_EQ(ToPytorchCsv(*built), ReadTestdata("dualpipev_4rank_10mb.csv"));
}

TEST(PytorchCsv, OlderNamingIsDetectedOrSelected) {
  // B followed by W of the same microbatch: input then weight backward.
  auto legacy = FromPytorchCsv(ReadTestdata("zb1p_2rank_2stagep_compute.csv"));
  ASSERT_TRUE(legacy.ok()) << legacy.status();
  EXPECT_TRUE(legacy->stage_ranks.empty());  // looped: rank 0 holds 0 and 2
  EXPECT_EQ(legacy->virtual_stages, 2);
  EXPECT_EQ(legacy->ranks[0][4], (Action{ActionKind::kBackwardInput, 2, 0, 0}));
  EXPECT_EQ(legacy->ranks[0][5], (Action{ActionKind::kBackwardWeight, 2, 0, 0}));
  // BW is the older full backward.
  auto comms = FromPytorchCsv(ReadTestdata("zb1p_2rank_2stagep_comms.csv"));
  ASSERT_TRUE(comms.ok()) << comms.status();
  EXPECT_EQ(comms->ranks[0][1], (Action{ActionKind::kSendF, 0, 0, 1}));
  EXPECT_EQ(comms->ranks[0][2], (Action{ActionKind::kRecvF, 2, 0, 1}));
  EXPECT_EQ(comms->ranks[0][11], (Action{ActionKind::kBackward, 2, 0, 0}));
  // Forced current naming: B is a full backward, and with its W it is a duplicate.
  auto forced = FromPytorchCsv("0F0,0B0,0W0\n", CsvNaming::kCurrent);
  ASSERT_TRUE(forced.ok());
  EXPECT_EQ(forced->ranks[0][1].kind, ActionKind::kBackward);
  EXPECT_FALSE(Validate(*forced).ok());
  EXPECT_EQ(FromPytorchCsv("0F0,0BW0\n", CsvNaming::kCurrent).status().message(),
            "row 1 (rank 0), cell 2: '0BW0' is the older naming's full backward, but the file is read with the "
            "current naming (I, W, B); read it with the legacy naming");
  EXPECT_EQ(FromPytorchCsv("0F0,0I0,0W0\n", CsvNaming::kLegacy).status().message(),
            "row 1 (rank 0), cell 2: '0I0' is current naming, but the file is read with the older naming (B = "
            "input backward, BW = full backward)");
  EXPECT_EQ(ParseCsvNaming("old").status().message(),
            "CSV naming 'old' is unknown; use auto, current (I/W/B) or legacy (B/W/BW)");
}

TEST(PytorchCsv, ComputeAndCommsRoundTrip) {
  for (const ScheduleSpec& spec : {ScheduleSpec{"zb-v", 3, 6, 2}, ScheduleSpec{"dualpipe-v", 3, 6, 2},
                                   ScheduleSpec{"interleaved", 2, 4, 2}}) {
    SCOPED_TRACE(spec.kind);
    auto built = BuildSchedule(spec);
    ASSERT_TRUE(built.ok());
    auto back = FromPytorchCsv(ToPytorchCsv(*built));
    ASSERT_TRUE(back.ok()) << back.status();
    back->kind = built->kind;
    EXPECT_EQ(*back, *built);
    auto lowered = Lower(*built);
    ASSERT_TRUE(lowered.ok());
    auto comms = FromPytorchCsv(ToPytorchCsv(*lowered, /*comms=*/true));
    ASSERT_TRUE(comms.ok()) << comms.status();
    EXPECT_TRUE(Validate(*comms).ok()) << Validate(*comms);
    // Everything but the reduction and the optimizer step comes back.
    for (int r = 0; r < lowered->num_ranks; ++r) {
      std::vector<Action> expected = lowered->ranks[r];
      expected.resize(expected.size() - 2);
      EXPECT_EQ(comms->ranks[r], expected) << "rank " << r;
    }
  }
}

TEST(PytorchCsv, InconsistentPlacementAndOverlapsNameTheCell) {
  EXPECT_EQ(FromPytorchCsv("0F0,1F0,1B0,0B0\n1F0,1B0\n").status().message(),
            "row 2 (rank 1), cell 1: '1F0' puts stage 1 on rank 1, but row 1 (rank 0), cell 2 put it on rank 0; a "
            "stage lives on one rank");
  EXPECT_EQ(FromPytorchCsv("0F0,0F1,(0F2;1B0)OVERLAP_F_B\n1F0,1B0\n").status().message(),
            "row 2 (rank 1), cell 1: '1F0' puts stage 1 on rank 1, but row 1 (rank 0), cell 3 put it on rank 0; a "
            "stage lives on one rank");
  EXPECT_EQ(FromPytorchCsv("1F0,1B0\n0F0,(0F1;1B1)OVERLAP_F_B\n").status().message(),
            "row 2 (rank 1), cell 2: the overlapped pair's halves are on different ranks: stage 1 lives on rank 0 "
            "(row 1 (rank 0), cell 1); both halves of an OVERLAP_F_B run on the rank of its row");
  EXPECT_EQ(FromPytorchCsv("0F0,(0B0;0F1)OVERLAP_F_B\n").status().message(),
            "row 1 (rank 0), cell 2: the first half of an OVERLAP_F_B is '0B0'; it must be a forward (F)");
  EXPECT_EQ(FromPytorchCsv("0F0,(0F1;0W0)OVERLAP_F_B\n").status().message(),
            "row 1 (rank 0), cell 2: the second half of an OVERLAP_F_B is '0W0'; it must be a backward (B or I)");
  EXPECT_EQ(FromPytorchCsv("0F0,(0F1)OVERLAP_F_B\n").status().message(),
            "row 1 (rank 0), cell 2: '(0F1)OVERLAP_F_B' has 1 parts; an OVERLAP_F_B pairs one F with one B");
  EXPECT_EQ(FromPytorchCsv("0F0,(0F1;0B0)\n").status().message(),
            "row 1 (rank 0), cell 2: '(0F1;0B0)' is not an overlapped pair; write (<forward>;<backward>)OVERLAP_F_B");
  EXPECT_EQ(FromPytorchCsv("0F0,1F0,3F0\n2F0\n").status().message(),
            "row 1 (rank 0) holds 3 stages; every rank must hold 2 (4 stages on 2 ranks)");
  EXPECT_EQ(FromPytorchCsv("0F0,3F0\n1F0\n").status().message(),
            "stage 2 of 0..3 appears in no row; every stage needs its actions");
  EXPECT_EQ(FromPytorchCsv("0F0,0SEND_F0\n1F0\n0RECV_F0\n").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PytorchCsv, AVScheduleImportedFromACsvTrainsTheSameOrder) {
  // A V placement the file states, with an odd-looking but valid order.
  auto s = FromPytorchCsv("0F0,3F0,3B0,0B0\n1F0,2F0,2B0,1B0\n");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->stage_ranks, (std::vector<int>{0, 1, 1, 0}));
  EXPECT_TRUE(Validate(*s).ok()) << Validate(*s);
  auto lowered = Lower(*s);
  ASSERT_TRUE(lowered.ok()) << lowered.status();
  // Stages 1 and 2 meet on rank 1 without the network: rank 1 only talks to rank 0.
  for (const Action& a : lowered->ranks[1]) {
    if (IsCommunication(a.kind)) EXPECT_EQ(a.peer, 0) << ActionToString(a);
  }
  int messages = 0;
  for (const Action& a : lowered->ranks[1]) messages += IsCommunication(a.kind);
  EXPECT_EQ(messages, 4);  // RECV_F(1), SEND_F(2), RECV_B(2), SEND_B(1)
}

}  // namespace
}  // namespace baton::schedule
