// SyntheticStage: ops take at least their configured time, activations and
// gradients carry values that catch lost, corrupted or misrouted transfers,
// the small gradient buffer feeds the norm and optimizer, and bad specs or
// call orders are errors.
#include "worker/synthetic_stage.h"

#include <cstring>
#include <chrono>
#include <cmath>
#include <memory>
#include <vector>

#include "gtest/gtest.h"

namespace baton {
namespace {

using kernels::Tensor;

v1::SyntheticCost Cost(double f, double bi, double bw, int64_t bytes) {
  v1::SyntheticCost cost;
  cost.set_forward_ms(f);
  cost.set_backward_input_ms(bi);
  cost.set_backward_weight_ms(bw);
  cost.set_activation_bytes(bytes);
  return cost;
}

std::vector<std::unique_ptr<SyntheticStage>> Pipeline(const v1::SyntheticCost& cost, int n) {
  std::vector<std::unique_ptr<SyntheticStage>> chunks;
  for (int c = 0; c < n; ++c) {
    auto chunk = SyntheticStage::Create(cost, c, n);
    EXPECT_TRUE(chunk.ok()) << chunk.status();
    chunks.push_back(std::move(*chunk));
  }
  return chunks;
}

// Milliseconds `op` took on the steady clock.
template <typename Op>
double TimeMs(Op op) {
  const auto start = std::chrono::steady_clock::now();
  op();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

TEST(SyntheticStageTest, OpsTakeAtLeastTheirConfiguredTimeAndPassCheckedTensors) {
  const int n = 3, microbatches = 4;
  auto chunks = Pipeline(Cost(4, 3, 2, 4096), n);
  EXPECT_EQ(chunks[0]->activation_elements(), 1024);
  // acts[mb][c]: chunk c's output; grads[mb][c]: gradient of chunk c's input.
  std::vector<std::vector<Tensor>> acts(microbatches), grads(microbatches);
  for (int mb = 0; mb < microbatches; ++mb) {
    for (int c = 0; c < n; ++c) {
      acts[mb].push_back(Tensor::Zeros({1024}));
      grads[mb].push_back(Tensor::Zeros({1024}));
    }
  }
  const MicrobatchData data;
  for (int mb = 0; mb < microbatches; ++mb) {
    for (int c = 0; c < n; ++c) {
      absl::Status st;
      const double ms = TimeMs([&] {
        st = chunks[c]->Forward(mb, data, c > 0 ? acts[mb][c - 1] : Tensor(),
                                c + 1 < n ? acts[mb][c] : Tensor());
      });
      ASSERT_TRUE(st.ok()) << st;
      EXPECT_GE(ms, 4.0);
    }
  }
  EXPECT_EQ(acts[2][1].f32()[1023], 2 * n + 2);  // mb · S + c + 1
  for (int mb = microbatches - 1; mb >= 0; --mb) {  // any order of microbatches
    for (int c = n - 1; c >= 0; --c) {
      absl::Status st;
      double ms = TimeMs([&] {
        st = chunks[c]->BackwardInput(mb, c + 1 < n ? grads[mb][c + 1] : Tensor(),
                                      c > 0 ? grads[mb][c] : Tensor());
      });
      ASSERT_TRUE(st.ok()) << st;
      EXPECT_GE(ms, 3.0);
      ms = TimeMs([&] { st = chunks[c]->BackwardWeight(mb); });
      ASSERT_TRUE(st.ok()) << st;
      EXPECT_GE(ms, 2.0);
    }
  }
  EXPECT_EQ(chunks[n - 1]->score().tokens, 0);
  EXPECT_EQ(chunks[n - 1]->score().loss_sum, 0.0);
}

TEST(SyntheticStageTest, CorruptedOrMisroutedTransfersAreErrorsNamingChunkAndMicrobatch) {
  auto chunks = Pipeline(Cost(0, 0, 0, 64), 2);
  const MicrobatchData data;
  Tensor act0 = Tensor::Zeros({16}), act1 = Tensor::Zeros({16});
  ASSERT_TRUE(chunks[0]->Forward(0, data, Tensor(), act0).ok());
  ASSERT_TRUE(chunks[0]->Forward(1, data, Tensor(), act1).ok());
  act0.f32()[5] += 0.5f;  // one corrupted element
  absl::Status st = chunks[1]->Forward(0, data, act0, Tensor());
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal);
  EXPECT_NE(st.message().find("synthetic chunk 1, microbatch 0"), absl::string_view::npos) << st;
  EXPECT_NE(st.message().find("[5]"), absl::string_view::npos) << st;
  // Microbatch 1's activations delivered as microbatch 0's.
  st = chunks[1]->Forward(0, data, act1, Tensor());
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
  EXPECT_TRUE(chunks[1]->Forward(1, data, act1, Tensor()).ok());
  // A gradient that never arrived (still zero) is caught on the way back.
  Tensor grad = Tensor::Zeros({16});
  st = chunks[0]->BackwardInput(1, grad, Tensor());
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
  ASSERT_TRUE(chunks[1]->BackwardInput(1, Tensor(), grad).ok());
  EXPECT_TRUE(chunks[0]->BackwardInput(1, grad, Tensor()).ok());
  // A wrongly sized buffer is a usage error.
  EXPECT_EQ(chunks[1]->Forward(2, data, Tensor::Zeros({8}), Tensor()).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(SyntheticStageTest, GradientsFeedTheNormAndTheOptimizer) {
  auto chunks = Pipeline(Cost(0, 0, 0, 4), 1);
  SyntheticStage& s = *chunks[0];
  const MicrobatchData data;
  for (int mb = 0; mb < 2; ++mb) {
    ASSERT_TRUE(s.Forward(mb, data, Tensor(), Tensor()).ok());
    ASSERT_TRUE(s.BackwardInput(mb, Tensor(), Tensor()).ok());
    ASSERT_TRUE(s.BackwardWeight(mb).ok());
  }
  const Tensor g = s.Gradients();
  ASSERT_EQ(g.numel(), kSyntheticGradElements);
  double want = 0;
  for (int64_t i = 0; i < g.numel(); ++i) {
    EXPECT_FLOAT_EQ(g.f32()[i], 2e-3f * static_cast<float>(i % 7 + 1));
    want += double{g.f32()[i]} * g.f32()[i];
  }
  EXPECT_NEAR(s.LocalGradSqNorm(), want, 1e-9);
  g.f32()[0] = 1.0f;  // as a DP all-reduce writes into the buffer
  ASSERT_TRUE(s.OptimizerStep(0.5f).ok());
  const std::vector<NamedShard> shards = s.Shards();
  ASSERT_EQ(shards.size(), 1u);
  EXPECT_EQ(shards[0].name, "synthetic.0.weight");
  EXPECT_EQ(shards[0].split_dim, -1);
  EXPECT_FLOAT_EQ(shards[0].value.f32()[0], -0.005f);  // −= 0.01 · 0.5 · 1
  s.ZeroGrad();
  EXPECT_EQ(s.LocalGradSqNorm(), 0.0);
}

TEST(SyntheticStageTest, RestoredStateReproducesTheNextStepsBitForBit) {
  auto chunks = Pipeline(Cost(0, 0, 0, 4), 1);
  SyntheticStage& s = *chunks[0];
  const MicrobatchData data;
  auto step = [&](float scale) {
    s.ZeroGrad();
    for (int mb = 0; mb < 2; ++mb) {
      ASSERT_TRUE(s.Forward(mb, data, Tensor(), Tensor()).ok());
      ASSERT_TRUE(s.BackwardInput(mb, Tensor(), Tensor()).ok());
      ASSERT_TRUE(s.BackwardWeight(mb).ok());
    }
    ASSERT_TRUE(s.OptimizerStep(scale).ok());
  };
  step(1.0f);
  const ChunkState saved = s.CaptureState();
  EXPECT_EQ(saved.optimizer_step, 1);
  ASSERT_EQ(saved.values.size(), static_cast<size_t>(kSyntheticGradElements));
  EXPECT_TRUE(saved.adam_m.empty() && saved.adam_v.empty());
  step(0.5f);
  step(0.25f);
  const ChunkState want = s.CaptureState();
  EXPECT_EQ(want.optimizer_step, 3);
  ASSERT_NE(std::memcmp(want.values.data(), saved.values.data(), 4 * saved.values.size()), 0);

  ASSERT_TRUE(s.Forward(0, data, Tensor(), Tensor()).ok());  // in flight: dropped by restore
  ASSERT_TRUE(s.RestoreState(saved).ok());
  step(0.5f);
  step(0.25f);
  const ChunkState got = s.CaptureState();
  EXPECT_EQ(got.optimizer_step, 3);
  EXPECT_EQ(std::memcmp(got.values.data(), want.values.data(), 4 * want.values.size()), 0);

  ChunkState wrong = saved;
  wrong.values.pop_back();
  EXPECT_EQ(s.RestoreState(wrong).code(), absl::StatusCode::kInvalidArgument);
  wrong = saved;
  wrong.adam_m.assign(kSyntheticGradElements, 0.0f);
  EXPECT_EQ(s.RestoreState(wrong).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.CaptureState().optimizer_step, 3);  // a refused state changes nothing
}

TEST(SyntheticStageTest, BadSpecsAndCallOrdersAreErrors) {
  auto negative = SyntheticStage::Create(Cost(1, -1, 1, 64), 0, 1);
  EXPECT_NE(negative.status().message().find("model.synthetic.backward_input_ms"),
            absl::string_view::npos);
  auto tiny = SyntheticStage::Create(Cost(1, 1, 1, 3), 0, 1);
  EXPECT_NE(tiny.status().message().find("model.synthetic.activation_bytes"),
            absl::string_view::npos);
  auto chunks = Pipeline(Cost(0, 0, 0, 64), 1);
  SyntheticStage& s = *chunks[0];
  const MicrobatchData data;
  EXPECT_EQ(s.BackwardInput(0, Tensor(), Tensor()).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(s.Forward(0, data, Tensor(), Tensor()).ok());
  EXPECT_EQ(s.Forward(0, data, Tensor(), Tensor()).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.BackwardWeight(0).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.OptimizerStep(1.0f).code(), absl::StatusCode::kFailedPrecondition);
  s.DropInFlight();  // a discarded step leaves nothing behind
  EXPECT_TRUE(s.OptimizerStep(1.0f).ok());
  EXPECT_TRUE(s.Forward(0, data, Tensor(), Tensor()).ok());
}

}  // namespace
}  // namespace baton
