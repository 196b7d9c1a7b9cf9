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
using ::testing::Not;

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

v1::JobSpec LlamaJob() {
  v1::JobSpec job;
  job.set_name("llama");
  v1::ModelSpec* m = job.mutable_model();
  m->set_arch("llama");
  m->set_layers(2);
  m->set_d_model(16);
  m->set_heads(4);
  m->set_kv_heads(2);
  m->set_ffn_dim(24);
  m->set_vocab(16);
  m->set_seq_len(8);
  m->set_rope_theta(500000);
  m->set_norm_eps(1e-6f);
  job.mutable_schedule()->set_kind("1f1b");
  return job;
}

TEST(CheckpointManifestTest, LlamaManifestRoundTripsItsArchitecture) {
  const std::string dir = NewDir("manifest/llama");
  ASSERT_TRUE(WriteFileAtomically(dir + "/chunk0-tp0.safetensors", "x").ok());
  v1::JobSpec job = LlamaJob();
  const ModelShape shape = ModelShapeOf(job);
  EXPECT_EQ(shape.arch, "llama");
  EXPECT_EQ(shape.kv_heads, 2);
  EXPECT_EQ(shape.ffn_dim, 24);
  EXPECT_EQ(shape.rope_theta, 500000.0f);
  EXPECT_EQ(shape.norm_eps, 1e-6f);
  EXPECT_FALSE(shape.tie_embeddings);  // unset: Llama's separate lm_head
  ASSERT_TRUE(WriteManifest(dir, ManifestFor(job, 7, {"chunk0-tp0.safetensors"})).ok());
  absl::StatusOr<std::string> text = ReadFile(dir + "/manifest.json");
  ASSERT_TRUE(text.ok());
  EXPECT_THAT(*text, HasSubstr("\"arch\": \"llama\", \"kv_heads\": 2, \"ffn_dim\": 24, \"rope_theta\": 500000, "
                               "\"norm_eps\": 1e-06, \"tie_embeddings\": false"));
  absl::StatusOr<ManifestInfo> m = ReadManifest(dir);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE(m->model == shape);
  EXPECT_EQ(m->model.arch, "llama");
  EXPECT_EQ(m->model.kv_heads, 2);
  EXPECT_EQ(m->model.ffn_dim, 24);
  EXPECT_EQ(m->model.rope_theta, 500000.0f);
  EXPECT_EQ(m->model.norm_eps, 1e-6f);  // the float read back exactly
  EXPECT_FALSE(m->model.tie_embeddings);
  EXPECT_THAT(DescribeModel(m->model), HasSubstr("a Llama (arch llama) of layers 2, d_model 16, heads 4, "
                                                 "kv_heads 2, ffn_dim 24"));
  EXPECT_THAT(DescribeModel(m->model), HasSubstr("untied lm_head"));

  // Each Llama field is part of the model.
  for (void (*change)(v1::ModelSpec*) : {
           +[](v1::ModelSpec* s) { s->set_kv_heads(4); }, +[](v1::ModelSpec* s) { s->set_ffn_dim(32); },
           +[](v1::ModelSpec* s) { s->set_rope_theta(10000); }, +[](v1::ModelSpec* s) { s->set_norm_eps(1e-5f); },
           +[](v1::ModelSpec* s) { s->set_tie_embeddings(true); }, +[](v1::ModelSpec* s) { s->clear_arch(); }}) {
    v1::JobSpec other = LlamaJob();
    change(other.mutable_model());
    EXPECT_FALSE(m->model == ModelShapeOf(other)) << other.model().ShortDebugString();
  }
  // Unset fields take Llama's defaults.
  v1::JobSpec defaults = LlamaJob();
  defaults.mutable_model()->clear_kv_heads();
  defaults.mutable_model()->clear_ffn_dim();
  defaults.mutable_model()->clear_rope_theta();
  defaults.mutable_model()->clear_norm_eps();
  const ModelShape d = ModelShapeOf(defaults);
  EXPECT_EQ(d.kv_heads, 4);
  EXPECT_EQ(d.ffn_dim, 64);
  EXPECT_EQ(d.rope_theta, 10000.0f);
  EXPECT_EQ(d.norm_eps, 1e-5f);
}

TEST(CheckpointManifestTest, AGptTwoManifestWithoutArchStillReadsAsGptTwo) {
  const std::string dir = NewDir("manifest/old-gpt2");
  ASSERT_TRUE(WriteFileAtomically(dir + "/chunk0-tp0.safetensors", "x").ok());
  // As releases before Llama wrote it.
  ASSERT_TRUE(WriteFileAtomically(dir + "/manifest.json", R"({"format": "baton-checkpoint-v2", "job": "demo",
      "step": 5, "model": {"layers": 4, "d_model": 32, "heads": 4, "vocab": 40, "seq_len": 12},
      "layout": {"pp": 2, "tp": 2, "dp": 1, "virtual_stages": 1, "schedule": "1f1b"},
      "files": ["chunk0-tp0.safetensors"]})")
                  .ok());
  absl::StatusOr<ManifestInfo> m = ReadManifest(dir);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->model.arch, "gpt2");
  EXPECT_TRUE(m->model == ModelShapeOf(Job()));
  v1::JobSpec explicit_gpt2 = Job();
  explicit_gpt2.mutable_model()->set_arch("gpt2");
  EXPECT_TRUE(m->model == ModelShapeOf(explicit_gpt2));
  EXPECT_FALSE(m->model == ModelShapeOf(LlamaJob()));
  EXPECT_THAT(DescribeModel(m->model), HasSubstr("a GPT of layers 4"));
  // A GPT-2 manifest is still written without the Llama fields.
  ASSERT_TRUE(WriteManifest(dir, ManifestFor(Job(), 5, {"chunk0-tp0.safetensors"})).ok());
  EXPECT_THAT(*ReadFile(dir + "/manifest.json"), Not(HasSubstr("arch")));

  const struct {
    const char* model;
    const char* error;
  } bad[] = {
      {R"("arch": "mistral")", "model.arch must be \"gpt2\" or \"llama\""},
      {R"("arch": "llama", "ffn_dim": 24, "rope_theta": 1e4, "norm_eps": 1e-5, "tie_embeddings": true)", "kv_heads"},
      {R"("arch": "llama", "kv_heads": 2, "ffn_dim": 24, "norm_eps": 1e-5, "tie_embeddings": true)", "rope_theta"},
      {R"("arch": "llama", "kv_heads": 2, "ffn_dim": 24, "rope_theta": 1e4, "norm_eps": null,
          "tie_embeddings": true)", "norm_eps must be a positive finite number"},
      {R"("arch": "llama", "kv_heads": 2, "ffn_dim": 24, "rope_theta": 1e4, "norm_eps": 1e-5)", "tie_embeddings"},
  };
  for (const auto& c : bad) {
    ASSERT_TRUE(WriteFileAtomically(dir + "/manifest.json",
                                    absl::StrCat(R"({"format": "baton-checkpoint-v2", "job": "j", "step": 1,
        "model": {"layers": 2, "d_model": 16, "heads": 4, "vocab": 16, "seq_len": 8, )", c.model, R"(},
        "layout": {"pp": 1, "tp": 1, "dp": 1, "virtual_stages": 1}, "files": ["chunk0-tp0.safetensors"]})"))
                    .ok());
    absl::StatusOr<ManifestInfo> r = ReadManifest(dir);
    ASSERT_FALSE(r.ok()) << c.model;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(c.error)) << c.model;
  }
}

// A one-chunk, tp 1 Llama checkpoint of `shards`' tensors (zeros, zero
// moments) whose manifest records `manifest`'s model.
std::string WriteLlamaCheckpoint(const std::string& name, const v1::JobSpec& shards, const v1::JobSpec& manifest,
                                 const std::vector<std::pair<std::string, std::vector<int64_t>>>& extra = {}) {
  const std::string dir = NewDir(name);
  const v1::ModelSpec& m = shards.model();
  const int64_t c = m.d_model(), v = m.vocab(), hd = c / m.heads(), kv = m.kv_heads() * hd, f = m.ffn_dim();
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes = {{"embed_tokens.weight", {v, c}},
                                                                      {"norm.weight", {c}}};
  if (!m.tie_embeddings()) shapes.push_back({"lm_head.weight", {v, c}});
  for (int i = 0; i < m.layers(); ++i) {
    const std::string p = absl::StrCat("layers.", i, ".");
    for (auto& [n, s] : std::vector<std::pair<std::string, std::vector<int64_t>>>{
             {"input_layernorm.weight", {c}},
             {"self_attn.q_proj.weight", {c, c}},
             {"self_attn.k_proj.weight", {kv, c}},
             {"self_attn.v_proj.weight", {kv, c}},
             {"self_attn.o_proj.weight", {c, c}},
             {"post_attention_layernorm.weight", {c}},
             {"mlp.gate_proj.weight", {f, c}},
             {"mlp.up_proj.weight", {f, c}},
             {"mlp.down_proj.weight", {c, f}}}) {
      shapes.push_back({p + n, s});
    }
  }
  for (const auto& e : extra) shapes.push_back(e);
  std::vector<std::vector<float>> values;
  for (const auto& [n, s] : shapes) values.emplace_back(NumElements(s), 0.0f);
  std::vector<StateShardTensor> tensors;
  for (size_t i = 0; i < shapes.size(); ++i) {
    StateShardTensor t;
    t.name = shapes[i].first;
    t.layout.full_shape = shapes[i].second;
    t.values = t.adam_m = t.adam_v = values[i];
    tensors.push_back(t);
  }
  absl::StatusOr<std::string> file = WriteStateShardFile(dir, 0, 0, 1, 3, /*moments=*/true, tensors);
  EXPECT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE(WriteManifest(dir, ManifestFor(manifest, 3, {*file})).ok());
  return dir;
}

TEST(CheckpointManifestTest, ResumingALlamaCheckpointChecksItsArchitectureAndTensors) {
  const v1::JobSpec job = LlamaJob();
  const std::string dir = WriteLlamaCheckpoint("resume/llama", job, job);
  absl::StatusOr<FullState> ok = ValidateCheckpointForJob(dir, job);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->tensors.at("layers.1.self_attn.k_proj.weight").shape, (std::vector<int64_t>{8, 16}));

  // Another model in the job: the message names each field that differs.
  const struct {
    const char* what;
    void (*change)(v1::ModelSpec*);
    const char* fields;
  } models[] = {
      {"kv_heads", [](v1::ModelSpec* s) { s->set_kv_heads(4); }, "model.kv_heads 4 (checkpoint: 2)"},
      {"ffn_dim", [](v1::ModelSpec* s) { s->set_ffn_dim(32); }, "model.ffn_dim 32 (checkpoint: 24)"},
      {"rope_theta", [](v1::ModelSpec* s) { s->clear_rope_theta(); }, "model.rope_theta 10000 (checkpoint: 500000)"},
      {"norm_eps", [](v1::ModelSpec* s) { s->set_norm_eps(1e-5f); }, "model.norm_eps 1e-05 (checkpoint: 1e-06)"},
      {"tie_embeddings", [](v1::ModelSpec* s) { s->set_tie_embeddings(true); },
       "model.tie_embeddings true (checkpoint: false)"},
      {"arch", [](v1::ModelSpec* s) { s->clear_arch(); }, "model.arch \"gpt2\" (checkpoint: \"llama\")"},
  };
  for (const auto& c : models) {
    v1::JobSpec other = LlamaJob();
    c.change(other.mutable_model());
    absl::StatusOr<FullState> s = ValidateCheckpointForJob(dir, other);
    ASSERT_FALSE(s.ok()) << c.what;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << c.what;
    EXPECT_THAT(std::string(s.status().message()), HasSubstr("it is from another model")) << c.what;
    EXPECT_THAT(std::string(s.status().message()), HasSubstr(c.fields)) << c.what << ": " << s.status();
  }
  v1::JobSpec gpt2 = LlamaJob();
  gpt2.mutable_model()->clear_arch();
  EXPECT_THAT(std::string(ValidateCheckpointForJob(dir, gpt2).status().message()),
              HasSubstr("holds a Llama (arch llama) of layers 2"));

  // Shards of another model under an edited manifest: the shapes betray it.
  v1::JobSpec mha = LlamaJob();
  mha.mutable_model()->set_kv_heads(4);
  absl::StatusOr<FullState> s = ValidateCheckpointForJob(WriteLlamaCheckpoint("resume/edited", job, mha), mha);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.status().message()),
              HasSubstr("tensor layers.0.self_attn.k_proj.weight has shape [8, 16] but the job's model needs [16, 16] "
                        "(d_model 16, heads 4, kv_heads 4, ffn_dim 24)"));
  v1::JobSpec wide = LlamaJob();
  wide.mutable_model()->set_ffn_dim(32);
  s = ValidateCheckpointForJob(WriteLlamaCheckpoint("resume/wide", job, wide), wide);
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("mlp.down_proj.weight has shape [16, 24]"));
  v1::JobSpec tied = LlamaJob();
  tied.mutable_model()->set_tie_embeddings(true);
  s = ValidateCheckpointForJob(WriteLlamaCheckpoint("resume/untied", job, tied), tied);
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("lm_head.weight is an untied LM head"));
  s = ValidateCheckpointForJob(WriteLlamaCheckpoint("resume/tied", tied, job), job);
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("tensor lm_head.weight is missing"));
  s = ValidateCheckpointForJob(WriteLlamaCheckpoint("resume/deep", job, job, {{"layers.2.input_layernorm.weight", {16}}}),
                               job);
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("layers.2.input_layernorm.weight is not a block of a 2-layer"));
  s = ValidateCheckpointForJob(WriteLlamaCheckpoint("resume/foreign", job, job, {{"layers.1.mlp.c_fc.weight", {16}}}),
                               job);
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("layers.1.mlp.c_fc.weight is not a tensor of a Llama block"));
  v1::JobSpec shallow = LlamaJob();
  shallow.mutable_model()->set_layers(3);
  s = ValidateCheckpointForJob(WriteLlamaCheckpoint("resume/shallow", job, shallow), shallow);
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("holds 2 transformer blocks but the job's model has 3"));
}

// Job()'s GPT-2 (4 blocks, d_model 32) with MoE blocks 1 and 3: 4 experts,
// top 2, a capacity factor, a non-default load-balancing coefficient.
v1::JobSpec MoeJob() {
  v1::JobSpec job = Job();
  v1::MoeSpec* moe = job.mutable_model()->mutable_moe();
  moe->set_experts(4);
  moe->set_top_k(2);
  moe->set_every_n_layers(2);
  moe->set_capacity_factor(1.1);
  moe->set_aux_loss_coef(0.02f);
  return job;
}

TEST(CheckpointManifestTest, MoeManifestRoundTripsItsExpertsAndADenseOneIsUnchanged) {
  const std::string dir = NewDir("manifest/moe");
  ASSERT_TRUE(WriteFileAtomically(dir + "/chunk0-tp0.safetensors", "x").ok());
  // A dense manifest is written byte for byte as before MoE.
  ASSERT_TRUE(WriteManifest(dir, ManifestFor(Job(), 5, {"chunk0-tp0.safetensors"})).ok());
  EXPECT_EQ(*ReadFile(dir + "/manifest.json"),
            "{\n  \"format\": \"baton-checkpoint-v2\",\n  \"job\": \"demo\",\n  \"step\": 5,\n"
            "  \"model\": {\"layers\": 4, \"d_model\": 32, \"heads\": 4, \"vocab\": 40, \"seq_len\": 12},\n"
            "  \"layout\": {\"pp\": 2, \"tp\": 2, \"dp\": 1, \"virtual_stages\": 1, \"schedule\": \"1f1b\"},\n"
            "  \"files\": [\"chunk0-tp0.safetensors\"]\n}\n");
  EXPECT_FALSE(ModelShapeOf(Job()).moe());

  const v1::JobSpec job = MoeJob();
  const ModelShape shape = ModelShapeOf(job);
  EXPECT_TRUE(shape.moe());
  EXPECT_FALSE(shape.moe_block(0));
  EXPECT_TRUE(shape.moe_block(1));
  EXPECT_TRUE(shape.moe_block(3));
  ASSERT_TRUE(WriteManifest(dir, ManifestFor(job, 7, {"chunk0-tp0.safetensors"})).ok());
  EXPECT_THAT(*ReadFile(dir + "/manifest.json"),
              HasSubstr("\"seq_len\": 12, \"moe\": {\"experts\": 4, \"top_k\": 2, \"every_n_layers\": 2, "
                        "\"capacity_factor\": 1.1, \"aux_loss_coef\": 0.02}}"));
  absl::StatusOr<ManifestInfo> m = ReadManifest(dir);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE(m->model == shape);
  EXPECT_EQ(m->model.moe_experts, 4);
  EXPECT_EQ(m->model.moe_top_k, 2);
  EXPECT_EQ(m->model.moe_every, 2);
  EXPECT_EQ(m->model.moe_capacity_factor, 1.1) << "the double read back exactly";
  EXPECT_EQ(m->model.moe_aux_coef, 0.02f) << "the float read back exactly";
  EXPECT_THAT(DescribeModel(m->model), HasSubstr("a GPT of layers 4, d_model 32, heads 4, vocab 40, seq_len 12, MoE "
                                                 "of 4 experts (top_k 2, every_n_layers 2, capacity_factor 1.1, "
                                                 "aux_loss_coef 0.02)"));
  EXPECT_FALSE(m->model == ModelShapeOf(Job())) << "a dense model is another model";

  // The experts, top_k and which blocks are MoE are part of the model.
  for (void (*change)(v1::MoeSpec*) : {+[](v1::MoeSpec* s) { s->set_experts(8); },
                                       +[](v1::MoeSpec* s) { s->set_top_k(1); },
                                       +[](v1::MoeSpec* s) { s->set_every_n_layers(1); }}) {
    v1::JobSpec other = MoeJob();
    change(other.mutable_model()->mutable_moe());
    EXPECT_FALSE(m->model == ModelShapeOf(other)) << other.model().ShortDebugString();
  }
  // The capacity and the load-balancing coefficient shape the training, not
  // the weights: a resume may change them, as it may change train.lr.
  for (void (*change)(v1::MoeSpec*) : {+[](v1::MoeSpec* s) { s->set_capacity_factor(0); },
                                       +[](v1::MoeSpec* s) { s->clear_aux_loss_coef(); }}) {
    v1::JobSpec other = MoeJob();
    change(other.mutable_model()->mutable_moe());
    EXPECT_TRUE(m->model == ModelShapeOf(other)) << other.model().ShortDebugString();
  }
  // Unset fields take their defaults: every block, dropless, 0.01.
  v1::JobSpec defaults = MoeJob();
  defaults.mutable_model()->mutable_moe()->clear_every_n_layers();
  defaults.mutable_model()->mutable_moe()->clear_capacity_factor();
  defaults.mutable_model()->mutable_moe()->clear_aux_loss_coef();
  const ModelShape d = ModelShapeOf(defaults);
  EXPECT_EQ(d.moe_every, 1);
  EXPECT_EQ(d.moe_capacity_factor, 0);
  EXPECT_EQ(d.moe_aux_coef, 0.01f);

  // A Llama MoE records both its fields and the experts.
  v1::JobSpec llama = LlamaJob();
  llama.mutable_model()->mutable_moe()->set_experts(3);
  llama.mutable_model()->mutable_moe()->set_top_k(1);
  ASSERT_TRUE(WriteManifest(dir, ManifestFor(llama, 7, {"chunk0-tp0.safetensors"})).ok());
  EXPECT_THAT(*ReadFile(dir + "/manifest.json"),
              HasSubstr("\"tie_embeddings\": false, \"moe\": {\"experts\": 3, \"top_k\": 1, \"every_n_layers\": 1, "
                        "\"capacity_factor\": 0, \"aux_loss_coef\": 0.01}}"));
  m = ReadManifest(dir);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE(m->model == ModelShapeOf(llama));
  EXPECT_THAT(DescribeModel(m->model), HasSubstr("untied lm_head, MoE of 3 experts (top_k 1"));

  const struct {
    const char* moe;
    const char* error;
  } bad[] = {
      {R"("moe": 4)", "model.moe must be an object"},
      {R"("moe": {"top_k": 2, "every_n_layers": 1, "capacity_factor": 0, "aux_loss_coef": 0.01})", "experts"},
      {R"("moe": {"experts": 1, "top_k": 1, "every_n_layers": 1, "capacity_factor": 0, "aux_loss_coef": 0.01})",
       "model.moe.experts must be at least 2"},
      {R"("moe": {"experts": 4, "top_k": 5, "every_n_layers": 1, "capacity_factor": 0, "aux_loss_coef": 0.01})",
       "model.moe.top_k must be in [1, experts]"},
      {R"("moe": {"experts": 4, "top_k": 2, "every_n_layers": 0, "capacity_factor": 0, "aux_loss_coef": 0.01})",
       "model.moe.every_n_layers must be at least 1"},
      {R"("moe": {"experts": 4, "top_k": 2, "every_n_layers": 1, "capacity_factor": -1, "aux_loss_coef": 0.01})",
       "model.moe.capacity_factor must be a finite number >= 0"},
      {R"("moe": {"experts": 4, "top_k": 2, "every_n_layers": 1, "capacity_factor": 0})",
       "model.moe.aux_loss_coef must be a finite number >= 0"},
  };
  for (const auto& c : bad) {
    ASSERT_TRUE(WriteFileAtomically(dir + "/manifest.json",
                                    absl::StrCat(R"({"format": "baton-checkpoint-v2", "job": "j", "step": 1,
        "model": {"layers": 2, "d_model": 16, "heads": 4, "vocab": 16, "seq_len": 8, )", c.moe, R"(},
        "layout": {"pp": 1, "tp": 1, "dp": 1, "virtual_stages": 1}, "files": ["chunk0-tp0.safetensors"]})"))
                    .ok());
    absl::StatusOr<ManifestInfo> r = ReadManifest(dir);
    ASSERT_FALSE(r.ok()) << c.moe;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(c.error)) << c.moe;
  }
}

using Shapes = std::vector<std::pair<std::string, std::vector<int64_t>>>;

// A one-chunk, tp 1 checkpoint holding `shapes` (zeros, zero moments) whose
// manifest records `manifest`'s model.
std::string WriteCheckpoint(const std::string& name, const Shapes& shapes, const v1::JobSpec& manifest) {
  const std::string dir = NewDir(name);
  std::vector<std::vector<float>> values;
  for (const auto& [n, s] : shapes) values.emplace_back(NumElements(s), 0.0f);
  std::vector<StateShardTensor> tensors;
  for (size_t i = 0; i < shapes.size(); ++i) {
    StateShardTensor t;
    t.name = shapes[i].first;
    t.layout.full_shape = shapes[i].second;
    t.values = t.adam_m = t.adam_v = values[i];
    tensors.push_back(t);
  }
  absl::StatusOr<std::string> file = WriteStateShardFile(dir, 0, 0, 1, 3, /*moments=*/true, tensors);
  EXPECT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE(WriteManifest(dir, ManifestFor(manifest, 3, {*file})).ok());
  return dir;
}

// The tensors of `job`'s GPT-2 (blocks' MoE MLPs as ModelShapeOf(job) says).
Shapes Gpt2Shapes(const v1::JobSpec& job) {
  const ModelShape m = ModelShapeOf(job);
  const int64_t c = m.d_model, f = 4 * c;
  Shapes shapes = {{"wte", {m.vocab, c}}, {"wpe", {m.seq_len, c}}, {"ln_f.weight", {c}}, {"ln_f.bias", {c}}};
  for (int i = 0; i < m.layers; ++i) {
    const std::string p = absl::StrCat("h.", i, ".");
    for (auto& [n, s] : Shapes{{"ln_1.weight", {c}}, {"ln_1.bias", {c}}, {"attn.c_attn.weight", {3 * c, c}},
                               {"attn.c_attn.bias", {3 * c}}, {"attn.c_proj.weight", {c, c}},
                               {"attn.c_proj.bias", {c}}, {"ln_2.weight", {c}}, {"ln_2.bias", {c}}}) {
      shapes.push_back({p + n, s});
    }
    if (!m.moe_block(i)) {
      for (auto& [n, s] : Shapes{{"mlp.c_fc.weight", {f, c}}, {"mlp.c_fc.bias", {f}},
                                 {"mlp.c_proj.weight", {c, f}}, {"mlp.c_proj.bias", {c}}}) {
        shapes.push_back({p + n, s});
      }
      continue;
    }
    shapes.push_back({p + "mlp.router.weight", {m.moe_experts, c}});
    for (int e = 0; e < m.moe_experts; ++e) {
      shapes.push_back({absl::StrCat(p, "mlp.experts.", e, ".c_fc.weight"), {f, c}});
      shapes.push_back({absl::StrCat(p, "mlp.experts.", e, ".c_proj.weight"), {c, f}});
    }
  }
  return shapes;
}

// Resuming an MoE checkpoint: another MoE configuration (or a dense model)
// is refused naming each field that differs, as the Llama fields are, and
// shards that do not fit the job's MoE blocks are refused naming the tensor.
TEST(CheckpointManifestTest, ResumingAnMoeCheckpointChecksItsExpertsAndTensors) {
  const v1::JobSpec job = MoeJob();
  const std::string dir = WriteCheckpoint("resume/moe", Gpt2Shapes(job), job);
  absl::StatusOr<FullState> ok = ValidateCheckpointForJob(dir, job);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->tensors.at("h.1.mlp.router.weight").shape, (std::vector<int64_t>{4, 32}));
  const v1::JobSpec dense = Job();
  ASSERT_TRUE(ValidateCheckpointForJob(WriteCheckpoint("resume/dense", Gpt2Shapes(dense), dense), dense).ok());

  const struct {
    const char* what;
    void (*change)(v1::ModelSpec*);
    const char* fields;
  } models[] = {
      {"experts", [](v1::ModelSpec* s) { s->mutable_moe()->set_experts(8); }, "model.moe.experts 8 (checkpoint: 4)"},
      {"top_k", [](v1::ModelSpec* s) { s->mutable_moe()->set_top_k(1); }, "model.moe.top_k 1 (checkpoint: 2)"},
      {"every_n_layers", [](v1::ModelSpec* s) { s->mutable_moe()->clear_every_n_layers(); },
       "model.moe.every_n_layers 1 (checkpoint: 2)"},
      {"dense", [](v1::ModelSpec* s) { s->clear_moe(); }, "model.moe unset (checkpoint: 4 experts)"},
  };
  for (const auto& c : models) {
    v1::JobSpec other = MoeJob();
    c.change(other.mutable_model());
    absl::StatusOr<FullState> s = ValidateCheckpointForJob(dir, other);
    ASSERT_FALSE(s.ok()) << c.what;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << c.what;
    EXPECT_THAT(std::string(s.status().message()), HasSubstr("it is from another model")) << c.what;
    EXPECT_THAT(std::string(s.status().message()), HasSubstr(c.fields)) << c.what << ": " << s.status();
  }
  // The training knobs may change on a resume.
  v1::JobSpec knobs = MoeJob();
  knobs.mutable_model()->mutable_moe()->set_capacity_factor(1.25);
  knobs.mutable_model()->mutable_moe()->clear_aux_loss_coef();
  EXPECT_TRUE(ValidateCheckpointForJob(dir, knobs).ok());
  absl::StatusOr<FullState> s = ValidateCheckpointForJob(WriteCheckpoint("resume/was-dense", Gpt2Shapes(dense), dense), job);
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("model.moe set (checkpoint: a dense model)")) << s.status();

  // Shards that do not fit the manifest's (edited) MoE model.
  v1::JobSpec eight = MoeJob();
  eight.mutable_model()->mutable_moe()->set_experts(8);
  s = ValidateCheckpointForJob(WriteCheckpoint("resume/router", Gpt2Shapes(job), eight), eight);
  EXPECT_THAT(std::string(s.status().message()),
              HasSubstr("tensor h.1.mlp.router.weight has shape [4, 32] but the job's model needs [8, 32] "
                        "(d_model 32, experts 8)"));
  Shapes extra = Gpt2Shapes(job);
  extra.push_back({"h.1.mlp.experts.4.c_fc.weight", {128, 32}});
  s = ValidateCheckpointForJob(WriteCheckpoint("resume/expert4", extra, job), job);
  EXPECT_THAT(std::string(s.status().message()),
              HasSubstr("tensor h.1.mlp.experts.4.c_fc.weight is not a tensor of MoE block 1 (4 experts)"));
  extra = Gpt2Shapes(job);
  extra.push_back({"h.3.mlp.c_fc.bias", {128}});
  s = ValidateCheckpointForJob(WriteCheckpoint("resume/bias", extra, job), job);
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("h.3.mlp.c_fc.bias is not a tensor of MoE block 3"));
  v1::JobSpec every = MoeJob();
  every.mutable_model()->mutable_moe()->set_every_n_layers(4);  // block 3 only
  s = ValidateCheckpointForJob(WriteCheckpoint("resume/every", Gpt2Shapes(job), every), every);
  EXPECT_THAT(std::string(s.status().message()),
              HasSubstr("tensor h.1.mlp.experts.0.c_fc.weight is a tensor of an MoE block but block 1 of the job's "
                        "model is dense (model.moe.every_n_layers 4)"));
  s = ValidateCheckpointForJob(WriteCheckpoint("resume/edited-dense", Gpt2Shapes(job), dense), dense);
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("is dense (model.moe unset)"));

  // Llama's names: block_sparse_moe.gate and experts' w1, w3, w2.
  v1::JobSpec llama = LlamaJob();  // 2 blocks, d_model 16, ffn_dim 24
  llama.mutable_model()->mutable_moe()->set_experts(2);
  llama.mutable_model()->mutable_moe()->set_top_k(1);
  llama.mutable_model()->mutable_moe()->set_every_n_layers(2);  // block 1
  Shapes shapes = {{"embed_tokens.weight", {16, 16}}, {"norm.weight", {16}}, {"lm_head.weight", {16, 16}}};
  for (int i = 0; i < 2; ++i) {
    const std::string p = absl::StrCat("layers.", i, ".");
    for (auto& [n, sh] : Shapes{{"input_layernorm.weight", {16}}, {"self_attn.q_proj.weight", {16, 16}},
                                {"self_attn.k_proj.weight", {8, 16}}, {"self_attn.v_proj.weight", {8, 16}},
                                {"self_attn.o_proj.weight", {16, 16}}, {"post_attention_layernorm.weight", {16}}}) {
      shapes.push_back({p + n, sh});
    }
  }
  for (auto& [n, sh] : Shapes{{"mlp.gate_proj.weight", {24, 16}}, {"mlp.up_proj.weight", {24, 16}},
                              {"mlp.down_proj.weight", {16, 24}}}) {
    shapes.push_back({"layers.0." + n, sh});
  }
  shapes.push_back({"layers.1.block_sparse_moe.gate.weight", {2, 16}});
  for (int e = 0; e < 2; ++e) {
    const std::string p = absl::StrCat("layers.1.block_sparse_moe.experts.", e, ".");
    shapes.push_back({p + "w1.weight", {24, 16}});
    shapes.push_back({p + "w3.weight", {24, 16}});
    shapes.push_back({p + "w2.weight", {16, 24}});
  }
  ok = ValidateCheckpointForJob(WriteCheckpoint("resume/llama-moe", shapes, llama), llama);
  ASSERT_TRUE(ok.ok()) << ok.status();
  shapes.back().second = {24, 16};
  s = ValidateCheckpointForJob(WriteCheckpoint("resume/llama-moe-w2", shapes, llama), llama);
  EXPECT_THAT(std::string(s.status().message()),
              HasSubstr("tensor layers.1.block_sparse_moe.experts.1.w2.weight has shape [24, 16] but the job's model "
                        "needs [16, 24] (d_model 16, experts 2, ffn_dim 24)"));
  shapes.back().second = {16, 24};
  shapes.push_back({"layers.1.mlp.down_proj.weight", {16, 24}});
  s = ValidateCheckpointForJob(WriteCheckpoint("resume/llama-moe-mlp", shapes, llama), llama);
  EXPECT_THAT(std::string(s.status().message()),
              HasSubstr("layers.1.mlp.down_proj.weight is not a tensor of MoE block 1 (2 experts)"));
}

}  // namespace
}  // namespace baton::checkpoint
