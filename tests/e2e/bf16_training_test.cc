// train.precision = bf16 end to end through `batonctl local`: a real
// coordinator and four real worker daemons (PP 2 x TP 2, 1F1B) on loopback,
// Gloo between them, the GPT stages on the CPU backend's bf16 reference ops
// with bf16 pipeline messages (their size: worker/executor_message_test).
//
//  - A bf16 job is accepted at Configure on CPU workers, trains (the loss
//    falls), stays close to the same job in fp32, and two runs are bitwise
//    identical (every step's loss text and the final weights).
//  - train.precision = "fp16" is refused before any step, naming the field.
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
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

constexpr int kSteps = 20;

// The default layout is pp 2 x tp 2; `model_extra` and `parallel` change it.
std::string Job(const std::string& name, const std::string& precision, const std::string& model_extra = "",
                const std::string& parallel = "pp: 2 tp: 2 dp: 1") {
  return absl::StrFormat(R"pb(
    name: "%s"
    model { layers: 4 d_model: 32 heads: 4 vocab: 16 seq_len: 20 %s }
    parallel { %s }
    schedule { kind: "1f1b" microbatches: 4 }
    train {
      steps: %d micro_batch_size: 2 lr: 0.003 weight_decay: 0.01 grad_clip: 1.0 seed: 7
      precision: "%s"
    }
    data { synthetic { task: "addition" } }
  )pb",
                         name, model_extra, parallel, kSteps, precision);
}

struct RunResult {
  std::string dir;
  int exit_code = -1;
  std::string output;
  std::vector<double> losses;
  std::vector<std::string> loss_text;  // exact JSON text, for bitwise checks
};

RunResult RunJob(const std::string& name, const std::string& precision, const std::string& model_extra = "",
                 const std::string& parallel = "pp: 2 tp: 2 dp: 1") {
  RunResult r;
  r.dir = TempDir(name);
  const std::string job_file = r.dir + "/job.textproto";
  std::ofstream(job_file) << Job(name, precision, model_extra, parallel);
  auto run = RunCommand(RunfilePath("cli/batonctl"),
                        {"local", "--job=" + job_file, "--out=" + r.dir + "/out", "--timeout_s=240"},
                        absl::Seconds(300));
  r.exit_code = run.exit_code;
  r.output = run.output;
  testing::StepLosses losses = testing::ReadStepLosses(r.dir + "/out/steps.jsonl");
  r.losses = std::move(losses.values);
  r.loss_text = std::move(losses.text);
  return r;
}

TEST(Bf16TrainingTest, TrainsCloseToFp32AndTwoRunsAreBitwiseIdentical) {
  const RunResult fp32 = RunJob("fp32", "fp32");
  const RunResult a = RunJob("bf16_a", "bf16");
  const RunResult b = RunJob("bf16_b", "bf16");
  ASSERT_EQ(fp32.exit_code, 0) << fp32.output;
  ASSERT_EQ(a.exit_code, 0) << a.output;
  ASSERT_EQ(b.exit_code, 0) << b.output;
  ASSERT_EQ(fp32.losses.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(a.losses.size(), static_cast<size_t>(kSteps));

  // It trains, like fp32 does.
  EXPECT_LT(a.losses.back(), 0.9 * a.losses.front());
  EXPECT_NEAR(a.losses.back(), fp32.losses.back(), 5e-2 * fp32.losses.back());
  // The first step's loss is the initial model's: bf16 rounding only.
  EXPECT_NEAR(a.losses.front(), fp32.losses.front(), 1e-2 * fp32.losses.front());
  EXPECT_NE(a.loss_text, fp32.loss_text);  // the bf16 path really ran

  // Same layout, seed and precision: the same bits.
  EXPECT_EQ(a.loss_text, b.loss_text);
  auto wa = checkpoint::LoadFullWeights(a.dir + "/out/final");
  auto wb = checkpoint::LoadFullWeights(b.dir + "/out/final");
  auto wf = checkpoint::LoadFullWeights(fp32.dir + "/out/final");
  ASSERT_TRUE(wa.ok() && wb.ok() && wf.ok());
  auto same = checkpoint::CompareWeights(*wa, *wb);
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_EQ(same->max_abs_diff, 0.0);
  // The checkpoint holds the fp32 master weights, near the fp32 job's.
  auto near = checkpoint::CompareWeights(*wa, *wf);
  ASSERT_TRUE(near.ok()) << near.status();
  EXPECT_GT(near->rel_l2, 0.0);
  EXPECT_LT(near->rel_l2, 2e-2);
  std::printf("bf16 vs fp32 over %d steps: first loss %.6f vs %.6f, last %.6f vs %.6f, "
              "final weights rel L2 %.3g\n",
              kSteps, a.losses.front(), fp32.losses.front(), a.losses.back(), fp32.losses.back(),
              near->rel_l2);
}

// A Mixture-of-Experts model in bf16 with its experts split over ep 2
// (pp 2 x dp 2): it trains like its fp32 run (routing on the fp32 image of
// the bf16 MLP input, experts' GEMMs in bf16) and repeats bitwise.
TEST(Bf16TrainingTest, MixtureOfExpertsWithExpertParallelismTrainsCloseToFp32AndRepeats) {
  const std::string moe = "moe { experts: 4 top_k: 2 capacity_factor: 1.25 }";
  const std::string parallel = "pp: 2 dp: 2 ep: 2";
  const RunResult fp32 = RunJob("moe_fp32", "fp32", moe, parallel);
  const RunResult a = RunJob("moe_bf16_a", "bf16", moe, parallel);
  const RunResult b = RunJob("moe_bf16_b", "bf16", moe, parallel);
  ASSERT_EQ(fp32.exit_code, 0) << fp32.output;
  ASSERT_EQ(a.exit_code, 0) << a.output;
  ASSERT_EQ(b.exit_code, 0) << b.output;
  ASSERT_EQ(a.losses.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(fp32.losses.size(), static_cast<size_t>(kSteps));
  EXPECT_LT(a.losses.back(), 0.9 * a.losses.front());
  EXPECT_NEAR(a.losses.front(), fp32.losses.front(), 1e-2 * fp32.losses.front());
  EXPECT_NEAR(a.losses.back(), fp32.losses.back(), 5e-2 * fp32.losses.back());
  EXPECT_NE(a.loss_text, fp32.loss_text);  // the bf16 path really ran
  EXPECT_EQ(a.loss_text, b.loss_text);
  std::printf("MoE ep 2, bf16 vs fp32 over %d steps: first loss %.6f vs %.6f, last %.6f vs %.6f\n", kSteps,
              a.losses.front(), fp32.losses.front(), a.losses.back(), fp32.losses.back());
}

TEST(Bf16TrainingTest, Fp16IsRefusedNamingTheField) {
  const RunResult r = RunJob("fp16", "fp16");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(r.losses.empty());
  EXPECT_NE(r.output.find("train.precision"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("\"bf16\""), std::string::npos) << r.output;
}

}  // namespace
}  // namespace baton
