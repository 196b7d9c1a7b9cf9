// The checkpoint format pieces that need no model: manifests (v1 and v2, and
// malformed ones), step-<n> directories, resolving a --resume path, pruning
// to `keep` without ever removing the newest complete checkpoint or one being
// written, and shard layouts.
#include "common/checkpoint_manifest.h"

#include <sys/stat.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/file_io.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace baton::checkpoint {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string NewDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string dir = absl::StrCat(tmp ? tmp : "/tmp", "/", name);
  EXPECT_TRUE(MakeDirectories(dir).ok());
  return dir;
}

bool Exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

v1::JobSpec Job() {
  v1::JobSpec job;
  job.set_name("demo");
  job.mutable_model()->set_layers(4);
  job.mutable_model()->set_d_model(32);
  job.mutable_model()->set_heads(4);
  job.mutable_model()->set_vocab(40);
  job.mutable_model()->set_seq_len(12);
  job.mutable_parallel()->set_pp(2);
  job.mutable_parallel()->set_tp(2);
  job.mutable_schedule()->set_kind("1f1b");
  return job;
}

// A step directory with one placeholder shard and, when `complete`, a manifest.
std::string MakeStep(const std::string& root, int64_t step, bool complete) {
  const std::string dir = absl::StrCat(root, "/", StepDirName(step));
  EXPECT_TRUE(MakeDirectories(dir).ok());
  EXPECT_TRUE(WriteFileAtomically(dir + "/chunk0-tp0.safetensors", "x").ok());
  if (complete) {
    EXPECT_TRUE(WriteManifest(dir, ManifestFor(Job(), step, {"chunk0-tp0.safetensors"})).ok());
  }
  return dir;
}

TEST(CheckpointManifestTest, V2ManifestRoundTripsModelAndLayout) {
  const std::string dir = NewDir("manifest/v2");
  ASSERT_TRUE(WriteFileAtomically(dir + "/chunk0-tp0.safetensors", "x").ok());
  v1::JobSpec job = Job();
  ASSERT_TRUE(WriteManifest(dir, ManifestFor(job, 200, {"chunk0-tp0.safetensors"})).ok());
  absl::StatusOr<ManifestInfo> m = ReadManifest(dir);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->version, 2);
  EXPECT_EQ(m->job, "demo");
  EXPECT_EQ(m->step, 200);
  EXPECT_TRUE(m->model == ModelShapeOf(job));
  EXPECT_EQ(m->layout.pp, 2);
  EXPECT_EQ(m->layout.tp, 2);
  EXPECT_EQ(m->layout.schedule, "1f1b");
  EXPECT_THAT(m->files, ElementsAre("chunk0-tp0.safetensors"));

  job.mutable_model()->set_heads(8);
  EXPECT_FALSE(m->model == ModelShapeOf(job));
  v1::JobSpec synthetic = Job();
  synthetic.mutable_model()->mutable_synthetic()->set_forward_ms(1);
  ASSERT_TRUE(WriteManifest(dir, ManifestFor(synthetic, 3, {"chunk0-tp0.safetensors"})).ok());
  m = ReadManifest(dir);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE(m->model.synthetic);
  EXPECT_EQ(m->model.chunks, 2);
  EXPECT_EQ(CheckpointKeep(Job()), 2);
}

TEST(CheckpointManifestTest, ManifestErrorsSayWhatIsWrong) {
  const std::string dir = NewDir("manifest/bad");
  EXPECT_THAT(std::string(WriteManifest(dir, ManifestFor(Job(), 1, {"absent.safetensors"})).message()),
              HasSubstr("absent.safetensors is not in"));
  EXPECT_THAT(std::string(WriteManifest(dir, ManifestFor(Job(), 1, {"../x"})).message()),
              HasSubstr("not a file name"));
  const struct {
    const char* text;
    const char* error;
  } cases[] = {
      {"{", "manifest.json"},
      {R"({"format": "other", "job": "j", "step": 1, "files": ["a"]})", "\"format\""},
      {R"({"format": "baton-checkpoint-v2", "job": "j", "step": -1, "files": ["a"]})", "step"},
      {R"({"format": "baton-checkpoint-v2", "job": "j", "step": 1, "files": ["a", "a"]})", "distinct"},
      {R"({"format": "baton-checkpoint-v2", "job": "j", "step": 1, "files": ["a"]})", "\"model\""},
      {R"({"format": "baton-checkpoint-v2", "job": "j", "step": 1, "files": ["a"], "model": {"layers": 2},
          "layout": {}})", "d_model"},
  };
  for (const auto& c : cases) {
    ASSERT_TRUE(WriteFileAtomically(dir + "/manifest.json", c.text).ok());
    absl::StatusOr<ManifestInfo> m = ReadManifest(dir);
    ASSERT_FALSE(m.ok()) << c.text;
    EXPECT_THAT(std::string(m.status().message()), HasSubstr(c.error)) << c.text;
  }
}

TEST(CheckpointManifestTest, ResolveFindsTheNewestCompleteCheckpoint) {
  const std::string root = NewDir("resolve");
  EXPECT_EQ(ResolveCheckpoint(root).status().code(), absl::StatusCode::kNotFound);
  MakeStep(root, 100, true);
  const std::string newest = MakeStep(root, 200, true);
  MakeStep(root, 300, false);  // being written, or crashed
  absl::StatusOr<std::string> r = ResolveCheckpoint(root);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, newest);
  EXPECT_EQ(*ResolveCheckpoint(newest), newest);
  EXPECT_THAT(std::string(ResolveCheckpoint(root + "/nope").status().message()), HasSubstr("no such directory"));
  EXPECT_EQ(StepDirName(42), "step-00000042");
}

TEST(CheckpointManifestTest, PruneKeepsTheNewestCompleteOnesAndAnySaveInProgress) {
  const std::string root = NewDir("prune");
  const std::string crashed = MakeStep(root, 50, false);
  const std::string s100 = MakeStep(root, 100, true);
  const std::string s200 = MakeStep(root, 200, true);
  const std::string crashed2 = MakeStep(root, 250, false);
  const std::string s300 = MakeStep(root, 300, true);
  const std::string writing = MakeStep(root, 400, false);
  ASSERT_TRUE(WriteFileAtomically(root + "/notes.txt", "not a checkpoint").ok());

  absl::StatusOr<std::vector<std::string>> removed = PruneCheckpoints(root, 2);
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_EQ(removed->size(), 3u);
  EXPECT_FALSE(Exists(crashed));
  EXPECT_FALSE(Exists(s100));
  EXPECT_FALSE(Exists(crashed2));
  EXPECT_TRUE(Exists(s200 + "/manifest.json"));
  EXPECT_TRUE(Exists(s300 + "/manifest.json"));
  EXPECT_TRUE(Exists(writing + "/chunk0-tp0.safetensors"));
  EXPECT_TRUE(Exists(root + "/notes.txt"));

  removed = PruneCheckpoints(root, 1);
  ASSERT_TRUE(removed.ok());
  EXPECT_THAT(*removed, ElementsAre(s200));
  EXPECT_TRUE(Exists(s300));
  EXPECT_TRUE(Exists(writing));
  EXPECT_THAT(std::string(PruneCheckpoints(root, 0).status().message()), HasSubstr("at least 1"));
  EXPECT_TRUE(PruneCheckpoints(root + "/absent", 2).ok());
}

TEST(CheckpointManifestTest, ShardLayoutsMoveTheRightElements) {
  // A [6, 2] QKV-style tensor split over 2 ranks: rank 1 holds rows 1, 3, 5.
  TensorLayout l;
  l.full_shape = {6, 2};
  l.split_dim = 0;
  l.qkv = true;
  l.tp_rank = 1;
  l.tp_size = 2;
  absl::StatusOr<std::vector<int64_t>> local = LocalShape(l);
  ASSERT_TRUE(local.ok());
  EXPECT_THAT(*local, ElementsAre(3, 2));
  const std::vector<float> full = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
  std::vector<float> shard(6);
  ExtractShard(l, full.data(), shard.data());
  EXPECT_THAT(shard, ElementsAre(2, 3, 6, 7, 10, 11));
  std::vector<float> back(12, -1);
  InsertShard(l, shard.data(), back.data());
  EXPECT_THAT(back, ElementsAre(-1, -1, 2, 3, -1, -1, 6, 7, -1, -1, 10, 11));

  absl::StatusOr<TensorLayout> parsed = ParseLayout(LayoutJson(l));
  ASSERT_TRUE(parsed.ok());
  EXPECT_TRUE(parsed->SameSplit(l));
  EXPECT_FALSE(ParseLayout(R"({"full_shape":[-1],"split_dim":0,"qkv":false,"tp_rank":0,"tp_size":1})").ok());
  EXPECT_FALSE(ParseLayout(R"({"full_shape":[4],"split_dim":0,"qkv":false,"tp_rank":0,"tp_size":0})").ok());
  l.full_shape = {4, 2};
  EXPECT_THAT(std::string(LocalShape(l).status().message()), HasSubstr("does not split"));
  l.full_shape = {int64_t{1} << 30, int64_t{1} << 30};
  l.qkv = false;
  EXPECT_THAT(std::string(LocalShape(l).status().message()), HasSubstr("too large"));
}

}  // namespace
}  // namespace baton::checkpoint
