// Times build + lower + validate + simulate of pipeline schedules at growing
// sizes (p * m up to 64 * 1024) and prints each phase and its cost per
// microbatch-stage, to show that the pipeline runs in time linear in p * m.
//
//   bazel run //bench:schedule_bench            (all kinds, best of 5 runs)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "coordinator/schedule/builders.h"
#include "coordinator/schedule/lowering.h"
#include "coordinator/schedule/simulator.h"
#include "coordinator/schedule/validator.h"

namespace {

using Clock = std::chrono::steady_clock;
using baton::schedule::ScheduleSpec;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

struct Timing {
  double build = 0, lower = 0, validate = 0, simulate = 0;
  double total() const { return build + lower + validate + simulate; }
  size_t actions = 0;
  double bubble = 0;
};

// One run of the whole pipeline; exits on any error (a benchmark of a
// failing pipeline would be meaningless).
Timing RunOnce(const ScheduleSpec& spec) {
  Timing t;
  const auto t0 = Clock::now();
  auto built = baton::schedule::BuildSchedule(spec);
  const auto t1 = Clock::now();
  if (!built.ok()) {
    std::fprintf(stderr, "build: %s\n", std::string(built.status().message()).c_str());
    std::exit(1);
  }
  auto lowered = baton::schedule::Lower(*built);
  const auto t2 = Clock::now();
  if (!lowered.ok()) {
    std::fprintf(stderr, "lower: %s\n", std::string(lowered.status().message()).c_str());
    std::exit(1);
  }
  const absl::Status valid = baton::schedule::Validate(*lowered);
  const auto t3 = Clock::now();
  if (!valid.ok()) {
    std::fprintf(stderr, "validate: %s\n", std::string(valid.message()).c_str());
    std::exit(1);
  }
  auto sim = baton::schedule::Simulate(*lowered, baton::schedule::CostModel());
  const auto t4 = Clock::now();
  if (!sim.ok()) {
    std::fprintf(stderr, "simulate: %s\n", std::string(sim.status().message()).c_str());
    std::exit(1);
  }
  t.build = Seconds(t0, t1);
  t.lower = Seconds(t1, t2);
  t.validate = Seconds(t2, t3);
  t.simulate = Seconds(t3, t4);
  for (const auto& program : lowered->ranks) t.actions += program.size();
  t.bubble = sim->bubble_ratio;
  return t;
}

Timing Best(const ScheduleSpec& spec, int runs) {
  Timing best = RunOnce(spec);
  for (int i = 1; i < runs; ++i) {
    Timing t = RunOnce(spec);
    if (t.total() < best.total()) best = t;
  }
  return best;
}

}  // namespace

int main() {
  const std::vector<std::pair<int, int>> sizes = {{8, 128}, {16, 256}, {32, 512}, {64, 1024}};
  const std::vector<ScheduleSpec> kinds = {
      {"gpipe", 0, 0, 1}, {"1f1b", 0, 0, 1}, {"interleaved", 0, 0, 2}, {"zb-h1", 0, 0, 1},
      {"zb-v", 0, 0, 2},  {"dualpipe-v", 0, 0, 2}};
  std::printf("%-12s %4s %5s %9s %8s %8s %8s %8s %8s %10s %7s\n", "schedule", "p", "m", "actions",
              "build", "lower", "validate", "simulate", "total", "ns/(p*m)", "bubble");
  for (const ScheduleSpec& kind : kinds) {
    for (const auto& [p, m] : sizes) {
      ScheduleSpec spec = kind;
      spec.num_ranks = p;
      spec.microbatches = m;
      const Timing t = Best(spec, 5);
      std::printf("%-12s %4d %5d %9zu %7.1fms %7.1fms %7.1fms %7.1fms %7.1fms %10.0f %7.4f\n",
                  (kind.kind + (kind.virtual_stages > 1 ? " v=2" : "")).c_str(), p, m, t.actions,
                  t.build * 1e3, t.lower * 1e3, t.validate * 1e3, t.simulate * 1e3, t.total() * 1e3,
                  t.total() * 1e9 / (static_cast<double>(p) * m), t.bubble);
    }
  }
  return 0;
}
