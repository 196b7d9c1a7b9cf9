// Planner: JobSpec + READY workers -> Plan (who holds which pipeline stage
// and TP/DP rank, which layers each stage holds, who stays spare).
//
// Rank order: TP innermost, then CP, then PP, then DP:
//   global_rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank
// (with cp = 1, as every runnable job has today: (dp_rank * pp + pp_rank) *
// tp + tp_rank), so a TP group is a block of tp consecutive ranks, placed on
// one host when some host has tp free workers (TP all-reduces are the most
// frequent and latency-bound collectives), and the cp ranks of one (dp, pp)
// come next, cp blocks of tp. EP adds no ranks: it is carved out of DP, the
// expert-parallel rank being dp_rank % ep (ep consecutive DP replicas share
// their experts' work); the Plan records ep and every rank's cp_rank.
// Workers are taken in (host, name) order, so the same workers always give
// the same plan. The rest are spares.
//
// Layer partition: contiguous blocks over pp * virtual_stages stages (chunk c
// lives where the schedule's placement puts it, Plan.stage_ranks: pp rank
// c % pp when looped, the V for zb-v and dualpipe-v), minimising the costliest stage, where a block
// costs 1 (an MoE block 1 + LayerCosts::moe_extra) and the first/last stage
// also pay for the embedding/LM head in block units (see LayerCosts). Every
// stage gets at least one block.
#ifndef BATON_COORDINATOR_PLANNER_H_
#define BATON_COORDINATOR_PLANNER_H_

#include <vector>

#include "absl/status/statusor.h"
#include "baton/v1/coordinator.pb.h"
#include "baton/v1/job.pb.h"
#include "baton/v1/plan.pb.h"

namespace baton {

struct LayerCosts {
  double embedding = 0;  // in units of one transformer block
  double head = 0;       // final LayerNorm + LM head + loss
  // model.moe: block i is an MoE block iff (i + 1) % moe_every == 0 (0: a
  // dense model), and costs moe_extra more than a dense block.
  int moe_every = 0;
  double moe_extra = 0;
};

// Forward FLOP ratios: a block is ~24*d^2 + 4*s*d per token, the LM head
// 2*d*vocab, the embedding a lookup (counted as 0.05 blocks for its optimizer
// and gradient traffic). An MoE block runs each token through top_k experts
// and its router: (top_k - 1) MLPs (GPT-2 16*d^2, Llama 6*d*ffn_dim) and
// 2*d*experts more. Synthetic models cost the same per block and nothing else.
LayerCosts CostsOf(const v1::ModelSpec& model);

// The cost of blocks [first, end) in block units: one each, plus moe_extra
// for each MoE block among them.
double BlocksCost(const LayerCosts& costs, int first, int end);

// Contiguous partition of `layers` blocks into `stages` stages (layers >= stages).
std::vector<v1::StagePartition> PartitionLayers(int layers, int stages, const LayerCosts& costs);

// FAILED_PRECONDITION when fewer workers are ready than pp*tp*cp*dp (says how
// many are missing); INVALID_ARGUMENT for an invalid spec (ValidateJobSpec,
// which refuses ep > 1 for a dense model);
// RESOURCE_EXHAUSTED when a worker of the plan lacks the memory its part needs
// (CheckPlanFitsMemory, which does not yet count cp's shorter sequences).
// Cost: O(pp * virtual_stages * layers + workers).
absl::StatusOr<v1::Plan> MakePlan(const v1::JobSpec& job, const std::vector<v1::WorkerInfo>& ready,
                                  int64_t generation);

// MakePlan, validated with ValidateJobSpecAllowingPlannedAxes: also plans a
// mesh with ep > 1 for a dense model, which no worker runs (tests of the
// mesh). Same code path as MakePlan after validation.
absl::StatusOr<v1::Plan> MakePlanOfMesh(const v1::JobSpec& job, const std::vector<v1::WorkerInfo>& ready,
                                        int64_t generation);

// Puts worker `w` in rank `r`: its name and what the plan knows of where it
// runs (host, device, GPU UUID). Every placement (planning, replacement,
// adoption) goes through it, so no field is left behind.
void PlaceRank(const v1::WorkerInfo& w, v1::RankAssignment* r);

// The data-plane backend of `plan`'s groups: "nccl" when the model is the GPT
// (a synthetic model's tensors are host memory on any device), every rank is
// a CUDA device ("cuda:N") and no two ranks share one GPU (NCCL refuses a
// communicator with a GPU twice, and every group of a generation is split
// from one communicator over all ranks; GPUs are told apart by their UUID,
// or by host and cuda:N where a worker registered none); otherwise "gloo", which
// stages CUDA tensors through host memory. Recomputed whenever ranks change
// hands.
std::string CommBackendOf(const v1::JobSpec& job, const v1::Plan& plan);

}  // namespace baton

#endif  // BATON_COORDINATOR_PLANNER_H_
