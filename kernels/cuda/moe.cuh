// Mixture-of-Experts routing, fp32 data, int32 indices, int64 counts: the
// CUDA form of kernels/cpu/moe.h (the math, the tie-breaking, the dispatch
// order and each backward are stated there and in kernels/ops.h). N tokens,
// E experts, top-k K, hidden size H, Cap rows per expert buffer; choice j of
// token t is (t,j), at index i = t·K + j.
//   router     p = softmax(z), max subtracted: e_e = exp(z_e − max) in float,
//              S = Σ_e e_e in double (e in order), p_e = e_e · (1/S);
//              expert[t,·] = the K largest p, equal values to the lower index;
//              gate = p_{e_j} / Σ_j p_{e_j} (double, j in order) or p_{e_j}
//   backward   renormalised: dz_{e_j} = g_j (dg_j − Σ_i g_i dg_i), else 0;
//              raw: dz_e = p_e (a_e − Σ_j p_{e_j} dg_j)  (dots in double)
//   dispatch   slot[t,j] = #{earlier choices to e_j in the order (j=0, t=0..N),
//              (j=1, t=0..N), …}, or −1 when that is ≥ capacity;
//              counts[e] = min(routed_e, capacity)
//   permute    expert_in[e_j, slot] = x[t]; dx[t] = Σ_{kept j} dexpert_in[e_j, slot]
//   combine    y[t] = Σ_{kept j} gate[t,j] · expert_out[e_j, slot];
//              dexpert_out[e_j, slot] = gate[t,j] · dy[t],
//              dgate[t,j] = Σ_h dy[t,h] · expert_out[e_j, slot, h]  (double, h in order)
//   aux loss   c_e = routed_e · coef·E/(N·K)/N; loss += (float) Σ_e c_e Σ_t p[t,e]
//              (double: t in order, then e in order); dlogits_aux[t,e] =
//              (float)(p[t,e] (c_e − Σ_e' p[t,e'] c_e')) · grad_scale
//
// Parallelisation. RouterTopK and RouterTopKBackward: one warp per token,
// lanes over the experts; the max is a warp max (exact), the double sum runs
// through shuffles in expert order, the top-K is K rounds of a warp argmax
// under the order (p descending, index ascending), each round taking the best
// expert below the previous round's: O(E + K·E/32) per warp. PlanDispatch:
// one block per expert scanning all N·K choices in the dispatch order, a
// ballot/popcount scan per 256 choices carrying the running count;
// ExpertTokenCounts: one block per expert counting them. So O(E·N·K) reads
// in all and N·K/256 steps per block — cheap for the E of a model (≤ 1024)
// and the tokens of a microbatch, not meant for more. Permute and
// CombineBackward: a memset of the buffer, then one warp per choice (lanes
// over H), each kept row written by exactly one warp (PlanDispatch gives
// distinct rows); dgate's double dot runs in h order through shuffles.
// PermuteBackward and Combine: one warp per token, each lane's channels
// summed over j in order from 0. LoadBalancingLoss: one block per expert
// counts its choices and one thread sums its probability column (N serial
// double adds: the CPU's order, at the cost of N dependent adds per expert),
// then one thread adds the E terms into loss, then one warp per token writes
// dlogits_aux; c and the terms live in 2·E doubles of scratch
// (LoadBalancingLossScratchBytes).
//
// Determinism: no atomics; every floating-point sum has a fixed order, the
// one of kernels/cpu/moe.cc; integer counts are exact in any order; the
// double operations are explicitly rounded intrinsics (no contraction). So
// fixed shapes give fixed bits, and every op but RouterTopK gives the CPU's
// bits on the same inputs. RouterTopK takes exp in float64 and rounds it to
// float, where the CPU calls glibc's expf; the two differ by one ulp for
// about 1 in 10^4 arguments (glibc's expf is not correctly rounded), so
// probs and gate are the CPU's within a few ulp (1e-6 relative), and expert
// is the CPU's unless two probabilities are within that of each other.
//
// Indices outside the contract (an expert outside [0, E), a slot outside
// [0, Cap) other than −1) are treated as dropped choices, never written
// through; PlanDispatch gives such a choice slot −1.
#ifndef BATON_KERNELS_CUDA_MOE_CUH_
#define BATON_KERNELS_CUDA_MOE_CUH_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace baton::cuda {

// The slot of a dropped choice (kernels/cpu/moe.h kDroppedSlot).
inline constexpr int32_t kMoeDroppedSlot = -1;

// Bytes of LoadBalancingLoss's scratch for E experts (c_e and the loss terms).
inline size_t LoadBalancingLossScratchBytes(int64_t experts) {
  return 2 * static_cast<size_t>(experts < 1 ? 1 : experts) * sizeof(double);
}

// Writes probs [N,E], expert [N,K] and gate [N,K] from logits [N,E].
cudaError_t LaunchRouterTopK(float* probs, int32_t* expert, float* gate, const float* logits,
                             int64_t tokens, int64_t experts, int64_t k, bool renormalize,
                             cudaStream_t stream);

// Overwrites dlogits [N,E] from dgate [N,K] and RouterTopK's expert, gate
// (read when renormalize) and probs (read when not).
cudaError_t LaunchRouterTopKBackward(float* dlogits, const float* dgate, const int32_t* expert,
                                     const float* gate, const float* probs, int64_t tokens,
                                     int64_t experts, int64_t k, bool renormalize,
                                     cudaStream_t stream);

// Writes slot [N,K] and counts [E]; 0 ≤ capacity < 2^31.
cudaError_t LaunchPlanDispatch(int32_t* slot, int64_t* counts, const int32_t* expert,
                               int64_t tokens, int64_t experts, int64_t k, int64_t capacity,
                               cudaStream_t stream);

// Overwrites routed [E] with the choices routed to each expert.
cudaError_t LaunchExpertTokenCounts(int64_t* routed, const int32_t* expert, int64_t tokens,
                                    int64_t experts, int64_t k, cudaStream_t stream);

// Overwrites expert_in [E,cap,H] (0 where no choice lands) from x [N,H].
cudaError_t LaunchPermute(float* expert_in, const float* x, const int32_t* expert,
                          const int32_t* slot, int64_t tokens, int64_t experts, int64_t k,
                          int64_t hidden, int64_t cap, cudaStream_t stream);

// Overwrites dx [N,H] from dexpert_in [E,cap,H].
cudaError_t LaunchPermuteBackward(float* dx, const float* dexpert_in, const int32_t* expert,
                                  const int32_t* slot, int64_t tokens, int64_t experts, int64_t k,
                                  int64_t hidden, int64_t cap, cudaStream_t stream);

// Overwrites y [N,H] from expert_out [E,cap,H] and gate [N,K].
cudaError_t LaunchCombine(float* y, const float* expert_out, const float* gate,
                          const int32_t* expert, const int32_t* slot, int64_t tokens,
                          int64_t experts, int64_t k, int64_t hidden, int64_t cap,
                          cudaStream_t stream);

// Overwrites dexpert_out [E,cap,H] (0 where no choice lands) and dgate [N,K]
// (0 for dropped choices) from dy [N,H].
cudaError_t LaunchCombineBackward(float* dexpert_out, float* dgate, const float* dy,
                                  const float* expert_out, const float* gate,
                                  const int32_t* expert, const int32_t* slot, int64_t tokens,
                                  int64_t experts, int64_t k, int64_t hidden, int64_t cap,
                                  cudaStream_t stream);

// loss[0] += the loss (double, rounded once to float, added in float);
// overwrites dlogits_aux [N,E]. `scratch`: LoadBalancingLossScratchBytes(E)
// bytes of device memory, used by the kernels this enqueues.
cudaError_t LaunchLoadBalancingLoss(float* loss, float* dlogits_aux, const float* probs,
                                    const int32_t* expert, int64_t tokens, int64_t experts,
                                    int64_t k, float coef, float grad_scale, double* scratch,
                                    cudaStream_t stream);

}  // namespace baton::cuda

#endif  // BATON_KERNELS_CUDA_MOE_CUH_
