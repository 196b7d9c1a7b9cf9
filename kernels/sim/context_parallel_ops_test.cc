// The context-parallel ops of kernels/ops.h (KvOfQkv, BlockAttention,
// MergeAttentionBlock, AttentionDelta, BlockAttentionBackward, QkvGradOfKv
// and RopePack's position offset), run through the backend seam on the CPU
// and on the simulated device: ring attention over Megatron's load-balanced
// cp = 2 split equals full causal Attention and AttentionBackward, a RoPE'd
// chunk at its offset equals the rows of the whole sequence's, and the
// simulated device gives the CPU's bits throughout.
#include <cmath>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/ops.h"
#include "kernels/sim/sim_backend.h"

namespace baton::kernels {
namespace {

using Vec = std::vector<float>;

constexpr double kTol = 1e-5;  // max abs diff against the full attention

Tensor Random(Shape shape, uint32_t seed) {
  Tensor t = Tensor::Zeros(std::move(shape));
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist;
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = dist(gen);
  return t;
}

Vec Values(const Tensor& host) { return Vec(host.f32(), host.f32() + host.numel()); }

double MaxAbsDiff(const Vec& a, const Vec& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    m = std::max(m, std::fabs(double{a[i]} - b[i]));
  }
  return m;
}

bool SameBits(const Vec& a, const Vec& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Where the ops run: the CPU (ExecContext::Host()) or sim:0 on its own
// stream; host tensors go up and results come back through Copy.
class Runner {
 public:
  explicit Runner(bool sim) {
    if (sim) {
      stream_ = *Stream::Create(Device::Sim(0));
      ctx_ = ExecContext::On(stream_.get());
    }
  }
  const ExecContext& ctx() const { return ctx_; }

  Tensor Zeros(Shape shape, DType dtype = DType::kFloat32) {
    return *ZerosOn(ctx_.device, std::move(shape), dtype);
  }
  Tensor Up(const Tensor& host) {
    Tensor d = Zeros(host.shape());
    Copy(ctx_, d, host);
    return d;
  }
  Vec Down(const Tensor& d) {
    Vec out(static_cast<size_t>(d.numel()));
    Copy(ctx_, Tensor::View(out.data(), {d.numel()}), d);
    if (stream_ != nullptr) {
      EXPECT_TRUE(stream_->Synchronize().ok());
    }
    return out;
  }

 private:
  std::unique_ptr<Stream> stream_;
  ExecContext ctx_ = ExecContext::Host();
};

// A run of sequence positions [start, start + len).
struct Span {
  int64_t start;
  int64_t len;
};

// Rows [span) of every batch row of x [B,T,W], as a host [B,len,W].
Tensor SeqRows(const Tensor& x, Span s) {
  const int64_t b = x.dim(0), t = x.dim(1), w = x.dim(2);
  Tensor r = Tensor::Zeros({b, s.len, w});
  for (int64_t i = 0; i < b; ++i) {
    std::memcpy(r.f32() + i * s.len * w, x.f32() + (i * t + s.start) * w,
                sizeof(float) * s.len * w);
  }
  return r;
}

// x[rows of span] = r (host [B,len,W] into [B,T,W] values).
void SetSeqRows(Vec& x, int64_t t, int64_t w, const Vec& r, Span s) {
  const int64_t b = static_cast<int64_t>(r.size()) / (s.len * w);
  for (int64_t i = 0; i < b; ++i) {
    std::memcpy(&x[(i * t + s.start) * w], &r[i * s.len * w], sizeof(float) * s.len * w);
  }
}

constexpr int64_t kBatch = 2, kHeads = 2, kHeadDim = 4, kChannels = kHeads * kHeadDim;
constexpr int64_t kChunk = 3, kSeq = 4 * kChunk;

// cp = 2, load balanced: the sequence in 4 chunks, rank 0 holding chunks 0
// and 3 (two blocks, not adjacent), rank 1 chunks 1 and 2 (adjacent: one
// block of 2·kChunk rows, so q_len ≠ k_len against rank 0's blocks).
const std::vector<std::vector<Span>> kRanks = {{{0, kChunk}, {3 * kChunk, kChunk}},
                                               {{kChunk, 2 * kChunk}}};

// What ring attention produced: out [B,T,C] and dqkv [B,T,3C] assembled
// from every block, and every block's final lse, in rank order.
struct RingResult {
  Vec out, dqkv;
  std::vector<Vec> lse;
};

// Ring attention assembled from the ops: each rank runs its query blocks
// against its own key/value blocks, then those arriving from the other rank
// (the ring's order); the first block goes straight into (out, lse), the
// rest are merged. The backward adds every query block's dk, dv into the
// key block's dkv (the reduction back to its owner), then each owner writes
// its dkv into its dqkv. With `bf16` the blocks read bf16 qkv, kv, dout and
// out (a bf16 stage's ring; δ from the fp32 output and dout's image), as
// GptStage runs them.
RingResult RunRing(Runner& run, const Tensor& qkv, const Tensor& dout, bool bf16 = false) {
  const int64_t c = kChannels;
  struct Block {
    Span span;
    Tensor qkv, kv, dout, out, lse, delta, dqkv, dkv;
  };
  const DType input = bf16 ? DType::kBFloat16 : DType::kFloat32;
  auto up = [&](const Tensor& host) {  // on the device, in the inputs' dtype
    const Tensor wide = run.Up(host);
    if (!bf16) return wide;
    Tensor narrow = run.Zeros(host.shape(), input);
    Cast(run.ctx(), narrow, wide);
    return narrow;
  };
  std::vector<std::vector<Block>> ranks;
  for (const std::vector<Span>& spans : kRanks) {
    std::vector<Block>& blocks = ranks.emplace_back();
    for (Span s : spans) {
      Block b;
      b.span = s;
      b.qkv = up(SeqRows(qkv, s));
      b.dout = up(SeqRows(dout, s));
      b.kv = run.Zeros({kBatch, s.len, 2 * c}, input);
      KvOfQkv(run.ctx(), b.kv, b.qkv);
      b.out = run.Zeros({kBatch, s.len, c});
      b.lse = run.Zeros({kBatch, kHeads, s.len});
      b.delta = run.Zeros({kBatch, kHeads, s.len});
      b.dqkv = run.Zeros({kBatch, s.len, 3 * c});
      b.dkv = run.Zeros({kBatch, s.len, 2 * c});
      blocks.push_back(std::move(b));
    }
  }
  // The key blocks rank r sees, in ring order: its own, then the next's.
  auto key_blocks = [&](size_t r) {
    std::vector<Block*> keys;
    for (size_t step = 0; step < ranks.size(); ++step) {
      for (Block& b : ranks[(r + ranks.size() - step) % ranks.size()]) keys.push_back(&b);
    }
    return keys;
  };
  const int64_t max_len = 2 * kChunk;
  Tensor scratch = run.Zeros({BlockAttentionBackwardScratch(max_len, max_len)});
  for (size_t r = 0; r < ranks.size(); ++r) {
    for (Block& q : ranks[r]) {
      Tensor block_out = run.Zeros(q.out.shape()), block_lse = run.Zeros(q.lse.shape());
      bool first = true;
      for (Block* k : key_blocks(r)) {
        const Tensor& o = first ? q.out : block_out;
        const Tensor& l = first ? q.lse : block_lse;
        BlockAttention(run.ctx(), o, l, q.qkv, k->kv, kHeads, q.span.start, k->span.start,
                       scratch);
        if (!first) MergeAttentionBlock(run.ctx(), q.out, q.lse, block_out, block_lse, kHeads);
        first = false;
      }
    }
  }
  for (size_t r = 0; r < ranks.size(); ++r) {
    for (Block& q : ranks[r]) {
      Tensor out = q.out, dout_image = q.dout;
      if (bf16) {  // the output as the stage keeps it, and dout's image for δ
        out = run.Zeros(q.out.shape(), input);
        Cast(run.ctx(), out, q.out);
        dout_image = run.Zeros(q.dout.shape());
        Cast(run.ctx(), dout_image, q.dout);
      }
      AttentionDelta(run.ctx(), q.delta, dout_image, q.out, kHeads);
      for (Block* k : key_blocks(r)) {
        BlockAttentionBackward(run.ctx(), q.dqkv, k->dkv, q.dout, out, q.qkv, k->kv, q.lse,
                               q.delta, kHeads, q.span.start, k->span.start, scratch);
      }
    }
  }
  RingResult result;
  result.out.assign(kBatch * kSeq * c, 0.0f);
  result.dqkv.assign(kBatch * kSeq * 3 * c, 0.0f);
  for (std::vector<Block>& blocks : ranks) {
    for (Block& b : blocks) {
      QkvGradOfKv(run.ctx(), b.dqkv, b.dkv);
      SetSeqRows(result.out, kSeq, c, run.Down(b.out), b.span);
      SetSeqRows(result.dqkv, kSeq, 3 * c, run.Down(b.dqkv), b.span);
      result.lse.push_back(run.Down(b.lse));
    }
  }
  return result;
}

class ContextParallelOpsTest : public ::testing::Test {
 protected:
  ContextParallelOpsTest()
      : qkv_(Random({kBatch, kSeq, 3 * kChannels}, 11)),
        dout_(Random({kBatch, kSeq, kChannels}, 12)) {}

  // Full causal attention over the whole sequence on the CPU.
  void Reference(Vec& out, Vec& dqkv) {
    const AttentionBuffers buffers = AttentionBuffersFor(ExecContext::Host(), kBatch, kSeq,
                                                         kChannels, kHeads, DType::kFloat32);
    Tensor o = Tensor::Zeros({kBatch, kSeq, kChannels}), att = Tensor::Zeros(buffers.saved);
    Tensor scratch = Tensor::Zeros({buffers.backward_scratch}), d = Tensor::Zeros(qkv_.shape());
    Attention(o, att, qkv_, kHeads);
    AttentionBackward(d, scratch, dout_, qkv_, att, kHeads);
    out = Values(o);
    dqkv = Values(d);
  }

  Tensor qkv_, dout_;
};

TEST_F(ContextParallelOpsTest, RingOverTheLoadBalancedSplitMatchesFullAttention) {
  Vec ref_out, ref_dqkv;
  Reference(ref_out, ref_dqkv);
  Runner cpu(/*sim=*/false);
  const RingResult ring = RunRing(cpu, qkv_, dout_);
  EXPECT_LE(MaxAbsDiff(ring.out, ref_out), kTol);
  EXPECT_LE(MaxAbsDiff(ring.dqkv, ref_dqkv), kTol);
  // Every gradient column was written: q from the blocks, k and v through
  // QkvGradOfKv (a missing part would leave zeros far from the reference).
  double norm = 0;
  for (float g : ref_dqkv) norm = std::max(norm, std::fabs(double{g}));
  EXPECT_GT(norm, 100 * kTol);
}

TEST_F(ContextParallelOpsTest, SimulatedDeviceGivesTheCpuBits) {
  Runner cpu(/*sim=*/false), sim(/*sim=*/true);
  const RingResult a = RunRing(cpu, qkv_, dout_);
  const RingResult b = RunRing(sim, qkv_, dout_);
  EXPECT_TRUE(SameBits(a.out, b.out));
  EXPECT_TRUE(SameBits(a.dqkv, b.dqkv));
  ASSERT_EQ(a.lse.size(), b.lse.size());
  for (size_t i = 0; i < a.lse.size(); ++i) EXPECT_TRUE(SameBits(a.lse[i], b.lse[i])) << i;
  // And the same bits run to run.
  const RingResult again = RunRing(sim, qkv_, dout_);
  EXPECT_TRUE(SameBits(again.dqkv, b.dqkv));
}

// The values of x rounded to bf16 (its exact fp32 image, as fp32).
Tensor Bf16Image(const Tensor& x) {
  Tensor r = Tensor::Zeros(x.shape()), narrow = Tensor::Zeros(x.shape(), DType::kBFloat16);
  Cast(ExecContext::Host(), narrow, x);
  Cast(ExecContext::Host(), r, narrow);
  return r;
}

// bf16 ring inputs (ops.h): on the CPU and the simulated device the ring
// gives the bits of the fp32 ring on the inputs' images, with k and v in
// bf16 (half the bytes on the ring).
TEST_F(ContextParallelOpsTest, Bf16InputsGiveTheFp32RingsBitsOnTheirImages) {
  const Tensor qkv = Bf16Image(qkv_), dout = Bf16Image(dout_);
  for (const bool sim : {false, true}) {
    SCOPED_TRACE(sim ? "sim" : "cpu");
    Runner run(sim);
    const RingResult fp32 = RunRing(run, qkv, dout);
    const RingResult bf16 = RunRing(run, qkv_, dout_, /*bf16=*/true);
    EXPECT_TRUE(SameBits(bf16.out, fp32.out));
    EXPECT_TRUE(SameBits(bf16.dqkv, fp32.dqkv));
    ASSERT_EQ(bf16.lse.size(), fp32.lse.size());
    for (size_t i = 0; i < fp32.lse.size(); ++i) EXPECT_TRUE(SameBits(bf16.lse[i], fp32.lse[i])) << i;
    // Not the unrounded inputs' bits: the inputs did go through bf16.
    EXPECT_FALSE(SameBits(bf16.out, RunRing(run, qkv_, dout_).out));
  }
}

// Mixed dtypes among the ring's inputs are refused, naming the rule.
TEST(ContextParallelOpsDeathTest, MixedInputDtypesAbortNamingTheRule) {
  const Tensor qkv = Tensor::Zeros({1, 2, 6}, DType::kBFloat16), kv = Tensor::Zeros({1, 2, 4});
  const Tensor out = Tensor::Zeros({1, 2, 2}), lse = Tensor::Zeros({1, 1, 2});
  const Tensor scratch = Tensor::Zeros({BlockAttentionBackwardScratch(2, 2)});
  EXPECT_DEATH(BlockAttention(ExecContext::Host(), out, lse, qkv, kv, 1, 0, 0, scratch),
               "BlockAttention.*share one dtype");
  EXPECT_DEATH(BlockAttention(ExecContext::Host(), out, lse, Tensor::Zeros({1, 2, 6}), kv, 1, 0, 0,
                              Tensor::Zeros({4}, DType::kBFloat16)),
               "BlockAttention.*scratch must be float32");
  EXPECT_DEATH(BlockAttentionBackward(ExecContext::Host(), Tensor::Zeros({1, 2, 6}), kv, out,
                                      Tensor::Zeros({1, 2, 2}, DType::kBFloat16),
                                      Tensor::Zeros({1, 2, 6}), kv, lse, lse, 1, 0, 0, scratch),
               "BlockAttentionBackward.*share one dtype");
}

TEST_F(ContextParallelOpsTest, BlockAttentionBackwardAccumulatesAndLeavesKvColumnsOfDqkv) {
  Runner cpu(/*sim=*/false);
  const Span s{0, kSeq};
  Tensor qkv = SeqRows(qkv_, s), kv = Tensor::Zeros({kBatch, kSeq, 2 * kChannels});
  KvOfQkv(cpu.ctx(), kv, qkv);
  Tensor out = Tensor::Zeros({kBatch, kSeq, kChannels}), lse = Tensor::Zeros({kBatch, kHeads, kSeq});
  Tensor delta = Tensor::Zeros(lse.shape());
  Tensor scratch = Tensor::Zeros({BlockAttentionBackwardScratch(kSeq, kSeq)});
  BlockAttention(cpu.ctx(), out, lse, qkv, kv, kHeads, 0, 0, scratch);
  AttentionDelta(cpu.ctx(), delta, dout_, out, kHeads);
  // Once from zero, once from a prefilled 1: the second is the first + 1
  // in the q columns (up to the rounding of the add), k/v columns keep 1.
  Tensor d0 = Tensor::Zeros(qkv.shape()), d1 = Tensor::Zeros(qkv.shape());
  Tensor dkv0 = Tensor::Zeros(kv.shape()), dkv1 = Tensor::Zeros(kv.shape());
  for (int64_t i = 0; i < d1.numel(); ++i) d1.f32()[i] = 1.0f;
  for (int64_t i = 0; i < dkv1.numel(); ++i) dkv1.f32()[i] = 1.0f;
  BlockAttentionBackward(cpu.ctx(), d0, dkv0, dout_, out, qkv, kv, lse, delta, kHeads, 0, 0, scratch);
  BlockAttentionBackward(cpu.ctx(), d1, dkv1, dout_, out, qkv, kv, lse, delta, kHeads, 0, 0, scratch);
  const int64_t c = kChannels;
  for (int64_t r = 0; r < kBatch * kSeq; ++r) {
    for (int64_t j = 0; j < 3 * c; ++j) {
      const float g0 = d0.f32()[r * 3 * c + j], g1 = d1.f32()[r * 3 * c + j];
      if (j < c) {
        EXPECT_NEAR(g1, g0 + 1.0f, 1e-6) << r << "," << j;
      } else {
        EXPECT_EQ(g0, 0.0f) << r << "," << j;
        EXPECT_EQ(g1, 1.0f) << r << "," << j;
      }
    }
    for (int64_t j = 0; j < 2 * c; ++j) {
      EXPECT_NEAR(dkv1.f32()[r * 2 * c + j], dkv0.f32()[r * 2 * c + j] + 1.0f, 1e-6);
    }
  }
}

// ---- RoPE at a position offset ----

constexpr int64_t kRopeHeads = 4, kRopeKvHeads = 2, kRopeDim = 8, kRopeSeq = 10;
constexpr float kTheta = 10000.0f;

// Rows [span) of a row-major [B·T, W] host tensor, as [B·len, W].
Tensor FlatRows(const Tensor& x, int64_t seq, Span s) {
  const int64_t w = x.dim(1), b = x.dim(0) / seq;
  return SeqRows(x.Reshaped({b, seq, w}), s).Reshaped({b * s.len, w});
}

// RopePack and RopePackBackward of the whole sequence, and of its chunk
// [span) at position offset `offset`, on `run`.
struct RopeOut {
  Vec qkv, dq, dk, dv;
};

RopeOut RunRope(Runner& run, const Tensor& q, const Tensor& k, const Tensor& v,
                const Tensor& dqkv, int64_t batch, int64_t seq, int64_t offset) {
  const int64_t hd = kRopeHeads * kRopeDim, kvd = kRopeKvHeads * kRopeDim;
  Tensor packed = run.Zeros({batch, seq, 3 * hd});
  Tensor dq = run.Zeros({batch * seq, hd}), dk = run.Zeros({batch * seq, kvd}),
         dv = run.Zeros({batch * seq, kvd});
  RopePack(run.ctx(), packed, run.Up(q), run.Up(k), run.Up(v), kRopeHeads, kRopeKvHeads, kTheta,
           offset);
  RopePackBackward(run.ctx(), dq, dk, dv, run.Up(dqkv), kRopeHeads, kRopeKvHeads, kTheta, offset);
  return {run.Down(packed), run.Down(dq), run.Down(dk), run.Down(dv)};
}

TEST(RopeOffsetTest, AChunkAtItsOffsetIsTheRowsOfTheWholeSequence) {
  const int64_t b = 2, t = kRopeSeq, hd = kRopeHeads * kRopeDim, kvd = kRopeKvHeads * kRopeDim;
  const Tensor q = Random({b * t, hd}, 21), k = Random({b * t, kvd}, 22),
               v = Random({b * t, kvd}, 23), dqkv = Random({b, t, 3 * hd}, 24);
  for (bool on_sim : {false, true}) {
    SCOPED_TRACE(on_sim ? "sim" : "cpu");
    Runner run(on_sim);
    const RopeOut whole = RunRope(run, q, k, v, dqkv, b, t, 0);
    // The default offset is 0: the op as it was.
    {
      Tensor packed = run.Zeros({b, t, 3 * hd});
      RopePack(run.ctx(), packed, run.Up(q), run.Up(k), run.Up(v), kRopeHeads, kRopeKvHeads,
               kTheta);
      EXPECT_TRUE(SameBits(run.Down(packed), whole.qkv));
    }
    for (Span s : {Span{0, t / 2}, Span{t / 2, t / 2}, Span{3, 4}}) {
      SCOPED_TRACE(s.start);
      const RopeOut chunk = RunRope(run, FlatRows(q, t, s), FlatRows(k, t, s), FlatRows(v, t, s),
                                    SeqRows(dqkv, s), b, s.len, s.start);
      Tensor whole_qkv = Tensor::View(const_cast<float*>(whole.qkv.data()), {b, t, 3 * hd});
      Tensor whole_dq = Tensor::View(const_cast<float*>(whole.dq.data()), {b * t, hd});
      Tensor whole_dk = Tensor::View(const_cast<float*>(whole.dk.data()), {b * t, kvd});
      Tensor whole_dv = Tensor::View(const_cast<float*>(whole.dv.data()), {b * t, kvd});
      EXPECT_TRUE(SameBits(chunk.qkv, Values(SeqRows(whole_qkv, s))));
      EXPECT_TRUE(SameBits(chunk.dq, Values(FlatRows(whole_dq, t, s))));
      EXPECT_TRUE(SameBits(chunk.dk, Values(FlatRows(whole_dk, t, s))));
      EXPECT_TRUE(SameBits(chunk.dv, Values(FlatRows(whole_dv, t, s))));
      if (s.start > 0) {
        // Without the offset the chunk would be rotated as positions 0..:
        // different values, so the test above can fail.
        const RopeOut unshifted =
            RunRope(run, FlatRows(q, t, s), FlatRows(k, t, s), FlatRows(v, t, s),
                    SeqRows(dqkv, s), b, s.len, 0);
        EXPECT_FALSE(SameBits(unshifted.qkv, chunk.qkv));
        EXPECT_FALSE(SameBits(unshifted.dq, chunk.dq));
      }
    }
  }
}

}  // namespace
}  // namespace baton::kernels
