// bfloat16 rounding, the one definition shared by the CPU reference kernels
// (kernels/cpu_backend.cc), the CUDA host code and tests (kernels/cuda/plan.h
// re-exports it) and the model:
//
//   FloatToBf16Bits(x)  the top 16 bits of x rounded to nearest, ties to even
//                       (the rounding of CUDA's __float2bfloat16_rn); a NaN
//                       stays a quiet NaN, values past the bf16 range round
//                       to ±inf.
//   Bf16BitsToFloat(b)  back to float32 (exact: every bf16 is a float32).
//   RoundToBf16(x)      Bf16BitsToFloat(FloatToBf16Bits(x)).
#ifndef BATON_KERNELS_BFLOAT16_H_
#define BATON_KERNELS_BFLOAT16_H_

#include <cstdint>
#include <cstring>

namespace baton::kernels {

inline uint16_t FloatToBf16Bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  const uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding) >> 16);
}

inline float Bf16BitsToFloat(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

inline float RoundToBf16(float x) { return Bf16BitsToFloat(FloatToBf16Bits(x)); }

}  // namespace baton::kernels

#endif  // BATON_KERNELS_BFLOAT16_H_
