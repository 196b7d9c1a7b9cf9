#include "kernels/cpu/embedding.h"

namespace baton::kernels::cpu {

void EmbeddingForward(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                      int64_t batch, int64_t seq, int64_t channels) {
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t < seq; ++t) {
      float* o = out + (b * seq + t) * channels;
      const float* w = wte + static_cast<int64_t>(tokens[b * seq + t]) * channels;
      const float* p = wpe + t * channels;
      for (int64_t c = 0; c < channels; ++c) o[c] = w[c] + p[c];
    }
  }
}

void EmbeddingBackward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                       int64_t batch, int64_t seq, int64_t channels) {
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t < seq; ++t) {
      const float* d = dout + (b * seq + t) * channels;
      if (dwte != nullptr) {
        float* w = dwte + static_cast<int64_t>(tokens[b * seq + t]) * channels;
        for (int64_t c = 0; c < channels; ++c) w[c] += d[c];
      }
      if (dwpe != nullptr) {
        float* p = dwpe + t * channels;
        for (int64_t c = 0; c < channels; ++c) p[c] += d[c];
      }
    }
  }
}

}  // namespace baton::kernels::cpu
