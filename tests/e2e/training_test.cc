// End-to-end training through `batonctl local`: a real coordinator and real
// worker daemons on loopback, Gloo between them, the real GPT math.
//
//  - Layout equivalence: every PP x TP x DP layout and schedule gives the
//    single-worker run's per-step losses and final weights (1e-5 relative
//    over 20 steps); DP=k is compared with one worker running k*m
//    microbatches, the same global batch. The same layout twice is bitwise
//    identical. ZeRO-1 (parallel.zero_stage 1), sequence-parallel
//    (parallel.sequence_parallel) and context-parallel (parallel.cp) layouts
//    train like one worker too; SP and CP workers report fewer activation
//    bytes.
//  - Bubble truth: with the synthetic cost model, the measured bubble ratio
//    is within 0.02 of the simulator's for gpipe, 1f1b, zb-h1, zb-v and
//    dualpipe-v.
//  - V schedules (zb-v, dualpipe-v: the last chunk and the tied embedding's
//    both ends on rank 0) and the schedules of PyTorch's own test artifacts,
//    imported from their CSVs (placement from the file), train like one
//    worker too.
//  - Evaluation (train.eval_every_steps): the same held-out loss at every
//    layout (SP and CP included), and training bitwise unchanged by it; a token-file job counts
//    its data epochs in steps.jsonl.
//  - MoE step lines: steps.jsonl's moe_dropped_ratio, moe_load_imbalance and
//    moe_aux_loss of a PP x TP x DP layout are the single worker's; dropless
//    drops nothing; a dense job's lines have no moe field.
//  - A worker killed mid-run with no spare and no replacement fails the run
//    after fault_tolerance.replacement_timeout_s, naming the worker and its
//    stage (recovery itself: tests/fault/).
#include <signal.h>

#include <cmath>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/http_get.h"
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
  Layout(int pp = 1, int tp = 1, int dp = 1, int v = 1, int microbatches = 4, std::string schedule = "1f1b")
      : pp(pp), tp(tp), dp(dp), v(v), microbatches(microbatches), schedule(std::move(schedule)) {}
  int pp, tp, dp, v, microbatches;
  std::string schedule;
  int layers = 4;
  int seq_len = 20;
  std::string csv_file;  // with schedule "csv": a runfile of coordinator/schedule/testdata
  std::string train_extra;  // more train { } fields, e.g. the evaluation's
  std::string model_extra;  // more model { } fields, e.g. Llama's
  std::string parallel_extra;  // more parallel { } fields, e.g. zero_stage
  std::string tag;          // names the run apart (e.g. "llama")
  std::string Name() const {
    std::string kind = schedule == "zb-h1" ? "zbh1" : schedule == "zb-v" ? "zbv" : schedule;
    if (!csv_file.empty()) kind = csv_file.substr(0, csv_file.find('.'));
    return absl::StrFormat("%s%s_pp%d_tp%d_dp%d_v%d_m%d_l%d", tag, kind, pp, tp, dp, v, microbatches, layers);
  }
};

std::string GptJob(const Layout& l) {
  const std::string csv =
      l.csv_file.empty() ? ""
                         : absl::StrCat(" csv_file: \"", RunfilePath("coordinator/schedule/testdata/" + l.csv_file), "\"");
  return absl::StrFormat(R"pb(
    name: "%s"
    model { layers: %d d_model: 32 heads: 4 vocab: 16 seq_len: %d %s }
    parallel { pp: %d tp: %d dp: %d virtual_stages: %d %s }
    schedule { kind: "%s" microbatches: %d%s }
    train { steps: 20 micro_batch_size: 2 lr: 0.003 weight_decay: 0.01 grad_clip: 1.0 seed: 7 %s }
    data { synthetic { task: "addition" } }
  )pb",
                         l.Name(), l.layers, l.seq_len, l.model_extra, l.pp, l.tp, l.dp, l.v, l.parallel_extra, l.schedule,
                         l.microbatches, csv, l.train_extra);
}

struct RunResult {
  std::string dir;
  std::vector<double> losses;
  std::vector<std::string> loss_text;  // exact JSON text, for bitwise checks
  JsonValue summary;
  std::string output;  // batonctl local's
};

// Runs `job` with batonctl local; fails the test if it does not finish.
RunResult RunJob(const std::string& name, const std::string& job, int workers = 0) {
  RunResult r;
  r.dir = TempDir(name);
  const std::string job_file = r.dir + "/job.textproto";
  std::ofstream(job_file) << job;
  std::vector<std::string> args = {"local", "--job=" + job_file, "--out=" + r.dir + "/out", "--timeout_s=240"};
  if (workers > 0) args.push_back(absl::StrCat("--workers=", workers));
  auto run = RunCommand(RunfilePath("cli/batonctl"), args, absl::Seconds(300));
  EXPECT_EQ(run.exit_code, 0) << name << ":\n" << run.output;
  r.output = run.output;
  testing::StepLosses losses = testing::ReadStepLosses(r.dir + "/out/steps.jsonl");
  r.losses = std::move(losses.values);
  r.loss_text = std::move(losses.text);
  std::ifstream summary(r.dir + "/out/summary.json");
  std::stringstream text;
  text << summary.rdbuf();
  auto parsed = JsonValue::Parse(text.str());
  if (parsed.ok()) r.summary = *parsed;
  return r;
}

double SummaryNumber(const RunResult& r, const char* key) {
  const JsonValue* v = r.summary.Find(key);
  return v == nullptr ? -1 : v->number();
}

void ExpectSameTraining(const RunResult& reference, const RunResult& run, const std::string& what) {
  ASSERT_EQ(reference.losses.size(), 20u) << what;
  ASSERT_EQ(run.losses.size(), reference.losses.size()) << what;
  for (size_t i = 0; i < run.losses.size(); ++i) {
    EXPECT_NEAR(run.losses[i], reference.losses[i], 1e-5 * std::abs(reference.losses[i]))
        << what << ": step " << i + 1;
  }
  auto a = checkpoint::LoadFullWeights(run.dir + "/out/final");
  auto b = checkpoint::LoadFullWeights(reference.dir + "/out/final");
  ASSERT_TRUE(a.ok()) << what << ": " << a.status();
  ASSERT_TRUE(b.ok()) << what << ": " << b.status();
  auto diff = checkpoint::CompareWeights(*a, *b);
  ASSERT_TRUE(diff.ok()) << what << ": " << diff.status();
  // All weights as one vector: ||a - b|| / ||b||. (Per tensor, the attention
  // key bias is the exception: its gradient is zero in exact arithmetic, so
  // AdamW turns rounding noise into O(lr * 1e-2) steps there, different in
  // every summation order; PyTorch behaves the same.)
  EXPECT_LE(diff->rel_l2, 1e-5) << what;
  EXPECT_LE(diff->max_abs_diff, 1e-4) << what;
}

TEST(TrainingTest, EveryLayoutTrainsLikeOneWorker) {
  const RunResult single = RunJob("single_m4", GptJob(Layout{}));
  // The loss must actually move, or equality would prove little.
  ASSERT_EQ(single.losses.size(), 20u);
  EXPECT_LT(single.losses.back(), single.losses.front());

  const std::vector<Layout> layouts = {
      {2, 1, 1, 1, 4, "1f1b"}, {4, 1, 1, 1, 4, "1f1b"},        {1, 2, 1, 1, 4, "1f1b"},
      {2, 2, 1, 1, 4, "1f1b"}, {2, 1, 1, 1, 4, "gpipe"},       {2, 1, 1, 2, 4, "interleaved"},
      {2, 1, 1, 1, 4, "zb-h1"}, {2, 1, 1, 2, 4, "zb-v"}, {2, 2, 1, 2, 4, "dualpipe-v"},
      {1, 1, 1, 2, 4, "zb-v"},  // one rank: both chunks and the tie local
  };
  for (const Layout& l : layouts) ExpectSameTraining(single, RunJob(l.Name(), GptJob(l)), l.Name());
}

// dp 4 with pp 2 (with and without ZeRO-1): a DP reduction's summation
// order depends on an element's place in the buffer, and the tied
// embedding's copies sit at different places in the first and last chunk,
// so they must be summed after it (or, sharded, reduced alone) to stay
// bitwise equal; a checkpoint with unequal copies is refused on load.
TEST(TrainingTest, DataParallelLayoutsTrainLikeOneWorkerOnTheSameGlobalBatch) {
  Layout one;
  one.microbatches = 8;
  const RunResult single = RunJob("single_m8", GptJob(one));
  Layout dp4_zero{2, 1, 4, 1, 2, "1f1b"};
  dp4_zero.parallel_extra = "zero_stage: 1";
  dp4_zero.tag = "zero_";
  for (const Layout& l : {Layout{2, 1, 2, 1, 4, "1f1b"}, Layout{2, 2, 2, 1, 4, "1f1b"}, Layout{2, 1, 2, 2, 4, "zb-v"},
                          Layout{2, 1, 4, 1, 2, "1f1b"}, dp4_zero}) {
    ExpectSameTraining(single, RunJob(l.Name(), GptJob(l)), l.Name());
  }
}

// parallel.zero_stage 1 (the AdamW moments sharded over DP, gradients
// reduce-scattered, values all-gathered) trains like one worker on the same
// global batch, so like zero_stage 0: with PP, TP, a V schedule (two chunks
// per rank, the tied embedding's both ends on rank 0), dp 3 (shards padded),
// and Llama; the final checkpoint (moments gathered from every DP rank)
// holds the same weights; the same layout twice is bitwise identical.
// Megatron sequence parallelism: pp x tp x dp layouts under several
// schedules (ZeRO-1 and Llama too) train like one worker, bitwise again on a
// rerun; the workers report fewer activation bytes than the same layout
// without it.
TEST(TrainingTest, SequenceParallelTrainsLikeOneWorkerAndHoldsFewerActivations) {
  auto sp = [](Layout l, std::string extra = "") {
    l.parallel_extra = "sequence_parallel: true " + extra;
    l.tag = "sp_" + l.tag;
    return l;
  };
  Layout one;
  one.microbatches = 8;
  const RunResult single = RunJob("sp_single_m8", GptJob(one));
  Layout zero = sp(Layout{2, 2, 2, 1, 4, "1f1b"}, "zero_stage: 1");
  zero.tag = "sp_zero1_";
  for (const Layout& job : {sp(Layout{1, 2, 1, 1, 8, "1f1b"}), sp(Layout{1, 4, 1, 1, 8, "1f1b"}),
                            sp(Layout{2, 2, 1, 2, 8, "zb-v"}), sp(Layout{2, 2, 1, 2, 8, "dualpipe-v"}), zero}) {
    const RunResult run = RunJob(job.Name(), GptJob(job));
    ExpectSameTraining(single, run, job.Name());
    if (job.pp != 1) continue;
    const RunResult again = RunJob(job.Name() + "_again", GptJob(job));
    EXPECT_EQ(run.loss_text, again.loss_text) << "not bitwise reproducible";
    Layout plain = job;
    plain.parallel_extra.clear();
    plain.tag = "sp_off_";
    const RunResult dense = RunJob(plain.Name(), GptJob(plain));
    const std::vector<double> with = testing::ReadStepField(run.dir + "/out/steps.jsonl", "max_activation_bytes");
    const std::vector<double> without =
        testing::ReadStepField(dense.dir + "/out/steps.jsonl", "max_activation_bytes");
    ASSERT_FALSE(with.empty());
    ASSERT_FALSE(without.empty());
    ASSERT_GT(without.back(), 0);
    EXPECT_LT(with.back(), 0.9 * without.back()) << with.back() << " vs " << without.back();
    std::printf("%s: max_activation_bytes %.0f with sequence parallelism, %.0f without (%.3f)\n", job.Name().c_str(),
                with.back(), without.back(), with.back() / without.back());
  }
  Layout llama_one;
  llama_one.microbatches = 8;
  llama_one.model_extra = R"pb(arch: "llama" kv_heads: 2 ffn_dim: 48)pb";
  const RunResult llama_single = RunJob("sp_llama_single_m8", GptJob(llama_one));
  Layout llama = sp(Layout{2, 2, 1, 1, 8, "gpipe"});
  llama.model_extra = llama_one.model_extra;
  llama.tag = "sp_llama_";
  ExpectSameTraining(llama_single, RunJob(llama.Name(), GptJob(llama)), llama.Name());
}

// Context parallelism (parallel.cp): each sequence split over cp workers,
// ring attention between them, gradients averaged over dp x cp. With PP, TP
// and SP, ZeRO-1, V schedules and Llama (rotary positions at each chunk's
// offset) it trains like one worker on the same global batch, bitwise again
// on a rerun, and each worker reports a fraction of the activation bytes.
TEST(TrainingTest, ContextParallelTrainsLikeOneWorkerAndHoldsFewerActivations) {
  auto cp = [](Layout l, int c, std::string extra = "") {
    l.seq_len = 24;  // 2·cp chunks of whole tokens for cp 2 and 4
    l.parallel_extra = absl::StrCat("cp: ", c, " ", extra);
    l.tag = absl::StrCat("cp", c, "_", l.tag);
    return l;
  };
  Layout one;
  one.seq_len = 24;
  one.tag = "cp_ref_";
  const RunResult single = RunJob(one.Name(), GptJob(one));
  Layout one_m8 = one;
  one_m8.microbatches = 8;
  const RunResult single_m8 = RunJob(one_m8.Name(), GptJob(one_m8));
  Layout zero = cp(Layout{1, 1, 2, 1, 4, "1f1b"}, 2, "zero_stage: 1");
  zero.tag = "cp2_zero1_";
  const struct {
    Layout layout;
    const RunResult* reference;
  } runs[] = {
      {cp(Layout{1, 1, 1, 1, 4, "1f1b"}, 2), &single},
      {cp(Layout{1, 1, 1, 1, 4, "1f1b"}, 4), &single},
      {cp(Layout{2, 1, 1, 1, 4, "1f1b"}, 2), &single},
      {cp(Layout{1, 2, 1, 1, 4, "1f1b"}, 2, "sequence_parallel: true"), &single},
      {cp(Layout{2, 1, 1, 2, 4, "zb-v"}, 2), &single},
      {cp(Layout{2, 1, 1, 2, 4, "dualpipe-v"}, 2), &single},
      {zero, &single_m8},
  };
  for (const auto& [job, reference] : runs) {
    const RunResult run = RunJob(job.Name(), GptJob(job));
    ExpectSameTraining(*reference, run, job.Name());
    if (job.pp != 1 || job.tp != 1 || job.dp != 1) continue;
    const RunResult again = RunJob(job.Name() + "_again", GptJob(job));
    EXPECT_EQ(run.loss_text, again.loss_text) << "not bitwise reproducible";
    const std::vector<double> with = testing::ReadStepField(run.dir + "/out/steps.jsonl", "max_activation_bytes");
    const std::vector<double> without =
        testing::ReadStepField(single.dir + "/out/steps.jsonl", "max_activation_bytes");
    ASSERT_FALSE(with.empty());
    ASSERT_FALSE(without.empty());
    ASSERT_GT(without.back(), 0);
    EXPECT_LT(with.back(), 0.8 * without.back()) << with.back() << " vs " << without.back();
    std::printf("%s: max_activation_bytes %.0f with context parallelism, %.0f without (%.3f)\n", job.Name().c_str(),
                with.back(), without.back(), with.back() / without.back());
  }
  Layout llama_one = one;
  llama_one.model_extra = R"pb(arch: "llama" kv_heads: 2 ffn_dim: 48)pb";
  llama_one.tag = "cp_llama_ref_";
  const RunResult llama_single = RunJob(llama_one.Name(), GptJob(llama_one));
  Layout llama = cp(Layout{2, 1, 1, 1, 4, "gpipe"}, 2);
  llama.model_extra = llama_one.model_extra;
  llama.tag = "cp2_llama_";
  ExpectSameTraining(llama_single, RunJob(llama.Name(), GptJob(llama)), llama.Name());
}

TEST(TrainingTest, ZeroStage1TrainsLikeOneWorkerAndIsBitwiseReproducible) {
  auto zero = [](Layout l) {
    l.parallel_extra = "zero_stage: 1";
    l.tag = "zero1_";
    return l;
  };
  Layout one;
  one.microbatches = 8;
  const RunResult single = RunJob("zero_single_m8", GptJob(one));
  for (const Layout& l : {Layout{2, 1, 2, 1, 4, "1f1b"}, Layout{1, 2, 2, 1, 4, "1f1b"}, Layout{2, 2, 2, 1, 4, "1f1b"},
                          Layout{2, 1, 2, 2, 4, "zb-v"}}) {
    const Layout job = zero(l);
    const RunResult run = RunJob(job.Name(), GptJob(job));
    ExpectSameTraining(single, run, job.Name());
    if (l.pp != 1 || l.tp != 2) continue;
    // What the workers report (StepDone, steps.jsonl) against the same
    // layout without ZeRO: the moments halve (padded shards: within 1%),
    // weights stay, gradients are the full buffer plus the shard (1 + 1/dp;
    // padding aside), and the reduce-scatter
    // plus all-gather send what the all-reduce sent (the ZeRO paper's
    // volume; ring chunks and padding: within 1%).
    const RunResult dense = RunJob(l.Name(), GptJob(l));
    const std::string zs = run.dir + "/out/steps.jsonl", ds = dense.dir + "/out/steps.jsonl";
    auto last = [](const std::string& path, const char* key) {
      const std::vector<double> v = testing::ReadStepField(path, key);
      return v.empty() ? -1.0 : v.back();
    };
    const double dense_moments = last(ds, "max_optimizer_bytes");
    ASSERT_GT(dense_moments, 0);
    EXPECT_NEAR(last(zs, "max_optimizer_bytes") / dense_moments, 0.5, 0.005);
    EXPECT_NEAR(last(zs, "max_grads_bytes") / last(ds, "max_grads_bytes"), 1.5, 0.01);
    EXPECT_NEAR(last(zs, "max_weights_bytes") / last(ds, "max_weights_bytes"), 1.0, 0.01);
    const double dense_dp = last(ds, "max_dp_bytes");
    ASSERT_GT(dense_dp, 0);
    EXPECT_NEAR(last(zs, "max_dp_bytes") / dense_dp, 1.0, 0.01);
    EXPECT_GT(last(zs, "max_tp_bytes"), 0) << "tp 2 all-reduces";
  }
  one.microbatches = 12;
  const RunResult single12 = RunJob("zero_single_m12", GptJob(one));
  const Layout dp3 = zero(Layout{1, 1, 3, 1, 4, "1f1b"});
  const RunResult a = RunJob(dp3.Name(), GptJob(dp3));
  ExpectSameTraining(single12, a, dp3.Name());
  const RunResult b = RunJob(dp3.Name() + "_again", GptJob(dp3));
  ASSERT_EQ(a.loss_text.size(), 20u);
  EXPECT_EQ(a.loss_text, b.loss_text);
  auto wa = checkpoint::LoadFullWeights(a.dir + "/out/final");
  auto wb = checkpoint::LoadFullWeights(b.dir + "/out/final");
  ASSERT_TRUE(wa.ok() && wb.ok());
  auto diff = checkpoint::CompareWeights(*wa, *wb);
  ASSERT_TRUE(diff.ok());
  EXPECT_EQ(diff->max_abs_diff, 0.0) << "zero_stage 1 twice";

  Layout llama_one;
  llama_one.microbatches = 8;
  llama_one.model_extra = R"pb(arch: "llama" kv_heads: 2 ffn_dim: 48)pb";
  llama_one.tag = "zero_llama_";
  const RunResult llama_single = RunJob("zero_llama_single_m8", GptJob(llama_one));
  Layout llama = zero(Layout{2, 1, 2, 1, 4, "gpipe"});
  llama.model_extra = llama_one.model_extra;
  llama.tag = "zero1_llama_";
  ExpectSameTraining(llama_single, RunJob(llama.Name(), GptJob(llama)), llama.Name());
}

// model.arch "llama" (RMSNorm, rotary positions, SwiGLU, grouped-query
// attention with 2 key/value heads, untied head) under every schedule, TP
// and DP trains like one worker on the same global batch; and a tied-head
// Llama on a V schedule (both ends of the tie on rank 0).
TEST(TrainingTest, LlamaTrainsLikeOneWorkerUnderEverySchedule) {
  auto llama = [](Layout l, const std::string& extra = "") {
    l.model_extra = absl::StrCat(R"pb(arch: "llama" kv_heads: 2 ffn_dim: 48 rope_theta: 10000 )pb", extra);
    l.tag = extra.empty() ? "llama_" : "llama_tied_";
    return l;
  };
  Layout one;
  one.microbatches = 8;
  const RunResult single = RunJob("llama_single_m8", GptJob(llama(one)));
  ASSERT_EQ(single.losses.size(), 20u);
  EXPECT_LT(single.losses.back(), single.losses.front());
  const std::vector<Layout> layouts = {
      {2, 1, 2, 1, 4, "gpipe"},        {2, 2, 2, 1, 4, "1f1b"}, {2, 1, 1, 2, 8, "interleaved"},
      {2, 1, 2, 1, 4, "zb-h1"},        {2, 1, 2, 2, 4, "zb-v"}, {2, 2, 1, 2, 8, "dualpipe-v"},
  };
  for (const Layout& l : layouts) {
    const Layout job = llama(l);
    ExpectSameTraining(single, RunJob(job.Name(), GptJob(job)), job.Name());
  }
  const RunResult tied_single = RunJob("llama_tied_single_m8", GptJob(llama(one, "tie_embeddings: true")));
  const Layout tied = llama(Layout{2, 1, 1, 2, 8, "zb-v"}, "tie_embeddings: true");
  ExpectSameTraining(tied_single, RunJob(tied.Name(), GptJob(tied)), tied.Name());
}

// model.moe (experts behind a router; GPT-2 with capacity drops, Llama
// dropless with every other block MoE) under the schedules, with TP, SP, DP
// and ZeRO-1, trains like one worker on the same global batch: routing,
// capacity and the load-balancing loss are per microbatch, whatever the
// layout; and a rerun is bitwise identical.
TEST(TrainingTest, MixtureOfExpertsTrainsLikeOneWorkerUnderEverySchedule) {
  auto moe = [](Layout l, bool llama) {
    l.model_extra = llama ? R"pb(arch: "llama" kv_heads: 2 ffn_dim: 48
                                 moe { experts: 4 top_k: 2 every_n_layers: 2 aux_loss_coef: 0.02 })pb"
                          : R"pb(moe { experts: 4 top_k: 2 capacity_factor: 1.25 aux_loss_coef: 0.01 })pb";
    l.tag = llama ? "moe_llama_" : "moe_";
    return l;
  };
  Layout one;
  one.microbatches = 8;
  for (const bool llama : {false, true}) {
    const RunResult single = RunJob(llama ? "moe_llama_single_m8" : "moe_single_m8", GptJob(moe(one, llama)));
    ASSERT_EQ(single.losses.size(), 20u);
    EXPECT_LT(single.losses.back(), single.losses.front());
    std::vector<Layout> layouts = {{2, 2, 2, 1, 4, "1f1b"}, {2, 1, 2, 2, 4, "zb-v"}, {2, 2, 1, 2, 8, "dualpipe-v"}};
    Layout zero_sp{2, 2, 2, 1, 4, "gpipe"};
    zero_sp.parallel_extra = "zero_stage: 1 sequence_parallel: true";
    zero_sp.tag = "zero_sp_";
    layouts.push_back(zero_sp);
    for (Layout l : layouts) {
      const std::string extra = l.parallel_extra, tag = l.tag;
      l = moe(l, llama);
      l.parallel_extra = extra;
      l.tag += tag;
      ExpectSameTraining(single, RunJob(l.Name(), GptJob(l)), l.Name());
    }
    if (llama) {
      // Context parallelism (dropless: capacity would count each cp rank's
      // tokens): the load-balancing loss spans the whole sequences.
      Layout cp{2, 1, 1, 1, 8, "1f1b"};
      cp = moe(cp, true);
      cp.parallel_extra = "cp: 2";
      cp.tag += "cp2_";
      ExpectSameTraining(single, RunJob(cp.Name(), GptJob(cp)), cp.Name());
      // And with the experts split over ep 2 (their gradients summed over
      // the same slot's dp ranks, then over cp).
      Layout cp_ep{1, 1, 2, 1, 4, "1f1b"};
      cp_ep = moe(cp_ep, true);
      cp_ep.parallel_extra = "cp: 2 ep: 2";
      cp_ep.tag += "cp2_ep2_";
      ExpectSameTraining(single, RunJob(cp_ep.Name(), GptJob(cp_ep)), cp_ep.Name());
    }
    if (!llama) {
      const Layout again = moe(Layout{2, 2, 2, 1, 4, "1f1b"}, false);
      const RunResult a = RunJob(again.Name() + "_again", GptJob(again));
      const RunResult b = RunJob(again.Name() + "_again2", GptJob(again));
      EXPECT_EQ(a.loss_text, b.loss_text) << "an MoE job repeats bitwise";
    }
  }
}

// Expert parallelism: parallel.ep splits each MoE block's experts over ep
// ranks of the dp axis; tokens travel to their experts' ranks and back by
// all-to-all, and expert gradients are summed over the ranks holding the
// same experts only. With pp, tp and any schedule it trains to the weights
// of one worker (ep = 1) on the same global batch, and repeats bitwise. The
// final weights are written whole (every expert), like ep = 1's.
TEST(TrainingTest, ExpertParallelJobsTrainLikeOneWorker) {
  const std::string moe = R"pb(moe { experts: 4 top_k: 2 capacity_factor: 1.25 aux_loss_coef: 0.01 })pb";
  Layout one;
  one.microbatches = 8;
  one.model_extra = moe;
  one.tag = "moe_";
  const RunResult single = RunJob(one.Name(), GptJob(one));
  ASSERT_EQ(single.losses.size(), 20u);
  EXPECT_LT(single.losses.back(), single.losses.front());
  Layout ep2{2, 1, 2, 1, 4, "1f1b"};
  ep2.parallel_extra = "ep: 2";
  Layout ep4{1, 2, 4, 1, 2, "1f1b"};
  ep4.parallel_extra = "ep: 4";
  Layout ep2_of_4{2, 1, 4, 2, 2, "zb-v"};  // two expert groups: the experts' gradients summed over 2 ranks
  ep2_of_4.parallel_extra = "ep: 2";
  // ZeRO-1 over the two ranks of each expert slot (the dense gradients
  // summed over the expert group first).
  Layout ep2_zero{2, 1, 4, 1, 2, "1f1b"};
  ep2_zero.parallel_extra = "ep: 2 zero_stage: 1";
  for (Layout l : {ep2, ep4, ep2_of_4, ep2_zero}) {
    l.model_extra = moe;
    l.tag = absl::StrCat("moe_", l.parallel_extra.substr(4, 1), "ep_", l.parallel_extra.size() > 6 ? "zero_" : "");
    const RunResult run = RunJob(l.Name(), GptJob(l));
    ExpectSameTraining(single, run, l.Name());
    if (l.dp == 4 && l.tp == 2) {
      const RunResult again = RunJob(l.Name() + "_again", GptJob(l));
      EXPECT_EQ(run.loss_text, again.loss_text) << l.Name() << ": an expert-parallel job repeats bitwise";
    }
  }
}

// steps.jsonl of an MoE job carries what the routers did in each step:
// moe_dropped_ratio (choices dropped at capacity over those routed, all
// workers), moe_load_imbalance (the most loaded expert index over the mean
// one) and moe_aux_loss (the load-balancing loss as it enters the
// objective: summed over the pipeline stages, TP ranks counted once,
// averaged over DP replicas). So a PP x TP x DP layout gives the single
// worker's numbers on the same global batch. A dropless job drops nothing;
// a dense job's lines have no moe field at all.
TEST(TrainingTest, MoeStepLinesShowDropsImbalanceAndTheLoadBalancingLoss) {
  auto field = [](const RunResult& r, const char* key) {
    return testing::ReadStepField(r.dir + "/out/steps.jsonl", key);
  };
  const std::string capped = R"pb(moe { experts: 4 top_k: 2 capacity_factor: 0.5 aux_loss_coef: 0.01 })pb";
  Layout one;
  one.microbatches = 8;
  one.model_extra = capped;
  one.tag = "moe_lines_";
  Layout split{2, 2, 2, 1, 4, "1f1b"};
  split.model_extra = capped;
  split.tag = one.tag;
  const RunResult single = RunJob(one.Name(), GptJob(one));
  const RunResult layout = RunJob(split.Name(), GptJob(split));
  for (const RunResult* r : {&single, &layout}) {
    const std::vector<double> dropped = field(*r, "moe_dropped_ratio");
    const std::vector<double> imbalance = field(*r, "moe_load_imbalance");
    const std::vector<double> aux = field(*r, "moe_aux_loss");
    ASSERT_EQ(dropped.size(), 20u) << r->dir;
    ASSERT_EQ(imbalance.size(), 20u) << r->dir;
    ASSERT_EQ(aux.size(), 20u) << r->dir;
    for (size_t i = 0; i < dropped.size(); ++i) {
      EXPECT_GT(dropped[i], 0) << r->dir << " step " << i + 1 << ": capacity 0.5 drops choices";
      EXPECT_LT(dropped[i], 1) << r->dir << " step " << i + 1;
      EXPECT_GE(imbalance[i], 1) << r->dir << " step " << i + 1;
      EXPECT_LE(imbalance[i], 4) << r->dir << " step " << i + 1 << ": at most E";
      EXPECT_GT(aux[i], 0) << r->dir << " step " << i + 1;
      EXPECT_LT(aux[i], 4 * 0.01 * 4) << r->dir << " step " << i + 1 << ": 4 blocks, each at most coef * E";
    }
  }
  const std::vector<double> want_dropped = field(single, "moe_dropped_ratio"),
                            got_dropped = field(layout, "moe_dropped_ratio");
  const std::vector<double> want_imbalance = field(single, "moe_load_imbalance"),
                            got_imbalance = field(layout, "moe_load_imbalance");
  const std::vector<double> want_aux = field(single, "moe_aux_loss"), got_aux = field(layout, "moe_aux_loss");
  if (want_aux.size() == 20 && got_aux.size() == 20) {
    std::printf("%s: step 1 dropped %.4f imbalance %.4f aux %.5f; step 20 dropped %.4f imbalance %.4f aux %.5f\n",
                split.Name().c_str(), got_dropped[0], got_imbalance[0], got_aux[0], got_dropped[19],
                got_imbalance[19], got_aux[19]);
  }
  for (size_t i = 0; i < want_aux.size() && i < got_aux.size(); ++i) {
    EXPECT_NEAR(got_dropped[i], want_dropped[i], 1e-6) << "step " << i + 1;
    EXPECT_NEAR(got_imbalance[i], want_imbalance[i], 1e-6) << "step " << i + 1;
    EXPECT_NEAR(got_aux[i], want_aux[i], 1e-5 * want_aux[i]) << "step " << i + 1;
  }

  Layout dropless{2, 1, 1, 1, 4, "1f1b"};
  dropless.model_extra = R"pb(moe { experts: 4 top_k: 2 })pb";
  dropless.tag = "moe_lines_dropless_";
  const RunResult none_dropped = RunJob(dropless.Name(), GptJob(dropless));
  const std::vector<double> dropped = field(none_dropped, "moe_dropped_ratio");
  const std::vector<double> imbalance = field(none_dropped, "moe_load_imbalance");
  ASSERT_EQ(dropped.size(), 20u);
  ASSERT_EQ(imbalance.size(), 20u);
  for (size_t i = 0; i < dropped.size(); ++i) {
    EXPECT_EQ(dropped[i], 0) << "dropless, step " << i + 1;
    EXPECT_GE(imbalance[i], 1) << "step " << i + 1;
  }
  EXPECT_EQ(field(none_dropped, "moe_aux_loss").size(), 20u);

  Layout dense{2, 1, 1, 1, 4, "1f1b"};
  dense.tag = "moe_lines_dense_";
  const RunResult plain = RunJob(dense.Name(), GptJob(dense));
  std::ifstream steps(plain.dir + "/out/steps.jsonl");
  std::string line;
  int step_lines = 0;
  while (std::getline(steps, line)) {
    if (line.find("\"step\": ") == std::string::npos) continue;
    ++step_lines;
    EXPECT_EQ(line.find("moe_"), std::string::npos) << "a dense job's step line: " << line;
    const std::string last = ", \"max_activation_bytes\"";  // the last field, as before MoE
    EXPECT_EQ(line.substr(line.rfind(", \""), last.size()), last) << line;
  }
  EXPECT_EQ(step_lines, 20);
}

// PyTorch's own schedule artifacts, imported from their CSVs: the
// interleaved zero-bubble (older naming, compute-only and with its comms)
// and DualPipe-V (V placement, OVERLAP_F_B) train like one worker on the
// same batch.
TEST(TrainingTest, PytorchsScheduleArtifactsTrainLikeOneWorker) {
  Layout one;
  one.microbatches = 8;
  const RunResult single = RunJob("single_m8", GptJob(one));
  for (const char* csv : {"zb1p_2rank_2stagep_compute.csv", "zb1p_2rank_2stagep_comms.csv"}) {
    Layout l{2, 1, 1, 2, 8, "csv"};
    l.csv_file = csv;
    ExpectSameTraining(single, RunJob(l.Name(), GptJob(l)), l.Name());
  }
  Layout deep;
  deep.microbatches = 10;
  deep.layers = 8;
  const RunResult single_deep = RunJob("single_m10_l8", GptJob(deep));
  Layout dualpipe{4, 1, 1, 2, 10, "csv"};
  dualpipe.layers = 8;
  dualpipe.csv_file = "dualpipev_4rank_10mb.csv";
  ExpectSameTraining(single_deep, RunJob(dualpipe.Name(), GptJob(dualpipe)), dualpipe.Name());
}

// train.eval_every_steps: the held-out loss after steps 5, 10, 15 and 20,
// the same at every layout (each DP replica scores its share of the eval
// batch), and training is unchanged by it, bit for bit.
TEST(TrainingTest, EvaluationReportsTheSameHeldOutLossAtEveryLayoutAndLeavesTrainingAlone) {
  const std::string eval = R"pb(eval_every_steps: 5 eval_steps: 2 eval_data { synthetic { task: "addition" } })pb";
  Layout one;
  one.microbatches = 8;
  const RunResult plain = RunJob("eval_plain_m8", GptJob(one));
  one.train_extra = eval;
  const RunResult single = RunJob("eval_single_m8", GptJob(one));
  // Evaluating changes nothing of training: the same losses and weights, bitwise.
  ASSERT_EQ(plain.loss_text.size(), 20u);
  EXPECT_EQ(single.loss_text, plain.loss_text);
  {
    auto a = checkpoint::LoadFullWeights(single.dir + "/out/final");
    auto b = checkpoint::LoadFullWeights(plain.dir + "/out/final");
    ASSERT_TRUE(a.ok() && b.ok());
    auto diff = checkpoint::CompareWeights(*a, *b);
    ASSERT_TRUE(diff.ok());
    EXPECT_EQ(diff->max_abs_diff, 0.0);
  }
  const std::vector<testing::EvalLine> reference = testing::ReadEvalLines(single.dir + "/out/steps.jsonl");
  ASSERT_EQ(reference.size(), 4u);
  for (size_t i = 0; i < reference.size(); ++i) {
    EXPECT_EQ(reference[i].step, 5 * static_cast<int64_t>(i + 1));
    EXPECT_GT(reference[i].tokens, 0);
    EXPECT_NEAR(reference[i].perplexity, std::exp(reference[i].loss), 1e-6 * reference[i].perplexity);
  }
  // Held out, and still learned: the addition task generalises.
  EXPECT_LT(reference.back().loss, reference.front().loss);
  EXPECT_NEAR(SummaryNumber(single, "eval_loss"), reference.back().loss, 1e-9);
  EXPECT_EQ(SummaryNumber(single, "eval_step"), 20);
  EXPECT_NE(single.output.find("eval_perplexity"), std::string::npos) << single.output;
  // The held-out batches are not the training ones: a seed of their own.
  EXPECT_NE(reference.front().loss_text, single.loss_text[4]);

  Layout mesh{2, 2, 2, 1, 4, "1f1b"};
  Layout v{2, 1, 1, 2, 8, "zb-v"};
  Layout sp{2, 2, 1, 1, 8, "1f1b"};  // evaluation's forwards under sequence parallelism too
  sp.parallel_extra = "sequence_parallel: true";
  sp.tag = "sp_";
  Layout cp{2, 1, 1, 1, 8, "1f1b"};  // and under context parallelism: each cp rank scores its chunks
  cp.parallel_extra = "cp: 2";
  cp.tag = "cp_";
  for (Layout l : {mesh, v, sp, cp}) {
    l.train_extra = eval;
    const RunResult run = RunJob("eval_" + l.Name(), GptJob(l));
    const std::vector<testing::EvalLine> got = testing::ReadEvalLines(run.dir + "/out/steps.jsonl");
    ASSERT_EQ(got.size(), reference.size()) << l.Name();
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].step, reference[i].step) << l.Name();
      EXPECT_EQ(got[i].tokens, reference[i].tokens) << l.Name();
      EXPECT_NEAR(got[i].loss, reference[i].loss, 1e-5 * reference[i].loss) << l.Name() << " eval " << i;
    }
  }
}

// A job on token files (raw uint16, memory-mapped) with a held-out token
// file: every step line says the data epoch its batch starts in (40 windows
// of seq_len + 1 ids, 8 per step: a new epoch every 5 steps), and pp 2 x
// dp 2 gives the single worker's losses and evaluations.
TEST(TrainingTest, ATokenFileJobCountsEpochsAndEvaluatesOnItsHeldOutFile) {
  auto job_in = [](const std::string& dir, int pp, int dp, int microbatches) {
    auto write_ids = [&](const std::string& name, int n, uint32_t seed) {
      std::string bytes;
      for (int i = 0; i < n; ++i) {
        seed = seed * 1103515245u + 12345u;
        const uint16_t id = static_cast<uint16_t>((seed >> 16) % 16);
        bytes.push_back(static_cast<char>(id & 0xff));
        bytes.push_back(static_cast<char>(id >> 8));
      }
      std::ofstream(dir + "/" + name, std::ios::binary) << bytes;
    };
    write_ids("train.bin", 40 * 20 + 1, 1);
    write_ids("val.bin", 16 * 20 + 1, 2);
    return absl::StrFormat(R"pb(
      name: "tokens"
      model { layers: 2 d_model: 32 heads: 4 vocab: 16 seq_len: 20 }
      parallel { pp: %d dp: %d }
      schedule { kind: "1f1b" microbatches: %d }
      train {
        steps: 20 micro_batch_size: 2 lr: 0.003 seed: 3
        eval_every_steps: 10 eval_data { tokens_file: "val.bin" }
      }
      data { tokens_file: "train.bin" token_format: "raw_uint16" }
    )pb",
                           pp, dp, microbatches);
  };
  std::vector<RunResult> runs;
  for (auto [pp, dp, m] : {std::tuple{1, 1, 4}, std::tuple{2, 2, 2}}) {
    const std::string name = absl::StrCat("tokens_pp", pp, "_dp", dp);
    const std::string dir = TempDir(name);
    const std::string job_file = dir + "/job.textproto";
    std::ofstream(job_file) << job_in(dir, pp, dp, m);
    auto run = RunCommand(RunfilePath("cli/batonctl"),
                          {"local", "--job=" + job_file, "--out=" + dir + "/out", "--timeout_s=240"},
                          absl::Seconds(300));
    ASSERT_EQ(run.exit_code, 0) << name << ":\n" << run.output;
    RunResult r;
    r.dir = dir;
    r.output = run.output;
    testing::StepLosses losses = testing::ReadStepLosses(dir + "/out/steps.jsonl");
    r.losses = std::move(losses.values);
    runs.push_back(std::move(r));
    std::ifstream steps(dir + "/out/steps.jsonl");
    int seen = 0;
    for (std::string line; std::getline(steps, line);) {
      auto v = JsonValue::Parse(line);
      if (!v.ok() || v->Find("step") == nullptr) continue;
      const int64_t step = static_cast<int64_t>(v->Find("step")->number());
      ASSERT_NE(v->Find("epoch"), nullptr) << line;
      EXPECT_EQ(v->Find("epoch")->number(), step * 8 / 40) << name << ": " << line;
      ++seen;
    }
    EXPECT_EQ(seen, 20) << name;
  }
  ASSERT_EQ(runs[0].losses.size(), 20u);
  ASSERT_EQ(runs[1].losses.size(), 20u);
  for (size_t i = 0; i < 20; ++i) EXPECT_NEAR(runs[1].losses[i], runs[0].losses[i], 1e-5 * runs[0].losses[i]);
  const auto a = testing::ReadEvalLines(runs[0].dir + "/out/steps.jsonl");
  const auto b = testing::ReadEvalLines(runs[1].dir + "/out/steps.jsonl");
  ASSERT_EQ(a.size(), 2u);
  ASSERT_EQ(b.size(), 2u);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].tokens, 8 * 20) << "one global batch of 8 windows, every target scored";
    EXPECT_EQ(b[i].tokens, a[i].tokens);
    EXPECT_NEAR(b[i].loss, a[i].loss, 1e-5 * a[i].loss);
  }
}

TEST(TrainingTest, SameLayoutTwiceIsBitwiseIdentical) {
  for (const Layout& l : {Layout{2, 2, 1, 1, 4, "1f1b"}, Layout{2, 1, 1, 2, 4, "dualpipe-v"}}) {
    const RunResult a = RunJob("bitwise_a_" + l.Name(), GptJob(l));
    const RunResult b = RunJob("bitwise_b_" + l.Name(), GptJob(l));
    ASSERT_EQ(a.loss_text.size(), 20u) << l.Name();
    EXPECT_EQ(a.loss_text, b.loss_text) << l.Name();
    auto wa = checkpoint::LoadFullWeights(a.dir + "/out/final");
    auto wb = checkpoint::LoadFullWeights(b.dir + "/out/final");
    ASSERT_TRUE(wa.ok() && wb.ok()) << l.Name();
    auto diff = checkpoint::CompareWeights(*wa, *wb);
    ASSERT_TRUE(diff.ok());
    EXPECT_EQ(diff->max_abs_diff, 0.0) << l.Name();
  }
}

TEST(TrainingTest, MeasuredBubbleMatchesTheSimulator) {
  for (const std::string kind : {"gpipe", "1f1b", "zb-h1", "zb-v", "dualpipe-v"}) {
    // A V has two chunks per rank; a synthetic op costs its time per chunk.
    const bool v = kind == "zb-v" || kind == "dualpipe-v";
    const std::string job = absl::StrFormat(R"pb(
      name: "bubble"
      model {
        layers: %d
        synthetic { forward_ms: %d backward_input_ms: %d backward_weight_ms: %d activation_bytes: 4096 }
      }
      parallel { pp: 4 virtual_stages: %d }
      schedule { kind: "%s" microbatches: 8 }
      train { steps: 3 micro_batch_size: 1 lr: 0.001 }
    )pb",
                                            v ? 8 : 4, v ? 25 : 50, v ? 25 : 50, v ? 25 : 50, v ? 2 : 1, kind);
    const RunResult r = RunJob(absl::StrCat("bubble_", kind), job);
    const double measured = SummaryNumber(r, "bubble_ratio"), expected = SummaryNumber(r, "expected_bubble_ratio");
    EXPECT_GT(expected, 0.05) << kind;
    EXPECT_NEAR(measured, expected, 0.02) << kind;
  }
}

// The README's first command trains examples/demo.textproto; it must learn:
// answer-digit accuracy well above chance (~23%: the leading answer digit is
// usually 0 or 1) by the end of the run.
TEST(TrainingTest, TheDemoLearnsAddition) {
  std::ifstream in(RunfilePath("examples/demo.textproto"));
  std::stringstream job;
  job << in.rdbuf();
  ASSERT_FALSE(job.str().empty());
  const RunResult r = RunJob("demo", job.str());
  EXPECT_GT(SummaryNumber(r, "final_accuracy"), 0.6);
  ASSERT_GT(r.losses.size(), 100u);
  EXPECT_LT(r.losses.back(), 0.5 * r.losses.front());
}

TEST(TrainingTest, AKilledWorkerWithoutReplacementFailsAfterTheTimeoutNamingItsStage) {
  const std::string dir = TempDir("killed");
  const std::string job_file = dir + "/job.textproto";
  std::ofstream(job_file) << R"pb(
    name: "long"
    model { layers: 2 synthetic { forward_ms: 5 backward_input_ms: 5 backward_weight_ms: 5 activation_bytes: 64 } }
    parallel { pp: 2 }
    schedule { kind: "1f1b" microbatches: 4 }
    train { steps: 100000 micro_batch_size: 1 lr: 0.001 }
    fault_tolerance { replacement_timeout_s: 2 }
  )pb";
  testing::Subprocess local(RunfilePath("cli/batonctl"),
                            {"local", "--job=" + job_file, "--out=" + dir + "/out", "--timeout_s=120"},
                            dir + "/local.log");
  ASSERT_TRUE(local.Start().ok());
  // Wait until training is under way, then kill the last stage's worker.
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  for (;;) {
    std::ifstream steps(dir + "/out/steps.jsonl");
    std::string line;
    int n = 0;
    while (std::getline(steps, line)) ++n;
    if (n >= 3) break;
    ASSERT_LT(absl::Now(), deadline) << "training never started:\n" << local.Log();
    absl::SleepFor(absl::Milliseconds(100));
  }
  // While it trains: the operator's views.
  auto coordinator = testing::ReadPortFile(dir + "/out/coordinator.ports", absl::Seconds(5));
  auto worker0 = testing::ReadPortFile(dir + "/out/worker-0.ports", absl::Seconds(5));
  ASSERT_TRUE(coordinator.ok() && worker0.ok());
  auto wmetrics = HttpGet("127.0.0.1", worker0->second, "/metrics");
  ASSERT_TRUE(wmetrics.ok());
  for (const char* series : {"baton_step_wall_seconds_total{", "baton_compute_seconds_total{",
                             "baton_comm_seconds_total{", "baton_bubble_seconds_total{", "baton_tokens_total{",
                             "baton_step{", "baton_host_syncs_total{"}) {
    EXPECT_NE(wmetrics->body.find(series), std::string::npos) << series << "\n" << wmetrics->body;
  }
  EXPECT_NE(wmetrics->body.find("stage=\"0\""), std::string::npos);
  EXPECT_NE(wmetrics->body.find("kind=\"p2p\""), std::string::npos);
  auto promtool = RunCommand("promtool", {"check", "metrics"}, absl::Seconds(30), wmetrics->body);
  EXPECT_EQ(promtool.exit_code, 0) << promtool.output;
  auto cmetrics = HttpGet("127.0.0.1", coordinator->second, "/metrics");
  ASSERT_TRUE(cmetrics.ok());
  EXPECT_NE(cmetrics->body.find("baton_expected_bubble_ratio{stage=\"1\",training_job=\"long\"}"), std::string::npos)
      << cmetrics->body;
  EXPECT_NE(cmetrics->body.find("baton_job_state{state=\"running\",training_job=\"long\"} 1"), std::string::npos)
      << cmetrics->body;
  EXPECT_EQ(cmetrics->body.find("{job="), std::string::npos) << "no label named job:\n" << cmetrics->body;
  EXPECT_NE(wmetrics->body.find("training_job=\"long\""), std::string::npos) << wmetrics->body;
  const std::string target = absl::StrCat("--coordinator=127.0.0.1:", coordinator->first);
  auto status = RunCommand(RunfilePath("cli/batonctl"), {"status", target});
  EXPECT_EQ(status.exit_code, 0) << status.output;
  EXPECT_NE(status.output.find("(running)"), std::string::npos) << status.output;
  EXPECT_NE(status.output.find("STAGE"), std::string::npos) << status.output;
  EXPECT_NE(status.output.find("worker-1"), std::string::npos) << status.output;
  const std::string trace_file = dir + "/trace.json";
  auto trace = RunCommand(RunfilePath("cli/batonctl"), {"trace", target, "--out=" + trace_file, "--steps=2"});
  EXPECT_EQ(trace.exit_code, 0) << trace.output;
  {
    std::ifstream in(trace_file);
    std::stringstream text;
    text << in.rdbuf();
    auto parsed = JsonValue::Parse(text.str());
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    const JsonValue* events = parsed->Find("traceEvents");
    ASSERT_NE(events, nullptr);
    int forwards = 0;
    std::set<double> pids;
    for (const JsonValue& e : events->items()) {
      const JsonValue* name = e.Find("name");
      if (name != nullptr && name->is_string() && name->str().rfind("F", 0) == 0) {
        ++forwards;
        pids.insert(e.Find("pid")->number());
      }
    }
    EXPECT_EQ(forwards, 2 * 2 * 4) << "2 steps x 2 stages x 4 microbatches";
    EXPECT_EQ(pids.size(), 2u);
  }

  auto pids = RunCommand("pgrep", {"-f", "--", "--port_file=" + dir + "/out/worker-1.ports"});
  ASSERT_EQ(pids.exit_code, 0) << "cannot find worker-1's process:\n" << pids.output;
  const absl::Time killed = absl::Now();
  for (absl::string_view pid : absl::StrSplit(pids.output, '\n', absl::SkipEmpty())) {
    kill(std::stoi(std::string(pid)), SIGKILL);
  }
  auto code = local.Wait(absl::Seconds(30));
  ASSERT_TRUE(code.has_value()) << "batonctl local hung after a worker was killed:\n" << local.Log();
  EXPECT_EQ(*code, 1);
  EXPECT_LT(absl::Now() - killed, absl::Seconds(15));
  EXPECT_NE(local.Log().find("worker-1"), std::string::npos) << local.Log();
  EXPECT_NE(local.Log().find("stage 1"), std::string::npos) << local.Log();
  EXPECT_NE(local.Log().find("no replacement for stage 1 (tp 0, dp 0) (worker worker-1)"), std::string::npos)
      << local.Log();
}

}  // namespace
}  // namespace baton
