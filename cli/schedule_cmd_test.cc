#include "cli/schedule_cmd.h"

#include <fstream>
#include <sstream>

#include "coordinator/schedule/builders.h"
#include "coordinator/schedule/ir.h"
#include "coordinator/schedule/lowering.h"
#include "gtest/gtest.h"

namespace baton::cli {
namespace {

struct Result {
  int code;
  std::string out;
  std::string err;
};

Result Batonctl(const std::vector<std::string>& args) {
  std::ostringstream out, err;
  const int code = RunScheduleCommand(args, out, err);
  return {code, out.str(), err.str()};
}

std::string WriteTemp(const std::string& name, const std::string& contents) {
  const std::string path = testing::TempDir() + "/" + name;
  std::ofstream(path) << contents;
  return path;
}

// V placements say which rank holds which stage; overlapped pairs sit side
// by side, the first half marked with "&".
TEST(ScheduleCommand, ShowDrawsVPlacementsAndOverlaps) {
  Result r = Batonctl({"show", "--schedule=dualpipe-v", "--pp=2", "--microbatches=4"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out.substr(0, r.out.find('\n', r.out.find('\n') + 1) + 1),
            "dualpipe-v: p=2 v=2 m=4 (one slot per action, . = idle, X& Y = X and Y overlapped)\n"
            "V placement: rank 0 holds 0,3; rank 1 holds 1,2\n");
  EXPECT_NE(r.out.find("0F3&  3B1"), std::string::npos) << r.out;
  Result zbv = Batonctl({"show", "--schedule=zb-v", "--pp=2", "--microbatches=3"});
  ASSERT_EQ(zbv.code, 0) << zbv.err;
  EXPECT_NE(zbv.out.find("zb-v: p=2 v=2 m=3"), std::string::npos) << zbv.out;
  // CSV out and back in, with its comms.
  Result comms = Batonctl({"show", "--schedule=zb-v", "--pp=2", "--microbatches=3", "--format=csv_comms"});
  ASSERT_EQ(comms.code, 0) << comms.err;
  EXPECT_NE(comms.out.find("0SEND_F0"), std::string::npos) << comms.out;
  Result valid = Batonctl({"validate", "--file=" + WriteTemp("zbv_comms.csv", comms.out)});
  EXPECT_EQ(valid.code, 0) << valid.err;
  EXPECT_NE(valid.out.find("(lowered)"), std::string::npos) << valid.out;
}

TEST(ScheduleCommand, ShowPrintsTheTextbookGrid) {
  Result r = Batonctl({"show", "--schedule=1f1b", "--pp=4", "--microbatches=8"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out,
            "1f1b: p=4 v=1 m=8 (one slot per action, . = idle)\n"
            "rank 0 | F0  F1  F2  F3  .   .   .   B0  F4  B1  F5  B2  F6  B3  F7  B4  .   B5  .   "
            "B6  .   B7\n"
            "rank 1 | .   F0  F1  F2  .   .   B0  F3  B1  F4  B2  F5  B3  F6  B4  F7  B5  .   B6  "
            ".   B7  .\n"
            "rank 2 | .   .   F0  F1  .   B0  F2  B1  F3  B2  F4  B3  F5  B4  F6  B5  F7  B6  .   "
            "B7  .   .\n"
            "rank 3 | .   .   .   F0  B0  F1  B1  F2  B2  F3  B3  F4  B4  F5  B5  F6  B6  F7  B7  "
            ".   .   .\n");
  EXPECT_EQ(r.err, "");
}

TEST(ScheduleCommand, ShowInterleavedAndOtherFormats) {
  Result grid =
      Batonctl({"show", "--schedule=interleaved", "--pp=2", "--microbatches=2", "--virtual=2"});
  ASSERT_EQ(grid.code, 0) << grid.err;
  EXPECT_NE(grid.out.find("rank 0 | 0F0  0F1  2F0  2F1"), std::string::npos) << grid.out;

  Result json =
      Batonctl({"show", "--schedule=gpipe", "--pp=2", "--microbatches=2", "--format=json"});
  ASSERT_EQ(json.code, 0) << json.err;
  auto programs = schedule::FromProgramsJson(json.out);
  ASSERT_TRUE(programs.ok()) << programs.status();
  EXPECT_TRUE(schedule::HasCommunication(*programs));

  Result csv = Batonctl({"show", "--schedule=gpipe", "--pp=2", "--microbatches=2", "--format=csv"});
  EXPECT_EQ(csv.out, "0F0,0F1,0B0,0B1\n1F0,1F1,1B0,1B1\n");
}

TEST(ScheduleCommand, SimulateJsonHasExactlyTheDocumentedKeys) {
  Result r =
      Batonctl({"simulate", "--schedule=gpipe", "--pp=2", "--microbatches=2", "--format=json"});
  ASSERT_EQ(r.code, 0) << r.err;
  // (p-1)/(m+p-1) = 1/3 of a makespan of 3 * (m + p - 1).
  EXPECT_EQ(r.out,
            "{\"makespan\": 9, \"bubble_ratio\": 0.333333333333, \"stages\": ["
            "{\"rank\": 0, \"busy\": 6, \"bubble_ratio\": 0.333333333333, "
            "\"peak_activations\": 2}, "
            "{\"rank\": 1, \"busy\": 6, \"bubble_ratio\": 0.333333333333, "
            "\"peak_activations\": 2}]}\n");
}

TEST(ScheduleCommand, SimulateTakesCosts) {
  // F = 2, B = I + W = 3 per stage; latency 1 per message:
  // rank 0 F [0,2] -> rank 1 F [3,5], B [5,8] -> rank 0 B [9,12].
  Result r =
      Batonctl({"simulate", "--schedule=1f1b", "--pp=2", "--microbatches=1", "--forward=2",
                "--backward_input=1", "--backward_weight=2", "--comm_latency=1", "--format=json"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out.substr(0, r.out.find(',')), "{\"makespan\": 12");

  Result uneven = Batonctl({"simulate", "--schedule=gpipe", "--pp=2", "--microbatches=2",
                            "--stage_multipliers=1,2", "--format=json"});
  ASSERT_EQ(uneven.code, 0) << uneven.err;
  // Rank 1 twice as slow: its Fs [1,3],[3,5], Bs [5,9],[9,13]; rank 0's B1 [13,15].
  EXPECT_EQ(uneven.out.substr(0, uneven.out.find(',')), "{\"makespan\": 15");
}

TEST(ScheduleCommand, SimulateTextChromeCsv) {
  const std::vector<std::string> base = {"simulate", "--schedule=zb-h1", "--pp=2",
                                         "--microbatches=2"};
  auto with = [&](const std::string& flag) {
    std::vector<std::string> args = base;
    args.push_back(flag);
    return Batonctl(args);
  };
  Result text = with("--format=text");
  ASSERT_EQ(text.code, 0) << text.err;
  EXPECT_NE(text.out.find("schedule zb-h1: p=2 v=1 m=2\nmakespan      7\n"), std::string::npos)
      << text.out;
  Result chrome = with("--format=chrome");
  ASSERT_EQ(chrome.code, 0);
  EXPECT_NE(chrome.out.find("\"traceEvents\""), std::string::npos);
  EXPECT_NE(chrome.out.find("\"name\": \"W1\", \"cat\": \"W\""), std::string::npos);
  Result csv = with("--format=csv");
  EXPECT_EQ(csv.out, "0F0,0F1,0I0,0W0,0I1,0W1\n1F0,1I0,1F1,1I1,1W0,1W1\n");
}

TEST(ScheduleCommand, ValidateCsvAndJsonFiles) {
  const std::string good =
      WriteTemp("good.csv", "0F0,0F1,0I0,0W0,0I1,0W1\n1F0,1I0,1F1,1I1,1W0,1W1\n");
  Result ok = Batonctl({"validate", "--file=" + good});
  EXPECT_EQ(ok.code, 0) << ok.err;
  EXPECT_EQ(ok.out, "valid: imported schedule, p=2 v=1 m=2, 12 actions (compute only)\n");

  const std::string missing_w =
      WriteTemp("missing_w.csv", "0F0,0F1,0I0,0W0,0I1,0W1\n1F0,1I0,1F1,1I1,1W0\n");
  Result bad = Batonctl({"validate", "--file=" + missing_w});
  EXPECT_EQ(bad.code, 1);
  EXPECT_NE(bad.err.find("invalid schedule: missing W(1,1): I(1,1) on rank 1 (action 3)"),
            std::string::npos)
      << bad.err;
  EXPECT_NE(bad.err.find("rank 1 | F0  I0  F1 [I1] W0"), std::string::npos) << bad.err;

  auto built = schedule::BuildSchedule({"1f1b", 2, 2, 1});
  auto lowered = schedule::Lower(*built);
  ASSERT_TRUE(lowered.ok());
  const std::string json = WriteTemp("good.json", schedule::ToProgramsJson(*lowered));
  Result json_ok = Batonctl({"validate", "--file=" + json});
  EXPECT_EQ(json_ok.code, 0) << json_ok.err;
  EXPECT_NE(json_ok.out.find("valid: 1f1b schedule, p=2 v=1 m=2"), std::string::npos);

  // Swap two receives of rank 1.
  schedule::Schedule swapped = *lowered;
  std::vector<schedule::Action>& program = swapped.ranks[1];
  std::vector<size_t> receives;
  for (size_t i = 0; i < program.size(); ++i) {
    if (program[i].kind == schedule::ActionKind::kRecvF) receives.push_back(i);
  }
  ASSERT_EQ(receives.size(), 2u);
  std::swap(program[receives[0]], program[receives[1]]);
  const std::string broken = WriteTemp("swapped.json", schedule::ToProgramsJson(swapped));
  Result json_bad = Batonctl({"validate", "--file=" + broken});
  EXPECT_EQ(json_bad.code, 1);
  EXPECT_NE(json_bad.err.find("F(1,0) on rank 1 (action 1) runs before its input arrives"),
            std::string::npos)
      << json_bad.err;

  // A PyTorch schedule can be simulated as well.
  Result sim = Batonctl({"simulate", "--file=" + good, "--format=json"});
  EXPECT_EQ(sim.code, 0) << sim.err;
  EXPECT_EQ(sim.out.substr(0, sim.out.find(',')), "{\"makespan\": 7");
}

TEST(ScheduleCommand, BadInputSaysWhatToChange) {
  const std::string malformed = WriteTemp("malformed.csv", "0F0,0Q1\n");
  const std::string split = WriteTemp("split.csv", "0F0,(0F1;1B0)OVERLAP_F_B\n1F0,1B0,1F1,1B1\n");
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"show", "--schedule=1f1b", "--pp=0", "--microbatches=8"},
       "--pp must be at least 1 (got 0); set it to the number of pipeline ranks"},
      {{"show", "--schedule=interleaved", "--pp=4", "--microbatches=6", "--virtual=2"},
       "--microbatches=6 does not fit interleaved with --pp=4: it needs a multiple of 4; use "
       "--microbatches=8"},
      {{"show", "--schedule=zb-w", "--pp=4", "--microbatches=8"},
       "unknown --schedule=zb-w; choose one of gpipe, 1f1b, interleaved, zb-h1, zb-v, dualpipe-v"},
      {{"show", "--schedule=zb-v", "--pp=4", "--microbatches=8", "--virtual=3"},
       "zb-v places two chunks on every rank in a V; use virtual stages 2 (got 3: a V needs an even chunk count)"},
      {{"validate", "--file=" + split},
       "--file=" + split +
           ": row 2 (rank 1), cell 1: '1F0' puts stage 1 on rank 1, but row 1 (rank 0), cell 2 put it on rank 0; a "
           "stage lives on one rank"},
      {{"validate", "--file=" + malformed, "--csv_naming=old"},
       "--csv_naming: CSV naming 'old' is unknown; use auto, current (I/W/B) or legacy (B/W/BW)"},
      {{"simulate", "--schedule=dualpipe-v", "--pp=2", "--microbatches=4", "--overlapped=-1"},
       "--overlapped must be a finite number >= 0 (got -1): the cost of an overlapped F&B pair"},
      {{"simulate", "--schedule=1f1b", "--pp=4", "--microbatches=8", "--backward_weight=-2"},
       "--backward_weight must be a finite number >= 0 (got -2)"},
      {{"validate", "--file=" + malformed},
       "--file=" + malformed +
           ": row 1 (rank 0), cell 2: '0Q1' has kind 'Q'; the format allows F, I, W, B (BW in the older naming), "
           "SEND_F, RECV_F, SEND_B, RECV_B and (F;B)OVERLAP_F_B"},
      {{"show", "--schedule=1f1b", "--pp=4", "--microbatches=8", "--virtual=2"},
       "--virtual=2 needs --schedule=interleaved (or zb-v, dualpipe-v with 2); drop --virtual for 1f1b"},
      {{"simulate", "--schedule=1f1b", "--pp=4", "--microbatches=8", "--format=xml"},
       "--format=xml is not one of text, json, chrome, csv, csv_comms"},
      {{"simulate", "--schedule=gpipe", "--pp=2", "--microbatches=2", "--stage_multipliers=1"},
       "got 1 stage multipliers for 2 stages; give one per stage"},
      {{"validate"},
       "give --schedule=KIND (one of gpipe, 1f1b, interleaved, zb-h1, zb-v, dualpipe-v) with --pp and "
       "--microbatches, or --file=PATH"},
      {{"show", "--schedule=1f1b", "--pp=2", "--microbatches=2", "extra"},
       "unexpected argument 'extra'; flags look like --name=value"},
  };
  for (const auto& [args, message] : cases) {
    Result r = Batonctl(args);
    EXPECT_EQ(r.code, 2) << args[1];
    EXPECT_EQ(r.err, "error: " + message + "\n");
    EXPECT_EQ(r.out, "");
  }
  Result unknown = Batonctl({"frobnicate"});
  EXPECT_EQ(unknown.code, 2);
  EXPECT_NE(unknown.err.find("unknown schedule command 'frobnicate'"), std::string::npos);
  EXPECT_NE(unknown.err.find("usage: batonctl schedule"), std::string::npos);
  EXPECT_EQ(Batonctl({}).code, 2);
}

// Issue 12: `show --pp=65536 --microbatches=65536` and `simulate --pp=4096
// --microbatches=4096` aborted with bad_alloc after 10-27 s. Sizes are
// bounded before anything is built: exit 2 at once, saying what to lower.
TEST(ScheduleCommand, HugeSchedulesAreRefusedBeforeAnythingIsBuilt) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"show", "--schedule=1f1b", "--pp=65536", "--microbatches=65536"},
       "--pp=65536 x --microbatches=65536 x --virtual=1 = 4294967296 (stage, microbatch) cells; at most "
       "262144 are supported: lower --microbatches to at most 4"},
      {{"simulate", "--schedule=1f1b", "--pp=4096", "--microbatches=4096"},
       "--pp=4096 x --microbatches=4096 x --virtual=1 = 16777216 (stage, microbatch) cells; at most 262144 "
       "are supported: lower --microbatches to at most 64"},
      {{"validate", "--schedule=interleaved", "--pp=64", "--microbatches=4096", "--virtual=2"},
       "--pp=64 x --microbatches=4096 x --virtual=2 = 524288 (stage, microbatch) cells; at most 262144 are "
       "supported: lower --microbatches to at most 2048"},
      {{"show", "--schedule=1f1b", "--pp=2", "--microbatches=1000000"},
       "--microbatches must be at most 65536 (got 1000000)"},
      {{"show", "--schedule=1f1b", "--pp=99999999999999999999", "--microbatches=2"}, "--pp"},
      {{"validate", "--file=/dev/zero"}, "--file=/dev/zero is not a regular file"},
      {{"validate", "--file=/"}, "--file=/ is not a regular file"},
      {{"validate", "--file=/nonexistent/x.csv"}, "cannot read --file=/nonexistent/x.csv: No such file"},
  };
  for (const auto& [args, message] : cases) {
    Result r = Batonctl(args);
    EXPECT_EQ(r.code, 2) << args[1] << " " << args[2] << ": " << r.err;
    EXPECT_NE(r.err.find(message), std::string::npos) << r.err;
    EXPECT_EQ(r.out, "");
  }
  // The largest allowed schedule still works.
  Result largest = Batonctl({"validate", "--schedule=1f1b", "--pp=64", "--microbatches=4096"});
  EXPECT_EQ(largest.code, 0) << largest.err;
  EXPECT_NE(largest.out.find("valid: 1f1b schedule, p=64 v=1 m=4096"), std::string::npos) << largest.out;
}

TEST(ScheduleCommand, AFileLargerThanTheLimitIsRefused) {
  const std::string path = testing::TempDir() + "/huge.csv";
  {
    std::ofstream out(path);
    const std::string row(1 << 20, ',');
    for (int i = 0; i < 65; ++i) out << row;
    out << "0F0\n";
  }
  Result r = Batonctl({"validate", "--file=" + path});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("is larger than 67108864 bytes"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace baton::cli
