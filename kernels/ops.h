// Tensor-level kernel entry points: check shapes and devices, then dispatch
// through the Backend of the context's device (kernels/backend.h, which holds
// the contract: streams, memory, precision, determinism). Every op has a form
// taking an ExecContext, which enqueues on ctx.stream and requires every
// defined tensor to live on ctx.device (Copy excepted), and a context-free
// form that runs on the CPU (ExecContext::Host()). Shape or device mismatches
// are programming errors and abort with the op's name.
//
// Conventions: activations are [rows, channels] with rows = batch·seq, except
// attention, which needs [batch, seq, ...]. Linear weights are [out, in].
// *Backward functions add (+=) into parameter gradients; input gradients are
// overwritten unless the function says it accumulates. Ops that reduce to a
// scalar add into a one-element accumulator tensor (float64 or int64) on the
// context's device; their context-free forms return the value.
#ifndef BATON_KERNELS_OPS_H_
#define BATON_KERNELS_OPS_H_

#include "kernels/backend.h"
#include "kernels/cpu/adamw.h"
#include "kernels/cpu/cross_entropy.h"
#include "kernels/cpu/moe.h"
#include "kernels/tensor.h"

namespace baton::kernels {

using cpu::AdamWConfig;
using cpu::kDroppedSlot;
using cpu::kIgnoreTarget;
using cpu::kMaxArgmaxVocab;

// tokens int32 [B,T]; wte [V,C] or the shard of rows [vocab_begin,
// vocab_begin + wte.dim(0)) (other tokens contribute zero); wpe [≥T,C] or
// undefined (no position term); out [B·T,C].
void Embedding(const Tensor& out, const Tensor& tokens, const Tensor& wte, int64_t vocab_begin,
               const Tensor& wpe);
// Either gradient may be undefined to skip it. dwte and dwpe accumulate
// (+=), and only dwpe's rows [0, T) are touched, so a sequence chunk at
// global positions [p, p + T) (context parallelism) passes wpe.Rows(p, p + T)
// to Embedding and dwpe.Rows(p, p + T) here (both forms, every backend).
void EmbeddingBackward(const Tensor& dwte, int64_t vocab_begin, const Tensor& dwpe,
                       const Tensor& dout, const Tensor& tokens);

// x, out [N,C]; mean, rstd [N]; weight, bias [C]. dx accumulates.
void LayerNorm(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& x,
               const Tensor& weight, const Tensor& bias);
void LayerNormBackward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                       const Tensor& dout, const Tensor& x, const Tensor& weight,
                       const Tensor& mean, const Tensor& rstd);

// out [N,O] = x [N,I] · weight[O,I]ᵀ (+ bias [O] when defined).
void Linear(const Tensor& out, const Tensor& x, const Tensor& weight, const Tensor& bias);
void LinearBackwardInput(const Tensor& dx, const Tensor& dout, const Tensor& weight,
                         bool accumulate);
void LinearBackwardWeight(const Tensor& dweight, const Tensor& dout, const Tensor& x);
// out [N,O] += bias [O] on every row.
void AddBias(const Tensor& out, const Tensor& bias);
void BiasBackward(const Tensor& dbias, const Tensor& dout);

void Gelu(const Tensor& out, const Tensor& x);
void GeluBackward(const Tensor& dx, const Tensor& x, const Tensor& dout);

// qkv [B,T,3C], out [B,T,C], att [B,H,T,T] (P); scratch holds ≥ T·T floats
// (on the CPU: AttentionBuffersFor(Host(), ...) says so).
void Attention(const Tensor& out, const Tensor& att, const Tensor& qkv, int heads);
void AttentionBackward(const Tensor& dqkv, const Tensor& scratch, const Tensor& dout,
                       const Tensor& qkv, const Tensor& att, int heads);

void Residual(const Tensor& out, const Tensor& a, const Tensor& b);
// da and db accumulate; either may be undefined.
void ResidualBackward(const Tensor& da, const Tensor& db, const Tensor& dout);

// logits [N,V] are overwritten by d(loss)/d(logits) · grad_scale; targets
// int32 [N], each in [0, V) or kIgnoreTarget (no loss, zero gradient).
// Returns the loss summed over scored rows.
double SoftmaxCrossEntropy(const Tensor& logits_to_grad, const Tensor& targets, float grad_scale);

// Vocabulary-parallel cross-entropy in two steps around an all-gather of `lse`
// into lse_all [shards, N] and an all-reduce-sum of `target_logit`; see
// kernels/cpu/cross_entropy.h. logits [N, V/shards] hold columns from
// vocab_begin; row_max, lse, target_logit [N].
void ShardedCrossEntropyStats(const Tensor& logits_to_exp, const Tensor& targets,
                              int64_t vocab_begin, const Tensor& row_max, const Tensor& lse,
                              const Tensor& target_logit);
double ShardedCrossEntropyFinish(const Tensor& exp_to_grad, const Tensor& targets,
                                 int64_t vocab_begin, const Tensor& row_max, const Tensor& lse_all,
                                 const Tensor& target_logit, float grad_scale);

// Accuracy (see kernels/cpu/cross_entropy.h): logits [N, V'] holding
// vocabulary columns from vocab_begin → per row the largest logit and the
// vocabulary index of its first occurrence, max and index float [N]. Run it
// before the cross-entropy overwrites the logits.
void ShardArgmax(const Tensor& logits, int64_t vocab_begin, const Tensor& max,
                 const Tensor& index);
// Scored rows whose first maximum over every shard is the target, from
// max_all and index_all [shards, N] (rank-major) and targets int32 [N].
int64_t CountArgmaxHits(const Tensor& max_all, const Tensor& index_all, const Tensor& targets);

void AdamW(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
           const AdamWConfig& config, int64_t step, float grad_scale);

double SumOfSquares(const Tensor& x);
void Scale(const Tensor& x, float factor);

// ---- On an execution context (any device; see the forms above for shapes) ----

// dst = src, same byte count; each may be host memory or memory on
// ctx.device (host<->device copies are stream-ordered: a host source must stay
// unchanged, and a host destination unread, until the stream has passed the
// copy).
void Copy(const ExecContext& ctx, const Tensor& dst, const Tensor& src);
void FillZero(const ExecContext& ctx, const Tensor& dst);
// float32 <-> bfloat16 (round to nearest even, kernels/bfloat16.h), same
// element count; same dtypes copy.
void Cast(const ExecContext& ctx, const Tensor& dst, const Tensor& src);
// out: int64 [1] on ctx.device. When the stream reaches the op (not when the
// host enqueues it), writes the time then in microseconds on the host's Unix
// clock (absl::Now), plus `offset_us` (e.g. coordinator clock - local clock):
// the CPU reads the clock inline, the simulated device on its stream thread,
// CUDA in a kernel from the %globaltimer register mapped onto the host clock
// (kernels/cuda/stamp.cuh). For timestamps that travel with pipeline
// messages in device memory (worker/executor.h).
void StampTime(const ExecContext& ctx, const Tensor& out, int64_t offset_us);

void Embedding(const ExecContext& ctx, const Tensor& out, const Tensor& tokens, const Tensor& wte,
               int64_t vocab_begin, const Tensor& wpe);
void EmbeddingBackward(const ExecContext& ctx, const Tensor& dwte, int64_t vocab_begin,
                       const Tensor& dwpe, const Tensor& dout, const Tensor& tokens);
void LayerNorm(const ExecContext& ctx, const Tensor& out, const Tensor& mean, const Tensor& rstd,
               const Tensor& x, const Tensor& weight, const Tensor& bias);
void LayerNormBackward(const ExecContext& ctx, const Tensor& dx, const Tensor& dweight,
                       const Tensor& dbias, const Tensor& dout, const Tensor& x,
                       const Tensor& weight, const Tensor& mean, const Tensor& rstd);
void Linear(const ExecContext& ctx, const Tensor& out, const Tensor& x, const Tensor& weight,
            const Tensor& bias);
void LinearBackwardInput(const ExecContext& ctx, const Tensor& dx, const Tensor& dout,
                         const Tensor& weight, bool accumulate);
void LinearBackwardWeight(const ExecContext& ctx, const Tensor& dweight, const Tensor& dout,
                          const Tensor& x);
void AddBias(const ExecContext& ctx, const Tensor& out, const Tensor& bias);
void BiasBackward(const ExecContext& ctx, const Tensor& dbias, const Tensor& dout);
void Gelu(const ExecContext& ctx, const Tensor& out, const Tensor& x);
void GeluBackward(const ExecContext& ctx, const Tensor& dx, const Tensor& x, const Tensor& dout);
// What to allocate for attention over qkv [batch, seq, 3·channels] of `dtype`
// with `heads` heads on ctx's device: att (`saved`, `saved_dtype`) and the
// backward's scratch (`backward_scratch` floats), as the backend's path needs
// them. CPU and sim, and CUDA's GEMM + softmax path (fp32, or bf16 without
// cuDNN): P [B,H,T,T] of dtype (T·T floats of scratch on the CPU and sim;
// none on CUDA, which uses its stream's scratch). CUDA's fused bf16 path
// (cuDNN SDPA): the softmax statistics (B·H·T fp32) and a copy of the output
// in one flat bf16 buffer (kernels/cuda/sdpa_plan.h), no T×T tensor.
// Attention and AttentionBackward on ctx accept an att of this dtype with at
// least this many elements.
AttentionBuffers AttentionBuffersFor(const ExecContext& ctx, int64_t batch, int64_t seq,
                                     int64_t channels, int heads, DType dtype);
void Attention(const ExecContext& ctx, const Tensor& out, const Tensor& att, const Tensor& qkv,
               int heads);
void AttentionBackward(const ExecContext& ctx, const Tensor& dqkv, const Tensor& scratch,
                       const Tensor& dout, const Tensor& qkv, const Tensor& att, int heads);
void Residual(const ExecContext& ctx, const Tensor& out, const Tensor& a, const Tensor& b);
void ResidualBackward(const ExecContext& ctx, const Tensor& da, const Tensor& db,
                      const Tensor& dout);
// loss_sum: float64 [1] on ctx.device; += the loss summed over scored rows.
void SoftmaxCrossEntropy(const ExecContext& ctx, const Tensor& logits_to_grad,
                         const Tensor& targets, float grad_scale, const Tensor& loss_sum);
void ShardedCrossEntropyStats(const ExecContext& ctx, const Tensor& logits_to_exp,
                              const Tensor& targets, int64_t vocab_begin, const Tensor& row_max,
                              const Tensor& lse, const Tensor& target_logit);
void ShardedCrossEntropyFinish(const ExecContext& ctx, const Tensor& exp_to_grad,
                               const Tensor& targets, int64_t vocab_begin, const Tensor& row_max,
                               const Tensor& lse_all, const Tensor& target_logit, float grad_scale,
                               const Tensor& loss_sum);
void ShardArgmax(const ExecContext& ctx, const Tensor& logits, int64_t vocab_begin,
                 const Tensor& max, const Tensor& index);
// hits: int64 [1] on ctx.device; += the hits.
void CountArgmaxHits(const ExecContext& ctx, const Tensor& max_all, const Tensor& index_all,
                     const Tensor& targets, const Tensor& hits);
// param_bf16: undefined, or bf16 [param.numel()] receiving the new values.
void AdamW(const ExecContext& ctx, const Tensor& param, const Tensor& grad, const Tensor& m,
           const Tensor& v, const AdamWConfig& config, int64_t step, float grad_scale,
           const Tensor& param_bf16 = Tensor());
// sum: float64 [1] on ctx.device; += Σ x².
void SumOfSquares(const ExecContext& ctx, const Tensor& x, const Tensor& sum);
void Scale(const ExecContext& ctx, const Tensor& x, float factor);

// ---- Llama blocks (context forms only; ExecContext::Host() runs them on the CPU) ----

// RMSNorm over the last dimension (Hugging Face's LlamaRMSNorm, in fp32):
//   rstd = 1 / sqrt(Σ x² / C + eps),  out = x · rstd · weight.
// x [N,C] fp32, weight [C], rstd [N] fp32 (saved for the backward), out [N,C]
// fp32 or bf16 (rounded once).
void RmsNorm(const ExecContext& ctx, const Tensor& out, const Tensor& rstd, const Tensor& x,
             const Tensor& weight, float eps);
// With x̂ = x · rstd and g = dout · weight:
//   dx += rstd · (g − x̂ · mean(g · x̂)),  dweight += Σ_rows dout · x̂
// (dx and dweight accumulate; rows in order, so dweight is deterministic).
// dout, x fp32 [N,C].
void RmsNormBackward(const ExecContext& ctx, const Tensor& dx, const Tensor& dweight,
                     const Tensor& dout, const Tensor& x, const Tensor& weight, const Tensor& rstd);

// SwiGLU: out = silu(gate) · up, silu(a) = a · sigmoid(a); gate, up, out
// fp32 [N,F].
void SwiGlu(const ExecContext& ctx, const Tensor& out, const Tensor& gate, const Tensor& up);
// dgate = dout · up · silu'(gate), dup = dout · silu(gate) (overwritten),
// silu'(a) = sigmoid(a) · (1 + a · (1 − sigmoid(a))). All fp32 [N,F].
void SwiGluBackward(const ExecContext& ctx, const Tensor& dgate, const Tensor& dup,
                    const Tensor& dout, const Tensor& gate, const Tensor& up);

// Rotary position embedding and grouped-query expansion into the packed qkv
// that Attention reads. q [B·T, H·D], k and v [B·T, KV·D] fp32, rows
// batch-major (row = b·T + t); H = heads, KV = kv_heads dividing H, D =
// head_dim (even); qkv [B, T, 3·H·D] fp32 or bf16 (rounded once), laid out as
// Attention wants: q heads, then k heads, then v heads, each head D wide.
// Query head h reads key/value head h / (H / KV) (Hugging Face's repeat_kv).
// q and k are rotated at position pos = position_offset + t (t: the row's
// index in its sequence; position_offset ≥ 0 is the global position of row
// 0, e.g. of a context-parallel rank's chunk, and 0 gives exactly the bits of
// the op before the offset existed) by rotate-half (Hugging Face Llama): for
// i < D/2,
//   inv_freq_i = fl(1 / fl(theta ^ fl(2i / D))),  angle = fl(pos · inv_freq_i)
// (fl: rounded to float32, as transformers computes them), and
//   (x_i, x_{i+D/2}) → (x_i cos(angle) − x_{i+D/2} sin(angle),
//                       x_{i+D/2} cos(angle) + x_i sin(angle)).
// v is copied unrotated.
void RopePack(const ExecContext& ctx, const Tensor& qkv, const Tensor& q, const Tensor& k,
              const Tensor& v, int heads, int kv_heads, float theta,
              int64_t position_offset = 0);
// The adjoint of RopePack: from dqkv [B, T, 3·H·D] (fp32 or bf16) writes
// (overwrites) dq [B·T, H·D] and dk, dv [B·T, KV·D] (fp32 or bf16, rounded
// once): q and k rotated back by −angle (at the same positions as the
// forward: pass it the same position_offset), and each key/value head's
// gradient the sum of its query heads' in increasing head order
// (deterministic).
void RopePackBackward(const ExecContext& ctx, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                      const Tensor& dqkv, int heads, int kv_heads, float theta,
                      int64_t position_offset = 0);

// ---- Context-parallel (ring) attention (context forms only; fp32, or bf16 inputs) ----
//
// Causal attention over a sequence split into chunks held by different
// ranks, one key/value block at a time, with the math of
// kernels/cpu/block_attention.h (online softmax over log-sum-exp; backward
// from the final lse and δ). Layouts, with C = channels of q and
// heads | C (head h is the h-th C/heads-wide slice of q, k and v):
//   qkv [B, Tq, 3C]  packed as Attention reads it: q, then k, then v columns
//   kv  [B, Tk, 2C]  a key/value block: k, then v columns (KvOfQkv)
//   out [B, Tq, C],  lse, delta [B, heads, Tq]
// Query row i sits at global position q_offset + i, key row j at k_offset + j;
// j is visible to i iff k_offset + j ≤ q_offset + i. One rank's forward:
// BlockAttention of the first key block straight into (out, lse), then for
// each further block BlockAttention into (block_out, block_lse) and
// MergeAttentionBlock into (out, lse), blocks in any order (rows no block
// has reached yet have lse −∞, which merging handles). Backward: AttentionDelta from the final
// out, then for each key block BlockAttentionBackward with the final lse and
// delta, which adds the block's dq into dqkv and its dk, dv into that
// block's dkv (to be reduced back to the block's owner); the owner writes
// its summed dkv into its dqkv with QkvGradOfKv. q, k and v are read in
// place (row strides), never copied. Fixed shapes give fixed bits (Gemm and
// row-order loops; no threads of their own; on CUDA, fixed-order sums and no
// atomics: kernels/cuda/ring_attention.cuh, which recomputes scores per row
// and leaves `scratch` unused). On a backend without these kernels every op
// below aborts naming itself (CPU, sim and CUDA all have them).
//
// bf16 inputs (a bf16 stage's ring: qkv, kv, and in the backward dout and
// out, all bf16; out, lse, delta, dqkv, dkv and scratch stay fp32): the
// same math on the inputs' exact fp32 images, so the key/value blocks travel
// the ring in half the bytes. The CPU (and sim) compute exactly that: the
// fp32 ops' bits on the images. CUDA runs cuDNN's fused SDPA for a block
// where it applies (a fully visible block, or the diagonal one: Tq = Tk and
// q_offset = k_offset), which rounds that block's o and its dq, dk, dv to
// bf16 once before they are merged or accumulated in fp32; other blocks, or
// a GPU without cuDNN, take its fp32 kernels on the widened inputs.

// Floats of BlockAttention's and BlockAttentionBackward's `scratch` for a
// query block of q_len rows and a key block of k_len rows: Tq·Tk and
// 2·Tq·Tk.
int64_t BlockAttentionScratch(int64_t q_len, int64_t k_len);
int64_t BlockAttentionBackwardScratch(int64_t q_len, int64_t k_len);

// kv [B,T,2C] = qkv's k and v columns (overwrites kv); both fp32 or both bf16.
void KvOfQkv(const ExecContext& ctx, const Tensor& kv, const Tensor& qkv);
// One key/value block's attention for the queries in qkv's first C columns:
// writes (overwrites) out [B,Tq,C] and lse [B,heads,Tq]. A row that sees no
// key of the block gets out = 0, lse = −∞. q_offset, k_offset ≥ 0;
// scratch fp32 with ≥ BlockAttentionScratch(Tq, Tk) elements.
void BlockAttention(const ExecContext& ctx, const Tensor& out, const Tensor& lse,
                    const Tensor& qkv, const Tensor& kv, int heads, int64_t q_offset,
                    int64_t k_offset, const Tensor& scratch);
// Merges (block_out, block_lse) into the running (out, lse) in place (shapes
// as BlockAttention's). A block row with lse −∞ leaves the running row's bits
// as they are; a running row with lse −∞ takes the block's.
void MergeAttentionBlock(const ExecContext& ctx, const Tensor& out, const Tensor& lse,
                         const Tensor& block_out, const Tensor& block_lse, int heads);
// delta [B,heads,Tq] = Σ over each head's channels of dout ⊙ out (out the
// final merged output; dout, out [B,Tq,C]). Overwrites delta.
void AttentionDelta(const ExecContext& ctx, const Tensor& delta, const Tensor& dout,
                    const Tensor& out, int heads);
// One key/value block's share of the gradients: ACCUMULATES (+=) dq into
// dqkv's first C columns (its k and v columns untouched) and dk, dv into dkv
// [B,Tk,2C]. out [B,Tq,C] (dout's dtype), lse and delta are the final
// (merged) ones: the fp32 kernels read delta, cuDNN recomputes it from out;
// offsets as the forward's; scratch fp32 with ≥
// BlockAttentionBackwardScratch(Tq, Tk) elements. A block no query row sees
// adds nothing.
void BlockAttentionBackward(const ExecContext& ctx, const Tensor& dqkv, const Tensor& dkv,
                            const Tensor& dout, const Tensor& out, const Tensor& qkv,
                            const Tensor& kv,
                            const Tensor& lse, const Tensor& delta, int heads, int64_t q_offset,
                            int64_t k_offset, const Tensor& scratch);
// dqkv's k and v columns = dkv [B,T,2C] (overwritten; its q columns untouched).
void QkvGradOfKv(const ExecContext& ctx, const Tensor& dqkv, const Tensor& dkv);

// ---- Mixture of Experts routing (context forms only; fp32 data, int32 indices) ----
//
// The routing of a Mixture-of-Experts MLP with the math of
// kernels/cpu/moe.h (the formulas, the tie-breaking, the dispatch order and
// each backward are stated there). N tokens (N >= 1), E experts, top-k K
// (1 <= K <= E), hidden size H, Cap rows per expert buffer
// (MoeExpertCapacity). Shapes and dtypes, checked by every op:
//   logits, probs, dlogits, dlogits_aux    [N,E] fp32
//   expert, slot                           [N,K] int32
//   gate, dgate                            [N,K] fp32
//   x, y, dx, dy                           [N,H] fp32 (or [B,T,H], B·T = N)
//   expert_in, expert_out and their grads  [E,Cap,H] fp32
//   counts, routed                         [E] int64;  loss [1] fp32
// Row views (Tensor::Rows, Reshaped) are tensors like any other.
// Choice j of token t is (t,j). A layer's forward: RouterTopK; PlanDispatch
// (slot, counts); Permute x into expert_in; each expert on its [Cap,H]
// buffer; Combine into y (a token whose every choice was dropped gets 0: the
// caller's residual carries it). Its backward: CombineBackward; the experts'
// backward; PermuteBackward; RouterTopKBackward, plus LoadBalancingLoss's
// dlogits_aux, into the router's dlogits. The indices live on the device and
// are not checked: expert must hold RouterTopK's choices (or K distinct
// experts in [0, E) per token) and slot PlanDispatch's plan for that expert
// array, every kept slot below the buffers' Cap (PlanDispatch's capacity,
// or any Cap at least the largest of its counts). Loops run in fixed order
// with no atomics: fixed shapes give fixed bits, and the simulated device
// gives the CPU's. CUDA's kernels (kernels/cuda/moe.cuh) keep the CPU's
// summation orders with no atomics, written to give the CPU's bits but for
// RouterTopK's probs and gate (exp taken in float64 there, glibc's expf on
// the CPU: within a few ulp). On a backend without these kernels every op
// below aborts naming itself (CPU, sim and CUDA all have them).

// Rows per expert buffer (a host function): ceil(capacity_factor · N · K /
// E), a decimal factor landing where its written value does (1.1 · 100 / 10
// gives 11), or N · K (dropless: no expert can overflow) for
// capacity_factor = 0; see kernels/cpu/moe.h ExpertCapacity. Needs N >= 0,
// 1 <= K <= E, a finite capacity_factor >= 0, and a result below 2^31 (the
// slots are int32); aborts naming itself otherwise.
int64_t MoeExpertCapacity(int64_t tokens, int64_t experts, int64_t k, double capacity_factor);

// Writes probs = softmax(logits) per token, expert (the K most probable,
// most probable first, equal probabilities to the lower expert index) and
// gate: renormalize, p_{e_j} / Σ_j p_{e_j} (Mixtral; Σ_j gate = 1, and 1 for
// K = 1); !renormalize, p_{e_j} itself (Switch Transformer: a top-1 router
// then learns from the model's loss through its gate). probs and expert do
// not depend on renormalize.
void RouterTopK(const ExecContext& ctx, const Tensor& probs, const Tensor& expert,
                const Tensor& gate, const Tensor& logits, bool renormalize);
// Overwrites dlogits with the gradient through the gates given dgate, from
// RouterTopK's expert, gate and probs for the same renormalize (the
// selection itself has no gradient). Renormalised: 0 off the chosen experts,
// and everywhere for K = 1. Raw: dz_e = p_e · (a_e − Σ_j p_{e_j} dg_j) with
// a_e = dg_j for a chosen e = e_j, else 0, so every logit gets a gradient.
// The load-balancing loss's gradient is LoadBalancingLoss's; add it.
void RouterTopKBackward(const ExecContext& ctx, const Tensor& dlogits, const Tensor& dgate,
                        const Tensor& expert, const Tensor& gate, const Tensor& probs,
                        bool renormalize);
// Writes slot (each choice's row in its expert's buffer, or kDroppedSlot when
// that buffer already holds `capacity` rows; every token's first choice
// claims a row before any second choice, tokens in order) and counts (kept
// choices per expert, <= capacity). 0 <= capacity < 2^31.
void PlanDispatch(const ExecContext& ctx, const Tensor& slot, const Tensor& counts,
                  const Tensor& expert, int64_t capacity);
// Overwrites routed with the number of choices routed to each expert before
// capacity drops (N·K in all): the load balance, for metrics.
void ExpertTokenCounts(const ExecContext& ctx, const Tensor& routed, const Tensor& expert);
// Overwrites expert_in [E,Cap,H] (Cap = expert_in.dim(1)) with the kept
// tokens of x: row slot[t,j] of expert e_j is x[t]; rows no choice fills
// are 0.
void Permute(const ExecContext& ctx, const Tensor& expert_in, const Tensor& x, const Tensor& expert,
             const Tensor& slot);
// Overwrites dx: dx[t] = Σ over t's kept choices, in j order, of their rows
// of dexpert_in [E,Cap,H]; 0 for a token with none.
void PermuteBackward(const ExecContext& ctx, const Tensor& dx, const Tensor& dexpert_in,
                     const Tensor& expert, const Tensor& slot);
// Overwrites y: y[t] = Σ over t's kept choices, in j order, of
// gate[t,j] · expert_out[e_j, slot[t,j]]; 0 for a token with none.
void Combine(const ExecContext& ctx, const Tensor& y, const Tensor& expert_out, const Tensor& gate,
             const Tensor& expert, const Tensor& slot);
// Overwrites dexpert_out (gate[t,j] · dy[t] in each kept choice's row, 0 in
// rows no choice fills) and dgate (dy[t] · expert_out[e_j, slot[t,j]],
// summed in double; 0 for a dropped choice).
void CombineBackward(const ExecContext& ctx, const Tensor& dexpert_out, const Tensor& dgate,
                     const Tensor& dy, const Tensor& expert_out, const Tensor& gate,
                     const Tensor& expert, const Tensor& slot);
// Switch Transformer's load-balancing loss coef · E · Σ_e f_e · P_e (f_e:
// the share of the N·K choices routed to e before capacity drops; P_e: e's
// mean probability), from RouterTopK's probs and expert. ACCUMULATES: the
// loss, computed in double and rounded once to float, is added (+=, in
// float) to loss [1] fp32, so one device tensor can sum it over blocks and
// microbatches. OVERWRITES dlogits_aux with grad_scale times the loss's
// gradient w.r.t. the logits (f held constant, as Switch does; the fp32
// gradient multiplied by grad_scale in fp32); add it into the router's
// dlogits.
void LoadBalancingLoss(const ExecContext& ctx, const Tensor& loss, const Tensor& dlogits_aux,
                       const Tensor& probs, const Tensor& expert, float coef, float grad_scale);

}  // namespace baton::kernels

#endif  // BATON_KERNELS_OPS_H_
