// Mixture-of-Experts routing (Switch / GShard / Mixtral style): the router's
// top-k with renormalised (Mixtral) or raw (Switch) gates, the
// capacity-limited dispatch plan, the
// permutation of tokens into per-expert buffers and back, the gated combine,
// and Switch Transformer's load-balancing loss, each with its backward.
//
// Shapes: N tokens, E experts, top-k K, hidden size H, capacity C (rows per
// expert buffer). Row-major: logits, probs [N,E]; expert, gate, slot [N,K];
// x, y [N,H]; expert buffers [E,C,H]. Choice j of token t is (t,j), at index
// t·K + j.
//
// Router, per token t:
//   p = softmax(z) = exp(z − max z) / Σ_e exp(z_e − max z)
//   expert[t,0..K) = the K largest p_e in descending order, equal values in
//                    ascending expert index (so equal logits pick the lowest
//                    indices)
//   renormalize = true (Mixtral's renormalised gates):
//     gate[t,j] = p_{e_j} / S,  S = Σ_j p_{e_j}  (Σ_j gate = 1, and gate = 1
//                    for K = 1)
//   renormalize = false (Switch Transformer's raw probabilities):
//     gate[t,j] = p_{e_j}  (the float probability itself, bit for bit)
// The selection itself is piecewise constant and has no gradient. Renormalised,
// the gates are the softmax of the selected logits alone, so
//   dz_{e_j} = g_j · (dg_j − Σ_i g_i dg_i),   dz_e = 0 for unselected e;
// for K = 1 the gate is the constant 1 and dz = 0: such a router learns only
// from the auxiliary loss. Raw, the gates are entries of the softmax over all
// E logits, so (∂p_i/∂z_e = p_i (δ_ie − p_e)) every logit gets a gradient:
//   dz_e = p_e · (a_e − Σ_j p_{e_j} dg_j),  a_e = dg_j if e = e_j is chosen,
//                                            else 0,
// and a K = 1 router learns from the loss through its one gate (Switch).
//
// Dispatch: ExpertCapacity gives C; PlanDispatch walks the choices in the
// order (j = 0, t = 0..N), (j = 1, t = 0..N), … so every token's first choice
// claims a place before any second choice (GShard's priority), and gives
// (t,j) the next free row slot[t,j] of its expert's buffer, or −1 (dropped)
// when that buffer already holds C rows.
//   Permute:  expert_in[e_j, slot] = x[t] for every kept (t,j); other rows 0
//   Combine:  y[t] = Σ_{kept j} gate[t,j] · expert_out[e_j, slot[t,j]]
// A token whose every choice is dropped gets y = 0; the caller's residual
// connection carries it. Backward:
//   PermuteBackward: dx[t] = Σ_{kept j} dexpert_in[e_j, slot[t,j]]
//   CombineBackward: dexpert_out[e_j, slot[t,j]] = gate[t,j] · dy[t],
//                    dgate[t,j] = dy[t] · expert_out[e_j, slot[t,j]],
//                    both 0 where nothing is kept.
//
// Load balancing (Switch Transformer, eq. 4, generalised to top-k):
//   loss = coef · E · Σ_e f_e · P_e
//   f_e = #{(t,j) : expert[t,j] = e} / (N·K)   (before capacity drops)
//   P_e = (1/N) Σ_t p[t,e]
// f is a constant of the backward (it is a count), so through the softmax
//   dz[t,e] = p[t,e] · (c_e − Σ_e' p[t,e'] c_e'),  c_e = coef · E · f_e / N.
// Uniform probabilities with perfectly balanced routing give loss = coef;
// everything on one expert with all its probability gives coef · E.
//
// Loops run in fixed index order with no threads: fixed shapes give fixed
// bits. The softmax sums, the gate renormalisation, the router backward's
// dot products (Σ g_i dg_i, Σ p_{e_j} dg_j), dgate's dot products and the
// loss's sums go in double precision; the K-term sums of Combine and
// PermuteBackward in float, in j order. Preconditions (the caller
// validates): 1 ≤ K ≤ E; logits finite; expert indices in [0, E); slot[t,j]
// as written by PlanDispatch for the same expert array and capacity (so no
// two kept choices share a row, and slot < C); C < 2³¹; capacity_factor ≥ 0.
// A token routed twice to the same expert (not something RouterTopK
// produces) takes two rows of that expert's buffer.
#ifndef BATON_KERNELS_CPU_MOE_H_
#define BATON_KERNELS_CPU_MOE_H_

#include <cstdint>

namespace baton::kernels::cpu {

// The slot of a dropped choice (its expert's buffer was full).
inline constexpr int32_t kDroppedSlot = -1;

// Writes probs [N,E], expert [N,K] and gate [N,K] from logits [N,E]; the
// gates renormalised over the K chosen (renormalize) or the chosen
// probabilities themselves (!renormalize). probs and expert do not depend
// on renormalize.
void RouterTopK(float* probs, int32_t* expert, float* gate, const float* logits, int64_t tokens,
                int64_t experts, int64_t k, bool renormalize);

// Overwrites dlogits [N,E] with the gradient through the gates given
// dgate [N,K], from expert, gate and probs as RouterTopK wrote them with the
// same renormalize. The renormalised form reads only expert and gate (probs
// may be null then); the raw form reads expert and probs (gate may be null).
void RouterTopKBackward(float* dlogits, const float* dgate, const int32_t* expert,
                        const float* gate, const float* probs, int64_t tokens, int64_t experts,
                        int64_t k, bool renormalize);

// Rows per expert buffer: ceil(capacity_factor · N · K / E), the product
// taken in double precision and snapped to the nearest integer when within a
// relative 1e-9 of it, so that a decimal factor lands where its written value
// does (1.1 · 100 / 10 is 11.000000000000002 in double: 11 rows, not 12).
// capacity_factor = 0 means dropless and returns N · K, which no expert can
// exceed.
int64_t ExpertCapacity(int64_t tokens, int64_t experts, int64_t k, double capacity_factor);

// Writes slot [N,K] (a row in [0, capacity) or kDroppedSlot) and counts [E]
// (kept choices per expert, ≤ capacity) for expert [N,K].
void PlanDispatch(int32_t* slot, int64_t* counts, const int32_t* expert, int64_t tokens,
                  int64_t experts, int64_t k, int64_t capacity);

// Overwrites expert_in [E,capacity,H] with the kept tokens of x [N,H]; rows
// no choice fills are 0.
void Permute(float* expert_in, const float* x, const int32_t* expert, const int32_t* slot,
             int64_t tokens, int64_t experts, int64_t k, int64_t hidden, int64_t capacity);

// Overwrites dx [N,H] from dexpert_in [E,capacity,H]; the kept choices of a
// token add in j order, and a token with none gets 0.
void PermuteBackward(float* dx, const float* dexpert_in, const int32_t* expert, const int32_t* slot,
                     int64_t tokens, int64_t k, int64_t hidden, int64_t capacity);

// Overwrites y [N,H] with the gated sum of the token's kept expert outputs
// from expert_out [E,capacity,H], added in j order.
void Combine(float* y, const float* expert_out, const float* gate, const int32_t* expert,
             const int32_t* slot, int64_t tokens, int64_t k, int64_t hidden, int64_t capacity);

// Overwrites dexpert_out [E,capacity,H] (0 in rows no choice fills) and
// dgate [N,K] (0 for dropped choices) from dy [N,H].
void CombineBackward(float* dexpert_out, float* dgate, const float* dy, const float* expert_out,
                     const float* gate, const int32_t* expert, const int32_t* slot, int64_t tokens,
                     int64_t experts, int64_t k, int64_t hidden, int64_t capacity);

// Returns the load-balancing loss and overwrites dlogits_aux [N,E] with its
// gradient w.r.t. the logits (add it to the router's dlogits). Needs N ≥ 1.
double LoadBalancingLoss(float* dlogits_aux, const float* probs, const int32_t* expert,
                         int64_t tokens, int64_t experts, int64_t k, float coef);

// Overwrites routed [E] with the number of choices routed to each expert,
// before capacity drops (N·K in all).
void ExpertTokenCounts(int64_t* routed, const int32_t* expert, int64_t tokens, int64_t experts,
                       int64_t k);

}  // namespace baton::kernels::cpu

#endif  // BATON_KERNELS_CPU_MOE_H_
