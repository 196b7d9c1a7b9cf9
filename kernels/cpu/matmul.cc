#include "kernels/cpu/matmul.h"

#include <cstring>

#include "kernels/cpu/gemm.h"

namespace baton::kernels::cpu {

void MatmulForward(float* out, const float* inp, const float* weight, const float* bias,
                   int64_t rows, int64_t in_features, int64_t out_features) {
  if (bias != nullptr) {
    for (int64_t n = 0; n < rows; ++n) {
      std::memcpy(out + n * out_features, bias, sizeof(float) * out_features);
    }
  }
  Gemm(false, true, rows, out_features, in_features, 1.0f, inp, in_features, weight, in_features,
       bias != nullptr ? 1.0f : 0.0f, out, out_features);
}

void MatmulBackwardInput(float* dinp, const float* dout, const float* weight, int64_t rows,
                         int64_t in_features, int64_t out_features, bool accumulate) {
  Gemm(false, false, rows, in_features, out_features, 1.0f, dout, out_features, weight, in_features,
       accumulate ? 1.0f : 0.0f, dinp, in_features);
}

void MatmulBackwardWeight(float* dweight, const float* dout, const float* inp, int64_t rows,
                          int64_t in_features, int64_t out_features) {
  Gemm(true, false, out_features, in_features, rows, 1.0f, dout, out_features, inp, in_features,
       1.0f, dweight, in_features);
}

void AddBias(float* out, const float* bias, int64_t rows, int64_t out_features) {
  for (int64_t n = 0; n < rows; ++n) {
    float* o = out + n * out_features;
    for (int64_t j = 0; j < out_features; ++j) o[j] += bias[j];
  }
}

void BiasBackward(float* dbias, const float* dout, int64_t rows, int64_t out_features) {
  for (int64_t n = 0; n < rows; ++n) {
    const float* d = dout + n * out_features;
    for (int64_t o = 0; o < out_features; ++o) dbias[o] += d[o];
  }
}

}  // namespace baton::kernels::cpu
