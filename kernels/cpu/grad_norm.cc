#include "kernels/cpu/grad_norm.h"

#include <cmath>

namespace baton::kernels::cpu {

double SumOfSquares(const float* x, int64_t n) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(x[i]) * x[i];
  return sum;
}

float ClipFactor(double global_sq_norm, double max_norm) {
  if (max_norm <= 0.0) return 1.0f;
  const double factor = max_norm / (std::sqrt(global_sq_norm) + 1e-6);
  return factor < 1.0 ? static_cast<float>(factor) : 1.0f;
}

void Scale(float* x, int64_t n, float factor) {
  for (int64_t i = 0; i < n; ++i) x[i] *= factor;
}

}  // namespace baton::kernels::cpu
