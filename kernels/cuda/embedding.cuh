// Token + position embedding (kernels/cpu/embedding.h):
//   forward:  out[b,t,:] = wte[tokens[b,t] − vocab_begin,:] + wpe[t,:]
//   backward: dwte[tokens[b,t] − vocab_begin,:] += dout[b,t,:]  for (b,t) in order
//             dwpe[t,:] += dout[b,t,:]                          for b in order
// `wte` may be the vocabulary shard [vocab_begin, vocab_begin + vocab_rows):
// tokens outside it contribute zero (vocabulary parallelism). `wpe` / `dwte` /
// `dwpe` may be null.
//
// Deterministic backward without atomics: a link kernel finds, for every
// token position n in the shard, the next position with the same token
// (next[n], −1 at the end) and whether n is the first (head[n]); then one
// thread per (first occurrence, channel) walks that chain in position order
// adding into dwte. That is the CPU's order of additions exactly, so the
// result is bitwise equal to kernels/cpu. dwpe: one thread per (t, c), b in
// order — also the CPU's order. Linking costs O(N²) token compares (N = B·T;
// 67M for N = 8192, read from shared memory), far below the GEMMs.
#ifndef BATON_KERNELS_CUDA_EMBEDDING_CUH_
#define BATON_KERNELS_CUDA_EMBEDDING_CUH_

#include <cuda_runtime.h>

#include <cstdint>

namespace baton::cuda {

cudaError_t LaunchEmbeddingForward(float* out, const int32_t* tokens, const float* wte,
                                   int64_t vocab_begin, int64_t vocab_rows, const float* wpe,
                                   int64_t batch, int64_t seq, int64_t channels,
                                   cudaStream_t stream);

// `scratch` holds 2·batch·seq int32 (plan.h EmbeddingBackwardScratchBytes).
cudaError_t LaunchEmbeddingBackward(float* dwte, int64_t vocab_begin, int64_t vocab_rows,
                                    float* dwpe, const float* dout, const int32_t* tokens,
                                    int64_t batch, int64_t seq, int64_t channels,
                                    int32_t* scratch, cudaStream_t stream);

}  // namespace baton::cuda

#endif  // BATON_KERNELS_CUDA_EMBEDDING_CUH_
