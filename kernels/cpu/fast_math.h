// Branch-free exp and tanh for the elementwise CPU kernels, written so that
// GCC vectorizes the loops that call them (libm's scalar expf/tanhf do not
// vectorize and dominated the step time).
//
//   FastExp: Cephes' expf — x = n·ln2 + r, |r| ≤ ½ln2, e^r by a degree-6
//            polynomial, 2ⁿ built in the exponent bits; relative error
//            below 3e-7 on [-87, 88], inputs clamped to that range.
//   FastTanh: 1 − 2 / (e^{2u} + 1) with u clamped to ±9; absolute error
//            below 3e-7 (tanh is ±1 in float beyond 9).
//
// BATON_ELEMENTWISE marks a kernel whose loops should be compiled for both
// baseline x86-64 and AVX2, chosen when the program loads. Kernels are built
// with -ffp-contract=off (kernels/cpu/BUILD), so both versions do the same
// IEEE operations on each element and give the same bits; reductions stay in
// sequential order either way.
#ifndef BATON_KERNELS_CPU_FAST_MATH_H_
#define BATON_KERNELS_CPU_FAST_MATH_H_

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define BATON_ELEMENTWISE __attribute__((target_clones("avx2", "default")))
#else
#define BATON_ELEMENTWISE
#endif

namespace baton::kernels::cpu {

inline float FastExp(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  // n = round(x / ln2) via truncation of a biased value, corrected to floor.
  const float fx = x * 1.44269504088896341f + 0.5f;
  float n = static_cast<float>(static_cast<int32_t>(fx));
  n = n > fx ? n - 1.0f : n;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline float FastTanh(float u) {
  u = u < -9.0f ? -9.0f : u;
  u = u > 9.0f ? 9.0f : u;
  return 1.0f - 2.0f / (FastExp(2.0f * u) + 1.0f);
}

}  // namespace baton::kernels::cpu

#endif  // BATON_KERNELS_CPU_FAST_MATH_H_
