// GPU test (tag `gpu`, one GPU): the NCCL watchdog ends an op that is stuck
// behind a long-running kernel on its stream, and neither the failed Wait,
// Abort nor destroying the communicator waits for that kernel.
//
// A spin kernel (spin_kernel.cuh) holds the communicator's stream until the
// test releases it; a collective is queued behind it with a short op
// timeout. "No hang" is checked without timing: every call under test must
// return while the kernel still spins (the kernel gives up on its own only
// after kSpinLimit, and says so). Run with:
//   bazel test //worker/comm:nccl_watchdog_test
#include <cuda_runtime.h>

#include <iostream>
#include <memory>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_status.h"
#include "worker/comm/nccl_communicator.h"
#include "worker/comm/spin_kernel.cuh"
#include "worker/comm/store.h"

namespace baton::comm {

// Reaches the communicator's own stream (friend of NcclCommunicator).
class NcclCommunicatorTestPeer {
 public:
  static cudaStream_t Stream(NcclCommunicator& c) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return c.stream_;
  }
};

namespace {

constexpr int64_t kSpinLimitNs = 120'000'000'000;  // the kernel's own limit: 120 s

TEST(NcclWatchdogTest, OpBehindALongKernelFailsAndAbortAndDestroyDoNotWaitForTheKernel) {
  int gpus = 0;
  absl::Status s = cuda::CudaDeviceCount(&gpus);
  ASSERT_TRUE(s.ok()) << "this test needs a GPU: " << s;
  ASSERT_GE(gpus, 1) << "this test needs a GPU";
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);

  InMemoryStore store;
  NcclOptions options;
  options.label = "watchdog gen 1";
  options.op_timeout = absl::Milliseconds(500);
  options.rendezvous_timeout = absl::Seconds(60);
  absl::StatusOr<std::unique_ptr<NcclCommunicator>> created = NcclCommunicator::Create(store, options);
  ASSERT_TRUE(created.ok()) << created.status();
  std::unique_ptr<NcclCommunicator> comm = std::move(*created);
  cudaStream_t stream = NcclCommunicatorTestPeer::Stream(*comm);

  int* flags = nullptr;  // [0] release, [1] state; mapped host memory
  ASSERT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&flags), 2 * sizeof(int), cudaHostAllocMapped),
            cudaSuccess);
  volatile int* release = flags;
  volatile int* state = flags + 1;
  *release = 0;
  *state = 0;
  int* dev_flags = nullptr;
  ASSERT_EQ(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev_flags), flags, 0), cudaSuccess);
  float* data = nullptr;
  ASSERT_EQ(cudaMalloc(&data, 1024 * sizeof(float)), cudaSuccess);
  cudaEvent_t after_spin = nullptr;
  ASSERT_EQ(cudaEventCreateWithFlags(&after_spin, cudaEventDisableTiming), cudaSuccess);

  ASSERT_EQ(testing::LaunchSpinUntilReleased(dev_flags, dev_flags + 1, kSpinLimitNs, stream),
            cudaSuccess);
  ASSERT_EQ(cudaEventRecord(after_spin, stream), cudaSuccess);
  for (int i = 0; i < 60000 && *state == 0; ++i) absl::SleepFor(absl::Milliseconds(1));
  ASSERT_EQ(*state, testing::kSpinning);

  // A collective queued behind the kernel: the watchdog fails it after the
  // op timeout and aborts the communicator.
  const absl::Time start = absl::Now();
  std::shared_ptr<Work> op = comm->AllReduceSum(Buffer{data, 1024, DType::kFloat32, 0});
  absl::Status waited = op->Wait(absl::Seconds(100));
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(*state, testing::kSpinning) << "Wait returned only after the kernel ended: " << waited;
  EXPECT_TRUE(absl::IsDeadlineExceeded(waited) || absl::IsAborted(waited)) << waited;
  EXPECT_NE(waited.message().find("AllReduceSum(1024 elements) on rank 0 of watchdog gen 1"),
            absl::string_view::npos)
      << waited;
  std::cout << "watchdog: the op behind the kernel failed after " << absl::FormatDuration(took)
            << " (op timeout " << absl::FormatDuration(options.op_timeout) << "): " << waited << "\n";

  // Later ops fail fast; Abort and destroy return while the kernel spins.
  absl::Status later = comm->Barrier()->Wait(absl::Seconds(100));
  EXPECT_TRUE(absl::IsAborted(later)) << later;
  comm->Abort("test");
  comm.reset();
  EXPECT_EQ(*state, testing::kSpinning) << "Abort or the destructor waited for the kernel";
  EXPECT_EQ(cudaEventQuery(after_spin), cudaErrorNotReady);

  // Release the kernel; the stream (destroyed, its work still running) drains.
  *release = 1;
  EXPECT_EQ(cudaEventSynchronize(after_spin), cudaSuccess);
  EXPECT_EQ(*state, testing::kReleased);
  cudaEventDestroy(after_spin);
  cudaFree(data);
  cudaFreeHost(flags);
}

// Runs only in the `multi_gpu` target (nccl_watchdog_two_gpu_test): the
// all-reduce's NCCL kernel on rank 0 is queued behind the spin kernel, so
// NCCL's own abort (which synchronises its internal stream, made to wait for
// that kernel) would block; rank 1's all-reduce waits for rank 0. Both
// watchdogs end their op, and rank 0's Abort and destroy return while the
// kernel still spins.
TEST(NcclWatchdogTest, TwoGpusCollectiveBehindALongKernelOnOneRank) {
  int gpus = 0;
  absl::Status s = cuda::CudaDeviceCount(&gpus);
  ASSERT_TRUE(s.ok()) << "this test needs two GPUs: " << s;
  ASSERT_GE(gpus, 2) << "this test needs two GPUs (bazel test --test_tag_filters=multi_gpu on such a machine)";
  InMemoryStore store;
  int* flags = nullptr;  // [0] release, [1] state; mapped host memory
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  ASSERT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&flags), 2 * sizeof(int),
                          cudaHostAllocMapped | cudaHostAllocPortable),
            cudaSuccess);
  volatile int* release = flags;
  volatile int* state = flags + 1;
  *release = 0;
  *state = 0;
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
      NcclOptions options;
      options.rank = r;
      options.size = 2;
      options.device = r;
      options.label = "watchdog2 gen 1";
      options.op_timeout = absl::Milliseconds(500);
      absl::StatusOr<std::unique_ptr<NcclCommunicator>> created = NcclCommunicator::Create(store, options);
      ASSERT_TRUE(created.ok()) << created.status();
      std::unique_ptr<NcclCommunicator> comm = std::move(*created);
      float* data = nullptr;
      ASSERT_EQ(cudaMalloc(&data, 1 << 20), cudaSuccess);
      cudaEvent_t after_spin = nullptr;
      if (r == 0) {
        int* dev_flags = nullptr;
        ASSERT_EQ(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev_flags), flags, 0), cudaSuccess);
        cudaStream_t stream = NcclCommunicatorTestPeer::Stream(*comm);
        ASSERT_EQ(cudaEventCreateWithFlags(&after_spin, cudaEventDisableTiming), cudaSuccess);
        ASSERT_EQ(testing::LaunchSpinUntilReleased(dev_flags, dev_flags + 1, kSpinLimitNs, stream),
                  cudaSuccess);
        ASSERT_EQ(cudaEventRecord(after_spin, stream), cudaSuccess);
        for (int i = 0; i < 60000 && *state == 0; ++i) absl::SleepFor(absl::Milliseconds(1));
        ASSERT_EQ(*state, testing::kSpinning);
      }
      absl::Status waited =
          comm->AllReduceSum(Buffer{data, (1 << 20) / 4, DType::kFloat32, r})->Wait(absl::Seconds(100));
      EXPECT_TRUE(absl::IsDeadlineExceeded(waited) || absl::IsAborted(waited)) << "rank " << r << ": " << waited;
      EXPECT_NE(waited.message().find("AllReduceSum"), absl::string_view::npos) << waited;
      comm->Abort("test");
      comm.reset();
      if (r == 0) {
        EXPECT_EQ(*state, testing::kSpinning) << "Wait, Abort or the destructor waited for the kernel";
        *release = 1;
        EXPECT_EQ(cudaEventSynchronize(after_spin), cudaSuccess);
        EXPECT_EQ(*state, testing::kReleased);
        cudaEventDestroy(after_spin);
      }
      cudaFree(data);
    });
  }
  for (auto& t : ranks) t.join();
  cudaFreeHost(flags);
}

}  // namespace
}  // namespace baton::comm
