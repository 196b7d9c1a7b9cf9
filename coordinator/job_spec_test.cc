#include "coordinator/job_spec.h"

#include <cmath>
#include <fstream>

#include "gtest/gtest.h"

namespace baton {
namespace {

constexpr char kGood[] = R"pb(
  name: "demo"
  model { layers: 4 d_model: 64 heads: 4 vocab: 32 seq_len: 16 }
  parallel { pp: 2 tp: 2 }
  schedule { kind: "1f1b" microbatches: 4 }
  train { steps: 10 micro_batch_size: 2 lr: 0.001 seed: 1 }
)pb";

v1::JobSpec Good() {
  absl::StatusOr<v1::JobSpec> job = ParseJobSpec(kGood, "test");
  EXPECT_TRUE(job.ok()) << job.status();
  return *job;
}

// Turns `job`'s model into a valid synthetic cost model (4 layers, tp 1).
void MakeSynthetic(v1::JobSpec* job) {
  job->clear_model();
  job->mutable_model()->set_layers(4);
  job->mutable_model()->mutable_synthetic()->set_forward_ms(20);
  job->mutable_model()->mutable_synthetic()->set_activation_bytes(4);
  job->mutable_parallel()->set_tp(1);
}

// Validates `job` and returns the error message ("" when valid).
std::string ErrorOf(const v1::JobSpec& job) { return std::string(ValidateJobSpec(job).message()); }

TEST(JobSpecTest, GoodSpecValidatesAndUnsetParallelFieldsMeanOne) {
  v1::JobSpec job = Good();
  EXPECT_EQ(ErrorOf(job), "");
  ParallelDims d = DimsOf(job);
  EXPECT_EQ(d.pp, 2);
  EXPECT_EQ(d.tp, 2);
  EXPECT_EQ(d.dp, 1);
  EXPECT_EQ(d.virtual_stages, 1);
  EXPECT_EQ(d.world_size(), 4);
}

TEST(JobSpecTest, JsonIsAcceptedToo) {
  auto job = ParseJobSpec(R"({"name": "j", "parallel": {"pp": 3}, "schedule": {"kind": "gpipe"}})", "json");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->name(), "j");
  EXPECT_EQ(DimsOf(*job).pp, 3);
}

TEST(JobSpecTest, UnknownFieldIsRejectedWithItsLine) {
  auto job = ParseJobSpec("name: \"x\"\nmodel { layerz: 3 }\n", "spec.textproto");
  ASSERT_FALSE(job.ok());
  EXPECT_NE(job.status().message().find("line 2"), std::string::npos) << job.status();
  EXPECT_NE(job.status().message().find("layerz"), std::string::npos) << job.status();
  auto json = ParseJobSpec(R"({"name": "j", "bogus": 1})", "spec.json");
  ASSERT_FALSE(json.ok());
  EXPECT_NE(json.status().message().find("bogus"), std::string::npos) << json.status();
}

TEST(JobSpecTest, EachInconsistencyNamesTheFieldAndTheFix) {
  struct Case {
    const char* what;
    void (*mutate)(v1::JobSpec*);
    const char* field;
    const char* fix;
  };
  const Case cases[] = {
      {"zero tp", [](v1::JobSpec* j) { j->mutable_parallel()->set_tp(0); }, "parallel.tp", ">= 1"},
      {"zero pp", [](v1::JobSpec* j) { j->mutable_parallel()->set_pp(0); }, "parallel.pp", ">= 1"},
      {"zero dp", [](v1::JobSpec* j) { j->mutable_parallel()->set_dp(0); }, "parallel.dp", ">= 1"},
      {"zero cp", [](v1::JobSpec* j) { j->mutable_parallel()->set_cp(0); }, "parallel.cp", ">= 1"},
      {"zero ep", [](v1::JobSpec* j) { j->mutable_parallel()->set_ep(0); }, "parallel.ep", ">= 1"},
      {"ep vs dp",
       [](v1::JobSpec* j) {
         j->mutable_parallel()->set_dp(4);
         j->mutable_parallel()->set_ep(3);
       },
       "parallel.ep", "must divide parallel.dp=4"},
      {"cp over a sequence that does not split", [](v1::JobSpec* j) { j->mutable_parallel()->set_cp(3); },
       "parallel.cp", "make model.seq_len a multiple of 2*cp"},
      {"ep without experts",
       [](v1::JobSpec* j) {
         j->mutable_parallel()->set_dp(2);
         j->mutable_parallel()->set_ep(2);
       },
       "parallel.ep", "is 2 but model.moe is unset"},
      {"heads vs d_model", [](v1::JobSpec* j) { j->mutable_model()->set_heads(3); }, "model.heads",
       "divides d_model"},
      {"tp vs heads",
       [](v1::JobSpec* j) {
         j->mutable_model()->set_heads(2);
         j->mutable_parallel()->set_tp(4);
       },
       "parallel.tp", "divides heads"},
      {"negative steps", [](v1::JobSpec* j) { j->mutable_train()->set_steps(-3); }, "train.steps", ">= 1"},
      {"unknown schedule", [](v1::JobSpec* j) { j->mutable_schedule()->set_kind("2f2b"); }, "schedule.kind",
       "gpipe, 1f1b, interleaved, zb-h1"},
      {"no microbatches", [](v1::JobSpec* j) { j->mutable_schedule()->set_microbatches(0); },
       "schedule.microbatches", ">= 1"},
      {"pp above layers", [](v1::JobSpec* j) { j->mutable_parallel()->set_pp(5); }, "model.layers",
       "lower pp"},
      {"interleaved without chunks", [](v1::JobSpec* j) { j->mutable_schedule()->set_kind("interleaved"); },
       "parallel.virtual_stages", ">= 2"},
      {"interleaved microbatches",
       [](v1::JobSpec* j) {
         j->mutable_schedule()->set_kind("interleaved");
         j->mutable_parallel()->set_virtual_stages(2);
         j->mutable_schedule()->set_microbatches(3);
       },
       "schedule.microbatches", "multiple of parallel.pp"},
      {"interleaved on one rank",
       [](v1::JobSpec* j) {
         j->mutable_schedule()->set_kind("interleaved");
         j->mutable_parallel()->set_pp(1);
         j->mutable_parallel()->set_virtual_stages(2);
       },
       "parallel.pp", "pp >= 2"},
      {"chunks without interleaved", [](v1::JobSpec* j) { j->mutable_parallel()->set_virtual_stages(2); },
       "parallel.virtual_stages", "interleaved"},
      {"a V with one chunk", [](v1::JobSpec* j) { j->mutable_schedule()->set_kind("zb-v"); },
       "parallel.virtual_stages", "set virtual_stages: 2"},
      {"a V with an odd chunk count",
       [](v1::JobSpec* j) {
         j->mutable_schedule()->set_kind("dualpipe-v");
         j->mutable_parallel()->set_pp(1);
         j->mutable_parallel()->set_virtual_stages(3);
       },
       "parallel.virtual_stages", "two chunks on every pipeline rank in a V"},
      {"dualpipe-v with few microbatches",
       [](v1::JobSpec* j) {
         j->mutable_schedule()->set_kind("dualpipe-v");
         j->mutable_parallel()->set_virtual_stages(2);
         j->mutable_schedule()->set_microbatches(3);
       },
       "schedule.microbatches", "at least 2 x parallel.pp = 4"},
      {"csv without its schedule", [](v1::JobSpec* j) { j->mutable_schedule()->set_kind("csv"); }, "schedule.csv",
       "needs the schedule in csv or csv_file"},
      {"csv text on another kind", [](v1::JobSpec* j) { j->mutable_schedule()->set_csv("0F0,0B0\n"); },
       "schedule.csv", "set kind: \"csv\""},
      {"csv rows against pp",
       [](v1::JobSpec* j) {
         j->mutable_schedule()->set_kind("csv");
         j->mutable_schedule()->set_csv("0F0,0B0\n");
       },
       "schedule.csv", "has 1 rows (pipeline ranks) but parallel.pp is 2"},
      {"csv microbatches",
       [](v1::JobSpec* j) {
         j->mutable_schedule()->set_kind("csv");
         j->mutable_schedule()->set_csv("0F0,0B0\n1F0,1B0\n");
       },
       "schedule.microbatches", "schedule.csv runs 1; set microbatches: 1"},
      {"csv with a malformed cell",
       [](v1::JobSpec* j) {
         j->mutable_schedule()->set_kind("csv");
         j->mutable_schedule()->set_csv("0F0,0B0\n1F0,1Z0\n");
       },
       "schedule.csv", "row 2 (rank 1), cell 2: '1Z0' has kind 'Z'"},
      {"csv naming",
       [](v1::JobSpec* j) {
         j->mutable_schedule()->set_kind("csv");
         j->mutable_schedule()->set_csv("0F0,0B0\n1F0,1B0\n");
         j->mutable_schedule()->set_csv_naming("old");
       },
       "schedule.csv_naming", "use auto, current (I/W/B) or legacy (B/W/BW)"},
      {"negative lr", [](v1::JobSpec* j) { j->mutable_train()->set_lr(-1); }, "train.lr", ">= 0"},
      {"missing name", [](v1::JobSpec* j) { j->clear_name(); }, "name", "must be set"},
      {"empty text file", [](v1::JobSpec* j) { j->mutable_data()->set_text_file(""); }, "data.text_file",
       "relative to the workers' --data_dir"},
      {"checkpoint without dir", [](v1::JobSpec* j) { j->mutable_checkpoint()->set_every_steps(5); },
       "checkpoint.dir", "must be set"},
      {"negative max_restarts", [](v1::JobSpec* j) { j->mutable_fault_tolerance()->set_max_restarts(-1); },
       "fault_tolerance.max_restarts", "between 0"},
      {"infinite replacement timeout",
       [](v1::JobSpec* j) { j->mutable_fault_tolerance()->set_replacement_timeout_s(1.0 / 0.0); },
       "fault_tolerance.replacement_timeout_s", "between 0 and 86400"},
      {"negative snapshot period",
       [](v1::JobSpec* j) { j->mutable_fault_tolerance()->set_snapshot_every_steps(-2); },
       "fault_tolerance.snapshot_every_steps", ">= 0"},
      {"keeping no checkpoint", [](v1::JobSpec* j) { j->mutable_checkpoint()->set_keep(0); },
       "checkpoint.keep", ">= 1"},
  };
  for (const Case& c : cases) {
    v1::JobSpec job = Good();
    c.mutate(&job);
    absl::Status s = ValidateJobSpec(job);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.what;
    EXPECT_NE(s.message().find(c.field), std::string::npos) << c.what << ": " << s;
    EXPECT_NE(s.message().find(c.fix), std::string::npos) << c.what << ": " << s;
  }
}

// Every size field has a hard cap, checked before anything is allocated for
// it (issue 12: layers 1e9, microbatches 1e9, seq_len 1e9, d_model 2^30,
// micro_batch_size 2e9 and steps INT64_MAX crashed or never ended).
TEST(JobSpecTest, EverySizeFieldHasACapThatNamesTheFieldAndTheLimit) {
  struct Case {
    const char* what;
    void (*mutate)(v1::JobSpec*);
    const char* field;
    const char* fix;
  };
  const Case cases[] = {
      {"layers 1e9", [](v1::JobSpec* j) { j->mutable_model()->set_layers(1000000000); }, "model.layers",
       "at most 1024"},
      {"d_model 2^30", [](v1::JobSpec* j) { j->mutable_model()->set_d_model(1 << 30); }, "model.d_model",
       "at most 65536"},
      {"heads", [](v1::JobSpec* j) { j->mutable_model()->set_heads(1 << 20); }, "model.heads", "at most 1024"},
      {"vocab", [](v1::JobSpec* j) { j->mutable_model()->set_vocab(2000000000); }, "model.vocab",
       "at most 1048576"},
      {"seq_len 1e9", [](v1::JobSpec* j) { j->mutable_model()->set_seq_len(1000000000); }, "model.seq_len",
       "at most 65536"},
      {"micro_batch_size 2e9", [](v1::JobSpec* j) { j->mutable_train()->set_micro_batch_size(2000000000); },
       "train.micro_batch_size", "at most 65536"},
      {"microbatches 1e9", [](v1::JobSpec* j) { j->mutable_schedule()->set_microbatches(1000000000); },
       "schedule.microbatches", "at most 65536"},
      {"steps INT64_MAX", [](v1::JobSpec* j) { j->mutable_train()->set_steps(INT64_MAX); }, "train.steps",
       "at most 100000000"},
      {"pp", [](v1::JobSpec* j) { j->mutable_parallel()->set_pp(1 << 30); }, "parallel.pp", "at most 65536"},
      {"tp", [](v1::JobSpec* j) { j->mutable_parallel()->set_tp(1 << 30); }, "parallel.tp", "at most 65536"},
      {"dp", [](v1::JobSpec* j) { j->mutable_parallel()->set_dp(1 << 30); }, "parallel.dp", "at most 65536"},
      {"cp", [](v1::JobSpec* j) { j->mutable_parallel()->set_cp(1 << 30); }, "parallel.cp", "at most 65536"},
      {"ep", [](v1::JobSpec* j) { j->mutable_parallel()->set_ep(1 << 30); }, "parallel.ep", "at most 65536"},
      {"world with cp", [](v1::JobSpec* j) { j->mutable_parallel()->set_cp(32768); }, "pp*tp*cp*dp = 131072",
       "at most 65536"},
      {"world", [](v1::JobSpec* j) { j->mutable_parallel()->set_dp(32768); }, "pp*tp*dp = 131072",
       "at most 65536"},
      {"virtual stages", [](v1::JobSpec* j) { j->mutable_parallel()->set_virtual_stages(1 << 20); },
       "parallel.virtual_stages", "at most 64"},
      {"checkpoint interval", [](v1::JobSpec* j) { j->mutable_checkpoint()->set_every_steps(INT64_MAX); },
       "checkpoint.every_steps", "at most"},
      {"schedule product p*m*v",
       [](v1::JobSpec* j) {
         j->mutable_model()->set_layers(64);
         j->mutable_parallel()->set_pp(64);
         j->mutable_parallel()->set_tp(1);
         j->mutable_schedule()->set_microbatches(65536);
       },
       "pp*microbatches*virtual_stages = 4194304", "at most 4096 here"},
      {"attention scores tensor",
       [](v1::JobSpec* j) {
         j->mutable_model()->set_seq_len(65536);
         j->mutable_train()->set_micro_batch_size(1);
       },
       "attention scores", "lower train.micro_batch_size"},
      {"logits tensor",
       [](v1::JobSpec* j) {
         j->mutable_model()->set_vocab(1 << 20);
         j->mutable_train()->set_micro_batch_size(4096);
       },
       "logits", "at most 2147483647"},
  };
  for (const Case& c : cases) {
    v1::JobSpec job = Good();
    c.mutate(&job);
    absl::Status s = ValidateJobSpec(job);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.what << ": " << s;
    EXPECT_NE(s.message().find(c.field), std::string::npos) << c.what << ": " << s;
    EXPECT_NE(s.message().find(c.fix), std::string::npos) << c.what << ": " << s;
  }
}

TEST(JobSpecTest, SyntheticCostsAreBoundedToo) {
  v1::JobSpec job = Good();
  job.clear_model();
  job.mutable_model()->set_layers(4);
  job.mutable_parallel()->set_tp(1);
  v1::SyntheticCost* c = job.mutable_model()->mutable_synthetic();
  c->set_activation_bytes(64);
  EXPECT_EQ(ErrorOf(job), "");
  c->set_forward_ms(1e300);
  EXPECT_NE(ErrorOf(job).find("model.synthetic.forward_ms: is 1e+300; baton supports at most 60000"),
            std::string::npos)
      << ErrorOf(job);
  c->set_forward_ms(1);
  c->set_activation_bytes(int64_t{1} << 40);
  EXPECT_NE(ErrorOf(job).find("model.synthetic.activation_bytes"), std::string::npos) << ErrorOf(job);
  EXPECT_NE(ErrorOf(job).find("at most 1073741824"), std::string::npos) << ErrorOf(job);
  c->set_activation_bytes(0);  // the workers need one float per message
  EXPECT_NE(ErrorOf(job).find("must be >= 4"), std::string::npos) << ErrorOf(job);
}

TEST(JobSpecTest, TheLargestAllowedSizesStillValidate) {
  v1::JobSpec job = Good();
  job.mutable_model()->set_layers(JobLimits::kMaxLayers);
  job.mutable_parallel()->set_pp(64);
  job.mutable_schedule()->set_microbatches(JobLimits::kMaxScheduleCells / 64);
  job.mutable_train()->set_steps(JobLimits::kMaxSteps);
  EXPECT_EQ(ErrorOf(job), "");
}

TEST(JobSpecTest, SyntheticModelSkipsShapeChecksButNotCosts) {
  v1::JobSpec job = Good();
  MakeSynthetic(&job);
  EXPECT_EQ(ErrorOf(job), "");
  job.mutable_model()->mutable_synthetic()->set_forward_ms(-1);
  EXPECT_NE(ErrorOf(job).find("model.synthetic.forward_ms"), std::string::npos);
}

TEST(JobSpecTest, LoadJobSpecNamesTheFile) {
  std::string path = std::string(getenv("TEST_TMPDIR")) + "/bad.textproto";
  std::ofstream(path) << "name: \"x\"\nparallel { pp: 0 }\n";
  auto job = LoadJobSpec(path);
  ASSERT_FALSE(job.ok());
  EXPECT_NE(job.status().message().find(path), std::string::npos);
  EXPECT_NE(job.status().message().find("parallel.pp"), std::string::npos);
  EXPECT_EQ(LoadJobSpec("/nonexistent.textproto").status().code(), absl::StatusCode::kNotFound);
}

// schedule.csv_file is read beside the job file, bounded, and becomes
// schedule.csv; a missing file names both files.
TEST(JobSpecTest, LoadJobSpecReadsTheScheduleCsvBesideTheJobFile) {
  const std::string dir = ::testing::TempDir();
  std::ofstream(dir + "/v.csv") << "0F0,3F0,3B0,0B0\n1F0,2F0,2B0,1B0\n";
  const std::string job_text = R"pb(
    name: "v"
    model { layers: 4 d_model: 64 heads: 4 vocab: 32 seq_len: 16 }
    parallel { pp: 2 virtual_stages: 2 }
    schedule { kind: "csv" microbatches: 1 csv_file: "v.csv" }
    train { steps: 10 micro_batch_size: 2 lr: 0.001 seed: 1 }
  )pb";
  std::ofstream(dir + "/v.textproto") << job_text;
  auto job = LoadJobSpec(dir + "/v.textproto");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->schedule().csv(), "0F0,3F0,3B0,0B0\n1F0,2F0,2B0,1B0\n");
  EXPECT_TRUE(job->schedule().csv_file().empty());
  std::string missing = job_text;
  missing.replace(missing.find("v.csv"), 5, "gone.csv");
  std::ofstream(dir + "/missing.textproto") << missing;
  auto gone = LoadJobSpec(dir + "/missing.textproto");
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(gone.status().message().find("missing.textproto: schedule.csv_file"), std::string::npos) << gone.status();
  EXPECT_NE(gone.status().message().find("gone.csv"), std::string::npos) << gone.status();
}

TEST(JobSpecTest, LoadJobSpecRefusesDevicesDirectoriesAndHugeFiles) {
  for (const char* path : {"/dev/zero", "/dev/urandom", "/"}) {
    auto job = LoadJobSpec(path);
    ASSERT_FALSE(job.ok()) << path;
    EXPECT_NE(job.status().message().find("not a regular file"), std::string::npos) << job.status();
  }
  std::string path = std::string(getenv("TEST_TMPDIR")) + "/huge.textproto";
  {
    std::ofstream out(path);
    out << "name: \"x\"\n";
    for (int i = 0; i < 200000; ++i) out << "# padding padding\n";
  }
  auto job = LoadJobSpec(path);
  ASSERT_FALSE(job.ok());
  EXPECT_NE(job.status().message().find("larger than 1048576 bytes"), std::string::npos) << job.status();
}

TEST(JobSpecTest, TokenFormatIsKnownAndOnlyWithTokensFile) {
  v1::JobSpec job = Good();
  job.mutable_data()->set_tokens_file("fineweb/train_*.bin");
  EXPECT_EQ(ErrorOf(job), "");  // a glob; the workers expand it under their --data_dir
  for (const char* format : {"raw_uint16", "raw_uint32", "llmc", "megatron"}) {
    job.mutable_data()->set_token_format(format);
    EXPECT_EQ(ErrorOf(job), "") << format;
  }
  job.mutable_data()->set_token_format("bpe");
  EXPECT_NE(ErrorOf(job).find("data.token_format"), std::string::npos) << ErrorOf(job);
  EXPECT_NE(ErrorOf(job).find("\"megatron\""), std::string::npos) << ErrorOf(job);
  job.mutable_data()->set_text_file("corpus.txt");
  job.mutable_model()->set_vocab(256);
  job.mutable_data()->set_token_format("llmc");
  EXPECT_NE(ErrorOf(job).find("data.token_format"), std::string::npos) << ErrorOf(job);
  EXPECT_NE(ErrorOf(job).find("tokens_file only"), std::string::npos) << ErrorOf(job);
  job.mutable_data()->set_tokens_file("");
  job.mutable_data()->clear_token_format();
  EXPECT_NE(ErrorOf(job).find("data.tokens_file"), std::string::npos) << ErrorOf(job);
}

TEST(JobSpecTest, EvaluationNeedsItsDataAndBoundedBatchesAndNamesTheirFields) {
  v1::JobSpec job = Good();
  job.mutable_train()->set_eval_every_steps(5);
  EXPECT_NE(ErrorOf(job).find("train.eval_data: must name the held-out data"), std::string::npos) << ErrorOf(job);
  job.mutable_train()->mutable_eval_data()->set_tokens_file("val/*.bin");
  job.mutable_train()->mutable_eval_data()->set_token_format("llmc");
  EXPECT_EQ(ErrorOf(job), "");
  job.mutable_train()->set_eval_steps(0);
  EXPECT_NE(ErrorOf(job).find("train.eval_steps: is 0; must be >= 1"), std::string::npos) << ErrorOf(job);
  job.mutable_train()->set_eval_steps(JobLimits::kMaxEvalSteps + 1);
  EXPECT_NE(ErrorOf(job).find("train.eval_steps"), std::string::npos) << ErrorOf(job);
  job.mutable_train()->set_eval_steps(JobLimits::kMaxEvalSteps);
  EXPECT_EQ(ErrorOf(job), "");
  // The eval data is checked like data, under its own field names.
  job.mutable_train()->mutable_eval_data()->set_token_format("bpe");
  EXPECT_NE(ErrorOf(job).find("train.eval_data.token_format"), std::string::npos) << ErrorOf(job);
  job.mutable_train()->mutable_eval_data()->set_text_file("val.txt");
  job.mutable_train()->mutable_eval_data()->clear_token_format();
  EXPECT_NE(ErrorOf(job).find("train.eval_data.text_file is byte-level and needs 256"), std::string::npos)
      << ErrorOf(job);
  job.mutable_train()->mutable_eval_data()->set_tokens_file("");
  EXPECT_NE(ErrorOf(job).find("train.eval_data.tokens_file: is empty"), std::string::npos) << ErrorOf(job);
  job.mutable_train()->set_eval_every_steps(-1);
  EXPECT_NE(ErrorOf(job).find("train.eval_every_steps"), std::string::npos) << ErrorOf(job);
  // Eval fields without eval_every_steps would silently do nothing.
  job.mutable_train()->set_eval_every_steps(0);
  EXPECT_NE(ErrorOf(job).find("train.eval_every_steps: is 0 (never)"), std::string::npos) << ErrorOf(job);
  job.mutable_train()->clear_eval_data();
  job.mutable_train()->clear_eval_steps();
  EXPECT_EQ(ErrorOf(job), "");
  // The synthetic cost model computes no loss.
  MakeSynthetic(&job);
  EXPECT_EQ(ErrorOf(job), "");
  job.mutable_train()->set_eval_every_steps(1);
  job.mutable_train()->mutable_eval_data()->mutable_synthetic();
  EXPECT_NE(ErrorOf(job).find("synthetic cost model has no loss"), std::string::npos) << ErrorOf(job);
}

TEST(JobSpecTest, ExpertParallelismOfADenseModelIsPlannedButRefusedAndContextParallelismRuns) {
  v1::JobSpec job = Good();  // pp 2, tp 2, seq_len 16
  EXPECT_EQ(DimsOf(job).cp, 1) << "unset cp means 1";
  EXPECT_EQ(DimsOf(job).ep, 1) << "unset ep means 1";
  job.mutable_parallel()->set_cp(1);
  job.mutable_parallel()->set_ep(1);
  EXPECT_EQ(ErrorOf(job), "") << "an explicit 1 is fine";

  job.mutable_parallel()->set_cp(2);
  job.mutable_parallel()->set_dp(4);
  job.mutable_parallel()->set_ep(2);
  const ParallelDims d = DimsOf(job);
  EXPECT_EQ(d.cp, 2);
  EXPECT_EQ(d.ep, 2);
  EXPECT_EQ(d.world_size(), 2 * 2 * 2 * 4) << "cp adds ranks, ep does not";
  // Consistent apart from ep on a dense model: the planner may plan its mesh...
  EXPECT_TRUE(ValidateJobSpecAllowingPlannedAxes(job).ok()) << ValidateJobSpecAllowingPlannedAxes(job);
  // ...but no job runs it: this one has no experts to split.
  EXPECT_NE(ErrorOf(job).find("parallel.ep: is 2 but model.moe is unset: expert parallelism splits the experts"),
            std::string::npos)
      << ErrorOf(job);
  EXPECT_NE(ErrorOf(job).find("a dense model has none; leave ep unset, or set model.moe"), std::string::npos)
      << ErrorOf(job);
  EXPECT_EQ(ErrorOf(job).find("yet"), std::string::npos) << "ep is not a missing feature of a dense model";
  job.mutable_parallel()->clear_ep();
  EXPECT_EQ(ErrorOf(job), "") << "cp = 2 runs";
  job.mutable_parallel()->clear_cp();
  EXPECT_EQ(ErrorOf(job), "");

  // The planned axis's own checks hold either way.
  job.mutable_parallel()->set_ep(3);
  const absl::Status allowing = ValidateJobSpecAllowingPlannedAxes(job);
  EXPECT_NE(allowing.message().find("parallel.ep: is 3 and must divide parallel.dp=4"), std::string::npos)
      << allowing;
  job.mutable_parallel()->set_ep(1);
  job.mutable_parallel()->set_cp(0);
  EXPECT_NE(std::string(ValidateJobSpecAllowingPlannedAxes(job).message()).find("parallel.cp"), std::string::npos);
  // And the rest of the spec is still checked with them set.
  job.mutable_parallel()->set_cp(2);
  job.mutable_model()->set_heads(3);
  EXPECT_NE(std::string(ValidateJobSpecAllowingPlannedAxes(job).message()).find("model.heads"), std::string::npos);
}

TEST(JobSpecTest, ContextParallelismIsAcceptedOnARealFp32ModelWhoseSequencesSplit) {
  v1::JobSpec job = Good();  // pp 2, tp 2, seq_len 16, micro_batch_size 2
  job.mutable_parallel()->set_cp(2);
  EXPECT_EQ(ErrorOf(job), "");
  EXPECT_EQ(DimsOf(job).world_size(), 2 * 2 * 2) << "cp multiplies the ranks";
  job.mutable_parallel()->set_cp(8);  // 16 tokens in 16 chunks of one
  EXPECT_EQ(ErrorOf(job), "");
  job.mutable_train()->set_precision("fp32");
  EXPECT_EQ(ErrorOf(job), "") << "fp32 spelled out";
  // With dp*cp >= 2 ranks in the data-parallel group, ZeRO 1 has something
  // to shard even at dp 1.
  job.mutable_parallel()->set_cp(2);
  job.mutable_parallel()->set_zero_stage(1);
  EXPECT_EQ(ErrorOf(job), "");
  // Sequence parallelism splits the seq_len / cp tokens of a rank: 2 * 16 / 2
  // = 16 over tp 2.
  job.mutable_parallel()->set_sequence_parallel(true);
  EXPECT_EQ(ErrorOf(job), "");
}

TEST(JobSpecTest, ContextParallelismOnASyntheticModelNamesParallelCp) {
  v1::JobSpec job = Good();
  MakeSynthetic(&job);
  EXPECT_EQ(ErrorOf(job), "");
  job.mutable_parallel()->set_cp(2);
  const std::string error = ErrorOf(job);
  EXPECT_NE(error.find("parallel.cp: is 2 but model.synthetic is set"), std::string::npos) << error;
  EXPECT_NE(error.find("no attention to split"), std::string::npos) << error;
  EXPECT_NE(error.find("leave cp unset (1), or train a real model"), std::string::npos) << error;
  EXPECT_FALSE(ValidateJobSpecAllowingPlannedAxes(job).ok()) << "not a planned axis any more";
}

TEST(JobSpecTest, ContextParallelismNeedsSequencesThatSplitIntoTwoChunksPerRank) {
  v1::JobSpec job = Good();  // seq_len 16
  job.mutable_parallel()->set_cp(3);  // 16 is not a multiple of 6
  std::string error = ErrorOf(job);
  EXPECT_NE(error.find("parallel.cp: is 3 and splits every sequence into 2*cp = 6 equal chunks"), std::string::npos)
      << error;
  EXPECT_NE(error.find("model.seq_len = 16 does not divide by 6"), std::string::npos) << error;
  EXPECT_NE(error.find("make model.seq_len a multiple of 2*cp"), std::string::npos) << error;
  // cp = 16: 32 chunks of 16 tokens would be half a token each.
  job.mutable_parallel()->set_cp(16);
  error = ErrorOf(job);
  EXPECT_NE(error.find("model.seq_len = 16 does not divide by 32"), std::string::npos) << error;
  job.mutable_model()->set_seq_len(24);
  job.mutable_parallel()->set_cp(3);
  EXPECT_EQ(ErrorOf(job), "");
}

TEST(JobSpecTest, ContextParallelismRunsInBf16) {
  v1::JobSpec job = Good();
  job.mutable_train()->set_precision("bf16");
  job.mutable_parallel()->set_cp(2);
  EXPECT_EQ(ErrorOf(job), "");
}

TEST(JobSpecTest, SequenceParallelWithContextParallelSplitsEachRanksTokens) {
  v1::JobSpec job = Good();  // tp 2
  job.mutable_parallel()->set_tp(4);
  job.mutable_train()->set_micro_batch_size(1);
  job.mutable_parallel()->set_sequence_parallel(true);
  EXPECT_EQ(ErrorOf(job), "") << "16 tokens over tp 4";
  job.mutable_parallel()->set_cp(8);  // 16 / 8 = 2 tokens per CP rank, not over 4 TP ranks
  const std::string error = ErrorOf(job);
  EXPECT_NE(error.find("parallel.sequence_parallel: is true but a microbatch's train.micro_batch_size * "
                       "model.seq_len / parallel.cp = 2 tokens per context-parallel rank do not split over "
                       "parallel.tp = 4"),
            std::string::npos)
      << error;
  job.mutable_parallel()->set_cp(2);  // 8 per CP rank
  EXPECT_EQ(ErrorOf(job), "");
}

TEST(JobSpecTest, ZeroStageOneIsAcceptedOnTwoDataParallelRanks) {
  v1::JobSpec job = Good();  // pp 2, tp 2
  EXPECT_EQ(DimsOf(job).zero_stage, 0) << "unset zero_stage means 0";
  EXPECT_FALSE(DimsOf(job).sharded_optimizer());
  job.mutable_parallel()->set_dp(2);
  job.mutable_parallel()->set_zero_stage(1);
  EXPECT_EQ(ErrorOf(job), "");
  const ParallelDims d = DimsOf(job);
  EXPECT_EQ(d.zero_stage, 1);
  EXPECT_TRUE(d.sharded_optimizer());
  EXPECT_EQ(d.world_size(), 2 * 2 * 2) << "ZeRO adds no ranks";
  job.mutable_parallel()->set_zero_stage(0);
  EXPECT_EQ(ErrorOf(job), "") << "an explicit 0 is fine";
  job.mutable_parallel()->clear_dp();
  EXPECT_EQ(ErrorOf(job), "") << "zero_stage 0 needs no dp";
}

TEST(JobSpecTest, SequenceParallelNeedsATensorParallelGroupAndTokensThatSplit) {
  v1::JobSpec job = Good();  // pp 2, tp 2
  EXPECT_FALSE(DimsOf(job).sequence_parallel) << "unset means off";
  job.mutable_parallel()->set_sequence_parallel(true);
  EXPECT_EQ(ErrorOf(job), "");
  EXPECT_TRUE(DimsOf(job).sequence_parallel);
  EXPECT_EQ(DimsOf(job).world_size(), 2 * 2) << "SP adds no ranks";

  job.mutable_parallel()->clear_tp();
  std::string error = ErrorOf(job);
  EXPECT_NE(error.find("parallel.sequence_parallel: is true but parallel.tp = 1"), std::string::npos) << error;
  EXPECT_NE(error.find("set tp >= 2 or sequence_parallel false"), std::string::npos) << error;

  job = Good();
  job.mutable_parallel()->set_sequence_parallel(true);
  job.mutable_parallel()->set_tp(4);
  job.mutable_model()->set_heads(4);
  job.mutable_train()->set_micro_batch_size(1);
  job.mutable_model()->set_seq_len(6);  // 6 tokens over 4 ranks
  error = ErrorOf(job);
  EXPECT_NE(error.find("parallel.sequence_parallel: is true but a microbatch's train.micro_batch_size * "
                       "model.seq_len = 6 tokens do not split over parallel.tp = 4"),
            std::string::npos)
      << error;
  job.mutable_model()->set_seq_len(8);
  EXPECT_EQ(ErrorOf(job), "");
}

TEST(JobSpecTest, EachBadZeroStageNamesTheFieldAndTheFix) {
  v1::JobSpec job = Good();
  job.mutable_parallel()->set_dp(2);
  for (int stage : {-1, 4, 100}) {
    job.mutable_parallel()->set_zero_stage(stage);
    const std::string error = ErrorOf(job);
    EXPECT_NE(error.find("parallel.zero_stage: is " + std::to_string(stage) + "; ZeRO stages are 0 to 3"),
              std::string::npos)
        << error;
    EXPECT_NE(error.find("set 0 or 1"), std::string::npos) << error;
  }
  for (int stage : {2, 3}) {
    job.mutable_parallel()->set_zero_stage(stage);
    const std::string error = ErrorOf(job);
    EXPECT_NE(error.find("parallel.zero_stage: is " + std::to_string(stage) +
                         "; stages 2 and 3 (sharded gradients / parameters) are not implemented yet: use 1 "
                         "(sharded optimizer state) or 0"),
              std::string::npos)
        << error;
    // Not a planned axis: refused for planning too.
    EXPECT_FALSE(ValidateJobSpecAllowingPlannedAxes(job).ok()) << stage;
  }

  job.mutable_parallel()->set_zero_stage(1);
  job.mutable_parallel()->set_dp(1);
  std::string error = ErrorOf(job);
  EXPECT_NE(error.find("parallel.zero_stage: is 1 and shards the optimizer state over the data-parallel ranks; "
                       "with parallel.dp = 1 there is nothing to shard: set dp >= 2 or zero_stage 0"),
            std::string::npos)
      << error;
  job.mutable_parallel()->clear_dp();  // unset dp is 1 as well
  EXPECT_NE(ErrorOf(job).find("parallel.dp = 1"), std::string::npos) << ErrorOf(job);

  MakeSynthetic(&job);
  job.mutable_parallel()->set_dp(2);
  job.mutable_parallel()->set_zero_stage(1);
  error = ErrorOf(job);
  EXPECT_NE(error.find("parallel.zero_stage: is 1 but model.synthetic is set, and synthetic stages hold no "
                       "optimizer state"),
            std::string::npos)
      << error;
  job.mutable_parallel()->set_zero_stage(0);
  EXPECT_EQ(ErrorOf(job), "") << "the synthetic job itself is valid";
}

}  // namespace
}  // namespace baton

namespace baton {
namespace {

// A Llama model with grouped-query attention (8 query heads sharing 4
// key/value heads), an MLP width that is not 4 * d_model, Llama 3's rotary
// base, an untied head, on pp 2 x tp 2 x dp 2.
constexpr char kGoodLlama[] = R"pb(
  name: "llama"
  model {
    arch: "llama"
    layers: 4
    d_model: 64
    heads: 8
    kv_heads: 4
    ffn_dim: 96
    vocab: 32
    seq_len: 16
    rope_theta: 500000
    norm_eps: 1e-6
    tie_embeddings: false
  }
  parallel { pp: 2 tp: 2 dp: 2 }
  schedule { kind: "1f1b" microbatches: 4 }
  train { steps: 10 micro_batch_size: 2 lr: 0.001 seed: 1 }
)pb";

v1::JobSpec GoodLlama() {
  absl::StatusOr<v1::JobSpec> job = ParseJobSpec(kGoodLlama, "test");
  EXPECT_TRUE(job.ok()) << job.status();
  return *job;
}

TEST(JobSpecTest, LlamaSpecValidatesOnPipelineTensorAndDataParallelRanks) {
  v1::JobSpec job = GoodLlama();
  EXPECT_EQ(ErrorOf(job), "");
  EXPECT_EQ(DimsOf(job).world_size(), 8);
  // The Llama fields all have defaults: unset, they give multi-head attention,
  // a 4 * d_model MLP, theta 10000, eps 1e-5 and an untied head.
  v1::ModelSpec* m = job.mutable_model();
  m->clear_kv_heads();
  m->clear_ffn_dim();
  m->clear_rope_theta();
  m->clear_norm_eps();
  m->clear_tie_embeddings();
  EXPECT_EQ(ErrorOf(job), "");
  // kv_heads = 1 (multi-query attention) without TP; kv_heads = heads.
  job = GoodLlama();
  job.mutable_model()->set_kv_heads(1);
  job.mutable_parallel()->set_tp(1);
  EXPECT_EQ(ErrorOf(job), "");
  job.mutable_model()->set_kv_heads(8);
  EXPECT_EQ(ErrorOf(job), "");
}

TEST(JobSpecTest, GptTwoTakesExplicitArchAndLlamaFieldsAtGptTwosValues) {
  v1::JobSpec job = Good();
  job.mutable_model()->set_arch("gpt2");
  job.mutable_model()->set_kv_heads(4);      // = heads
  job.mutable_model()->set_ffn_dim(256);     // = 4 * d_model
  job.mutable_model()->set_rope_theta(10000);
  job.mutable_model()->set_norm_eps(1e-5f);
  job.mutable_model()->set_tie_embeddings(true);
  EXPECT_EQ(ErrorOf(job), "");
}

TEST(JobSpecTest, EachBadArchitectureFieldNamesTheFieldAndTheFix) {
  struct Case {
    const char* what;
    bool llama;  // mutate GoodLlama(), else Good() (GPT-2, heads 4, d_model 64, tp 2)
    void (*mutate)(v1::JobSpec*);
    const char* field;
    const char* fix;
  };
  const Case cases[] = {
      {"unknown arch", true, [](v1::JobSpec* j) { j->mutable_model()->set_arch("mistral"); }, "model.arch",
       "is \"mistral\"; use \"gpt2\" (the default) or \"llama\""},
      {"zero kv_heads", true, [](v1::JobSpec* j) { j->mutable_model()->set_kv_heads(0); }, "model.kv_heads",
       "must be >= 1 (leave it unset for model.heads)"},
      {"negative kv_heads", false, [](v1::JobSpec* j) { j->mutable_model()->set_kv_heads(-4); }, "model.kv_heads",
       "must be >= 1"},
      {"huge kv_heads", true, [](v1::JobSpec* j) { j->mutable_model()->set_kv_heads(1 << 30); }, "model.kv_heads",
       "at most 1024"},
      {"kv_heads not dividing heads", true, [](v1::JobSpec* j) { j->mutable_model()->set_kv_heads(3); },
       "model.kv_heads", "does not divide model.heads=8; grouped-query attention"},
      {"kv_heads above heads", true, [](v1::JobSpec* j) { j->mutable_model()->set_kv_heads(16); },
       "model.kv_heads", "does not divide model.heads=8"},
      {"tp not dividing kv_heads", true, [](v1::JobSpec* j) { j->mutable_model()->set_kv_heads(1); },
       "parallel.tp", "must divide model.kv_heads=1; each tensor-parallel rank holds whole key/value heads"},
      {"zero ffn_dim", true, [](v1::JobSpec* j) { j->mutable_model()->set_ffn_dim(0); }, "model.ffn_dim",
       "must be >= 1 (leave it unset for 4 * model.d_model)"},
      {"ffn_dim 2^30, refused before anything is sized from it", true,
       [](v1::JobSpec* j) { j->mutable_model()->set_ffn_dim(1 << 30); }, "model.ffn_dim", "at most 262144"},
      {"tp not dividing ffn_dim", true, [](v1::JobSpec* j) { j->mutable_model()->set_ffn_dim(97); }, "parallel.tp",
       "does not divide the MLP width model.ffn_dim=97"},
      {"odd head_dim", true,
       [](v1::JobSpec* j) {
         j->mutable_model()->set_d_model(72);  // 72 / 8 = 9
       },
       "model.heads", "head_dim = d_model/heads = 9 odd"},
      {"rope_theta 1", true, [](v1::JobSpec* j) { j->mutable_model()->set_rope_theta(1); }, "model.rope_theta",
       "must be a finite number > 1"},
      {"negative rope_theta", true, [](v1::JobSpec* j) { j->mutable_model()->set_rope_theta(-5); },
       "model.rope_theta", "must be a finite number > 1"},
      {"infinite rope_theta", true, [](v1::JobSpec* j) { j->mutable_model()->set_rope_theta(1.0f / 0.0f); },
       "model.rope_theta", "Llama 3: 500000"},
      {"zero norm_eps", true, [](v1::JobSpec* j) { j->mutable_model()->set_norm_eps(0); }, "model.norm_eps",
       "must be a finite number in (0, 1]"},
      {"norm_eps above 1", true, [](v1::JobSpec* j) { j->mutable_model()->set_norm_eps(2); }, "model.norm_eps",
       "(0, 1]"},
      {"NaN norm_eps", true, [](v1::JobSpec* j) { j->mutable_model()->set_norm_eps(std::nanf("")); },
       "model.norm_eps", "(0, 1]"},
      {"an MLP weight too large for one tensor", true,
       [](v1::JobSpec* j) {
         j->mutable_model()->set_d_model(16384);
         j->mutable_model()->set_ffn_dim(262144);
       },
       "MLP weight (d_model * MLP width)", "model.ffn_dim"},
      // GPT-2 has none of Llama's knobs.
      {"kv_heads on GPT-2", false, [](v1::JobSpec* j) { j->mutable_model()->set_kv_heads(2); }, "model.kv_heads",
       "GPT-2 attention has model.heads=4 key/value heads; set model.arch: \"llama\""},
      {"ffn_dim on GPT-2", false, [](v1::JobSpec* j) { j->mutable_model()->set_ffn_dim(128); }, "model.ffn_dim",
       "GPT-2's MLP is 4*d_model=256 wide; set model.arch: \"llama\""},
      {"rope_theta on GPT-2", false, [](v1::JobSpec* j) { j->mutable_model()->set_rope_theta(500000); },
       "model.rope_theta", "GPT-2 has learned positions"},
      {"norm_eps on GPT-2", false, [](v1::JobSpec* j) { j->mutable_model()->set_norm_eps(1e-6f); },
       "model.norm_eps", "GPT-2's LayerNorm epsilon is 1e-5"},
      {"an untied head on GPT-2", false, [](v1::JobSpec* j) { j->mutable_model()->set_tie_embeddings(false); },
       "model.tie_embeddings", "GPT-2's LM head is its token embedding"},
      {"arch in another case", false, [](v1::JobSpec* j) { j->mutable_model()->set_arch("Llama"); }, "model.arch",
       "use \"gpt2\""},
  };
  for (const Case& c : cases) {
    v1::JobSpec job = c.llama ? GoodLlama() : Good();
    c.mutate(&job);
    absl::Status s = ValidateJobSpec(job);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.what << ": " << s;
    EXPECT_NE(s.message().find(c.field), std::string::npos) << c.what << ": " << s;
    EXPECT_NE(s.message().find(c.fix), std::string::npos) << c.what << ": " << s;
  }
}

// A GPT-2 MoE job (every second block, 4 experts, top 2) on pp 2 x tp 2 x dp 2.
v1::JobSpec GoodMoe() {
  v1::JobSpec job = Good();
  v1::MoeSpec* moe = job.mutable_model()->mutable_moe();
  moe->set_experts(4);
  moe->set_top_k(2);
  moe->set_every_n_layers(2);
  job.mutable_parallel()->set_dp(2);
  return job;
}

TEST(JobSpecTest, MoeValidatesWithPipelineTensorDataParallelismAndZero) {
  v1::JobSpec job = GoodMoe();
  EXPECT_EQ(ErrorOf(job), "");
  job.mutable_parallel()->set_zero_stage(1);
  job.mutable_parallel()->set_sequence_parallel(true);
  job.mutable_train()->set_precision("fp32");
  EXPECT_EQ(ErrorOf(job), "") << "ZeRO 1, SP and fp32 spelled out";
  // The limits themselves: top_k = experts, every_n_layers = layers (only the
  // last block), a capacity factor, no load-balancing loss, the most experts.
  v1::MoeSpec* moe = job.mutable_model()->mutable_moe();
  moe->set_top_k(4);
  moe->set_every_n_layers(4);
  moe->set_capacity_factor(1.25);
  moe->set_aux_loss_coef(0);
  EXPECT_EQ(ErrorOf(job), "");
  moe->set_experts(JobLimits::kMaxExperts);
  EXPECT_EQ(ErrorOf(job), "");
  // Unset every_n_layers is every block; Llama takes MoE too.
  job = GoodMoe();
  job.mutable_model()->mutable_moe()->clear_every_n_layers();
  EXPECT_EQ(ErrorOf(job), "");
  v1::JobSpec llama = GoodLlama();
  llama.mutable_model()->mutable_moe()->set_experts(8);
  llama.mutable_model()->mutable_moe()->set_top_k(2);
  EXPECT_EQ(ErrorOf(llama), "");
}

TEST(JobSpecTest, EachBadMoeFieldNamesTheFieldAndTheFix) {
  struct Case {
    const char* what;
    void (*mutate)(v1::JobSpec*);
    const char* field;
    const char* fix;
  };
  const Case cases[] = {
      {"an empty moe block", [](v1::JobSpec* j) { j->mutable_model()->mutable_moe()->Clear(); },
       "model.moe.experts: is 0; must be >= 2", "leave model.moe unset for a dense model"},
      {"one expert", [](v1::JobSpec* j) { j->mutable_model()->mutable_moe()->set_experts(1); },
       "model.moe.experts: is 1", "must be >= 2"},
      {"too many experts", [](v1::JobSpec* j) { j->mutable_model()->mutable_moe()->set_experts(1025); },
       "model.moe.experts: is 1025", "at most 1024"},
      {"top_k 0", [](v1::JobSpec* j) { j->mutable_model()->mutable_moe()->set_top_k(0); },
       "model.moe.top_k: is 0", "must be in [1, model.moe.experts = 4]"},
      {"top_k above experts", [](v1::JobSpec* j) { j->mutable_model()->mutable_moe()->set_top_k(5); },
       "model.moe.top_k: is 5", "must be in [1, model.moe.experts = 4]: the experts each token is sent to"},
      {"negative every_n_layers", [](v1::JobSpec* j) { j->mutable_model()->mutable_moe()->set_every_n_layers(-1); },
       "model.moe.every_n_layers: is -1", "must be in [0, model.layers = 4]"},
      {"every_n_layers above layers",
       [](v1::JobSpec* j) { j->mutable_model()->mutable_moe()->set_every_n_layers(5); },
       "model.moe.every_n_layers: is 5", "(i + 1) % every_n_layers == 0"},
      {"negative capacity_factor",
       [](v1::JobSpec* j) { j->mutable_model()->mutable_moe()->set_capacity_factor(-0.5); },
       "model.moe.capacity_factor: is -0.5", "must be a finite number in [0, 1e+06] (0, unset: dropless"},
      {"NaN capacity_factor",
       [](v1::JobSpec* j) { j->mutable_model()->mutable_moe()->set_capacity_factor(std::nan("")); },
       "model.moe.capacity_factor: is nan", "must be a finite number"},
      {"infinite capacity_factor",
       [](v1::JobSpec* j) { j->mutable_model()->mutable_moe()->set_capacity_factor(1.0 / 0.0); },
       "model.moe.capacity_factor: is inf", "must be a finite number"},
      {"negative aux_loss_coef",
       [](v1::JobSpec* j) { j->mutable_model()->mutable_moe()->set_aux_loss_coef(-0.01f); },
       "model.moe.aux_loss_coef: is -0.01", "must be a finite number >= 0 (unset: 0.01"},
      {"NaN aux_loss_coef",
       [](v1::JobSpec* j) { j->mutable_model()->mutable_moe()->set_aux_loss_coef(std::nanf("")); },
       "model.moe.aux_loss_coef: is nan", "must be a finite number >= 0"},
      {"on a synthetic model",
       [](v1::JobSpec* j) {
         MakeSynthetic(j);
         j->mutable_model()->mutable_moe()->set_experts(4);
         j->mutable_model()->mutable_moe()->set_top_k(1);
       },
       "model.moe: is set but model.synthetic is set", "remove model.moe, or train a real model"},
      {"ep not dividing dp",
       [](v1::JobSpec* j) { j->mutable_parallel()->set_ep(4); },
       "parallel.ep: is 4 and must divide parallel.dp=2", "choose ep that divides dp"},
      {"ep not dividing the experts",
       [](v1::JobSpec* j) {
         j->mutable_model()->mutable_moe()->set_experts(6);
         j->mutable_parallel()->set_dp(4);
         j->mutable_parallel()->set_ep(4);
       },
       "parallel.ep: is 4 and must divide model.moe.experts=6", "choose ep that divides experts"},
      {"ep = dp with ZeRO 1",
       [](v1::JobSpec* j) {
         j->mutable_parallel()->set_ep(2);
         j->mutable_parallel()->set_zero_stage(1);
       },
       "parallel.zero_stage: is 1 with parallel.ep = parallel.dp = 2",
       "ZeRO shards over the dp / ep ranks holding the same experts, and here there is one: raise dp above ep"},
      {"router probabilities too large for one tensor",
       [](v1::JobSpec* j) {
         // 6000 x 512 tokens: attention's 1 x 512 per token fits, 1024 experts' do not.
         j->mutable_model()->set_seq_len(512);
         j->mutable_model()->set_heads(1);
         j->mutable_parallel()->set_tp(1);
         j->mutable_train()->set_micro_batch_size(6000);
         j->mutable_model()->mutable_moe()->set_experts(1024);
       },
       "model.moe: the MoE router probabilities", "model.moe.experts"},
  };
  for (const Case& c : cases) {
    v1::JobSpec job = GoodMoe();
    c.mutate(&job);
    absl::Status s = ValidateJobSpec(job);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.what << ": " << s;
    EXPECT_NE(s.message().find(c.field), std::string::npos) << c.what << ": " << s;
    EXPECT_NE(s.message().find(c.fix), std::string::npos) << c.what << ": " << s;
  }
}

// The worker's bounds (worker/model/gpt_config.h), restated for the
// coordinator: the two must move together.
TEST(JobSpecTest, MoeLimitsAreTheWorkers) {
  EXPECT_EQ(JobLimits::kMaxExperts, 1024);
  EXPECT_EQ(JobLimits::kMaxCapacityFactor, 1e6);
}

TEST(JobSpecTest, ExpertParallelismRunsOnAnMoeModelWhoseExpertsSplit) {
  v1::JobSpec job = GoodMoe();  // pp 2, tp 2, dp 2, 4 experts
  job.mutable_parallel()->set_ep(2);
  EXPECT_EQ(ErrorOf(job), "");
  EXPECT_TRUE(ValidateJobSpecAllowingPlannedAxes(job).ok()) << ValidateJobSpecAllowingPlannedAxes(job);
  EXPECT_EQ(DimsOf(job).world_size(), 2 * 2 * 2) << "ep is carved out of dp";
  // With sequence parallelism, a capacity factor, fp32 spelled out, and
  // several expert groups (dp 4 = 2 groups of ep 2); ep = dp = experts.
  job.mutable_parallel()->set_sequence_parallel(true);
  job.mutable_model()->mutable_moe()->set_capacity_factor(1.25);
  job.mutable_train()->set_precision("fp32");
  EXPECT_EQ(ErrorOf(job), "");
  job.mutable_parallel()->set_dp(4);
  EXPECT_EQ(ErrorOf(job), "");
  job.mutable_parallel()->set_ep(4);
  EXPECT_EQ(ErrorOf(job), "");
  // ZeRO 1 shards over the dp / ep ranks holding the same experts: none to
  // shard at ep = dp, for planning either; at dp 4 x ep 2 it runs.
  job.mutable_parallel()->set_zero_stage(1);
  EXPECT_NE(ErrorOf(job).find("parallel.zero_stage: is 1 with parallel.ep = parallel.dp = 4"), std::string::npos)
      << ErrorOf(job);
  EXPECT_FALSE(ValidateJobSpecAllowingPlannedAxes(job).ok());
  job.mutable_parallel()->set_ep(2);
  EXPECT_EQ(ErrorOf(job), "") << "ZeRO 1 over the two ranks of each expert slot";
  job.mutable_parallel()->set_cp(2);
  job.mutable_model()->set_seq_len(std::max(4, job.model().seq_len() / 4 * 4));
  EXPECT_NE(ErrorOf(job).find("ZeRO with expert and context parallelism together is not supported yet"),
            std::string::npos)
      << ErrorOf(job);
  job.mutable_parallel()->clear_cp();
  job.mutable_parallel()->set_ep(1);
  EXPECT_EQ(ErrorOf(job), "") << "ZeRO 1 without ep runs";
  job.mutable_parallel()->clear_zero_stage();
  // The experts must split over the ep ranks.
  job.mutable_parallel()->set_ep(2);
  job.mutable_model()->mutable_moe()->set_experts(3);
  job.mutable_model()->mutable_moe()->set_top_k(1);
  const absl::Status odd = ValidateJobSpec(job);
  EXPECT_NE(odd.message().find("parallel.ep: is 2 and must divide model.moe.experts=3"), std::string::npos) << odd;
  EXPECT_FALSE(ValidateJobSpecAllowingPlannedAxes(job).ok());
}

// The experts' rows of one microbatch: every choice when dropless, else each
// expert's capacity (at most every token) times the experts.
TEST(JobSpecTest, MoeExpertRowsAreTheChoicesOrTheCapacities) {
  v1::MoeSpec moe;
  moe.set_experts(8);
  moe.set_top_k(2);
  EXPECT_EQ(MoeExpertRows(moe, 100), 200) << "dropless: 100 tokens x top 2";
  moe.set_capacity_factor(1.0);
  EXPECT_EQ(MoeExpertRows(moe, 100), 8 * 25) << "ceil(1.0 * 200 / 8) = 25 each";
  moe.set_capacity_factor(1.25);
  EXPECT_EQ(MoeExpertRows(moe, 100), 8 * 32) << "ceil(1.25 * 200 / 8) = ceil(31.25)";
  moe.set_capacity_factor(100);
  EXPECT_EQ(MoeExpertRows(moe, 100), 8 * 100) << "no expert takes a token twice";
}

// Block i is an MoE block iff (i + 1) % every_n_layers == 0.
TEST(JobSpecTest, MoeBlocksAreEveryNthBlock) {
  v1::ModelSpec m = GoodMoe().model();  // every_n_layers 2
  EXPECT_EQ(MoeEvery(m), 2);
  EXPECT_EQ(MoeBlocksIn(2, 0, 4), 2) << "blocks 1 and 3";
  EXPECT_EQ(MoeBlocksIn(2, 0, 1), 0);
  EXPECT_EQ(MoeBlocksIn(2, 1, 2), 1);
  EXPECT_EQ(MoeBlocksIn(2, 2, 3), 0);
  EXPECT_EQ(MoeBlocksIn(3, 2, 9), 3) << "blocks 2, 5 and 8";
  EXPECT_EQ(MoeBlocksIn(1, 3, 7), 4) << "every block";
  m.mutable_moe()->clear_every_n_layers();
  EXPECT_EQ(MoeEvery(m), 1) << "unset: every block";
  m.clear_moe();
  EXPECT_EQ(MoeEvery(m), 0);
  EXPECT_EQ(MoeBlocksIn(0, 0, 4), 0) << "dense";
}

}  // namespace
}  // namespace baton
