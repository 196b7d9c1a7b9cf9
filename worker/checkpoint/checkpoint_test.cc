#include "worker/checkpoint/checkpoint.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/file_io.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/checkpoint/weights_diff.h"
#include "worker/model/gpt_stage.h"

namespace baton::checkpoint {
namespace {

using ::testing::HasSubstr;

std::string NewDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string dir = absl::StrCat(tmp ? tmp : "/tmp", "/", name);
  mkdir(dir.c_str(), 0755);
  return dir;
}

model::GptConfig Model() {
  model::GptConfig m;
  m.layers = 8;
  m.d_model = 16;
  m.heads = 4;
  m.vocab = 32;
  m.seq_len = 8;
  return m;
}

// A store of `config`'s parameters on the CPU, initialised from seed 7, as
// a worker's stage holds them.
absl::StatusOr<model::ParameterStore> InitializedStore(const model::StageConfig& config, int rank, int tp) {
  absl::StatusOr<model::ParameterStore> store =
      model::ParameterStore::Create(model::StageParameterSpecs(config), rank, tp);
  if (!store.ok()) return store.status();
  if (absl::Status s = store->Place(kernels::Device::Cpu()); !s.ok()) return s;
  store->Initialize(7);
  return store;
}

// Saves a freshly initialised model split into `chunks` × `tp` the way
// workers do (every chunk on every TP rank writes its shard file), and the
// manifest. Returns the file names.
std::vector<std::string> SaveModel(const std::string& dir, int chunks, int tp, bool vocab_parallel = false) {
  std::vector<std::string> files;
  for (int c = 0; c < chunks; ++c) {
    for (int r = 0; r < tp; ++r) {
      absl::StatusOr<model::StageConfig> config = model::MakeStageConfig(Model(), c, chunks, r, tp, /*seed=*/7);
      EXPECT_TRUE(config.ok()) << config.status();
      config->vocab_parallel = vocab_parallel;
      absl::StatusOr<model::ParameterStore> store = InitializedStore(*config, r, tp);
      EXPECT_TRUE(store.ok()) << store.status();
      absl::StatusOr<std::vector<NamedShard>> shards = ShardsOf(*store);
      EXPECT_TRUE(shards.ok()) << shards.status();
      absl::StatusOr<std::string> file = WriteShardFile(dir, c, r, tp, *shards);
      EXPECT_TRUE(file.ok()) << file.status();
      EXPECT_EQ(*file, ShardFileName(c, r));
      files.push_back(*file);
    }
  }
  EXPECT_TRUE(WriteManifest(dir, files, "test-job", 20).ok());
  return files;
}

std::string Message(const absl::Status& s) { return std::string(s.message()); }

TEST(CheckpointTest, EveryLayoutGathersToTheSameFullWeightsBitForBit) {
  const std::string ref_dir = NewDir("ref");
  SaveModel(ref_dir, 1, 1);
  auto reference = LoadFullWeights(ref_dir);
  ASSERT_TRUE(reference.ok()) << reference.status();
  ASSERT_EQ(reference->count("h.7.attn.c_attn.weight"), 1u);
  EXPECT_EQ(reference->at("h.7.attn.c_attn.weight").shape, (std::vector<int64_t>{48, 16}));
  EXPECT_EQ(reference->size(), 4u + 8 * 12);  // wte wpe ln_f.{weight,bias} + 12 per block

  struct Layout {
    int chunks, tp;
    bool vocab_parallel;
  };
  // PP 2, TP 2, PP 2 × TP 2, TP 4 × PP 4, interleaved (PP 4 × 2 virtual
  // stages = 8 chunks) × TP 2, and the vocabulary-parallel embedding.
  for (const Layout& l : {Layout{2, 1, false}, Layout{1, 2, false}, Layout{2, 2, false}, Layout{4, 4, false},
                          Layout{8, 2, false}, Layout{2, 2, true}}) {
    SCOPED_TRACE(absl::StrCat(l.chunks, " chunks, tp ", l.tp, l.vocab_parallel ? ", vocab parallel" : ""));
    const std::string dir = NewDir(absl::StrCat("layout", l.chunks, "x", l.tp, l.vocab_parallel));
    SaveModel(dir, l.chunks, l.tp, l.vocab_parallel);
    auto weights = LoadFullWeights(dir);
    ASSERT_TRUE(weights.ok()) << weights.status();
    auto diff = CompareWeights(*weights, *reference);
    ASSERT_TRUE(diff.ok()) << diff.status();
    EXPECT_EQ(diff->max_abs_diff, 0.0);
    EXPECT_EQ(diff->tensors.size(), reference->size());
    for (const auto& [name, t] : *reference) {
      EXPECT_EQ(weights->at(name).values, t.values) << name;
    }
  }
}

TEST(CheckpointTest, ManifestRecordsJobAndStep) {
  const std::string dir = NewDir("manifest");
  SaveModel(dir, 2, 1);
  auto manifest = ReadManifest(dir);
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  EXPECT_EQ(manifest->job, "test-job");
  EXPECT_EQ(manifest->step, 20);
  EXPECT_EQ(manifest->files, (std::vector<std::string>{"chunk0-tp0.safetensors", "chunk1-tp0.safetensors"}));
  EXPECT_THAT(Message(WriteManifest(dir, {"chunk9-tp0.safetensors"}, "j", 1)), HasSubstr("chunk9-tp0"));
  EXPECT_FALSE(WriteManifest(dir, {}, "j", 1).ok());
}

TEST(CheckpointTest, WriteShardFileRejectsShardsThatDoNotFitTheirFullShape) {
  const std::string dir = NewDir("bad_write");
  kernels::Tensor t = kernels::Tensor::Zeros({4, 3});
  auto write = [&](NamedShard s, int tp) { return WriteShardFile(dir, 0, 0, tp, {std::move(s)}).status(); };
  EXPECT_THAT(Message(write(NamedShard{"w", t, {8, 6}, 1, false}, 2)), HasSubstr("gives [8, 3]"));
  EXPECT_THAT(Message(write(NamedShard{"w", t, {9, 3}, 0, true}, 2)), HasSubstr("does not split"));
  EXPECT_THAT(Message(write(NamedShard{"w", t, {4, 3}, 2, false}, 1)), HasSubstr("split_dim 2"));
  EXPECT_THAT(Message(WriteShardFile(dir, 0, 0, 1, {NamedShard{"w", t, {4, 3}}, NamedShard{"w", t, {4, 3}}}).status()),
              HasSubstr("added twice"));
  EXPECT_THAT(Message(write(NamedShard{"i", kernels::Tensor::Zeros({2}, kernels::DType::kInt32), {2}}, 1)),
              HasSubstr("float32"));
  EXPECT_FALSE(WriteShardFile(dir, 0, 2, 2, {}).ok());  // rank outside the group
  EXPECT_TRUE(WriteShardFile(dir, 0, 1, 2, {NamedShard{"w", t, {8, 3}, 0, false}}).ok());
}

class BrokenCheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = NewDir(::testing::UnitTest::GetInstance()->current_test_info()->name());
    files_ = SaveModel(dir_, 2, 2);
  }
  std::string Path(const std::string& file) const { return absl::StrCat(dir_, "/", file); }
  std::string LoadError() const {
    auto w = LoadFullWeights(dir_);
    return w.ok() ? "(loaded)" : Message(w.status());
  }
  // Rewrites one shard file with `edit` applied to its parameters.
  void Rewrite(int chunk, int rank, const std::function<void(model::ParameterStore&)>& edit) {
    auto config = model::MakeStageConfig(Model(), chunk, 2, rank, 2, 7);
    absl::StatusOr<model::ParameterStore> store = InitializedStore(*config, rank, 2);
    ASSERT_TRUE(store.ok()) << store.status();
    edit(*store);
    ASSERT_TRUE(WriteShardFile(dir_, chunk, rank, 2, *ShardsOf(*store)).ok());
  }

  std::string dir_;
  std::vector<std::string> files_;
};

TEST_F(BrokenCheckpointTest, NoManifest) {
  unlink(Path("manifest.json").c_str());
  EXPECT_THAT(LoadError(), HasSubstr("a baton checkpoint directory"));
}

TEST_F(BrokenCheckpointTest, ListedFileMissing) {
  unlink(Path("chunk1-tp0.safetensors").c_str());
  EXPECT_THAT(LoadError(), HasSubstr("chunk1-tp0.safetensors"));
}

TEST_F(BrokenCheckpointTest, ShardNotInManifest) {
  ASSERT_TRUE(WriteManifest(dir_, {files_[0], files_[1], files_[2]}, "j", 1).ok());
  EXPECT_THAT(LoadError(), HasSubstr("chunk1-tp1.safetensors not listed in manifest.json"));
}

TEST_F(BrokenCheckpointTest, MissingTpRank) {
  unlink(Path("chunk0-tp1.safetensors").c_str());
  ASSERT_TRUE(WriteManifest(dir_, {files_[0], files_[2], files_[3]}, "j", 1).ok());
  EXPECT_THAT(LoadError(), HasSubstr("no shard for chunk 0 tp rank 1"));
}

TEST_F(BrokenCheckpointTest, TruncatedShard) {
  const std::string bytes = *ReadFile(Path("chunk1-tp1.safetensors"));
  ASSERT_TRUE(WriteFileAtomically(Path("chunk1-tp1.safetensors"), bytes.substr(0, bytes.size() - 3)).ok());
  EXPECT_THAT(LoadError(), HasSubstr("chunk1-tp1.safetensors"));
}

TEST_F(BrokenCheckpointTest, TiedEmbeddingCopiesDiffer) {
  Rewrite(1, 0, [](model::ParameterStore& s) { s.Find("wte")->value.f32()[5] += 1e-6f; });
  Rewrite(1, 1, [](model::ParameterStore& s) { s.Find("wte")->value.f32()[5] += 1e-6f; });
  EXPECT_THAT(LoadError(), HasSubstr("tensor wte is stored by chunk 0 and chunk 1 with different values"));
}

TEST_F(BrokenCheckpointTest, ReplicatedTensorDiffersAcrossTpRanks) {
  Rewrite(0, 1, [](model::ParameterStore& s) { s.Find("h.0.ln_1.weight")->value.f32()[0] = 2; });
  EXPECT_THAT(LoadError(), HasSubstr("h.0.ln_1.weight of chunk 0 is replicated but differs"));
}

TEST_F(BrokenCheckpointTest, TensorMissingOnOneTpRank) {
  auto config = model::MakeStageConfig(Model(), 0, 2, 1, 2, 7);
  absl::StatusOr<model::ParameterStore> store = InitializedStore(*config, 1, 2);
  ASSERT_TRUE(store.ok()) << store.status();
  std::vector<NamedShard> shards = *ShardsOf(*store);
  shards.pop_back();
  ASSERT_TRUE(WriteShardFile(dir_, 0, 1, 2, shards).ok());
  EXPECT_THAT(LoadError(), HasSubstr("missing from chunk0-tp1.safetensors"));
}

TEST_F(BrokenCheckpointTest, RandomlyCorruptedHeadersAreErrorsNotCrashes) {
  const std::string path = Path("chunk1-tp1.safetensors");
  const std::string good = *ReadFile(path);
  const size_t header_end = 8 + static_cast<uint8_t>(good[0]) + 256 * static_cast<uint8_t>(good[1]);
  std::mt19937 rng(7);
  int failed = 0;
  for (int trial = 0; trial < 300; ++trial) {
    std::string bytes = good;
    for (int f = 0; f < 3; ++f) bytes[rng() % header_end] = static_cast<char>(rng());
    ASSERT_TRUE(WriteFileAtomically(path, bytes).ok());
    failed += !LoadFullWeights(dir_).ok();
  }
  EXPECT_GT(failed, 250);
}

TEST(WeightsDiffTest, ReportsAbsoluteAndRelativeDifferencePerTensor) {
  std::map<std::string, FullTensor> a = {{"x", {{2}, {3, 4}, {}, {}}}, {"y", {{1}, {1}, {}, {}}}};
  std::map<std::string, FullTensor> b = a;
  b["x"].values = {3, 4.5f};
  auto diff = CompareWeights(a, b);
  ASSERT_TRUE(diff.ok());
  EXPECT_DOUBLE_EQ(diff->max_abs_diff, 0.5);
  EXPECT_NEAR(diff->max_rel_diff, 0.5 / std::sqrt(9 + 4.5 * 4.5), 1e-12);
  EXPECT_EQ(diff->tensors[1].max_abs_diff, 0.0);
  // All tensors as one vector: ||(0, 0.5, 0)|| / ||(3, 4.5, 1)||.
  EXPECT_NEAR(diff->rel_l2, 0.5 / std::sqrt(9 + 4.5 * 4.5 + 1), 1e-12);

  b["x"].shape = {1, 2};
  b.erase("y");
  b["z"] = {{1}, {0}, {}, {}};
  EXPECT_THAT(Message(CompareWeights(a, b).status()),
              HasSubstr("only in the first: y; only in the second: z; shapes differ: x [2] vs [1, 2]"));
}

}  // namespace
}  // namespace baton::checkpoint
