#include "kernels/cuda/embedding.cuh"

#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch_math.h"

namespace baton::cuda {
namespace {

// Warp per position; channels strided over the lanes.
__global__ void EmbeddingForwardKernel(float* __restrict__ out, const int32_t* __restrict__ tokens,
                                       const float* __restrict__ wte, int64_t vocab_begin,
                                       int64_t vocab_rows, const float* __restrict__ wpe,
                                       int64_t rows, int64_t seq, int64_t channels) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t n = GlobalThread() / 32; n < rows; n += warps) {
    const int64_t row = tokens[n] - vocab_begin;
    const bool owned = wte != nullptr && row >= 0 && row < vocab_rows;
    const float* w = owned ? wte + row * channels : nullptr;
    const float* p = wpe == nullptr ? nullptr : wpe + (n % seq) * channels;
    float* o = out + n * channels;
    for (int64_t c = lane; c < channels; c += 32) {
      // Same cases as the CPU: w + p, w, p or 0 (never w + 0.0f, which would
      // turn a −0 into +0).
      float v = 0.0f;
      if (owned && p != nullptr) {
        v = w[c] + p[c];
      } else if (owned) {
        v = w[c];
      } else if (p != nullptr) {
        v = p[c];
      }
      o[c] = v;
    }
  }
}

constexpr int kTile = 256;

// next[n]: the next position with the same (owned) token, −1 if none;
// head[n]: 1 if n is the first owned position of its token.
__global__ void LinkKernel(int32_t* __restrict__ next, int32_t* __restrict__ head,
                           const int32_t* __restrict__ tokens, int64_t n_tokens,
                           int64_t vocab_begin, int64_t vocab_rows) {
  __shared__ int32_t tile[kTile];
  const int64_t n = GlobalThread();
  const int32_t tok = n < n_tokens ? tokens[n] : 0;
  const bool owned = n < n_tokens && tok - vocab_begin >= 0 && tok - vocab_begin < vocab_rows;
  int32_t nxt = -1;
  bool first = true;
  for (int64_t base = 0; base < n_tokens; base += kTile) {
    __syncthreads();
    if (base + threadIdx.x < n_tokens) tile[threadIdx.x] = tokens[base + threadIdx.x];
    __syncthreads();
    if (!owned) continue;
    const int64_t len = n_tokens - base < kTile ? n_tokens - base : kTile;
    for (int64_t j = 0; j < len; ++j) {
      if (tile[j] != tok) continue;
      const int64_t m = base + j;
      if (m < n) first = false;
      if (m > n && nxt < 0) nxt = static_cast<int32_t>(m);
    }
  }
  if (n < n_tokens) {
    next[n] = nxt;
    head[n] = owned && first ? 1 : 0;
  }
}

// Thread (n, c): if n heads a chain, dwte[tok,c] += dout[m,c] for m along it.
__global__ void TokenGradKernel(float* __restrict__ dwte, const int32_t* __restrict__ next,
                                const int32_t* __restrict__ head, const float* __restrict__ dout,
                                const int32_t* __restrict__ tokens, int64_t n_tokens,
                                int64_t vocab_begin, int64_t channels) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  for (int64_t n = blockIdx.y; n < n_tokens; n += gridDim.y) {
    if (!head[n]) continue;
    float* w = dwte + (tokens[n] - vocab_begin) * channels + c;
    float acc = *w;
    for (int64_t m = n; m >= 0; m = next[m]) acc += dout[m * channels + c];
    *w = acc;
  }
}

// Thread (t, c): dwpe[t,c] += dout[b,t,c] for b in order.
__global__ void PositionGradKernel(float* __restrict__ dwpe, const float* __restrict__ dout,
                                   int64_t batch, int64_t seq, int64_t channels) {
  const int64_t n = seq * channels;
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    float acc = dwpe[i];
    for (int64_t b = 0; b < batch; ++b) acc += dout[b * n + i];
    dwpe[i] = acc;
  }
}

}  // namespace

cudaError_t LaunchEmbeddingForward(float* out, const int32_t* tokens, const float* wte,
                                   int64_t vocab_begin, int64_t vocab_rows, const float* wpe,
                                   int64_t batch, int64_t seq, int64_t channels,
                                   cudaStream_t stream) {
  const int64_t rows = batch * seq;
  if (rows <= 0 || channels <= 0) return cudaSuccess;
  const LaunchShape s = WarpPerRowLaunch(rows);
  EmbeddingForwardKernel<<<s.blocks, s.threads, 0, stream>>>(out, tokens, wte, vocab_begin,
                                                             vocab_rows, wpe, rows, seq, channels);
  return cudaGetLastError();
}

cudaError_t LaunchEmbeddingBackward(float* dwte, int64_t vocab_begin, int64_t vocab_rows,
                                    float* dwpe, const float* dout, const int32_t* tokens,
                                    int64_t batch, int64_t seq, int64_t channels,
                                    int32_t* scratch, cudaStream_t stream) {
  const int64_t n = batch * seq;
  if (n <= 0 || channels <= 0) return cudaSuccess;
  if (n > (int64_t{1} << 30)) return cudaErrorInvalidValue;
  if (dwte != nullptr) {
    int32_t* next = scratch;
    int32_t* head = scratch + n;
    LinkKernel<<<static_cast<int>(CeilDiv(n, kTile)), kTile, 0, stream>>>(
        next, head, tokens, n, vocab_begin, vocab_rows);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    dim3 grid(static_cast<unsigned>(CeilDiv(channels, kThreadsPerBlock)),
              static_cast<unsigned>(n < 65535 ? n : 65535));
    TokenGradKernel<<<grid, kThreadsPerBlock, 0, stream>>>(dwte, next, head, dout, tokens, n,
                                                            vocab_begin, channels);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  if (dwpe != nullptr) {
    const LaunchShape s = ElementwiseLaunch(seq * channels, 1);
    PositionGradKernel<<<s.blocks, s.threads, 0, stream>>>(dwpe, dout, batch, seq, channels);
    return cudaGetLastError();
  }
  return cudaSuccess;
}

}  // namespace baton::cuda
