#include "cli/checkpoint_cmd.h"

#include <sys/stat.h>

#include <cstdlib>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/tensor.h"
#include "worker/checkpoint/checkpoint.h"

namespace baton::cli {
namespace {

using ::testing::HasSubstr;
using ::testing::MatchesRegex;

struct Result {
  int code;
  std::string out, err;
};

Result RunDiff(const std::vector<std::string>& args) {
  std::ostringstream out, err;
  int code = RunCheckpointCommand(args, out, err);
  return {code, out.str(), err.str()};
}

std::string NewDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string dir = absl::StrCat(tmp ? tmp : "/tmp", "/", name);
  mkdir(dir.c_str(), 0755);
  return dir;
}

// Saves w = [[0, 1], [2, 3], [4, 5], [6, 7]] (rows split over `tp`) and a
// replicated b = [1, -1], with `w[index] += delta`, and optionally an extra
// tensor.
std::string Save(const std::string& name, int tp, int index = 0, float delta = 0, bool extra = false) {
  const std::string dir = NewDir(name);
  std::vector<float> w = {0, 1, 2, 3, 4, 5, 6, 7};
  w[index] += delta;
  std::vector<float> b = {1, -1};
  std::vector<std::string> files;
  for (int r = 0; r < tp; ++r) {
    const int rows = 4 / tp;
    std::vector<NamedShard> shards = {
        {"w", kernels::Tensor::View(w.data() + r * rows * 2, {rows, 2}), {4, 2}, 0, false},
        {"b", kernels::Tensor::View(b.data(), {2}), {2}, -1, false}};
    if (extra) shards.push_back({"extra", kernels::Tensor::View(b.data(), {2}), {2}, -1, false});
    files.push_back(*checkpoint::WriteShardFile(dir, 0, r, tp, shards));
  }
  EXPECT_TRUE(checkpoint::WriteManifest(dir, files, "job", 3).ok());
  return dir;
}

TEST(CheckpointCommandTest, DiffAcrossLayoutsPrintsOverallAndPerTensor) {
  const std::string a = Save("a", 1, 5, 0.25f);  // w[2][1]: 5 → 5.25
  const std::string b = Save("b", 2);
  Result r = RunDiff({"diff", a, b});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("max_abs_diff 0.25  max_rel_diff 0.0211"));  // 0.25 / ‖w‖ = 0.25 / √140
  EXPECT_THAT(r.out, HasSubstr("w                                [4,2]          0.25"));
  EXPECT_THAT(r.out, HasSubstr("b                                [2]            0              0\n"));

  r = RunDiff({"diff", a, b, "--json"});
  EXPECT_EQ(r.code, 0);
  EXPECT_THAT(r.out, MatchesRegex(R"(\{"max_abs_diff": 0\.25, "max_rel_diff": 0\.02112885636[0-9]*, "tensors": 2\}.)"));

  r = RunDiff({"diff", b, Save("c", 4), "--json"});  // same weights, other TP split
  EXPECT_EQ(r.out, "{\"max_abs_diff\": 0, \"max_rel_diff\": 0, \"tensors\": 2}\n");
}

// A v2 checkpoint of the same w and b with AdamW moments: adam_m = values,
// adam_v = values · v_scale, optimizer step `step`.
std::string SaveState(const std::string& name, int64_t step, float v_scale) {
  const std::string dir = NewDir(name);
  std::vector<float> w = {0, 1, 2, 3, 4, 5, 6, 7};
  std::vector<float> b = {1, -1};
  std::vector<NamedShard> shards = {{"w", kernels::Tensor::View(w.data(), {4, 2}), {4, 2}, 0, false},
                                    {"b", kernels::Tensor::View(b.data(), {2}), {2}, -1, false}};
  absl::StatusOr<checkpoint::ChunkLayout> layout = checkpoint::LayoutOfChunk(shards, 0, 0, 1);
  EXPECT_TRUE(layout.ok()) << layout.status();
  ChunkState state;
  state.optimizer_step = step;
  state.values = {0, 1, 2, 3, 4, 5, 6, 7, 1, -1};
  state.adam_m = state.values;
  for (float x : state.values) state.adam_v.push_back(x * v_scale);
  absl::StatusOr<std::string> file = checkpoint::WriteStateShardFile(dir, *layout, state);
  EXPECT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE(checkpoint::WriteManifest(dir, {*file}, "job", step).ok());
  return dir;
}

TEST(CheckpointCommandTest, DiffComparesOptimizerStateWhenBothHoldIt) {
  const std::string a = SaveState("opt_a", 7, 1.0f), b = SaveState("opt_b", 7, 1.0f),
                    c = SaveState("opt_c", 9, 2.0f);
  Result r = RunDiff({"diff", a, b, "--json"});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out,
            "{\"max_abs_diff\": 0, \"max_rel_diff\": 0, \"tensors\": 2, \"optimizer_step\": [7, 7], "
            "\"moments_max_abs_diff\": 0, \"moments_max_rel_diff\": 0}\n");
  r = RunDiff({"diff", a, c});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("max_abs_diff 0  max_rel_diff 0  (2 tensors"));
  // adam_v of w differs by 7 at most (7 · 2 − 7); rel = ‖v‖ / ‖2v‖ = 0.5.
  EXPECT_THAT(r.out, HasSubstr("optimizer: step 7 vs 9  adam moments max_abs_diff 7  max_rel_diff 0.5\n"));
  r = RunDiff({"diff", a, Save("weights_only", 1)});
  EXPECT_THAT(r.out, HasSubstr("optimizer: only the first checkpoint holds optimizer state"));
}

TEST(CheckpointCommandTest, DifferentTensorsExitOneSayingWhich) {
  Result r = RunDiff({"diff", Save("d", 1, 0, 0, /*extra=*/true), Save("e", 2)});
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("only in the first: extra"));
}

TEST(CheckpointCommandTest, BadUsageAndUnreadableDirectoriesExitTwo) {
  const std::string good = Save("f", 1);
  EXPECT_EQ(RunDiff({"diff", good}).code, 2);
  EXPECT_EQ(RunDiff({"show", good, good}).code, 2);
  EXPECT_EQ(RunDiff({"diff", good, good, "--jsn"}).code, 2);
  Result r = RunDiff({"diff", good, "/nonexistent/ckpt"});
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("cannot load /nonexistent/ckpt"));
}

}  // namespace
}  // namespace baton::cli
