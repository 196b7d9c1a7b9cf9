// Token + position embedding.
//   forward:  out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:]
//   backward: dwte[tokens[b,t],:] += dout[b,t,:], dwpe[t,:] += dout[b,t,:]
// `wte` may be a shard of the token table — rows [vocab_begin, vocab_begin +
// vocab_rows) — for a vocabulary-parallel embedding: tokens outside the shard
// contribute zero, and summing the shards' outputs (with wpe added by one of
// them) gives exactly the unsharded result, since x + 0 = x and a + b = b + a.
// Backward visits (b,t) in order, so repeated tokens accumulate in a fixed
// order. Token ids must already be checked against the vocabulary.
#ifndef BATON_KERNELS_CPU_EMBEDDING_H_
#define BATON_KERNELS_CPU_EMBEDDING_H_

#include <cstdint>

namespace baton::kernels::cpu {

// `wpe` may be null (no position term from this shard).
void EmbeddingForward(float* out, const int32_t* tokens, const float* wte, int64_t vocab_begin,
                      int64_t vocab_rows, const float* wpe, int64_t batch, int64_t seq,
                      int64_t channels);

// `dwte` or `dwpe` may be null to skip that gradient.
void EmbeddingBackward(float* dwte, int64_t vocab_begin, int64_t vocab_rows, float* dwpe,
                       const float* dout, const int32_t* tokens, int64_t batch, int64_t seq,
                       int64_t channels);

}  // namespace baton::kernels::cpu

#endif  // BATON_KERNELS_CPU_EMBEDDING_H_
