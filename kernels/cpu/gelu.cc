#include "kernels/cpu/gelu.h"

#include "kernels/cpu/fast_math.h"

namespace baton::kernels::cpu {
namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kCubic = 0.044715f;

}  // namespace

BATON_ELEMENTWISE void GeluForward(float* out, const float* inp, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = inp[i];
    const float u = kSqrt2OverPi * (x + kCubic * x * x * x);
    out[i] = 0.5f * x * (1.0f + FastTanh(u));
  }
}

BATON_ELEMENTWISE void GeluBackward(float* dinp, const float* inp, const float* dout, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = inp[i];
    const float u = kSqrt2OverPi * (x + kCubic * x * x * x);
    const float th = FastTanh(u);
    const float du = kSqrt2OverPi * (1.0f + 3.0f * kCubic * x * x);
    dinp[i] = dout[i] * (0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * du);
  }
}

}  // namespace baton::kernels::cpu
