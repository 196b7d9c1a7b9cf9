#include "kernels/cpu/rope.h"

#include <math.h>

#include <cmath>
#include <cstring>

namespace baton::kernels::cpu {
namespace {

// out = x rotated by the angles whose cos and sin are c and s (half wide).
void Rotate(float* out, const float* x, const float* c, const float* s, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    out[i] = x1 * c[i] - x2 * s[i];
    out[i + half] = x2 * c[i] + x1 * s[i];
  }
}

// out = g rotated back (by the negated angles).
void RotateBack(float* out, const float* g, const float* c, const float* s, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float g1 = g[i], g2 = g[i + half];
    out[i] = g1 * c[i] + g2 * s[i];
    out[i + half] = g2 * c[i] - g1 * s[i];
  }
}

}  // namespace

void RopeTable(std::vector<float>& cos, std::vector<float>& sin, int64_t seq, int64_t head_dim,
               float theta, int64_t position_offset) {
  const int64_t half = head_dim / 2;
  std::vector<float> inv_freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    inv_freq[i] = 1.0f / powf(theta, exponent);
  }
  cos.resize(static_cast<size_t>(seq * half));
  sin.resize(static_cast<size_t>(seq * half));
  for (int64_t t = 0; t < seq; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const float angle = static_cast<float>(position_offset + t) * inv_freq[i];
      cos[t * half + i] = static_cast<float>(std::cos(static_cast<double>(angle)));
      sin[t * half + i] = static_cast<float>(std::sin(static_cast<double>(angle)));
    }
  }
}

void RopePackForward(float* qkv, const float* q, const float* k, const float* v, int64_t batch,
                     int64_t seq, int64_t heads, int64_t kv_heads, int64_t head_dim, float theta,
                     int64_t position_offset) {
  std::vector<float> cos, sin;
  RopeTable(cos, sin, seq, head_dim, theta, position_offset);
  const int64_t half = head_dim / 2, group = heads / kv_heads;
  const int64_t qc = heads * head_dim, kvc = kv_heads * head_dim;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t < seq; ++t) {
      const int64_t row = b * seq + t;
      const float* c = cos.data() + t * half;
      const float* s = sin.data() + t * half;
      float* out = qkv + row * 3 * qc;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t kvh = h / group;
        Rotate(out + h * head_dim, q + row * qc + h * head_dim, c, s, half);
        Rotate(out + qc + h * head_dim, k + row * kvc + kvh * head_dim, c, s, half);
        std::memcpy(out + 2 * qc + h * head_dim, v + row * kvc + kvh * head_dim,
                    sizeof(float) * head_dim);
      }
    }
  }
}

void RopePackBackward(float* dq, float* dk, float* dv, const float* dqkv, int64_t batch,
                      int64_t seq, int64_t heads, int64_t kv_heads, int64_t head_dim, float theta,
                      int64_t position_offset) {
  std::vector<float> cos, sin;
  RopeTable(cos, sin, seq, head_dim, theta, position_offset);
  const int64_t half = head_dim / 2, group = heads / kv_heads;
  const int64_t qc = heads * head_dim, kvc = kv_heads * head_dim;
  std::vector<float> dk_sum(static_cast<size_t>(head_dim));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t < seq; ++t) {
      const int64_t row = b * seq + t;
      const float* c = cos.data() + t * half;
      const float* s = sin.data() + t * half;
      const float* g = dqkv + row * 3 * qc;
      for (int64_t h = 0; h < heads; ++h) {
        RotateBack(dq + row * qc + h * head_dim, g + h * head_dim, c, s, half);
      }
      for (int64_t j = 0; j < kv_heads; ++j) {
        float* dv_head = dv + row * kvc + j * head_dim;
        const float* gk = g + qc + j * group * head_dim;
        const float* gv = g + 2 * qc + j * group * head_dim;
        std::memcpy(dk_sum.data(), gk, sizeof(float) * head_dim);
        std::memcpy(dv_head, gv, sizeof(float) * head_dim);
        for (int64_t m = 1; m < group; ++m) {
          for (int64_t d = 0; d < head_dim; ++d) {
            dk_sum[d] += gk[m * head_dim + d];
            dv_head[d] += gv[m * head_dim + d];
          }
        }
        RotateBack(dk + row * kvc + j * head_dim, dk_sum.data(), c, s, half);
      }
    }
  }
}

}  // namespace baton::kernels::cpu
