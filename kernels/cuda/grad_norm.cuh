// Squared gradient norm in a fixed order (kernels/cpu/grad_norm.h
// SumOfSquares), in double:
//   partial[b] = Σ_{i ≡ b·256+t (mod 512·256)} x[i]²  (thread t of block b,
//                 grid-stride, then the block's fixed tree)
//   out[0]     = Σ_b partial[b] (one block, fixed tree)
// The grid is kNormBlocks × 256 whatever the GPU, so the order, and the bits,
// depend only on n. Results differ from the CPU's sequential sum by double
// rounding only (≈1e-15 relative).
// `accumulate`: out[0] += the sum (several flat buffers into one norm).
#ifndef BATON_KERNELS_CUDA_GRAD_NORM_CUH_
#define BATON_KERNELS_CUDA_GRAD_NORM_CUH_

#include <cuda_runtime.h>

#include <cstdint>

namespace baton::cuda {

// `partial` holds kNormBlocks doubles (plan.h NormScratchBytes).
cudaError_t LaunchSumOfSquares(const float* x, int64_t n, double* partial, double* out,
                               bool accumulate, cudaStream_t stream);

}  // namespace baton::cuda

#endif  // BATON_KERNELS_CUDA_GRAD_NORM_CUH_
