#include "coordinator/planner.h"

#include <algorithm>
#include <limits>
#include <map>
#include <iterator>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "coordinator/job_schedule.h"
#include "coordinator/job_spec.h"
#include "coordinator/memory_estimate.h"

namespace baton {

LayerCosts CostsOf(const v1::ModelSpec& model) {
  LayerCosts c;
  if (model.has_synthetic()) return c;
  const double d = model.d_model(), s = model.seq_len(), v = model.vocab();
  const double block = 24.0 * d * d + 4.0 * s * d;
  if (block <= 0) return c;
  c.head = 2.0 * d * v / block;
  c.embedding = 0.05;
  if (model.has_moe()) {
    const double mlp = model.arch() == "llama" ? 6.0 * d * (model.has_ffn_dim() ? model.ffn_dim() : 4.0 * d)
                                               : 16.0 * d * d;
    c.moe_every = MoeEvery(model);
    c.moe_extra = ((model.moe().top_k() - 1) * mlp + 2.0 * d * model.moe().experts()) / block;
  }
  return c;
}

double BlocksCost(const LayerCosts& costs, int first, int end) {
  const double blocks = end - first;
  if (costs.moe_every <= 0) return blocks;
  return blocks + costs.moe_extra * MoeBlocksIn(costs.moe_every, first, end);
}

std::vector<v1::StagePartition> PartitionLayers(int layers, int stages, const LayerCosts& costs) {
  // best[k][i]: the smallest possible max stage cost when the first k stages
  // hold the first i layers. Ties go to the later cut (the largest j), which
  // keeps earlier stages no heavier.
  //
  // best[k][i] = min over j of max(best[k-1][j], cost(k-1, j, i)). best[k-1][.]
  // is nondecreasing in j and cost(k-1, j, i) decreasing in j (every block
  // costs more than 0, an MoE block more than a dense one), so the minimum
  // sits where the two cross, and both the crossing and the largest minimising
  // j move right as i grows: two pointers give each row in O(layers), the
  // whole table in O(stages * layers) time and memory (stages <= layers <=
  // JobLimits::kMaxLayers).
  const double kInf = std::numeric_limits<double>::infinity();
  const double kTie = 1e-12;
  auto cost = [&](int stage, int first, int end) {
    double c = BlocksCost(costs, first, end);
    if (stage == 0) c += costs.embedding;
    if (stage == stages - 1) c += costs.head;
    return c;
  };
  std::vector<std::vector<double>> best(stages + 1, std::vector<double>(layers + 1, kInf));
  std::vector<std::vector<int>> cut(stages + 1, std::vector<int>(layers + 1, 0));
  best[0][0] = 0;
  for (int k = 1; k <= stages; ++k) {
    const std::vector<double>& prev = best[k - 1];
    // prev[j] is finite for j in [k - 1, ...] (k - 1 stages need k - 1 layers).
    int cross = k - 1;  // smallest j with prev[j] >= cost(k - 1, j, i)
    int last = k - 1;   // largest j with prev[j] <= best[k][i] + kTie
    for (int i = k; i <= layers - (stages - k); ++i) {
      auto g = [&](int j) { return std::max(prev[j], cost(k - 1, j, i)); };
      while (cross < i - 1 && prev[cross] < cost(k - 1, cross, i)) ++cross;
      // g is quasi-convex in j: its minimisers form an interval holding
      // cross - 1 or cross, whose right end never moves left as i grows.
      int argmin = cross;
      if (cross > k - 1 && g(cross - 1) < g(cross)) argmin = cross - 1;
      const double m = g(argmin);
      last = std::max(last, argmin);
      while (last + 1 <= i - 1 && g(last + 1) <= m + kTie) ++last;
      best[k][i] = m;
      cut[k][i] = last;
    }
  }
  std::vector<v1::StagePartition> out(stages);
  int end = layers;
  for (int k = stages; k >= 1; --k) {
    const int first = cut[k][end];
    v1::StagePartition& p = out[k - 1];
    p.set_stage(k - 1);
    p.set_first_layer(first);
    p.set_num_layers(end - first);
    p.set_has_embedding(k == 1);
    p.set_has_head(k == stages);
    end = first;
  }
  return out;
}

namespace {

// MakePlan after validation: the one code path of MakePlan and MakePlanOfMesh.
absl::StatusOr<v1::Plan> PlanValidated(const v1::JobSpec& job, const std::vector<v1::WorkerInfo>& ready,
                                       int64_t generation) {
  const ParallelDims d = DimsOf(job);
  const int world = d.world_size();
  if (static_cast<int>(ready.size()) < world) {
    const std::string formula = d.cp > 1 ? absl::StrCat("pp*tp*cp*dp = ", d.pp, "*", d.tp, "*", d.cp, "*", d.dp)
                                         : absl::StrCat("pp*tp*dp = ", d.pp, "*", d.tp, "*", d.dp);
    return absl::FailedPreconditionError(absl::StrCat("job '", job.name(), "' needs ", formula, " = ", world,
                                                      " workers; ", ready.size(), " are ready (start ",
                                                      world - ready.size(), " more)"));
  }
  // Free workers per host, each list in name order; hosts in name order.
  std::map<std::string, std::vector<const v1::WorkerInfo*>> free;
  for (const v1::WorkerInfo& w : ready) free[w.host()].push_back(&w);
  for (auto& [host, list] : free) {
    std::sort(list.begin(), list.end(), [](auto* a, auto* b) { return a->name() < b->name(); });
    std::reverse(list.begin(), list.end());  // pop_back() yields name order
  }
  // First fit: the first host (in name order) with n free workers takes the
  // whole group. `fits` holds the hosts that still have n (n is the same for
  // every call), and emptied hosts leave `free`, so planning stays linear in
  // the workers (scanning every host per group made 65,536 ranks take ~1 s).
  const int group_size = d.tp;
  std::set<std::string> fits;
  for (const auto& [host, list] : free) {
    if (static_cast<int>(list.size()) >= group_size) fits.insert(host);
  }
  auto take_group = [&]() {
    std::vector<const v1::WorkerInfo*> group;
    if (!fits.empty()) {
      auto host = free.find(*fits.begin());
      std::vector<const v1::WorkerInfo*>& list = host->second;
      for (int i = 0; i < group_size; ++i) {
        group.push_back(list.back());
        list.pop_back();
      }
      if (static_cast<int>(list.size()) < group_size) fits.erase(fits.begin());
      if (list.empty()) free.erase(host);
      return group;
    }
    // No host fits the whole group: spread it over the hosts in name order.
    for (auto it = free.begin(); it != free.end() && static_cast<int>(group.size()) < group_size;) {
      std::vector<const v1::WorkerInfo*>& list = it->second;
      while (!list.empty() && static_cast<int>(group.size()) < group_size) {
        group.push_back(list.back());
        list.pop_back();
      }
      it = list.empty() ? free.erase(it) : std::next(it);
    }
    return group;
  };

  v1::Plan plan;
  plan.set_job(job.name());
  plan.set_generation(generation);
  plan.set_pp(d.pp);
  plan.set_tp(d.tp);
  plan.set_dp(d.dp);
  plan.set_virtual_stages(d.virtual_stages);
  plan.set_cp(d.cp);
  plan.set_ep(d.ep);
  BATON_ASSIGN_OR_RETURN(const std::vector<int> placement, PlacementOfJob(job));
  for (int rank : placement) plan.add_stage_ranks(rank);
  // Ranks in global-rank order (planner.h): the loops nest as the axes do.
  for (int dp = 0; dp < d.dp; ++dp) {
    for (int pp = 0; pp < d.pp; ++pp) {
      for (int cp = 0; cp < d.cp; ++cp) {
        std::vector<const v1::WorkerInfo*> group = take_group();
        for (int tp = 0; tp < d.tp; ++tp) {
          v1::RankAssignment* r = plan.add_ranks();
          PlaceRank(*group[tp], r);
          r->set_global_rank(((dp * d.pp + pp) * d.cp + cp) * d.tp + tp);
          r->set_pp_rank(pp);
          r->set_tp_rank(tp);
          r->set_dp_rank(dp);
          r->set_cp_rank(cp);
        }
      }
    }
  }
  for (auto& [host, list] : free) {
    for (auto it = list.rbegin(); it != list.rend(); ++it) plan.add_spares((*it)->name());
  }
  for (v1::StagePartition& p :
       PartitionLayers(job.model().layers(), d.pp * d.virtual_stages, CostsOf(job.model()))) {
    *plan.add_stages() = std::move(p);
  }
  plan.set_comm_backend(CommBackendOf(job, plan));
  BATON_RETURN_IF_ERROR(CheckPlanFitsMemory(job, plan, ready));
  return plan;
}

}  // namespace

absl::StatusOr<v1::Plan> MakePlan(const v1::JobSpec& job, const std::vector<v1::WorkerInfo>& ready,
                                  int64_t generation) {
  BATON_RETURN_IF_ERROR(ValidateJobSpec(job));
  return PlanValidated(job, ready, generation);
}

absl::StatusOr<v1::Plan> MakePlanOfMesh(const v1::JobSpec& job, const std::vector<v1::WorkerInfo>& ready,
                                        int64_t generation) {
  BATON_RETURN_IF_ERROR(ValidateJobSpecAllowingPlannedAxes(job));
  return PlanValidated(job, ready, generation);
}

void PlaceRank(const v1::WorkerInfo& w, v1::RankAssignment* r) {
  r->set_worker_name(w.name());
  r->set_host(w.host());
  r->set_device(w.device());
  r->set_device_uuid(w.device_uuid());
  r->set_fused_attention_bf16(w.fused_attention_bf16());
  r->set_verdict_in_run_step(w.verdict_in_run_step());
  r->set_report_groups(w.report_groups());
  r->set_report_group_columns(w.report_group_columns());
}

std::string CommBackendOf(const v1::JobSpec& job, const v1::Plan& plan) {
  if (job.model().has_synthetic()) return "gloo";  // its tensors live in host memory on every device
  // A GPU's UUID names it on every host and in every container; without one,
  // host and ordinal (two containers on one node with their own host names
  // and one GPU each look distinct then, and NCCL would refuse them).
  std::set<std::string> gpus;
  for (const v1::RankAssignment& r : plan.ranks()) {
    if (!absl::StartsWith(r.device(), "cuda:")) return "gloo";
    const std::string id = r.device_uuid().empty() ? absl::StrCat(r.host(), "/", r.device()) : r.device_uuid();
    if (!gpus.insert(id).second) return "gloo";
  }
  return plan.ranks_size() > 0 ? "nccl" : "gloo";
}

}  // namespace baton
