// Memory estimate: what one worker needs for its part of a job, from the job
// spec and the plan alone, so that the coordinator refuses a job that cannot
// fit before any worker allocates for it (issue 12: d_model 2^30 or
// micro_batch_size 2e9 aborted every worker).
//
// Per worker (one pipeline rank's chunks, one TP shard), in bytes:
//   parameters   fp32 values of the chunks' parameters (TP-sharded matrices,
//                replicated norms and biases; the first chunk holds the token
//                and position embeddings, the last the tied LM head's copy),
//                and with bf16 the GEMM weights' bf16 copy
//   optimizer    gradients + AdamW's two moments: 3x the fp32 parameters;
//                with parallel.zero_stage 1 each moment holds only the
//                rank's shard of every chunk over the data-parallel group,
//                round_up(ceil(N / (dp*cp)), 16) of a chunk's N parameters
//                (gradients stay whole)
//   activations  what a microbatch keeps from its forward until its backward
//                plus the backward's temporaries (the arena of
//                worker/model/gpt_stage.cc), times the schedule's peak of
//                microbatch-chunks in flight on this rank (ActivationBound);
//                attention's P in train.precision's bytes; for bf16 on a
//                stage whose every rank reported fused attention
//                (RankAssignment.fused_attention_bf16), cuDNN's softmax
//                statistics and o's copy instead (memory_estimate.cc);
//                with parallel.cp, divided by cp (each rank holds seq_len/cp
//                tokens of every sequence)
//   scratch      on CUDA, each chunk's stream's op temporaries: cuBLASLt's
//                workspace, the attention backward's (cuDNN's workspace,
//                or the GEMM path's H'·T·T floats for one batch row), the
//                bf16 QKV projection's fp32 fallback output
//   comm         point-to-point activation and gradient buffers, the TP
//                all-reduce buffer and, with dp*cp > 1, a flat gradient
//                buffer
//   snapshots    in-memory recovery snapshots, in host RAM: 13 shard
//                states (values and moments; 3 own, 2 of the buddy's, and
//                a snapshot step's copies in flight, as measured), one with
//                fault_tolerance.snapshot_every_steps: 0; not counted where
//                every rank of the stage is on CUDA (host RAM is not
//                reported there)
// MoE (model.moe): an MoE block's parameters are its router (E x C,
// replicated over tp) and E experts' MLP matrices (split by tp as the dense
// MLP's, no biases) instead of the dense MLP; a rank holds experts/ep of
// them (parallel.ep), and their gradients and moments follow as above. Its
// activations trade the dense MLP's hidden ones for the router's (4 N E
// floats: logits, probabilities, two logit gradients), each choice's
// expert, gate, slot and gate gradient (4 N K), and per expert row its
// input and output with their gradients (4 C) and the MLP's hidden
// activations with theirs (GPT-2 4 F', Llama 6 F'); rows R = N K when
// dropless (an even spread: the stage pads each expert to the fullest, so
// a skewed router can need up to E N), else E x min(capacity, N)
// (MoeExpertRows in job_spec.h).
// Synthetic models: activation_bytes per stored microbatch-chunk and message.
// The numbers are estimates (within a few percent of the arena sizes for GPT
// shapes); a fixed kRuntimeOverheadBytes covers the process itself.
#ifndef BATON_COORDINATOR_MEMORY_ESTIMATE_H_
#define BATON_COORDINATOR_MEMORY_ESTIMATE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/format_bytes.h"  // FormatBytes, used with these estimates
#include "baton/v1/coordinator.pb.h"
#include "baton/v1/job.pb.h"
#include "baton/v1/plan.pb.h"

namespace baton {

// The process, its libraries, gRPC and the communicator threads.
inline constexpr double kRuntimeOverheadBytes = 256.0 * (1 << 20);

struct WorkerMemory {
  int pp_rank = 0;
  int peak_microbatches = 0;  // microbatch-chunks in flight at the peak
  // Doubles: the products of capped sizes still exceed int64 for absurd specs.
  double parameter_bytes = 0;
  double optimizer_bytes = 0;
  double activation_bytes = 0;
  double comm_bytes = 0;
  double scratch_bytes = 0;  // CUDA: op temporaries held by each chunk's stream
  // In-memory recovery snapshots in host RAM; 0 where every rank of the
  // stage computes on CUDA (the GPU's memory holds none of them).
  double snapshot_bytes = 0;
  double total() const {
    return parameter_bytes + optimizer_bytes + activation_bytes + scratch_bytes + comm_bytes + snapshot_bytes +
           kRuntimeOverheadBytes;
  }
};

// The estimate for a worker on pipeline rank `pp_rank` of `plan` (the same
// for every TP and DP rank of it). `job` must be valid (ValidateJobSpec).
WorkerMemory EstimateWorkerMemory(const v1::JobSpec& job, const v1::Plan& plan, int pp_rank);


// RESOURCE_EXHAUSTED naming the stage, the worker and the numbers when a
// worker of the plan reported (RegisterRequest.memory_bytes) less memory than
// its estimate, or when the workers the plan puts on one memory need together
// more than it has: one host's RAM for CPU workers, one GPU for CUDA workers
// (told apart by UUID, else by host and cuda:N; workers sharing a GPU share
// its memory, workers on different GPUs of one host do not). Workers that
// reported 0 (unknown) are not checked. With dp*cp >= 2 and zero_stage 0 the
// message suggests parallel.zero_stage: 1 first, with what it saves; then
// sequence_parallel and parallel.cp (2, 4 or 8 times the job's, on as many
// times the workers) where the job validates with them and they save memory.
absl::Status CheckPlanFitsMemory(const v1::JobSpec& job, const v1::Plan& plan,
                                 const std::vector<v1::WorkerInfo>& workers);

}  // namespace baton

#endif  // BATON_COORDINATOR_MEMORY_ESTIMATE_H_
