#include "coordinator/memory_estimate.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "coordinator/job_spec.h"
#include "coordinator/schedule/builders.h"

namespace baton {
namespace {

constexpr double kFloat = 4;

// What attention keeps per block and microbatch (kernels::AttentionBuffersFor,
// which the worker's GptStage allocates): the probabilities P [B,H',T,T] in
// the GEMM inputs' precision, and on CPU and simulated devices T·T floats of
// backward scratch (CUDA uses its stream's scratch).
//
// On CUDA with bf16, a worker whose device runs cuDNN's fused attention
// (RegisterRequest.fused_attention_bf16, carried on its RankAssignment) keeps
// instead only the softmax statistics and a copy of the output: B·H'·T·4
// bytes padded to 256, then B·T·C'·2 bytes (kernels/cuda/sdpa_plan.h
// SdpaSavedBytes; 1.5 MiB per sequence and layer for GPT-2 small instead of
// P's 24 MiB). That is counted only where every rank of the stage reported it
// and the backend takes the fused path for the shape (SdpaApplies: a head
// dimension that is a multiple of 8, T ≥ 2); heads wider than 128 count P,
// since Ampere's cuDNN has no fused backward for them (Hopper's has, up to
// 256: an upper bound there). Otherwise P: without cuDNN the worker runs the
// GEMM + softmax path, and a fit check must not under-count.
//
// The fused backward's workspace (cuDNN's deterministic dP buffer,
// B·H'·⌈T/64⌉·64·⌈T/64⌉·64·2 bytes, sdpa_plan.h) is the stream's scratch:
// one microbatch's worth per chunk stream, not per microbatch; so is the
// GEMM path's (H'·T·T floats, and bf16, for one batch row):
// CudaStreamScratchBytes.
//
// The sizes are restated here, not called: the coordinator depends on proto,
// common and its own packages only (DESIGN.md §12; //kernels is not visible
// to it), and kernels::AttentionBuffersFor needs a live stream.
constexpr int64_t kFusedHeadDimMultiple = 8;   // sdpa_plan.h kSdpaHeadDimMultiple
constexpr int64_t kFusedMaxHeadDim = 128;      // cuDNN's bf16 SDPA backward on Ampere/Ada

struct AttentionTerms {
  double p_element_bytes = kFloat;
  bool backward_scratch = true;
  bool fused = false;  // stats + o's copy instead of P
};

// Whether the fused path takes attention of `heads` heads over d_model `c`
// and `seq` tokens (the head dimension does not change with TP).
bool FusedAttentionApplies(int64_t c, int64_t heads, int64_t seq) {
  if (heads <= 0 || c % heads != 0) return false;
  const int64_t hd = c / heads;
  return hd % kFusedHeadDimMultiple == 0 && hd <= kFusedMaxHeadDim && seq >= 2;
}

AttentionTerms AttentionTermsFor(const v1::JobSpec& job, const v1::Plan& plan, int pp_rank) {
  AttentionTerms t;
  const bool bf16 = job.train().precision() == "bf16";
  if (bf16) t.p_element_bytes = 2;
  // Scratch unless every rank of this stage is known to be a CUDA device;
  // fused only if every one of them also reported fused attention.
  bool all_cuda = false, all_fused = true;
  for (const v1::RankAssignment& r : plan.ranks()) {
    if (r.pp_rank() != pp_rank) continue;
    if (!absl::StartsWith(r.device(), "cuda")) return t;
    all_cuda = true;
    all_fused = all_fused && r.fused_attention_bf16();
  }
  t.backward_scratch = !all_cuda;
  const v1::ModelSpec& m = job.model();
  t.fused = bf16 && all_cuda && all_fused && FusedAttentionApplies(m.d_model(), m.heads(), m.seq_len());
  return t;
}

// One transformer block's widths on one TP rank, per token.
struct BlockShape {
  bool llama = false;
  double c = 0;    // d_model (the residual stream, replicated)
  double cl = 0;   // query (and attention output) channels: d_model / tp
  double kvl = 0;  // Llama: key (and value) channels, kv_heads · head_dim / tp; GPT-2: cl
  double fl = 0;   // MLP width / tp
};

BlockShape BlockShapeOf(const v1::ModelSpec& m, double tp) {
  BlockShape b;
  b.llama = m.arch() == "llama";
  b.c = m.d_model();
  b.cl = b.c / tp;
  const double kv_heads = m.has_kv_heads() ? m.kv_heads() : m.heads();
  b.kvl = b.llama ? kv_heads * (b.c / m.heads()) / tp : b.cl;
  b.fl = (m.has_ffn_dim() ? m.ffn_dim() : 4 * b.c) / tp;
  return b;
}

// Bytes of one microbatch's arena for one transformer block (forward stash
// plus backward temporaries; see GptStage::BlockForward / BlockBackward*).
// The block's input is the previous block's output (or the stage's x0), so
// it is not counted again.
//   GPT-2 forward: norm outputs and the residual stream (6 C), LayerNorm
//     mean and rstd (4), qkv (3 C') and y (C'), the MLP's fc and GELU (2 F');
//     backward: 3 C, the MLP gradient (F'), dy and dqkv (4 C').
//   Llama forward: the same 6 C, RMSNorm rstd (2), q (C'), k and v (2 KV'),
//     the packed rotated qkv (3 C'), y (C'), gate, up and SwiGLU (3 F');
//     backward: 3 C, dg, dgate and dup (3 F'), dy and dqkv (4 C'), dq (C'),
//     dk and dv (2 KV').
// With sequence parallelism (`sp`) the norm outputs, the residual stream and
// the norms' statistics keep n / tp rows (4 C / tp: the weight gradients
// gather the norm outputs again); the projections' outputs and the gathered
// norm outputs are per-block temporaries (the SP arena, counted once per
// chunk by the caller); backward keeps the gathered output gradients (2 C,
// read by the weight gradients) and the residual stream's rows (2 C / tp).
double BlockActivationBytes(double n, double b, double s, const BlockShape& w, double heads, double tp, bool sp,
                            const AttentionTerms& att) {
  const double c = w.c, cl = w.cl, fl = w.fl, h = heads / tp;
  const double rows = sp ? n / tp : n;  // of the residual stream and the norms' statistics
  const double stream_forward = sp ? 4 * rows * c : 6 * n * c;
  const double stream_backward = sp ? 2 * n * c + 2 * rows * c : 3 * n * c;
  double forward = 0, backward = 0;
  if (w.llama) {
    forward = kFloat * (stream_forward + 2 * rows + n * (5 * cl + 2 * w.kvl) + 3 * n * fl);
    backward = kFloat * (stream_backward + 3 * n * fl + n * (5 * cl + 2 * w.kvl));
  } else {
    forward = kFloat * (stream_forward + 4 * rows + 4 * n * cl + 2 * n * fl);
    backward = kFloat * (stream_backward + n * fl + 4 * n * cl);
  }
  const double saved = att.fused ? std::ceil(kFloat * b * h * s / 256) * 256 + 2 * n * cl
                                 : att.p_element_bytes * b * h * s * s;
  const double attention = saved + (att.backward_scratch ? kFloat * s * s : 0);
  return forward + backward + attention;
}

// The dense MLP's part of BlockActivationBytes (its hidden activations:
// GPT-2's fc and GELU outputs and their gradient, 3 F'; Llama's gate, up,
// SwiGLU and dg, dgate, dup, 6 F'), which an MoE block replaces.
double DenseMlpActivationBytes(double n, const BlockShape& w) {
  return kFloat * (w.llama ? 6 : 3) * n * w.fl;
}

// What an MoE block's MLP keeps per microbatch instead (model.moe; see
// memory_estimate.h), for n tokens whose experts hold `rows` rows in all
// (MoeExpertRows). GptStage::MoeForward / MoeBackwardInput's buffers:
//   router   logits, probabilities, the load-balancing loss's logit
//            gradient and the logit gradient [n, E]; each choice's expert,
//            gate, slot and gate gradient [n, K] (4 bytes each)
//   experts  per row: its dispatched input, its output and their gradients
//            (4 C); the hidden activations and their gradients (GPT-2 h, g,
//            dh, dg: 4 F'; Llama h, up, g, dh, dup, dg: 6 F')
// The stage pads every expert's buffer to the fullest expert's rows; a
// dropless block is counted at an even spread (n * top_k rows in all), a
// capped one at every expert full (MoeExpertRows). With expert parallelism
// (`exchanged`: parallel.ep > 1) the four C-wide buffers are held twice: in
// this rank's layout (its tokens' rows for every expert) and in the
// all-to-all's (every ep rank's rows for this rank's E / ep experts, about
// as many: GptStage::ExchangeExpertRows); the hidden ones only once.
double MoeMlpActivationBytes(double n, double rows, double experts, double top_k, const BlockShape& w,
                             bool exchanged) {
  const double router = 4 * n * experts + 4 * n * top_k;
  return kFloat * (router + rows * ((exchanged ? 8 : 4) * w.c + (w.llama ? 6 : 4) * w.fl));
}

// The fused backward's workspace for one microbatch (stream scratch).
double FusedWorkspaceBytes(double b, double s, double heads, double tp) {
  const double t = std::ceil(s / 64) * 64;
  return 2 * b * (heads / tp) * t * t;
}

// cuBLASLt's workspace, one per CUDA stream (kernels/cuda/plan.h kLtWorkspaceBytes).
constexpr double kLtWorkspaceBytes = 32.0 * (1 << 20);

// What one chunk's CUDA stream holds for op temporaries (kernels/cuda/
// cuda_backend.cc Scratch, sized per op and grown, never shrunk; an outgrown
// buffer stays until the stream goes, so the kinds below are summed, an
// upper bound of the sizes it grows through): cuBLASLt's workspace; the
// attention backward's (cuDNN's workspace when fused, else the GEMM path's
// H'·T·T floats for one batch row, plus their bf16 copy in bf16); in bf16
// the fp32 output of the QKV projection when cuBLASLt has no bf16 kernel
// for its fp32 bias (Linear's fallback, [N, 3C']; GPT-2 only: Llama's
// projections have no bias); and the small ones (embedding backward, loss
// and norm partials).
double CudaStreamScratchBytes(double n, double b, double s, double c, double heads, double tp, bool bf16,
                              bool fused, bool qkv_bias) {
  const double h = heads / tp, cl = c / tp;
  double bytes = kLtWorkspaceBytes + 16 * n + (1 << 20);
  bytes += fused ? FusedWorkspaceBytes(b, s, heads, tp) : (bf16 ? 6 : 4) * h * s * s;
  if (bf16 && qkv_bias) bytes += kFloat * n * 3 * cl;
  return bytes;
}

// ZeRO stage 1: the elements of one rank's shard of a chunk's flat buffer of
// `n` parameters (its local count on its TP rank) over the `dp` ranks of the
// data-parallel group (with cp > 1 its dp*cp ranks), round_up(ceil(n / dp),
// 16); the buffer is padded to dp times that. The same rule as the worker's
// sharding (docs/model.md "ZeRO"), restated here for the reason the
// attention sizes above are.
constexpr double kZeroShardAlignment = 16;

double ZeroShardElements(double n, double dp) {
  return std::ceil(std::ceil(n / dp) / kZeroShardAlignment) * kZeroShardAlignment;
}

// In-memory recovery snapshots (docs/protocol.md, "Snapshots"), in the
// worker's host RAM, in shard states (values and both AdamW moments, as the
// worker holds them): its last 3 own (WorkerJob::kOwnSnapshots) and the
// last 2 of the worker it is the buddy of (kHeldSnapshots; taken at the
// size of its own), plus what a snapshot step holds for a while: the state
// being captured and encoded, the copy being sent, and a relayed copy
// being joined from its fragments, parsed and kept. Measured at 12.0
// states above the same job without snapshots (bench/
// snapshot_memory_bench.sh; docs/BENCHMARKS.md, "Host memory of in-memory
// snapshots"), so 13. With
// fault_tolerance.snapshot_every_steps: 0 a worker keeps at most one (after
// a resume from a checkpoint).
constexpr double kSnapshotStates = 13;

// fault_tolerance.snapshot_every_steps: 0 (unset means by cost, not none).
bool SnapshotsOff(const v1::JobSpec& job) {
  const v1::FaultToleranceSpec& ft = job.fault_tolerance();
  return ft.has_snapshot_every_steps() && ft.snapshot_every_steps() == 0;
}

}  // namespace

WorkerMemory EstimateWorkerMemory(const v1::JobSpec& job, const v1::Plan& plan, int pp_rank) {
  const ParallelDims d = DimsOf(job);
  const int stages = d.pp * d.virtual_stages;
  WorkerMemory w;
  w.pp_rank = pp_rank;
  w.peak_microbatches = schedule::ActivationBound(job.schedule().kind(), d.pp, job.schedule().microbatches(),
                                                  d.virtual_stages, pp_rank);
  const v1::ModelSpec& m = job.model();
  if (m.has_synthetic()) {
    const double a = m.synthetic().activation_bytes();
    // Each stored microbatch-chunk keeps its output and, later, its gradient;
    // a send and a receive buffer are in flight at a time.
    w.activation_bytes = 2 * a * w.peak_microbatches;
    w.comm_bytes = 2 * a;
    return w;
  }
  const double c = m.d_model(), v = m.vocab(), s = m.seq_len(), heads = m.heads(), tp = d.tp;
  const double b = job.train().micro_batch_size(), n = b * s;
  const BlockShape shape = BlockShapeOf(m, tp);
  const bool sp = d.sequence_parallel && d.tp > 1;  // sequence parallelism
  // The data-parallel group ZeRO 1 shards over: dp x cp, or with ep the dp /
  // ep ranks holding the same experts.
  const double group = d.ep > 1 ? static_cast<double>(d.dp) / d.ep : static_cast<double>(d.dp) * d.cp;
  // GPT-2: LayerNorms and the replicated biases (6 C), qkv, proj and the
  // 4x MLP with their split biases. Llama: two RMSNorm weights (2 C), q and
  // o (C x C each), k and v (KV·hd x C each), gate, up and down (F x C each).
  const double block_gemm = shape.llama ? (2 * c * c + 2 * c * shape.kvl * tp + 3 * c * shape.fl * tp) / tp
                                        : 12 * c * c / tp;
  const double block_params = shape.llama ? 2 * c + block_gemm : 6 * c + (12 * c * c + 7 * c) / tp;
  // An MoE block (model.moe) trades the dense MLP's matrices (GPT-2: c_fc
  // and c_proj, 2 C x F split by tp, and their biases, F' split and C
  // replicated; Llama: gate, up and down, 3 C x F split) for a router
  // (E x C, replicated) and E experts of the same matrices without biases.
  // With parallel.ep each rank holds E / ep of them (its slot's experts:
  // weights, gradients and moments); the router stays whole.
  const int moe_every = MoeEvery(m);
  const double experts = moe_every > 0 ? m.moe().experts() : 0;
  const double local_experts = experts / d.ep;
  const double mlp_gemm = (shape.llama ? 3 : 2) * c * shape.fl;
  const double mlp_bias = shape.llama ? 0 : shape.fl + c;
  const double moe_block_gemm = block_gemm - mlp_gemm + experts * c + local_experts * mlp_gemm;
  const double moe_block_params = block_params - mlp_gemm - mlp_bias + experts * c + local_experts * mlp_gemm;
  const bool tied = !shape.llama || m.tie_embeddings();  // Llama: unset means an untied lm_head
  double params = 0, gemm_weights = 0, max_chunk_activations = 0;
  double moment_elements = 0;  // per AdamW moment: every chunk's parameters, or with ZeRO 1 its shard
  int chunks = 0;
  const AttentionTerms att = AttentionTermsFor(job, plan, pp_rank);
  const std::vector<int> placement(plan.stage_ranks().begin(), plan.stage_ranks().end());
  for (int chunk : schedule::StagesOfRank(placement, d.pp, stages, pp_rank)) {
    ++chunks;
    double layers = 0, moe_blocks = 0;
    bool first = chunk == 0, last = chunk == stages - 1;
    if (chunk < plan.stages_size()) {
      const v1::StagePartition& p = plan.stages(chunk);
      layers = p.num_layers();
      moe_blocks = MoeBlocksIn(moe_every, p.first_layer(), p.first_layer() + p.num_layers());
      first = p.has_embedding();
      last = p.has_head();
    }
    const double dense_blocks = layers - moe_blocks;
    double chunk_params = dense_blocks * block_params + moe_blocks * moe_block_params;
    gemm_weights += dense_blocks * block_gemm + moe_blocks * moe_block_gemm + (last ? v * c : 0);  // + the head's
    double act = layers * BlockActivationBytes(n, b, s, shape, heads, tp, sp, att);
    if (moe_blocks > 0) {
      const v1::MoeSpec& moe = m.moe();
      act += moe_blocks * (MoeMlpActivationBytes(n, MoeExpertRows(moe, n), experts, moe.top_k(), shape, d.ep > 1) -
                           DenseMlpActivationBytes(n, shape));
    }
    if (first) {
      // Token (+ GPT-2's position) embeddings; Llama's positions are rotary.
      chunk_params += shape.llama ? v * c : v * c + s * c;
      act += kFloat * (2 * n * c + n);           // tokens, x0 and its gradient
    }
    if (last) {
      if (shape.llama) {
        // RMSNorm; the untied lm_head, or the tied embedding's copy (none
        // where this chunk holds the embedding itself).
        chunk_params += c + (tied && first ? 0 : v * c);
      } else {
        chunk_params += 2 * c + v * c;           // final norm + the tied head's copy
      }
      act += kFloat * (3 * n * c + n * v + 8 * n);  // xf, logits / their gradient, loss stats
    }
    params += chunk_params;
    moment_elements += d.sharded_optimizer() ? ZeroShardElements(std::ceil(chunk_params), group) : chunk_params;
    max_chunk_activations = std::max(max_chunk_activations, act);
  }
  const bool bf16 = job.train().precision() == "bf16";
  // fp32 master values, and in bf16 the GEMM weights' bf16 copy (ParameterStore::AllocateBf16Copies).
  w.parameter_bytes = kFloat * params + (bf16 ? 2 * gemm_weights : 0);
  // Gradients (whole on every DP rank: ZeRO 1 reduce-scatters them in place)
  // and AdamW's m and v.
  w.optimizer_bytes = kFloat * params + 2 * kFloat * moment_elements;
  w.activation_bytes = max_chunk_activations * w.peak_microbatches;
  // Sequence parallelism's per-block temporaries: a gathered norm output and
  // a partial sum, [n, C] each, one arena per chunk.
  if (sp) w.activation_bytes += chunks * kFloat * 2 * n * c;
  // Context parallelism: each rank holds seq_len / cp tokens of every
  // sequence (two chunks of seq_len / (2 cp)), so every token-sized term
  // above falls by cp; attention's are taken to fall by cp too (the rank's
  // query rows against the whole sequence's keys: P's T·T becomes T/cp · T).
  // Kept simple: the whole activation term is divided by cp, not the shapes
  // re-derived. The CUDA stream scratch and the messages below stay at the
  // whole microbatch's size, an upper bound that also covers the ring's
  // key/value blocks in flight.
  w.activation_bytes /= d.cp;
  if (!att.backward_scratch) {  // every rank of the stage is a CUDA device: each chunk's stream's scratch
    w.scratch_bytes = chunks * CudaStreamScratchBytes(n, b, s, c, heads, tp, bf16, att.fused, !shape.llama);
  }
  // Snapshots are held in host RAM: counted unless every rank of the stage
  // computes on a CUDA device (whose registered memory is the GPU's).
  if (att.backward_scratch) {
    w.snapshot_bytes = (SnapshotsOff(job) ? 1 : kSnapshotStates) * kFloat * (params + 2 * moment_elements);
  }
  const double message = kFloat * n * c;  // one microbatch's activations or gradients
  // With a data-parallel group (dp*cp ranks: the CP ranks reduce the
  // gradients with the DP replicas), a flat gradient buffer.
  w.comm_bytes = 4 * message + (d.tp > 1 ? message : 0) + (d.dp * d.cp > 1 ? w.parameter_bytes : 0);
  return w;
}

namespace {

// The memory a worker's registered memory_bytes is part of, shared by every
// worker in it, as it is named in messages: its GPU (by UUID, or host and
// cuda:N without one) or its host's RAM.
std::string MemoryPoolOf(const v1::WorkerInfo& w) {
  if (!absl::StartsWith(w.device(), "cuda:")) return absl::StrCat("host '", w.host(), "'");
  if (!w.device_uuid().empty()) return absl::StrCat("GPU ", w.device_uuid());
  return absl::StrCat("GPU ", w.device(), " of host '", w.host(), "'");
}

}  // namespace

absl::Status CheckPlanFitsMemory(const v1::JobSpec& job, const v1::Plan& plan,
                                 const std::vector<v1::WorkerInfo>& workers) {
  std::map<std::string, const v1::WorkerInfo*> by_name;
  for (const v1::WorkerInfo& w : workers) by_name[w.name()] = &w;
  const ParallelDims d = DimsOf(job);
  std::vector<WorkerMemory> per_stage;
  for (int p = 0; p < d.pp; ++p) per_stage.push_back(EstimateWorkerMemory(job, plan, p));
  auto detail = [](const WorkerMemory& m) {
    return absl::StrCat("parameters ", FormatBytes(m.parameter_bytes), ", gradients and AdamW state ",
                        FormatBytes(m.optimizer_bytes), ", activations of ", m.peak_microbatches,
                        " microbatch-chunks in flight ", FormatBytes(m.activation_bytes),
                        m.scratch_bytes > 0 ? absl::StrCat(", op scratch ", FormatBytes(m.scratch_bytes)) : "",
                        ", communication ", FormatBytes(m.comm_bytes),
                        m.snapshot_bytes > 0 ? absl::StrCat(", in-memory snapshots ", FormatBytes(m.snapshot_bytes))
                                             : "",
                        ", runtime ", FormatBytes(kRuntimeOverheadBytes));
  };
  // What to change; with several DP replicas of whole AdamW state, ZeRO
  // stage 1 first, the fix that changes nothing else about the job, with
  // what it saves (computed only for a refusal).
  // The most any stage's worker saves of `bytes` with `changed` instead.
  auto most_saved = [&](const v1::JobSpec& changed, double WorkerMemory::*bytes) {
    double saved = 0;
    for (int p = 0; p < d.pp; ++p) {
      saved = std::max(saved, per_stage[p].*bytes - EstimateWorkerMemory(changed, plan, p).*bytes);
    }
    return saved;
  };
  // `short_by`: how much less each refused worker would have to need.
  auto fix = [&](double short_by) {
    std::string zero;
    // The group the moments shard over: dp x cp, or with ep the dp / ep
    // ranks holding the same experts (ZeRO with ep and cp is refused).
    const int group = d.ep > 1 ? (d.cp > 1 ? 1 : d.dp / d.ep) : d.dp * d.cp;
    if (group >= 2 && d.zero_stage == 0 && !job.model().has_synthetic()) {
      v1::JobSpec sharded = job;
      sharded.mutable_parallel()->set_zero_stage(1);
      zero = absl::StrCat("set parallel.zero_stage: 1 to shard the AdamW moments over the ", group,
                          d.cp > 1 ? " ranks of the data-parallel group (dp*cp)" : " data-parallel ranks",
                          " (up to ", FormatBytes(most_saved(sharded, &WorkerMemory::optimizer_bytes)),
                          " less per worker), ");
    }
    std::string sp;
    v1::JobSpec split = job;
    split.mutable_parallel()->set_sequence_parallel(true);
    if (!d.sequence_parallel && ValidateJobSpec(split).ok()) {  // SP applies to this job
      const double saved = most_saved(split, &WorkerMemory::activation_bytes);
      if (saved > 0) {
        sp = absl::StrCat("set parallel.sequence_parallel: true to split the residual stream over the ", d.tp,
                          " tensor-parallel ranks (up to ", FormatBytes(saved), " less per worker), ");
      }
    }
    // Context parallelism: what each worker saves in all (fewer activations,
    // less the data-parallel group's gradient buffer it may add), for 2, 4
    // and 8 times the job's cp while the job still validates with it; the
    // smallest that covers `short_by`, else the largest.
    std::string cp;
    int best_cp = 0;
    double best_saved = 0;
    for (int times : {2, 4, 8}) {
      v1::JobSpec more = job;
      more.mutable_parallel()->set_cp(d.cp * times);
      if (!ValidateJobSpec(more).ok()) break;  // nor would a larger cp
      double saved = 0;
      for (int p = 0; p < d.pp; ++p) {
        saved = std::max(saved, per_stage[p].total() - EstimateWorkerMemory(more, plan, p).total());
      }
      if (saved <= 0) continue;  // the group's gradient buffer outweighs it; a larger cp may not
      best_cp = d.cp * times;
      best_saved = saved;
      if (saved >= short_by) break;
    }
    if (best_cp > 0) {
      const int times = best_cp / d.cp;
      cp = absl::StrCat("set parallel.cp: ", best_cp, " to split each sequence over ", best_cp,
                        " context-parallel ranks, on ", times, "x the workers (pp*tp*cp*dp = ",
                        int64_t{d.world_size()} * times, "; up to ", FormatBytes(best_saved), " less per worker), ");
    }
    // MoE: expert parallelism, the most a worker saves in all with 2, 4, ...
    // times the job's ep while the job still validates with it (ep divides
    // dp and the experts; zero_stage 0), the smallest that covers
    // `short_by`, else the largest; then fewer experts.
    std::string ep, experts;
    if (job.model().has_moe()) {
      int best_ep = 0;
      double best_ep_saved = 0;
      for (int more_ep = 2 * d.ep; more_ep <= d.dp; more_ep *= 2) {
        v1::JobSpec more = job;
        more.mutable_parallel()->set_ep(more_ep);
        if (!ValidateJobSpec(more).ok()) break;  // nor would a larger ep
        double saved = 0;
        for (int p = 0; p < d.pp; ++p) {
          saved = std::max(saved, per_stage[p].total() - EstimateWorkerMemory(more, plan, p).total());
        }
        if (saved <= 0) continue;  // the exchange buffers outweigh the experts; a larger ep may not
        best_ep = more_ep;
        best_ep_saved = saved;
        if (saved >= short_by) break;
      }
      if (best_ep > 0) {
        ep = absl::StrCat("set parallel.ep: ", best_ep, " to split each MoE block's ", job.model().moe().experts(),
                          " experts over ", best_ep, " data-parallel ranks (up to ", FormatBytes(best_ep_saved),
                          " less per worker), ");
      }
      experts = d.ep > 1 ? absl::StrCat("lower model.moe.experts (every rank holds experts/ep = ",
                                        job.model().moe().experts() / d.ep, " of each MoE block), ")
                         : "lower model.moe.experts (every rank holds all experts of its blocks), ";
    }
    // In-memory snapshots: what turning them off saves (recovery then has
    // no snapshot to resume from: a DP replica's state, else a checkpoint).
    std::string snapshots;
    if (!SnapshotsOff(job)) {
      v1::JobSpec off = job;
      off.mutable_fault_tolerance()->set_snapshot_every_steps(0);
      if (const double saved = most_saved(off, &WorkerMemory::snapshot_bytes); saved > 0) {
        snapshots = absl::StrCat("set fault_tolerance.snapshot_every_steps: 0 to keep no in-memory recovery "
                                 "snapshots in host RAM (up to ",
                                 FormatBytes(saved), " less per worker; a lost worker is then restored from a "
                                 "data-parallel replica or the last checkpoint), ");
      }
    }
    return absl::StrCat(zero, sp, cp, ep, experts, snapshots,
                        "lower train.micro_batch_size, model.seq_len or schedule.microbatches (for gpipe), raise "
                        "parallel.pp or parallel.tp, or use workers with more memory");
  };
  struct Host {
    double need = 0, has = 0;
    std::vector<std::string> names;
  };
  std::map<std::string, Host> hosts;
  for (const v1::RankAssignment& r : plan.ranks()) {
    auto it = by_name.find(r.worker_name());
    if (it == by_name.end() || it->second->memory_bytes() <= 0) continue;
    const WorkerMemory& need = per_stage[r.pp_rank()];
    const double has = static_cast<double>(it->second->memory_bytes());
    if (need.total() > has) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "job '", job.name(), "': pipeline stage ", r.pp_rank(), " (tp rank ", r.tp_rank(), ", dp rank ",
          r.dp_rank(), d.cp > 1 ? absl::StrCat(", cp rank ", r.cp_rank()) : "", ") needs about ",
          FormatBytes(need.total()), " per worker but worker '", r.worker_name(),
          "' has ", FormatBytes(has), " (", detail(need), "); ", fix(need.total() - has)));
    }
    Host& h = hosts[MemoryPoolOf(*it->second)];
    h.need += need.total();
    h.has = std::max(h.has, has);
    h.names.push_back(r.worker_name());
  }
  for (const auto& [host, h] : hosts) {
    if (h.names.size() > 1 && h.need > h.has) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "job '", job.name(), "': the ", h.names.size(), " workers the plan puts on ", host, " need about ",
          FormatBytes(h.need), " together but it has ", FormatBytes(h.has), " (per stage: ", detail(per_stage[0]),
          " for stage 0); ", fix((h.need - h.has) / h.names.size()), ", or spread the workers over more ",
          absl::StartsWith(host, "GPU") ? "GPUs" : "hosts"));
    }
  }
  return absl::OkStatus();
}

}  // namespace baton
