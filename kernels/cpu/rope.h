// Rotary position embedding (Hugging Face Llama's rotate-half form) fused
// with the grouped-query expansion into the packed qkv that attention reads.
//
// q [B·T, H·D], k and v [B·T, KV·D], rows batch-major (row = b·T + t);
// qkv [B, T, 3·H·D]: H query heads, then H key heads, then H value heads,
// each D wide. Query head h reads key/value head h / (H / KV) (repeat_kv).
// For i < D/2, in float32 as transformers computes them:
//   inv_freq_i = fl(1 / powf(theta, fl(2i / D))),  angle = fl(pos · inv_freq_i)
//   pos = position_offset + t   (t: the row's index in its sequence; a
//                               context-parallel rank's chunk passes the
//                               chunk's first global position)
//   c = fl(cos(angle)), s = fl(sin(angle))   (cos, sin in float64, rounded)
//   (x_i, x_{i+D/2}) → (x_i·c − x_{i+D/2}·s,  x_{i+D/2}·c + x_i·s)
// q and k are rotated, v is copied.
//
// Backward (the adjoint): per key/value head, the gradients of its query
// heads' copies are summed in fp32 in increasing head order (repeat_kv's
// backward), then q and k gradients are rotated back by −angle:
//   (g_i, g_{i+D/2}) → (g_i·c + g_{i+D/2}·s,  g_{i+D/2}·c − g_i·s).
// Fixed order throughout: deterministic.
#ifndef BATON_KERNELS_CPU_ROPE_H_
#define BATON_KERNELS_CPU_ROPE_H_

#include <cstdint>
#include <vector>

namespace baton::kernels::cpu {

// cos and sin of every (position position_offset + t, t < seq; frequency
// i < head_dim / 2), at [t · head_dim/2 + i], by the recipe above. With
// offset 0 the rows are positions 0 .. seq−1, as before the offset existed;
// row t of an offset table has the bits of row position_offset + t of a table
// from 0 (the position is converted to float whole).
void RopeTable(std::vector<float>& cos, std::vector<float>& sin, int64_t seq, int64_t head_dim,
               float theta, int64_t position_offset = 0);

// Writes qkv (every element).
void RopePackForward(float* qkv, const float* q, const float* k, const float* v, int64_t batch,
                     int64_t seq, int64_t heads, int64_t kv_heads, int64_t head_dim, float theta,
                     int64_t position_offset = 0);

// Writes (overwrites) dq, dk and dv.
void RopePackBackward(float* dq, float* dk, float* dv, const float* dqkv, int64_t batch,
                      int64_t seq, int64_t heads, int64_t kv_heads, int64_t head_dim, float theta,
                      int64_t position_offset = 0);

}  // namespace baton::kernels::cpu

#endif  // BATON_KERNELS_CPU_ROPE_H_
