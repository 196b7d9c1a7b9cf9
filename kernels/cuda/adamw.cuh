// AdamW over flat fp32 buffers (kernels/cpu/adamw.h), optionally writing the
// bf16 copy of the parameters that bf16 GEMMs read:
//   g = grad · grad_scale
//   m = β1 m + (1 − β1) g,  v = β2 v + (1 − β2) g²
//   p = p · (1 − lr · wd) − lr · (m / (1 − β1ᵗ)) / (√(v / (1 − β2ᵗ)) + eps)
//   p_bf16 = bf16(p)
// Every operation is an explicitly rounded IEEE op (__fmul_rn etc.: no FMA
// contraction), and the bias corrections come from the host exactly as the
// CPU computes them, so the fp32 result is bitwise equal to kernels/cpu.
#ifndef BATON_KERNELS_CUDA_ADAMW_CUH_
#define BATON_KERNELS_CUDA_ADAMW_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace baton::cuda {

struct AdamWArgs {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  int64_t step = 1;  // counts from 1
  float grad_scale = 1.0f;
};

// `param_bf16` may be null.
cudaError_t LaunchAdamW(float* param, __nv_bfloat16* param_bf16, const float* grad, float* m,
                        float* v, int64_t n, const AdamWArgs& args, cudaStream_t stream);

}  // namespace baton::cuda

#endif  // BATON_KERNELS_CUDA_ADAMW_CUH_
