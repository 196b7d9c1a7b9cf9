// Gemm: the one place the CPU kernels call BLAS (cblas_sgemm, row-major),
// with a per-thread account of the time spent there, and the per-process
// OpenBLAS thread count. Deterministic: OpenBLAS splits a GEMM over its
// output, never over the reduction dimension, so a fixed thread count and
// fixed shapes give fixed bits.
#ifndef BATON_KERNELS_CPU_GEMM_H_
#define BATON_KERNELS_CPU_GEMM_H_

#include <cstdint>

namespace baton::kernels::cpu {

// C[M,N] = alpha * op(A) * op(B) + beta * C, all row-major; op(X) is X or
// X^T. `lda`, `ldb`, `ldc` are row strides in elements.
void Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

// Time and work spent in Gemm on the calling thread since the last reset.
struct GemmStats {
  double seconds = 0;
  double flops = 0;
  int64_t calls = 0;
};
GemmStats ThreadGemmStats();
void ResetThreadGemmStats();

// Sets OpenBLAS's thread count for the whole process (it is global there).
void SetBlasThreads(int threads);

}  // namespace baton::kernels::cpu

#endif  // BATON_KERNELS_CPU_GEMM_H_
