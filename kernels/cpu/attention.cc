#include "kernels/cpu/attention.h"

#include <cmath>

#include "kernels/bfloat16.h"
#include "kernels/cpu/fast_math.h"
#include "kernels/cpu/gemm.h"

namespace baton::kernels::cpu {
namespace {

// row[0, valid) = softmax(row[0, valid)) given its maximum; row[valid, n) = 0.
// Exponentials in a vectorizable loop, then the sum in index order.
BATON_ELEMENTWISE void SoftmaxPrefix(float* row, int64_t valid, int64_t n, float max) {
  for (int64_t j = 0; j < valid; ++j) row[j] = FastExp(row[j] - max);
  float sum = 0.0f;
  for (int64_t j = 0; j < valid; ++j) sum += row[j];
  const float inv = 1.0f / sum;
  for (int64_t j = 0; j < valid; ++j) row[j] *= inv;
  for (int64_t j = valid; j < n; ++j) row[j] = 0.0f;
}

void RoundRowToBf16(float* row, int64_t n) {
  for (int64_t j = 0; j < n; ++j) row[j] = RoundToBf16(row[j]);
}

template <bool kBf16>
void Forward(float* out, float* att, const float* qkv, int64_t batch, int64_t seq,
             int64_t channels, int64_t heads) {
  const int64_t hd = channels / heads;
  const int64_t ld = 3 * channels;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      const float* q = qkv + b * seq * ld + h * hd;
      const float* k = q + channels;
      const float* v = q + 2 * channels;
      float* p = att + (b * heads + h) * seq * seq;
      Gemm(false, true, seq, seq, hd, scale, q, ld, k, ld, 0.0f, p, seq);
      for (int64_t i = 0; i < seq; ++i) {
        float* row = p + i * seq;
        float max = row[0];
        for (int64_t j = 1; j <= i; ++j) max = row[j] > max ? row[j] : max;
        SoftmaxPrefix(row, i + 1, seq, max);
        if constexpr (kBf16) RoundRowToBf16(row, i + 1);
      }
      Gemm(false, false, seq, hd, seq, 1.0f, p, seq, v, ld, 0.0f, out + b * seq * channels + h * hd,
           channels);
    }
  }
}

template <bool kBf16>
void Backward(float* dqkv, float* scratch, const float* dout, const float* qkv, const float* att,
              int64_t batch, int64_t seq, int64_t channels, int64_t heads) {
  const int64_t hd = channels / heads;
  const int64_t ld = 3 * channels;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      const float* q = qkv + b * seq * ld + h * hd;
      const float* k = q + channels;
      const float* v = q + 2 * channels;
      float* dq = dqkv + b * seq * ld + h * hd;
      float* dk = dq + channels;
      float* dv = dq + 2 * channels;
      const float* p = att + (b * heads + h) * seq * seq;
      const float* d_o = dout + b * seq * channels + h * hd;
      float* ds = scratch;
      Gemm(false, true, seq, seq, hd, 1.0f, d_o, channels, v, ld, 0.0f, ds, seq);
      Gemm(true, false, seq, hd, seq, 1.0f, p, seq, d_o, channels, 0.0f, dv, ld);
      for (int64_t i = 0; i < seq; ++i) {
        const float* prow = p + i * seq;
        float* drow = ds + i * seq;
        float dot = 0.0f;
        for (int64_t j = 0; j <= i; ++j) dot += prow[j] * drow[j];
        for (int64_t j = 0; j <= i; ++j) drow[j] = prow[j] * (drow[j] - dot) * scale;
        for (int64_t j = i + 1; j < seq; ++j) drow[j] = 0.0f;
        if constexpr (kBf16) RoundRowToBf16(drow, i + 1);
      }
      Gemm(false, false, seq, hd, seq, 1.0f, ds, seq, k, ld, 0.0f, dq, ld);
      Gemm(true, false, seq, hd, seq, 1.0f, ds, seq, q, ld, 0.0f, dk, ld);
    }
  }
}

}  // namespace

void AttentionForward(float* out, float* att, const float* qkv, int64_t batch, int64_t seq,
                      int64_t channels, int64_t heads) {
  Forward<false>(out, att, qkv, batch, seq, channels, heads);
}

void AttentionBackward(float* dqkv, float* scratch, const float* dout, const float* qkv,
                       const float* att, int64_t batch, int64_t seq, int64_t channels,
                       int64_t heads) {
  Backward<false>(dqkv, scratch, dout, qkv, att, batch, seq, channels, heads);
}

void AttentionForwardBf16Rounded(float* out, float* att, const float* qkv, int64_t batch,
                                 int64_t seq, int64_t channels, int64_t heads) {
  Forward<true>(out, att, qkv, batch, seq, channels, heads);
}

void AttentionBackwardBf16Rounded(float* dqkv, float* scratch, const float* dout,
                                  const float* qkv, const float* att, int64_t batch, int64_t seq,
                                  int64_t channels, int64_t heads) {
  Backward<true>(dqkv, scratch, dout, qkv, att, batch, seq, channels, heads);
}

}  // namespace baton::kernels::cpu
