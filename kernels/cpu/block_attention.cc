#include "kernels/cpu/block_attention.h"

#include <cmath>
#include <limits>

#include "kernels/cpu/fast_math.h"
#include "kernels/cpu/gemm.h"

namespace baton::kernels::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// How many keys of the block query row i sees: the visible keys are the
// prefix j < VisibleKeys(i), since k_offset + j ≤ q_offset + i. Nondecreasing
// in i.
int64_t VisibleKeys(int64_t i, int64_t q_offset, int64_t k_offset, int64_t k_len) {
  const int64_t n = q_offset + i - k_offset + 1;
  return n < 0 ? 0 : (n > k_len ? k_len : n);
}

// row[0, valid) = exp(row[j] − max), row[valid, n) = 0; returns the sum of
// the exponentials, taken in index order.
BATON_ELEMENTWISE float ExpPrefix(float* row, int64_t valid, int64_t n, float max) {
  for (int64_t j = 0; j < valid; ++j) row[j] = FastExp(row[j] - max);
  float sum = 0.0f;
  for (int64_t j = 0; j < valid; ++j) sum += row[j];
  for (int64_t j = valid; j < n; ++j) row[j] = 0.0f;
  return sum;
}

BATON_ELEMENTWISE void ScalePrefix(float* row, int64_t valid, float factor) {
  for (int64_t j = 0; j < valid; ++j) row[j] *= factor;
}

// Backward, one row: p[j] = exp(s[j] − lse) and ds[j] = p[j]·(dp[j] − δ)·scale
// on the visible prefix, both 0 beyond it. `p` holds s on entry, `ds` holds
// dp = do vᵀ.
BATON_ELEMENTWISE void BackwardRow(float* p, float* ds, int64_t valid, int64_t n, float lse,
                                   float delta, float scale) {
  for (int64_t j = 0; j < valid; ++j) p[j] = FastExp(p[j] - lse);
  for (int64_t j = 0; j < valid; ++j) ds[j] = p[j] * (ds[j] - delta) * scale;
  for (int64_t j = valid; j < n; ++j) p[j] = 0.0f;
  for (int64_t j = valid; j < n; ++j) ds[j] = 0.0f;
}

}  // namespace

void BlockAttentionForward(float* out, float* lse, const float* q, const float* k, const float* v,
                           int64_t batch, int64_t q_len, int64_t k_len, int64_t channels,
                           int64_t heads, int64_t q_offset, int64_t k_offset, float* scratch) {
  BlockAttentionForward(out, lse, q, k, v, batch, q_len, k_len, channels, heads, q_offset, k_offset,
                        scratch, BlockAttentionStrides{channels, channels});
}

void BlockAttentionForward(float* out, float* lse, const float* q, const float* k, const float* v,
                           int64_t batch, int64_t q_len, int64_t k_len, int64_t channels,
                           int64_t heads, int64_t q_offset, int64_t k_offset, float* scratch,
                           BlockAttentionStrides strides) {
  const int64_t qs = strides.q, ks = strides.kv;
  const int64_t hd = channels / heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  // Rows [0, first) see no key of the block (all rows when first == q_len).
  int64_t first = 0;
  while (first < q_len && VisibleKeys(first, q_offset, k_offset, k_len) == 0) ++first;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      const float* qh = q + b * q_len * qs + h * hd;
      const float* kh = k + b * k_len * ks + h * hd;
      const float* vh = v + b * k_len * ks + h * hd;
      float* oh = out + b * q_len * channels + h * hd;
      float* lh = lse + (b * heads + h) * q_len;
      if (first < q_len) {
        float* p = scratch;
        Gemm(false, true, q_len, k_len, hd, scale, qh, qs, kh, ks, 0.0f, p, k_len);
        for (int64_t i = 0; i < q_len; ++i) {
          float* row = p + i * k_len;
          const int64_t valid = VisibleKeys(i, q_offset, k_offset, k_len);
          if (valid == 0) {
            for (int64_t j = 0; j < k_len; ++j) row[j] = 0.0f;
            lh[i] = kNegInf;
            continue;
          }
          float max = row[0];
          for (int64_t j = 1; j < valid; ++j) max = row[j] > max ? row[j] : max;
          // Every exponent is ≤ 0 and the max's is 0, so 1 ≤ sum ≤ valid.
          const float sum = ExpPrefix(row, valid, k_len, max);
          ScalePrefix(row, valid, 1.0f / sum);
          lh[i] = max + std::log(sum);
        }
        Gemm(false, false, q_len, hd, k_len, 1.0f, p, k_len, vh, ks, 0.0f, oh, channels);
      }
      // Rows that see nothing: out = +0 exactly (a Gemm over a zero row of P
      // can give −0), lse = −∞.
      for (int64_t i = 0; i < first; ++i) {
        for (int64_t c = 0; c < hd; ++c) oh[i * channels + c] = 0.0f;
        lh[i] = kNegInf;
      }
    }
  }
}

void MergeAttentionBlock(float* out, float* lse, const float* block_out, const float* block_lse,
                         int64_t batch, int64_t q_len, int64_t channels, int64_t heads) {
  const int64_t hd = channels / heads;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t i = 0; i < q_len; ++i) {
        const int64_t row = (b * heads + h) * q_len + i;
        float* o = out + (b * q_len + i) * channels + h * hd;
        const float* bo = block_out + (b * q_len + i) * channels + h * hd;
        const float a = lse[row];
        const float c = block_lse[row];
        // A side with lse = −∞ has no keys. The formula below would give it
        // weight 0, but with both sides −∞ it computes −∞ − (−∞) = NaN; the
        // guards skip that, and let the other side through bit for bit.
        if (c == kNegInf) continue;
        if (a == kNegInf) {
          for (int64_t d = 0; d < hd; ++d) o[d] = bo[d];
          lse[row] = c;
          continue;
        }
        // logaddexp(a, c) = max + log1p(e^{−|a−c|}); both weights are ≤ 1
        // and they sum to 1 (up to rounding).
        const float hi = a > c ? a : c;
        const float lo = a > c ? c : a;
        const float merged = hi + std::log1p(std::exp(lo - hi));
        const float wa = std::exp(a - merged);
        const float wc = std::exp(c - merged);
        for (int64_t d = 0; d < hd; ++d) o[d] = o[d] * wa + bo[d] * wc;
        lse[row] = merged;
      }
    }
  }
}

void AttentionDelta(float* delta, const float* dout, const float* out, int64_t batch,
                    int64_t q_len, int64_t channels, int64_t heads) {
  const int64_t hd = channels / heads;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t i = 0; i < q_len; ++i) {
        const float* d_o = dout + (b * q_len + i) * channels + h * hd;
        const float* o = out + (b * q_len + i) * channels + h * hd;
        float sum = 0.0f;
        for (int64_t d = 0; d < hd; ++d) sum += d_o[d] * o[d];
        delta[(b * heads + h) * q_len + i] = sum;
      }
    }
  }
}

void BlockAttentionBackward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                            const float* k, const float* v, const float* lse, const float* delta,
                            int64_t batch, int64_t q_len, int64_t k_len, int64_t channels,
                            int64_t heads, int64_t q_offset, int64_t k_offset, float* scratch) {
  BlockAttentionBackward(dq, dk, dv, dout, q, k, v, lse, delta, batch, q_len, k_len, channels,
                         heads, q_offset, k_offset, scratch,
                         BlockAttentionStrides{channels, channels});
}

void BlockAttentionBackward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                            const float* k, const float* v, const float* lse, const float* delta,
                            int64_t batch, int64_t q_len, int64_t k_len, int64_t channels,
                            int64_t heads, int64_t q_offset, int64_t k_offset, float* scratch,
                            BlockAttentionStrides strides) {
  const int64_t qs = strides.q, ks = strides.kv;
  // The last query row sees the most keys; if it sees none, no row does.
  if (q_len == 0 || VisibleKeys(q_len - 1, q_offset, k_offset, k_len) == 0) return;
  const int64_t hd = channels / heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  float* p = scratch;
  float* ds = scratch + q_len * k_len;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t qo = b * q_len * qs + h * hd;  // q, dq
      const int64_t oo = b * q_len * channels + h * hd;  // dout
      const int64_t ko = b * k_len * ks + h * hd;  // k, v, dk, dv
      const float* lh = lse + (b * heads + h) * q_len;
      const float* dh = delta + (b * heads + h) * q_len;
      // p = S = q kᵀ / √hd, ds = dP = do vᵀ; then both row by row.
      Gemm(false, true, q_len, k_len, hd, scale, q + qo, qs, k + ko, ks, 0.0f, p, k_len);
      Gemm(false, true, q_len, k_len, hd, 1.0f, dout + oo, channels, v + ko, ks, 0.0f, ds, k_len);
      for (int64_t i = 0; i < q_len; ++i) {
        BackwardRow(p + i * k_len, ds + i * k_len, VisibleKeys(i, q_offset, k_offset, k_len),
                    k_len, lh[i], dh[i], scale);
      }
      Gemm(true, false, k_len, hd, q_len, 1.0f, p, k_len, dout + oo, channels, 1.0f, dv + ko, ks);
      Gemm(false, false, q_len, hd, k_len, 1.0f, ds, k_len, k + ko, ks, 1.0f, dq + qo, qs);
      Gemm(true, false, k_len, hd, q_len, 1.0f, ds, k_len, q + qo, qs, 1.0f, dk + ko, ks);
    }
  }
}

}  // namespace baton::kernels::cpu
