// Property tests over p in 1..8, m in 1..32, v in {1, 2, 4}: every builder's
// output and its lowering pass the validator, and the simulated bubble and
// activations match the closed forms with equal costs and free communication.
#include <algorithm>
#include <vector>

#include "coordinator/schedule/builders.h"
#include "coordinator/schedule/lowering.h"
#include "coordinator/schedule/simulator.h"
#include "coordinator/schedule/validator.h"
#include "gtest/gtest.h"

namespace baton::schedule {
namespace {

constexpr double kEps = 1e-9;

// Builds, validates, lowers and validates again; returns {compute, lowered}.
std::pair<Schedule, Schedule> BuildChecked(const ScheduleSpec& spec) {
  auto built = BuildSchedule(spec);
  EXPECT_TRUE(built.ok()) << built.status();
  if (!built.ok()) return {};
  EXPECT_TRUE(Validate(*built).ok()) << Validate(*built);
  auto lowered = Lower(*built);
  EXPECT_TRUE(lowered.ok()) << lowered.status();
  if (!lowered.ok()) return {};
  EXPECT_TRUE(Validate(*lowered).ok()) << Validate(*lowered);
  return {*built, *lowered};
}

SimulationResult SimulateOk(const Schedule& s, bool blocking_sends = false) {
  CostModel costs;
  costs.blocking_sends = blocking_sends;
  auto sim = Simulate(s, costs);
  EXPECT_TRUE(sim.ok()) << sim.status();
  return sim.ok() ? *sim : SimulationResult();
}

// The ways one schedule is simulated: as built, and lowered with buffered or
// blocking sends.
struct Variant {
  const char* name;
  const Schedule* schedule;
  bool blocking_sends;
};

std::vector<Variant> Variants(const Schedule& compute, const Schedule& lowered) {
  return {{"compute-only", &compute, false},
          {"lowered, buffered sends", &lowered, false},
          {"lowered, blocking sends", &lowered, true}};
}

TEST(ScheduleProperties, GpipeAndOneFOneBBubbleAndActivations) {
  for (int p = 1; p <= 8; ++p) {
    for (int m = 1; m <= 32; ++m) {
      for (const char* kind : {"gpipe", "1f1b"}) {
        SCOPED_TRACE(testing::Message() << kind << " p=" << p << " m=" << m);
        auto [compute, lowered] = BuildChecked({kind, p, m, 1});
        const double expected = static_cast<double>(p - 1) / (m + p - 1);
        for (const Variant& variant : Variants(compute, lowered)) {
          SCOPED_TRACE(variant.name);
          SimulationResult sim = SimulateOk(*variant.schedule, variant.blocking_sends);
          EXPECT_NEAR(sim.bubble_ratio, expected, kEps);
          EXPECT_NEAR(sim.makespan, 3.0 * (m + p - 1), kEps);
          ASSERT_EQ(sim.ranks.size(), static_cast<size_t>(p));
          for (int r = 0; r < p; ++r) {
            EXPECT_NEAR(sim.ranks[r].bubble_ratio, expected, kEps) << "rank " << r;
            const int peak = std::string(kind) == "1f1b" ? std::min(p - r, m) : m;
            EXPECT_EQ(sim.ranks[r].peak_activations, peak) << "rank " << r;
          }
        }
      }
    }
  }
}

TEST(ScheduleProperties, InterleavedBubble) {
  for (int p = 1; p <= 8; ++p) {
    for (int m = 1; m <= 32; ++m) {
      for (int v : {1, 2, 4}) {
        SCOPED_TRACE(testing::Message() << "interleaved p=" << p << " m=" << m << " v=" << v);
        if (m % p != 0) {
          auto built = BuildSchedule({"interleaved", p, m, v});
          EXPECT_EQ(built.status().code(), absl::StatusCode::kInvalidArgument);
          continue;
        }
        auto [compute, lowered] = BuildChecked({"interleaved", p, m, v});
        const double expected = static_cast<double>(p - 1) / (v * m + p - 1);
        for (const Variant& variant : Variants(compute, lowered)) {
          SCOPED_TRACE(variant.name);
          SimulationResult sim = SimulateOk(*variant.schedule, variant.blocking_sends);
          if (variant.blocking_sends) {
            // Under rendezvous some messages find their receiver busy (the
            // interleaved timeline has no common idle moment for them), so
            // the bubble can only grow.
            EXPECT_GE(sim.bubble_ratio, expected - kEps);
            continue;
          }
          EXPECT_NEAR(sim.bubble_ratio, expected, kEps);
          // Chunks cost 1/v of a stage: the work per rank stays 3m.
          EXPECT_NEAR(sim.makespan, 3.0 * m + 3.0 * (p - 1) / v, kEps);
        }
      }
    }
  }
}

TEST(ScheduleProperties, ZeroBubbleH1AgainstOneFOneB) {
  for (int p = 1; p <= 8; ++p) {
    for (int m = 1; m <= 32; ++m) {
      SCOPED_TRACE(testing::Message() << "zb-h1 p=" << p << " m=" << m);
      auto zb = BuildChecked({"zb-h1", p, m, 1});
      auto ofob = BuildChecked({"1f1b", p, m, 1});
      const std::vector<Variant> zb_variants = Variants(zb.first, zb.second);
      const std::vector<Variant> ofob_variants = Variants(ofob.first, ofob.second);
      for (size_t k = 0; k < zb_variants.size(); ++k) {
        SCOPED_TRACE(zb_variants[k].name);
        SimulationResult z = SimulateOk(*zb_variants[k].schedule, zb_variants[k].blocking_sends);
        SimulationResult o =
            SimulateOk(*ofob_variants[k].schedule, ofob_variants[k].blocking_sends);
        int peak_1f1b = 0;
        for (const RankStats& r : o.ranks) peak_1f1b = std::max(peak_1f1b, r.peak_activations);
        for (int r = 0; r < p; ++r) {
          const double zb_bubble = z.makespan - z.ranks[r].busy;
          const double ofob_bubble = o.makespan - o.ranks[r].busy;
          // F = I = W = 1, so one op of slack is 1. With m < p the critical
          // path (p forwards, p input-backwards, one W) forbids the bound;
          // there zb-h1 must still not lose to 1F1B.
          const double bound = m >= p ? ofob_bubble / 3 + 1 : ofob_bubble;
          EXPECT_LE(zb_bubble, bound + kEps) << "rank " << r;
          EXPECT_LE(z.ranks[r].peak_activations, peak_1f1b) << "rank " << r;
        }
        if (m >= p) {
          EXPECT_NEAR(z.makespan, 3.0 * m + p - 1, kEps);
        }
      }
    }
  }
}

// ZB-V with F = I = W: once m >= 2p - 1 the only idle time is the fill
// every pipeline pays (p - 1 chunk-forwards before the last rank starts), so
// the makespan is the work 3m plus (p - 1) F-chunks, and no rank stores more
// than 1F1B's peak (p whole-stage microbatches = 2p chunks).
TEST(ScheduleProperties, ZeroBubbleVFillsEveryBubbleWithEqualCosts) {
  for (int p = 1; p <= 8; ++p) {
    for (int m = 1; m <= 32; ++m) {
      SCOPED_TRACE(testing::Message() << "zb-v p=" << p << " m=" << m);
      auto [compute, lowered] = BuildChecked({"zb-v", p, m, 2});
      auto ofob = BuildChecked({"1f1b", p, m, 1});
      int peak_1f1b = 0;
      for (const RankStats& r : SimulateOk(ofob.first).ranks) peak_1f1b = std::max(peak_1f1b, r.peak_activations);
      for (const Variant& variant : Variants(compute, lowered)) {
        SCOPED_TRACE(variant.name);
        SimulationResult sim = SimulateOk(*variant.schedule, variant.blocking_sends);
        for (int r = 0; r < p; ++r) {
          // Chunk-activations are half a stage's: 1F1B's peak is 2 * peak_1f1b of them.
          EXPECT_LE(sim.ranks[r].peak_activations, 2 * peak_1f1b) << "rank " << r;
          EXPECT_NEAR(sim.ranks[r].busy, 3.0 * m, kEps);
        }
        if (m >= 2 * p - 1) {
          EXPECT_NEAR(sim.makespan, 3.0 * m + 0.5 * (p - 1), kEps);
          EXPECT_LE(sim.bubble_ratio, 0.5 * (p - 1) / (3.0 * m) + kEps);
        }
      }
    }
  }
}

// DualPipe-V: the paper's bubble (PP/2 - 1)(F&B + B - 3W) of DualPipe over
// 2p chunks, i.e. (p - 1)(F&B + B - 3W) in chunk costs, exactly on every
// rank when F = I = W and the pair costs its two halves (F&B = F + B), and as
// an upper bound with unequal costs (compute-only order); a cheaper pair (a real overlap)
// shortens the step; at most 2p + 1 chunk-activations (the paper's PP + 1).
TEST(ScheduleProperties, DualPipeVBubbleFormula) {
  struct Costs {
    double f, i, w;
  };
  for (int p = 1; p <= 8; ++p) {
    for (int m = 2 * p; m <= 32; ++m) {
      SCOPED_TRACE(testing::Message() << "dualpipe-v p=" << p << " m=" << m);
      auto [compute, lowered] = BuildChecked({"dualpipe-v", p, m, 2});
      for (const Variant& variant : Variants(compute, lowered)) {
        for (const Costs& c : {Costs{1, 1, 1}, Costs{1, 2, 1}, Costs{1, 1.5, 0.5}}) {
          SCOPED_TRACE(testing::Message() << variant.name << ", F=" << c.f << " I=" << c.i << " W=" << c.w);
          CostModel costs;
          costs.forward = c.f;
          costs.backward_input = c.i;
          costs.backward_weight = c.w;
          costs.blocking_sends = variant.blocking_sends;
          auto sim = Simulate(*variant.schedule, costs);
          ASSERT_TRUE(sim.ok()) << sim.status();
          const double f = c.f / 2, b = (c.i + c.w) / 2, w = c.w / 2, fb = f + b;  // chunk costs (v = 2)
          const double formula = (p - 1) * (fb + b - 3 * w);
          const bool equal = c.f == c.i && c.i == c.w;
          for (int r = 0; r < p; ++r) {
            const double idle = sim->makespan - sim->ranks[r].busy;
            if (equal) {
              EXPECT_NEAR(idle, formula, kEps) << "rank " << r;
            } else if (variant.schedule == &compute) {
              // (The lowered programs place messages for equal costs, as
              // lowered here; the coordinator lowers with the job's costs.)
              EXPECT_LE(idle, formula + kEps) << "rank " << r;
            }
            EXPECT_LE(sim->ranks[r].peak_activations, 2 * p + 1) << "rank " << r;
          }
          if (p > 1) {
            CostModel overlapped = costs;
            overlapped.overlapped = 0.75 * (c.f + c.i + c.w);  // F&B a quarter below F + B
            auto faster = Simulate(*variant.schedule, overlapped);
            ASSERT_TRUE(faster.ok()) << faster.status();
            EXPECT_LT(faster->makespan, sim->makespan);
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace baton::schedule
