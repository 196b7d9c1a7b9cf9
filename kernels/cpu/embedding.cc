#include "kernels/cpu/embedding.h"

namespace baton::kernels::cpu {

void EmbeddingForward(float* out, const int32_t* tokens, const float* wte, int64_t vocab_begin,
                      int64_t vocab_rows, const float* wpe, int64_t batch, int64_t seq,
                      int64_t channels) {
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t < seq; ++t) {
      float* o = out + (b * seq + t) * channels;
      const int64_t row = tokens[b * seq + t] - vocab_begin;
      const bool owned = row >= 0 && row < vocab_rows;
      const float* w = owned ? wte + row * channels : nullptr;
      const float* p = wpe == nullptr ? nullptr : wpe + t * channels;
      if (owned && p != nullptr) {
        for (int64_t c = 0; c < channels; ++c) o[c] = w[c] + p[c];
      } else if (owned) {
        for (int64_t c = 0; c < channels; ++c) o[c] = w[c];
      } else if (p != nullptr) {
        for (int64_t c = 0; c < channels; ++c) o[c] = p[c];
      } else {
        for (int64_t c = 0; c < channels; ++c) o[c] = 0.0f;
      }
    }
  }
}

void EmbeddingBackward(float* dwte, int64_t vocab_begin, int64_t vocab_rows, float* dwpe,
                       const float* dout, const int32_t* tokens, int64_t batch, int64_t seq,
                       int64_t channels) {
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t < seq; ++t) {
      const float* d = dout + (b * seq + t) * channels;
      const int64_t row = tokens[b * seq + t] - vocab_begin;
      if (dwte != nullptr && row >= 0 && row < vocab_rows) {
        float* w = dwte + row * channels;
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
