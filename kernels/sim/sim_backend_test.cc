// The simulated device: CPU bits, real stream/event ordering, and the two
// mistakes it exists to catch — a host access to device memory (abort) and a
// missing wait (stale data, deterministically, because streams are lazy).
#include "kernels/sim/sim_backend.h"

#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kernels/arena.h"
#include "kernels/backend.h"
#include "kernels/ops.h"

namespace baton::kernels {
namespace {

const Device kSim = Device::Sim(0);

Tensor Random(Shape shape, uint32_t seed) {
  Tensor t = Tensor::Zeros(std::move(shape));
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist;
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = dist(gen);
  return t;
}

Tensor OnSim(const ExecContext& ctx, const Tensor& host) {
  Tensor d = *ZerosOn(kSim, host.shape(), host.dtype());
  Copy(ctx, d, host);
  return d;
}

std::vector<float> ToHost(const ExecContext& ctx, const Tensor& d) {
  std::vector<float> out(d.numel());
  Copy(ctx, Tensor::View(out.data(), {d.numel()}), d);
  EXPECT_TRUE(ctx.stream->Synchronize().ok());
  return out;
}

std::vector<float> Values(const Tensor& host) {
  return std::vector<float>(host.f32(), host.f32() + host.numel());
}

TEST(SimBackendTest, OpsGiveTheCpuBits) {
  auto stream = *Stream::Create(kSim);
  const ExecContext ctx = ExecContext::On(stream.get());
  const int64_t n = 6, in = 8, out = 5;
  Tensor x = Random({n, in}, 1), w = Random({out, in}, 2), b = Random({out}, 3);
  Tensor y = Tensor::Zeros({n, out}), ln = Tensor::Zeros({n, out});
  Tensor mean = Tensor::Zeros({n}), rstd = Tensor::Zeros({n}), lw = Random({out}, 4),
         lb = Random({out}, 5);
  Linear(y, x, w, b);
  LayerNorm(ln, mean, rstd, y, lw, lb);
  const double cpu_sq = SumOfSquares(ln);

  Tensor dx = OnSim(ctx, x), dw = OnSim(ctx, w), db = OnSim(ctx, b), dlw = OnSim(ctx, lw),
         dlb = OnSim(ctx, lb);
  Tensor dy = *ZerosOn(kSim, {n, out}), dln = *ZerosOn(kSim, {n, out});
  Tensor dmean = *ZerosOn(kSim, {n}), drstd = *ZerosOn(kSim, {n});
  Tensor sq = *ZerosOn(kSim, {1}, DType::kFloat64);
  Linear(ctx, dy, dx, dw, db);
  LayerNorm(ctx, dln, dmean, drstd, dy, dlw, dlb);
  SumOfSquares(ctx, dln, sq);
  double sim_sq = 0;
  Copy(ctx, Tensor::View(&sim_sq, {1}, DType::kFloat64), sq);
  ASSERT_TRUE(stream->Synchronize().ok());
  EXPECT_EQ(ToHost(ctx, dln), Values(ln));
  EXPECT_EQ(ToHost(ctx, dy), Values(y));
  EXPECT_EQ(sim_sq, cpu_sq);
}

// The bytes of device tensor `d`, copied back to the host.
std::vector<unsigned char> BytesOf(const ExecContext& ctx, const Tensor& d) {
  std::vector<unsigned char> out(d.bytes());
  Copy(ctx, Tensor::View(out.data(), d.shape(), d.dtype()), d);
  EXPECT_TRUE(ctx.stream->Synchronize().ok());
  return out;
}

std::vector<unsigned char> BytesOf(const Tensor& host) {
  const auto* p = static_cast<const unsigned char*>(host.raw());
  return std::vector<unsigned char>(p, p + host.bytes());
}

// The Llama blocks (RmsNorm, SwiGlu, RopePack with grouped heads and their
// backwards), fp32 and with bf16 where they take it: the CPU's bits.
TEST(SimBackendTest, LlamaBlocksGiveTheCpuBits) {
  auto stream = *Stream::Create(kSim);
  const ExecContext ctx = ExecContext::On(stream.get());
  const ExecContext& cpu = ExecContext::Host();
  const int64_t b = 2, t = 5, heads = 4, kv = 2, d = 8, n = b * t, c = heads * d;
  const float theta = 10000.0f;
  Tensor x = Random({n, c}, 11), w = Random({c}, 12), dy = Random({n, c}, 13);
  Tensor q = Random({n, c}, 14), k = Random({n, kv * d}, 15), v = Random({n, kv * d}, 16);
  Tensor g = Random({b, t, 3 * c}, 17);
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    // On the CPU.
    Tensor y = Tensor::Zeros({n, c}, dtype), rstd = Tensor::Zeros({n});
    Tensor dx = Tensor::Zeros({n, c}), dw = Tensor::Zeros({c});
    Tensor s = Tensor::Zeros({n, c}), dgate = Tensor::Zeros({n, c}), dup = Tensor::Zeros({n, c});
    Tensor qkv = Tensor::Zeros({b, t, 3 * c}, dtype), dqkv = Tensor::Zeros({b, t, 3 * c}, dtype);
    Tensor dq = Tensor::Zeros({n, c}, dtype), dk = Tensor::Zeros({n, kv * d}, dtype),
           dv = Tensor::Zeros({n, kv * d}, dtype);
    Cast(cpu, dqkv, g);
    RmsNorm(cpu, y, rstd, x, w, 1e-5f);
    RmsNormBackward(cpu, dx, dw, dy, x, w, rstd);
    SwiGlu(cpu, s, x, dy);
    SwiGluBackward(cpu, dgate, dup, dy, x, q);
    RopePack(cpu, qkv, q, k, v, heads, kv, theta);
    RopePackBackward(cpu, dq, dk, dv, dqkv, heads, kv, theta);

    // On the simulated device.
    Tensor sx = OnSim(ctx, x), sw = OnSim(ctx, w), sdy = OnSim(ctx, dy), sq = OnSim(ctx, q),
           sk = OnSim(ctx, k), sv = OnSim(ctx, v), sdqkv = OnSim(ctx, dqkv);
    Tensor sy = *ZerosOn(kSim, {n, c}, dtype), srstd = *ZerosOn(kSim, {n});
    Tensor sdx = *ZerosOn(kSim, {n, c}), sdw = *ZerosOn(kSim, {c});
    Tensor ss = *ZerosOn(kSim, {n, c}), sdgate = *ZerosOn(kSim, {n, c}),
           sdup = *ZerosOn(kSim, {n, c});
    Tensor sqkv = *ZerosOn(kSim, {b, t, 3 * c}, dtype);
    Tensor sdq = *ZerosOn(kSim, {n, c}, dtype), sdk = *ZerosOn(kSim, {n, kv * d}, dtype),
           sdv = *ZerosOn(kSim, {n, kv * d}, dtype);
    RmsNorm(ctx, sy, srstd, sx, sw, 1e-5f);
    RmsNormBackward(ctx, sdx, sdw, sdy, sx, sw, srstd);
    SwiGlu(ctx, ss, sx, sdy);
    SwiGluBackward(ctx, sdgate, sdup, sdy, sx, sq);
    RopePack(ctx, sqkv, sq, sk, sv, heads, kv, theta);
    RopePackBackward(ctx, sdq, sdk, sdv, sdqkv, heads, kv, theta);

    const std::vector<std::pair<Tensor, Tensor>> pairs = {
        {sy, y},     {srstd, rstd}, {sdx, dx}, {sdw, dw}, {ss, s},  {sdgate, dgate},
        {sdup, dup}, {sqkv, qkv},   {sdq, dq}, {sdk, dk}, {sdv, dv}};
    for (size_t i = 0; i < pairs.size(); ++i) {
      EXPECT_EQ(BytesOf(ctx, pairs[i].first), BytesOf(pairs[i].second))
          << "output " << i << (dtype == DType::kBFloat16 ? " (bf16)" : " (fp32)");
    }
  }
}

// The CPU and the simulated device keep P for attention's backward (the
// model allocates what AttentionBuffersFor says) and read T·T floats of
// scratch; an att smaller than that is refused.
TEST(SimBackendTest, AttentionKeepsTheProbabilitiesOnTheCpuAndTheSimulatedDevice) {
  auto stream = *Stream::Create(kSim);
  const ExecContext sim = ExecContext::On(stream.get());
  for (const ExecContext* ctx : {&ExecContext::Host(), &sim}) {
    for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
      const AttentionBuffers b = AttentionBuffersFor(*ctx, 2, 7, 12, 3, dtype);
      EXPECT_EQ(b.saved, Shape({2, 3, 7, 7})) << ctx->backend->name;
      EXPECT_EQ(b.saved_dtype, dtype);
      EXPECT_EQ(b.backward_scratch, 7 * 7);
    }
  }
}

TEST(SimBackendDeathTest, AttentionRefusesASavedBufferSmallerThanP) {
  const int64_t b = 1, t = 4, c = 4;
  Tensor qkv = Random({b, t, 3 * c}, 7), out = Tensor::Zeros({b, t, c});
  Tensor att = Tensor::Zeros({b, 2, t, t - 1});
  EXPECT_DEATH(Attention(out, att, qkv, 2), "smaller than AttentionBuffersFor");
}

TEST(SimBackendDeathTest, HostAccessToDeviceMemoryAborts) {
  Tensor d = *ZerosOn(kSim, {4});
  EXPECT_DEATH(d.f32(), "host access to a tensor on sim:0 \\[4\\]");
  EXPECT_DEATH(d.raw(), "host access");
  Arena arena(kSim);
  Tensor a = *arena.Allocate({2, 3});
  EXPECT_EQ(a.device(), kSim);
  EXPECT_DEATH(a.f32()[0] = 1.0f, "host access to a tensor on sim:0 \\[2, 3\\]");
}

// Host memory the simulated device copies without a host wait, holding `values`.
Tensor Pinned(const std::vector<float>& values) {
  Tensor t = *PinnedHostZeros(kSim, {static_cast<int64_t>(values.size())});
  std::copy(values.begin(), values.end(), t.f32());
  return t;
}

TEST(SimBackendTest, AReadWithoutWaitingSeesStaleDataAWaitedOneTheResult) {
  auto stream = *Stream::Create(kSim);
  const ExecContext ctx = ExecContext::On(stream.get());
  Tensor src = Pinned({1, 2, 3, 4}), dst = Pinned(std::vector<float>(4, -1.0f));
  Tensor d = *ZerosOn(kSim, {4});
  const int64_t syncs = HostSyncCount();
  Copy(ctx, d, src);
  Copy(ctx, dst, d);
  // Nothing waited: the copies have not run.
  EXPECT_EQ(Values(dst), std::vector<float>(4, -1.0f));
  EXPECT_EQ(HostSyncCount(), syncs);
  ASSERT_TRUE(stream->Synchronize().ok());
  EXPECT_EQ(Values(dst), Values(src));
}

// As cudaMemcpyAsync: a copy to or from pageable host memory waits on the
// host for the stream (and counts as a host synchronisation); only pinned
// memory is copied in stream order.
TEST(SimBackendTest, ACopyWithPageableHostMemoryWaitsForTheStream) {
  auto stream = *Stream::Create(kSim);
  const ExecContext ctx = ExecContext::On(stream.get());
  std::vector<float> src = {1, 2, 3, 4}, dst(4, -1.0f);
  Tensor d = *ZerosOn(kSim, {4});
  const int64_t syncs = HostSyncCount();
  Copy(ctx, d, Tensor::View(src.data(), {4}));
  EXPECT_EQ(HostSyncCount(), syncs + 1);
  src.assign(4, 9.0f);  // the copy has run: changing the source changes nothing
  Copy(ctx, Tensor::View(dst.data(), {4}), d);
  EXPECT_EQ(HostSyncCount(), syncs + 2);
  EXPECT_EQ(dst, std::vector<float>({1, 2, 3, 4}));  // read with no Synchronize
}

TEST(SimBackendTest, PinnedHostMemoryIsKnownByItsRange) {
  Tensor pinned = *PinnedHostZeros(kSim, {8});
  EXPECT_EQ(pinned.device(), Device::Cpu());
  EXPECT_EQ(Values(pinned), std::vector<float>(8, 0.0f));
  EXPECT_TRUE(IsPinnedHost(pinned));
  EXPECT_TRUE(IsPinnedHost(pinned.Rows(2, 5)));
  // A view that runs past the allocation is not pinned as a whole.
  EXPECT_FALSE(IsPinnedHost(Tensor::View(pinned.f32() + 4, {8})));
  std::vector<float> pageable(8);
  EXPECT_FALSE(IsPinnedHost(Tensor::View(pageable.data(), {8})));
  EXPECT_FALSE(IsPinnedHost(*ZerosOn(kSim, {8})));  // device memory
  // On the CPU there is nothing to pin: plain host memory.
  EXPECT_FALSE(IsPinnedHost(*PinnedHostZeros(Device::Cpu(), {8})));
  const void* freed = nullptr;
  {
    Tensor gone = *PinnedHostZeros(kSim, {4});
    freed = gone.address();
  }
  EXPECT_FALSE(IsPinnedHost(Tensor::View(const_cast<void*>(freed), {1})));
}

TEST(SimBackendTest, EventsOrderTwoStreams) {
  auto producer = *Stream::Create(kSim);
  auto consumer = *Stream::Create(kSim);
  const ExecContext p = ExecContext::On(producer.get()), c = ExecContext::On(consumer.get());
  Tensor src = Pinned({5, 6, 7}), missed = Pinned(std::vector<float>(3, -1.0f)),
         ordered = Pinned(std::vector<float>(3, -1.0f));
  Tensor d = *ZerosOn(kSim, {3});
  Copy(p, d, src);
  auto ready = *Event::Create(kSim);
  ASSERT_TRUE(ready->Record(*producer).ok());

  // Without a wait the consumer reads d before the producer wrote it.
  Copy(c, missed, d);
  ASSERT_TRUE(consumer->Synchronize().ok());
  EXPECT_EQ(Values(missed), std::vector<float>(3, 0.0f));

  // With the event the consumer's copy runs after the producer's.
  ASSERT_TRUE(ready->StreamWait(*consumer).ok());
  Copy(c, ordered, d);
  ASSERT_TRUE(consumer->Synchronize().ok());
  EXPECT_EQ(Values(ordered), Values(src));
  ASSERT_TRUE(ready->Synchronize().ok());
}

TEST(SimBackendTest, DeviceArenaAllocatesOnceAcrossCycles) {
  Arena arena(kSim);
  const int64_t before = GetMemoryStats(kSim).system_allocations;
  for (int step = 0; step < 5; ++step) {
    ASSERT_TRUE(arena.Allocate({1000}).ok());
    ASSERT_TRUE(arena.Allocate({300000}).ok());  // forces a second block in the first cycle
    arena.Reset();
  }
  // Two blocks in the first cycle, one merged block after its Reset, none later.
  EXPECT_EQ(GetMemoryStats(kSim).system_allocations - before, 3);
  EXPECT_GT(GetMemoryStats(kSim).reserved_bytes, 0);
}

TEST(SimBackendTest, MemoryInUseAndReservedAreCounted) {
  const MemoryStats start = GetMemoryStats(kSim);
  {
    Tensor t = *ZerosOn(kSim, {1000});
    EXPECT_EQ(GetMemoryStats(kSim).in_use_bytes - start.in_use_bytes, 4000);
    EXPECT_EQ(GetMemoryStats(kSim).reserved_bytes - start.reserved_bytes, 4000);
    Arena arena(kSim);
    ASSERT_TRUE(arena.Allocate({16}).ok());  // 64 bytes, in a 1 MiB block
    EXPECT_EQ(GetMemoryStats(kSim).in_use_bytes - start.in_use_bytes, 4000 + 64);
    EXPECT_EQ(GetMemoryStats(kSim).reserved_bytes - start.reserved_bytes, 4000 + (1 << 20));
    arena.Reset();
    EXPECT_EQ(GetMemoryStats(kSim).in_use_bytes - start.in_use_bytes, 4000);
    ASSERT_TRUE(arena.Allocate({16}).ok());
  }
  EXPECT_EQ(GetMemoryStats(kSim).in_use_bytes, start.in_use_bytes);
  EXPECT_EQ(GetMemoryStats(kSim).reserved_bytes, start.reserved_bytes);
}

// A device arena that cannot grow past the device's memory fails the
// allocation with RESOURCE_EXHAUSTED naming device and bytes (as cudaMalloc
// on a full GPU), and stays usable: counters as before, allocations that fit
// still work, and with the limit lifted the large one does too.
TEST(SimBackendTest, ArenaOutOfDeviceMemoryIsResourceExhaustedAndStaysUsable) {
  const Device sim5 = Device::Sim(5);  // no other test uses it
  const int64_t base = GetMemoryStats(sim5).reserved_bytes;
  sim::SetSimDeviceMemoryLimitForTesting(base + (int64_t{4} << 20));
  {
    Arena arena(sim5, "an activation arena");
    ASSERT_TRUE(arena.Allocate({1 << 18}).ok());  // 1 MiB: the first block, full
    const MemoryStats before = GetMemoryStats(sim5);
    const int64_t allocations = arena.system_allocations();

    absl::StatusOr<Tensor> big = arena.Allocate({1 << 20});  // 4 MiB more: past the limit
    ASSERT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted) << big.status();
    const std::string message(big.status().message());
    EXPECT_NE(message.find("sim:5 is out of memory: an activation arena needs 4.0 MiB more (4194304 "
                           "bytes; the arena holds 1.0 MiB; 1.0 MiB held on the device"),
              std::string::npos)
        << message;
    EXPECT_EQ(arena.used_bytes(), size_t{1} << 20);
    EXPECT_EQ(arena.capacity_bytes(), size_t{1} << 20);
    EXPECT_EQ(arena.system_allocations(), allocations);
    EXPECT_EQ(GetMemoryStats(sim5).in_use_bytes, before.in_use_bytes);
    EXPECT_EQ(GetMemoryStats(sim5).reserved_bytes, before.reserved_bytes);

    // What fits still comes: a second 1 MiB block.
    absl::StatusOr<Tensor> small = arena.Allocate({1000});
    ASSERT_TRUE(small.ok()) << small.status();
    EXPECT_EQ(small->device(), sim5);
    EXPECT_EQ(arena.used_bytes(), (size_t{1} << 20) + 4032);
    EXPECT_EQ(GetMemoryStats(sim5).in_use_bytes, before.in_use_bytes + 4032);
    arena.Reset();  // merges into one 2 MiB block
    EXPECT_EQ(arena.used_bytes(), 0u);
    EXPECT_EQ(arena.capacity_bytes(), size_t{2} << 20);

    sim::SetSimDeviceMemoryLimitForTesting(0);
    absl::StatusOr<Tensor> lifted = arena.Allocate({1 << 20});
    EXPECT_TRUE(lifted.ok()) << lifted.status();
  }
  sim::SetSimDeviceMemoryLimitForTesting(0);
  EXPECT_EQ(GetMemoryStats(sim5).reserved_bytes, base);
  EXPECT_EQ(GetMemoryStats(sim5).in_use_bytes, 0);
}

// A host function (Stream::LaunchHostFunc) runs in the stream's order
// without the host waiting for it, even on a lazy stream (it stands for
// communication a peer may be blocked on): it sees the stream's earlier
// work done, and the stream's later work waits for it.
TEST(SimBackendTest, HostFunctionRunsInStreamOrderWithoutAHostWait) {
  auto stream = *Stream::Create(kSim);
  const ExecContext ctx = ExecContext::On(stream.get());
  Tensor d = *ZerosOn(kSim, {1});
  Tensor one = Tensor::Zeros({1});
  one.f32()[0] = 1.0f;
  Copy(ctx, d, one);  // enqueued before the function: done when it runs
  absl::Notification ran;
  float seen = -1;
  ASSERT_TRUE(stream
                  ->LaunchHostFunc([&] {
                    seen = *static_cast<const float*>(d.address());
                    *static_cast<float*>(d.address()) = 2.0f;  // the stream's own thread
                    ran.Notify();
                  })
                  .ok());
  const int64_t syncs = HostSyncCount();
  ran.WaitForNotification();  // would block forever if the lazy stream held it back
  EXPECT_EQ(HostSyncCount(), syncs);
  EXPECT_EQ(seen, 1.0f);
  EXPECT_EQ(ToHost(ctx, d), std::vector<float>{2.0f});  // the copy out ran after the function
}

// StampTime reads the clock when the stream reaches it, not when the host
// enqueues it: on the CPU (inline) between the host times around the call;
// on a lazy simulated stream, which runs nothing until the host waits, after
// the host time taken between enqueueing and waiting. The offset is added.
TEST(SimBackendTest, StampTimeIsTheClockWhenTheStreamGetsThere) {
  constexpr int64_t kOffset = 7'000'000;
  Tensor host = Tensor::Zeros({1}, DType::kInt64);
  const int64_t before = absl::ToUnixMicros(absl::Now());
  StampTime(ExecContext::Host(), host, kOffset);
  const int64_t after = absl::ToUnixMicros(absl::Now());
  const int64_t cpu = *static_cast<int64_t*>(host.raw()) - kOffset;
  EXPECT_GE(cpu, before);
  EXPECT_LE(cpu, after);

  auto stream = *Stream::Create(kSim);
  const ExecContext ctx = ExecContext::On(stream.get());
  Tensor stamp = *ZerosOn(kSim, {1}, DType::kInt64);
  StampTime(ctx, stamp, kOffset);
  absl::SleepFor(absl::Milliseconds(2));
  const int64_t enqueued = absl::ToUnixMicros(absl::Now());
  int64_t got = 0;
  Copy(ctx, Tensor::View(&got, {1}, DType::kInt64), stamp);
  ASSERT_TRUE(stream->Synchronize().ok());
  EXPECT_GE(got - kOffset, enqueued) << "the simulated stream read the clock at enqueue time";
}

}  // namespace
}  // namespace baton::kernels
