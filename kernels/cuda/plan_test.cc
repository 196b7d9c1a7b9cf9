// CPU tests of the CUDA kernels' host-side planning: the cuBLASLt mapping is
// executed by a plain column-major reference GEMM (BLAS semantics, as cuBLASLt
// reads its descriptors) and compared with the row-major CPU kernels.
#include "kernels/cuda/plan.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/matmul.h"

namespace baton::cuda {
namespace {

// D = α op(A) op(B) + β C, column-major, exactly as cuBLASLt interprets an
// LtGemm: element (i, j) of a stored matrix with leading dimension ld is at
// i + j·ld.
void ColMajorGemm(const LtGemm& lt, float alpha, const float* a, const float* b, float beta,
                  float* c) {
  for (int64_t item = 0; item < lt.batch; ++item) {
    const float* ai = a + item * lt.stride_a;
    const float* bi = b + item * lt.stride_b;
    float* ci = c + item * lt.stride_c;
    for (int64_t j = 0; j < lt.n; ++j) {
      for (int64_t i = 0; i < lt.m; ++i) {
        double sum = 0;
        for (int64_t p = 0; p < lt.k; ++p) {
          const float av = lt.trans_a ? ai[p + i * lt.lda] : ai[i + p * lt.lda];
          const float bv = lt.trans_b ? bi[j + p * lt.ldb] : bi[p + j * lt.ldb];
          sum += static_cast<double>(av) * bv;
        }
        float& out = ci[i + j * lt.ldc];
        out = static_cast<float>(alpha * sum + (beta == 0 ? 0.0 : beta * out));
      }
    }
  }
}

// Runs a row-major problem through the mapping: cuBLASLt's A is the caller's B.
void RunMapped(const RowMajorGemm& g, float alpha, const float* a, const float* b, float beta,
               float* c) {
  absl::StatusOr<LtGemm> lt = MapRowMajorGemm(g);
  ASSERT_TRUE(lt.ok()) << lt.status();
  ASSERT_TRUE(lt->operands_swapped);
  ColMajorGemm(*lt, alpha, b, a, beta, c);
}

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

void ExpectClose(const std::vector<float>& got, const std::vector<float>& want, float tol) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], tol * (1.0f + std::fabs(want[i]))) << "at " << i;
  }
}

TEST(GemmMappingTest, EveryTransposeCombinationWithPaddedLeadingDimensionsMatchesRowMajorBlas) {
  const int64_t m = 5, n = 7, k = 3;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      RowMajorGemm g;
      g.trans_a = ta;
      g.trans_b = tb;
      g.m = m;
      g.n = n;
      g.k = k;
      g.lda = (ta ? m : k) + 2;
      g.ldb = (tb ? k : n) + 1;
      g.ldc = n + 3;
      const std::vector<float> a = Random((ta ? k : m) * g.lda, 1);
      const std::vector<float> b = Random((tb ? n : k) * g.ldb, 2);
      std::vector<float> want = Random(m * g.ldc, 3);
      std::vector<float> got = want;
      kernels::cpu::Gemm(ta, tb, m, n, k, 0.5f, a.data(), g.lda, b.data(), g.ldb, 1.0f,
                         want.data(), g.ldc);
      RunMapped(g, 0.5f, a.data(), b.data(), 1.0f, got.data());
      SCOPED_TRACE(::testing::Message() << "trans_a=" << ta << " trans_b=" << tb);
      ExpectClose(got, want, 1e-5f);
    }
  }
}

TEST(GemmMappingTest, StoredShapesAndOpsAreWhatCublasLtDescriptorsNeed) {
  // out[N,O] = x[N,I]·Wᵀ: cuBLASLt computes outᵀ[O,N] = W(ᵀ of col-major [I,O]) · xᵀ.
  absl::StatusOr<LtGemm> lt = MapRowMajorGemm(LinearForwardGemm(8, 3, 4));
  ASSERT_TRUE(lt.ok());
  EXPECT_TRUE(lt->trans_a);
  EXPECT_FALSE(lt->trans_b);
  EXPECT_EQ(lt->m, 4);
  EXPECT_EQ(lt->n, 8);
  EXPECT_EQ(lt->k, 3);
  EXPECT_EQ(lt->a_rows, 3);  // W stored col-major as [I, O]
  EXPECT_EQ(lt->a_cols, 4);
  EXPECT_EQ(lt->b_rows, 3);  // x stored col-major as [I, N]
  EXPECT_EQ(lt->b_cols, 8);
  EXPECT_EQ(lt->c_rows, 4);
  EXPECT_EQ(lt->c_cols, 8);
  EXPECT_EQ(BiasLength(*lt), 4);  // one bias per output feature
}

TEST(GemmMappingTest, LinearGemmsMatchTheCpuMatmulKernels) {
  const int64_t rows = 6, in = 5, out = 4;
  const std::vector<float> x = Random(rows * in, 4), w = Random(out * in, 5);
  const std::vector<float> dy = Random(rows * out, 6);

  std::vector<float> want(rows * out), got(rows * out);
  kernels::cpu::MatmulForward(want.data(), x.data(), w.data(), nullptr, rows, in, out);
  RunMapped(LinearForwardGemm(rows, in, out), 1.0f, x.data(), w.data(), 0.0f, got.data());
  ExpectClose(got, want, 1e-5f);

  std::vector<float> dx_want(rows * in), dx_got(rows * in);
  kernels::cpu::MatmulBackwardInput(dx_want.data(), dy.data(), w.data(), rows, in, out, false);
  RunMapped(LinearBackwardInputGemm(rows, in, out), 1.0f, dy.data(), w.data(), 0.0f,
            dx_got.data());
  ExpectClose(dx_got, dx_want, 1e-5f);

  std::vector<float> dw_want = Random(out * in, 7);
  std::vector<float> dw_got = dw_want;  // the weight gradient accumulates (β = 1)
  kernels::cpu::MatmulBackwardWeight(dw_want.data(), dy.data(), x.data(), rows, in, out);
  RunMapped(LinearBackwardWeightGemm(rows, in, out), 1.0f, dy.data(), x.data(), 1.0f,
            dw_got.data());
  ExpectClose(dw_got, dw_want, 1e-5f);
}

TEST(GemmMappingTest, BadShapesAreRejectedWithTheFieldToFix) {
  RowMajorGemm g = LinearForwardGemm(4, 3, 2);
  g.lda = 2;
  absl::StatusOr<LtGemm> lt = MapRowMajorGemm(g);
  EXPECT_EQ(lt.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(lt.status().message().find("lda=2"), absl::string_view::npos) << lt.status();

  g = LinearForwardGemm(0, 3, 2);
  EXPECT_EQ(MapRowMajorGemm(g).status().code(), absl::StatusCode::kInvalidArgument);

  g = LinearForwardGemm(4, 3, 2);
  g.batch = 3;
  g.stride_c = 0;  // every item would write the same output
  EXPECT_EQ(MapRowMajorGemm(g).status().code(), absl::StatusCode::kInvalidArgument);
}

// Causal softmax of each row of a [T,T] block, in place (the CUDA kernel's job).
void CausalSoftmax(float* s, int64_t t) {
  for (int64_t i = 0; i < t; ++i) {
    float* row = s + i * t;
    double max = row[0];
    for (int64_t j = 1; j <= i; ++j) max = std::max<double>(max, row[j]);
    double sum = 0;
    for (int64_t j = 0; j <= i; ++j) sum += std::exp(row[j] - max);
    for (int64_t j = 0; j < t; ++j) row[j] = j <= i ? std::exp(row[j] - max) / sum : 0.0f;
  }
}

// dS = P ⊙ (dP − rowsum(P ⊙ dP)) · scale, in place over dP.
void CausalSoftmaxBackward(float* dp, const float* p, int64_t t, float scale) {
  for (int64_t i = 0; i < t; ++i) {
    double dot = 0;
    for (int64_t j = 0; j <= i; ++j) dot += p[i * t + j] * dp[i * t + j];
    for (int64_t j = 0; j < t; ++j) {
      dp[i * t + j] = j <= i ? static_cast<float>(p[i * t + j] * (dp[i * t + j] - dot) * scale)
                             : 0.0f;
    }
  }
}

// The attention plan for rank `rank` of a tp=2 split, executed with the
// reference GEMM, gives exactly that rank's heads of the full CPU attention.
TEST(AttentionPlanTest, TensorParallelShardReproducesItsHeadsOfTheFullAttention) {
  const int64_t batch = 2, seq = 5, heads = 4, hd = 3, channels = heads * hd, tp = 2;
  const std::vector<float> qkv = Random(batch * seq * 3 * channels, 8);
  const std::vector<float> dout = Random(batch * seq * channels, 9);
  std::vector<float> out(batch * seq * channels), att(batch * heads * seq * seq);
  std::vector<float> dqkv(qkv.size()), scratch(seq * seq);
  kernels::cpu::AttentionForward(out.data(), att.data(), qkv.data(), batch, seq, channels, heads);
  kernels::cpu::AttentionBackward(dqkv.data(), scratch.data(), dout.data(), qkv.data(),
                                  att.data(), batch, seq, channels, heads);

  absl::StatusOr<AttentionShard> shard = ShardAttention(batch, seq, channels, heads, tp);
  ASSERT_TRUE(shard.ok()) << shard.status();
  EXPECT_EQ(shard->heads, 2);
  EXPECT_EQ(shard->channels, 6);
  const AttentionPlan plan = PlanAttention(*shard);
  EXPECT_FLOAT_EQ(plan.scale, 1.0f / std::sqrt(3.0f));
  const int64_t lc = shard->channels;

  for (int64_t rank = 0; rank < tp; ++rank) {
    SCOPED_TRACE(::testing::Message() << "rank " << rank);
    // This rank's qkv / dout: columns of its heads in each third.
    std::vector<float> lqkv(batch * seq * 3 * lc), ldout(batch * seq * lc);
    for (int64_t r = 0; r < batch * seq; ++r) {
      for (int64_t part = 0; part < 3; ++part) {
        for (int64_t c = 0; c < lc; ++c) {
          lqkv[r * 3 * lc + part * lc + c] = qkv[r * 3 * channels + part * channels + rank * lc + c];
        }
      }
      for (int64_t c = 0; c < lc; ++c) ldout[r * lc + c] = dout[r * channels + rank * lc + c];
    }
    std::vector<float> lout(batch * seq * lc), latt(batch * shard->heads * seq * seq);
    std::vector<float> ldqkv(lqkv.size()), dp(shard->heads * seq * seq);
    for (int64_t b = 0; b < batch; ++b) {
      const float* base = lqkv.data() + b * plan.qkv_batch_stride;
      float* p = latt.data() + b * plan.att_batch_stride;
      float* o = lout.data() + b * plan.out_batch_stride;
      const float* d_o = ldout.data() + b * plan.out_batch_stride;
      float* dbase = ldqkv.data() + b * plan.qkv_batch_stride;
      RunMapped(plan.scores, plan.scale, base + plan.q_offset, base + plan.k_offset, 0.0f, p);
      for (int64_t h = 0; h < shard->heads; ++h) CausalSoftmax(p + h * plan.att_head_stride, seq);
      RunMapped(plan.context, 1.0f, p, base + plan.v_offset, 0.0f, o);
      RunMapped(plan.grad_probs, 1.0f, d_o, base + plan.v_offset, 0.0f, dp.data());
      RunMapped(plan.grad_v, 1.0f, p, d_o, 0.0f, dbase + plan.v_offset);
      for (int64_t h = 0; h < shard->heads; ++h) {
        CausalSoftmaxBackward(dp.data() + h * plan.att_head_stride, p + h * plan.att_head_stride,
                              seq, plan.scale);
      }
      RunMapped(plan.grad_q, 1.0f, dp.data(), base + plan.k_offset, 0.0f, dbase + plan.q_offset);
      RunMapped(plan.grad_k, 1.0f, dp.data(), base + plan.q_offset, 0.0f, dbase + plan.k_offset);
    }
    for (int64_t r = 0; r < batch * seq; ++r) {
      for (int64_t c = 0; c < lc; ++c) {
        ASSERT_NEAR(lout[r * lc + c], out[r * channels + rank * lc + c], 1e-5f) << r << "," << c;
        for (int64_t part = 0; part < 3; ++part) {
          ASSERT_NEAR(ldqkv[r * 3 * lc + part * lc + c],
                      dqkv[r * 3 * channels + part * channels + rank * lc + c], 1e-5f)
              << "part " << part << " row " << r << " col " << c;
        }
      }
    }
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t h = 0; h < shard->heads; ++h) {
        for (int64_t e = 0; e < seq * seq; ++e) {
          ASSERT_NEAR(latt[(b * shard->heads + h) * seq * seq + e],
                      att[(b * heads + rank * shard->heads + h) * seq * seq + e], 1e-6f);
        }
      }
    }
  }
}

TEST(AttentionPlanTest, ShardsMustHoldWholeHeads) {
  absl::StatusOr<AttentionShard> s = ShardAttention(1, 8, 12, 4, 3);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("multiple of the tensor-parallel degree"),
            absl::string_view::npos);
  EXPECT_FALSE(ShardAttention(1, 8, 10, 4, 1).ok());  // 10 channels over 4 heads
  EXPECT_FALSE(ShardAttention(0, 8, 12, 4, 1).ok());
}

TEST(LaunchShapeTest, GridsCoverEveryItemAndStayWithinLimits) {
  for (int64_t n : std::vector<int64_t>{1, 3, 255, 256, 257, 1000003, int64_t{1} << 34}) {
    for (int vec : {1, 4, 8}) {
      const LaunchShape s = ElementwiseLaunch(n, vec);
      EXPECT_EQ(s.threads, kThreadsPerBlock);
      EXPECT_GE(s.blocks, 1);
      EXPECT_LE(s.blocks, kMaxGridX);
      // Grid-stride loops finish any n; for small n the grid covers it in one pass.
      if (n < int64_t{kMaxGridX} * kThreadsPerBlock) {
        EXPECT_GE(int64_t{s.blocks} * s.threads * vec, n) << n << " " << vec;
        EXPECT_LT(int64_t{s.blocks - 1} * s.threads * vec, n) << "an idle block for " << n;
      }
    }
  }
  const LaunchShape w = WarpPerRowLaunch(17);
  EXPECT_EQ(w.items_per_block, 8);
  EXPECT_EQ(w.blocks, 3);
  EXPECT_EQ(BlockPerRowLaunch(5).blocks, 5);
}

TEST(LaunchShapeTest, ColumnReduceChunksPartitionTheRowsExactly) {
  for (int64_t rows : std::vector<int64_t>{1, 63, 64, 65, 1000, 8192, 100000}) {
    for (int64_t cols : std::vector<int64_t>{1, 255, 768, 3072}) {
      const ColumnReducePlan p = PlanColumnReduce(rows, cols);
      EXPECT_GE(p.chunks, 1);
      EXPECT_LE(p.chunks, 256);
      // Every row in exactly one chunk; no empty chunk (it would add a zero partial
      // and a wasted block).
      EXPECT_GE(p.chunks * p.rows_per_chunk, rows);
      EXPECT_LT((p.chunks - 1) * p.rows_per_chunk, rows);
      EXPECT_GE(int64_t{p.column_blocks} * p.threads, cols);
      // The same shape gives the same plan (the reduction order is fixed).
      const ColumnReducePlan q = PlanColumnReduce(rows, cols);
      EXPECT_EQ(q.chunks, p.chunks);
      EXPECT_EQ(q.rows_per_chunk, p.rows_per_chunk);
    }
  }
}

// The column kernels have one thread per column and no grid-stride loop, so
// the grid must reach the widest matrix ColumnReduceScratchBytes accepts
// (2^30 columns); a grid clamped like the grid-stride kernels' stopped at
// 268M columns and left the rest unsummed.
TEST(LaunchShapeTest, ColumnReduceGridReachesEveryColumnOfTheWidestAcceptedMatrix) {
  for (int64_t cols : std::vector<int64_t>{int64_t{kMaxGridX} * kThreadsPerBlock + 1,
                                           int64_t{1} << 30}) {
    ASSERT_TRUE(ColumnReduceScratchBytes(1, cols, 1).ok()) << cols;
    const ColumnReducePlan p = PlanColumnReduce(1, cols);
    EXPECT_TRUE(ColumnReduceCoversColumns(p, cols)) << cols;
    EXPECT_GE(int64_t{p.column_blocks} * p.threads, cols) << cols;
    EXPECT_LT(int64_t{p.column_blocks - 1} * p.threads, cols) << "an idle block for " << cols;
  }
  ColumnReducePlan clamped = PlanColumnReduce(1, 1000);
  clamped.column_blocks = 1;
  EXPECT_FALSE(ColumnReduceCoversColumns(clamped, 1000));
}

TEST(WorkspaceTest, SizesFollowTheShapesAndHugeRequestsAreRefused) {
  absl::StatusOr<AttentionShard> s = ShardAttention(8, 1024, 768, 12, 1);
  ASSERT_TRUE(s.ok());
  absl::StatusOr<size_t> att = AttentionBackwardScratchBytes(*s);
  ASSERT_TRUE(att.ok());
  EXPECT_EQ(*att, size_t{12} * 1024 * 1024 * 4);
  EXPECT_EQ(*EmbeddingBackwardScratchBytes(8192), size_t{8192} * 2 * 4);
  const ColumnReducePlan p = PlanColumnReduce(8192, 768);
  EXPECT_EQ(*ColumnReduceScratchBytes(8192, 768, 2), size_t{2} * p.chunks * 768 * 4);
  EXPECT_EQ(*RowLossScratchBytes(10), size_t{11} * 8);

  absl::StatusOr<AttentionShard> huge = ShardAttention(1, int64_t{1} << 20, 1 << 16, 1 << 16, 1);
  ASSERT_TRUE(huge.ok());
  EXPECT_EQ(AttentionBackwardScratchBytes(*huge).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE(EmbeddingBackwardScratchBytes(-1).ok());
  EXPECT_FALSE(ColumnReduceScratchBytes(10, 0, 2).ok());
}

GemmKey KeyFor(const RowMajorGemm& g) {
  GemmKey key;
  key.shape = *MapRowMajorGemm(g);
  return key;
}

TEST(GemmAlgoCacheTest, SameProblemHitsAndEveryDistinguishingFieldMisses) {
  GemmAlgoCache<int> cache;
  const GemmKey base = KeyFor(LinearForwardGemm(1024, 768, 2304));
  ASSERT_TRUE(cache.Insert(base, 7).ok());
  const int* hit = cache.Find(KeyFor(LinearForwardGemm(1024, 768, 2304)));
  ASSERT_NE(hit, nullptr);
  EXPECT_EQ(*hit, 7);

  std::vector<GemmKey> variants(11, base);
  variants[0].shape = KeyFor(LinearForwardGemm(1024, 768, 768)).shape;
  variants[1].shape = KeyFor(LinearBackwardInputGemm(1024, 2304, 768)).shape;  // same m,n,k; ops differ
  variants[2].ab_type = GemmDType::kBF16;
  variants[3].c_type = GemmDType::kBF16;
  variants[4].epilogue = GemmEpilogue::kBias;
  variants[5].accumulate = true;
  variants[6].alignment = 4;
  variants[7].aux_ld = 2304;
  variants[8].shape.batch = 2;
  variants[8].shape.stride_c = 1;
  variants[9].bias_type = GemmDType::kBF16;  // the bias's type changes the kernel too
  variants[10].aux_type = GemmDType::kBF16;
  for (size_t i = 0; i < variants.size(); ++i) {
    EXPECT_FALSE(variants[i] == base) << i;
    EXPECT_EQ(cache.Find(variants[i]), nullptr) << "variant " << i << " " << GemmKeyToString(variants[i]);
  }
  EXPECT_EQ(cache.hits(), 1);
  EXPECT_EQ(cache.misses(), 11);
}

TEST(GemmAlgoCacheTest, RemembersProblemsWithoutAnAlgorithmApartFromTheirVariants) {
  GemmAlgoCache<int> cache;
  GemmKey bf16_out = KeyFor(LinearForwardGemm(1024, 768, 2304));
  bf16_out.ab_type = GemmDType::kBF16;
  bf16_out.c_type = GemmDType::kBF16;
  bf16_out.epilogue = GemmEpilogue::kBias;
  GemmKey fp32_out = bf16_out;
  fp32_out.c_type = GemmDType::kF32;
  EXPECT_FALSE(cache.IsUnsupported(bf16_out));
  cache.MarkUnsupported(bf16_out);
  EXPECT_TRUE(cache.IsUnsupported(bf16_out));
  EXPECT_FALSE(cache.IsUnsupported(fp32_out)) << "the fp32-output form is asked on its own";
  EXPECT_EQ(cache.Find(bf16_out), nullptr);
  EXPECT_EQ(cache.size(), 0u) << "a verdict is not an algorithm";
  EXPECT_NE(GemmKeyToString(bf16_out).find("bias=f32"), std::string::npos)
      << GemmKeyToString(bf16_out);
}

TEST(WithFp32BiasOutputTest, ThePlainProblemIntoAnFp32BufferOrAClearRefusal) {
  alignas(256) static float buf[4096];
  GemmArgs g;
  g.shape = LinearForwardGemm(16, 32, 48);  // qkv-like: out [16, 48] = x [16, 32] · Wᵀ + b
  g.ab_type = GemmDType::kBF16;
  g.c_type = GemmDType::kBF16;
  g.a = buf;
  g.b = buf + 1024;
  g.c = buf + 2048;
  g.epilogue = GemmEpilogue::kBias;
  g.bias = buf + 3072;
  g.bias_type = GemmDType::kF32;
  absl::StatusOr<GemmArgs> wide = WithFp32BiasOutput(g, buf + 3584);
  ASSERT_TRUE(wide.ok()) << wide.status();
  EXPECT_EQ(wide->c_type, GemmDType::kF32);
  EXPECT_EQ(wide->c, buf + 3584);
  EXPECT_EQ(wide->ab_type, GemmDType::kBF16);
  EXPECT_EQ(wide->a, g.a);
  EXPECT_EQ(wide->b, g.b);
  EXPECT_EQ(wide->bias, g.bias);
  EXPECT_EQ(wide->bias_type, GemmDType::kF32);
  EXPECT_EQ(wide->epilogue, GemmEpilogue::kBias);
  EXPECT_EQ(wide->shape.ldc, 48) << "contiguous: the cast reads m·n floats";
  absl::StatusOr<GemmKey> wide_key = MakeGemmKey(*wide);
  ASSERT_TRUE(wide_key.ok()) << wide_key.status();
  EXPECT_FALSE(*wide_key == *MakeGemmKey(g));

  GemmArgs bad = g;
  bad.c_type = GemmDType::kF32;  // already fp32: nothing to do
  EXPECT_EQ(WithFp32BiasOutput(bad, buf).status().code(), absl::StatusCode::kInvalidArgument);
  bad = g;
  bad.bias_type = GemmDType::kBF16;  // the bias already has the output's type
  EXPECT_FALSE(WithFp32BiasOutput(bad, buf).ok());
  bad = g;
  bad.epilogue = GemmEpilogue::kNone;
  bad.bias = nullptr;
  EXPECT_FALSE(WithFp32BiasOutput(bad, buf).ok());
  bad = g;
  bad.shape.ldc = 64;  // padded rows: the cast would read the padding
  EXPECT_FALSE(WithFp32BiasOutput(bad, buf).ok());
  bad = g;
  bad.beta = 1.0f;  // would read the scratch as C
  EXPECT_FALSE(WithFp32BiasOutput(bad, buf).ok());
  EXPECT_FALSE(WithFp32BiasOutput(g, nullptr).ok());
}

TEST(GemmAlgoCacheTest, IsBoundedAndSaysWhichShapeOverflowed) {
  GemmAlgoCache<int> cache;
  for (int64_t i = 1; i <= static_cast<int64_t>(GemmAlgoCache<int>::kMaxEntries); ++i) {
    ASSERT_TRUE(cache.Insert(KeyFor(LinearForwardGemm(i, 8, 8)), 0).ok());
  }
  ASSERT_TRUE(cache.Insert(KeyFor(LinearForwardGemm(1, 8, 8)), 1).ok());  // replace is fine
  absl::Status s = cache.Insert(KeyFor(LinearForwardGemm(99999, 8, 8)), 0);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("n=99999"), absl::string_view::npos) << s;
}

TEST(AlignmentTest, SmallestPowerOfTwoDividingAllNonNullPointers) {
  EXPECT_EQ(CommonAlignment({256, 1024, 0}), 256);
  EXPECT_EQ(CommonAlignment({4096, 1024 + 64}), 64);
  EXPECT_EQ(CommonAlignment({256, 1028}), 4);
  EXPECT_EQ(CommonAlignment({256, 1030}), 2);
  EXPECT_EQ(CommonAlignment({8, 24}), 8);
}

TEST(Bf16Test, RoundsToNearestEvenAndKeepsSpecials) {
  EXPECT_EQ(FloatToBf16Bits(1.0f), 0x3f80);
  auto from_bits = [](uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  };
  EXPECT_EQ(FloatToBf16Bits(from_bits(0x3f808000u)), 0x3f80);  // tie → even (down)
  EXPECT_EQ(FloatToBf16Bits(from_bits(0x3f818000u)), 0x3f82);  // tie → even (up)
  EXPECT_EQ(FloatToBf16Bits(from_bits(0x3f808001u)), 0x3f81);  // above the tie
  EXPECT_EQ(FloatToBf16Bits(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(FloatToBf16Bits(std::numeric_limits<float>::max()), 0x7f80);  // overflows to inf
  EXPECT_TRUE(std::isnan(Bf16BitsToFloat(FloatToBf16Bits(std::nanf("")))));
  EXPECT_EQ(FloatToBf16Bits(-2.5f), 0xc020);
  EXPECT_EQ(Bf16BitsToFloat(0x3fc0), 1.5f);
  for (float x : {0.1f, -3.7f, 1234.5f, 1e-20f}) {
    const float r = Bf16BitsToFloat(FloatToBf16Bits(x));
    EXPECT_LE(std::fabs(r - x), std::fabs(x) * (1.0f / 256)) << x;  // 8 significant bits
  }
}

}  // namespace
}  // namespace baton::cuda

namespace baton::cuda {
namespace {

TEST(MakeGemmKeyTest, RejectsWhatCublasLtWouldMisreadAndKeysTheRest) {
  alignas(256) static float buf[64];
  GemmArgs g;
  g.shape = LinearForwardGemm(4, 8, 8);
  g.a = buf;
  g.b = buf;
  g.c = buf;
  absl::StatusOr<GemmKey> key = MakeGemmKey(g);
  ASSERT_TRUE(key.ok()) << key.status();
  EXPECT_EQ(key->alignment, 256);
  EXPECT_FALSE(key->accumulate);

  GemmArgs bad = g;
  bad.epilogue = GemmEpilogue::kBias;  // no bias
  EXPECT_EQ(MakeGemmKey(bad).status().code(), absl::StatusCode::kInvalidArgument);
  bad = g;
  bad.bias = buf;  // bias without the epilogue: it would be ignored silently
  EXPECT_FALSE(MakeGemmKey(bad).ok());
  bad = g;
  bad.epilogue = GemmEpilogue::kGeluAux;
  bad.aux = buf;
  bad.aux_ld = 12;  // not a multiple of 8
  EXPECT_NE(MakeGemmKey(bad).status().message().find("multiple of 8"), absl::string_view::npos);
  bad.aux_ld = 8;
  EXPECT_TRUE(MakeGemmKey(bad).ok());
  bad = g;
  bad.c_type = GemmDType::kBF16;  // fp32 inputs, bf16 output
  EXPECT_FALSE(MakeGemmKey(bad).ok());
  bad = g;
  bad.b = nullptr;
  EXPECT_FALSE(MakeGemmKey(bad).ok());

  GemmArgs odd = g;
  odd.a = buf + 1;  // 4-byte aligned: a different algorithm class
  odd.beta = 1.0f;
  absl::StatusOr<GemmKey> odd_key = MakeGemmKey(odd);
  ASSERT_TRUE(odd_key.ok());
  EXPECT_EQ(odd_key->alignment, 4);
  EXPECT_TRUE(odd_key->accumulate);
  EXPECT_FALSE(*odd_key == *key);

  // Batched: the batch strides count too (head h of a bf16 qkv starts
  // h·hd·2 bytes in: 128 for hd = 64).
  GemmArgs heads = g;
  heads.shape.batch = 4;
  heads.shape.stride_a = 64;
  heads.shape.stride_b = 64;
  heads.shape.stride_c = 64;
  heads.ab_type = GemmDType::kBF16;
  absl::StatusOr<GemmKey> heads_key = MakeGemmKey(heads);
  ASSERT_TRUE(heads_key.ok()) << heads_key.status();
  EXPECT_EQ(heads_key->alignment, 128);
}

}  // namespace
}  // namespace baton::cuda
