// Casts between fp32 and bf16 (round to nearest even, as
// __float2bfloat16_rn and kernels/cuda/plan.h's FloatToBf16Bits):
//   y[i] = bf16(x[i]),  x[i] = float(y[i]) (exact).
#ifndef BATON_KERNELS_CUDA_CAST_CUH_
#define BATON_KERNELS_CUDA_CAST_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace baton::cuda {

cudaError_t LaunchCastF32ToBf16(__nv_bfloat16* y, const float* x, int64_t n, cudaStream_t stream);
cudaError_t LaunchCastBf16ToF32(float* y, const __nv_bfloat16* x, int64_t n, cudaStream_t stream);

}  // namespace baton::cuda

#endif  // BATON_KERNELS_CUDA_CAST_CUH_
