// GptStage: one pipeline stage of a decoder-only transformer (GPT-2 or
// Llama, StageConfig::model.arch) on one tensor-parallel rank.
//
// Layout (pre-norm): x → [norm → causal attention → +x] → [norm → MLP → +x],
// repeated for the stage's contiguous block range; the first stage also holds
// the token (GPT-2: and position) embeddings, the last the final norm, the LM
// head and the cross-entropy loss. The two architectures share the stage and
// differ only inside the sub-blocks (Norm, AttentionForward, MlpForward and
// their backwards):
//   GPT-2: LayerNorm; fused qkv projection with bias; learned positions; GELU
//          MLP of 4·C with biases; the head tied to the token embedding.
//   Llama: RMSNorm (norm_eps); separate q, k, v projections, k and v with
//          kv_heads heads (grouped-query attention), rotary positions
//          (rope_theta) applied by kernels::RopePack, which also expands the
//          key/value heads into the packed qkv the attention kernels read;
//          SwiGLU MLP down(silu(gate(x)) · up(x)) of ffn_dim; no biases; an
//          untied head "lm_head.weight" unless tie_embeddings. Parameter
//          names are Hugging Face's less "model." (StageParameterSpecs).
//
// Tensor parallelism (Megatron): QKV (Llama: q, k and v, by query and by
// key/value heads, so tp divides kv_heads) and MLP fc (Llama: gate and up)
// are column-parallel (heads and hidden units split over the TP group), the
// attention and MLP output
// projections row-parallel; forward all-reduces after each of the two
// row-parallel products, backward all-reduces the input gradients of the two
// column-parallel ones. Embeddings, LayerNorms, biases of the row-parallel
// layers and the LM head are replicated; their inputs and gradients are the
// same on every TP rank, so their gradients agree without communication.
// With StageConfig::vocab_parallel the token embedding and the tied head are
// instead split by vocabulary rows: the embedding output is all-reduced, the
// loss is a sharded cross-entropy (an all-gather of per-shard log-sum-exps and
// an all-reduce of target logits), and the head's input gradient is
// all-reduced.
//
// Tied embedding with PP > 1: the last stage keeps its own copy of the token
// embedding ("wte") for the head, initialised identically. The two copies'
// gradients must be summed (SyncTiedEmbeddingGrad over a two-rank group of
// first and last stage) before the optimizer step; both then take the same
// AdamW step and stay equal. With PP = 1 one tensor serves both uses.
//
// Loss: next-token cross-entropy over the scored positions, those whose
// target is not kernels::kIgnoreTarget (-1); ignored positions contribute no
// loss and no gradient. The step's objective is the mean over its
// StageConfig::microbatches microbatches of each microbatch's mean loss over
// its scored tokens, so microbatch mb's loss gradient is scaled by
// 1 / (scored_mb · microbatches). The scale depends only on the microbatch's
// targets, never on the layout, so every TP/PP layout computes exactly the
// unsharded model's gradient; with data parallelism the replicas' gradients
// are averaged (each replica runs the same number of microbatches). When
// every microbatch scores the same number of tokens (all of baton's data
// sources do) the objective is the plain mean over the step's scored tokens,
// which is what score() reports as loss_sum / tokens.
//
// Device: every op runs through kernels/ops.h on the stage's ExecContext
// (StageConfig::device, one stream); the stage never branches on the device.
// The TP collectives and the tied-embedding sum run on that stream too
// (comm/stream_collectives.h: a host function over Gloo or the in-process
// communicator, the NCCL op over NCCL), so forward and backward never wait on
// the host; only CUDA memory over a host communicator (Gloo staging) still
// synchronises the stream and waits for the op. A collective's failure
// (DEADLINE_EXCEEDED after StageConfig::comm_timeout, ABORTED), named after
// what it carries ("tensor-parallel all-reduce of the attention output in
// block 3"), is returned by the call when it is already known (the CPU runs
// the op inline), else by the next ReadStepResults / TakeStepResults; after
// it the stage posts no further collective until ZeroGrad.
// Inputs tokens and targets are host int32 tensors; activations, outputs and
// gradients passed in and out live on the device. Outputs are complete once
// stream() has passed them (the caller synchronises or waits on an event).
//
// Precision (StageConfig::precision, kernels/backend.h §6). With bf16 the
// stage keeps fp32 master weights, gradients and AdamW moments plus a bf16
// copy of every GEMM weight (the QKV, attention-output, MLP and LM-head
// matrices), written by AdamW each step and rounded from the master weights
// at Create and by RefreshBf16Weights (after a restore). The LayerNorm
// outputs, qkv, attention's saved state and its output, the GELU output and
// the gradients entering GEMMs are bf16; the residual stream, the GEMM
// outputs feeding the residual, GELU and the loss, LayerNorm/GELU/softmax/
// loss math, bias gradients, every TP all-reduce and the gradient norm stay
// fp32. The stage's input and output activations and their gradients (the
// pipeline messages) are bf16 tensors: activation_dtype().
//
// Sequence parallelism (StageConfig::sequence_parallel, Megatron's SP): each
// TP rank keeps rows [r · n/tp, (r + 1) · n/tp) of the microbatch's n =
// batch · seq tokens in the residual stream, the norms (and their saved
// statistics) and the biases after the row-parallel GEMMs. Where TP
// all-reduces a partial sum (attention and MLP outputs, their input
// gradients, a vocabulary-parallel embedding and LM-head input gradient) SP
// reduce-scatters it; the norm outputs entering the column-parallel GEMMs and
// the output gradients entering the row-parallel ones are all-gathered; the
// norm outputs are kept as this rank's rows and gathered again for the
// weight gradients (BackwardWeight), as Megatron does. The stage's input
// and output messages stay whole [B, T, C]: a rank takes its rows of its
// input and all-gathers its output and input gradient. The norm weights see
// only this rank's rows, so after the step's last BackwardWeight (the
// microbatches-th since ZeroGrad) their gradients are summed over the TP
// group. Temporaries of the SP path (the partial sums before a
// reduce-scatter, the gathered norm outputs) live in an arena reset per
// block, so only what backward reads stays with the microbatch.
//
// Mixture of Experts (GptConfig::moe(); proto MoeSpec has the math): the
// MLP of an MoE block is E bias-free expert MLPs (the arch's MLP: GELU, or
// SwiGLU) behind a replicated router. Per microbatch: logits = ln2 · Wrᵀ,
// softmax top-k (renormalised gates for k > 1, the probability for k = 1),
// the dispatch plan (capacity, or dropless), the tokens permuted into
// per-expert buffers as long as the fullest expert's (the counts come to the
// host: one synchronisation per MoE block and microbatch; each expert's
// GEMMs run on the rows it got), the gated combine. The Switch
// load-balancing loss accumulates on the device (MoeAuxLossSum) and its
// logit gradient, weighted 1 / microbatches like the cross-entropy, joins
// the router's in the backward. TP: every rank routes the whole tokens
// alike; each expert is split like the dense MLP (fc rows, fc2 columns), so
// the combine is a partial sum over TP and the gate gradients are summed
// over TP; the router's input gradient joins the TP sum from rank 0 only.
// Expert parallelism (StageConfig::ep_size > 1): this rank holds E/ep of
// the experts; after routing and permuting its own tokens it all-gathers the
// ep group's kept counts, sends each rank the kept rows of that rank's
// experts, packed (an AllToAllV, host memory after a stream
// synchronisation; the buffers' padding rows do not travel), runs its
// experts on every source's rows, and sends the outputs back the same way;
// the backward exchanges the output gradients and the input gradients
// likewise. Each expert's weight gradient then sums every ep rank's tokens'
// share; the executor reduces it over the expert-data-parallel group only.
//
// Context parallelism (StageConfig::cp_size > 1; Liu et al.'s ring
// attention with the load-balanced causal split, context_parallel.h): the
// stage sees its CP rank's view of every microbatch, two chunks of each
// sequence as the two halves of a [2B, T/(2cp)] batch; everything but
// attention works on it row by row, the GPT-2 position embedding and RoPE
// take each half's global offset. Attention: this rank's q against every
// rank's k and v, which pass around the cp group's ring (each step's
// send/receive posted before the step's block attentions, so the transfer
// runs behind them); the blocks' outputs merge by their log-sum-exps
// (kernels::MergeAttentionBlock), in ring order, so the bits are fixed. A
// block no query can see (wholly in the causal future) is skipped. The
// backward passes the k and v around again, each block's dk/dv accumulator
// travelling one hop behind it (received while this rank computes its share,
// added, sent on) and arriving home after cp hops. Saved per block: qkv,
// the output and the log-sum-exps [B, H, T] (not P). The parameters'
// gradients here are this rank's tokens' share: the executor averages them
// over the cp ranks with the dp replicas (one dp · cp group). Under bf16
// the blocks read the bf16 qkv, and k and v travel the ring in bf16; the
// block outputs merge in fp32, the dq and dk/dv accumulators (which travel
// too) are fp32, and the output and the qkv gradient round to bf16 once
// each (kernels/ops.h, bf16 ring inputs: the CPU computes on the exact fp32
// images, CUDA runs cuDNN's SDPA with stats on the blocks it applies to).
// On CUDA the ring passes device memory to the communicator after a stream
// synchronisation per transfer (NCCL's or Gloo's staging).
//
// Per microbatch: Forward(mb) stashes what backward needs in an arena from a
// pool (for attention, what the device's attention path keeps:
// kernels::AttentionBuffersFor — P [B,H,T,T], or with cuDNN's fused bf16
// attention only the softmax statistics and the output); BackwardInput(mb) computes the input gradient (plus the cheap bias and
// LayerNorm gradients); BackwardWeight(mb) runs the weight-gradient GEMMs and
// the embedding gradient and returns the arena; Backward(mb) does both.
// Gradients accumulate across microbatches until ZeroGrad().
// When the device cannot hold a microbatch's activations (the arena cannot
// grow), Forward / BackwardInput return RESOURCE_EXHAUSTED naming the
// microbatch, the block, the device and the bytes, and what to lower
// (train.micro_batch_size, model.seq_len) — never an abort. A failed Forward
// releases its microbatch; after a failed BackwardInput the step is broken:
// the caller drops it with DropInFlight and starts the next with ZeroGrad
// (partial gradients are discarded there; no optimizer step ran).
//
// Not thread-safe: one thread drives a stage.
#ifndef BATON_WORKER_MODEL_GPT_STAGE_H_
#define BATON_WORKER_MODEL_GPT_STAGE_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/arena.h"
#include "kernels/ops.h"
#include "kernels/tensor.h"
#include "worker/comm/communicator.h"
#include "worker/comm/stream_collectives.h"
#include "worker/model/gpt_config.h"
#include "worker/model/parameters.h"
#include "worker/model/step_score.h"

namespace baton::model {

// Under context parallelism (StageConfig::cp_size > 1) B and T below are
// those of the rank's view of the microbatch (context_parallel.h): B = 2 ·
// micro_batch_size rows, T = model.seq_len / (2 · cp) tokens each.
struct StageInputs {
  kernels::Tensor tokens;       // first stage: int32 [B, T]
  kernels::Tensor activations;  // other stages: [B, T, C] of activation_dtype(), from the previous stage
  kernels::Tensor targets;      // last stage: int32 [B, T], next-token ids or -1 (ignored)
};

class GptStage {
 public:
  // `tp_group` has config.tp_size ranks (this one is config.tp_rank); it may be
  // null when tp_size == 1. `cp_group` likewise has config.cp_size ranks
  // (this one config.cp_rank), null when cp_size == 1. Parameters are
  // initialised from config.seed.
  // `ep_group`: config.ep_size ranks (this one config.ep_rank) of the
  // stage's expert-parallel group, null when ep_size == 1.
  static absl::StatusOr<std::unique_ptr<GptStage>> Create(const StageConfig& config,
                                                          comm::Communicator* tp_group,
                                                          comm::Communicator* cp_group = nullptr,
                                                          comm::Communicator* ep_group = nullptr);
  ~GptStage();
  GptStage(const GptStage&) = delete;
  GptStage& operator=(const GptStage&) = delete;

  // Runs microbatch `mb` forward. Non-last stages write their output
  // activations [B, T, C] into `output`. Last stages compute the loss.
  absl::Status Forward(int mb, const StageInputs& inputs, const kernels::Tensor& output);
  // Forward only, for sampling (worker/generate.h): a last stage writes the
  // logits of every position, float32 [B, T, V] on config.device (V: this
  // rank's vocabulary columns, all of model.vocab unless vocabulary-parallel),
  // into `logits`; inputs.targets is not read. No loss, no accuracy, nothing
  // kept for backward: the step accumulators and gradients are untouched.
  // Between steps only (FAILED_PRECONDITION while a microbatch is in flight),
  // because it resets the op scratch arena, as ZeroGrad does, so that calls
  // in a loop do not grow it. Causal attention: position t's logits depend on
  // tokens 0..t only. Complete once stream() has passed them.
  absl::Status ForwardLogits(const StageInputs& inputs, const kernels::Tensor& logits);
  // The dtype of `inputs.activations`, `output`, `grad_output` and
  // `grad_input`: float32, or bf16 for a bf16 stage.
  kernels::DType activation_dtype() const { return bf16_ ? kernels::DType::kBFloat16 : kernels::DType::kFloat32; }
  // Rounds the master weights into their bf16 copies (a no-op for fp32), for
  // after the values were set other than by OptimizerStep (a restore,
  // ParameterStore::SetFull). Enqueued on stream().
  void RefreshBf16Weights();

  // `grad_output` [B, T, C] is the gradient of the output (ignored on the
  // last stage); non-first stages write the gradient of their input
  // activations into `grad_input`.
  absl::Status BackwardInput(int mb, const kernels::Tensor& grad_output,
                             const kernels::Tensor& grad_input);
  absl::Status BackwardWeight(int mb);
  absl::Status Backward(int mb, const kernels::Tensor& grad_output,
                        const kernels::Tensor& grad_input);

  // Last stage: mean loss over the scored tokens of the microbatches run
  // forward since ZeroGrad() (0 when none was scored).
  double MeanLoss() const;
  // MoE: the load-balancing losses of this stage's MoE blocks, summed over
  // the blocks and the microbatches run forward since ZeroGrad() (0 for a
  // dense model). The objective holds them weighted 1 / microbatches. Waits
  // for the stream (a host synchronisation).
  double MoeAuxLossSum() const;
  // MoE: per expert, the choices routed to it and those kept (capacity)
  // since ZeroGrad(), summed over this stage's MoE blocks (host counts;
  // empty for a dense model).
  const std::vector<int64_t>& moe_routed() const { return moe_routed_; }
  const std::vector<int64_t>& moe_kept() const { return moe_kept_; }
  // Last stage: loss, scored tokens and argmax hits since ZeroGrad(); the same
  // on every TP rank. Zero on other stages. Waits for the stage's stream (a
  // host synchronisation; the loss and hits accumulate on the device).
  StepScore score() const;

  // Starts a step: zeroes the gradients and accumulators and forgets a
  // collective failure not yet read (the caller waited for the stream's
  // earlier work, as the executor does after a failed step).
  void ZeroGrad();
  // Releases every microbatch still in flight (after a failed or discarded
  // step), so the next step starts clean.
  void DropInFlight();
  // This rank's share of the squared global gradient norm (see
  // ParameterSpec::counts_in_norm).
  // With the optimizer state sharded over DP (StageConfig::dp_size > 1):
  // the norm of the shard's reduced gradient (ParameterStore::shard_grads),
  // this rank's share of the DP group's.
  double LocalGradSqNorm() const;
  // score() and LocalGradSqNorm() together with ONE host synchronisation:
  // the norm is computed on the stream, the loss, hits and norm are copied to
  // the host, then the stream is waited for once. On return the stream has
  // finished every op enqueued before the call. The stream's error, if any,
  // else the first failed collective's since the last read (reported once).
  absl::Status ReadStepResults(StepScore* score, double* grad_sq_norm);
  // ReadStepResults in two halves, for a caller that waits for several
  // streams at once: EnqueueStepResults computes the norm and copies loss,
  // hits and norm to host memory of the stage, on the stream, without a host
  // wait; TakeStepResults returns them, and may be called only after the
  // host waited for work that covers the stream's (a synchronisation of this
  // stream, or of one that waited on an event recorded after the copies).
  void EnqueueStepResults();
  // The first failed collective's error since the last read (once), if any.
  absl::Status TakeStepResults(StepScore* score, double* grad_sq_norm);
  // Sums the two copies of the tied embedding gradient over `group`, a
  // two-rank group of this TP rank's first (rank 0) and last (rank 1) stage.
  // Only for PP > 1, on the first and last stage.
  absl::Status SyncTiedEmbeddingGrad(comm::Communicator& group);
  // In-place sum of `t` (on this stage's device) over `group`, in stream
  // order like the tied embedding's sum (its errors come with the step's
  // results).
  absl::Status SumOverGroup(comm::Communicator& group, const kernels::Tensor& t, const std::string& name);
  // One AdamW step on every parameter with gradients multiplied by
  // `grad_scale` (the clip factor). Weight decay applies to matrices only.
  absl::Status OptimizerStep(const kernels::AdamWConfig& config, float grad_scale);

  ParameterStore& parameters() { return params_; }
  const ParameterStore& parameters() const { return params_; }
  // Expert parallelism (config.ep_size > 1): how many trailing elements of
  // the flat buffers hold this rank's experts (ParameterSpec::expert); 0
  // otherwise, when every parameter is reduced over the data-parallel group.
  int64_t expert_elements() const;
  // AdamW steps taken (the bias-correction step of the next one minus 1);
  // set when restoring a captured state.
  int64_t optimizer_step() const { return step_; }
  void set_optimizer_step(int64_t step) { step_ = step; }
  // The stream the stage's ops run on (config.device). Outputs written by
  // Forward / BackwardInput are complete once it has passed them.
  kernels::Stream& stream() { return *stream_; }
  const kernels::ExecContext& context() const { return ctx_; }
  int64_t microbatches_in_flight() const { return static_cast<int64_t>(in_flight_.size()); }
  // Times the activation arenas asked the system for memory; flat once the
  // arenas have grown to a step's high-water mark.
  int64_t activation_system_allocations() const;
  // The most activation bytes in use at once since ZeroGrad: the stashes of
  // the microbatches in flight plus the SP temporaries, sampled after every
  // Forward and BackwardInput (the arenas' used bytes, not their capacity).
  int64_t activation_bytes() const { return activation_high_water_; }

 private:
  struct Block;
  struct ExpertRows;
  struct BlockActivations;
  struct Microbatch;

  GptStage(const StageConfig& config, comm::Communicator* tp_group, comm::Communicator* cp_group,
           ParameterStore params);
  void BindParameters();
  void BindLlamaParameters();
  // The block's norm of `x` (LayerNorm, or RMSNorm for Llama, whose `b` is
  // null and which leaves `mean` unset) into `out` (of the GEMM dtype) and
  // the saved statistics, in `arena`.
  absl::Status Norm(kernels::Arena& arena, const kernels::Tensor& x, const Parameter* w, const Parameter* b,
                    kernels::Tensor* out, kernels::Tensor* mean, kernels::Tensor* rstd);
  // dx += the norm's input gradient; w's (and b's) gradients accumulate.
  void NormBackward(const kernels::Tensor& dx, const Parameter* w, const Parameter* b, const kernels::Tensor& dout,
                    const kernels::Tensor& x, const kernels::Tensor& mean, const kernels::Tensor& rstd);
  // Parameters, stream and accumulators onto config_.device.
  absl::Status PlaceOnDevice();

  // `logits_only` (ForwardLogits): a last stage needs no targets.
  absl::Status ValidateInputs(const StageInputs& inputs, const kernels::Tensor& output,
                              int64_t* batch, int64_t* seq, bool logits_only = false) const;
  // Adds the last stage's loss, scored tokens and hits to `score`; with
  // `logits` (ForwardLogits, last stage) copies the logits there instead and
  // scores nothing.
  absl::Status RunForward(Microbatch& s, const StageInputs& inputs, const kernels::Tensor& output,
                          StepScore* score, const kernels::Tensor* logits = nullptr);
  absl::Status ScoreVocabularyParallel(Microbatch& s, float grad_scale);
  // BackwardInput after its argument checks.
  absl::Status RunBackwardInput(Microbatch& s, const kernels::Tensor& grad_output,
                                const kernels::Tensor& grad_input);
  absl::Status BlockForward(const Block& block, Microbatch& mb, BlockActivations& a);
  // The sub-blocks: from a.ln1 (a.ln2) to the all-reduced projection that
  // joins the residual stream.
  absl::StatusOr<kernels::Tensor> AttentionForward(const Block& block, Microbatch& mb, BlockActivations& a);
  absl::StatusOr<kernels::Tensor> MlpForward(const Block& block, Microbatch& mb, BlockActivations& a);
  // Their input gradients (before the TP all-reduce) from the residual
  // stream's gradient after them.
  absl::StatusOr<kernels::Tensor> MlpBackwardInput(const Block& block, Microbatch& mb, BlockActivations& a,
                                                   const kernels::Tensor& d_out);
  absl::StatusOr<kernels::Tensor> AttentionBackwardInput(const Block& block, Microbatch& mb, BlockActivations& a,
                                                         const kernels::Tensor& d_mid);
  // Mixture of Experts (an MoE block's MLP; see Mixture of Experts above):
  // forward from a.ln2 (whole) to the TP sum of the gated expert outputs;
  // backward to the MLP input's gradient (a partial sum over TP); the
  // experts' and the router's weight gradients from `ln2` (whole).
  absl::StatusOr<kernels::Tensor> MoeForward(const Block& block, Microbatch& mb, BlockActivations& a);
  absl::StatusOr<kernels::Tensor> MoeBackwardInput(const Block& block, Microbatch& mb, BlockActivations& a,
                                                   const kernels::Tensor& d_out);
  absl::Status MoeBackwardWeight(const Block& block, const BlockActivations& a, const kernels::Tensor& ln2);
  // The rows this rank's experts compute, from the kept counts per expert of
  // this rank's tokens: without EP its own buffer's; under EP each ep rank's
  // slab of this rank's experts (an all-gather of the counts first).
  absl::Status PlanExpertRows(const Block& block, const std::vector<int64_t>& kept, BlockActivations& a);
  // Copies the kept rows of `buffer` [E·cap, ·] (this rank's per-expert
  // layout) into `packed` [Σ ep_send_rows, ·] in rank order (pack), or back
  // (unpack; the padding rows untouched).
  void PackExpertRows(const BlockActivations& a, const kernels::Tensor& buffer, const kernels::Tensor& packed,
                      bool pack);
  // The kept rows of `buffer` to the ranks holding their experts, packed,
  // into `to` [Σ ep_recv_rows, ·] (the rows a.expert_rows index); and the
  // experts' rows `rows` back into this rank's `buffer` (padding zeroed).
  // The packed send or receive buffer comes from `arena`.
  absl::Status SendToExperts(kernels::Arena& arena, const BlockActivations& a, const kernels::Tensor& buffer,
                             const kernels::Tensor& to, const char* what, int block);
  absl::Status ReturnFromExperts(kernels::Arena& arena, const BlockActivations& a, const kernels::Tensor& rows,
                                 const kernels::Tensor& buffer, const char* what, int block);
  // AllToAllV over the ep group of `from`'s rows (send_rows[r] rows to rank
  // r, in rank order) into `to` (recv_rows[r] from rank r), after a stream
  // synchronisation; errors name `what` and the block.
  absl::Status ExchangeExpertRows(const kernels::Tensor& from, const std::vector<int64_t>& send_rows,
                                  const kernels::Tensor& to, const std::vector<int64_t>& recv_rows, const char* what,
                                  int block);
  // Context parallelism: ring attention over the cp group from a.qkv into
  // a.y, keeping the log-sum-exps in a.att; and its backward from dy into
  // a.dqkv (see Context parallelism above).
  absl::Status RingAttentionForward(const Block& block, Microbatch& mb, BlockActivations& a);
  absl::Status RingAttentionBackward(const Block& block, Microbatch& mb, BlockActivations& a,
                                     const kernels::Tensor& dy);
  // Sends `send` to the next cp rank and receives the previous rank's into
  // `recv` (both on the host once the stream is synchronised); returns the
  // pending transfer, waited for by AwaitRing.
  struct RingTransfer;
  absl::StatusOr<RingTransfer> StartRing(const kernels::Tensor& send, const kernels::Tensor& recv);
  absl::Status AwaitRing(RingTransfer& transfer, const char* what, int block);
  // The pieces: a fresh tag (every cp rank draws the same sequence), a send
  // to the next rank after a stream synchronisation, the previous rank's
  // index, and a wait naming the transfer.
  uint64_t NextRingTag();
  absl::StatusOr<std::shared_ptr<comm::Work>> SendToNext(const kernels::Tensor& t, uint64_t tag);
  int PrevCpRank() const;
  // The exact fp32 image of a bf16 tensor, allocated in `arena`; an fp32
  // tensor is returned as it is. The ring's backward takes δ from the images
  // of the output and its gradient; MoE routes and exchanges the image of
  // the bf16 MLP input.
  // MoE under context parallelism: the load-balancing loss over every cp
  // rank's tokens (the whole sequences'); a.dlogits_aux gets this rank's rows.
  absl::Status CpLoadBalancingLoss(const Block& b, kernels::Arena& arena, BlockActivations& a);
  absl::StatusOr<kernels::Tensor> Fp32Image(kernels::Arena& arena, const kernels::Tensor& t) const;
  absl::Status AwaitRingWork(comm::Work& work, const char* what, int block, bool sending);
  // The global position of the first token of half `half` of a CP view of
  // `seq`-token rows (0 without CP).
  int64_t HalfOffset(int half, int64_t seq) const;
  absl::Status BlockBackwardInput(const Block& block, Microbatch& mb, BlockActivations& a,
                                  const kernels::Tensor& d_out, const kernels::Tensor& d_in);
  absl::Status BlockBackwardWeight(const Block& block, const BlockActivations& a);
  // On the stream (see Device above). `block` names the block in errors; -1
  // for none.
  absl::Status AllReduceTp(const kernels::Tensor& t, const char* what, int block);
  absl::Status AllGatherTp(const kernels::Tensor& in, const kernels::Tensor& out, const char* what);
  // Sequence parallelism: out [n/tp, c] = this rank's rows of the sum of
  // every rank's `in` [n, c].
  absl::Status ReduceScatterTp(const kernels::Tensor& in, const kernels::Tensor& out, const char* what, int block);
  // The two: on the stream where the communicator can run them from it,
  // else after a stream synchronisation on the host.
  enum class TpMove { kAllGather, kReduceScatter };
  absl::Status MoveOverTp(TpMove move, const kernels::Tensor& in, const kernels::Tensor& out,
                          const std::string& name);
  // The TP sum of a GEMM's partial output `partial` [n, c]: `partial` itself,
  // all-reduced; under SP this rank's rows of the sum, in the SP arena.
  absl::StatusOr<kernels::Tensor> SumOverTp(const kernels::Tensor& partial, const char* what, int block);
  // Norm() for a GEMM's input: `whole` [n, c] is what the GEMM reads and
  // `rows` what the microbatch keeps; without SP both are the norm output
  // (in `arena`); under SP `rows` is the norm of this rank's rows (in
  // `arena`, the statistics too) and `whole` every rank's rows gathered, a
  // temporary.
  absl::Status NormForGemm(kernels::Arena& arena, const kernels::Tensor& x, const Parameter* w, const Parameter* b,
                           kernels::Tensor* whole, kernels::Tensor* rows, kernels::Tensor* mean,
                           kernels::Tensor* rstd, const char* what, int block);
  // Under SP `t` [n, c] every rank's rows gathered from this rank's `rows`
  // (in `arena`); otherwise `rows` itself.
  absl::StatusOr<kernels::Tensor> GatherRows(kernels::Arena& arena, const kernels::Tensor& rows, const char* what,
                                             int block);
  // Rows of the residual stream this rank holds of n tokens: n, or n / tp
  // under SP; and this rank's rows of a whole [n, c] tensor (a view).
  int64_t ResidualRows(int64_t n) const { return sp_ ? n / config_.tp_size : n; }
  kernels::Tensor OwnRows(const kernels::Tensor& whole, int64_t n) const;
  // SP: the norm weights' gradients summed over the TP group (each rank's
  // saw its rows only), in one all-reduce.
  absl::Status SumNormGradsOverTp();
  // A sum of `t` over `coll`'s group on the stream, or, where it cannot run
  // from the stream, after a stream synchronisation on the host.
  absl::Status AllReduceOnStream(comm::StreamCollectives& coll, const kernels::Tensor& t, const std::string& name);
  absl::StatusOr<Microbatch*> Find(int mb, const char* op);
  // The tensor a GEMM reads for `p`: its bf16 copy for a bf16 stage, else
  // its value.
  const kernels::Tensor& W(const Parameter* p) const;
  // `t` as a GEMM input: itself (fp32), or a bf16 copy in `arena`.
  absl::StatusOr<kernels::Tensor> ForGemm(kernels::Arena& arena, const kernels::Tensor& t) const;

  StageConfig config_;
  comm::Communicator* tp_;
  std::shared_ptr<comm::StreamCollectives> tp_collectives_;  // of tp_; shared with the rank's other chunks
  // The first failure of a collective run on the stream.
  const std::shared_ptr<comm::StreamCommStatus> comm_status_ = std::make_shared<comm::StreamCommStatus>();
  ParameterStore params_;
  const bool vocab_parallel_;  // config.vocab_parallel with tp > 1
  const int64_t vocab_begin_;  // first vocabulary row of this rank's wte
  const bool bf16_;            // config.precision is kBFloat16
  const bool llama_;           // config.model.arch is kLlama
  const bool sp_;              // config.sequence_parallel (tp > 1)
  comm::Communicator* cp_;     // the context-parallel group (cp_size > 1), else null
  comm::Communicator* ep_ = nullptr;  // the expert-parallel group (ep_size > 1), else null
  uint64_t cp_tag_ = 0;        // ring messages sent since Create: every cp rank counts the same
  // Ring attention's temporaries (block outputs, the travelling k/v and
  // their gradients), reset per attention call.
  std::unique_ptr<kernels::Arena> cp_scratch_;
  const kernels::DType gemm_dtype_;  // of GEMM inputs and attention tensors
  std::vector<Block> blocks_;
  Parameter* wte_ = nullptr;  // token embedding: first stage, and the tied head's copy on the last
  Parameter* head_ = nullptr;  // last stage: the LM head (wte_ when tied, else Llama's lm_head)
  Parameter* wpe_ = nullptr;   // GPT-2's position embedding (first stage)
  Parameter* lnf_w_ = nullptr;
  Parameter* lnf_b_ = nullptr;
  int64_t step_ = 0;
  StepScore score_;  // tokens only; loss and hits in the accumulators
  std::unique_ptr<kernels::Stream> stream_;
  // Op temporaries (ExecContext::scratch), on config.device; reset at
  // ZeroGrad, between steps.
  std::unique_ptr<kernels::Arena> scratch_;
  // SP temporaries (see Sequence parallelism above), reset per block.
  std::unique_ptr<kernels::Arena> sp_scratch_;
  int backward_weights_ = 0;  // BackwardWeight calls since ZeroGrad
  int64_t activation_high_water_ = 0;  // see activation_bytes()
  void SampleActivationBytes();
  kernels::ExecContext ctx_;
  kernels::Tensor loss_acc_, hits_acc_, norm_acc_;  // float64 / int64 / float64 [1] on config.device
  kernels::Tensor aux_acc_;                         // float32 [1]: MoE load-balancing losses (MoeAuxLossSum)
  std::vector<int64_t> moe_routed_, moe_kept_;      // per expert, since ZeroGrad
  // Host copies of the three, written on the stream by EnqueueStepResults
  // (and by score() and LocalGradSqNorm, which then wait once),
  // in pinned memory (kernels::PinnedHostZeros) viewed as HostResults.
  struct HostResults {
    double loss_sum, sq;
    int64_t hits;
  };
  kernels::Tensor host_results_;
  HostResults& Results() const { return *static_cast<HostResults*>(host_results_.address()); }
  absl::flat_hash_map<int, std::unique_ptr<Microbatch>> in_flight_;
  std::vector<std::unique_ptr<Microbatch>> free_;  // arenas kept for reuse
  // A microbatch's state from free_ (or a new one) for a [batch, seq] forward.
  std::unique_ptr<Microbatch> TakeMicrobatch(int64_t batch, int64_t seq);
  // Enqueues this rank's share of the squared gradient norm into norm_acc_.
  void AccumulateGradSqNorm() const;
};

// Parameter specs of one stage, in the order the stage stores them.
std::vector<ParameterSpec> StageParameterSpecs(const StageConfig& config);

// `status`, and when the device or host ran out of memory
// (kernels::IsOutOfMemory: an arena block, or an op's stream scratch
// reported by the stream) what to lower so the stage fits. Said once.
absl::Status WithOutOfMemoryAdvice(const absl::Status& status);

}  // namespace baton::model

#endif  // BATON_WORKER_MODEL_GPT_STAGE_H_
