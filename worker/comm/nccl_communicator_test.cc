// GPU tests (tag `gpu`) of the NCCL backend: a one-rank communicator and the
// device paths on one GPU; send/recv and multi-rank collectives when the
// machine has two or more GPUs. Run with: bazel test //worker/comm:nccl_communicator_test
#include "worker/comm/nccl_communicator.h"

#include <cuda_runtime.h>

#include <numeric>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_status.h"
#include "worker/comm/communicator_factory.h"
#include "worker/comm/store.h"

namespace baton::comm {
namespace {

constexpr absl::Duration kWait = absl::Seconds(60);

class NcclCommunicatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::Status s = cuda::CudaDeviceCount(&gpus_);
    ASSERT_TRUE(s.ok()) << "this test needs a GPU: " << s;
  }

  // Device copy of `host`; freed at TearDown.
  float* ToDevice(const std::vector<float>& host) {
    float* d = nullptr;
    EXPECT_EQ(cudaMalloc(&d, host.size() * sizeof(float)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(d, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice),
              cudaSuccess);
    allocations_.push_back(d);
    return d;
  }
  std::vector<float> ToHost(const float* d, size_t n) {
    std::vector<float> host(n);
    EXPECT_EQ(cudaMemcpy(host.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }
  void TearDown() override {
    for (float* d : allocations_) cudaFree(d);
  }

  int gpus_ = 0;
  std::vector<float*> allocations_;
};

std::unique_ptr<Communicator> OneRank(Store& store, const std::string& group) {
  CommunicatorSpec spec;
  spec.group = group;
  spec.generation = 1;
  spec.backend = Backend::kNccl;
  spec.device = 0;
  spec.rendezvous_timeout = absl::Seconds(30);
  auto c = CreateCommunicator(store, spec);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

TEST_F(NcclCommunicatorTest, OneRankCollectivesOnDeviceMemory) {
  InMemoryStore store;
  auto comm = OneRank(store, "one");
  ASSERT_NE(comm, nullptr);
  EXPECT_EQ(comm->backend(), "nccl");
  const int64_t n = 1000003;
  std::vector<float> x(n);
  std::iota(x.begin(), x.end(), 0.25f);
  float* d = ToDevice(x);
  ASSERT_TRUE(comm->AllReduceSum(Buffer{d, n, DType::kFloat32, 0})->Wait(kWait).ok());
  EXPECT_EQ(ToHost(d, n), x) << "a one-rank sum is the input";

  float* out = ToDevice(std::vector<float>(n, -1));
  ASSERT_TRUE(comm->AllGather(Buffer{d, n, DType::kFloat32, 0}, Buffer{out, n, DType::kFloat32, 0})
                  ->Wait(kWait).ok());
  EXPECT_EQ(ToHost(out, n), x);
  float* rs = ToDevice(std::vector<float>(n, -1));
  ASSERT_TRUE(comm->ReduceScatterSum(Buffer{d, n, DType::kFloat32, 0}, Buffer{rs, n, DType::kFloat32, 0})
                  ->Wait(kWait).ok());
  EXPECT_EQ(ToHost(rs, n), x);
  ASSERT_TRUE(comm->Broadcast(Buffer{d, n, DType::kFloat32, 0}, 0)->Wait(kWait).ok());
  EXPECT_TRUE(comm->Barrier()->Wait(kWait).ok());
  EXPECT_EQ(store.Keys().size(), 2u) << "arrived/0 and nccl/unique_id";
}

// A one-rank AllToAllV is the rank's own chunk, through ncclSend/ncclRecv
// to itself; the shared argument checks and the host-memory refusal hold.
TEST_F(NcclCommunicatorTest, OneRankAllToAllVOnDeviceMemory) {
  InMemoryStore store;
  auto comm = OneRank(store, "one-a2av");
  ASSERT_NE(comm, nullptr);
  const int64_t n = 100003;
  std::vector<float> x(n);
  std::iota(x.begin(), x.end(), 0.5f);
  float* in = ToDevice(x);
  float* out = ToDevice(std::vector<float>(n, -1));
  absl::Status s = comm->AllToAllV(Buffer{in, n, DType::kFloat32, 0}, {n}, Buffer{out, n, DType::kFloat32, 0}, {n})
                       ->Wait(kWait);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(ToHost(out, n), x);
  // Zero elements: nothing to send, nothing posted to NCCL.
  s = comm->AllToAllV(Buffer{in, 0, DType::kFloat32, 0}, {0}, Buffer{out, 0, DType::kFloat32, 0}, {0})->Wait(kWait);
  EXPECT_TRUE(s.ok()) << s;

  s = comm->AllToAllV(Buffer{in, n, DType::kFloat32, 0}, {n - 1}, Buffer{out, n, DType::kFloat32, 0}, {n})
          ->Wait(kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("send_counts add up to"), absl::string_view::npos) << s;
  std::vector<float> host(4);
  s = comm->AllToAllV(Buffer::Host(host.data(), 4), {4}, Buffer{out, 4, DType::kFloat32, 0}, {4})->Wait(kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("host memory"), absl::string_view::npos) << s;
  absl::StatusOr<std::vector<int64_t>> counts = ExchangeCounts(*comm, {1}, kWait);
  EXPECT_EQ(counts.status().code(), absl::StatusCode::kUnimplemented) << counts.status();
}

TEST_F(NcclCommunicatorTest, HostBuffersAndOtherDevicesAreRejected) {
  InMemoryStore store;
  auto comm = OneRank(store, "reject");
  ASSERT_NE(comm, nullptr);
  std::vector<float> host(4);
  absl::Status s = comm->AllReduceSum(Buffer::Host(host.data(), 4))->Wait(kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("host memory"), absl::string_view::npos) << s;
}

TEST_F(NcclCommunicatorTest, AbortMakesLaterOpsFailFast) {
  InMemoryStore store;
  auto comm = OneRank(store, "abort");
  ASSERT_NE(comm, nullptr);
  float* d = ToDevice(std::vector<float>(16, 1));
  comm->Abort("test");
  const absl::Time start = absl::Now();
  absl::Status s = comm->AllReduceSum(Buffer{d, 16, DType::kFloat32, 0})->Wait(kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
}

TEST_F(NcclCommunicatorTest, MissingRankIsNamedBeforeNcclInit) {
  InMemoryStore store;
  CommunicatorSpec spec;
  spec.group = "absent";
  spec.backend = Backend::kNccl;
  spec.device = 0;
  spec.size = 2;
  spec.rendezvous_timeout = absl::Milliseconds(500);
  auto c = CreateCommunicator(store, spec);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(c.status().message().find("rank(s) 1 of 2"), absl::string_view::npos) << c.status();
}

// Runs only in the `multi_gpu` target (nccl_communicator_two_gpu_test).
TEST_F(NcclCommunicatorTest, TwoGpusSendRecvAndAllReduce) {
  ASSERT_GE(gpus_, 2) << "this test needs two GPUs (bazel test --test_tag_filters=multi_gpu on such a machine)";
  InMemoryStore store;
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      CommunicatorSpec spec;
      spec.group = "pair";
      spec.backend = Backend::kNccl;
      spec.rank = r;
      spec.size = 2;
      spec.device = r;
      auto c = CreateCommunicator(store, spec);
      ASSERT_TRUE(c.ok()) << c.status();
      ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
      const int64_t n = (1 << 20) + 3;
      float* d = nullptr;
      ASSERT_EQ(cudaMalloc(&d, n * sizeof(float)), cudaSuccess);
      std::vector<float> x(n, static_cast<float>(r + 1));
      ASSERT_EQ(cudaMemcpy(d, x.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_TRUE((*c)->AllReduceSum(Buffer{d, n, DType::kFloat32, r})->Wait(kWait).ok());
      std::vector<float> got(n);
      ASSERT_EQ(cudaMemcpy(got.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
      EXPECT_EQ(got[n - 1], 3.0f);
      auto w = r == 0 ? (*c)->Send(Buffer{d, n, DType::kFloat32, 0}, 1, 0)
                      : (*c)->Recv(Buffer{d, n, DType::kFloat32, 1}, 0, 0);
      ASSERT_TRUE(w->Wait(kWait).ok());
      cudaFree(d);
    });
  }
  for (auto& t : ranks) t.join();
}

// Uneven counts with a zero chunk each way: rank 0 sends rank 1 nothing.
TEST_F(NcclCommunicatorTest, TwoGpusAllToAllVWithUnevenCounts) {
  ASSERT_GE(gpus_, 2) << "this test needs two GPUs (bazel test --test_tag_filters=multi_gpu on such a machine)";
  InMemoryStore store;
  const int64_t count[2][2] = {{1000, 0}, {(1 << 20) + 7, 3}};  // [from][to]
  auto value = [](int from, int to, int64_t i) { return static_cast<int32_t>((from * 2 + to) * 10000000 + i); };
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      CommunicatorSpec spec;
      spec.group = "pair-a2av";
      spec.backend = Backend::kNccl;
      spec.rank = r;
      spec.size = 2;
      spec.device = r;
      auto c = CreateCommunicator(store, spec);
      ASSERT_TRUE(c.ok()) << c.status();
      ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
      std::vector<int64_t> send = {count[r][0], count[r][1]}, recv = {count[0][r], count[1][r]};
      std::vector<int32_t> mine;
      for (int j = 0; j < 2; ++j) {
        for (int64_t i = 0; i < send[j]; ++i) mine.push_back(value(r, j, i));
      }
      const int64_t total = recv[0] + recv[1];
      int32_t* in = nullptr;
      int32_t* out = nullptr;
      ASSERT_EQ(cudaMalloc(&in, mine.size() * sizeof(int32_t)), cudaSuccess);
      ASSERT_EQ(cudaMalloc(&out, total * sizeof(int32_t)), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(in, mine.data(), mine.size() * sizeof(int32_t), cudaMemcpyHostToDevice), cudaSuccess);
      absl::Status s = (*c)->AllToAllV(Buffer{in, static_cast<int64_t>(mine.size()), DType::kInt32, r}, send,
                                       Buffer{out, total, DType::kInt32, r}, recv)
                           ->Wait(kWait);
      ASSERT_TRUE(s.ok()) << s;
      std::vector<int32_t> got(total);
      ASSERT_EQ(cudaMemcpy(got.data(), out, total * sizeof(int32_t), cudaMemcpyDeviceToHost), cudaSuccess);
      int64_t k = 0;
      for (int j = 0; j < 2; ++j) {
        for (int64_t i = 0; i < recv[j]; ++i, ++k) {
          ASSERT_EQ(got[k], value(j, r, i)) << "rank " << r << ", element " << i << " from rank " << j;
        }
      }
      cudaFree(in);
      cudaFree(out);
    });
  }
  for (auto& t : ranks) t.join();
}

TEST_F(NcclCommunicatorTest, GroupOnStreamRejectsHostMemory) {
  InMemoryStore store;
  auto comm = OneRank(store, "group-host");
  ASSERT_NE(comm, nullptr);
  EXPECT_TRUE(comm->RunsOnStreams());
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  std::vector<float> host(4);
  P2POp op;
  op.send = true;
  op.buf = Buffer::Host(host.data(), 4);
  op.peer = 1;
  op.name = "SEND_F(stage 0, mb 0)";
  absl::Status s = comm->GroupOnStream({op}, stream)->Wait(kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("host memory"), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("SEND_F(stage 0, mb 0)"), absl::string_view::npos) << s;
  cudaStreamDestroy(stream);
}

std::unique_ptr<Communicator> PairRank(Store& store, const std::string& group, int r, absl::Duration op_timeout) {
  CommunicatorSpec spec;
  spec.group = group;
  spec.backend = Backend::kNccl;
  spec.rank = r;
  spec.size = 2;
  spec.device = r;
  spec.op_timeout = op_timeout;
  auto c = CreateCommunicator(store, spec);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

// A group on the caller's stream runs after the work enqueued on it before
// (the payload is written by an async copy just before, with no host wait)
// and before the work enqueued after (the receiver's copy out).
TEST_F(NcclCommunicatorTest, TwoGpusGroupOnStreamIsOrderedOnTheCallersStream) {
  ASSERT_GE(gpus_, 2) << "this test needs two GPUs (bazel test --test_tag_filters=multi_gpu on such a machine)";
  InMemoryStore store;
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      auto c = PairRank(store, "group-pair", r, absl::Seconds(60));
      ASSERT_NE(c, nullptr);
      ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
      cudaStream_t stream = nullptr;
      ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
      const int64_t n = (1 << 20) + 3;
      float* d = nullptr;
      int64_t* stamp = nullptr;
      ASSERT_EQ(cudaMalloc(&d, n * sizeof(float)), cudaSuccess);
      ASSERT_EQ(cudaMalloc(&stamp, sizeof(int64_t)), cudaSuccess);
      std::vector<float> x(n, 7.5f), got(n, 0.0f);
      const int64_t sent_us = 1234567;
      int64_t got_us = 0;
      if (r == 0) {
        ASSERT_EQ(cudaMemcpyAsync(d, x.data(), n * sizeof(float), cudaMemcpyHostToDevice, stream), cudaSuccess);
        ASSERT_EQ(cudaMemcpyAsync(stamp, &sent_us, sizeof(int64_t), cudaMemcpyHostToDevice, stream), cudaSuccess);
      }
      std::vector<P2POp> ops(2);
      ops[0] = P2POp{r == 0, Buffer{d, n, DType::kFloat32, r}, 1 - r, 0, "payload"};
      ops[1] = P2POp{r == 0, Buffer{stamp, 1, DType::kInt64, r}, 1 - r, 1, "stamp"};
      std::shared_ptr<Work> w = c->GroupOnStream(ops, stream);
      if (r == 1) {
        ASSERT_EQ(cudaMemcpyAsync(got.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost, stream), cudaSuccess);
        ASSERT_EQ(cudaMemcpyAsync(&got_us, stamp, sizeof(int64_t), cudaMemcpyDeviceToHost, stream), cudaSuccess);
      }
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      EXPECT_TRUE(w->Wait(absl::ZeroDuration()).ok()) << "complete after the stream was waited for";
      if (r == 1) {
        EXPECT_EQ(got, x);
        EXPECT_EQ(got_us, sent_us);
      }
      cudaFree(d);
      cudaFree(stamp);
      cudaStreamDestroy(stream);
    });
  }
  for (auto& t : ranks) t.join();
}

// A peer that never sends: the receiving group is aborted by the watchdog
// after the op timeout, the caller's stream goes on (its synchronise
// returns), and the group's Work says DEADLINE_EXCEEDED naming the op.
TEST_F(NcclCommunicatorTest, TwoGpusGroupOnStreamPeerThatNeverSendsEndsWithinTheOpTimeout) {
  ASSERT_GE(gpus_, 2) << "this test needs two GPUs (bazel test --test_tag_filters=multi_gpu on such a machine)";
  InMemoryStore store;
  std::vector<std::thread> ranks;
  absl::Notification received;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      auto c = PairRank(store, "group-silent", r, absl::Milliseconds(500));
      ASSERT_NE(c, nullptr);
      if (r == 0) {  // joins the communicator, never sends
        received.WaitForNotificationWithTimeout(absl::Minutes(2));
        return;
      }
      ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
      cudaStream_t stream = nullptr;
      ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
      float* d = nullptr;
      ASSERT_EQ(cudaMalloc(&d, 1024 * sizeof(float)), cudaSuccess);
      std::shared_ptr<Work> w =
          c->GroupOnStream({P2POp{false, Buffer{d, 1024, DType::kFloat32, 1}, 0, 0, "RECV_F(stage 1, mb 0)"}}, stream);
      cudaStreamSynchronize(stream);  // returns once the watchdog aborted the communicator
      absl::Status s = w->Wait(kWait);
      EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
      EXPECT_NE(s.message().find("RECV_F(stage 1, mb 0)"), absl::string_view::npos) << s;
      received.Notify();
      cudaFree(d);
      cudaStreamDestroy(stream);
    });
  }
  for (auto& t : ranks) t.join();
}

}  // namespace
}  // namespace baton::comm
