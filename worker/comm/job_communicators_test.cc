// CreateJobCommunicators over Gloo (the per-group path every CPU job takes):
// the ranks of a pp=3 x dp=2 job, as threads over loopback, each get their
// pipeline, DP and tie communicators in the PlanJobGroups order, with the
// right ranks and sizes, and the members of one group can all-reduce.
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "worker/comm/communicator_factory.h"
#include "worker/comm/store.h"

namespace baton::comm {
namespace {

TEST(JobCommunicatorsTest, GlooGivesEveryRankItsGroupsInPlanOrder) {
  const JobLayout layout{3, 1, 2, true};
  InMemoryStore store;
  std::vector<std::thread> threads;
  // got[job rank][round] = sum of (pp rank + 1) over the group.
  std::vector<std::vector<float>> got(JobSize(layout));
  for (int d = 0; d < layout.dp; ++d) {
    for (int p = 0; p < layout.pp; ++p) {
      threads.emplace_back([&, p, d] {
        JobCommSpec spec;
        spec.generation = 7;
        spec.layout = layout;
        spec.rank = RankCoords{p, 0, d};
        spec.backend = Backend::kGloo;
        spec.rendezvous_timeout = absl::Seconds(60);
        absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> comms =
            CreateJobCommunicators(store, spec);
        ASSERT_TRUE(comms.ok()) << comms.status();
        absl::StatusOr<std::vector<GroupRound>> rounds = PlanJobGroups(layout, spec.rank);
        ASSERT_TRUE(rounds.ok());
        ASSERT_EQ(comms->size(), rounds->size());
        std::vector<float>& mine = got[JobRank(layout, spec.rank)];
        for (size_t i = 0; i < rounds->size(); ++i) {
          const GroupRound& round = (*rounds)[i];
          Communicator* c = (*comms)[i].get();
          if (round.color == kNoColor) {
            EXPECT_EQ(c, nullptr);
            mine.push_back(0);
            continue;
          }
          ASSERT_NE(c, nullptr) << round.group;
          EXPECT_EQ(c->rank(), round.key) << round.group;
          EXPECT_EQ(c->size(), round.size) << round.group;
          float x = static_cast<float>(p + 1);
          absl::Status s = c->AllReduceSum(Buffer::Host(&x, 1))->Wait(absl::Seconds(60));
          EXPECT_TRUE(s.ok()) << round.group << ": " << s;
          mine.push_back(x);
        }
      });
    }
  }
  for (auto& t : threads) t.join();
  for (int d = 0; d < layout.dp; ++d) {
    for (int p = 0; p < layout.pp; ++p) {
      SCOPED_TRACE(testing::Message() << "pp rank " << p << " dp rank " << d);
      const std::vector<float>& mine = got[JobRank(layout, RankCoords{p, 0, d})];
      ASSERT_EQ(mine.size(), 3u) << "pipeline, dp, tie";
      EXPECT_EQ(mine[0], 1 + 2 + 3) << "the pipeline group is the 3 stages of this replica";
      EXPECT_EQ(mine[1], 2 * (p + 1)) << "the DP group is this stage in both replicas";
      EXPECT_EQ(mine[2], p == 1 ? 0 : 1 + 3) << "the tie group is the first and last stage";
    }
  }
  for (const std::string& key : store.Keys()) {
    EXPECT_NE(key.find("/gen7/"), std::string::npos) << key << ": keys are scoped by generation";
    EXPECT_EQ(key.rfind("comm/job/", 0), std::string::npos) << key << ": Gloo makes no parent";
  }
}

// The planned axes' rounds need nothing new of CreateJobCommunicators: a
// cp=2 x dp=4 (ep=2) mesh gets its DP, CP, expert and expert-DP groups, and
// each group's all-reduce of 2^(job rank) yields exactly its members' bits.
TEST(JobCommunicatorsTest, GlooGivesContextAndExpertGroupsTheirMembers) {
  JobLayout layout{1, 1, 4, false};
  layout.cp = 2;
  layout.ep = 2;
  InMemoryStore store;
  std::vector<std::thread> threads;
  std::vector<std::vector<float>> got(JobSize(layout));
  std::vector<std::vector<GroupKind>> kinds(JobSize(layout));
  for (int d = 0; d < layout.dp; ++d) {
    for (int c = 0; c < layout.cp; ++c) {
      threads.emplace_back([&, c, d] {
        JobCommSpec spec;
        spec.generation = 3;
        spec.layout = layout;
        spec.rank = RankCoords{0, 0, d, c};
        spec.backend = Backend::kGloo;
        spec.rendezvous_timeout = absl::Seconds(60);
        absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> comms = CreateJobCommunicators(store, spec);
        ASSERT_TRUE(comms.ok()) << comms.status();
        absl::StatusOr<std::vector<GroupRound>> rounds = PlanJobGroups(layout, spec.rank);
        ASSERT_TRUE(rounds.ok());
        ASSERT_EQ(comms->size(), rounds->size());
        const int me = JobRank(layout, spec.rank);
        for (size_t i = 0; i < rounds->size(); ++i) {
          Communicator* comm = (*comms)[i].get();
          ASSERT_NE(comm, nullptr) << (*rounds)[i].group;
          EXPECT_EQ(comm->rank(), (*rounds)[i].key) << (*rounds)[i].group;
          EXPECT_EQ(comm->size(), (*rounds)[i].size) << (*rounds)[i].group;
          float x = static_cast<float>(1 << me);
          absl::Status s = comm->AllReduceSum(Buffer::Host(&x, 1))->Wait(absl::Seconds(60));
          EXPECT_TRUE(s.ok()) << (*rounds)[i].group << ": " << s;
          got[me].push_back(x);
          kinds[me].push_back((*rounds)[i].kind);
        }
      });
    }
  }
  for (auto& t : threads) t.join();
  auto bits = [&](std::vector<std::pair<int, int>> dc) {
    int mask = 0;
    for (auto [d, c] : dc) mask |= 1 << JobRank(layout, RankCoords{0, 0, d, c});
    return static_cast<float>(mask);
  };
  for (int d = 0; d < layout.dp; ++d) {
    for (int c = 0; c < layout.cp; ++c) {
      SCOPED_TRACE(testing::Message() << "dp rank " << d << " cp rank " << c);
      const int me = JobRank(layout, RankCoords{0, 0, d, c});
      ASSERT_EQ(kinds[me], (std::vector<GroupKind>{GroupKind::kDp, GroupKind::kCp, GroupKind::kEp,
                                                   GroupKind::kExpertDp}));
      EXPECT_EQ(got[me][0], bits({{0, 0}, {0, 1}, {1, 0}, {1, 1}, {2, 0}, {2, 1}, {3, 0}, {3, 1}}))
          << "DP: every cp rank of every replica (the dp x cp group)";
      EXPECT_EQ(got[me][1], bits({{d, 0}, {d, 1}})) << "CP: both halves of this replica's sequences";
      const int g = d / 2 * 2, slot = d % 2;
      EXPECT_EQ(got[me][2], bits({{g, c}, {g + 1, c}})) << "EP: two consecutive replicas";
      EXPECT_EQ(got[me][3], bits({{slot, c}, {slot + 2, c}})) << "EDP: the replicas of this expert slot";
    }
  }
}

TEST(JobCommunicatorsTest, NcclWithoutADeviceOrWithoutCudaIsRefused) {
  InMemoryStore store;
  JobCommSpec spec;
  spec.layout = JobLayout{2, 1, 1, false};
  spec.backend = Backend::kNccl;
  spec.rendezvous_timeout = absl::Milliseconds(200);
  absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> comms = CreateJobCommunicators(store, spec);
  ASSERT_FALSE(comms.ok());
  // INVALID_ARGUMENT (no device) in CUDA builds, UNIMPLEMENTED without CUDA.
  EXPECT_TRUE(absl::IsInvalidArgument(comms.status()) || absl::IsUnimplemented(comms.status()))
      << comms.status();
  EXPECT_TRUE(store.Keys().empty()) << "refused before any rendezvous";
}

}  // namespace
}  // namespace baton::comm
