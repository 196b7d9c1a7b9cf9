// Fused softmax + cross-entropy over the vocabulary, per row n:
//   loss[n] = log Σ_v exp(z[n,v]) − z[n, target[n]]
//   dz[n,v] = (softmax(z[n])[v] − [v = target[n]]) · grad_scale
// The logits are overwritten by their gradient, so a training step keeps one
// [N,V] buffer. `grad_scale` is d(total loss)/d(loss[n]), e.g. 1/N for a mean.
#ifndef BATON_KERNELS_CPU_CROSS_ENTROPY_H_
#define BATON_KERNELS_CPU_CROSS_ENTROPY_H_

#include <cstdint>

namespace baton::kernels::cpu {

// Returns Σ_n loss[n], summed in row order in double precision. Targets must
// be in [0, vocab).
double SoftmaxCrossEntropy(float* logits_to_grad, const int32_t* targets, int64_t rows,
                           int64_t vocab, float grad_scale);

}  // namespace baton::kernels::cpu

#endif  // BATON_KERNELS_CPU_CROSS_ENTROPY_H_
