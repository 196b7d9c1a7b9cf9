// The Mixture-of-Experts routing ops of kernels/ops.h (RouterTopK,
// RouterTopKBackward, PlanDispatch, ExpertTokenCounts, Permute,
// PermuteBackward, Combine, CombineBackward, LoadBalancingLoss) through the
// backend seam: on the CPU every op gives exactly the bits of the
// kernels/cpu/moe.h functions it wraps (so no dimension is passed in the
// wrong place), the simulated device gives the CPU's bits, in both router
// modes; LoadBalancingLoss accumulates its loss and scales its gradient; and
// the ops abort naming themselves on a shape or dtype mismatch and where a
// backend has no MoE kernels.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/moe.h"
#include "kernels/ops.h"
#include "kernels/sim/sim_backend.h"

namespace baton::kernels {
namespace {

using Vec = std::vector<float>;
using Ivec = std::vector<int32_t>;
using Lvec = std::vector<int64_t>;

template <typename T>
bool SameBits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

template <typename T>
DType DTypeOf();
template <>
DType DTypeOf<float>() { return DType::kFloat32; }
template <>
DType DTypeOf<int32_t>() { return DType::kInt32; }
template <>
DType DTypeOf<int64_t>() { return DType::kInt64; }

// Where the ops run: the CPU (ExecContext::Host()) or sim:0 on its own
// stream; host vectors go up and results come back through Copy.
class Runner {
 public:
  explicit Runner(bool sim) {
    if (sim) {
      stream_ = *Stream::Create(Device::Sim(0));
      ctx_ = ExecContext::On(stream_.get());
    }
  }
  const ExecContext& ctx() const { return ctx_; }

  template <typename T>
  Tensor Zeros(Shape shape) {
    return *ZerosOn(ctx_.device, std::move(shape), DTypeOf<T>());
  }
  template <typename T>
  Tensor Up(const std::vector<T>& host, Shape shape) {
    Tensor d = Zeros<T>(shape);
    Copy(ctx_, d, Tensor::View(const_cast<T*>(host.data()), std::move(shape), DTypeOf<T>()));
    return d;
  }
  template <typename T>
  std::vector<T> Down(const Tensor& d) {
    std::vector<T> out(static_cast<size_t>(d.numel()));
    Copy(ctx_, Tensor::View(out.data(), {d.numel()}, DTypeOf<T>()), d);
    if (stream_ != nullptr) {
      EXPECT_TRUE(stream_->Synchronize().ok());
    }
    return out;
  }

 private:
  std::unique_ptr<Stream> stream_;
  ExecContext ctx_ = ExecContext::Host();
};

// N tokens, E experts, top-k K, hidden H: all different, so a dimension
// passed in another's place shows. Capacity 0.75 drops choices.
constexpr int64_t kTokens = 11, kExperts = 4, kTopK = 2, kHidden = 6;
constexpr double kCapacityFactor = 0.75;
constexpr float kCoef = 0.01f, kGradScale = 0.37f, kLossBefore = 0.5f;

// The inputs of one layer's routing: the router's logits, the tokens, what
// the experts return, and the gradients arriving from above.
struct Inputs {
  Vec logits, x, expert_out, dy, dexpert_in;
  int64_t capacity;
};

// Everything the ops write.
struct Outputs {
  Vec probs, gate, expert_in, y, dexpert_out, dgate, dx, dlogits, dlogits_aux, loss;
  Ivec expert, slot;
  Lvec counts, routed;
};

Vec Normal(int64_t size, std::mt19937& gen) {
  std::normal_distribution<float> dist;
  Vec v(size);
  for (float& x : v) x = dist(gen);
  return v;
}

Inputs MakeInputs(double capacity_factor = kCapacityFactor) {
  std::mt19937 gen(20240917);
  Inputs in;
  in.capacity = MoeExpertCapacity(kTokens, kExperts, kTopK, capacity_factor);
  const int64_t buffer = kExperts * in.capacity * kHidden;
  in.logits = Normal(kTokens * kExperts, gen);
  in.x = Normal(kTokens * kHidden, gen);
  in.expert_out = Normal(buffer, gen);
  in.dy = Normal(kTokens * kHidden, gen);
  in.dexpert_in = Normal(buffer, gen);
  return in;
}

// The layer's routing through the ops on `run`.
Outputs RunOps(Runner& run, const Inputs& in, bool renormalize) {
  const ExecContext& ctx = run.ctx();
  const int64_t n = kTokens, e = kExperts, k = kTopK, h = kHidden, c = in.capacity;
  const Tensor logits = run.Up(in.logits, {n, e}), x = run.Up(in.x, {n, h}),
               expert_out = run.Up(in.expert_out, {e, c, h}), dy = run.Up(in.dy, {n, h}),
               dexpert_in = run.Up(in.dexpert_in, {e, c, h});
  const Tensor probs = run.Zeros<float>({n, e}), gate = run.Zeros<float>({n, k}),
               expert = run.Zeros<int32_t>({n, k}), slot = run.Zeros<int32_t>({n, k}),
               counts = run.Zeros<int64_t>({e}), routed = run.Zeros<int64_t>({e}),
               expert_in = run.Zeros<float>({e, c, h}), y = run.Zeros<float>({n, h}),
               dexpert_out = run.Zeros<float>({e, c, h}), dgate = run.Zeros<float>({n, k}),
               dx = run.Zeros<float>({n, h}), dlogits = run.Zeros<float>({n, e}),
               dlogits_aux = run.Zeros<float>({n, e}), loss = run.Up(Vec{kLossBefore}, {1});
  RouterTopK(ctx, probs, expert, gate, logits, renormalize);
  PlanDispatch(ctx, slot, counts, expert, c);
  ExpertTokenCounts(ctx, routed, expert);
  Permute(ctx, expert_in, x, expert, slot);
  Combine(ctx, y, expert_out, gate, expert, slot);
  CombineBackward(ctx, dexpert_out, dgate, dy, expert_out, gate, expert, slot);
  PermuteBackward(ctx, dx, dexpert_in, expert, slot);
  RouterTopKBackward(ctx, dlogits, dgate, expert, gate, probs, renormalize);
  LoadBalancingLoss(ctx, loss, dlogits_aux, probs, expert, kCoef, kGradScale);
  Outputs out;
  out.probs = run.Down<float>(probs);
  out.gate = run.Down<float>(gate);
  out.expert = run.Down<int32_t>(expert);
  out.slot = run.Down<int32_t>(slot);
  out.counts = run.Down<int64_t>(counts);
  out.routed = run.Down<int64_t>(routed);
  out.expert_in = run.Down<float>(expert_in);
  out.y = run.Down<float>(y);
  out.dexpert_out = run.Down<float>(dexpert_out);
  out.dgate = run.Down<float>(dgate);
  out.dx = run.Down<float>(dx);
  out.dlogits = run.Down<float>(dlogits);
  out.dlogits_aux = run.Down<float>(dlogits_aux);
  out.loss = run.Down<float>(loss);
  return out;
}

// The same through the kernels/cpu functions directly; LoadBalancingLoss's
// op semantics spelled out: loss += float(the double loss), the gradient
// times grad_scale in float.
Outputs RunKernels(const Inputs& in, bool renormalize) {
  const int64_t n = kTokens, e = kExperts, k = kTopK, h = kHidden, c = in.capacity;
  Outputs out;
  out.probs.assign(n * e, 0);
  out.gate.assign(n * k, 0);
  out.expert.assign(n * k, 0);
  out.slot.assign(n * k, 0);
  out.counts.assign(e, 0);
  out.routed.assign(e, 0);
  out.expert_in.assign(e * c * h, 0);
  out.y.assign(n * h, 0);
  out.dexpert_out.assign(e * c * h, 0);
  out.dgate.assign(n * k, 0);
  out.dx.assign(n * h, 0);
  out.dlogits.assign(n * e, 0);
  out.dlogits_aux.assign(n * e, 0);
  cpu::RouterTopK(out.probs.data(), out.expert.data(), out.gate.data(), in.logits.data(), n, e, k,
                  renormalize);
  cpu::PlanDispatch(out.slot.data(), out.counts.data(), out.expert.data(), n, e, k, c);
  cpu::ExpertTokenCounts(out.routed.data(), out.expert.data(), n, e, k);
  cpu::Permute(out.expert_in.data(), in.x.data(), out.expert.data(), out.slot.data(), n, e, k, h,
               c);
  cpu::Combine(out.y.data(), in.expert_out.data(), out.gate.data(), out.expert.data(),
               out.slot.data(), n, k, h, c);
  cpu::CombineBackward(out.dexpert_out.data(), out.dgate.data(), in.dy.data(), in.expert_out.data(),
                       out.gate.data(), out.expert.data(), out.slot.data(), n, e, k, h, c);
  cpu::PermuteBackward(out.dx.data(), in.dexpert_in.data(), out.expert.data(), out.slot.data(), n,
                       k, h, c);
  cpu::RouterTopKBackward(out.dlogits.data(), out.dgate.data(), out.expert.data(), out.gate.data(),
                          out.probs.data(), n, e, k, renormalize);
  const double loss = cpu::LoadBalancingLoss(out.dlogits_aux.data(), out.probs.data(),
                                             out.expert.data(), n, e, k, kCoef);
  for (float& g : out.dlogits_aux) g *= kGradScale;
  out.loss = {kLossBefore + static_cast<float>(loss)};
  return out;
}

void ExpectSameBits(const Outputs& a, const Outputs& b) {
  EXPECT_TRUE(SameBits(a.probs, b.probs));
  EXPECT_TRUE(SameBits(a.gate, b.gate));
  EXPECT_EQ(a.expert, b.expert);
  EXPECT_EQ(a.slot, b.slot);
  EXPECT_EQ(a.counts, b.counts);
  EXPECT_EQ(a.routed, b.routed);
  EXPECT_TRUE(SameBits(a.expert_in, b.expert_in));
  EXPECT_TRUE(SameBits(a.y, b.y));
  EXPECT_TRUE(SameBits(a.dexpert_out, b.dexpert_out));
  EXPECT_TRUE(SameBits(a.dgate, b.dgate));
  EXPECT_TRUE(SameBits(a.dx, b.dx));
  EXPECT_TRUE(SameBits(a.dlogits, b.dlogits));
  EXPECT_TRUE(SameBits(a.dlogits_aux, b.dlogits_aux));
  EXPECT_TRUE(SameBits(a.loss, b.loss));
}

class MoeOpsTest : public ::testing::TestWithParam<bool> {
 protected:
  bool renormalize() const { return GetParam(); }
  const Inputs in_ = MakeInputs();
};

INSTANTIATE_TEST_SUITE_P(RouterModes, MoeOpsTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Renormalized" : "Raw";
                         });

TEST_P(MoeOpsTest, CpuOpsGiveTheKernelsBits) {
  Runner cpu(/*sim=*/false);
  const Outputs ops = RunOps(cpu, in_, renormalize());
  const Outputs direct = RunKernels(in_, renormalize());
  ExpectSameBits(ops, direct);
  // The case exercises what it should: some choices dropped, some kept,
  // every output written (a zero-filled output would match nothing).
  EXPECT_EQ(in_.capacity, 5);  // ceil(0.75 · 11 · 2 / 4)
  int64_t kept = 0;
  for (int64_t count : ops.counts) kept += count;
  EXPECT_GT(kept, 0);
  EXPECT_LT(kept, kTokens * kTopK);
  int64_t routed = 0;
  for (int64_t count : ops.routed) routed += count;
  EXPECT_EQ(routed, kTokens * kTopK);
  for (const Vec* v : {&ops.y, &ops.dx, &ops.dgate, &ops.dlogits, &ops.dlogits_aux}) {
    float norm = 0;
    for (float f : *v) norm += f * f;
    EXPECT_GT(norm, 0.0f);
  }
  EXPECT_GT(ops.loss[0], kLossBefore);
}

TEST_P(MoeOpsTest, SimulatedDeviceGivesTheCpuBits) {
  Runner cpu(/*sim=*/false), sim(/*sim=*/true);
  const Outputs a = RunOps(cpu, in_, renormalize());
  const Outputs b = RunOps(sim, in_, renormalize());
  ExpectSameBits(a, b);
  // And the same bits run to run.
  ExpectSameBits(RunOps(sim, in_, renormalize()), b);
}

TEST(MoeOpsSemanticsTest, RawAndRenormalizedGatesDiffer) {
  // The test above runs both modes; make sure the flag reaches the kernel.
  Runner sim(/*sim=*/true);
  const Inputs in = MakeInputs();
  const Outputs raw = RunOps(sim, in, false), renormalized = RunOps(sim, in, true);
  EXPECT_TRUE(SameBits(raw.probs, renormalized.probs));
  EXPECT_EQ(raw.expert, renormalized.expert);
  EXPECT_FALSE(SameBits(raw.gate, renormalized.gate));
  EXPECT_FALSE(SameBits(raw.dlogits, renormalized.dlogits));
}

TEST(MoeOpsSemanticsTest, LoadBalancingLossAccumulatesAndScalesItsGradient) {
  for (bool on_sim : {false, true}) {
    SCOPED_TRACE(on_sim ? "sim" : "cpu");
    Runner run(on_sim);
    const Inputs in = MakeInputs();
    const int64_t n = kTokens, e = kExperts, k = kTopK;
    const Tensor probs = run.Zeros<float>({n, e}), gate = run.Zeros<float>({n, k}),
                 expert = run.Zeros<int32_t>({n, k}), loss = run.Zeros<float>({1}),
                 scaled = run.Zeros<float>({n, e}), unscaled = run.Zeros<float>({n, e});
    RouterTopK(run.ctx(), probs, expert, gate, run.Up(in.logits, {n, e}), true);
    LoadBalancingLoss(run.ctx(), loss, unscaled, probs, expert, kCoef, 1.0f);
    const float once = run.Down<float>(loss)[0];
    LoadBalancingLoss(run.ctx(), loss, scaled, probs, expert, kCoef, kGradScale);
    const float twice = run.Down<float>(loss)[0];
    EXPECT_GT(once, 0.0f);
    EXPECT_EQ(twice, once + once);  // added, not overwritten
    const Vec a = run.Down<float>(unscaled), b = run.Down<float>(scaled);
    for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(b[i], a[i] * kGradScale) << i;
  }
}

// Buffers only as long as the fullest expert's kept count (shorter than
// PlanDispatch's capacity; here dropless, N·K) hold the same rows: Permute
// writes the first rows of the full-capacity buffers, and Combine of those
// rows gives the same y.
TEST(MoeOpsSemanticsTest, BuffersAsLongAsTheFullestExpertSuffice) {
  Runner sim(/*sim=*/true);
  const Inputs in = MakeInputs(/*capacity_factor=*/0.0);
  const Outputs full = RunOps(sim, in, true);
  int64_t rows = 0;
  for (int64_t count : full.counts) rows = std::max(rows, count);
  const int64_t n = kTokens, e = kExperts, h = kHidden, c = in.capacity;
  ASSERT_LT(rows, c) << "pick inputs whose fullest expert is below the capacity";
  // expert_out's first `rows` rows of each expert.
  Vec short_out(e * rows * h);
  for (int64_t i = 0; i < e; ++i) {
    std::memcpy(&short_out[i * rows * h], &in.expert_out[i * c * h], sizeof(float) * rows * h);
  }
  const Tensor expert = sim.Up(full.expert, {n, kTopK}), slot = sim.Up(full.slot, {n, kTopK}),
               gate = sim.Up(full.gate, {n, kTopK});
  const Tensor expert_in = sim.Zeros<float>({e, rows, h}), y = sim.Zeros<float>({n, h});
  Permute(sim.ctx(), expert_in, sim.Up(in.x, {n, h}), expert, slot);
  Combine(sim.ctx(), y, sim.Up(short_out, {e, rows, h}), gate, expert, slot);
  const Vec short_in = sim.Down<float>(expert_in);
  for (int64_t i = 0; i < e; ++i) {
    EXPECT_EQ(
        std::memcmp(&short_in[i * rows * h], &full.expert_in[i * c * h], sizeof(float) * rows * h),
        0)
        << "expert " << i;
  }
  EXPECT_TRUE(SameBits(sim.Down<float>(y), full.y));
}

// ---- argument checks ----

TEST(MoeOpsDeathTest, ShapeAndDtypeMismatchesAbortNamingTheOp) {
  ::testing::GTEST_FLAG(death_test_style) = "threadsafe";
  const Tensor logits = Tensor::Zeros({3, 4}), probs = Tensor::Zeros({3, 4}),
               gate = Tensor::Zeros({3, 2}), expert = Tensor::Zeros({3, 2}, DType::kInt32),
               slot = Tensor::Zeros({3, 2}, DType::kInt32),
               counts = Tensor::Zeros({4}, DType::kInt64), x = Tensor::Zeros({3, 5}),
               buffer = Tensor::Zeros({4, 2, 5});
  const ExecContext& ctx = ExecContext::Host();
  EXPECT_DEATH(RouterTopK(ctx, probs, gate, gate, logits, true),
               "RouterTopK: expert must be int32");
  EXPECT_DEATH(RouterTopK(ctx, probs, expert, gate, Tensor::Zeros({3, 1}), true),
               "RouterTopK: shape mismatch");
  EXPECT_DEATH(RouterTopKBackward(ctx, logits, Tensor::Zeros({2, 2}), expert, gate, probs, false),
               "RouterTopKBackward: shape mismatch");
  EXPECT_DEATH(PlanDispatch(ctx, slot, Tensor::Zeros({4}), expert, 2),
               "PlanDispatch: counts and routed must be int64");
  EXPECT_DEATH(PlanDispatch(ctx, slot, counts, expert, int64_t{1} << 31),
               "PlanDispatch: capacity must be in");
  EXPECT_DEATH(ExpertTokenCounts(ctx, Tensor::Zeros({1}, DType::kInt64), expert),
               "ExpertTokenCounts: shape mismatch");
  EXPECT_DEATH(Permute(ctx, buffer, Tensor::Zeros({3, 4}), expert, slot),
               "Permute: shape mismatch");
  EXPECT_DEATH(PermuteBackward(ctx, x, buffer, expert, Tensor::Zeros({3, 2})),
               "PermuteBackward: slot must be int32");
  EXPECT_DEATH(Combine(ctx, x, buffer, gate, expert, Tensor::Zeros({2, 2}, DType::kInt32)),
               "Combine: shape mismatch");
  EXPECT_DEATH(CombineBackward(ctx, buffer, gate, x, Tensor::Zeros({4, 3, 5}), gate, expert, slot),
               "CombineBackward: shape mismatch");
  EXPECT_DEATH(LoadBalancingLoss(ctx, Tensor::Zeros({1}, DType::kFloat64), logits, probs, expert,
                                 0.01f, 1.0f),
               "LoadBalancingLoss: loss must be a one-element float32");
  EXPECT_DEATH(MoeExpertCapacity(10, 4, 5, 1.0), "MoeExpertCapacity: want");
  EXPECT_DEATH(MoeExpertCapacity(10, 4, 2, -1.0), "MoeExpertCapacity: capacity_factor");
  EXPECT_DEATH(MoeExpertCapacity(int64_t{1} << 40, 1, 1, 1.0),
               "MoeExpertCapacity: capacity past 2\\^31");
}

TEST(MoeExpertCapacityTest, IsTheKernelsCapacity) {
  EXPECT_EQ(MoeExpertCapacity(100, 10, 1, 1.1), 11);
  EXPECT_EQ(MoeExpertCapacity(10, 4, 2, 0.0), 20);  // dropless: N·K
  EXPECT_EQ(MoeExpertCapacity(1000, 64, 2, 1.0), cpu::ExpertCapacity(1000, 64, 2, 1.0));
}

// A backend without MoE kernels (null entries, as CUDA's today): every op
// aborts naming itself and what to do, instead of calling through null.
TEST(MoeOpsDeathTest, ABackendWithoutMoeKernelsAbortsNamingTheOp) {
  ::testing::GTEST_FLAG(death_test_style) = "threadsafe";
  static Backend without = *FindBackend(DeviceType::kCpu);
  without.name = "fake";
  without.router_top_k = nullptr;
  without.router_top_k_backward = nullptr;
  without.plan_dispatch = nullptr;
  without.expert_token_counts = nullptr;
  without.permute = nullptr;
  without.permute_backward = nullptr;
  without.combine = nullptr;
  without.combine_backward = nullptr;
  without.load_balancing_loss = nullptr;
  ExecContext ctx;
  ctx.device = Device::Cpu();
  ctx.backend = &without;
  const Tensor logits = Tensor::Zeros({3, 4}), probs = Tensor::Zeros({3, 4}),
               gate = Tensor::Zeros({3, 2}), expert = Tensor::Zeros({3, 2}, DType::kInt32),
               slot = Tensor::Zeros({3, 2}, DType::kInt32),
               counts = Tensor::Zeros({4}, DType::kInt64), x = Tensor::Zeros({3, 5}),
               buffer = Tensor::Zeros({4, 2, 5}), loss = Tensor::Zeros({1});
  const char* no_kernel = ": Mixture-of-Experts routing has no fake kernel yet";
  auto expect = [&](const char* op) { return std::string(op) + no_kernel; };
  EXPECT_DEATH(RouterTopK(ctx, probs, expert, gate, logits, true), expect("RouterTopK"));
  EXPECT_DEATH(RouterTopKBackward(ctx, logits, gate, expert, gate, probs, true),
               expect("RouterTopKBackward"));
  EXPECT_DEATH(PlanDispatch(ctx, slot, counts, expert, 2), expect("PlanDispatch"));
  EXPECT_DEATH(ExpertTokenCounts(ctx, counts, expert), expect("ExpertTokenCounts"));
  EXPECT_DEATH(Permute(ctx, buffer, x, expert, slot), expect("Permute"));
  EXPECT_DEATH(PermuteBackward(ctx, x, buffer, expert, slot), expect("PermuteBackward"));
  EXPECT_DEATH(Combine(ctx, x, buffer, gate, expert, slot), expect("Combine"));
  EXPECT_DEATH(CombineBackward(ctx, buffer, gate, x, buffer, gate, expert, slot),
               expect("CombineBackward"));
  EXPECT_DEATH(LoadBalancingLoss(ctx, loss, logits, probs, expert, 0.01f, 1.0f),
               expect("LoadBalancingLoss"));
}

}  // namespace
}  // namespace baton::kernels
