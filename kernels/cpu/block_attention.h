// Block attention with log-sum-exp output: the CPU reference for ring
// attention (context parallelism), where each rank holds a block of queries
// and sees the key/value blocks of the sequence one at a time.
//
// Per batch row b and head h (hd = C/NH; head h is the h-th hd-wide slice of
// the channel dim of q [B,Tq,C], k and v [B,Tk,C]). Query row i sits at global
// position q_offset + i, key row j at k_offset + j; j is visible to i iff
// k_offset + j ≤ q_offset + i (causal). Over the visible j of one block:
//   s_ij = q_i · k_j / √hd,   lse_i = log Σ_j exp(s_ij),
//   o_i = Σ_j exp(s_ij − lse_i) v_j
// A row with no visible key in the block has o_i = 0 and lse_i = −∞.
//
// Merge (online softmax), for the outputs (o, l) and (o', l') of two disjoint
// key sets: l'' = logaddexp(l, l'),  o'' = o·e^{l−l''} + o'·e^{l'−l''}.
// Starting from o = 0, l = −∞ and merging every key block of the sequence, in
// any order, gives full causal attention (within fp32 rounding); a side with
// l = −∞ contributes nothing, exactly.
//
// Backward, with the final (merged) lse and δ_i = Σ_c do_ic · o_ic over the
// head's channels (AttentionDelta, from the final o):
//   P_ij = exp(s_ij − lse_i) on visible entries (0 elsewhere),
//   dS = P ⊙ (do vᵀ − δ) / √hd,  dq += dS k,  dk += dSᵀ q,  dv += Pᵀ do
// Summed over all key blocks this is the full attention's gradient
// (δ_i = Σ_j P_ij dP_ij over all keys equals rowsum(do ⊙ o)).
//
// The products go through Gemm and the softmax runs row by row in index
// order, with no threads of its own: fixed shapes give fixed bits. Inputs
// are finite; channels is a multiple of heads.
#ifndef BATON_KERNELS_CPU_BLOCK_ATTENTION_H_
#define BATON_KERNELS_CPU_BLOCK_ATTENTION_H_

#include <cstdint>

namespace baton::kernels::cpu {

// Row strides (in floats) of the q-side and k/v-side arrays, so that q, k and
// v may be column slices of packed rows: q (and dq) row i of batch b starts
// at q + (b·Tq + i)·q; k, v (and dk, dv) row j at k + (b·Tk + j)·kv. E.g. q
// read from qkv [B,Tq,3C] has q = 3C, and k, v from kv [B,Tk,2C] have
// kv = 2C (v = k + C). out, dout, lse and delta are always contiguous. The
// forms without strides use q = kv = C. Strides change only where rows are
// read and written, never the arithmetic: the bits are those of contiguous
// copies.
struct BlockAttentionStrides {
  int64_t q;
  int64_t kv;
};

// Writes out [B,Tq,C] and lse [B,NH,Tq] for one key/value block.
// `scratch` holds Tq·Tk floats.
void BlockAttentionForward(float* out, float* lse, const float* q, const float* k, const float* v,
                           int64_t batch, int64_t q_len, int64_t k_len, int64_t channels,
                           int64_t heads, int64_t q_offset, int64_t k_offset, float* scratch);
void BlockAttentionForward(float* out, float* lse, const float* q, const float* k, const float* v,
                           int64_t batch, int64_t q_len, int64_t k_len, int64_t channels,
                           int64_t heads, int64_t q_offset, int64_t k_offset, float* scratch,
                           BlockAttentionStrides strides);

// Merges one block's (block_out [B,Tq,C], block_lse [B,NH,Tq]) into the
// running (out, lse) in place. Initialize out = 0, lse = −∞ before the first
// block. A row whose block_lse is −∞ is left untouched (bit for bit); a row
// whose lse is −∞ takes the block's values as they are.
void MergeAttentionBlock(float* out, float* lse, const float* block_out, const float* block_lse,
                         int64_t batch, int64_t q_len, int64_t channels, int64_t heads);

// Writes delta [B,NH,Tq] = Σ over the head's channels of dout ⊙ out, where
// out is the final merged output.
void AttentionDelta(float* delta, const float* dout, const float* out, int64_t batch,
                    int64_t q_len, int64_t channels, int64_t heads);

// Accumulates (+=) one key/value block's share of the gradients into
// dq [B,Tq,C], dk and dv [B,Tk,C]. `lse` and `delta` ([B,NH,Tq]) are those of
// the final merged attention over all key blocks. A block no query row can
// see leaves dq, dk and dv untouched. `scratch` holds 2·Tq·Tk floats.
void BlockAttentionBackward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                            const float* k, const float* v, const float* lse, const float* delta,
                            int64_t batch, int64_t q_len, int64_t k_len, int64_t channels,
                            int64_t heads, int64_t q_offset, int64_t k_offset, float* scratch);
void BlockAttentionBackward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                            const float* k, const float* v, const float* lse, const float* delta,
                            int64_t batch, int64_t q_len, int64_t k_len, int64_t channels,
                            int64_t heads, int64_t q_offset, int64_t k_offset, float* scratch,
                            BlockAttentionStrides strides);

}  // namespace baton::kernels::cpu

#endif  // BATON_KERNELS_CPU_BLOCK_ATTENTION_H_
