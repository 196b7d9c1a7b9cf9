// Causal softmax of attention scores (kernels/cpu/attention.h), per row i of
// each head's [T,T] block, scores already scaled by 1/√hd in the GEMM:
//   P[i,j] = exp(S[i,j] − max_{j'≤i} S) / Σ_{j'≤i} exp(S[i,j'] − max)  for j ≤ i
//   P[i,j] = 0                                                          for j > i
// Backward: dS[i,j] = P[i,j] · (dP[i,j] − Σ_{j'≤i} P[i,j'] dP[i,j']) · scale
// Warp per row, sums by butterfly (agree with the CPU's sequential sums to
// rounding). P is written as fp32 (in place over S allowed) or bf16 (the A
// operand of the bf16 P·v GEMM); dS likewise.
#ifndef BATON_KERNELS_CUDA_CAUSAL_SOFTMAX_CUH_
#define BATON_KERNELS_CUDA_CAUSAL_SOFTMAX_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace baton::cuda {

// `rows` = heads · T rows of length T (row r is query r % T).
cudaError_t LaunchCausalSoftmaxForward(float* probs, const float* scores, int64_t rows,
                                       int64_t seq, cudaStream_t stream);
cudaError_t LaunchCausalSoftmaxForward(__nv_bfloat16* probs, const float* scores, int64_t rows,
                                       int64_t seq, cudaStream_t stream);

// dscores may alias dprobs (fp32).
cudaError_t LaunchCausalSoftmaxBackward(float* dscores, const float* dprobs, const float* probs,
                                        int64_t rows, int64_t seq, float scale,
                                        cudaStream_t stream);
cudaError_t LaunchCausalSoftmaxBackward(__nv_bfloat16* dscores, const float* dprobs,
                                        const __nv_bfloat16* probs, int64_t rows, int64_t seq,
                                        float scale, cudaStream_t stream);

}  // namespace baton::cuda

#endif  // BATON_KERNELS_CUDA_CAUSAL_SOFTMAX_CUH_
