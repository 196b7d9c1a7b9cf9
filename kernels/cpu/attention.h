// Causal multi-head self-attention, per batch row b and head h (hd = C/NH):
//   q, k, v = the h-th hd-wide slices of the q | k | v thirds of qkv[b]
//   S = q kᵀ / √hd,  P = softmax over j ≤ i (row i; P[i,j>i] = 0),  o = P v
// Backward:
//   dP = do vᵀ,  dv = Pᵀ do,  dS = P ⊙ (dP − rowsum(P ⊙ dP)) / √hd,
//   dq = dS k,  dk = dSᵀ q
// The four products per head go through Gemm; the softmax runs row by row.
//
// bf16 (the definition kernels/cuda/attention.h implements for bf16 qkv):
// the *Bf16Rounded forms take inputs holding bf16 values (widened to float,
// exact), accumulate every product in fp32 and round P (forward) and dS
// (backward) to bf16 before they enter the next product, as the CUDA path
// stores them. Their outputs (out; dqkv) are fp32 sums for the caller to
// round to bf16 once; att receives the bf16-rounded P. S and dP stay fp32.
#ifndef BATON_KERNELS_CPU_ATTENTION_H_
#define BATON_KERNELS_CPU_ATTENTION_H_

#include <cstdint>

namespace baton::kernels::cpu {

// qkv [B,T,3C] → out [B,T,C]; att [B,NH,T,T] keeps P for the backward pass.
void AttentionForward(float* out, float* att, const float* qkv, int64_t batch, int64_t seq,
                      int64_t channels, int64_t heads);

// Writes dqkv [B,T,3C]. `scratch` holds T·T floats.
void AttentionBackward(float* dqkv, float* scratch, const float* dout, const float* qkv,
                       const float* att, int64_t batch, int64_t seq, int64_t channels,
                       int64_t heads);

void AttentionForwardBf16Rounded(float* out, float* att, const float* qkv, int64_t batch,
                                 int64_t seq, int64_t channels, int64_t heads);
void AttentionBackwardBf16Rounded(float* dqkv, float* scratch, const float* dout,
                                  const float* qkv, const float* att, int64_t batch, int64_t seq,
                                  int64_t channels, int64_t heads);

}  // namespace baton::kernels::cpu

#endif  // BATON_KERNELS_CPU_ATTENTION_H_
