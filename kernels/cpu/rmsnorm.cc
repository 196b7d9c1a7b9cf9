#include "kernels/cpu/rmsnorm.h"

#include <cmath>

namespace baton::kernels::cpu {

void RmsNormForward(float* out, float* rstd, const float* inp, const float* weight, int64_t rows,
                    int64_t channels, float eps) {
  for (int64_t n = 0; n < rows; ++n) {
    const float* x = inp + n * channels;
    float* y = out + n * channels;
    double sum = 0.0;
    for (int64_t c = 0; c < channels; ++c) sum += static_cast<double>(x[c]) * x[c];
    const float mean_square = static_cast<float>(sum / static_cast<double>(channels));
    const float s = 1.0f / std::sqrt(mean_square + eps);
    for (int64_t c = 0; c < channels; ++c) y[c] = (x[c] * s) * weight[c];
    rstd[n] = s;
  }
}

void RmsNormBackward(float* dinp, float* dweight, const float* dout, const float* inp,
                     const float* weight, const float* rstd, int64_t rows, int64_t channels) {
  for (int64_t n = 0; n < rows; ++n) {
    const float* x = inp + n * channels;
    const float* dy = dout + n * channels;
    float* dx = dinp + n * channels;
    const float s = rstd[n];
    double gx_sum = 0.0;
    for (int64_t c = 0; c < channels; ++c) {
      const float xhat = x[c] * s;
      const float g = dy[c] * weight[c];
      gx_sum += static_cast<double>(g * xhat);
    }
    const float gx_mean = static_cast<float>(gx_sum / static_cast<double>(channels));
    for (int64_t c = 0; c < channels; ++c) {
      const float xhat = x[c] * s;
      const float g = dy[c] * weight[c];
      dx[c] += s * (g - xhat * gx_mean);
      dweight[c] += dy[c] * xhat;
    }
  }
}

}  // namespace baton::kernels::cpu
