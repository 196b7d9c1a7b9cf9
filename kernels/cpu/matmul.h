// Linear layer in PyTorch's weight layout (weight[out, in]):
//   forward:         y[N,O] = x[N,I] · Wᵀ + b
//   backward input:  dx[N,I] (=|+=) dy[N,O] · W
//   backward weight: dW[O,I] += dyᵀ · x
//   bias backward:   db[O] += Σ_n dy[n,:]   (rows summed in order)
// The input and weight halves are separate so zero-bubble schedules can
// defer the weight GEMM.
#ifndef BATON_KERNELS_CPU_MATMUL_H_
#define BATON_KERNELS_CPU_MATMUL_H_

#include <cstdint>

namespace baton::kernels::cpu {

// `bias` may be null.
void MatmulForward(float* out, const float* inp, const float* weight, const float* bias,
                   int64_t rows, int64_t in_features, int64_t out_features);

void MatmulBackwardInput(float* dinp, const float* dout, const float* weight, int64_t rows,
                         int64_t in_features, int64_t out_features, bool accumulate);

void MatmulBackwardWeight(float* dweight, const float* dout, const float* inp, int64_t rows,
                          int64_t in_features, int64_t out_features);

// out[n,:] += bias, for a bias added after a tensor-parallel reduction.
void AddBias(float* out, const float* bias, int64_t rows, int64_t out_features);

void BiasBackward(float* dbias, const float* dout, int64_t rows, int64_t out_features);

}  // namespace baton::kernels::cpu

#endif  // BATON_KERNELS_CPU_MATMUL_H_
