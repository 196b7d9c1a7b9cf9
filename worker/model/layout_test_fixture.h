// What the GPT-2 and Llama stage tests share: a fixture with two
// microbatches of 2 x 12 random ids for its model, run at any pp x tp layout
// through an InProcModel, and the check that a tiny model memorises one
// fixed batch.
#ifndef BATON_WORKER_MODEL_LAYOUT_TEST_FIXTURE_H_
#define BATON_WORKER_MODEL_LAYOUT_TEST_FIXTURE_H_

#include <cmath>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/gemm.h"
#include "kernels/tensor.h"
#include "worker/model/gpt_config.h"
#include "worker/model/inproc_model.h"
#include "worker/model/model_test_util.h"

namespace baton::model {

class LayoutTest : public ::testing::Test {
 protected:
  explicit LayoutTest(GptConfig model) : model_(std::move(model)) {}

  static void SetUpTestSuite() { kernels::cpu::SetBlasThreads(1); }
  void SetUp() override { DrawBatches(); }

  // Two microbatches of 2 x `seq` ids (12 < seq_len by default) for model_,
  // from seed 7: again after a test changes model_.vocab.
  void DrawBatches(int64_t seq = 12) {
    tokens_.clear();
    targets_.clear();
    std::mt19937 rng(7);
    for (int mb = 0; mb < 2; ++mb) {
      tokens_.push_back(RandomIds(rng, 2, seq, model_.vocab));
      targets_.push_back(RandomIds(rng, 2, seq, model_.vocab));
    }
  }

  // model_ at pp x tp (x cp) (seed 42), one forward and backward of the batches;
  // *loss is their mean loss. Null (a failed expectation) when it cannot run.
  std::unique_ptr<InProcModel> Run(int pp, int tp, double* loss, bool vocab_parallel = false,
                                   bool sequence_parallel = false, int cp = 1) {
    auto m = InProcModel::Create(model_, pp, tp, /*seed=*/42, /*microbatches=*/2, vocab_parallel,
                                 kernels::Device::Cpu(), kernels::Precision::kFloat32, sequence_parallel, cp);
    EXPECT_TRUE(m.ok()) << m.status();
    if (!m.ok()) return nullptr;
    auto l = (*m)->ForwardBackward(tokens_, targets_);
    EXPECT_TRUE(l.ok()) << l.status();
    *loss = l.ok() ? *l : NAN;
    return std::move(*m);
  }

  GptConfig model_;
  std::vector<kernels::Tensor> tokens_, targets_;
};

// 300 AdamW steps (lr 1e-2) of `tiny` (vocab 16, seq_len 8) on one batch of
// 4 x 8 random ids: the loss starts near ln 16 and ends memorised, with
// every argmax on the target.
inline void ExpectMemorisesAFixedBatch(const GptConfig& tiny) {
  auto m = InProcModel::Create(tiny, 1, 1, 3, 1, false);
  ASSERT_TRUE(m.ok()) << m.status();
  std::mt19937 rng(11);
  const std::vector<kernels::Tensor> tokens = {RandomIds(rng, 4, 8, tiny.vocab)};
  const std::vector<kernels::Tensor> targets = {RandomIds(rng, 4, 8, tiny.vocab)};
  kernels::AdamWConfig adam;
  adam.lr = 1e-2f;
  double first = 0, last = 0;
  for (int step = 0; step < 300; ++step) {
    auto loss = (*m)->ForwardBackward(tokens, targets);
    ASSERT_TRUE(loss.ok()) << loss.status();
    if (step == 0) first = *loss;
    last = *loss;
    ASSERT_TRUE((*m)->OptimizerStep(adam, 1.0).ok());
  }
  EXPECT_GT(first, 2.0);  // ~ln 16 before training
  EXPECT_LT(last, 0.05);  // memorised
  const StepScore score = (*m)->stage(0, 0).score();
  EXPECT_EQ(score.tokens, 4 * 8);
  EXPECT_EQ(score.correct, score.tokens);  // every argmax is the target
}

}  // namespace baton::model

#endif  // BATON_WORKER_MODEL_LAYOUT_TEST_FIXTURE_H_
