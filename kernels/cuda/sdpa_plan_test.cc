// The cuDNN SDPA plan over the packed qkv layout, without a GPU: the dims and
// strides given to cuDNN's graph, executed here by a float64 model of SDPA
// (forward with the log-sum-exp stats, backward from the stats as cuDNN
// recomputes P), reproduce each tensor-parallel rank's heads of the full CPU
// attention; the saved-buffer layout, head-dimension limits, workspace bound
// and cache keys.
#include "kernels/cuda/sdpa_plan.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "gtest/gtest.h"
#include "kernels/cpu/attention.h"
#include "kernels/cuda/plan.h"

namespace baton::cuda {
namespace {

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// Element (b, h, i, d) of an SDPA tensor through its plan (dims, strides,
// offset), as cuDNN addresses it.
int64_t Index(const SdpaTensor& t, int64_t b, int64_t h, int64_t i, int64_t d) {
  EXPECT_LT(b, t.dim[0]);
  EXPECT_LT(h, t.dim[1]);
  EXPECT_LT(i, t.dim[2]);
  EXPECT_LT(d, t.dim[3]);
  return t.offset + b * t.stride[0] + h * t.stride[1] + i * t.stride[2] + d * t.stride[3];
}

// The SDPA definition of cudnn_attention.h in float64, every tensor reached
// through the plan: forward writes o and stats; backward reads o and stats
// (never P) and writes dq, dk, dv.
void SdpaForward(const SdpaPlan& p, const std::vector<float>& qkv, std::vector<float>& out,
                 std::vector<float>& stats) {
  const AttentionShard& s = p.shard;
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.heads; ++h) {
      for (int64_t i = 0; i < s.seq; ++i) {
        std::vector<double> sc(i + 1);
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < s.head_dim; ++d) {
            dot += double{qkv[Index(p.q, b, h, i, d)]} * qkv[Index(p.k, b, h, j, d)];
          }
          sc[j] = dot * p.scale;
          mx = std::max(mx, sc[j]);
        }
        double sum = 0;
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(sc[j] - mx);
        const double lse = mx + std::log(sum);
        stats[Index(p.stats, b, h, i, 0)] = static_cast<float>(lse);
        for (int64_t d = 0; d < s.head_dim; ++d) {
          double o = 0;
          for (int64_t j = 0; j <= i; ++j) {
            o += std::exp(sc[j] - lse) * qkv[Index(p.v, b, h, j, d)];
          }
          out[Index(p.o, b, h, i, d)] = static_cast<float>(o);
        }
      }
    }
  }
}

void SdpaBackward(const SdpaPlan& p, const std::vector<float>& qkv, const std::vector<float>& out,
                  const std::vector<float>& stats, const std::vector<float>& dout,
                  std::vector<float>& dqkv) {
  const AttentionShard& s = p.shard;
  const int64_t t = s.seq, hd = s.head_dim;
  std::vector<double> dq(t * hd), dk(t * hd), dv(t * hd);
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.heads; ++h) {
      std::fill(dq.begin(), dq.end(), 0.0);
      std::fill(dk.begin(), dk.end(), 0.0);
      std::fill(dv.begin(), dv.end(), 0.0);
      for (int64_t i = 0; i < t; ++i) {
        double big_d = 0;  // D_i = do_i · o_i
        for (int64_t d = 0; d < hd; ++d) {
          big_d += double{dout[Index(p.o, b, h, i, d)]} * out[Index(p.o, b, h, i, d)];
        }
        const double lse = stats[Index(p.stats, b, h, i, 0)];
        for (int64_t j = 0; j <= i; ++j) {
          double sc = 0, dp = 0;
          for (int64_t d = 0; d < hd; ++d) {
            sc += double{qkv[Index(p.q, b, h, i, d)]} * qkv[Index(p.k, b, h, j, d)];
            dp += double{dout[Index(p.o, b, h, i, d)]} * qkv[Index(p.v, b, h, j, d)];
          }
          const double pij = std::exp(sc * p.scale - lse);
          const double ds = pij * (dp - big_d) * p.scale;
          for (int64_t d = 0; d < hd; ++d) {
            dq[i * hd + d] += ds * qkv[Index(p.k, b, h, j, d)];
            dk[j * hd + d] += ds * qkv[Index(p.q, b, h, i, d)];
            dv[j * hd + d] += pij * dout[Index(p.o, b, h, i, d)];
          }
        }
      }
      for (int64_t i = 0; i < t; ++i) {
        for (int64_t d = 0; d < hd; ++d) {
          dqkv[Index(p.q, b, h, i, d)] = static_cast<float>(dq[i * hd + d]);
          dqkv[Index(p.k, b, h, i, d)] = static_cast<float>(dk[i * hd + d]);
          dqkv[Index(p.v, b, h, i, d)] = static_cast<float>(dv[i * hd + d]);
        }
      }
    }
  }
}

TEST(SdpaPlanTest, DimsAndStridesOfATensorParallelShard) {
  // GPT-2 small's attention split over tp = 4: C' = 192, H' = 3, hd = 64.
  absl::StatusOr<AttentionShard> shard = ShardAttention(8, 1024, 768, 12, 4);
  ASSERT_TRUE(shard.ok()) << shard.status();
  absl::StatusOr<SdpaPlan> p = PlanSdpa(*shard);
  ASSERT_TRUE(p.ok()) << p.status();
  const std::array<int64_t, 4> qkv_dim = {8, 3, 1024, 64};
  const std::array<int64_t, 4> qkv_stride = {1024 * 576, 64, 576, 1};
  EXPECT_EQ(p->q.dim, qkv_dim);
  EXPECT_EQ(p->q.stride, qkv_stride);
  EXPECT_EQ(p->k.stride, qkv_stride);
  EXPECT_EQ(p->v.stride, qkv_stride);
  EXPECT_EQ(p->q.offset, 0);
  EXPECT_EQ(p->k.offset, 192);
  EXPECT_EQ(p->v.offset, 384);
  EXPECT_EQ(p->o.dim, qkv_dim);
  EXPECT_EQ(p->o.stride, (std::array<int64_t, 4>{1024 * 192, 64, 192, 1}));
  EXPECT_EQ(p->o.offset, 0);
  EXPECT_EQ(p->stats.dim, (std::array<int64_t, 4>{8, 3, 1024, 1}));
  EXPECT_EQ(p->stats.stride, (std::array<int64_t, 4>{3 * 1024, 1024, 1, 1}));
  EXPECT_EQ(p->scale, PlanAttention(*shard).scale);
  EXPECT_EQ(p->scale, 0.125f);
  // Every bf16 base pointer and row stride is 16-byte aligned (cuDNN's need).
  for (const SdpaTensor* t : {&p->q, &p->k, &p->v, &p->o}) {
    EXPECT_EQ(t->offset * 2 % 16, 0);
    EXPECT_EQ(t->stride[2] * 2 % 16, 0);
  }
}

// The plan, executed by the float64 SDPA model, gives each rank exactly its
// heads of the full CPU attention: out, and dqkv from out and the stats.
TEST(SdpaPlanTest, TensorParallelShardReproducesItsHeadsOfTheFullAttention) {
  const int64_t batch = 2, seq = 6, heads = 4, hd = 8, channels = heads * hd, tp = 2;
  const std::vector<float> qkv = Random(batch * seq * 3 * channels, 21);
  const std::vector<float> dout = Random(batch * seq * channels, 22);
  std::vector<float> out(batch * seq * channels), att(batch * heads * seq * seq);
  std::vector<float> dqkv(qkv.size()), scratch(seq * seq);
  kernels::cpu::AttentionForward(out.data(), att.data(), qkv.data(), batch, seq, channels, heads);
  kernels::cpu::AttentionBackward(dqkv.data(), scratch.data(), dout.data(), qkv.data(),
                                  att.data(), batch, seq, channels, heads);

  absl::StatusOr<AttentionShard> shard = ShardAttention(batch, seq, channels, heads, tp);
  ASSERT_TRUE(shard.ok()) << shard.status();
  absl::StatusOr<SdpaPlan> p = PlanSdpa(*shard);
  ASSERT_TRUE(p.ok()) << p.status();
  const int64_t lc = shard->channels;
  for (int64_t rank = 0; rank < tp; ++rank) {
    SCOPED_TRACE(::testing::Message() << "rank " << rank);
    std::vector<float> lqkv(batch * seq * 3 * lc), ldout(batch * seq * lc);
    for (int64_t r = 0; r < batch * seq; ++r) {
      for (int64_t part = 0; part < 3; ++part) {
        for (int64_t c = 0; c < lc; ++c) {
          lqkv[r * 3 * lc + part * lc + c] = qkv[r * 3 * channels + part * channels + rank * lc + c];
        }
      }
      for (int64_t c = 0; c < lc; ++c) ldout[r * lc + c] = dout[r * channels + rank * lc + c];
    }
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::vector<float> lout(batch * seq * lc, nan), stats(SdpaStatsBytes(*shard) / 4, nan);
    std::vector<float> ldqkv(lqkv.size(), nan);
    SdpaForward(*p, lqkv, lout, stats);
    SdpaBackward(*p, lqkv, lout, stats, ldout, ldqkv);
    for (float x : stats) ASSERT_FALSE(std::isnan(x)) << "a stats element was not written";
    for (int64_t r = 0; r < batch * seq; ++r) {
      for (int64_t c = 0; c < lc; ++c) {
        ASSERT_NEAR(lout[r * lc + c], out[r * channels + rank * lc + c], 1e-5f) << r << "," << c;
      }
      for (int64_t part = 0; part < 3; ++part) {
        for (int64_t c = 0; c < lc; ++c) {
          ASSERT_NEAR(ldqkv[r * 3 * lc + part * lc + c],
                      dqkv[r * 3 * channels + part * channels + rank * lc + c], 1e-4f)
              << "row " << r << " part " << part << " col " << c;
        }
      }
    }
  }
}

TEST(SdpaPlanTest, SavedBufferHoldsStatsThenOutputWhenItFits) {
  // GPT-2 small, one rank: att is [8, 12, 1024, 1024] bf16.
  absl::StatusOr<AttentionShard> shard = ShardAttention(8, 1024, 768, 12, 1);
  ASSERT_TRUE(shard.ok());
  absl::StatusOr<SdpaPlan> p = PlanSdpa(*shard);
  ASSERT_TRUE(p.ok());
  const size_t att_bytes = size_t{8} * 12 * 1024 * 1024 * 2;
  EXPECT_EQ(SdpaStatsBytes(*shard), size_t{8} * 12 * 1024 * 4);
  EXPECT_GE(p->saved_out_offset, SdpaStatsBytes(*shard));
  EXPECT_EQ(p->saved_out_offset % 256, 0u);
  EXPECT_EQ(SdpaSavedBytes(*shard), p->saved_out_offset + size_t{8} * 1024 * 768 * 2);
  EXPECT_TRUE(SdpaApplies(*shard, att_bytes).ok());
  // 15 times smaller than P: what the model could allocate instead.
  EXPECT_LT(SdpaSavedBytes(*shard) * 15, att_bytes);

  // T ≤ hd: [B,H',T,T] cannot hold o; the GEMM path takes it.
  absl::StatusOr<AttentionShard> small = ShardAttention(2, 16, 128, 2, 1);  // hd 64
  ASSERT_TRUE(small.ok());
  const size_t small_att = size_t{2} * 2 * 16 * 16 * 2;
  absl::Status s = SdpaApplies(*small, small_att);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_TRUE(PlanSdpa(*small).ok());  // the plan itself is fine
}

TEST(SdpaPlanTest, HeadDimensionAndSequenceLimits) {
  for (int64_t hd : {8, 64, 128, 256}) {
    absl::StatusOr<AttentionShard> s = ShardAttention(1, 512, hd * 2, 2, 1);
    ASSERT_TRUE(s.ok());
    EXPECT_TRUE(PlanSdpa(*s).ok()) << "hd " << hd;
  }
  for (int64_t hd : {4, 12, 65, 264}) {
    absl::StatusOr<AttentionShard> s = ShardAttention(1, 512, hd * 2, 2, 1);
    ASSERT_TRUE(s.ok());
    absl::StatusOr<SdpaPlan> p = PlanSdpa(*s);
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << "hd " << hd;
    EXPECT_EQ(SdpaApplies(*s, size_t{1} << 30).code(), absl::StatusCode::kInvalidArgument);
  }
  absl::StatusOr<AttentionShard> one = ShardAttention(4, 1, 64, 1, 1);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(PlanSdpa(*one).status().code(), absl::StatusCode::kInvalidArgument);
  AttentionShard bad;  // C' ≠ H'·hd
  bad.batch = 1, bad.seq = 8, bad.heads = 2, bad.head_dim = 8, bad.channels = 24;
  EXPECT_EQ(PlanSdpa(bad).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(SdpaPlanTest, WorkspaceBound) {
  absl::StatusOr<AttentionShard> s = ShardAttention(8, 1024, 768, 12, 1);
  ASSERT_TRUE(s.ok());
  EXPECT_TRUE(CheckSdpaWorkspace(0, *s).ok());
  EXPECT_TRUE(CheckSdpaWorkspace(kMaxSdpaWorkspaceBytes, *s).ok());
  // The deterministic backward's dP workspace for GPT-2 small at 8 sequences
  // (B·H·T·T·2 = 192 MiB) is well inside the bound.
  EXPECT_TRUE(CheckSdpaWorkspace(size_t{8} * 12 * 1024 * 1024 * 2, *s).ok());
  absl::Status over = CheckSdpaWorkspace(kMaxSdpaWorkspaceBytes + 1, *s);
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(over.message().find("T=1024"), std::string::npos) << over;
}

TEST(SdpaPlanTest, CacheKeysSeparateEveryShapeAndDevice) {
  absl::StatusOr<AttentionShard> base = ShardAttention(4, 256, 512, 8, 2);
  ASSERT_TRUE(base.ok());
  const SdpaKey k = MakeSdpaKey(*base, 0);
  EXPECT_EQ(k, MakeSdpaKey(*base, 0));
  std::vector<SdpaKey> keys = {k, MakeSdpaKey(*base, 1)};
  for (int field = 0; field < 4; ++field) {
    AttentionShard s = *base;
    if (field == 0) s.batch += 1;
    if (field == 1) s.seq += 1;
    if (field == 2) s.heads += 1, s.channels += s.head_dim;
    if (field == 3) s.head_dim += 8, s.channels += 8 * s.heads;
    keys.push_back(MakeSdpaKey(s, 0));
  }
  absl::flat_hash_set<SdpaKey> set(keys.begin(), keys.end());
  EXPECT_EQ(set.size(), keys.size());
  for (size_t i = 1; i < keys.size(); ++i) EXPECT_FALSE(keys[i] == k) << i;
  // The same sizes reached through another tp split are the same graphs.
  absl::StatusOr<AttentionShard> other = ShardAttention(4, 256, 256, 4, 1);
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(MakeSdpaKey(*other, 0), k);
  EXPECT_EQ(SdpaKeyToString(k), "sdpa B=4 T=256 C'=256 H'=4 hd=64 cuda:0");
}

}  // namespace
}  // namespace baton::cuda
