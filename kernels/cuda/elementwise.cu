#include "kernels/cuda/elementwise.cuh"

#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch_math.h"

namespace baton::cuda {
namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kCubic = 0.044715f;

__global__ void GeluForwardKernel(float* __restrict__ out, const float* __restrict__ inp,
                                  int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const float x = inp[i];
    const float u = kSqrt2OverPi * (x + kCubic * x * x * x);
    out[i] = 0.5f * x * (1.0f + tanhf(u));
  }
}

// dinp may alias dout (the model computes dh in place): neither is __restrict__.
__global__ void GeluBackwardKernel(float* dinp, const float* __restrict__ inp, const float* dout,
                                   int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const float x = inp[i];
    const float u = kSqrt2OverPi * (x + kCubic * x * x * x);
    const float th = tanhf(u);
    const float du = kSqrt2OverPi * (1.0f + 3.0f * kCubic * x * x);
    dinp[i] = dout[i] * (0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * du);
  }
}

__global__ void ResidualForwardKernel(float* out, const float* a, const float* b, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) out[i] = a[i] + b[i];
}

__global__ void ResidualBackwardKernel(float* da, float* db, const float* __restrict__ dout,
                                       int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const float d = dout[i];
    if (da != nullptr) da[i] += d;
    if (db != nullptr) db[i] += d;
  }
}

__global__ void AddBiasKernel(float* __restrict__ out, const float* __restrict__ bias,
                              int64_t rows, int64_t cols) {
  const int64_t n = rows * cols;
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) out[i] += bias[i % cols];
}

__global__ void ScaleKernel(float* x, int64_t n, float factor) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) x[i] *= factor;
}

LaunchShape Shape(int64_t n) { return ElementwiseLaunch(n, 1); }

}  // namespace

cudaError_t LaunchGeluForward(float* out, const float* inp, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const LaunchShape s = Shape(n);
  GeluForwardKernel<<<s.blocks, s.threads, 0, stream>>>(out, inp, n);
  return cudaGetLastError();
}

cudaError_t LaunchGeluBackward(float* dinp, const float* inp, const float* dout, int64_t n,
                               cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const LaunchShape s = Shape(n);
  GeluBackwardKernel<<<s.blocks, s.threads, 0, stream>>>(dinp, inp, dout, n);
  return cudaGetLastError();
}

cudaError_t LaunchResidualForward(float* out, const float* a, const float* b, int64_t n,
                                  cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const LaunchShape s = Shape(n);
  ResidualForwardKernel<<<s.blocks, s.threads, 0, stream>>>(out, a, b, n);
  return cudaGetLastError();
}

cudaError_t LaunchResidualBackward(float* da, float* db, const float* dout, int64_t n,
                                   cudaStream_t stream) {
  if (n <= 0 || (da == nullptr && db == nullptr)) return cudaSuccess;
  const LaunchShape s = Shape(n);
  ResidualBackwardKernel<<<s.blocks, s.threads, 0, stream>>>(da, db, dout, n);
  return cudaGetLastError();
}

cudaError_t LaunchAddBias(float* out, const float* bias, int64_t rows, int64_t cols,
                          cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  const LaunchShape s = Shape(rows * cols);
  AddBiasKernel<<<s.blocks, s.threads, 0, stream>>>(out, bias, rows, cols);
  return cudaGetLastError();
}

cudaError_t LaunchScale(float* x, int64_t n, float factor, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const LaunchShape s = Shape(n);
  ScaleKernel<<<s.blocks, s.threads, 0, stream>>>(x, n, factor);
  return cudaGetLastError();
}

}  // namespace baton::cuda
