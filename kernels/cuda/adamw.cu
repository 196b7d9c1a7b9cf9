#include "kernels/cuda/adamw.cuh"

#include <cmath>

#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch_math.h"

namespace baton::cuda {
namespace {

struct Coefficients {
  float b1, one_minus_b1, b2, one_minus_b2, correction1, correction2, decay, lr, eps, grad_scale;
};

__global__ void AdamWKernel(float* __restrict__ param, __nv_bfloat16* __restrict__ param_bf16,
                            const float* __restrict__ grad, float* __restrict__ m,
                            float* __restrict__ v, int64_t n, Coefficients k) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const float g = __fmul_rn(grad[i], k.grad_scale);
    const float mi = __fadd_rn(__fmul_rn(k.b1, m[i]), __fmul_rn(k.one_minus_b1, g));
    const float vi = __fadd_rn(__fmul_rn(k.b2, v[i]), __fmul_rn(__fmul_rn(k.one_minus_b2, g), g));
    m[i] = mi;
    v[i] = vi;
    const float m_hat = __fdiv_rn(mi, k.correction1);
    const float v_hat = __fdiv_rn(vi, k.correction2);
    const float step = __fdiv_rn(__fmul_rn(k.lr, m_hat), __fadd_rn(__fsqrt_rn(v_hat), k.eps));
    const float p = __fsub_rn(__fmul_rn(param[i], k.decay), step);
    param[i] = p;
    if (param_bf16 != nullptr) param_bf16[i] = __float2bfloat16_rn(p);
  }
}

}  // namespace

cudaError_t LaunchAdamW(float* param, __nv_bfloat16* param_bf16, const float* grad, float* m,
                        float* v, int64_t n, const AdamWArgs& a, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (a.step < 1) return cudaErrorInvalidValue;
  // The same float expressions as kernels/cpu/adamw.cc.
  Coefficients k;
  k.b1 = a.beta1;
  k.b2 = a.beta2;
  k.one_minus_b1 = 1.0f - a.beta1;
  k.one_minus_b2 = 1.0f - a.beta2;
  k.correction1 = 1.0f - static_cast<float>(std::pow(a.beta1, static_cast<double>(a.step)));
  k.correction2 = 1.0f - static_cast<float>(std::pow(a.beta2, static_cast<double>(a.step)));
  k.decay = 1.0f - a.lr * a.weight_decay;
  k.lr = a.lr;
  k.eps = a.eps;
  k.grad_scale = a.grad_scale;
  const LaunchShape s = ElementwiseLaunch(n, 1);
  AdamWKernel<<<s.blocks, s.threads, 0, stream>>>(param, param_bf16, grad, m, v, n, k);
  return cudaGetLastError();
}

}  // namespace baton::cuda
