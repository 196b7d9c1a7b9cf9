#include "coordinator/planner.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "coordinator/job_spec.h"
#include "gtest/gtest.h"

namespace baton {
namespace {

v1::JobSpec Job(int layers, int pp, int tp, int dp) {
  v1::JobSpec job;
  job.set_name("j");
  auto* m = job.mutable_model();
  m->set_layers(layers);
  m->set_d_model(64);
  m->set_heads(8);
  m->set_vocab(64);
  m->set_seq_len(16);
  job.mutable_parallel()->set_pp(pp);
  job.mutable_parallel()->set_tp(tp);
  job.mutable_parallel()->set_dp(dp);
  job.mutable_schedule()->set_kind("1f1b");
  job.mutable_schedule()->set_microbatches(4);
  job.mutable_train()->set_steps(1);
  job.mutable_train()->set_micro_batch_size(1);
  return job;
}

std::vector<v1::WorkerInfo> Workers(const std::vector<std::pair<std::string, std::string>>& name_host) {
  std::vector<v1::WorkerInfo> out;
  int64_t id = 1;
  for (const auto& [name, host] : name_host) {
    v1::WorkerInfo w;
    w.set_name(name);
    w.set_host(host);
    w.set_worker_id(id++);
    out.push_back(w);
  }
  return out;
}

std::vector<int> Sizes(const std::vector<v1::StagePartition>& parts) {
  std::vector<int> out;
  for (const auto& p : parts) out.push_back(p.num_layers());
  return out;
}

TEST(PlannerTest, UnevenLayersSpreadContiguouslyAndCoverAll) {
  auto parts = PartitionLayers(7, 3, LayerCosts{});
  ASSERT_EQ(parts.size(), 3u);
  int next = 0, total = 0;
  for (const auto& p : parts) {
    EXPECT_EQ(p.first_layer(), next);
    EXPECT_GE(p.num_layers(), 1);
    next += p.num_layers();
    total += p.num_layers();
  }
  EXPECT_EQ(total, 7);
  std::vector<int> sizes = Sizes(parts);
  EXPECT_EQ(*std::max_element(sizes.begin(), sizes.end()), 3);
  EXPECT_TRUE(parts.front().has_embedding());
  EXPECT_TRUE(parts.back().has_head());
  EXPECT_FALSE(parts[1].has_embedding() || parts[1].has_head());
}

TEST(PlannerTest, AHeavyHeadTakesLayersOffTheLastStage) {
  EXPECT_EQ(Sizes(PartitionLayers(8, 2, LayerCosts{0, 0})), (std::vector<int>{4, 4}));
  EXPECT_EQ(Sizes(PartitionLayers(8, 2, LayerCosts{0, 2})), (std::vector<int>{5, 3}));
  // The head costs as much as 2 blocks for a vocab of 12*d + 2*s.
  v1::ModelSpec m;
  m.set_d_model(64);
  m.set_seq_len(16);
  m.set_vocab(12 * 64 + 2 * 16);
  EXPECT_NEAR(CostsOf(m).head, 1.0, 1e-9);
  m.mutable_synthetic();
  EXPECT_EQ(CostsOf(m).head, 0);
}

// The O(stages * layers^2) dynamic programme the planner used before: the
// reference the faster one must agree with, partition for partition.
std::vector<int> ReferencePartition(int layers, int stages, const LayerCosts& costs) {
  const double kInf = std::numeric_limits<double>::infinity();
  auto cost = [&](int stage, int first, int end) {
    double c = 0;
    for (int i = first; i < end; ++i) {
      c += 1 + (costs.moe_every > 0 && (i + 1) % costs.moe_every == 0 ? costs.moe_extra : 0);
    }
    if (stage == 0) c += costs.embedding;
    if (stage == stages - 1) c += costs.head;
    return c;
  };
  std::vector<std::vector<double>> best(stages + 1, std::vector<double>(layers + 1, kInf));
  std::vector<std::vector<int>> cut(stages + 1, std::vector<int>(layers + 1, 0));
  best[0][0] = 0;
  for (int k = 1; k <= stages; ++k) {
    for (int i = k; i <= layers - (stages - k); ++i) {
      for (int j = k - 1; j < i; ++j) {
        if (best[k - 1][j] == kInf) continue;
        double m = std::max(best[k - 1][j], cost(k - 1, j, i));
        if (m < best[k][i] - 1e-12 || (std::abs(m - best[k][i]) <= 1e-12 && j > cut[k][i])) {
          best[k][i] = m;
          cut[k][i] = j;
        }
      }
    }
  }
  std::vector<int> sizes(stages);
  int end = layers;
  for (int k = stages; k >= 1; --k) {
    sizes[k - 1] = end - cut[k][end];
    end = cut[k][end];
  }
  return sizes;
}

TEST(PlannerTest, PartitionsMatchTheExhaustiveProgramme) {
  std::mt19937 rng(12);
  const double head_costs[] = {0, 0.05, 0.5, 1, 1.5, 2, 3.25, 7};
  for (int trial = 0; trial < 3000; ++trial) {
    const int layers = 1 + static_cast<int>(rng() % 40);
    const int stages = 1 + static_cast<int>(rng() % layers);
    LayerCosts costs{rng() % 2 ? 0.05 : 0.0, head_costs[rng() % 8]};
    if (rng() % 4 == 0) costs.head = (rng() % 1000) / 97.0;
    ASSERT_EQ(Sizes(PartitionLayers(layers, stages, costs)), ReferencePartition(layers, stages, costs))
        << layers << " layers, " << stages << " stages, head " << costs.head << ", embedding " << costs.embedding;
  }
}

// MoE blocks weigh more than dense ones at arbitrary places; the two-pointer
// programme still finds the exhaustive one's partition.
TEST(PlannerTest, PartitionsWithMoeBlocksMatchTheExhaustiveProgramme) {
  std::mt19937 rng(34);
  for (int trial = 0; trial < 3000; ++trial) {
    const int layers = 1 + static_cast<int>(rng() % 40);
    const int stages = 1 + static_cast<int>(rng() % layers);
    LayerCosts costs{rng() % 2 ? 0.05 : 0.0, (rng() % 1000) / 97.0};
    costs.moe_every = 1 + static_cast<int>(rng() % layers);
    costs.moe_extra = (rng() % 1000) / 53.0;
    ASSERT_EQ(Sizes(PartitionLayers(layers, stages, costs)), ReferencePartition(layers, stages, costs))
        << layers << " layers, " << stages << " stages, head " << costs.head << ", MoE every "
        << costs.moe_every << " costing " << costs.moe_extra << " more";
  }
}

// An MoE block runs each token through top_k expert MLPs and its router:
// (top_k - 1) MLPs and 2*d*experts more FLOPs than a dense block, so the
// partition moves blocks off the stage that holds it.
TEST(PlannerTest, AnMoeBlockWeighsItsTopKExpertsAndItsRouter) {
  v1::JobSpec job = Job(12, 2, 1, 1);  // d 64, seq_len 16
  const std::vector<v1::WorkerInfo> workers = Workers({{"a", "h"}, {"b", "h"}});
  auto dense = MakePlan(job, workers, 1);
  ASSERT_TRUE(dense.ok()) << dense.status();
  EXPECT_EQ(Sizes({dense->stages().begin(), dense->stages().end()}), (std::vector<int>{6, 6}));
  EXPECT_EQ(CostsOf(job.model()).moe_every, 0);
  EXPECT_EQ(CostsOf(job.model()).moe_extra, 0);

  // Only the last block is an MoE block: 4 experts, each token to all 4.
  v1::MoeSpec* moe = job.mutable_model()->mutable_moe();
  moe->set_experts(4);
  moe->set_top_k(4);
  moe->set_every_n_layers(12);
  const double d = 64, block = 24 * d * d + 4 * 16 * d;
  const LayerCosts costs = CostsOf(job.model());
  EXPECT_EQ(costs.moe_every, 12);
  EXPECT_DOUBLE_EQ(costs.moe_extra, (3 * 16 * d * d + 2 * d * 4) / block);  // 1.92
  EXPECT_DOUBLE_EQ(BlocksCost(costs, 0, 11), 11);
  EXPECT_DOUBLE_EQ(BlocksCost(costs, 6, 12), 6 + costs.moe_extra);
  auto plan = MakePlan(job, workers, 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  // {6, 6} would cost 6 + 1.92 + the head on the last stage; {7, 5} at most 7.05.
  EXPECT_EQ(Sizes({plan->stages().begin(), plan->stages().end()}), (std::vector<int>{7, 5}));

  // Unset every_n_layers is every block: uniform again. Llama's MLP is
  // 3 matrices of d x ffn_dim; top_k 1 costs the router only.
  moe->clear_every_n_layers();
  EXPECT_EQ(CostsOf(job.model()).moe_every, 1);
  auto uniform = MakePlan(job, workers, 1);
  ASSERT_TRUE(uniform.ok()) << uniform.status();
  EXPECT_EQ(Sizes({uniform->stages().begin(), uniform->stages().end()}), (std::vector<int>{6, 6}));
  job.mutable_model()->set_arch("llama");
  job.mutable_model()->set_ffn_dim(96);
  EXPECT_DOUBLE_EQ(CostsOf(job.model()).moe_extra, (3 * 6 * d * 96 + 2 * d * 4) / block);
  moe->set_top_k(1);
  EXPECT_DOUBLE_EQ(CostsOf(job.model()).moe_extra, 2 * d * 4 / block);
}

// The largest plans the job spec allows take well under a second (the old
// programme needed O(layers^2) per stage; layers: 1e9 aborted the coordinator).
TEST(PlannerTest, TheLargestAllowedPartitionIsCheap) {
  for (int stages : {1, 64, 512, 1024}) {
    auto parts = PartitionLayers(JobLimits::kMaxLayers, stages, LayerCosts{0.05, 3.5});
    ASSERT_EQ(static_cast<int>(parts.size()), stages);
    int total = 0;
    for (const auto& p : parts) total += p.num_layers();
    EXPECT_EQ(total, JobLimits::kMaxLayers);
  }
  auto plan = MakePlan(Job(1000000000, 2, 1, 1), Workers({{"a", "h"}, {"b", "h"}}), 1);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("model.layers: is 1000000000; baton supports at most 1024"),
            std::string::npos)
      << plan.status();
}

TEST(PlannerTest, TensorGroupsStayOnOneHostAndRanksAreTpInnermost) {
  // Two hosts with 2 workers each and a stray: tp=2 groups must not straddle hosts.
  auto workers = Workers({{"a1", "hostA"}, {"b1", "hostB"}, {"a2", "hostA"}, {"b2", "hostB"}, {"c1", "hostC"}});
  auto plan = MakePlan(Job(4, 2, 2, 1), workers, 7);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->generation(), 7);
  ASSERT_EQ(plan->ranks_size(), 4);
  for (const auto& r : plan->ranks()) {
    EXPECT_EQ(r.global_rank(), r.pp_rank() * 2 + r.tp_rank());
  }
  EXPECT_EQ(plan->ranks(0).host(), plan->ranks(1).host());
  EXPECT_EQ(plan->ranks(2).host(), plan->ranks(3).host());
  EXPECT_NE(plan->ranks(0).host(), plan->ranks(2).host());
  ASSERT_EQ(plan->spares_size(), 1);
  EXPECT_EQ(plan->spares(0), "c1");
  EXPECT_EQ(plan->stages_size(), 2);
}

// The placement rule, written the plain way: each TP group goes to the first
// host (in name order) with tp free workers, taken in name order; when no
// host has that many, the group is spread over the hosts in name order.
std::vector<std::string> FirstFitByRule(const std::vector<v1::WorkerInfo>& workers, int groups, int tp) {
  std::map<std::string, std::vector<std::string>> free;
  for (const auto& w : workers) free[w.host()].push_back(w.name());
  for (auto& [host, names] : free) std::sort(names.begin(), names.end());
  std::vector<std::string> out;
  for (int g = 0; g < groups; ++g) {
    bool placed = false;
    for (auto& [host, names] : free) {
      if (static_cast<int>(names.size()) >= tp) {
        out.insert(out.end(), names.begin(), names.begin() + tp);
        names.erase(names.begin(), names.begin() + tp);
        placed = true;
        break;
      }
    }
    for (int need = tp; !placed && need > 0;) {
      for (auto& [host, names] : free) {
        while (!names.empty() && need > 0) {
          out.push_back(names.front());
          names.erase(names.begin());
          --need;
        }
      }
    }
  }
  return out;
}

TEST(PlannerTest, PlacementFollowsTheFirstFitRuleOnRaggedHosts) {
  // Hosts of 1..11 workers, so some TP groups fit a host, some hosts keep a
  // remainder, and the last groups must be spread.
  std::mt19937 rng(7);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<std::pair<std::string, std::string>> name_host;
    const int hosts = 3 + static_cast<int>(rng() % 12);
    for (int h = 0; h < hosts; ++h) {
      const int n = 1 + static_cast<int>(rng() % 11);
      for (int i = 0; i < n; ++i) name_host.push_back({absl::StrCat("w", h, "-", i), absl::StrCat("host", rng() % 100)});
    }
    const int tp = 4, pp = 2;
    const int dp = static_cast<int>(name_host.size()) / (tp * pp);
    if (dp == 0) continue;
    auto workers = Workers(name_host);
    v1::JobSpec job = Job(4, pp, tp, dp);
    auto plan = MakePlan(job, workers, 1);
    ASSERT_TRUE(plan.ok()) << plan.status();
    std::vector<std::string> got;
    for (const auto& r : plan->ranks()) got.push_back(r.worker_name());
    EXPECT_EQ(got, FirstFitByRule(workers, pp * dp, tp)) << "trial " << trial;
  }
}

TEST(PlannerTest, PlansAPaperScaleMesh) {
  // pp=64 x tp=8 x dp=128 = 65,536 ranks on 8-GPU hosts: every worker placed
  // once, every TP group on one host (the planner is linear in the workers;
  // bench/plan_bench times it).
  std::vector<std::pair<std::string, std::string>> name_host;
  for (int i = 0; i < 65536; ++i) name_host.push_back({absl::StrCat("w", i), absl::StrCat("node", i / 8)});
  v1::JobSpec job = Job(128, 64, 8, 128);
  auto plan = MakePlan(job, Workers(name_host), 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->ranks_size(), 65536);
  std::set<std::string> names;
  for (int i = 0; i < plan->ranks_size(); ++i) {
    const auto& r = plan->ranks(i);
    names.insert(r.worker_name());
    ASSERT_EQ(r.global_rank(), i);
    ASSERT_EQ(r.host(), plan->ranks(i - r.tp_rank()).host()) << "rank " << i;
  }
  EXPECT_EQ(names.size(), 65536u);
  EXPECT_EQ(plan->spares_size(), 0);
}

TEST(PlannerTest, SameWorkersGiveTheSamePlanWhateverTheirOrder) {
  auto w1 = Workers({{"x", "h"}, {"y", "h"}, {"z", "h"}});
  auto w2 = Workers({{"z", "h"}, {"x", "h"}, {"y", "h"}});
  for (auto& w : w2) w.set_worker_id(w.name() == "x" ? 1 : w.name() == "y" ? 2 : 3);
  auto p1 = MakePlan(Job(3, 3, 1, 1), w1, 1), p2 = MakePlan(Job(3, 3, 1, 1), w2, 1);
  ASSERT_TRUE(p1.ok() && p2.ok());
  EXPECT_EQ(p1->SerializeAsString(), p2->SerializeAsString());
}

TEST(PlannerTest, DataParallelReplicasGetDistinctWorkers) {
  auto workers = Workers({{"w0", "h"}, {"w1", "h"}, {"w2", "h"}, {"w3", "h"}, {"w4", "h"}, {"w5", "h"},
                          {"w6", "h"}, {"w7", "h"}});
  auto plan = MakePlan(Job(4, 2, 2, 2), workers, 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::set<std::string> names;
  for (const auto& r : plan->ranks()) names.insert(r.worker_name());
  EXPECT_EQ(names.size(), 8u);
  EXPECT_EQ(plan->ranks(7).dp_rank(), 1);
  EXPECT_EQ(plan->ranks(7).global_rank(), 7);
}

// The data plane: NCCL only when every rank has a GPU of its own.
TEST(PlannerTest, NcclOnlyWhenEveryRankHasAGpuOfItsOwn) {
  auto with_devices = [](std::vector<std::pair<std::string, std::string>> host_device) {
    std::vector<std::pair<std::string, std::string>> names;
    for (size_t i = 0; i < host_device.size(); ++i) names.push_back({absl::StrCat("w", i), host_device[i].first});
    std::vector<v1::WorkerInfo> workers = Workers(names);
    for (size_t i = 0; i < workers.size(); ++i) workers[i].set_device(host_device[i].second);
    return workers;
  };
  auto backend = [](const v1::JobSpec& job, const std::vector<v1::WorkerInfo>& workers) {
    auto plan = MakePlan(job, workers, 1);
    EXPECT_TRUE(plan.ok()) << plan.status();
    if (!plan.ok()) return std::string("error");
    for (const v1::RankAssignment& r : plan->ranks()) {
      auto w = std::find_if(workers.begin(), workers.end(),
                            [&](const v1::WorkerInfo& i) { return i.name() == r.worker_name(); });
      EXPECT_EQ(r.device(), w->device()) << r.worker_name();
      EXPECT_EQ(r.device_uuid(), w->device_uuid()) << r.worker_name();
    }
    return plan->comm_backend();
  };
  auto with_uuids = [](std::vector<v1::WorkerInfo> workers, std::vector<std::string> uuids) {
    for (size_t i = 0; i < workers.size(); ++i) workers[i].set_device_uuid(uuids[i]);
    return workers;
  };
  const v1::JobSpec gpt = Job(4, 2, 2, 1);
  // Four GPUs of one host, and two GPUs on each of two hosts: NCCL.
  EXPECT_EQ(backend(gpt, with_devices({{"h", "cuda:0"}, {"h", "cuda:1"}, {"h", "cuda:2"}, {"h", "cuda:3"}})), "nccl");
  EXPECT_EQ(backend(gpt, with_devices({{"a", "cuda:0"}, {"a", "cuda:1"}, {"b", "cuda:0"}, {"b", "cuda:1"}})), "nccl");
  // Two ranks on one GPU (one GPU shared by a pipeline on one machine): Gloo.
  EXPECT_EQ(backend(gpt, with_devices({{"h", "cuda:0"}, {"h", "cuda:0"}, {"h", "cuda:1"}, {"h", "cuda:2"}})), "gloo");
  // Pods with host names of their own on one node: by name four distinct
  // GPUs, by UUID two of them the same GPU (time-slicing): Gloo. Four UUIDs: NCCL.
  const auto pods = with_devices({{"p0", "cuda:0"}, {"p1", "cuda:0"}, {"p2", "cuda:0"}, {"p3", "cuda:0"}});
  EXPECT_EQ(backend(gpt, with_uuids(pods, {"GPU-a", "GPU-b", "GPU-a", "GPU-c"})), "gloo");
  EXPECT_EQ(backend(gpt, with_uuids(pods, {"GPU-a", "GPU-b", "GPU-c", "GPU-d"})), "nccl");
  // One host whose workers see their GPUs through different
  // CUDA_VISIBLE_DEVICES: cuda:0 and cuda:1 may be one GPU; the UUID says so.
  const auto one_host = with_devices({{"h", "cuda:0"}, {"h", "cuda:1"}, {"h", "cuda:2"}, {"h", "cuda:3"}});
  EXPECT_EQ(backend(gpt, with_uuids(one_host, {"GPU-a", "GPU-a", "GPU-b", "GPU-c"})), "gloo");
  // A CPU or simulated device anywhere: Gloo.
  EXPECT_EQ(backend(gpt, with_devices({{"h", "cuda:0"}, {"h", "cuda:1"}, {"h", "cpu"}, {"h", "cuda:2"}})), "gloo");
  EXPECT_EQ(backend(gpt, with_devices({{"h", "sim:0"}, {"h", "sim:1"}, {"h", "sim:2"}, {"h", "sim:3"}})), "gloo");
  // A synthetic model keeps its tensors in host memory: Gloo on GPUs too.
  v1::JobSpec synthetic = gpt;
  synthetic.mutable_model()->mutable_synthetic()->set_activation_bytes(64);
  EXPECT_EQ(backend(synthetic, with_devices({{"h", "cuda:0"}, {"h", "cuda:1"}, {"h", "cuda:2"}, {"h", "cuda:3"}})),
            "gloo");
}

// PlaceRank copies what the worker registered of its device onto its rank
// (recovery's replacements go through it too), fused attention included: the
// memory estimate reads it from the plan.
TEST(PlannerTest, PlaceRankCarriesTheWorkersDeviceFacts) {
  v1::WorkerInfo w;
  w.set_name("w3");
  w.set_host("box");
  w.set_device("cuda:1");
  w.set_device_uuid("GPU-a");
  w.set_fused_attention_bf16(true);
  w.set_verdict_in_run_step(true);
  v1::RankAssignment r;
  r.set_pp_rank(2);
  PlaceRank(w, &r);
  EXPECT_EQ(r.worker_name(), "w3");
  EXPECT_EQ(r.host(), "box");
  EXPECT_EQ(r.device(), "cuda:1");
  EXPECT_EQ(r.device_uuid(), "GPU-a");
  EXPECT_TRUE(r.fused_attention_bf16());
  EXPECT_TRUE(r.verdict_in_run_step());
  EXPECT_EQ(r.pp_rank(), 2);  // the rank's place is the caller's
  w.set_fused_attention_bf16(false);  // a replacement without them clears them
  w.set_verdict_in_run_step(false);
  PlaceRank(w, &r);
  EXPECT_FALSE(r.fused_attention_bf16());
  EXPECT_FALSE(r.verdict_in_run_step());
}

TEST(PlannerTest, TooFewWorkersSaysHowManyAreMissing) {
  auto plan = MakePlan(Job(4, 2, 2, 1), Workers({{"a", "h"}, {"b", "h"}}), 1);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(plan.status().message().find("start 2 more"), std::string::npos) << plan.status();
}

TEST(PlannerTest, InvalidSpecIsRejectedBeforePlanning) {
  auto plan = MakePlan(Job(2, 3, 1, 1), Workers({{"a", "h"}, {"b", "h"}, {"c", "h"}}), 1);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(plan.status().message().find("model.layers"), std::string::npos);
}

// Two workers per host, named so that name order is host order.
std::vector<v1::WorkerInfo> PairsOnHosts(int workers) {
  std::vector<std::pair<std::string, std::string>> name_host;
  for (int i = 0; i < workers; ++i) {
    name_host.push_back({absl::StrCat("w", i < 10 ? "0" : "", i), absl::StrCat("h", i / 2 < 10 ? "0" : "", i / 2)});
  }
  return Workers(name_host);
}

TEST(PlannerTest, ContextParallelRanksSitBetweenTpAndPp) {
  v1::JobSpec job = Job(4, 2, 2, 2);
  job.mutable_parallel()->set_cp(2);
  const std::vector<v1::WorkerInfo> workers = PairsOnHosts(17);
  // A job runs it: MakePlan plans the mesh MakePlanOfMesh does.
  auto plan = MakePlan(job, workers, 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  auto mesh = MakePlanOfMesh(job, workers, 1);
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  EXPECT_EQ(plan->SerializeAsString(), mesh->SerializeAsString());
  EXPECT_EQ(plan->cp(), 2);
  EXPECT_EQ(plan->ep(), 1);
  ASSERT_EQ(plan->ranks_size(), 16);
  ASSERT_EQ(plan->spares_size(), 1);
  EXPECT_EQ(plan->spares(0), "w16");
  std::set<std::tuple<int, int, int, int>> coords;
  std::set<std::string> names;
  for (int i = 0; i < plan->ranks_size(); ++i) {
    const v1::RankAssignment& r = plan->ranks(i);
    SCOPED_TRACE(absl::StrCat("rank ", i));
    EXPECT_EQ(r.global_rank(), i) << "ranks are listed in global-rank order";
    EXPECT_EQ(r.global_rank(), ((r.dp_rank() * 2 + r.pp_rank()) * 2 + r.cp_rank()) * 2 + r.tp_rank());
    EXPECT_TRUE(coords.insert({r.dp_rank(), r.pp_rank(), r.cp_rank(), r.tp_rank()}).second);
    EXPECT_TRUE(names.insert(r.worker_name()).second) << "one rank per worker";
    EXPECT_GE(r.cp_rank(), 0);
    EXPECT_LT(r.cp_rank(), 2);
  }
  EXPECT_EQ(coords.size(), 16u);
  // TP innermost, then CP, then PP, then DP.
  auto at = [&](int i) {
    const v1::RankAssignment& r = plan->ranks(i);
    return std::make_tuple(r.dp_rank(), r.pp_rank(), r.cp_rank(), r.tp_rank());
  };
  EXPECT_EQ(at(1), std::make_tuple(0, 0, 0, 1));
  EXPECT_EQ(at(2), std::make_tuple(0, 0, 1, 0));
  EXPECT_EQ(at(4), std::make_tuple(0, 1, 0, 0));
  EXPECT_EQ(at(8), std::make_tuple(1, 0, 0, 0));
  EXPECT_EQ(at(15), std::make_tuple(1, 1, 1, 1));
  // Every TP group still shares a host; the two CP blocks of one (dp, pp) do not.
  for (int i = 0; i < 16; i += 2) EXPECT_EQ(plan->ranks(i).host(), plan->ranks(i + 1).host()) << i;
  EXPECT_NE(plan->ranks(0).host(), plan->ranks(2).host());
}

TEST(PlannerTest, WithoutTheNewAxesMakePlanOfMeshIsMakePlan) {
  const std::vector<v1::WorkerInfo> workers = PairsOnHosts(13);
  for (const v1::JobSpec& job : {Job(4, 2, 2, 3), Job(6, 3, 1, 2), Job(2, 1, 2, 1)}) {
    auto a = MakePlan(job, workers, 3);
    auto b = MakePlanOfMesh(job, workers, 3);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(a->SerializeAsString(), b->SerializeAsString());
    EXPECT_EQ(a->cp(), 1);
    EXPECT_EQ(a->ep(), 1);
    for (const v1::RankAssignment& r : a->ranks()) {
      EXPECT_EQ(r.cp_rank(), 0);
      EXPECT_EQ(r.global_rank(), (r.dp_rank() * job.parallel().pp() + r.pp_rank()) * job.parallel().tp() + r.tp_rank());
    }
  }
}

TEST(PlannerTest, ExpertParallelismAddsNoRanks) {
  v1::JobSpec job = Job(4, 1, 2, 4);
  job.mutable_parallel()->set_ep(2);
  const std::vector<v1::WorkerInfo> workers = PairsOnHosts(8);
  auto refused = MakePlan(job, workers, 1);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("parallel.ep"), std::string::npos) << refused.status();
  auto plan = MakePlanOfMesh(job, workers, 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->ep(), 2);
  EXPECT_EQ(plan->dp(), 4);
  EXPECT_EQ(plan->ranks_size(), 8) << "ep is carved out of dp";
  EXPECT_EQ(plan->spares_size(), 0);
  job.mutable_parallel()->set_ep(3);
  auto bad = MakePlanOfMesh(job, workers, 1);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("must divide parallel.dp"), std::string::npos) << bad.status();
}

TEST(PlannerTest, AContextParallelJobWhoseSequencesDoNotSplitIsNotPlanned) {
  v1::JobSpec job = Job(4, 2, 1, 1);  // seq_len 16
  job.mutable_parallel()->set_cp(3);  // 2*cp = 6 chunks
  for (bool mesh : {false, true}) {
    auto plan = mesh ? MakePlanOfMesh(job, PairsOnHosts(6), 1) : MakePlan(job, PairsOnHosts(6), 1);
    ASSERT_FALSE(plan.ok()) << mesh;
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(plan.status().message().find("parallel.cp"), std::string::npos) << plan.status();
    EXPECT_NE(plan.status().message().find("model.seq_len"), std::string::npos) << plan.status();
  }
}

TEST(PlannerTest, TooFewWorkersForAContextParallelMeshCountsCp) {
  v1::JobSpec job = Job(4, 2, 1, 1);
  job.mutable_parallel()->set_cp(2);
  auto plan = MakePlanOfMesh(job, PairsOnHosts(3), 1);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(plan.status().message().find("pp*tp*cp*dp = 2*1*2*1 = 4"), std::string::npos) << plan.status();
  EXPECT_NE(plan.status().message().find("start 1 more"), std::string::npos) << plan.status();
}

}  // namespace
}  // namespace baton
