// plan_bench: what the coordinator does between "every worker is ready" and
// "every worker has its Configure", on paper-scale meshes, without gRPC:
// MakePlan (the real planner, with its job-spec validation), the schedule
// pipeline the job runner runs (build, lower, validate, simulate,
// ToPrograms) and the Configure messages it would send (one per worker:
// plan + that rank's program + job), serialized.
//
//   bazel build -c opt //bench:plan_bench && bazel-bin/bench/plan_bench
//
// Prints one JSON object per mesh.
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "baton/v1/coordinator.pb.h"
#include "coordinator/planner.h"
#include "coordinator/schedule/builders.h"
#include "coordinator/schedule/ir.h"
#include "coordinator/schedule/lowering.h"
#include "coordinator/schedule/simulator.h"
#include "coordinator/schedule/validator.h"

namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

std::string Quote(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += (c == '\n' ? ' ' : c);
  }
  return out + "\"";
}

// Returns false when the plan or the schedule failed (the JSON says why).
bool Run(int pp, int tp, int dp, int v, int m) {
  const int world = pp * tp * dp;
  baton::v1::JobSpec job;
  job.set_name("plan-bench");
  job.mutable_model()->set_layers(pp * v);
  auto* syn = job.mutable_model()->mutable_synthetic();
  syn->set_forward_ms(1);
  syn->set_backward_input_ms(1);
  syn->set_backward_weight_ms(1);
  syn->set_activation_bytes(4);
  job.mutable_parallel()->set_pp(pp);
  job.mutable_parallel()->set_tp(tp);
  job.mutable_parallel()->set_dp(dp);
  job.mutable_parallel()->set_virtual_stages(v);
  job.mutable_schedule()->set_kind(v > 1 ? "interleaved" : "1f1b");
  job.mutable_schedule()->set_microbatches(m);
  job.mutable_train()->set_steps(1);
  job.mutable_train()->set_micro_batch_size(1);
  job.mutable_data()->mutable_synthetic();
  std::vector<baton::v1::WorkerInfo> ready(world);
  for (int i = 0; i < world; ++i) {
    ready[i].set_name(absl::StrCat("w", i));
    ready[i].set_worker_id(i + 1);
    ready[i].set_host(absl::StrCat("host", i / 8));
    ready[i].set_state(baton::v1::READY);
  }

  auto t = Clock::now();
  absl::StatusOr<baton::v1::Plan> plan = baton::MakePlan(job, ready, 1);
  const double plan_s = Since(t);

  namespace s = baton::schedule;
  s::ScheduleSpec spec{job.schedule().kind(), pp, m, v};
  t = Clock::now();
  auto built = s::BuildSchedule(spec);
  if (!built.ok()) {
    std::printf("{\"error\": %s}\n", Quote(std::string(built.status().message())).c_str());
    return false;
  }
  s::CostModel costs;
  costs.forward = costs.backward_input = costs.backward_weight = v;
  auto lowered = s::Lower(*built, costs);
  absl::Status valid = lowered.ok() ? s::Validate(*lowered) : lowered.status();
  auto sim = lowered.ok() ? s::Simulate(*lowered, costs) : lowered.status();
  std::vector<baton::v1::Program> programs;
  if (lowered.ok()) programs = s::ToPrograms(*lowered);
  const double schedule_s = Since(t);

  // The Configure messages, as the job runner builds them (the plan with
  // the worker's own rank only), and as it built them before (the whole
  // plan in every message), serialized.
  double configure_s = 0, configure_bytes = 0, full_plan_s = 0, full_plan_bytes = 0;
  if (plan.ok() && valid.ok()) {
    baton::v1::Plan shared = *plan;
    shared.clear_ranks();
    shared.clear_spares();
    t = Clock::now();
    for (const baton::v1::RankAssignment& r : plan->ranks()) {
      baton::v1::CoordinatorMessage msg;
      *msg.mutable_configure()->mutable_plan() = shared;
      *msg.mutable_configure()->mutable_plan()->add_ranks() = r;
      *msg.mutable_configure()->mutable_program() = programs[r.pp_rank()];
      *msg.mutable_configure()->mutable_job() = job;
      configure_bytes += static_cast<double>(msg.SerializeAsString().size());
    }
    configure_s = Since(t);
    t = Clock::now();
    // Quadratic (every rank in every message): ~140 GB at 65,536 ranks, so
    // only measured up to 4096.
    for (const baton::v1::RankAssignment& r : plan->ranks()) {
      if (world > 4096) break;
      baton::v1::CoordinatorMessage msg;
      *msg.mutable_configure()->mutable_plan() = *plan;
      *msg.mutable_configure()->mutable_program() = programs[r.pp_rank()];
      *msg.mutable_configure()->mutable_job() = job;
      full_plan_bytes += static_cast<double>(msg.SerializeAsString().size());
    }
    full_plan_s = Since(t);
  }
  std::printf(
      "{\"pp\": %d, \"tp\": %d, \"dp\": %d, \"ranks\": %d, \"virtual_stages\": %d, "
      "\"microbatches\": %d, \"plan_seconds\": %.4f, \"plan_error\": %s, "
      "\"schedule_seconds\": %.4f, \"schedule_error\": %s, \"bubble\": %.4f, "
      "\"plan_plus_schedule_seconds\": %.4f, \"configure_messages_seconds\": %.4f, "
      "\"configure_bytes_total\": %.0f, \"full_plan_configure_seconds\": %.4f, "
      "\"full_plan_configure_bytes_total\": %.0f}\n",
      pp, tp, dp, world, v, m, plan_s,
      Quote(plan.ok() ? "" : std::string(plan.status().message())).c_str(), schedule_s,
      Quote(valid.ok() ? "" : std::string(valid.message())).c_str(),
      sim.ok() ? sim->bubble_ratio : -1.0, plan_s + schedule_s, configure_s, configure_bytes, full_plan_s,
      full_plan_bytes);
  std::fflush(stdout);
  return plan.ok() && valid.ok();
}

}  // namespace

int main() {
  // The control-plane bench's meshes, then the paper-scale one.
  bool ok = Run(4, 4, 4, 2, 16);  // 64
  ok &= Run(8, 8, 4, 2, 32);      // 256
  ok &= Run(16, 8, 8, 2, 64);     // 1024
  ok &= Run(32, 8, 16, 2, 128);   // 4096
  ok &= Run(64, 8, 128, 2, 256);  // 65,536
  return ok ? 0 : 1;
}
