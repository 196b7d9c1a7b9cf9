#include "kernels/cuda/vector_ops.cuh"

namespace baton::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void FillKernel(float* __restrict__ y, float value, int64_t n) {
  const int64_t n4 = n / 4;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  float4 v = make_float4(value, value, value, value);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n4; i += stride) {
    reinterpret_cast<float4*>(y)[i] = v;
  }
  for (int64_t i = 4 * n4 + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += stride) {
    y[i] = value;
  }
}

__global__ void AxpyKernel(float a, const float* __restrict__ x, float* __restrict__ y, int64_t n) {
  const int64_t n4 = n / 4;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n4; i += stride) {
    float4 xv = reinterpret_cast<const float4*>(x)[i];
    float4 yv = reinterpret_cast<float4*>(y)[i];
    yv.x = fmaf(a, xv.x, yv.x);
    yv.y = fmaf(a, xv.y, yv.y);
    yv.z = fmaf(a, xv.z, yv.z);
    yv.w = fmaf(a, xv.w, yv.w);
    reinterpret_cast<float4*>(y)[i] = yv;
  }
  for (int64_t i = 4 * n4 + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += stride) {
    y[i] = fmaf(a, x[i], y[i]);
  }
}

int Blocks(int64_t n) {
  int64_t blocks = (n / 4 + kThreads - 1) / kThreads;
  if (blocks < 1) blocks = 1;
  if (blocks > 65535) blocks = 65535;
  return static_cast<int>(blocks);
}

}  // namespace

cudaError_t LaunchFill(float* y, float value, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (reinterpret_cast<uintptr_t>(y) % 16 != 0) return cudaErrorMisalignedAddress;
  FillKernel<<<Blocks(n), kThreads, 0, stream>>>(y, value, n);
  return cudaGetLastError();
}

cudaError_t LaunchAxpy(float a, const float* x, float* y, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (reinterpret_cast<uintptr_t>(x) % 16 != 0 || reinterpret_cast<uintptr_t>(y) % 16 != 0) {
    return cudaErrorMisalignedAddress;
  }
  AxpyKernel<<<Blocks(n), kThreads, 0, stream>>>(a, x, y, n);
  return cudaGetLastError();
}

}  // namespace baton::cuda
