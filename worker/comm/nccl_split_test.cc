// GPU tests (tag `gpu`) of the job's NCCL communicators split from one
// parent (NcclCommunicator::CreateSplit, CreateJobCommunicators). One GPU:
// a one-rank job split into a group and a "no group" round. Two GPUs (the
// `multi_gpu` target): a two-rank job with TP-like and tie-like rounds, and
// a rank that never splits, which must end in DEADLINE_EXCEEDED naming the
// group. Run with: bazel test //worker/comm:nccl_split_test
#include <cuda_runtime.h>

#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_status.h"
#include "worker/comm/communicator_factory.h"
#include "worker/comm/nccl_communicator.h"
#include "worker/comm/store.h"

namespace baton::comm {
namespace {

constexpr absl::Duration kWait = absl::Seconds(60);

int Gpus() {
  int gpus = 0;
  absl::Status s = cuda::CudaDeviceCount(&gpus);
  EXPECT_TRUE(s.ok()) << "this test needs a GPU: " << s;
  return s.ok() ? gpus : 0;
}

NcclCommunicator::Split MakeSplit(int color, int key, int size, const std::string& label) {
  NcclCommunicator::Split split;
  split.color = color;
  split.key = key;
  split.options.rank = key;
  split.options.size = size;
  split.options.label = label;
  return split;
}

// An all-reduce of `rank + 1` over `comm`, checked against `want`.
void ExpectAllReduce(Communicator& comm, int device, int rank, float want) {
  ASSERT_EQ(cudaSetDevice(device), cudaSuccess);
  const int64_t n = 4099;
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, n * sizeof(float)), cudaSuccess);
  std::vector<float> x(n, static_cast<float>(rank + 1));
  ASSERT_EQ(cudaMemcpy(d, x.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  absl::Status s = comm.AllReduceSum(Buffer{d, n, DType::kFloat32, device})->Wait(kWait);
  EXPECT_TRUE(s.ok()) << s;
  ASSERT_EQ(cudaMemcpy(x.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(x[n - 1], want);
  cudaFree(d);
}

TEST(NcclSplitTest, OneRankParentSplitsIntoAGroupAndNoGroup) {
  ASSERT_GE(Gpus(), 1) << "this test needs a GPU";
  InMemoryStore store;
  NcclOptions parent;
  parent.label = "job gen 1";
  parent.rendezvous_timeout = absl::Seconds(60);
  absl::StatusOr<std::vector<std::unique_ptr<NcclCommunicator>>> children =
      NcclCommunicator::CreateSplit(
          store, parent, {MakeSplit(0, 0, 1, "solo gen 1"), MakeSplit(NCCL_SPLIT_NOCOLOR, 0, 0, "none")});
  ASSERT_TRUE(children.ok()) << children.status();
  ASSERT_EQ(children->size(), 2u);
  ASSERT_NE((*children)[0], nullptr);
  EXPECT_EQ((*children)[1], nullptr) << "NOCOLOR yields no communicator";
  EXPECT_EQ((*children)[0]->rank(), 0);
  EXPECT_EQ((*children)[0]->size(), 1);
  ExpectAllReduce(*(*children)[0], 0, 0, 1.0f);
  // One unique id for the parent, nothing per child.
  EXPECT_EQ(store.Keys().size(), 3u) << "arrived/0, nccl/unique_id, split-done/arrived/0";
}

TEST(NcclSplitTest, OneRankJobHasNoCommunicators) {
  ASSERT_GE(Gpus(), 1) << "this test needs a GPU";
  InMemoryStore store;
  JobCommSpec spec;
  spec.backend = Backend::kNccl;
  spec.device = 0;
  absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> comms = CreateJobCommunicators(store, spec);
  ASSERT_TRUE(comms.ok()) << comms.status();
  EXPECT_TRUE(comms->empty());
  EXPECT_TRUE(SplitsParentCommunicator(Backend::kNccl));
}

// Runs only in the `multi_gpu` target (nccl_split_two_gpu_test).
TEST(NcclSplitTest, TwoGpusJobOfTwoPipelineRanksGetsPipelineAndTieGroups) {
  ASSERT_GE(Gpus(), 2) << "this test needs two GPUs (bazel test --test_tag_filters=multi_gpu on such a machine)";
  InMemoryStore store;
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      JobCommSpec spec;
      spec.generation = 4;
      spec.layout = JobLayout{2, 1, 1, true};
      spec.rank = RankCoords{r, 0, 0};
      spec.backend = Backend::kNccl;
      spec.device = r;
      spec.rendezvous_timeout = absl::Seconds(60);
      absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> comms = CreateJobCommunicators(store, spec);
      ASSERT_TRUE(comms.ok()) << comms.status();
      ASSERT_EQ(comms->size(), 2u) << "pipeline and tie";
      for (auto& c : *comms) {
        ASSERT_NE(c, nullptr);
        EXPECT_EQ(c->rank(), r);
        EXPECT_EQ(c->size(), 2);
        ExpectAllReduce(*c, r, r, 3.0f);
      }
    });
  }
  for (auto& t : ranks) t.join();
  for (const std::string& key : store.Keys()) {
    EXPECT_EQ(key.rfind("comm/job/gen4/", 0), 0u) << key << ": one parent, keys scoped by generation";
  }
}

TEST(NcclSplitTest, TwoGpusRankThatNeverSplitsEndsInDeadlineExceededNamingTheGroup) {
  ASSERT_GE(Gpus(), 2) << "this test needs two GPUs (bazel test --test_tag_filters=multi_gpu on such a machine)";
  InMemoryStore store;
  absl::Notification failed;
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
      NcclOptions parent;
      parent.rank = r;
      parent.size = 2;
      parent.device = r;
      parent.label = "job gen 5";
      parent.rendezvous_timeout = absl::Seconds(3);
      // Rank 1 makes one split fewer than rank 0 (a plan mismatch).
      std::vector<NcclCommunicator::Split> splits = {MakeSplit(0, r, 2, "pp-d0-t0 gen 5")};
      if (r == 0) splits.push_back(MakeSplit(0, r, 2, "tie-d0-t0 gen 5"));
      absl::StatusOr<std::vector<std::unique_ptr<NcclCommunicator>>> children =
          NcclCommunicator::CreateSplit(store, parent, splits);
      if (r == 0) {
        ASSERT_FALSE(children.ok());
        EXPECT_EQ(children.status().code(), absl::StatusCode::kDeadlineExceeded) << children.status();
        EXPECT_NE(children.status().message().find("tie-d0-t0 gen 5"), absl::string_view::npos)
            << children.status();
        failed.Notify();
      } else {
        // Rank 1 finished its splits and waits in the split-done barrier,
        // which also times out since rank 0 never gets there.
        EXPECT_FALSE(children.ok());
        failed.WaitForNotificationWithTimeout(absl::Minutes(2));
      }
    });
  }
  for (auto& t : ranks) t.join();
}

}  // namespace
}  // namespace baton::comm
