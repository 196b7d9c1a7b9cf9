// GptStageModel: chunks built from explicit (uneven, interleaved) block ranges
// and driven through the StageModel interface compute the unsharded model's
// loss, accuracy and gradients; the tied embedding stays one tensor; Shards()
// reassemble into the full parameters; bad wiring is an error.
#include "worker/gpt_stage_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/gemm.h"
#include "worker/comm/inproc_communicator.h"
#include "worker/model/inproc_model.h"
#include "worker/model/model_test_util.h"

namespace baton {
namespace {

using kernels::Tensor;
using model::Full;

constexpr int64_t kBatch = 2;

model::GptConfig SmallModel() {
  model::GptConfig c;
  c.layers = 4;
  c.d_model = 32;
  c.heads = 4;
  c.vocab = 40;
  c.seq_len = 12;
  return c;
}

double RelError(const float* got, const std::vector<float>& want) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff += (double{got[i]} - want[i]) * (double{got[i]} - want[i]);
    norm += double{want[i]} * want[i];
  }
  return std::sqrt(diff) / std::max(std::sqrt(norm), 1e-30);
}

class GptStageModelTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { kernels::cpu::SetBlasThreads(1); }

  void SetUp() override {
    std::mt19937 rng(17);
    std::uniform_int_distribution<int> id(0, model_.vocab - 1);
    for (int mb = 0; mb < 2; ++mb) {
      MicrobatchData d;
      d.tokens = Tensor::Zeros({kBatch, model_.seq_len}, kernels::DType::kInt32);
      d.targets = Tensor::Zeros({kBatch, model_.seq_len}, kernels::DType::kInt32);
      for (int64_t i = 0; i < d.tokens.numel(); ++i) {
        d.tokens.i32()[i] = id(rng);
        d.targets.i32()[i] = i % 4 == 0 ? -1 : id(rng);  // some positions not scored
      }
      data_.push_back(d);
    }
  }

  // The unsharded reference after one forward/backward of data_.
  std::unique_ptr<model::InProcModel> Reference() {
    auto m = model::InProcModel::Create(model_, 1, 1, kSeed, 2, false);
    EXPECT_TRUE(m.ok());
    EXPECT_TRUE((*m)->ForwardBackward({data_[0].tokens, data_[1].tokens},
                                      {data_[0].targets, data_[1].targets})
                    .ok());
    return std::move(*m);
  }

  // One model per chunk of a single-TP-rank pipeline over `ranges`.
  // With `local_tie` the first and last chunk sum their tied embedding
  // gradients without a group, as on the rank of a V that holds both.
  std::vector<std::unique_ptr<GptStageModel>> MakeChunks(
      const std::vector<model::BlockRange>& ranges, bool local_tie = false) {
    if (!local_tie) tie_ = comm::InProcCommunicator::CreateGroup(2);  // (earlier chunks' group is replaced)
    std::vector<std::unique_ptr<GptStageModel>> chunks;
    const int n = static_cast<int>(ranges.size());
    for (int c = 0; c < n; ++c) {
      auto config = model::MakeChunkConfig(model_, c, n, ranges[c], 0, 1, kSeed);
      EXPECT_TRUE(config.ok()) << config.status();
      config->microbatches = 2;
      config->precision = precision_;
      comm::Communicator* tie = c == 0 ? tie_[0].get() : c == n - 1 ? tie_[1].get() : nullptr;
      auto chunk = GptStageModel::Create(*config, kBatch, nullptr, n > 1 && !local_tie ? tie : nullptr,
                                         AdamWFromTrainSpec(train_));
      EXPECT_TRUE(chunk.ok()) << chunk.status();
      chunks.push_back(std::move(*chunk));
    }
    if (local_tie) EXPECT_TRUE(GptStageModel::TieLocally(*chunks.front(), *chunks.back()).ok());
    return chunks;
  }

  // Runs both microbatches through the chunks in order (1F1B-like: each
  // microbatch forward then backward) and syncs the tied gradients.
  void RunStep(std::vector<std::unique_ptr<GptStageModel>>& chunks) {
    const int n = static_cast<int>(chunks.size());
    for (auto& c : chunks) c->ZeroGrad();
    for (int mb = 0; mb < 2; ++mb) {
      std::vector<Tensor> acts, grads;
      for (int c = 0; c < n; ++c) {
        acts.push_back(Tensor::Zeros({chunks[c]->activation_elements()}, chunks[c]->activation_dtype()));
        grads.push_back(Tensor::Zeros({chunks[c]->activation_elements()}, chunks[c]->activation_dtype()));
      }
      for (int c = 0; c < n; ++c) {
        ASSERT_TRUE(chunks[c]
                        ->Forward(mb, data_[mb], c > 0 ? acts[c - 1] : Tensor(),
                                  c + 1 < n ? acts[c] : Tensor())
                        .ok());
      }
      for (int c = n - 1; c >= 0; --c) {
        ASSERT_TRUE(chunks[c]
                        ->BackwardInput(mb, c + 1 < n ? grads[c + 1] : Tensor(),
                                        c > 0 ? grads[c] : Tensor())
                        .ok());
        ASSERT_TRUE(chunks[c]->BackwardWeight(mb).ok());
      }
    }
    absl::Status first;
    std::thread sync([&] { first = chunks[0]->SyncTiedGradients(); });
    const absl::Status last = chunks[n - 1]->SyncTiedGradients();
    sync.join();
    ASSERT_TRUE(first.ok()) << first;
    ASSERT_TRUE(last.ok()) << last;
    for (int c = 1; c + 1 < n; ++c) ASSERT_TRUE(chunks[c]->SyncTiedGradients().ok());
  }

  static constexpr uint64_t kSeed = 21;
  model::GptConfig model_ = SmallModel();
  std::vector<MicrobatchData> data_;
  std::vector<std::unique_ptr<comm::InProcCommunicator>> tie_;
  v1::TrainSpec train_;
  kernels::Precision precision_ = kernels::Precision::kFloat32;
};

TEST_F(GptStageModelTest, ExplicitAndInterleavedChunksComputeTheUnshardedModel) {
  auto ref = Reference();
  const model::StepScore want = ref->stage(0, 0).score();
  ASSERT_EQ(want.tokens, 2 * kBatch * 9);  // 3 of every 4 targets scored
  const std::vector<std::vector<model::BlockRange>> layouts = {
      {{0, 1}, {1, 3}},                  // uneven, as a planner may choose
      {{0, 1}, {1, 1}, {2, 1}, {3, 1}},  // pp 2 × 2 virtual stages: 4 chunks
      {{0, 2}, {2, 1}, {3, 1}},          // three uneven chunks
  };
  for (const auto& ranges : layouts) {
    SCOPED_TRACE(::testing::Message() << ranges.size() << " chunks, first has "
                                      << ranges[0].count << " blocks");
    auto chunks = MakeChunks(ranges);
    RunStep(chunks);
    const model::StepScore got = chunks.back()->score();
    EXPECT_EQ(got.tokens, want.tokens);
    EXPECT_EQ(got.correct, want.correct);
    EXPECT_NEAR(got.loss_sum, want.loss_sum, 1e-5 * want.loss_sum);
    EXPECT_EQ(chunks.front()->score().tokens, 0);  // only the last chunk scores
    double norm = 0;
    for (auto& chunk : chunks) {
      norm += chunk->LocalGradSqNorm();
      for (const model::Parameter& p : chunk->stage().parameters().parameters()) {
        EXPECT_LT(RelError(p.grad.f32(), Full(ref->FullGrad(p.spec.name))), 1e-5) << p.spec.name;
      }
      // Gradients() is the flat buffer holding every parameter's gradient.
      const Tensor flat = chunk->Gradients();
      EXPECT_EQ(flat.raw(), chunk->stage().parameters().grads().raw());
    }
    EXPECT_NEAR(norm, ref->GlobalGradSqNorm(), 1e-5 * norm);
  }
}

// MoE: each chunk reports its own blocks' routing (every token's top-k
// choices, the kept ones within capacity) and its load-balancing loss as it
// enters the objective, so the chunks' losses add up to the unsharded
// model's; a dense chunk reports nothing.
TEST_F(GptStageModelTest, MoeStatsAreEachChunksRoutingAndLoadBalancingLoss) {
  model_.moe_experts = 4;
  model_.moe_top_k = 2;
  model_.moe_capacity_factor = 0.5;  // drops: an expert keeps at most 6 of a microbatch's 48 choices
  model_.moe_aux_coef = 0.01f;
  const double want_aux = Reference()->LastAuxLoss();
  ASSERT_GT(want_aux, 0);
  auto chunks = MakeChunks({{0, 1}, {1, 3}});
  RunStep(chunks);
  const int64_t tokens = 2 * kBatch * model_.seq_len;  // two microbatches
  const int64_t capacity = kernels::MoeExpertCapacity(kBatch * model_.seq_len, 4, 2, 0.5);
  double aux = 0;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const int blocks = c == 0 ? 1 : 3;
    const MoeStats stats = chunks[c]->ReadMoeStats();
    ASSERT_EQ(stats.routed.size(), 4u) << "chunk " << c;
    ASSERT_EQ(stats.kept.size(), 4u) << "chunk " << c;
    int64_t routed = 0, kept = 0;
    for (int e = 0; e < 4; ++e) {
      EXPECT_LE(stats.kept[e], stats.routed[e]) << "chunk " << c << " expert " << e;
      EXPECT_LE(stats.kept[e], 2 * blocks * capacity) << "chunk " << c << " expert " << e;
      routed += stats.routed[e];
      kept += stats.kept[e];
    }
    EXPECT_EQ(routed, tokens * 2 * blocks) << "chunk " << c << ": every token's two choices in every block";
    EXPECT_LT(kept, routed) << "chunk " << c << ": capacity 0.5 drops";
    EXPECT_GT(stats.aux_loss, 0) << "chunk " << c;
    aux += stats.aux_loss;
  }
  EXPECT_NEAR(aux, want_aux, 1e-6 * want_aux);
  // ZeroGrad starts the counts over.
  chunks[0]->ZeroGrad();
  const MoeStats zeroed = chunks[0]->ReadMoeStats();
  EXPECT_EQ(zeroed.routed, std::vector<int64_t>(4, 0));
  EXPECT_EQ(zeroed.aux_loss, 0);

  model_ = SmallModel();
  auto dense = MakeChunks({{0, 2}, {2, 2}});
  RunStep(dense);
  for (const auto& chunk : dense) {
    const MoeStats stats = chunk->ReadMoeStats();
    EXPECT_TRUE(stats.routed.empty());
    EXPECT_TRUE(stats.kept.empty());
    EXPECT_EQ(stats.aux_loss, 0);
  }
}

TEST_F(GptStageModelTest, TiedEmbeddingCopiesStayEqualAndTheOptimizerUsesTheTrainSpec) {
  train_.set_lr(0.01);
  train_.set_weight_decay(0.1);
  const kernels::AdamWConfig adamw = AdamWFromTrainSpec(train_);
  EXPECT_FLOAT_EQ(adamw.lr, 0.01f);
  EXPECT_FLOAT_EQ(adamw.weight_decay, 0.1f);
  EXPECT_FLOAT_EQ(adamw.beta1, 0.9f);
  EXPECT_FLOAT_EQ(adamw.beta2, 0.95f);
  EXPECT_FLOAT_EQ(adamw.eps, 1e-8f);

  auto chunks = MakeChunks({{0, 2}, {2, 2}});
  auto ref = model::InProcModel::Create(model_, 1, 1, kSeed, 2, false);
  ASSERT_TRUE(ref.ok());
  for (int step = 0; step < 2; ++step) {
    RunStep(chunks);
    for (auto& c : chunks) ASSERT_TRUE(c->OptimizerStep(1.0f).ok());
    ASSERT_TRUE((*ref)->ForwardBackward({data_[0].tokens, data_[1].tokens},
                                        {data_[0].targets, data_[1].targets})
                    .ok());
    ASSERT_TRUE((*ref)->OptimizerStep(adamw, 0.0).ok());
  }
  const model::Parameter* first = chunks[0]->stage().parameters().Find("wte");
  const model::Parameter* last = chunks[1]->stage().parameters().Find("wte");
  EXPECT_EQ(std::memcmp(first->value.raw(), last->value.raw(), first->value.bytes()), 0);
  EXPECT_LT(RelError(first->value.f32(), Full((*ref)->FullValue("wte"))), 1e-5);
  EXPECT_LT(RelError(chunks[1]->stage().parameters().Find("h.3.mlp.c_fc.weight")->value.f32(),
                     Full((*ref)->FullValue("h.3.mlp.c_fc.weight"))),
            1e-5);
}

// The V's rank 0 holds the first and the last chunk: their tied embedding
// gradients summed locally give the two-rank tie group's bits exactly.
TEST_F(GptStageModelTest, TiedEmbeddingSummedLocallyIsBitwiseTheTieGroupsSum) {
  auto grouped = MakeChunks({{0, 1}, {1, 1}, {2, 2}});
  auto local = MakeChunks({{0, 1}, {1, 1}, {2, 2}}, /*local_tie=*/true);
  for (int step = 0; step < 2; ++step) {
    RunStep(grouped);
    RunStep(local);
    for (size_t c = 0; c < grouped.size(); ++c) {
      ASSERT_TRUE(grouped[c]->OptimizerStep(1.0f).ok());
      ASSERT_TRUE(local[c]->OptimizerStep(1.0f).ok());
    }
  }
  for (size_t c = 0; c < grouped.size(); ++c) {
    const Tensor a = grouped[c]->stage().parameters().values(), b = local[c]->stage().parameters().values();
    ASSERT_EQ(a.bytes(), b.bytes());
    EXPECT_EQ(std::memcmp(a.raw(), b.raw(), a.bytes()), 0) << "chunk " << c;
  }
  const model::Parameter* first = local[0]->stage().parameters().Find("wte");
  const model::Parameter* last = local[2]->stage().parameters().Find("wte");
  EXPECT_EQ(std::memcmp(first->value.raw(), last->value.raw(), first->value.bytes()), 0);
}

// Reassembles a full tensor from every TP rank's NamedShard, reading only the
// NamedShard fields (as a checkpoint reader would).
std::vector<float> Assemble(const std::vector<NamedShard>& ranks) {
  const NamedShard& s0 = ranks[0];
  const int64_t tp = static_cast<int64_t>(ranks.size());
  std::vector<float> full(kernels::NumElements(s0.full_shape));
  if (s0.split_dim < 0) {
    std::memcpy(full.data(), s0.value.f32(), full.size() * sizeof(float));
    return full;
  }
  int64_t outer = 1, split = s0.full_shape[s0.split_dim], inner = 1;
  for (int d = 0; d < s0.split_dim; ++d) outer *= s0.full_shape[d];
  for (size_t d = s0.split_dim + 1; d < s0.full_shape.size(); ++d) inner *= s0.full_shape[d];
  if (s0.qkv) {  // [3 · C, ...]: q, k and v each split
    outer = 3;
    split /= 3;
  }
  const int64_t piece = split / tp;
  for (int64_t r = 0; r < tp; ++r) {
    for (int64_t o = 0; o < outer; ++o) {
      std::memcpy(full.data() + (o * split + r * piece) * inner,
                  ranks[r].value.f32() + o * piece * inner, piece * inner * sizeof(float));
    }
  }
  return full;
}

TEST_F(GptStageModelTest, ShardsReassembleIntoTheFullParametersWithOneTiedEmbedding) {
  const int tp = 2;
  auto ref = model::InProcModel::Create(model_, 1, 1, kSeed, 1, false);
  ASSERT_TRUE(ref.ok());
  // Create only checks the TP groups; nothing runs across them here.
  auto tp_groups = comm::InProcCommunicator::CreateGroup(tp);
  auto tp_groups_last = comm::InProcCommunicator::CreateGroup(tp);
  std::vector<std::vector<std::unique_ptr<comm::InProcCommunicator>>> ties;
  std::vector<std::vector<std::unique_ptr<GptStageModel>>> chunks(2);  // [chunk][tp rank]
  for (int r = 0; r < tp; ++r) {
    ties.push_back(comm::InProcCommunicator::CreateGroup(2));
    for (int c = 0; c < 2; ++c) {
      auto config = model::MakeChunkConfig(model_, c, 2, c == 0 ? model::BlockRange{0, 3}
                                                                 : model::BlockRange{3, 1},
                                           r, tp, kSeed);
      ASSERT_TRUE(config.ok()) << config.status();
      auto m = GptStageModel::Create(*config, kBatch,
                                     (c == 0 ? tp_groups : tp_groups_last)[r].get(),
                                     ties[r][c].get(), AdamWFromTrainSpec(train_));
      ASSERT_TRUE(m.ok()) << m.status();
      chunks[c].push_back(std::move(*m));
    }
  }
  std::vector<std::string> seen;
  for (int c = 0; c < 2; ++c) {
    std::vector<std::vector<NamedShard>> by_rank;
    for (int r = 0; r < tp; ++r) by_rank.push_back(chunks[c][r]->Shards());
    for (size_t i = 0; i < by_rank[0].size(); ++i) {
      std::vector<NamedShard> shards;
      for (int r = 0; r < tp; ++r) shards.push_back(by_rank[r][i]);
      const NamedShard& s = shards[0];
      SCOPED_TRACE(s.name);
      EXPECT_EQ(s.tied_copy, c == 1 && s.name == "wte");
      if (s.tied_copy) continue;  // the first chunk's "wte" is the tensor
      seen.push_back(s.name);
      EXPECT_EQ(Assemble(shards), Full((*ref)->FullValue(s.name)));
      EXPECT_EQ(s.qkv, s.name.find("c_attn") != std::string::npos);
    }
  }
  std::vector<std::string> names = (*ref)->ParameterNames();
  std::sort(names.begin(), names.end());
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(seen, names);  // every parameter exactly once
  // The last chunk's copy holds the same values as the first chunk's wte.
  const NamedShard copy = chunks[1][0]->Shards().back();
  ASSERT_EQ(copy.name, "wte");
  EXPECT_EQ(std::vector<float>(copy.value.f32(), copy.value.f32() + copy.value.numel()),
            Full((*ref)->FullValue("wte")));
}

TEST_F(GptStageModelTest, BadWiringAndInputsAreErrors) {
  auto config = model::MakeChunkConfig(model_, 0, 2, {0, 2}, 0, 1, kSeed);
  ASSERT_TRUE(config.ok());
  // Without a tie group the tied embedding needs a local partner before its sum.
  auto no_tie = GptStageModel::Create(*config, kBatch, nullptr, nullptr, {});
  ASSERT_TRUE(no_tie.ok()) << no_tie.status();
  const absl::Status unpaired = (*no_tie)->SyncTiedGradients();
  EXPECT_EQ(unpaired.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(unpaired.message().find("no tie group and no local partner"), absl::string_view::npos);
  auto tied = MakeChunks({{0, 2}, {2, 2}});
  EXPECT_EQ(GptStageModel::TieLocally(*tied[0], *tied[1]).code(), absl::StatusCode::kInvalidArgument);
  auto bad_batch = GptStageModel::Create(*config, 0, nullptr, nullptr, {});
  EXPECT_NE(bad_batch.status().message().find("train.micro_batch_size"), absl::string_view::npos);
  auto gap = model::MakeChunkConfig(model_, 1, 2, {3, 1}, 0, 1, kSeed);
  EXPECT_TRUE(gap.ok());  // a range ending at the last layer is a valid last chunk
  auto not_first = model::MakeChunkConfig(model_, 1, 3, {0, 2}, 0, 1, kSeed);
  EXPECT_NE(not_first.status().message().find("model chunk 1 of 3"), absl::string_view::npos)
      << not_first.status();

  auto chunks = MakeChunks({{0, 2}, {2, 2}});
  const Tensor short_input = Tensor::Zeros({10});
  const absl::Status st = chunks[1]->Forward(0, data_[0], short_input, Tensor());
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("input"), absl::string_view::npos) << st;
}

bool SameState(const ChunkState& a, const ChunkState& b) {
  auto same = [](const std::vector<float>& x, const std::vector<float>& y) {
    return x.size() == y.size() &&
           std::memcmp(x.data(), y.data(), sizeof(float) * x.size()) == 0;
  };
  return a.optimizer_step == b.optimizer_step && same(a.values, b.values) &&
         same(a.adam_m, b.adam_m) && same(a.adam_v, b.adam_v);
}

TEST_F(GptStageModelTest, RestoredStateReproducesTheNextStepsBitForBit) {
  train_.set_lr(0.01);
  train_.set_weight_decay(0.1);
  auto step = [&](std::vector<std::unique_ptr<GptStageModel>>& chunks) {
    RunStep(chunks);
    for (auto& c : chunks) ASSERT_TRUE(c->OptimizerStep(0.75f).ok());
  };
  auto capture = [](const std::vector<std::unique_ptr<GptStageModel>>& chunks) {
    std::vector<ChunkState> out;
    for (const auto& c : chunks) out.push_back(c->CaptureState());
    return out;
  };

  auto chunks = MakeChunks({{0, 2}, {2, 2}});
  step(chunks);
  const std::vector<ChunkState> saved = capture(chunks);
  ASSERT_EQ(saved[0].optimizer_step, 1);
  ASSERT_EQ(saved[0].values.size(), saved[0].adam_m.size());
  ASSERT_EQ(saved[0].values.size(), saved[0].adam_v.size());
  step(chunks);
  step(chunks);
  const std::vector<ChunkState> want = capture(chunks);
  ASSERT_EQ(want[1].optimizer_step, 3);
  ASSERT_FALSE(SameState(want[0], saved[0]));  // training changed the state

  // The same models, rolled back mid-step (a microbatch in flight).
  ASSERT_TRUE(chunks[0]->Forward(0, data_[0], Tensor(), Tensor::Zeros({chunks[0]->activation_elements()})).ok());
  for (int c = 0; c < 2; ++c) ASSERT_TRUE(chunks[c]->RestoreState(saved[c]).ok());
  EXPECT_TRUE(SameState(chunks[0]->CaptureState(), saved[0]));
  step(chunks);
  step(chunks);
  std::vector<ChunkState> got = capture(chunks);
  for (int c = 0; c < 2; ++c) EXPECT_TRUE(SameState(got[c], want[c])) << "chunk " << c;

  // Fresh models (as a replacement worker builds them) given the saved state.
  chunks = MakeChunks({{0, 2}, {2, 2}});
  for (int c = 0; c < 2; ++c) ASSERT_TRUE(chunks[c]->RestoreState(saved[c]).ok());
  step(chunks);
  step(chunks);
  got = capture(chunks);
  for (int c = 0; c < 2; ++c) EXPECT_TRUE(SameState(got[c], want[c])) << "fresh chunk " << c;
}

// bf16: the state is the fp32 master state (the fp32 model's sizes), and a
// restore rounds the restored weights into the bf16 GEMM copies, so a fresh
// model given a saved state continues exactly as the saved one did.
TEST_F(GptStageModelTest, Bf16StateIsTheFp32MasterStateAndARestoreRefreshesTheBf16Copies) {
  train_.set_lr(0.01);
  auto fp32 = MakeChunks({{0, 2}, {2, 2}});
  precision_ = kernels::Precision::kBFloat16;
  auto chunks = MakeChunks({{0, 2}, {2, 2}});
  EXPECT_EQ(chunks[0]->activation_dtype(), kernels::DType::kBFloat16);
  EXPECT_EQ(fp32[0]->activation_dtype(), kernels::DType::kFloat32);
  auto step = [&](std::vector<std::unique_ptr<GptStageModel>>& c) {
    RunStep(c);
    for (auto& chunk : c) ASSERT_TRUE(chunk->OptimizerStep(1.0f).ok());
  };
  step(chunks);
  std::vector<ChunkState> saved;
  for (const auto& c : chunks) saved.push_back(c->CaptureState());
  for (int c = 0; c < 2; ++c) {
    EXPECT_EQ(saved[c].values.size(), fp32[c]->CaptureState().values.size());
  }
  step(chunks);
  step(chunks);
  std::vector<ChunkState> want;
  for (const auto& c : chunks) want.push_back(c->CaptureState());

  auto fresh = MakeChunks({{0, 2}, {2, 2}});
  for (int c = 0; c < 2; ++c) ASSERT_TRUE(fresh[c]->RestoreState(saved[c]).ok());
  step(fresh);
  step(fresh);
  for (int c = 0; c < 2; ++c) {
    EXPECT_TRUE(SameState(fresh[c]->CaptureState(), want[c])) << "fresh chunk " << c;
  }
}

TEST_F(GptStageModelTest, RestoringAStateOfAnotherLayoutIsRefusedAndChangesNothing) {
  auto chunks = MakeChunks({{0, 1}, {1, 3}});
  const ChunkState first = chunks[0]->CaptureState();
  const ChunkState last = chunks[1]->CaptureState();
  ASSERT_NE(first.values.size(), last.values.size());
  const absl::Status s = chunks[1]->RestoreState(first);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("another layout"), absl::string_view::npos) << s;
  EXPECT_TRUE(SameState(chunks[1]->CaptureState(), last));

  ChunkState no_moments = last;
  no_moments.adam_m.clear();
  EXPECT_EQ(chunks[1]->RestoreState(no_moments).code(), absl::StatusCode::kInvalidArgument);
  ChunkState negative = last;
  negative.optimizer_step = -1;
  EXPECT_EQ(chunks[1]->RestoreState(negative).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(SameState(chunks[1]->CaptureState(), last));
}

TEST_F(GptStageModelTest, StateMovesBitForBitToAndFromASimulatedDevice) {
  // A trained state from the host...
  auto chunks = MakeChunks({{0, 2}, {2, 2}});
  RunStep(chunks);
  for (auto& c : chunks) ASSERT_TRUE(c->OptimizerStep(1.0f).ok());
  const ChunkState trained = chunks[1]->CaptureState();
  ASSERT_EQ(trained.optimizer_step, 1);

  // ...restored into the same chunk placed on the simulated device (whose
  // memory aborts on host access, so only stream copies can move it) and
  // captured back.
  auto config = model::MakeChunkConfig(model_, 1, 2, {2, 2}, 0, 1, kSeed);
  ASSERT_TRUE(config.ok());
  config->microbatches = 2;
  config->device = kernels::Device::Sim(0);
  auto tie = comm::InProcCommunicator::CreateGroup(2);
  auto sim = GptStageModel::Create(*config, kBatch, nullptr, tie[1].get(), AdamWFromTrainSpec(train_));
  ASSERT_TRUE(sim.ok()) << sim.status();
  const ChunkState initial = (*sim)->CaptureState();
  EXPECT_EQ(initial.optimizer_step, 0);
  EXPECT_FALSE(SameState(initial, trained));
  ASSERT_TRUE((*sim)->RestoreState(trained).ok());
  EXPECT_TRUE(SameState((*sim)->CaptureState(), trained));
}

}  // namespace
}  // namespace baton
