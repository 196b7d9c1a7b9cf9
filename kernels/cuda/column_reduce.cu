#include "kernels/cuda/column_reduce.cuh"

#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch_math.h"

namespace baton::cuda {
namespace {

// Block (column block x, chunk y); thread = one column.
__global__ void ChunkSumKernel(float* __restrict__ partial, const float* __restrict__ x,
                               int64_t rows, int64_t cols, int64_t rows_per_chunk) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  const int64_t begin = blockIdx.y * rows_per_chunk;
  const int64_t end = begin + rows_per_chunk < rows ? begin + rows_per_chunk : rows;
  float acc = 0.0f;
  for (int64_t n = begin; n < end; ++n) acc += x[n * cols + c];
  partial[blockIdx.y * cols + c] = acc;
}

__global__ void AddChunkSumsKernel(float* __restrict__ out, const float* __restrict__ partial,
                                   int chunks, int64_t cols, int outputs) {
  const int64_t total = cols * outputs;
  for (int64_t i = GlobalThread(); i < total; i += GridThreads()) {
    const int64_t o = i / cols, c = i % cols;
    const float* p = partial + o * chunks * cols + c;
    float acc = 0.0f;
    for (int k = 0; k < chunks; ++k) acc += p[k * cols];
    out[i] += acc;
  }
}

}  // namespace

cudaError_t LaunchAddChunkSums(float* out, const float* partial, int chunks, int64_t cols,
                               int outputs, cudaStream_t stream) {
  if (cols <= 0 || outputs <= 0 || chunks <= 0) return cudaSuccess;
  const LaunchShape s = ElementwiseLaunch(cols * outputs, 1);
  AddChunkSumsKernel<<<s.blocks, s.threads, 0, stream>>>(out, partial, chunks, cols, outputs);
  return cudaGetLastError();
}

cudaError_t LaunchColumnSum(float* out, const float* x, int64_t rows, int64_t cols,
                            float* partial, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  const ColumnReducePlan p = PlanColumnReduce(rows, cols);
  if (!ColumnReduceCoversColumns(p, cols)) return cudaErrorInvalidValue;
  ChunkSumKernel<<<dim3(p.column_blocks, p.chunks), p.threads, 0, stream>>>(partial, x, rows, cols,
                                                                            p.rows_per_chunk);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return LaunchAddChunkSums(out, partial, p.chunks, cols, 1, stream);
}

}  // namespace baton::cuda
