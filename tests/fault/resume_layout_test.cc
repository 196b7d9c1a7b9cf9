// Resuming a checkpoint into another layout, end to end (batonctl local: a
// real coordinator, real worker processes, Gloo, the real GPT math):
//   - a pp=2 job writes a complete checkpoint at step 10 (checkpoint.every_steps);
//   - `--resume` of it with `steps: 10` in another layout (pp=1 tp=2; pp=2
//     interleaved with 3 virtual stages; pp=2 zb-v, whose V puts the first
//     and last chunk on rank 0) trains nothing and saves the state
//     again in its own layout: the saved state equals the checkpoint bit for
//     bit (weights, both AdamW moments, the optimizer step), and `batonctl
//     checkpoint diff` reports 0 for weights and moments;
//   - the same resume continued to step 20 stays within the drift the layout
//     equivalence tests allow (tests/e2e/training_test.cc: per-step loss 1e-5
//     relative, all weights 1e-5 relative, 1e-4 absolute) of the run that
//     never stopped;
//   - a checkpoint with a missing file, or of another model shape, is refused
//     before any worker is configured, naming the file and the problem (a
//     truncated one: tests/fault/recovery_test.cc).
#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "common/json.h"
#include "gtest/gtest.h"
#include "tests/testing/process.h"
#include "tests/testing/steps_log.h"
#include "worker/checkpoint/checkpoint.h"
#include "worker/checkpoint/weights_diff.h"

namespace baton {
namespace {

using testing::RunCommand;
using testing::RunfilePath;
using testing::TempDir;

struct Layout {
  int pp = 2, tp = 1, v = 1;
  std::string schedule = "1f1b";
  std::string parallel_extra;  // more parallel { } fields, e.g. "dp: 2 zero_stage: 1"
  std::string Name() const {
    return absl::StrFormat("%s_pp%d_tp%d_v%d%s", schedule, pp, tp, v,
                           parallel_extra.empty()                        ? ""
                           : absl::StrContains(parallel_extra, "ep:") ? "_ep"
                                                                         : "_zero");
  }
};

std::string Job(const Layout& l, int steps, const std::string& extra = "", int vocab = 16,
                const std::string& model_extra = "") {
  return absl::StrFormat(R"pb(
    name: "resume"
    model { layers: 6 d_model: 32 heads: 4 vocab: %d seq_len: 20 %s }
    parallel { pp: %d tp: %d virtual_stages: %d %s }
    schedule { kind: "%s" microbatches: 4 }
    train { steps: %d micro_batch_size: 2 lr: 0.003 weight_decay: 0.01 grad_clip: 1.0 seed: 5 }
    data { synthetic { task: "addition" } }
    %s
  )pb",
                         vocab, model_extra, l.pp, l.tp, l.v, l.parallel_extra, l.schedule, steps, extra);
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

struct LocalResult {
  std::string dir, out, log;
  int exit_code = -1;
  std::vector<double> losses;
};

// One `batonctl local` run to its end (bounded).
LocalResult Local(const std::string& name, const std::string& job, std::vector<std::string> extra = {}) {
  LocalResult r;
  r.dir = TempDir(name);
  r.out = r.dir + "/out";
  std::ofstream(r.dir + "/job.textproto") << job;
  std::vector<std::string> args = {"local", "--job=" + r.dir + "/job.textproto", "--out=" + r.out, "--timeout_s=240"};
  for (std::string& a : extra) args.push_back(std::move(a));
  auto run = RunCommand(RunfilePath("cli/batonctl"), args, absl::Seconds(300));
  r.exit_code = run.exit_code;
  r.log = run.output;
  r.losses = testing::ReadStepLosses(r.out + "/steps.jsonl").values;
  return r;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// Every tensor, both moments and the optimizer step equal bit for bit.
void ExpectSameState(const std::string& want_dir, const std::string& got_dir, const std::string& what) {
  auto want = checkpoint::LoadFullState(want_dir);
  auto got = checkpoint::LoadFullState(got_dir);
  ASSERT_TRUE(want.ok()) << what << ": " << want.status();
  ASSERT_TRUE(got.ok()) << what << ": " << got.status();
  EXPECT_EQ(got->optimizer_step, want->optimizer_step) << what;
  ASSERT_TRUE(want->has_moments) << what;
  EXPECT_TRUE(got->has_moments) << what;
  ASSERT_EQ(got->tensors.size(), want->tensors.size()) << what;
  for (const auto& [name, w] : want->tensors) {
    auto it = got->tensors.find(name);
    ASSERT_NE(it, got->tensors.end()) << what << ": no tensor " << name;
    EXPECT_EQ(it->second.shape, w.shape) << what << ": " << name;
    EXPECT_TRUE(SameBits(it->second.values, w.values)) << what << ": values of " << name;
    EXPECT_TRUE(SameBits(it->second.adam_m, w.adam_m)) << what << ": adam_m of " << name;
    EXPECT_TRUE(SameBits(it->second.adam_v, w.adam_v)) << what << ": adam_v of " << name;
  }
  // The operator's tool says the same.
  auto diff = RunCommand(RunfilePath("cli/batonctl"), {"checkpoint", "diff", "--json", got_dir, want_dir});
  ASSERT_EQ(diff.exit_code, 0) << what << ": " << diff.output;
  auto json = JsonValue::Parse(diff.output);
  ASSERT_TRUE(json.ok()) << diff.output;
  for (const char* key : {"max_abs_diff", "moments_max_abs_diff"}) {
    ASSERT_NE(json->Find(key), nullptr) << what << ": " << diff.output;
    EXPECT_EQ(json->Find(key)->number(), 0.0) << what << ": " << key;
  }
}

// Within the layout-equivalence tolerances of tests/e2e/training_test.cc.
void ExpectWithinLayoutDrift(const LocalResult& reference, const LocalResult& run, size_t from_step, const std::string& what) {
  ASSERT_EQ(run.losses.size() + from_step, reference.losses.size()) << what;
  for (size_t i = 0; i < run.losses.size(); ++i) {
    const double ref = reference.losses[from_step + i];
    EXPECT_NEAR(run.losses[i], ref, 1e-5 * std::abs(ref)) << what << ": step " << from_step + i + 1;
  }
  auto a = checkpoint::LoadFullWeights(run.out + "/final");
  auto b = checkpoint::LoadFullWeights(reference.out + "/final");
  ASSERT_TRUE(a.ok()) << what << ": " << a.status();
  ASSERT_TRUE(b.ok()) << what << ": " << b.status();
  auto diff = checkpoint::CompareWeights(*a, *b);
  ASSERT_TRUE(diff.ok()) << what << ": " << diff.status();
  EXPECT_LE(diff->rel_l2, 1e-5) << what;
  EXPECT_LE(diff->max_abs_diff, 1e-4) << what;
}

TEST(ResumeLayoutTest, ACheckpointResumesIntoOtherLayoutsExactly) {
  const Layout saved_by;  // pp=2, 1f1b
  const std::string root = TempDir("resume_layout_checkpoints");
  const std::string ck = absl::StrFormat("checkpoint { dir: \"%s\" every_steps: 10 keep: 2 }", root);
  const LocalResult full = Local("full", Job(saved_by, 20, ck));
  ASSERT_EQ(full.exit_code, 0) << full.log;
  ASSERT_EQ(full.losses.size(), 20u);
  EXPECT_LT(full.losses.back(), full.losses.front()) << "the loss must move, or equality proves little";
  const std::string step10 = root + "/step-00000010";
  ASSERT_FALSE(ReadAll(step10 + "/manifest.json").empty()) << full.log;

  for (const Layout& l : {Layout{1, 2, 1, "1f1b", ""}, Layout{2, 1, 3, "interleaved", ""}, Layout{2, 1, 2, "zb-v", ""}}) {
    // (a) Resumed at the job's last step: nothing is trained, the state is
    // saved again in the new layout, bit for bit.
    const LocalResult same = Local("save_only_" + l.Name(), Job(l, 10), {"--resume=" + step10});
    ASSERT_EQ(same.exit_code, 0) << l.Name() << ":\n" << same.log;
    EXPECT_TRUE(same.losses.empty()) << l.Name() << ": trained although the job has no step left";
    ExpectSameState(step10, same.out + "/final", l.Name());

    // (b) Continued to step 20: the run that never stopped, within the layout drift.
    const LocalResult continued = Local("continued_" + l.Name(), Job(l, 20), {"--resume=" + step10});
    ASSERT_EQ(continued.exit_code, 0) << l.Name() << ":\n" << continued.log;
    ExpectWithinLayoutDrift(full, continued, 10, l.Name());
  }
}

// ZeRO-1 (parallel.zero_stage 1, the AdamW moments sharded over dp 2): a
// checkpoint it saves holds the whole state (each DP rank's moment shard
// gathered), so resuming it without ZeRO saves the same state again, bit
// for bit; and a checkpoint saved without ZeRO, resumed into zero_stage 1
// at dp 2 and 3 (each rank takes its padded shard of the moments) and
// saved again, is bit for bit the same.
TEST(ResumeLayoutTest, ZeroStage1CheckpointsHoldTheWholeStateAndResumeBothWays) {
  const std::string root = TempDir("resume_zero_checkpoints");
  const std::string ck = absl::StrFormat("checkpoint { dir: \"%s\" every_steps: 10 keep: 2 }", root);
  Layout zero;
  zero.parallel_extra = "dp: 2 zero_stage: 1";
  const LocalResult sharded = Local("zero_full", Job(zero, 10, ck));
  ASSERT_EQ(sharded.exit_code, 0) << sharded.log;
  ASSERT_EQ(sharded.losses.size(), 10u);
  const std::string step10 = root + "/step-00000010";
  const LocalResult plain = Local("zero_into_plain", Job(Layout{}, 10), {"--resume=" + step10});
  ASSERT_EQ(plain.exit_code, 0) << plain.log;
  EXPECT_TRUE(plain.losses.empty());
  ExpectSameState(step10, plain.out + "/final", "zero_stage 1 saved, resumed without ZeRO");
  for (const char* into : {"dp: 2 zero_stage: 1", "dp: 3 zero_stage: 1"}) {
    Layout l;
    l.parallel_extra = into;
    const LocalResult back = Local(absl::StrCat("plain_into_zero_", l.parallel_extra.substr(4, 1)), Job(l, 10),
                                   {"--resume=" + plain.out + "/final"});
    ASSERT_EQ(back.exit_code, 0) << into << ":\n" << back.log;
    ExpectSameState(step10, back.out + "/final", into);
  }
}

// A checkpoint saved at step 10 in `saved` resumes into the plain pp 2
// layout, and that one back into `into`, holding the same state bit for bit
// each time. `name` keeps the runs' directories apart.
void ExpectResumesOutOfAndInto(const std::string& name, const Layout& saved, const Layout& into) {
  const std::string root = TempDir(absl::StrCat("resume_", name, "_checkpoints"));
  const std::string ck = absl::StrFormat("checkpoint { dir: \"%s\" every_steps: 10 keep: 2 }", root);
  const LocalResult full = Local(name + "_full", Job(saved, 10, ck));
  ASSERT_EQ(full.exit_code, 0) << full.log;
  ASSERT_EQ(full.losses.size(), 10u);
  const std::string step10 = root + "/step-00000010";
  const LocalResult plain = Local(name + "_into_plain", Job(Layout{}, 10), {"--resume=" + step10});
  ASSERT_EQ(plain.exit_code, 0) << plain.log;
  ExpectSameState(step10, plain.out + "/final", saved.parallel_extra + " saved, resumed without it");
  const LocalResult back = Local("plain_into_" + name, Job(into, 10), {"--resume=" + plain.out + "/final"});
  ASSERT_EQ(back.exit_code, 0) << back.log;
  ExpectSameState(step10, back.out + "/final", "resumed into " + into.parallel_extra);
}

// Sequence parallelism changes no parameter: a checkpoint saved under it at
// pp 2 x tp 2 resumes without it, and that one back into it at tp 4.
TEST(ResumeLayoutTest, SequenceParallelCheckpointsResumeOutOfAndIntoIt) {
  ExpectResumesOutOfAndInto("sp", Layout{2, 2, 1, "1f1b", "sequence_parallel: true"},
                            Layout{1, 4, 1, "1f1b", "sequence_parallel: true"});
}

// Context parallelism changes no parameter either: a checkpoint saved at
// pp 2 x cp 2 (ZeRO-1 over the dp x cp group: each cp rank a shard of the
// moments) resumes without cp, and that one back into cp 2 with tp 2 and
// sequence parallelism.
TEST(ResumeLayoutTest, ContextParallelCheckpointsResumeOutOfAndIntoIt) {
  ExpectResumesOutOfAndInto("cp", Layout{2, 1, 1, "1f1b", "cp: 2 zero_stage: 1"},
                            Layout{1, 2, 1, "1f1b", "cp: 2 sequence_parallel: true"});
}

// The same for a Llama (grouped-query attention, untied head): saved at
// pp=2, resumed bit for bit at pp=1 tp=2 and under zb-v, continued within
// the layout drift; and refused, naming the field, by a job whose Llama
// differs (kv_heads) or that is a GPT-2.
TEST(ResumeLayoutTest, ALlamaCheckpointResumesIntoOtherLayoutsAndNotIntoAnotherModel) {
  const std::string llama = R"pb(arch: "llama" kv_heads: 2 ffn_dim: 48 rope_theta: 500000)pb";
  const std::string root = TempDir("resume_llama_checkpoints");
  const std::string ck = absl::StrFormat("checkpoint { dir: \"%s\" every_steps: 10 keep: 2 }", root);
  const LocalResult full = Local("llama_full", Job(Layout{}, 20, ck, 16, llama));
  ASSERT_EQ(full.exit_code, 0) << full.log;
  ASSERT_EQ(full.losses.size(), 20u);
  EXPECT_LT(full.losses.back(), full.losses.front());
  const std::string step10 = root + "/step-00000010";
  for (const Layout& l : {Layout{1, 2, 1, "1f1b", ""}, Layout{2, 1, 2, "zb-v", ""}}) {
    const LocalResult same = Local("llama_save_only_" + l.Name(), Job(l, 10, "", 16, llama), {"--resume=" + step10});
    ASSERT_EQ(same.exit_code, 0) << l.Name() << ":\n" << same.log;
    ExpectSameState(step10, same.out + "/final", "llama " + l.Name());
    const LocalResult continued =
        Local("llama_continued_" + l.Name(), Job(l, 20, "", 16, llama), {"--resume=" + step10});
    ASSERT_EQ(continued.exit_code, 0) << l.Name() << ":\n" << continued.log;
    ExpectWithinLayoutDrift(full, continued, 10, "llama " + l.Name());
  }
  const struct {
    std::string model_extra, field;
  } foreign[] = {
      {R"pb(arch: "llama" kv_heads: 4 ffn_dim: 48 rope_theta: 500000)pb", "kv_heads"},
      {"", "arch"},
  };
  for (const auto& f : foreign) {
    const LocalResult refused = Local("llama_refused_" + f.field, Job(Layout{}, 20, "", 16, f.model_extra),
                                      {"--resume=" + step10});
    EXPECT_NE(refused.exit_code, 0) << f.field;
    EXPECT_NE(refused.log.find(f.field), std::string::npos) << f.field << ":\n" << refused.log;
    EXPECT_TRUE(refused.losses.empty()) << f.field;
  }
}

// An MoE model's checkpoint (router and experts by name; ZeRO-1 moments
// sharded over dp) resumes without ZeRO at pp 1 x tp 2, under zb-v and with
// the experts split over ep 2 (and with ZeRO-1 over the two ranks of each
// expert slot at dp 4) bit for bit; the expert-parallel job's own
// checkpoint (its experts gathered from both ep ranks) resumes at ep 1; a
// job with other experts is refused, naming the field.
TEST(ResumeLayoutTest, AnMoeCheckpointResumesIntoOtherLayoutsAndNotIntoAnotherMoe) {
  const std::string moe = R"pb(moe { experts: 4 top_k: 2 capacity_factor: 1.25 aux_loss_coef: 0.02 })pb";
  const std::string root = TempDir("resume_moe_checkpoints");
  const std::string ck = absl::StrFormat("checkpoint { dir: \"%s\" every_steps: 10 keep: 2 }", root);
  const LocalResult full = Local("moe_full", Job(Layout{2, 1, 1, "1f1b", "dp: 2 zero_stage: 1"}, 10, ck, 16, moe));
  ASSERT_EQ(full.exit_code, 0) << full.log;
  ASSERT_EQ(full.losses.size(), 10u);
  const std::string step10 = root + "/step-00000010";
  std::string from_ep;
  for (const Layout& l : {Layout{1, 2, 1, "1f1b", ""}, Layout{2, 1, 2, "zb-v", ""}, Layout{2, 1, 1, "1f1b", "dp: 2 ep: 2"},
                          Layout{2, 1, 1, "gpipe", "dp: 4 ep: 2 zero_stage: 1"}}) {
    const LocalResult same = Local("moe_into_" + l.Name(), Job(l, 10, "", 16, moe), {"--resume=" + step10});
    ASSERT_EQ(same.exit_code, 0) << l.Name() << ":\n" << same.log;
    ExpectSameState(step10, same.out + "/final", "moe " + l.Name());
    if (l.parallel_extra == "dp: 2 ep: 2") from_ep = same.out + "/final";
  }
  const Layout one_ep{1, 2, 1, "1f1b", ""};
  const LocalResult back = Local("moe_from_ep", Job(one_ep, 10, "", 16, moe), {"--resume=" + from_ep});
  ASSERT_EQ(back.exit_code, 0) << back.log;
  ExpectSameState(step10, back.out + "/final", "moe from ep 2 into ep 1");
  const LocalResult refused =
      Local("moe_refused_experts", Job(Layout{}, 20, "", 16, R"pb(moe { experts: 8 top_k: 2 })pb"),
            {"--resume=" + step10});
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.log.find("experts"), std::string::npos) << refused.log;
  EXPECT_TRUE(refused.losses.empty());
}

// A checkpoint that cannot be resumed is refused before any worker is
// configured, naming the file and the problem.
TEST(ResumeLayoutTest, ABrokenOrForeignCheckpointIsRefusedBeforeTraining) {
  const Layout l;
  const std::string root = TempDir("refused_checkpoints");
  const std::string ck = absl::StrFormat("checkpoint { dir: \"%s\" every_steps: 5 }", root);
  const LocalResult source = Local("source", Job(l, 5, ck));
  ASSERT_EQ(source.exit_code, 0) << source.log;
  const std::string good = root + "/step-00000005";
  ASSERT_FALSE(ReadAll(good + "/manifest.json").empty()) << source.log;

  struct Case {
    std::string name, job, break_it, want;
  };
  const std::string missing = TempDir("missing_file");
  const std::vector<Case> cases = {
      {"missing_file", Job(l, 10), absl::StrCat("cp -r ", good, "/. ", missing, " && rm ", missing,
                                                "/chunk1-tp0.safetensors"),
       "chunk1-tp0.safetensors: missing (listed in manifest.json)"},
      // The job's model has another vocabulary: the checkpoint is of another shape.
      {"other_shape", Job(l, 10, "", 24), "", "it is from another model"},
  };
  for (const Case& c : cases) {
    if (!c.break_it.empty()) {
      ASSERT_EQ(RunCommand("sh", {"-c", c.break_it}).exit_code, 0) << c.name;
    }
    const std::string dir = c.name == "missing_file" ? missing : good;
    const LocalResult refused = Local("refused_" + c.name, c.job, {"--resume=" + dir});
    EXPECT_EQ(refused.exit_code, 1) << c.name << ":\n" << refused.log;
    EXPECT_NE(refused.log.find(c.want), std::string::npos) << c.name << ":\n" << refused.log;
    EXPECT_NE(refused.log.find(dir), std::string::npos) << c.name << ": the message names the checkpoint\n"
                                                        << refused.log;
    EXPECT_TRUE(refused.losses.empty()) << c.name;
    for (int i = 0; i < 2; ++i) {
      const std::string log = ReadAll(absl::StrCat(refused.out, "/logs/worker-", i, ".log"));
      EXPECT_EQ(log.find("configured for job"), std::string::npos) << c.name << ": worker-" << i << " was configured";
    }
  }
}

}  // namespace
}  // namespace baton
