// Block attention (ring attention's kernel) against the full causal
// attention of kernels/cpu/attention.h: forward merged over key blocks in any
// order, backward summed over key blocks, Megatron's load-balanced context
// parallel split, uneven blocks, the −∞ edge cases and determinism.
#include "kernels/cpu/block_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/gemm.h"

namespace baton::kernels::cpu {
namespace {

using Vec = std::vector<float>;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr double kOutTol = 1e-5;   // max abs diff of out
constexpr double kLseTol = 1e-5;   // max abs diff of lse against float64
constexpr double kGradTol = 1e-5;  // relative L2 of dq, dk, dv

// A contiguous run of sequence positions [start, start + len).
struct Span {
  int64_t start;
  int64_t len;
};

// q, k, v and dout, each [B,T,C].
struct Problem {
  int64_t batch, seq, channels, heads;
  Vec q, k, v, dout;
};

// Rows [span) of x [B,T,C], as a contiguous [B,len,C].
Vec Rows(const Vec& x, const Problem& p, Span s) {
  Vec r(p.batch * s.len * p.channels);
  for (int64_t b = 0; b < p.batch; ++b) {
    std::memcpy(&r[b * s.len * p.channels], &x[(b * p.seq + s.start) * p.channels],
                s.len * p.channels * sizeof(float));
  }
  return r;
}

// x[rows of span] = r, the inverse of Rows.
void SetRows(Vec& x, const Vec& r, const Problem& p, Span s) {
  for (int64_t b = 0; b < p.batch; ++b) {
    std::memcpy(&x[(b * p.seq + s.start) * p.channels], &r[b * s.len * p.channels],
                s.len * p.channels * sizeof(float));
  }
}

// Positions [span) of an lse-shaped x [B,NH,T], as [B,NH,len].
Vec LseRows(const std::vector<double>& x, const Problem& p, Span s) {
  Vec r(p.batch * p.heads * s.len);
  for (int64_t bh = 0; bh < p.batch * p.heads; ++bh) {
    for (int64_t i = 0; i < s.len; ++i) r[bh * s.len + i] = x[bh * p.seq + s.start + i];
  }
  return r;
}

double MaxAbsDiff(const Vec& a, const Vec& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(double{a[i]} - b[i]));
  return m;
}

double RelativeL2(const Vec& a, const Vec& ref) {
  EXPECT_EQ(a.size(), ref.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double{a[i]} - ref[i]) * (double{a[i]} - ref[i]);
    den += double{ref[i]} * ref[i];
  }
  return std::sqrt(num / den);
}

bool SameBits(const Vec& a, const Vec& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// The full causal attention of kernels/cpu/attention.h on the packed
// qkv [B,T,3C]: out [B,T,C], and dq, dk, dv [B,T,C] unpacked from dqkv.
struct Reference {
  Vec out, dq, dk, dv;
};

Reference FullAttention(const Problem& p) {
  const int64_t c = p.channels;
  Vec qkv(p.batch * p.seq * 3 * c);
  for (int64_t r = 0; r < p.batch * p.seq; ++r) {
    std::memcpy(&qkv[r * 3 * c], &p.q[r * c], c * sizeof(float));
    std::memcpy(&qkv[r * 3 * c + c], &p.k[r * c], c * sizeof(float));
    std::memcpy(&qkv[r * 3 * c + 2 * c], &p.v[r * c], c * sizeof(float));
  }
  Reference ref;
  ref.out.resize(p.batch * p.seq * c);
  Vec att(p.batch * p.heads * p.seq * p.seq), scratch(p.seq * p.seq), dqkv(qkv.size());
  AttentionForward(ref.out.data(), att.data(), qkv.data(), p.batch, p.seq, c, p.heads);
  AttentionBackward(dqkv.data(), scratch.data(), p.dout.data(), qkv.data(), att.data(), p.batch,
                    p.seq, c, p.heads);
  for (Vec* g : {&ref.dq, &ref.dk, &ref.dv}) g->resize(p.batch * p.seq * c);
  for (int64_t r = 0; r < p.batch * p.seq; ++r) {
    std::memcpy(&ref.dq[r * c], &dqkv[r * 3 * c], c * sizeof(float));
    std::memcpy(&ref.dk[r * c], &dqkv[r * 3 * c + c], c * sizeof(float));
    std::memcpy(&ref.dv[r * c], &dqkv[r * 3 * c + 2 * c], c * sizeof(float));
  }
  return ref;
}

// lse [B,NH,T] of the full causal attention, directly in float64.
std::vector<double> ReferenceLse(const Problem& p) {
  const int64_t hd = p.channels / p.heads;
  std::vector<double> lse(p.batch * p.heads * p.seq);
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t h = 0; h < p.heads; ++h) {
      for (int64_t i = 0; i < p.seq; ++i) {
        std::vector<double> s(i + 1);
        double max = -1e300;
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < hd; ++d) {
            dot += double{p.q[(b * p.seq + i) * p.channels + h * hd + d]} *
                   p.k[(b * p.seq + j) * p.channels + h * hd + d];
          }
          s[j] = dot / std::sqrt(static_cast<double>(hd));
          max = std::max(max, s[j]);
        }
        double sum = 0;
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(s[j] - max);
        lse[(b * p.heads + h) * p.seq + i] = max + std::log(sum);
      }
    }
  }
  return lse;
}

// The attention state of one query block: out [B,len,C], lse [B,NH,len].
struct State {
  Vec out, lse;
};

State EmptyState(const Problem& p, Span qs) {
  return {Vec(p.batch * qs.len * p.channels, 0.0f), Vec(p.batch * p.heads * qs.len, kNegInf)};
}

// One key block's forward for the queries of `qs`.
State BlockForward(const Problem& p, Span qs, Span ks) {
  State block = EmptyState(p, qs);
  const Vec q = Rows(p.q, p, qs), k = Rows(p.k, p, ks), v = Rows(p.v, p, ks);
  Vec scratch(qs.len * ks.len);
  BlockAttentionForward(block.out.data(), block.lse.data(), q.data(), k.data(), v.data(), p.batch,
                        qs.len, ks.len, p.channels, p.heads, qs.start, ks.start, scratch.data());
  return block;
}

void Merge(State& state, const State& block, const Problem& p, int64_t q_len) {
  MergeAttentionBlock(state.out.data(), state.lse.data(), block.out.data(), block.lse.data(),
                      p.batch, q_len, p.channels, p.heads);
}

// The queries of `qs` against the key blocks `ks`, merged in the given order.
State MergedForward(const Problem& p, Span qs, const std::vector<Span>& ks) {
  State state = EmptyState(p, qs);
  for (Span s : ks) Merge(state, BlockForward(p, qs, s), p, qs.len);
  return state;
}

// Accumulates the gradients of the queries of `qs` against the key blocks
// `ks` (in the given order) into dq, dk, dv [B,T,C], given the final state.
void BlockBackward(const Problem& p, Span qs, const std::vector<Span>& ks, const State& merged,
                   Vec& dq, Vec& dk, Vec& dv) {
  const Vec q = Rows(p.q, p, qs), dout = Rows(p.dout, p, qs);
  Vec delta(p.batch * p.heads * qs.len);
  AttentionDelta(delta.data(), dout.data(), merged.out.data(), p.batch, qs.len, p.channels,
                 p.heads);
  // dq stays local across the key blocks, as on a ring rank; dk and dv
  // accumulate into the running sums of their rows.
  Vec dq_local = Rows(dq, p, qs);
  for (Span s : ks) {
    const Vec k = Rows(p.k, p, s), v = Rows(p.v, p, s);
    Vec dk_rows = Rows(dk, p, s), dv_rows = Rows(dv, p, s), scratch(2 * qs.len * s.len);
    BlockAttentionBackward(dq_local.data(), dk_rows.data(), dv_rows.data(), dout.data(), q.data(),
                           k.data(), v.data(), merged.lse.data(), delta.data(), p.batch, qs.len,
                           s.len, p.channels, p.heads, qs.start, s.start, scratch.data());
    SetRows(dk, dk_rows, p, s);
    SetRows(dv, dv_rows, p, s);
  }
  SetRows(dq, dq_local, p, qs);
}

class BlockAttentionTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { SetBlasThreads(1); }

  Problem RandomProblem(int64_t batch, int64_t seq, int64_t heads, int64_t hd) {
    Problem p{batch, seq, heads * hd, heads, {}, {}, {}, {}};
    std::normal_distribution<float> dist(0.0f, 1.0f);
    for (Vec* x : {&p.q, &p.k, &p.v, &p.dout}) {
      x->resize(batch * seq * p.channels);
      for (float& e : *x) e = dist(rng_);
    }
    return p;
  }

  // Forward and backward of the split (every query block against every key
  // block, key blocks in a shuffled order per query block) against the full
  // attention.
  void ExpectSplitMatchesFull(const Problem& p, const std::vector<Span>& q_blocks,
                              const std::vector<Span>& k_blocks) {
    const Reference ref = FullAttention(p);
    const std::vector<double> ref_lse = ReferenceLse(p);
    Vec dq(ref.dq.size(), 0.0f), dk(dq.size(), 0.0f), dv(dq.size(), 0.0f);
    for (Span qs : q_blocks) {
      std::vector<Span> order = k_blocks;
      std::shuffle(order.begin(), order.end(), rng_);
      const State state = MergedForward(p, qs, order);
      EXPECT_LE(MaxAbsDiff(state.out, Rows(ref.out, p, qs)), kOutTol) << "queries at " << qs.start;
      EXPECT_LE(MaxAbsDiff(state.lse, LseRows(ref_lse, p, qs)), kLseTol)
          << "queries at " << qs.start;
      std::shuffle(order.begin(), order.end(), rng_);
      BlockBackward(p, qs, order, state, dq, dk, dv);
    }
    EXPECT_LE(RelativeL2(dq, ref.dq), kGradTol);
    EXPECT_LE(RelativeL2(dk, ref.dk), kGradTol);
    EXPECT_LE(RelativeL2(dv, ref.dv), kGradTol);
  }

  std::mt19937 rng_{20240611};
};

std::vector<Span> EvenBlocks(int64_t seq, int64_t len) {
  std::vector<Span> blocks;
  for (int64_t s = 0; s < seq; s += len) blocks.push_back({s, len});
  return blocks;
}

TEST_F(BlockAttentionTest, MergedBlocksInAnyOrderMatchFullAttention) {
  const Problem p = RandomProblem(/*batch=*/2, /*seq=*/16, /*heads=*/4, /*hd=*/8);
  const Reference ref = FullAttention(p);
  const std::vector<double> ref_lse = ReferenceLse(p);
  const std::vector<Span> blocks = EvenBlocks(p.seq, 4);
  for (Span qs : blocks) {
    // Every key block, the ones wholly in this block's future included.
    std::vector<Span> order = blocks;
    std::shuffle(order.begin(), order.end(), rng_);
    const State state = MergedForward(p, qs, order);
    EXPECT_LE(MaxAbsDiff(state.out, Rows(ref.out, p, qs)), kOutTol) << "queries at " << qs.start;
    EXPECT_LE(MaxAbsDiff(state.lse, LseRows(ref_lse, p, qs)), kLseTol)
        << "queries at " << qs.start;
  }
}

TEST_F(BlockAttentionTest, BackwardSummedOverBlocksMatchesFullGradient) {
  const Problem p = RandomProblem(/*batch=*/2, /*seq=*/16, /*heads=*/4, /*hd=*/8);
  const Reference ref = FullAttention(p);
  const std::vector<Span> blocks = EvenBlocks(p.seq, 4);
  Vec dq(ref.dq.size(), 0.0f), dk(dq.size(), 0.0f), dv(dq.size(), 0.0f);
  for (Span qs : blocks) {
    std::vector<Span> order = blocks;
    std::shuffle(order.begin(), order.end(), rng_);
    const State state = MergedForward(p, qs, order);
    std::shuffle(order.begin(), order.end(), rng_);
    BlockBackward(p, qs, order, state, dq, dk, dv);
  }
  EXPECT_LE(RelativeL2(dq, ref.dq), kGradTol);
  EXPECT_LE(RelativeL2(dk, ref.dk), kGradTol);
  EXPECT_LE(RelativeL2(dv, ref.dv), kGradTol);
}

// Megatron's load-balanced causal split for cp = 2: the sequence in 2·cp = 4
// chunks, rank 0 holding chunks 0 and 3, rank 1 chunks 1 and 2. Each rank
// runs its queries against every rank's keys through the offsets. Rank 0's
// chunks are not adjacent, so its queries and keys are two blocks of 4; rank
// 1's are adjacent and go as one block of 8 (q_len ≠ k_len).
TEST_F(BlockAttentionTest, LoadBalancedContextParallelSplitMatchesFullAttention) {
  const Problem p = RandomProblem(/*batch=*/2, /*seq=*/16, /*heads=*/4, /*hd=*/8);
  const std::vector<Span> rank0 = {{0, 4}, {12, 4}};  // chunks 0 and 3
  const std::vector<Span> rank1 = {{4, 8}};           // chunks 1 and 2
  // Every rank's queries meet every rank's key blocks (the ring's full turn).
  std::vector<Span> blocks = rank0;
  blocks.insert(blocks.end(), rank1.begin(), rank1.end());
  ExpectSplitMatchesFull(p, /*q_blocks=*/blocks, /*k_blocks=*/blocks);
}

// Blocks of different lengths at offsets that cut through the diagonal, so
// that some rows of a partly visible block see none of its keys (queries 0–1
// against keys 2–8), and queries and keys split differently.
TEST_F(BlockAttentionTest, UnevenBlocksMatchFullAttention) {
  const Problem p = RandomProblem(/*batch=*/2, /*seq=*/13, /*heads=*/2, /*hd=*/4);
  ExpectSplitMatchesFull(p, {{0, 5}, {5, 3}, {8, 5}}, {{0, 2}, {2, 7}, {9, 1}, {10, 3}});
  ExpectSplitMatchesFull(p, {{0, 13}}, {{0, 1}, {1, 12}});
  ExpectSplitMatchesFull(p, {{0, 1}, {1, 12}}, {{0, 13}});
}

TEST_F(BlockAttentionTest, FutureBlockIsEmptyAndMergingItChangesNothing) {
  const Problem p = RandomProblem(/*batch=*/2, /*seq=*/8, /*heads=*/2, /*hd=*/4);
  const Span qs{0, 4};
  const State future = BlockForward(p, qs, {4, 4});
  for (float o : future.out) {
    EXPECT_EQ(o, 0.0f);
    EXPECT_FALSE(std::signbit(o));
  }
  for (float l : future.lse) EXPECT_EQ(l, kNegInf);

  State state = BlockForward(p, qs, {0, 4});
  const State before = state;
  Merge(state, future, p, qs.len);
  EXPECT_TRUE(SameBits(state.out, before.out));
  EXPECT_TRUE(SameBits(state.lse, before.lse));

  // Its backward adds nothing either: prefilled gradients keep their bits.
  Vec dq = p.q, dk = p.k, dv = p.v;
  BlockBackward(p, qs, {{4, 4}}, state, dq, dk, dv);
  EXPECT_TRUE(SameBits(dq, p.q));
  EXPECT_TRUE(SameBits(dk, p.k));
  EXPECT_TRUE(SameBits(dv, p.v));
}

TEST_F(BlockAttentionTest, RowsThatSeeNoKeyOfAPartlyVisibleBlockAreEmpty) {
  const Problem p = RandomProblem(/*batch=*/1, /*seq=*/6, /*heads=*/2, /*hd=*/4);
  const Span qs{0, 4};
  // Keys 2–5: rows 0 and 1 see none, rows 2 and 3 see keys 2.. their own.
  const State block = BlockForward(p, qs, {2, 4});
  for (int64_t h = 0; h < p.heads; ++h) {
    for (int64_t i = 0; i < qs.len; ++i) {
      const float l = block.lse[h * qs.len + i];
      if (i < 2) {
        EXPECT_EQ(l, kNegInf) << "row " << i;
        for (int64_t c = 0; c < 4; ++c) EXPECT_EQ(block.out[i * p.channels + h * 4 + c], 0.0f);
      } else {
        EXPECT_TRUE(std::isfinite(l)) << "row " << i;
      }
    }
  }
}

TEST_F(BlockAttentionTest, MergingEmptyStatesGivesNoNaN) {
  const Problem p = RandomProblem(/*batch=*/2, /*seq=*/4, /*heads=*/2, /*hd=*/4);
  const Span qs{0, 4};
  State state = EmptyState(p, qs);
  Merge(state, EmptyState(p, qs), p, qs.len);
  for (float o : state.out) EXPECT_EQ(o, 0.0f);
  for (float l : state.lse) EXPECT_EQ(l, kNegInf);

  // An empty state takes the first real block as it is.
  const State block = BlockForward(p, qs, {0, 4});
  Merge(state, block, p, qs.len);
  EXPECT_TRUE(SameBits(state.out, block.out));
  EXPECT_TRUE(SameBits(state.lse, block.lse));
  for (float l : state.lse) EXPECT_TRUE(std::isfinite(l));
}

TEST_F(BlockAttentionTest, MergeWeighsBlocksByTheirMass) {
  // Two one-row, one-head blocks with lse log 1 and log 3: weights ¼ and ¾.
  Vec out = {1.0f, 2.0f}, lse = {0.0f};
  const Vec block_out = {5.0f, -2.0f}, block_lse = {std::log(3.0f)};
  MergeAttentionBlock(out.data(), lse.data(), block_out.data(), block_lse.data(), 1, 1, 2, 1);
  EXPECT_NEAR(out[0], 0.25 * 1 + 0.75 * 5, 1e-6);
  EXPECT_NEAR(out[1], 0.25 * 2 - 0.75 * 2, 1e-6);
  EXPECT_NEAR(lse[0], std::log(4.0), 1e-6);

  // Far-apart lse values stay finite: the smaller side's weight underflows
  // to 0 instead of overflowing the larger side's.
  out = {1.0f, 1.0f};
  lse = {-200.0f};
  const Vec big_lse = {200.0f};
  MergeAttentionBlock(out.data(), lse.data(), block_out.data(), big_lse.data(), 1, 1, 2, 1);
  EXPECT_EQ(out[0], 5.0f);
  EXPECT_EQ(out[1], -2.0f);
  EXPECT_EQ(lse[0], 200.0f);
}

TEST_F(BlockAttentionTest, RunningTwiceGivesIdenticalBits) {
  const Problem p = RandomProblem(/*batch=*/2, /*seq=*/16, /*heads=*/4, /*hd=*/8);
  const std::vector<Span> q_blocks = {{0, 4}, {12, 4}, {4, 8}};
  const std::vector<Span> k_blocks = {{4, 8}, {0, 4}, {12, 4}};
  auto run = [&] {
    std::vector<Vec> results;
    Vec dq(p.q.size(), 0.0f), dk(dq.size(), 0.0f), dv(dq.size(), 0.0f);
    for (Span qs : q_blocks) {
      const State state = MergedForward(p, qs, k_blocks);
      results.push_back(state.out);
      results.push_back(state.lse);
      BlockBackward(p, qs, k_blocks, state, dq, dk, dv);
    }
    results.push_back(dq);
    results.push_back(dk);
    results.push_back(dv);
    return results;
  };
  const std::vector<Vec> first = run(), second = run();
  ASSERT_EQ(first.size(), second.size());
  for (size_t i = 0; i < first.size(); ++i) EXPECT_TRUE(SameBits(first[i], second[i])) << i;
}

// q as the first C columns of packed [B,Tq,3C] rows and k, v as the two
// halves of [B,Tk,2C] rows (the strided forms) give the bits of contiguous
// copies, forward and backward; the columns around the slices are untouched.
TEST_F(BlockAttentionTest, StridedColumnSlicesGiveTheContiguousBits) {
  const Problem p = RandomProblem(/*batch=*/2, /*seq=*/12, /*heads=*/2, /*hd=*/4);
  const int64_t c = p.channels;
  const Span qs{4, 8}, ks{0, 8};
  const Vec q = Rows(p.q, p, qs), k = Rows(p.k, p, ks), v = Rows(p.v, p, ks);
  const Vec dout = Rows(p.dout, p, qs);
  const int64_t nq = p.batch * qs.len, nk = p.batch * ks.len;
  // Packed copies, the columns the kernel must not touch filled with 7.
  Vec qkv(nq * 3 * c, 7.0f), kv(nk * 2 * c, 7.0f);
  for (int64_t r = 0; r < nq; ++r) std::memcpy(&qkv[r * 3 * c], &q[r * c], c * sizeof(float));
  for (int64_t r = 0; r < nk; ++r) {
    std::memcpy(&kv[r * 2 * c], &k[r * c], c * sizeof(float));
    std::memcpy(&kv[r * 2 * c + c], &v[r * c], c * sizeof(float));
  }
  const BlockAttentionStrides strides{3 * c, 2 * c};

  State contiguous = EmptyState(p, qs), strided = EmptyState(p, qs);
  Vec scratch(2 * qs.len * ks.len);
  BlockAttentionForward(contiguous.out.data(), contiguous.lse.data(), q.data(), k.data(),
                        v.data(), p.batch, qs.len, ks.len, c, p.heads, qs.start, ks.start,
                        scratch.data());
  BlockAttentionForward(strided.out.data(), strided.lse.data(), qkv.data(), kv.data(),
                        kv.data() + c, p.batch, qs.len, ks.len, c, p.heads, qs.start, ks.start,
                        scratch.data(), strides);
  EXPECT_TRUE(SameBits(strided.out, contiguous.out));
  EXPECT_TRUE(SameBits(strided.lse, contiguous.lse));

  Vec delta(p.batch * p.heads * qs.len);
  AttentionDelta(delta.data(), dout.data(), contiguous.out.data(), p.batch, qs.len, c, p.heads);
  // Gradients start from nonzero values: both forms accumulate.
  Vec dq = q, dk = k, dv = v;
  Vec dqkv = qkv, dkv = kv;
  BlockAttentionBackward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(),
                         v.data(), contiguous.lse.data(), delta.data(), p.batch, qs.len, ks.len, c,
                         p.heads, qs.start, ks.start, scratch.data());
  BlockAttentionBackward(dqkv.data(), dkv.data(), dkv.data() + c, dout.data(), qkv.data(),
                         kv.data(), kv.data() + c, contiguous.lse.data(), delta.data(), p.batch,
                         qs.len, ks.len, c, p.heads, qs.start, ks.start, scratch.data(), strides);
  Vec dq_s(nq * c), dk_s(nk * c), dv_s(nk * c);
  for (int64_t r = 0; r < nq; ++r) {
    std::memcpy(&dq_s[r * c], &dqkv[r * 3 * c], c * sizeof(float));
    for (int64_t j = c; j < 3 * c; ++j) EXPECT_EQ(dqkv[r * 3 * c + j], 7.0f);
  }
  for (int64_t r = 0; r < nk; ++r) {
    std::memcpy(&dk_s[r * c], &dkv[r * 2 * c], c * sizeof(float));
    std::memcpy(&dv_s[r * c], &dkv[r * 2 * c + c], c * sizeof(float));
  }
  EXPECT_FALSE(SameBits(dq, q));  // the block is visible: something was added
  EXPECT_TRUE(SameBits(dq_s, dq));
  EXPECT_TRUE(SameBits(dk_s, dk));
  EXPECT_TRUE(SameBits(dv_s, dv));
}

}  // namespace
}  // namespace baton::kernels::cpu
