// GPU test (tag `gpu`): the Gloo backend carrying CUDA device buffers through
// pinned host memory (CommunicatorSpec.device >= 0), two ranks as threads on
// one GPU over loopback.
#include "worker/comm/device_staging_communicator.h"

#include <cuda_runtime.h>

#include <numeric>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/cuda_status.h"
#include "worker/comm/communicator_factory.h"
#include "worker/comm/store.h"

namespace baton::comm {
namespace {

constexpr absl::Duration kWait = absl::Seconds(60);

float* DeviceCopy(const std::vector<float>& host) {
  float* d = nullptr;
  EXPECT_EQ(cudaMalloc(&d, host.size() * sizeof(float)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice),
            cudaSuccess);
  return d;
}

std::vector<float> HostCopy(const float* d, size_t n) {
  std::vector<float> host(n);
  EXPECT_EQ(cudaMemcpy(host.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

TEST(DeviceStagingTest, GlooCarriesDeviceBuffersForEveryOp) {
  int gpus = 0;
  absl::Status s = cuda::CudaDeviceCount(&gpus);
  ASSERT_TRUE(s.ok()) << "this test needs a GPU: " << s;
  InMemoryStore store;
  const int n = 2;
  const int64_t count = (1 << 18) + 5;
  std::vector<std::thread> ranks;
  for (int r = 0; r < n; ++r) {
    ranks.emplace_back([&, r] {
      ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
      CommunicatorSpec spec;
      spec.group = "staged";
      spec.rank = r;
      spec.size = n;
      spec.device = 0;
      auto c = CreateCommunicator(store, spec);
      ASSERT_TRUE(c.ok()) << c.status();
      Communicator& comm = **c;
      EXPECT_EQ(comm.backend(), "gloo");

      std::vector<float> mine(count);
      std::iota(mine.begin(), mine.end(), static_cast<float>(r * 10));
      float* d = DeviceCopy(mine);
      ASSERT_TRUE(comm.AllReduceSum(Buffer{d, count, DType::kFloat32, 0})->Wait(kWait).ok());
      std::vector<float> sum = HostCopy(d, count);
      EXPECT_EQ(sum[0], 10.0f);
      EXPECT_EQ(sum[count - 1], 2.0f * (count - 1) + 10.0f);

      float* got = DeviceCopy(std::vector<float>(count, -1));
      auto recv = comm.Recv(Buffer{got, count, DType::kFloat32, 0}, 1 - r, 3);
      auto send = comm.Send(Buffer{d, count, DType::kFloat32, 0}, 1 - r, 3);
      ASSERT_TRUE(send->Wait(kWait).ok());
      ASSERT_TRUE(recv->Wait(kWait).ok());
      EXPECT_EQ(HostCopy(got, count), sum) << "the peer sent the same sum";

      float* all = DeviceCopy(std::vector<float>(count * n, -1));
      float* in = DeviceCopy(mine);
      ASSERT_TRUE(comm.AllGather(Buffer{in, count, DType::kFloat32, 0},
                                 Buffer{all, count * n, DType::kFloat32, 0})
                      ->Wait(kWait).ok());
      std::vector<float> gathered = HostCopy(all, count * n);
      EXPECT_EQ(gathered[0], 0.0f);
      EXPECT_EQ(gathered[count], 10.0f);

      float* part = DeviceCopy(std::vector<float>(count / n, -1));
      ASSERT_TRUE(comm.ReduceScatterSum(Buffer{in, (count / n) * n, DType::kFloat32, 0},
                                        Buffer{part, count / n, DType::kFloat32, 0})
                      ->Wait(kWait).ok());
      EXPECT_EQ(HostCopy(part, 1)[0], 2.0f * (r * (count / n)) + 10.0f);

      float* b = DeviceCopy(std::vector<float>(count, static_cast<float>(r)));
      ASSERT_TRUE(comm.Broadcast(Buffer{b, count, DType::kFloat32, 0}, 1)->Wait(kWait).ok());
      EXPECT_EQ(HostCopy(b, count)[count / 2], 1.0f);
      for (float* p : {d, got, all, in, part, b}) cudaFree(p);
    });
  }
  for (auto& t : ranks) t.join();
}

// AllToAllV of device buffers: uneven counts with a zero chunk, staged
// through pinned host memory both ways.
TEST(DeviceStagingTest, GlooCarriesAnAllToAllVOfDeviceBuffers) {
  int gpus = 0;
  absl::Status s = cuda::CudaDeviceCount(&gpus);
  ASSERT_TRUE(s.ok()) << "this test needs a GPU: " << s;
  InMemoryStore store;
  const int n = 2;
  // count[from][to]: rank 1 keeps nothing for itself.
  const int64_t count[2][2] = {{3, 70001}, {5, 0}};
  auto value = [](int from, int to, int64_t i) { return static_cast<float>((from * 2 + to) * 100000 + i); };
  std::vector<std::thread> ranks;
  for (int r = 0; r < n; ++r) {
    ranks.emplace_back([&, r] {
      ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
      CommunicatorSpec spec;
      spec.group = "staged-a2av";
      spec.rank = r;
      spec.size = n;
      spec.device = 0;
      auto c = CreateCommunicator(store, spec);
      ASSERT_TRUE(c.ok()) << c.status();
      std::vector<int64_t> send = {count[r][0], count[r][1]}, recv = {count[0][r], count[1][r]};
      std::vector<float> mine;
      for (int j = 0; j < n; ++j) {
        for (int64_t i = 0; i < send[j]; ++i) mine.push_back(value(r, j, i));
      }
      const int64_t total = recv[0] + recv[1];
      float* in = DeviceCopy(mine);
      float* out = DeviceCopy(std::vector<float>(total, -1));
      ASSERT_TRUE((*c)->AllToAllV(Buffer{in, static_cast<int64_t>(mine.size()), DType::kFloat32, 0}, send,
                                  Buffer{out, total, DType::kFloat32, 0}, recv)
                      ->Wait(kWait).ok());
      std::vector<float> got = HostCopy(out, total);
      int64_t k = 0;
      for (int j = 0; j < n; ++j) {
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

}  // namespace
}  // namespace baton::comm
