// Deterministic column sums (bias gradients, LayerNorm's parameter
// gradients), kernels/cpu/matmul.h BiasBackward:
//   out[c] += Σ_n x[n,c]
// in two passes with a fixed shape (launch_math.h PlanColumnReduce): chunk k
// sums rows [k·R, (k+1)·R) in row order into partial[k,c]; then out[c] +=
// Σ_k partial[k,c] in chunk order. No atomics: same shapes, same bits.
#ifndef BATON_KERNELS_CUDA_COLUMN_REDUCE_CUH_
#define BATON_KERNELS_CUDA_COLUMN_REDUCE_CUH_

#include <cuda_runtime.h>

#include <cstdint>

namespace baton::cuda {

// `partial` holds PlanColumnReduce(rows, cols).chunks · cols floats.
cudaError_t LaunchColumnSum(float* out, const float* x, int64_t rows, int64_t cols,
                            float* partial, cudaStream_t stream);

// Pass two alone, for kernels that write their own partials [chunks, cols]:
// out[c] += Σ_k partial[k·cols + c]. `outputs` vectors laid one after the
// other in both (out + o·cols, partial + o·chunks·cols).
cudaError_t LaunchAddChunkSums(float* out, const float* partial, int chunks, int64_t cols,
                               int outputs, cudaStream_t stream);

}  // namespace baton::cuda

#endif  // BATON_KERNELS_CUDA_COLUMN_REDUCE_CUH_
