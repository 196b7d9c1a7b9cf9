// Complete checkpoints through the model seam: GPT chunks of one layout save
// their ChunkState (weights, AdamW moments, optimizer step) as v2 shards; a
// checkpoint loads into any other layout (pp split, interleaved chunks, TP
// size, vocabulary-parallel) exactly, so saving again without training gives
// the same full state bit for bit; resuming the same layout continues bit for
// bit like an uninterrupted run; the AsyncWriter writes what was captured even
// while training goes on; ValidateCheckpointForJob refuses truncated,
// missing, corrupted and foreign checkpoints naming the file and the problem.
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/checkpoint_manifest.h"
#include "common/file_io.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/gemm.h"
#include "worker/checkpoint/async_writer.h"
#include "worker/checkpoint/checkpoint.h"
#include "worker/comm/inproc_communicator.h"
#include "worker/gpt_stage_model.h"
#include "worker/synthetic_stage.h"

namespace baton::checkpoint {
namespace {

using kernels::Tensor;
using ::testing::HasSubstr;

constexpr int64_t kBatch = 2;
constexpr int kMicrobatches = 2;
constexpr uint64_t kSeed = 5;

std::string NewDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string dir = absl::StrCat(tmp ? tmp : "/tmp", "/", name);
  EXPECT_TRUE(MakeDirectories(dir).ok());
  return dir;
}

model::GptConfig Model(int vocab = 40) {
  model::GptConfig c;
  c.layers = 4;
  c.d_model = 32;
  c.heads = 4;
  c.vocab = vocab;
  c.seq_len = 12;
  return c;
}

struct LayoutSpec {
  std::vector<model::BlockRange> ranges;  // one per chunk
  int tp = 1;
  bool vocab_parallel = false;
};

std::string Describe(const LayoutSpec& l) {
  return absl::StrCat(l.ranges.size(), " chunks x tp ", l.tp, l.vocab_parallel ? " vocab-parallel" : "");
}

v1::JobSpec JobFor(const model::GptConfig& m, const LayoutSpec& l) {
  v1::JobSpec job;
  job.set_name("resume-test");
  job.mutable_model()->set_layers(m.layers);
  job.mutable_model()->set_d_model(m.d_model);
  job.mutable_model()->set_heads(m.heads);
  job.mutable_model()->set_vocab(m.vocab);
  job.mutable_model()->set_seq_len(m.seq_len);
  job.mutable_parallel()->set_pp(static_cast<int>(l.ranges.size()));
  job.mutable_parallel()->set_tp(l.tp);
  job.mutable_schedule()->set_kind("gpipe");
  return job;
}

// The chunks of one layout, all TP ranks, in one process.
class Pipeline {
 public:
  Pipeline(const LayoutSpec& spec, const model::GptConfig& m) : spec_(spec), model_(m) {
    const int n = static_cast<int>(spec.ranges.size());
    for (int r = 0; r < spec.tp; ++r) tie_.push_back(comm::InProcCommunicator::CreateGroup(2));
    v1::TrainSpec train;
    train.set_lr(0.02);
    train.set_weight_decay(0.1);
    chunks_.resize(n);
    for (int c = 0; c < n; ++c) {
      tp_.push_back(comm::InProcCommunicator::CreateGroup(spec.tp));
      for (int r = 0; r < spec.tp; ++r) {
        absl::StatusOr<model::StageConfig> config =
            model::MakeChunkConfig(m, c, n, spec.ranges[c], r, spec.tp, kSeed);
        EXPECT_TRUE(config.ok()) << config.status();
        config->microbatches = kMicrobatches;
        config->vocab_parallel = spec.vocab_parallel;
        config->comm_timeout = absl::Seconds(60);
        comm::Communicator* tie = n == 1 ? nullptr : c == 0 ? tie_[r][0].get() : c == n - 1 ? tie_[r][1].get() : nullptr;
        auto chunk = GptStageModel::Create(*config, kBatch, tp_[c][r].get(), tie, AdamWFromTrainSpec(train));
        EXPECT_TRUE(chunk.ok()) << chunk.status();
        chunks_[c].push_back(std::move(*chunk));
      }
    }
  }

  int chunks() const { return static_cast<int>(chunks_.size()); }

  // One training step (GPipe order) on every TP rank, then AdamW everywhere.
  void Step(const std::vector<MicrobatchData>& data) {
    std::vector<std::thread> threads;
    std::vector<absl::Status> status(spec_.tp);
    for (int r = 0; r < spec_.tp; ++r) threads.emplace_back([&, r] { status[r] = RunRank(r, data); });
    for (auto& t : threads) t.join();
    for (const absl::Status& s : status) ASSERT_TRUE(s.ok()) << s;
    for (auto& row : chunks_) {
      for (auto& chunk : row) ASSERT_TRUE(chunk->OptimizerStep(0.5f).ok());
    }
  }

  // Saves every (chunk, TP rank) synchronously, then the manifest.
  void Save(const std::string& dir, int64_t step) {
    std::vector<std::string> files;
    for (int c = 0; c < chunks(); ++c) {
      for (int r = 0; r < spec_.tp; ++r) {
        absl::StatusOr<ChunkLayout> layout = LayoutOfChunk(chunks_[c][r]->Shards(), c, r, spec_.tp);
        ASSERT_TRUE(layout.ok()) << layout.status();
        absl::StatusOr<std::string> file = WriteStateShardFile(dir, *layout, chunks_[c][r]->CaptureState());
        ASSERT_TRUE(file.ok()) << file.status();
        files.push_back(*file);
      }
    }
    ASSERT_TRUE(WriteManifest(dir, ManifestFor(JobFor(model_, spec_), step, files)).ok());
  }

  // Every chunk and rank restores its own shard of the checkpoint in `dir`.
  void Load(const std::string& dir) {
    absl::StatusOr<FullState> full = LoadFullState(dir);
    ASSERT_TRUE(full.ok()) << full.status();
    for (int c = 0; c < chunks(); ++c) {
      for (int r = 0; r < spec_.tp; ++r) {
        absl::StatusOr<ChunkLayout> layout = LayoutOfChunk(chunks_[c][r]->Shards(), c, r, spec_.tp);
        ASSERT_TRUE(layout.ok()) << layout.status();
        absl::StatusOr<ChunkState> state = ChunkStateFrom(*full, *layout);
        ASSERT_TRUE(state.ok()) << state.status();
        ASSERT_TRUE(chunks_[c][r]->RestoreState(*state).ok());
      }
    }
  }

  std::vector<ChunkToSave> ToSave() {
    std::vector<ChunkToSave> out;
    for (int c = 0; c < chunks(); ++c) {
      for (int r = 0; r < spec_.tp; ++r) out.push_back({c, r, spec_.tp, chunks_[c][r].get(), {}, {}});
    }
    return out;
  }

 private:
  absl::Status RunRank(int r, const std::vector<MicrobatchData>& data) {
    const int n = chunks();
    for (auto& row : chunks_) row[r]->ZeroGrad();
    std::vector<std::vector<Tensor>> acts(data.size()), grads(data.size());
    for (size_t mb = 0; mb < data.size(); ++mb) {
      for (int c = 0; c < n; ++c) {
        acts[mb].push_back(Tensor::Zeros({chunks_[c][r]->activation_elements()}));
        grads[mb].push_back(Tensor::Zeros({chunks_[c][r]->activation_elements()}));
      }
      for (int c = 0; c < n; ++c) {
        absl::Status s = chunks_[c][r]->Forward(static_cast<int>(mb), data[mb], c > 0 ? acts[mb][c - 1] : Tensor(),
                                                c + 1 < n ? acts[mb][c] : Tensor());
        if (!s.ok()) return s;
      }
    }
    for (size_t mb = 0; mb < data.size(); ++mb) {
      for (int c = n - 1; c >= 0; --c) {
        absl::Status s = chunks_[c][r]->BackwardInput(static_cast<int>(mb), c + 1 < n ? grads[mb][c + 1] : Tensor(),
                                                      c > 0 ? grads[mb][c] : Tensor());
        if (s.ok()) s = chunks_[c][r]->BackwardWeight(static_cast<int>(mb));
        if (!s.ok()) return s;
      }
    }
    if (n == 1) return chunks_[0][r]->SyncTiedGradients();
    absl::Status first;
    std::thread sync([&] { first = chunks_[0][r]->SyncTiedGradients(); });
    const absl::Status last = chunks_[n - 1][r]->SyncTiedGradients();
    sync.join();
    return first.ok() ? last : first;
  }

  LayoutSpec spec_;
  model::GptConfig model_;
  std::vector<std::vector<std::unique_ptr<comm::InProcCommunicator>>> tie_;  // [tp rank][first, last]
  std::vector<std::vector<std::unique_ptr<comm::InProcCommunicator>>> tp_;   // [chunk][tp rank]
  std::vector<std::vector<std::unique_ptr<GptStageModel>>> chunks_;          // [chunk][tp rank]
};

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), sizeof(float) * a.size()) == 0);
}

// Every tensor, moment and the optimizer step equal bit for bit.
void ExpectSameFullState(const std::string& dir_a, const std::string& dir_b) {
  absl::StatusOr<FullState> a = LoadFullState(dir_a);
  absl::StatusOr<FullState> b = LoadFullState(dir_b);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(a->optimizer_step, b->optimizer_step);
  EXPECT_TRUE(a->has_moments && b->has_moments);
  ASSERT_EQ(a->tensors.size(), b->tensors.size());
  for (const auto& [name, t] : a->tensors) {
    auto it = b->tensors.find(name);
    ASSERT_NE(it, b->tensors.end()) << name;
    EXPECT_EQ(t.shape, it->second.shape) << name;
    EXPECT_TRUE(SameBits(t.values, it->second.values)) << name;
    EXPECT_TRUE(SameBits(t.adam_m, it->second.adam_m)) << name << " adam_m";
    EXPECT_TRUE(SameBits(t.adam_v, it->second.adam_v)) << name << " adam_v";
    EXPECT_FALSE(t.adam_v.empty()) << name;
  }
}

double MaxRelDiff(const std::string& dir_a, const std::string& dir_b) {
  absl::StatusOr<FullState> a = LoadFullState(dir_a);
  absl::StatusOr<FullState> b = LoadFullState(dir_b);
  EXPECT_TRUE(a.ok() && b.ok());
  double worst = 0;
  for (const auto& [name, t] : a->tensors) {
    const std::vector<float>& other = b->tensors.at(name).values;
    double diff = 0, norm = 0;
    for (size_t i = 0; i < t.values.size(); ++i) {
      diff += (double{t.values[i]} - other[i]) * (double{t.values[i]} - other[i]);
      norm += double{t.values[i]} * t.values[i];
    }
    worst = std::max(worst, std::sqrt(diff) / std::max(std::sqrt(norm), 1e-30));
  }
  return worst;
}

class ResumeTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { kernels::cpu::SetBlasThreads(1); }

  void SetUp() override {
    std::mt19937 rng(3);
    std::uniform_int_distribution<int> id(0, 39);
    for (int step = 0; step < 6; ++step) {
      std::vector<MicrobatchData> batch;
      for (int mb = 0; mb < kMicrobatches; ++mb) {
        MicrobatchData d;
        d.tokens = Tensor::Zeros({kBatch, 12}, kernels::DType::kInt32);
        d.targets = Tensor::Zeros({kBatch, 12}, kernels::DType::kInt32);
        for (int64_t i = 0; i < d.tokens.numel(); ++i) {
          d.tokens.i32()[i] = id(rng);
          d.targets.i32()[i] = id(rng);
        }
        batch.push_back(d);
      }
      data_.push_back(batch);
    }
  }

  std::vector<std::vector<MicrobatchData>> data_;  // per step
};

const LayoutSpec kTwoByTwo{{{0, 2}, {2, 2}}, 2, false};

TEST_F(ResumeTest, SameLayoutResumeContinuesBitForBit) {
  const std::string saved = NewDir("same/saved"), uninterrupted = NewDir("same/uninterrupted"),
                    resumed = NewDir("same/resumed");
  {
    Pipeline run(kTwoByTwo, Model());
    for (int s = 0; s < 2; ++s) run.Step(data_[s]);
    run.Save(saved, 2);
    for (int s = 2; s < 5; ++s) run.Step(data_[s]);
    run.Save(uninterrupted, 5);
  }
  Pipeline again(kTwoByTwo, Model());
  again.Load(saved);
  for (int s = 2; s < 5; ++s) again.Step(data_[s]);
  again.Save(resumed, 5);
  ExpectSameFullState(uninterrupted, resumed);
  // Not vacuous: three more steps changed the state.
  EXPECT_GT(MaxRelDiff(saved, resumed), 1e-4);
}

TEST_F(ResumeTest, AnyLayoutLoadsExactlyAndSavesTheSameState) {
  const std::vector<std::pair<LayoutSpec, LayoutSpec>> pairs = {
      {kTwoByTwo, {{{0, 4}}, 1, false}},                        // to one chunk, no TP
      {kTwoByTwo, {{{0, 1}, {1, 1}, {2, 1}, {3, 1}}, 1, false}},  // interleaved-like chunks
      {kTwoByTwo, {{{0, 1}, {1, 3}}, 4, true}},                  // uneven, TP 4, vocab-parallel
      {{{{0, 1}, {1, 1}, {2, 2}}, 4, true}, {{{0, 3}, {3, 1}}, 2, false}},
      {{{{0, 4}}, 1, false}, {{{0, 2}, {2, 1}, {3, 1}}, 2, true}},
  };
  int i = 0;
  for (const auto& [from, to] : pairs) {
    SCOPED_TRACE(absl::StrCat(Describe(from), " -> ", Describe(to)));
    const std::string a = NewDir(absl::StrCat("any/", i, "/a")), b = NewDir(absl::StrCat("any/", i, "/b")),
                      a_next = NewDir(absl::StrCat("any/", i, "/a_next")),
                      b_next = NewDir(absl::StrCat("any/", i, "/b_next"));
    ++i;
    {
      Pipeline source(from, Model());
      for (int s = 0; s < 2; ++s) source.Step(data_[s]);
      source.Save(a, 2);
      source.Step(data_[2]);
      source.Save(a_next, 3);
    }
    Pipeline target(to, Model());
    target.Load(a);
    target.Save(b, 2);  // no training in between
    ExpectSameFullState(a, b);
    // The resharded state trains on like the original, within the drift of
    // another layout's summation order.
    target.Step(data_[2]);
    target.Save(b_next, 3);
    EXPECT_LT(MaxRelDiff(a_next, b_next), 1e-4);
    EXPECT_GT(MaxRelDiff(a, b_next), 1e-4);
  }
}

TEST_F(ResumeTest, AsyncWriterWritesTheCapturedStateWhileTrainingGoesOn) {
  const std::string sync_dir = NewDir("async/sync"), async_dir = NewDir("async/async");
  Pipeline run(kTwoByTwo, Model());
  run.Step(data_[0]);
  run.Save(sync_dir, 1);

  AsyncWriter writer;
  absl::Mutex mu;
  std::vector<SaveResult> results;
  absl::StatusOr<double> stall = writer.Save(async_dir + "/new", 1, run.ToSave(), [&](const SaveResult& r) {
    absl::MutexLock lock(&mu);
    results.push_back(r);
  });
  ASSERT_TRUE(stall.ok()) << stall.status();
  EXPECT_GE(*stall, 0.0);
  run.Step(data_[1]);  // the model moves on while the files are written
  writer.Flush();
  ASSERT_EQ(results.size(), 1u);
  const SaveResult& r = results[0];
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.files.size(), 4u);
  EXPECT_EQ(r.step, 1);
  int64_t bytes = 0;
  for (const std::string& f : r.files) {
    struct stat st;
    ASSERT_EQ(stat((r.dir + "/" + f).c_str(), &st), 0) << f;
    bytes += st.st_size;
  }
  EXPECT_EQ(r.bytes, bytes);
  EXPECT_EQ(writer.bytes_written(), bytes);
  EXPECT_DOUBLE_EQ(writer.stall_seconds(), *stall);
  ASSERT_TRUE(WriteManifest(r.dir, ManifestFor(JobFor(Model(), kTwoByTwo), 1, r.files)).ok());
  ExpectSameFullState(sync_dir, r.dir);

  // A write that fails reports the error to the callback, not a crash.
  std::ofstream(async_dir + "/blocker") << "a file where a directory should be";
  bool failed = false;
  ASSERT_TRUE(writer
                  .Save(async_dir + "/blocker/sub", 2, run.ToSave(),
                        [&](const SaveResult& res) {
                          absl::MutexLock lock(&mu);
                          failed = !res.status.ok() && res.files.empty();
                        })
                  .ok());
  writer.Flush();
  EXPECT_TRUE(failed);
}

TEST(SyntheticResumeTest, SyntheticChunksSaveAndLoadTheirWeightAndStep) {
  v1::JobSpec job;
  job.set_name("synthetic");
  job.mutable_model()->mutable_synthetic()->set_activation_bytes(16);
  job.mutable_parallel()->set_pp(2);
  v1::SyntheticCost cost = job.model().synthetic();
  std::vector<std::unique_ptr<SyntheticStage>> chunks;
  for (int c = 0; c < 2; ++c) chunks.push_back(*SyntheticStage::Create(cost, c, 2));
  const MicrobatchData data;
  const Tensor act = Tensor::Zeros({4}), grad = Tensor::Zeros({4});
  ASSERT_TRUE(chunks[0]->Forward(0, data, Tensor(), act).ok());
  ASSERT_TRUE(chunks[1]->Forward(0, data, act, Tensor()).ok());
  ASSERT_TRUE(chunks[1]->BackwardInput(0, Tensor(), grad).ok());
  ASSERT_TRUE(chunks[0]->BackwardInput(0, grad, Tensor()).ok());
  for (auto& s : chunks) {
    ASSERT_TRUE(s->BackwardWeight(0).ok());
    ASSERT_TRUE(s->OptimizerStep(1.0f).ok());
  }
  const std::string dir = NewDir("synthetic");
  AsyncWriter writer;
  std::vector<std::string> files;
  ASSERT_TRUE(writer
                  .Save(dir, 1, {{0, 0, 1, chunks[0].get(), {}, {}}, {1, 0, 1, chunks[1].get(), {}, {}}},
                        [&](const SaveResult& r) { files = r.files; })
                  .ok());
  writer.Flush();
  ASSERT_EQ(files.size(), 2u);
  ASSERT_TRUE(WriteManifest(dir, ManifestFor(job, 1, files)).ok());
  absl::StatusOr<FullState> valid = ValidateCheckpointForJob(dir, job);
  ASSERT_TRUE(valid.ok()) << valid.status();
  job.mutable_parallel()->set_pp(4);  // another chunk count: the weights are per chunk
  EXPECT_THAT(std::string(ValidateCheckpointForJob(dir, job).status().message()), HasSubstr("another model"));

  auto fresh = *SyntheticStage::Create(cost, 1, 2);
  absl::StatusOr<ChunkLayout> layout = LayoutOfChunk(fresh->Shards(), 1, 0, 1);
  ASSERT_TRUE(layout.ok());
  absl::StatusOr<ChunkState> state = LoadChunkState(dir, *layout);
  ASSERT_TRUE(state.ok()) << state.status();
  ASSERT_TRUE(fresh->RestoreState(*state).ok());
  const ChunkState a = chunks[1]->CaptureState(), b = fresh->CaptureState();
  EXPECT_EQ(b.optimizer_step, 1);
  EXPECT_TRUE(SameBits(a.values, b.values));
}

// Checkpoints broken in the ways a crash, a full disk or a wrong path makes
// them are refused before training, naming the file and the problem.
class ValidateTest : public ResumeTest {
 protected:
  void SetUp() override {
    ResumeTest::SetUp();
    good_ = NewDir(absl::StrCat("validate/", ::testing::UnitTest::GetInstance()->current_test_info()->name()));
    Pipeline run(kTwoByTwo, Model());
    run.Step(data_[0]);
    run.Save(good_, 1);
  }
  std::string Error(const v1::JobSpec& job) {
    absl::StatusOr<FullState> s = ValidateCheckpointForJob(good_, job);
    return s.ok() ? "" : std::string(s.status().message());
  }
  std::string Error() { return Error(JobFor(Model(), kTwoByTwo)); }
  std::string good_;
};

TEST_F(ValidateTest, AGoodCheckpointPassesForAnyLayoutOfTheSameModel) {
  EXPECT_EQ(Error(), "");
  EXPECT_EQ(Error(JobFor(Model(), {{{0, 1}, {1, 1}, {2, 1}, {3, 1}}, 1, false})), "");
  absl::StatusOr<FullState> s = ValidateCheckpointForJob(good_, JobFor(Model(), kTwoByTwo));
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->optimizer_step, 1);
  EXPECT_EQ(s->chunks, 2);
  EXPECT_EQ(s->tp_size, 2);
}

TEST_F(ValidateTest, ResumeFromAJobCheckpointDirPicksTheNewestCompleteSave) {
  const std::string root = NewDir("validate/root");
  Pipeline run(kTwoByTwo, Model());
  run.Step(data_[0]);
  for (int64_t step : {1, 2, 3}) ASSERT_TRUE(MakeDirectories(root + "/" + StepDirName(step)).ok());
  run.Save(root + "/" + StepDirName(1), 1);
  run.Step(data_[1]);
  run.Save(root + "/" + StepDirName(2), 2);
  const std::string crashed = root + "/" + StepDirName(3);  // no manifest
  ASSERT_TRUE(WriteFileAtomically(crashed + "/chunk0-tp0.safetensors", "partial").ok());
  absl::StatusOr<FullState> s = ValidateResumeCheckpoint(root, JobFor(Model(), kTwoByTwo));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->dir, root + "/" + StepDirName(2));
  EXPECT_EQ(s->manifest.step, 2);
  EXPECT_EQ(s->optimizer_step, 2);
  EXPECT_THAT(std::string(ValidateResumeCheckpoint(crashed, JobFor(Model(), kTwoByTwo)).status().message()),
              HasSubstr("no manifest.json"));
}

TEST_F(ValidateTest, TruncatedShard) {
  const std::string path = good_ + "/chunk1-tp0.safetensors";
  absl::StatusOr<std::string> bytes = ReadFile(path);
  ASSERT_TRUE(bytes.ok());
  ASSERT_EQ(truncate(path.c_str(), static_cast<off_t>(bytes->size() / 2)), 0);
  EXPECT_THAT(Error(), HasSubstr("chunk1-tp0.safetensors"));
  EXPECT_THAT(Error(), HasSubstr("truncated"));
}

TEST_F(ValidateTest, MissingShard) {
  ASSERT_EQ(unlink((good_ + "/chunk0-tp1.safetensors").c_str()), 0);
  EXPECT_THAT(Error(), HasSubstr("chunk0-tp1.safetensors: missing"));
}

TEST_F(ValidateTest, CorruptedData) {
  const std::string path = good_ + "/chunk0-tp0.safetensors";
  std::string bytes = *ReadFile(path);
  bytes[bytes.size() - 100] ^= 0x40;  // a bit of some tensor's data
  ASSERT_TRUE(WriteFileAtomically(path, bytes).ok());
  EXPECT_THAT(Error(), HasSubstr("chunk0-tp0.safetensors"));
  EXPECT_THAT(Error(), HasSubstr("CRC-32"));
}

TEST_F(ValidateTest, NoManifestBecauseTheSaveDidNotFinish) {
  ASSERT_EQ(unlink((good_ + "/manifest.json").c_str()), 0);
  EXPECT_THAT(Error(), HasSubstr("manifest.json"));
  EXPECT_THAT(Error(), HasSubstr("did not finish"));
}

TEST_F(ValidateTest, AnotherModelByItsManifest) {
  model::GptConfig other = Model();
  other.d_model = 64;
  const std::string e = Error(JobFor(other, kTwoByTwo));
  EXPECT_THAT(e, HasSubstr("manifest.json"));
  EXPECT_THAT(e, HasSubstr("another model"));
  EXPECT_THAT(e, HasSubstr("d_model 32"));
}

TEST_F(ValidateTest, AnotherModelByItsTensorsUnderAnEditedManifest) {
  const std::string foreign = NewDir("validate/foreign");
  Pipeline run(kTwoByTwo, Model(/*vocab=*/48));
  run.Save(foreign, 0);
  // The manifest claims the job's model; the tensors say otherwise.
  absl::StatusOr<ManifestInfo> m = ReadManifest(foreign);
  ASSERT_TRUE(m.ok());
  ASSERT_TRUE(WriteManifest(foreign, ManifestFor(JobFor(Model(), kTwoByTwo), 0, m->files)).ok());
  absl::StatusOr<FullState> s = ValidateCheckpointForJob(foreign, JobFor(Model(), kTwoByTwo));
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("tensor wte has shape [48, 32]"));
}

TEST_F(ValidateTest, RandomlyCorruptedShardsAreRefusedNeverCrash) {
  std::vector<std::pair<std::string, std::string>> files;
  for (const char* name : {"chunk0-tp0.safetensors", "chunk0-tp1.safetensors", "chunk1-tp0.safetensors",
                           "chunk1-tp1.safetensors"}) {
    files.emplace_back(name, *ReadFile(good_ + "/" + name));
  }
  std::mt19937 rng(11);
  int refused = 0, trials = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const auto& [name, good] = files[rng() % files.size()];
    std::string bytes = good;
    if (trial % 4 == 3) {
      bytes.resize(rng() % bytes.size());  // cut anywhere, header included
    } else {
      // Flips biased to the header (the first KiB), where structure lives.
      for (int f = 1 + static_cast<int>(rng() % 3); f > 0; --f) {
        const size_t at = rng() % 2 == 0 ? rng() % std::min<size_t>(1024, bytes.size()) : rng() % bytes.size();
        bytes[at] = static_cast<char>(bytes[at] ^ (1 + rng() % 255));
      }
    }
    if (bytes == good) continue;
    ++trials;
    ASSERT_TRUE(WriteFileAtomically(good_ + "/" + name, bytes).ok());
    absl::StatusOr<FullState> s = ValidateCheckpointForJob(good_, JobFor(Model(), kTwoByTwo));
    if (!s.ok()) {
      ++refused;
      EXPECT_THAT(std::string(s.status().message()), HasSubstr(good_)) << "the message names the checkpoint";
    }
    ASSERT_TRUE(WriteFileAtomically(good_ + "/" + name, good).ok());
  }
  // A flip can land where it changes nothing the format defines (JSON
  // whitespace padding of the header); everything else is refused.
  EXPECT_GE(refused, trials * 95 / 100) << refused << " of " << trials;
  EXPECT_EQ(Error(), "");  // restored
}

TEST_F(ValidateTest, WeightsOnlyCheckpointCannotResume) {
  const std::string v1dir = NewDir("validate/v1");
  Pipeline run(kTwoByTwo, Model());
  std::vector<std::string> files;
  // The v1 writer, as the final weights are saved today.
  for (const ChunkToSave& c : run.ToSave()) {
    absl::StatusOr<std::string> f = WriteShardFile(v1dir, c.chunk, c.tp_rank, c.tp_size, c.model->Shards());
    ASSERT_TRUE(f.ok()) << f.status();
    files.push_back(*f);
  }
  ASSERT_TRUE(WriteManifest(v1dir, files, "old", 0).ok());
  absl::StatusOr<FullState> s = ValidateCheckpointForJob(v1dir, JobFor(Model(), kTwoByTwo));
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("weights-only"));
  // Its weights still gather for comparisons.
  EXPECT_TRUE(LoadFullWeights(v1dir).ok());
}

}  // namespace
}  // namespace baton::checkpoint
