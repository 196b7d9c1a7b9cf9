#include "kernels/cpu/layernorm.h"

#include <cmath>

namespace baton::kernels::cpu {

void LayerNormForward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                      const float* bias, int64_t rows, int64_t channels) {
  const float inv_c = 1.0f / static_cast<float>(channels);
  for (int64_t n = 0; n < rows; ++n) {
    const float* x = inp + n * channels;
    float* y = out + n * channels;
    float sum = 0.0f;
    for (int64_t c = 0; c < channels; ++c) sum += x[c];
    const float m = sum * inv_c;
    float var = 0.0f;
    for (int64_t c = 0; c < channels; ++c) {
      const float d = x[c] - m;
      var += d * d;
    }
    const float s = 1.0f / std::sqrt(var * inv_c + kLayerNormEps);
    for (int64_t c = 0; c < channels; ++c) y[c] = (x[c] - m) * s * weight[c] + bias[c];
    mean[n] = m;
    rstd[n] = s;
  }
}

void LayerNormBackward(float* dinp, float* dweight, float* dbias, const float* dout,
                       const float* inp, const float* weight, const float* mean, const float* rstd,
                       int64_t rows, int64_t channels) {
  const float inv_c = 1.0f / static_cast<float>(channels);
  for (int64_t n = 0; n < rows; ++n) {
    const float* x = inp + n * channels;
    const float* dy = dout + n * channels;
    float* dx = dinp + n * channels;
    const float m = mean[n];
    const float s = rstd[n];
    float g_mean = 0.0f;
    float gx_mean = 0.0f;
    for (int64_t c = 0; c < channels; ++c) {
      const float xhat = (x[c] - m) * s;
      const float g = dy[c] * weight[c];
      g_mean += g;
      gx_mean += g * xhat;
    }
    g_mean *= inv_c;
    gx_mean *= inv_c;
    for (int64_t c = 0; c < channels; ++c) {
      const float xhat = (x[c] - m) * s;
      const float g = dy[c] * weight[c];
      dx[c] += s * (g - g_mean - xhat * gx_mean);
      dweight[c] += dy[c] * xhat;
      dbias[c] += dy[c];
    }
  }
}

}  // namespace baton::kernels::cpu
