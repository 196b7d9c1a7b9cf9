#include "kernels/cuda/moe.cuh"

#include <math.h>

#include <cstdint>

#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch_math.h"

namespace baton::cuda {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;

// exp of a float argument taken in float64 and rounded once: the correctly
// rounded expf but in rare cases (the CPU calls glibc's expf; moe.cuh).
__device__ __forceinline__ float ExpOf(float x) {
  return __double2float_rn(exp(static_cast<double>(x)));
}

// Whether (e, slot) names a row of an [experts, cap, ·] buffer; anything
// else (kMoeDroppedSlot, or indices outside the contract) is a dropped choice.
__device__ __forceinline__ bool Kept(int32_t e, int32_t slot, int64_t experts, int64_t cap) {
  return e >= 0 && e < experts && slot >= 0 && slot < cap;
}

// (p, e) ranks above (q, f): larger probability, or equal and lower index.
__device__ __forceinline__ bool Above(float p, int32_t e, float q, int32_t f) {
  return p > q || (p == q && e < f);
}

// Warp per token t. Sums in the CPU's orders (moe.cuh).
__global__ void RouterTopKKernel(float* __restrict__ probs, int32_t* __restrict__ expert,
                                 float* __restrict__ gate, const float* __restrict__ logits,
                                 int64_t tokens, int64_t experts, int64_t k, bool renormalize) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarpSize);
  for (int64_t t = GlobalThread() / kWarpSize; t < tokens; t += warps) {
    const float* z = logits + t * experts;
    float* p = probs + t * experts;
    float max = -INFINITY;
    for (int64_t e = lane; e < experts; e += kWarpSize) max = fmaxf(max, z[e]);
    max = WarpMax(max);
    // S = Σ_e exp(z_e − max) in expert order: 32 at a time, lane s's term
    // added s-th (every lane adds the same terms in the same order).
    double sum = 0.0;
    for (int64_t base = 0; base < experts; base += kWarpSize) {
      const int64_t e = base + lane;
      const double v = e < experts ? static_cast<double>(ExpOf(__fsub_rn(z[e], max))) : 0.0;
      const int64_t valid = experts - base < kWarpSize ? experts - base : kWarpSize;
      for (int s = 0; s < valid; ++s) sum = __dadd_rn(sum, __shfl_sync(kFullMask, v, s));
    }
    const double inv = __ddiv_rn(1.0, sum);
    for (int64_t e = lane; e < experts; e += kWarpSize) {
      p[e] = __double2float_rn(
          __dmul_rn(static_cast<double>(ExpOf(__fsub_rn(z[e], max))), inv));
    }
    // Top-K: round j takes the best expert ranking below round j−1's (all
    // those above it are taken). A lane reads back only the p it wrote.
    float prev_p = INFINITY;
    int32_t prev_e = -1;
    double chosen = 0.0;  // Σ_j p_{e_j}, j in order
    for (int64_t j = 0; j < k; ++j) {
      float best_p = -1.0f;  // below every probability
      int32_t best_e = 0x7fffffff;
      for (int64_t e = lane; e < experts; e += kWarpSize) {
        const float q = p[e];
        const int32_t f = static_cast<int32_t>(e);
        if (Above(prev_p, prev_e, q, f) && Above(q, f, best_p, best_e)) {
          best_p = q;
          best_e = f;
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const float q = __shfl_xor_sync(kFullMask, best_p, o);
        const int32_t f = __shfl_xor_sync(kFullMask, best_e, o);
        if (Above(q, f, best_p, best_e)) {
          best_p = q;
          best_e = f;
        }
      }
      if (lane == 0) {
        expert[t * k + j] = best_e;
        gate[t * k + j] = best_p;  // renormalised below
      }
      chosen = __dadd_rn(chosen, static_cast<double>(best_p));
      prev_p = best_p;
      prev_e = best_e;
    }
    if (renormalize && lane == 0) {  // the gates lane 0 wrote above
      for (int64_t j = 0; j < k; ++j) {
        gate[t * k + j] = __double2float_rn(__ddiv_rn(static_cast<double>(gate[t * k + j]), chosen));
      }
    }
  }
}

// Warp per token t: lanes write the unchosen experts' gradient, then lane 0
// the chosen ones in j order (so a repeated expert takes its last choice's,
// as on the CPU).
__global__ void RouterTopKBackwardKernel(float* __restrict__ dlogits,
                                         const float* __restrict__ dgate,
                                         const int32_t* __restrict__ expert,
                                         const float* __restrict__ gate,
                                         const float* __restrict__ probs, int64_t tokens,
                                         int64_t experts, int64_t k, bool renormalize) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarpSize);
  for (int64_t t = GlobalThread() / kWarpSize; t < tokens; t += warps) {
    float* dz = dlogits + t * experts;
    const float* dg = dgate + t * k;
    const int32_t* top = expert + t * k;
    if (renormalize) {
      const float* g = gate + t * k;
      double dot = 0.0;  // Σ_i g_i dg_i (exact products)
      for (int64_t j = 0; j < k; ++j) {
        dot = __dadd_rn(dot, __dmul_rn(static_cast<double>(g[j]), static_cast<double>(dg[j])));
      }
      for (int64_t e = lane; e < experts; e += kWarpSize) dz[e] = 0.0f;
      __syncwarp();
      if (lane == 0) {
        for (int64_t j = 0; j < k; ++j) {
          if (top[j] < 0 || top[j] >= experts) continue;
          dz[top[j]] = __double2float_rn(__dmul_rn(
              static_cast<double>(g[j]), __dsub_rn(static_cast<double>(dg[j]), dot)));
        }
      }
      continue;
    }
    const float* p = probs + t * experts;
    double dot = 0.0;  // Σ_j p_{e_j} dg_j
    for (int64_t j = 0; j < k; ++j) {
      const float pj = top[j] >= 0 && top[j] < experts ? p[top[j]] : 0.0f;
      dot = __dadd_rn(dot, __dmul_rn(static_cast<double>(pj), static_cast<double>(dg[j])));
    }
    const double unchosen = __dsub_rn(0.0, dot);  // a_e = 0 (0 − dot, as the CPU: +0 for dot = 0)
    for (int64_t e = lane; e < experts; e += kWarpSize) {
      dz[e] = __double2float_rn(__dmul_rn(static_cast<double>(p[e]), unchosen));
    }
    __syncwarp();
    if (lane == 0) {
      for (int64_t j = 0; j < k; ++j) {
        const int32_t e = top[j];
        if (e < 0 || e >= experts) continue;
        dz[e] = __double2float_rn(__dmul_rn(static_cast<double>(p[e]),
                                            __dsub_rn(static_cast<double>(dg[j]), dot)));
      }
    }
  }
}

// The running total of `mine` over the block's threads before this one, and
// the block's total (*all), for one 256-choice step of a scan. `warp_counts`:
// 32 ints of shared memory. Contains __syncthreads.
__device__ __forceinline__ int64_t BlockExclusiveCount(bool mine, int* warp_counts, int64_t* all) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int warps = blockDim.x / kWarpSize;
  const unsigned ballot = __ballot_sync(kFullMask, mine);
  __syncthreads();  // the previous step has read warp_counts
  if (lane == 0) warp_counts[warp] = __popc(ballot);
  __syncthreads();
  int64_t before = __popc(ballot & ((1u << lane) - 1u)), total = 0;
  for (int w = 0; w < warps; ++w) {
    if (w < warp) before += warp_counts[w];
    total += warp_counts[w];
  }
  *all = total;
  return before;
}

// Block per expert e: the choices in dispatch order q = j·N + t (i = t·K + j),
// blockDim at a time; a choice of e takes its rank among e's earlier ones.
__global__ void PlanDispatchKernel(int32_t* __restrict__ slot, int64_t* __restrict__ counts,
                                   const int32_t* __restrict__ expert, int64_t tokens,
                                   int64_t experts, int64_t k, int64_t capacity) {
  __shared__ int warp_counts[kWarpSize];
  const int64_t choices = tokens * k;
  for (int64_t e = blockIdx.x; e < experts; e += gridDim.x) {
    int64_t routed = 0;  // e's choices before this step
    for (int64_t base = 0; base < choices; base += blockDim.x) {
      const int64_t q = base + threadIdx.x;
      int64_t i = 0;
      bool mine = false;
      if (q < choices) {
        const int64_t j = q / tokens;
        i = (q - j * tokens) * k + j;
        const int32_t x = expert[i];
        mine = x == e;
        // Outside the contract: dropped (block 0 writes it, once).
        if (e == 0 && (x < 0 || x >= experts)) slot[i] = kMoeDroppedSlot;
      }
      int64_t step = 0;
      const int64_t rank = routed + BlockExclusiveCount(mine, warp_counts, &step);
      if (mine) slot[i] = rank < capacity ? static_cast<int32_t>(rank) : kMoeDroppedSlot;
      routed += step;
    }
    if (threadIdx.x == 0) counts[e] = routed < capacity ? routed : capacity;
  }
}

// Block per expert e: the number of choices routed to e (any order: integers).
__device__ __forceinline__ int64_t BlockRouted(const int32_t* __restrict__ expert, int64_t choices,
                                               int64_t e, int64_t* shared) {
  int64_t n = 0;
  for (int64_t i = threadIdx.x; i < choices; i += blockDim.x) n += expert[i] == e ? 1 : 0;
  return BlockSum(n, shared);
}

__global__ void ExpertTokenCountsKernel(int64_t* __restrict__ routed,
                                        const int32_t* __restrict__ expert, int64_t choices,
                                        int64_t experts) {
  __shared__ int64_t shared[kWarpSize];
  for (int64_t e = blockIdx.x; e < experts; e += gridDim.x) {
    const int64_t n = BlockRouted(expert, choices, e, shared);
    if (threadIdx.x == 0) routed[e] = n;
  }
}

// Warp per choice i: copies x[t] into its row.
__global__ void PermuteKernel(float* __restrict__ expert_in, const float* __restrict__ x,
                              const int32_t* __restrict__ expert, const int32_t* __restrict__ slot,
                              int64_t choices, int64_t experts, int64_t k, int64_t hidden,
                              int64_t cap) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarpSize);
  for (int64_t i = GlobalThread() / kWarpSize; i < choices; i += warps) {
    const int32_t e = expert[i], s = slot[i];
    if (!Kept(e, s, experts, cap)) continue;
    float* dst = expert_in + (e * cap + s) * hidden;
    const float* src = x + (i / k) * hidden;
    for (int64_t h = lane; h < hidden; h += kWarpSize) dst[h] = src[h];
  }
}

// Warp per token t: out[t,h] = Σ_{kept j} w_j · rows_j[h], j in order from 0
// (w_j = 1 without gates: a plain sum, as PermuteBackward's).
__global__ void GatherSumKernel(float* __restrict__ out, const float* __restrict__ rows,
                                const float* __restrict__ gate, const int32_t* __restrict__ expert,
                                const int32_t* __restrict__ slot, int64_t tokens, int64_t experts,
                                int64_t k, int64_t hidden, int64_t cap) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarpSize);
  for (int64_t t = GlobalThread() / kWarpSize; t < tokens; t += warps) {
    for (int64_t h = lane; h < hidden; h += kWarpSize) {
      float acc = 0.0f;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t i = t * k + j;
        const int32_t e = expert[i], s = slot[i];
        if (!Kept(e, s, experts, cap)) continue;
        const float v = rows[(e * cap + s) * hidden + h];
        acc = __fadd_rn(acc, gate != nullptr ? __fmul_rn(gate[i], v) : v);
      }
      out[t * hidden + h] = acc;
    }
  }
}

// Warp per choice i: dexpert_out's row = gate · dy[t]; dgate = dy[t] · the
// expert's output row in double, h in order (the float products are exact in
// double; lane s's is added s-th).
__global__ void CombineBackwardKernel(float* __restrict__ dexpert_out, float* __restrict__ dgate,
                                      const float* __restrict__ dy,
                                      const float* __restrict__ expert_out,
                                      const float* __restrict__ gate,
                                      const int32_t* __restrict__ expert,
                                      const int32_t* __restrict__ slot, int64_t choices,
                                      int64_t experts, int64_t k, int64_t hidden, int64_t cap) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarpSize);
  for (int64_t i = GlobalThread() / kWarpSize; i < choices; i += warps) {
    const int32_t e = expert[i], s = slot[i];
    if (!Kept(e, s, experts, cap)) {
      if (lane == 0) dgate[i] = 0.0f;
      continue;
    }
    const int64_t row = (e * cap + s) * hidden;
    const float* dyt = dy + (i / k) * hidden;
    const float g = gate[i];
    double dot = 0.0;
    for (int64_t base = 0; base < hidden; base += kWarpSize) {
      const int64_t h = base + lane;
      double product = 0.0;
      if (h < hidden) {
        const float d = dyt[h];
        dexpert_out[row + h] = __fmul_rn(g, d);
        product = __dmul_rn(static_cast<double>(d), static_cast<double>(expert_out[row + h]));
      }
      const int64_t valid = hidden - base < kWarpSize ? hidden - base : kWarpSize;
      for (int s2 = 0; s2 < valid; ++s2) dot = __dadd_rn(dot, __shfl_sync(kFullMask, product, s2));
    }
    if (lane == 0) dgate[i] = __double2float_rn(dot);
  }
}

// Block per expert e: c_e = routed_e · scale, and its loss term c_e · Σ_t
// p[t,e] (t in order, one thread). scratch: c [E], then the terms [E].
__global__ void LoadBalancingTermsKernel(double* __restrict__ scratch,
                                         const float* __restrict__ probs,
                                         const int32_t* __restrict__ expert, int64_t tokens,
                                         int64_t experts, int64_t k, double scale) {
  __shared__ int64_t shared[kWarpSize];
  for (int64_t e = blockIdx.x; e < experts; e += gridDim.x) {
    const int64_t routed = BlockRouted(expert, tokens * k, e, shared);
    if (threadIdx.x == 0) {
      const double c = __dmul_rn(static_cast<double>(routed), scale);
      double column = 0.0;
      for (int64_t t = 0; t < tokens; ++t) {
        column = __dadd_rn(column, static_cast<double>(probs[t * experts + e]));
      }
      scratch[e] = c;
      scratch[experts + e] = __dmul_rn(c, column);
    }
  }
}

// One thread: loss[0] += (float) Σ_e term_e, e in order.
__global__ void LoadBalancingLossKernel(float* __restrict__ loss, const double* __restrict__ terms,
                                        int64_t experts) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  double sum = 0.0;
  for (int64_t e = 0; e < experts; ++e) sum = __dadd_rn(sum, terms[e]);
  loss[0] = __fadd_rn(loss[0], __double2float_rn(sum));
}

// Warp per token t: dz[t,e] = (float)(p_e (c_e − Σ_e' p_e' c_e')) · grad_scale;
// every lane forms the dot in expert order.
__global__ void LoadBalancingGradKernel(float* __restrict__ dlogits_aux,
                                        const float* __restrict__ probs,
                                        const double* __restrict__ c, int64_t tokens,
                                        int64_t experts, float grad_scale) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarpSize);
  for (int64_t t = GlobalThread() / kWarpSize; t < tokens; t += warps) {
    const float* p = probs + t * experts;
    double dot = 0.0;
    for (int64_t e = 0; e < experts; ++e) {
      dot = __dadd_rn(dot, __dmul_rn(static_cast<double>(p[e]), c[e]));
    }
    float* dz = dlogits_aux + t * experts;
    for (int64_t e = lane; e < experts; e += kWarpSize) {
      const float d = __double2float_rn(__dmul_rn(static_cast<double>(p[e]), __dsub_rn(c[e], dot)));
      dz[e] = __fmul_rn(d, grad_scale);
    }
  }
}

// N ≥ 1, 1 ≤ K ≤ E.
bool ValidChoices(int64_t tokens, int64_t experts, int64_t k) {
  return tokens >= 1 && k >= 1 && k <= experts;
}

// One block per expert (grid-stride past kMaxGridX experts).
LaunchShape ExpertBlocks(int64_t experts) {
  return LaunchShape{ClampGrid(experts), kThreadsPerBlock, 1};
}

}  // namespace

cudaError_t LaunchRouterTopK(float* probs, int32_t* expert, float* gate, const float* logits,
                             int64_t tokens, int64_t experts, int64_t k, bool renormalize,
                             cudaStream_t stream) {
  if (!ValidChoices(tokens, experts, k) || experts > INT32_MAX) return cudaErrorInvalidValue;
  const LaunchShape s = WarpPerRowLaunch(tokens);
  RouterTopKKernel<<<s.blocks, s.threads, 0, stream>>>(probs, expert, gate, logits, tokens,
                                                       experts, k, renormalize);
  return cudaGetLastError();
}

cudaError_t LaunchRouterTopKBackward(float* dlogits, const float* dgate, const int32_t* expert,
                                     const float* gate, const float* probs, int64_t tokens,
                                     int64_t experts, int64_t k, bool renormalize,
                                     cudaStream_t stream) {
  if (!ValidChoices(tokens, experts, k)) return cudaErrorInvalidValue;
  const LaunchShape s = WarpPerRowLaunch(tokens);
  RouterTopKBackwardKernel<<<s.blocks, s.threads, 0, stream>>>(dlogits, dgate, expert, gate, probs,
                                                               tokens, experts, k, renormalize);
  return cudaGetLastError();
}

cudaError_t LaunchPlanDispatch(int32_t* slot, int64_t* counts, const int32_t* expert,
                               int64_t tokens, int64_t experts, int64_t k, int64_t capacity,
                               cudaStream_t stream) {
  if (!ValidChoices(tokens, experts, k) || capacity < 0 || capacity > INT32_MAX) {
    return cudaErrorInvalidValue;
  }
  const LaunchShape s = ExpertBlocks(experts);
  PlanDispatchKernel<<<s.blocks, s.threads, 0, stream>>>(slot, counts, expert, tokens, experts, k,
                                                         capacity);
  return cudaGetLastError();
}

cudaError_t LaunchExpertTokenCounts(int64_t* routed, const int32_t* expert, int64_t tokens,
                                    int64_t experts, int64_t k, cudaStream_t stream) {
  if (!ValidChoices(tokens, experts, k)) return cudaErrorInvalidValue;
  const LaunchShape s = ExpertBlocks(experts);
  ExpertTokenCountsKernel<<<s.blocks, s.threads, 0, stream>>>(routed, expert, tokens * k, experts);
  return cudaGetLastError();
}

cudaError_t LaunchPermute(float* expert_in, const float* x, const int32_t* expert,
                          const int32_t* slot, int64_t tokens, int64_t experts, int64_t k,
                          int64_t hidden, int64_t cap, cudaStream_t stream) {
  if (!ValidChoices(tokens, experts, k) || hidden < 1 || cap < 0) return cudaErrorInvalidValue;
  const cudaError_t err =
      cudaMemsetAsync(expert_in, 0, experts * cap * hidden * sizeof(float), stream);
  if (err != cudaSuccess || cap == 0) return err;
  const LaunchShape s = WarpPerRowLaunch(tokens * k);
  PermuteKernel<<<s.blocks, s.threads, 0, stream>>>(expert_in, x, expert, slot, tokens * k,
                                                    experts, k, hidden, cap);
  return cudaGetLastError();
}

cudaError_t LaunchPermuteBackward(float* dx, const float* dexpert_in, const int32_t* expert,
                                  const int32_t* slot, int64_t tokens, int64_t experts, int64_t k,
                                  int64_t hidden, int64_t cap, cudaStream_t stream) {
  if (!ValidChoices(tokens, experts, k) || hidden < 1 || cap < 0) return cudaErrorInvalidValue;
  const LaunchShape s = WarpPerRowLaunch(tokens);
  GatherSumKernel<<<s.blocks, s.threads, 0, stream>>>(dx, dexpert_in, nullptr, expert, slot,
                                                      tokens, experts, k, hidden, cap);
  return cudaGetLastError();
}

cudaError_t LaunchCombine(float* y, const float* expert_out, const float* gate,
                          const int32_t* expert, const int32_t* slot, int64_t tokens,
                          int64_t experts, int64_t k, int64_t hidden, int64_t cap,
                          cudaStream_t stream) {
  if (!ValidChoices(tokens, experts, k) || hidden < 1 || cap < 0 || gate == nullptr) {
    return cudaErrorInvalidValue;
  }
  const LaunchShape s = WarpPerRowLaunch(tokens);
  GatherSumKernel<<<s.blocks, s.threads, 0, stream>>>(y, expert_out, gate, expert, slot, tokens,
                                                      experts, k, hidden, cap);
  return cudaGetLastError();
}

cudaError_t LaunchCombineBackward(float* dexpert_out, float* dgate, const float* dy,
                                  const float* expert_out, const float* gate,
                                  const int32_t* expert, const int32_t* slot, int64_t tokens,
                                  int64_t experts, int64_t k, int64_t hidden, int64_t cap,
                                  cudaStream_t stream) {
  if (!ValidChoices(tokens, experts, k) || hidden < 1 || cap < 0) return cudaErrorInvalidValue;
  const cudaError_t err =
      cudaMemsetAsync(dexpert_out, 0, experts * cap * hidden * sizeof(float), stream);
  if (err != cudaSuccess) return err;
  const LaunchShape s = WarpPerRowLaunch(tokens * k);
  CombineBackwardKernel<<<s.blocks, s.threads, 0, stream>>>(dexpert_out, dgate, dy, expert_out,
                                                            gate, expert, slot, tokens * k,
                                                            experts, k, hidden, cap);
  return cudaGetLastError();
}

cudaError_t LaunchLoadBalancingLoss(float* loss, float* dlogits_aux, const float* probs,
                                    const int32_t* expert, int64_t tokens, int64_t experts,
                                    int64_t k, float coef, float grad_scale, double* scratch,
                                    cudaStream_t stream) {
  if (!ValidChoices(tokens, experts, k) || scratch == nullptr) return cudaErrorInvalidValue;
  // The CPU's expression, in its order.
  const double n = static_cast<double>(tokens);
  const double scale = static_cast<double>(coef) * experts / (n * k) / n;
  const LaunchShape blocks = ExpertBlocks(experts);
  LoadBalancingTermsKernel<<<blocks.blocks, blocks.threads, 0, stream>>>(scratch, probs, expert,
                                                                         tokens, experts, k, scale);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  LoadBalancingLossKernel<<<1, kWarpSize, 0, stream>>>(loss, scratch + experts, experts);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const LaunchShape rows = WarpPerRowLaunch(tokens);
  LoadBalancingGradKernel<<<rows.blocks, rows.threads, 0, stream>>>(dlogits_aux, probs, scratch,
                                                                    tokens, experts, grad_scale);
  return cudaGetLastError();
}

}  // namespace baton::cuda
