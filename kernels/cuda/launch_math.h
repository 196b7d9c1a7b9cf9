// Launch shapes of the CUDA kernels, as plain inline functions with no
// dependencies so that the .cu files (compiled by nvcc with only CUDA headers)
// and the host-side tests (kernels/cuda/plan_test.cc) use the same ones.
//
// Wherever a grid's shape decides the order of a floating-point reduction
// (column sums, the squared norm), the shape depends only on the problem
// size, never on the GPU's multiprocessor count: same shapes, same bits.
#ifndef BATON_KERNELS_CUDA_LAUNCH_MATH_H_
#define BATON_KERNELS_CUDA_LAUNCH_MATH_H_

#include <cstdint>

namespace baton::cuda {

struct LaunchShape {
  int blocks = 0;
  int threads = 0;
  int64_t items_per_block = 0;  // rows per block, as the kernel defines
};

inline constexpr int kThreadsPerBlock = 256;
inline constexpr int kWarpSize = 32;
inline constexpr int kMaxGridX = 65535 * 16;  // well under CUDA's 2^31-1
// CUDA's own limit on gridDim.x, for kernels that are not grid-stride.
inline constexpr int64_t kMaxGridXHardware = 2147483647;

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline int ClampGrid(int64_t blocks) {
  return static_cast<int>(blocks < 1 ? 1 : (blocks > kMaxGridX ? kMaxGridX : blocks));
}

// Grid-stride elementwise launch over n items handled `vector_width` at a time.
inline LaunchShape ElementwiseLaunch(int64_t n, int vector_width) {
  const int64_t vectors = CeilDiv(n < 1 ? 1 : n, vector_width < 1 ? 1 : vector_width);
  return LaunchShape{ClampGrid(CeilDiv(vectors, kThreadsPerBlock)), kThreadsPerBlock, 0};
}

// One warp per row, kThreadsPerBlock/32 rows per block (grid-stride over rows).
inline LaunchShape WarpPerRowLaunch(int64_t rows) {
  const int rows_per_block = kThreadsPerBlock / kWarpSize;
  return LaunchShape{ClampGrid(CeilDiv(rows < 1 ? 1 : rows, rows_per_block)), kThreadsPerBlock,
                     rows_per_block};
}

// One block per row (long rows: cross-entropy over the vocabulary).
inline LaunchShape BlockPerRowLaunch(int64_t rows) {
  return LaunchShape{ClampGrid(rows), kThreadsPerBlock, 1};
}

// Deterministic column sums of a [rows, cols] matrix in two passes: pass one
// has chunks × column_blocks blocks, block (chunk, j) summing rows
// [chunk·rows_per_chunk, ...) of its columns in row order into a partial
// [chunks, cols]; pass two adds the chunks in chunk order.
struct ColumnReducePlan {
  int chunks = 0;
  int64_t rows_per_chunk = 0;
  int column_blocks = 0;
  int threads = 0;
};

inline ColumnReducePlan PlanColumnReduce(int64_t rows, int64_t cols) {
  rows = rows < 1 ? 1 : rows;
  cols = cols < 1 ? 1 : cols;
  ColumnReducePlan p;
  p.threads = kThreadsPerBlock;
  // One thread per column and no grid-stride loop over columns: the grid must
  // cover them all (ClampGrid's kMaxGridX would drop every column past
  // 268M). ColumnReduceCoversColumns says whether it does.
  const int64_t column_blocks = CeilDiv(cols, p.threads);
  p.column_blocks = static_cast<int>(column_blocks > kMaxGridXHardware ? kMaxGridXHardware
                                                                       : column_blocks);
  // About 64 rows per chunk, at most 256 chunks: enough blocks to fill a GPU
  // at C = 768 and a short second pass.
  int64_t chunks = CeilDiv(rows, 64);
  chunks = chunks > 256 ? 256 : chunks;
  p.rows_per_chunk = CeilDiv(rows, chunks);
  p.chunks = static_cast<int>(CeilDiv(rows, p.rows_per_chunk));
  return p;
}

// Whether p's grid has a thread for each of `cols` columns (launchers refuse
// a plan that does not, rather than leave columns unsummed).
inline bool ColumnReduceCoversColumns(const ColumnReducePlan& p, int64_t cols) {
  return static_cast<int64_t>(p.column_blocks) * p.threads >= cols;
}

// Fixed grid for the squared-norm reduction: block b's partial covers a
// grid-stride set of indices that depends only on n.
inline constexpr int kNormBlocks = 512;

}  // namespace baton::cuda

#endif  // BATON_KERNELS_CUDA_LAUNCH_MATH_H_
