// The cuDNN SDPA plan over the packed qkv layout, without a GPU: the dims and
// strides given to cuDNN's graph, executed here by a float64 model of SDPA
// (forward with the log-sum-exp stats, backward from the stats as cuDNN
// recomputes P), reproduce each tensor-parallel rank's heads of the full CPU
// attention; the saved-buffer layout, head-dimension limits, workspace bound
// and cache keys. The context-parallel (ring) plan likewise: one pair of
// blocks' dims, strides and scratch layout, which blocks cuDNN takes, and a
// query block's ring (two fully visible key blocks and its diagonal) through
// the plan reproducing the CPU's block attention, merged, and its backward
// from the final lse and o.
#include "kernels/cuda/sdpa_plan.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "gtest/gtest.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/block_attention.h"
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

// ------------------------------------- context-parallel (ring) attention

// The SDPA definition for one ring block in float64, every tensor reached
// through the plan: no mask, or cuDNN's top-left causal mask (j ≤ i). The
// forward writes o and stats; the backward reads the given (final) o and
// stats, forms D_i = do_i · o_i itself as cuDNN does, and writes dq (o's
// layout, in its own buffer) and dk, dv (k's and v's layout, in theirs).
bool Visible(const RingSdpaPlan& p, int64_t i, int64_t j) { return !p.causal || j <= i; }

void RingSdpaForward(const RingSdpaPlan& p, const std::vector<float>& qkv,
                     const std::vector<float>& kv, std::vector<float>& out,
                     std::vector<float>& stats) {
  const RingSdpaBlock& s = p.block;
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.heads; ++h) {
      for (int64_t i = 0; i < s.q_len; ++i) {
        std::vector<double> sc(s.k_len);
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < s.k_len; ++j) {
          if (!Visible(p, i, j)) continue;
          double dot = 0;
          for (int64_t d = 0; d < p.head_dim; ++d) {
            dot += double{qkv[Index(p.q, b, h, i, d)]} * kv[Index(p.k, b, h, j, d)];
          }
          sc[j] = dot * p.scale;
          mx = std::max(mx, sc[j]);
        }
        double sum = 0;
        for (int64_t j = 0; j < s.k_len; ++j) {
          if (Visible(p, i, j)) sum += std::exp(sc[j] - mx);
        }
        const double lse = mx + std::log(sum);
        stats[Index(p.stats, b, h, i, 0)] = static_cast<float>(lse);
        for (int64_t d = 0; d < p.head_dim; ++d) {
          double o = 0;
          for (int64_t j = 0; j < s.k_len; ++j) {
            if (Visible(p, i, j)) o += std::exp(sc[j] - lse) * kv[Index(p.v, b, h, j, d)];
          }
          out[Index(p.o, b, h, i, d)] = static_cast<float>(o);
        }
      }
    }
  }
}

void RingSdpaBackward(const RingSdpaPlan& p, const std::vector<float>& qkv,
                      const std::vector<float>& kv, const std::vector<float>& out,
                      const std::vector<float>& stats, const std::vector<float>& dout,
                      std::vector<float>& dq, std::vector<float>& dkv) {
  const RingSdpaBlock& s = p.block;
  const int64_t hd = p.head_dim;
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.heads; ++h) {
      std::vector<double> gq(s.q_len * hd, 0.0), gk(s.k_len * hd, 0.0), gv(s.k_len * hd, 0.0);
      for (int64_t i = 0; i < s.q_len; ++i) {
        double big_d = 0;
        for (int64_t d = 0; d < hd; ++d) {
          big_d += double{dout[Index(p.o, b, h, i, d)]} * out[Index(p.o, b, h, i, d)];
        }
        const double lse = stats[Index(p.stats, b, h, i, 0)];
        for (int64_t j = 0; j < s.k_len; ++j) {
          if (!Visible(p, i, j)) continue;
          double sc = 0, dp = 0;
          for (int64_t d = 0; d < hd; ++d) {
            sc += double{qkv[Index(p.q, b, h, i, d)]} * kv[Index(p.k, b, h, j, d)];
            dp += double{dout[Index(p.o, b, h, i, d)]} * kv[Index(p.v, b, h, j, d)];
          }
          const double pij = std::exp(sc * p.scale - lse);
          const double ds = pij * (dp - big_d) * p.scale;
          for (int64_t d = 0; d < hd; ++d) {
            gq[i * hd + d] += ds * kv[Index(p.k, b, h, j, d)];
            gk[j * hd + d] += ds * qkv[Index(p.q, b, h, i, d)];
            gv[j * hd + d] += pij * dout[Index(p.o, b, h, i, d)];
          }
        }
      }
      for (int64_t i = 0; i < s.q_len; ++i) {
        for (int64_t d = 0; d < hd; ++d) {
          dq[Index(p.o, b, h, i, d)] = static_cast<float>(gq[i * hd + d]);
        }
      }
      for (int64_t j = 0; j < s.k_len; ++j) {
        for (int64_t d = 0; d < hd; ++d) {
          dkv[Index(p.k, b, h, j, d)] = static_cast<float>(gk[j * hd + d]);
          dkv[Index(p.v, b, h, j, d)] = static_cast<float>(gv[j * hd + d]);
        }
      }
    }
  }
}

RingSdpaBlock Block(int64_t batch, int64_t q_len, int64_t k_len, int64_t channels, int64_t heads,
                    int64_t q_offset, int64_t k_offset) {
  RingSdpaBlock b;
  b.batch = batch;
  b.q_len = q_len;
  b.k_len = k_len;
  b.channels = channels;
  b.heads = heads;
  b.q_offset = q_offset;
  b.k_offset = k_offset;
  return b;
}

TEST(RingSdpaPlanTest, DimsStridesAndScratchOfABlock) {
  // GPT-2 small's attention under tp 4 (C' = 192, H' = 3, hd 64), cp 4 over
  // T = 4096: halves of 512 rows; a later half's query block against an
  // earlier key block.
  absl::StatusOr<RingSdpaPlan> p = PlanRingSdpa(Block(2, 512, 512, 192, 3, 3584, 1024));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_FALSE(p->causal);
  EXPECT_EQ(p->head_dim, 64);
  EXPECT_EQ(p->scale, 0.125f);
  EXPECT_EQ(p->q.dim, (std::array<int64_t, 4>{2, 3, 512, 64}));
  EXPECT_EQ(p->q.stride, (std::array<int64_t, 4>{512 * 576, 64, 576, 1}));
  EXPECT_EQ(p->q.offset, 0);
  EXPECT_EQ(p->k.dim, (std::array<int64_t, 4>{2, 3, 512, 64}));
  EXPECT_EQ(p->k.stride, (std::array<int64_t, 4>{512 * 384, 64, 384, 1}));
  EXPECT_EQ(p->k.offset, 0);
  EXPECT_EQ(p->v.stride, p->k.stride);
  EXPECT_EQ(p->v.offset, 192);
  EXPECT_EQ(p->o.stride, (std::array<int64_t, 4>{512 * 192, 64, 192, 1}));
  EXPECT_EQ(p->o.offset, 0);
  // Stats is the op's lse [B, H', Tq], packed.
  EXPECT_EQ(p->stats.dim, (std::array<int64_t, 4>{2, 3, 512, 1}));
  EXPECT_EQ(p->stats.stride, (std::array<int64_t, 4>{3 * 512, 512, 1, 1}));
  for (const SdpaTensor* t : {&p->q, &p->k, &p->v, &p->o}) {
    EXPECT_EQ(t->offset * 2 % 16, 0);  // cuDNN's 16-byte rows
    EXPECT_EQ(t->stride[2] * 2 % 16, 0);
  }
  // Temporaries: o (and dq) then dk|dv, then the workspace, 256-aligned and
  // disjoint.
  const RingSdpaScratch& s = p->scratch;
  EXPECT_EQ(s.o_bytes, size_t{2} * 512 * 192 * 2);
  EXPECT_EQ(s.dkv_bytes, size_t{2} * 512 * 384 * 2);
  for (size_t offset : {s.forward_workspace, s.dkv, s.backward_workspace}) {
    EXPECT_EQ(offset % 256, 0u);
  }
  EXPECT_GE(s.forward_workspace, s.o_bytes);
  EXPECT_GE(s.dkv, s.o_bytes);
  EXPECT_GE(s.backward_workspace, s.dkv + s.dkv_bytes);
  EXPECT_EQ(RingSdpaForwardScratchBytes(*p, 1000), s.forward_workspace + 1000);
  EXPECT_EQ(RingSdpaBackwardScratchBytes(*p, 0), s.backward_workspace);

  // A diagonal block with T not a multiple of 128: rows still 16-byte
  // aligned, the mask causal.
  absl::StatusOr<RingSdpaPlan> d = PlanRingSdpa(Block(1, 100, 100, 64, 2, 300, 300));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_TRUE(d->causal);
  EXPECT_EQ(d->scale, 1.0f / std::sqrt(32.0f));
  EXPECT_EQ(d->scratch.forward_workspace, 12800u);  // 100·64·2 = 12800, a multiple of 256
  EXPECT_EQ(d->scratch.dkv, 12800u);
  EXPECT_EQ(d->scratch.backward_workspace, 12800u + 25600u);
}

TEST(RingSdpaPlanTest, CudnnTakesFullyVisibleAndDiagonalBlocksOnly) {
  struct Case {
    const char* name;
    RingSdpaBlock block;
    RingBlockMask mask;
    absl::StatusCode code;
  };
  const Case cases[] = {
      {"fully visible, the last key is the first query's position",
       Block(2, 8, 8, 64, 2, 8, 1), RingBlockMask::kNone, absl::StatusCode::kOk},
      {"fully visible, Tq ≠ Tk", Block(2, 6, 10, 64, 2, 40, 0), RingBlockMask::kNone,
       absl::StatusCode::kOk},
      {"diagonal", Block(2, 8, 8, 64, 2, 16, 16), RingBlockMask::kCausal, absl::StatusCode::kOk},
      {"diagonal at 0", Block(1, 2, 2, 64, 8, 0, 0), RingBlockMask::kCausal,
       absl::StatusCode::kOk},
      {"one key past full visibility", Block(2, 8, 8, 64, 2, 8, 2), RingBlockMask::kPartial,
       absl::StatusCode::kFailedPrecondition},
      {"same offsets, Tq ≠ Tk", Block(2, 8, 6, 64, 2, 16, 16), RingBlockMask::kPartial,
       absl::StatusCode::kFailedPrecondition},
      {"diagonal shifted by one", Block(2, 8, 8, 64, 2, 17, 16), RingBlockMask::kPartial,
       absl::StatusCode::kFailedPrecondition},
      {"invisible", Block(2, 8, 8, 64, 2, 0, 8), RingBlockMask::kInvisible,
       absl::StatusCode::kFailedPrecondition},
      {"one query row", Block(2, 1, 8, 64, 2, 40, 0), RingBlockMask::kNone,
       absl::StatusCode::kFailedPrecondition},
      {"one key row", Block(2, 8, 1, 64, 2, 40, 0), RingBlockMask::kNone,
       absl::StatusCode::kFailedPrecondition},
      {"head dim 4", Block(2, 8, 8, 8, 2, 8, 0), RingBlockMask::kNone,
       absl::StatusCode::kInvalidArgument},
      {"head dim 12", Block(2, 8, 8, 24, 2, 8, 0), RingBlockMask::kNone,
       absl::StatusCode::kInvalidArgument},
      {"head dim 264", Block(2, 8, 8, 528, 2, 8, 0), RingBlockMask::kNone,
       absl::StatusCode::kInvalidArgument},
      {"H' not dividing C'", Block(2, 8, 8, 60, 8, 8, 0), RingBlockMask::kNone,
       absl::StatusCode::kInvalidArgument},
      {"negative offset", Block(2, 8, 8, 64, 2, -1, -9), RingBlockMask::kNone,
       absl::StatusCode::kInvalidArgument},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    EXPECT_EQ(RingBlockMaskOf(c.block), c.mask);
    const absl::Status s = RingSdpaApplies(c.block);
    EXPECT_EQ(s.code(), c.code) << s;
    EXPECT_EQ(PlanRingSdpa(c.block).status().code(), c.code);
  }
  for (int64_t hd : {8, 64, 128, 256}) {
    EXPECT_TRUE(RingSdpaApplies(Block(1, 16, 16, 2 * hd, 2, 16, 0)).ok()) << "hd " << hd;
  }
  // The reason names the kind of block.
  EXPECT_NE(RingSdpaApplies(Block(2, 8, 8, 64, 2, 8, 2)).message().find("partly visible"),
            std::string::npos);
}

// One query block of a cp ring over T = 12 in chunks of 4 (q at 8), against
// the key/value blocks at 0 and 4 (fully visible) and its own (the
// diagonal): each block through the plan matches the CPU's block attention
// (Stats = the CPU's lse); merged, the CPU's full attention; the backward of
// each block from the final lse and o, the CPU's block backward.
TEST(RingSdpaPlanTest, RingOfBlocksReproducesTheCpuForwardAndBackward) {
  namespace cpu = ::baton::kernels::cpu;
  const int64_t batch = 2, t = 4, heads = 2, hd = 8, c = heads * hd, q_offset = 8;
  const std::vector<float> qkv = Random(batch * t * 3 * c, 31);
  const std::vector<float> dout = Random(batch * t * c, 32);
  const cpu::BlockAttentionStrides strides{3 * c, 2 * c};
  const int64_t k_offsets[] = {0, 4, 8};
  std::vector<std::vector<float>> kvs;
  for (int64_t k_offset : k_offsets) {
    // The diagonal's keys and values are the query chunk's own.
    std::vector<float> kv = Random(batch * t * 2 * c, 40 + static_cast<uint32_t>(k_offset));
    if (k_offset == q_offset) {
      for (int64_t r = 0; r < batch * t; ++r) {
        for (int64_t e = 0; e < 2 * c; ++e) kv[r * 2 * c + e] = qkv[r * 3 * c + c + e];
      }
    }
    kvs.push_back(kv);
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> scratch(2 * t * t);
  // The CPU's ring, and the plan's blocks merged by the CPU's merge.
  std::vector<float> out(batch * t * c, 0.0f), lse(batch * heads * t, -INFINITY);
  std::vector<float> sdpa_out = out, sdpa_lse = lse;
  for (size_t n = 0; n < kvs.size(); ++n) {
    SCOPED_TRACE(::testing::Message() << "k_offset " << k_offsets[n]);
    std::vector<float> bo(out.size()), bl(lse.size());
    cpu::BlockAttentionForward(bo.data(), bl.data(), qkv.data(), kvs[n].data(), kvs[n].data() + c,
                               batch, t, t, c, heads, q_offset, k_offsets[n], scratch.data(),
                               strides);
    cpu::MergeAttentionBlock(out.data(), lse.data(), bo.data(), bl.data(), batch, t, c, heads);

    absl::StatusOr<RingSdpaPlan> p =
        PlanRingSdpa(Block(batch, t, t, c, heads, q_offset, k_offsets[n]));
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(p->causal, k_offsets[n] == q_offset);
    std::vector<float> so(out.size(), nan), sl(lse.size(), nan);
    RingSdpaForward(*p, qkv, kvs[n], so, sl);
    for (size_t e = 0; e < so.size(); ++e) ASSERT_NEAR(so[e], bo[e], 1e-5f) << "o " << e;
    for (size_t e = 0; e < sl.size(); ++e) ASSERT_NEAR(sl[e], bl[e], 1e-5f) << "stats " << e;
    cpu::MergeAttentionBlock(sdpa_out.data(), sdpa_lse.data(), so.data(), sl.data(), batch, t, c,
                             heads);
  }
  for (size_t e = 0; e < out.size(); ++e) ASSERT_NEAR(sdpa_out[e], out[e], 1e-5f) << "out " << e;
  for (size_t e = 0; e < lse.size(); ++e) ASSERT_NEAR(sdpa_lse[e], lse[e], 1e-5f) << "lse " << e;

  std::vector<float> delta(lse.size());
  cpu::AttentionDelta(delta.data(), dout.data(), out.data(), batch, t, c, heads);
  std::vector<float> dq_cpu(qkv.size(), 0.0f), dq_sum(batch * t * c, 0.0f);
  for (size_t n = 0; n < kvs.size(); ++n) {
    SCOPED_TRACE(::testing::Message() << "k_offset " << k_offsets[n]);
    std::vector<float> dkv_cpu(kvs[n].size(), 0.0f);
    cpu::BlockAttentionBackward(dq_cpu.data(), dkv_cpu.data(), dkv_cpu.data() + c, dout.data(),
                                qkv.data(), kvs[n].data(), kvs[n].data() + c, lse.data(),
                                delta.data(), batch, t, t, c, heads, q_offset, k_offsets[n],
                                scratch.data(), strides);
    absl::StatusOr<RingSdpaPlan> p =
        PlanRingSdpa(Block(batch, t, t, c, heads, q_offset, k_offsets[n]));
    ASSERT_TRUE(p.ok()) << p.status();
    std::vector<float> dq(batch * t * c, nan), dkv(kvs[n].size(), nan);
    RingSdpaBackward(*p, qkv, kvs[n], out, lse, dout, dq, dkv);
    for (size_t e = 0; e < dkv.size(); ++e) ASSERT_NEAR(dkv[e], dkv_cpu[e], 1e-4f) << "dkv " << e;
    for (size_t e = 0; e < dq.size(); ++e) dq_sum[e] += dq[e];
  }
  for (int64_t r = 0; r < batch * t; ++r) {
    for (int64_t e = 0; e < c; ++e) {
      ASSERT_NEAR(dq_sum[r * c + e], dq_cpu[r * 3 * c + e], 1e-4f) << "dq " << r << "," << e;
    }
  }
}

TEST(RingSdpaPlanTest, CacheKeysSeparateEveryShapeMaskAndDevice) {
  const RingSdpaBlock base = Block(2, 64, 64, 128, 2, 128, 0);
  absl::StatusOr<RingSdpaPlan> p = PlanRingSdpa(base);
  ASSERT_TRUE(p.ok());
  const RingSdpaKey k = MakeRingSdpaKey(*p, 0);
  std::vector<RingSdpaKey> keys = {k, MakeRingSdpaKey(*p, 1)};
  for (int field = 0; field < 6; ++field) {
    RingSdpaBlock b = base;
    if (field == 0) b.batch += 1;
    if (field == 1) b.q_len += 1;
    if (field == 2) b.k_len += 1;
    if (field == 3) b.channels += 64;
    if (field == 4) b.heads = 4;  // hd 32
    if (field == 5) b.k_offset = b.q_offset;  // the diagonal: causal
    absl::StatusOr<RingSdpaPlan> other = PlanRingSdpa(b);
    ASSERT_TRUE(other.ok()) << field << ": " << other.status();
    keys.push_back(MakeRingSdpaKey(*other, 0));
  }
  absl::flat_hash_set<RingSdpaKey> set(keys.begin(), keys.end());
  EXPECT_EQ(set.size(), keys.size());
  // Other offsets with the same mask are the same graphs.
  absl::StatusOr<RingSdpaPlan> shifted = PlanRingSdpa(Block(2, 64, 64, 128, 2, 640, 64));
  ASSERT_TRUE(shifted.ok());
  EXPECT_EQ(MakeRingSdpaKey(*shifted, 0), k);
  EXPECT_EQ(RingSdpaKeyToString(k), "ring sdpa B=2 Tq=64 Tk=64 C'=128 H'=2 unmasked cuda:0");
}

TEST(RingSdpaPlanTest, WorkspaceBound) {
  const RingSdpaBlock b = Block(2, 64, 64, 128, 2, 64, 64);
  EXPECT_TRUE(CheckRingSdpaWorkspace(kMaxSdpaWorkspaceBytes, b).ok());
  const absl::Status over = CheckRingSdpaWorkspace(kMaxSdpaWorkspaceBytes + 1, b);
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(over.message().find("Tq=64"), std::string::npos) << over;
}

}  // namespace
}  // namespace baton::cuda
