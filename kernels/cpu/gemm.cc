#include "kernels/cpu/gemm.h"

#include <cblas.h>

#include <chrono>

namespace baton::kernels::cpu {
namespace {

thread_local GemmStats thread_stats;

}  // namespace

void Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const auto start = std::chrono::steady_clock::now();
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, static_cast<blasint>(m), static_cast<blasint>(n),
              static_cast<blasint>(k), alpha, a, static_cast<blasint>(lda), b,
              static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
  const auto end = std::chrono::steady_clock::now();
  thread_stats.seconds += std::chrono::duration<double>(end - start).count();
  thread_stats.flops +=
      2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  ++thread_stats.calls;
}

GemmStats ThreadGemmStats() { return thread_stats; }

void ResetThreadGemmStats() { thread_stats = GemmStats{}; }

void SetBlasThreads(int threads) { openblas_set_num_threads(threads); }

}  // namespace baton::kernels::cpu
