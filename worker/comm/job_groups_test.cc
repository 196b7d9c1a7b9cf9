#include "worker/comm/job_groups.h"

#include <map>
#include <set>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"

namespace baton::comm {
namespace {

std::vector<RankCoords> AllRanks(const JobLayout& l) {
  std::vector<RankCoords> ranks;
  for (int d = 0; d < l.dp; ++d)
    for (int p = 0; p < l.pp; ++p)
      for (int t = 0; t < l.tp; ++t) ranks.push_back(RankCoords{p, t, d});
  return ranks;
}

// What each split of the parent produces, checked against the groups the
// layout defines: every rank calls the same rounds in the same order, and in
// each round the ranks of one color are exactly one group, ordered by key.
void CheckLayout(const JobLayout& l) {
  SCOPED_TRACE(testing::Message() << "pp " << l.pp << " tp " << l.tp << " dp " << l.dp
                                  << " tie " << l.tied_embedding);
  const std::vector<RankCoords> ranks = AllRanks(l);
  std::vector<std::vector<GroupRound>> plans;
  std::set<int> job_ranks;
  for (const RankCoords& r : ranks) {
    absl::StatusOr<std::vector<GroupRound>> plan = PlanJobGroups(l, r);
    ASSERT_TRUE(plan.ok()) << plan.status();
    plans.push_back(*plan);
    const int g = JobRank(l, r);
    EXPECT_GE(g, 0);
    EXPECT_LT(g, JobSize(l));
    job_ranks.insert(g);
  }
  EXPECT_EQ(job_ranks.size(), ranks.size()) << "job ranks are a permutation";

  const size_t rounds = plans[0].size();
  size_t want_rounds = (l.tp > 1) + (l.pp > 1) + (l.dp > 1) + (l.pp > 1 && l.tied_embedding);
  EXPECT_EQ(rounds, want_rounds);
  for (size_t i = 0; i < rounds; ++i) {
    const GroupKind kind = plans[0][i].kind;
    // color -> (key -> coords)
    std::map<int, std::map<int, RankCoords>> members;
    std::map<int, std::string> names;
    for (size_t k = 0; k < ranks.size(); ++k) {
      ASSERT_EQ(plans[k].size(), rounds) << "every rank splits the parent the same number of times";
      const GroupRound& round = plans[k][i];
      ASSERT_EQ(round.kind, kind) << "round " << i << " is the same kind on every rank";
      if (round.color == kNoColor) {
        EXPECT_EQ(kind, GroupKind::kTie);
        EXPECT_TRUE(ranks[k].pp_rank != 0 && ranks[k].pp_rank != l.pp - 1);
        continue;
      }
      EXPECT_GE(round.color, 0);
      EXPECT_TRUE(members[round.color].emplace(round.key, ranks[k]).second)
          << "two ranks with key " << round.key << " in group " << round.group;
      auto [it, fresh] = names.emplace(round.color, round.group);
      EXPECT_EQ(it->second, round.group) << "one name per color";
      (void)fresh;
    }
    std::set<std::string> distinct;
    for (const auto& [color, by_key] : members) {
      const std::string& name = names[color];
      EXPECT_TRUE(distinct.insert(name).second) << "two colors named " << name;
      const int size = static_cast<int>(by_key.size());
      int expect_key = 0;
      for (const auto& [key, r] : by_key) {
        EXPECT_EQ(key, expect_key++) << name << ": keys are 0..size-1";
        const RankCoords& first = by_key.begin()->second;
        switch (kind) {
          case GroupKind::kTp:
            EXPECT_EQ(size, l.tp);
            EXPECT_EQ(key, r.tp_rank);
            EXPECT_EQ(std::tie(r.pp_rank, r.dp_rank), std::tie(first.pp_rank, first.dp_rank));
            EXPECT_EQ(name, "tp-d" + std::to_string(r.dp_rank) + "-p" + std::to_string(r.pp_rank));
            break;
          case GroupKind::kPipeline:
            EXPECT_EQ(size, l.pp);
            EXPECT_EQ(key, r.pp_rank);
            EXPECT_EQ(std::tie(r.tp_rank, r.dp_rank), std::tie(first.tp_rank, first.dp_rank));
            EXPECT_EQ(name, "pp-d" + std::to_string(r.dp_rank) + "-t" + std::to_string(r.tp_rank));
            break;
          case GroupKind::kDp:
            EXPECT_EQ(size, l.dp);
            EXPECT_EQ(key, r.dp_rank);
            EXPECT_EQ(std::tie(r.pp_rank, r.tp_rank), std::tie(first.pp_rank, first.tp_rank));
            EXPECT_EQ(name, "dp-p" + std::to_string(r.pp_rank) + "-t" + std::to_string(r.tp_rank));
            break;
          case GroupKind::kTie:
            EXPECT_EQ(size, 2);
            EXPECT_EQ(r.pp_rank, key == 0 ? 0 : l.pp - 1);
            EXPECT_EQ(std::tie(r.tp_rank, r.dp_rank), std::tie(first.tp_rank, first.dp_rank));
            EXPECT_EQ(name, "tie-d" + std::to_string(r.dp_rank) + "-t" + std::to_string(r.tp_rank));
            break;
        }
      }
      for (size_t k = 0; k < ranks.size(); ++k) {
        if (plans[k][i].color == color) {
          EXPECT_EQ(plans[k][i].size, size);
        }
      }
    }
  }
}

TEST(JobGroupsTest, EverySplitOfEveryLayoutYieldsExactlyTheLayoutsGroups) {
  for (int pp : {1, 2, 3, 4})
    for (int tp : {1, 2, 4})
      for (int dp : {1, 2, 3})
        for (bool tie : {false, true}) CheckLayout(JobLayout{pp, tp, dp, tie});
}

TEST(JobGroupsTest, OrderIsTpPipelineDpTie) {
  absl::StatusOr<std::vector<GroupRound>> plan =
      PlanJobGroups(JobLayout{3, 2, 2, true}, RankCoords{1, 1, 1});
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->size(), 4u);
  EXPECT_EQ((*plan)[0].kind, GroupKind::kTp);
  EXPECT_EQ((*plan)[0].group, "tp-d1-p1");
  EXPECT_EQ((*plan)[0].color, 1 * 3 + 1);
  EXPECT_EQ((*plan)[0].key, 1);
  EXPECT_EQ((*plan)[1].kind, GroupKind::kPipeline);
  EXPECT_EQ((*plan)[1].group, "pp-d1-t1");
  EXPECT_EQ((*plan)[2].kind, GroupKind::kDp);
  EXPECT_EQ((*plan)[2].group, "dp-p1-t1");
  EXPECT_EQ((*plan)[3].kind, GroupKind::kTie);
  EXPECT_EQ((*plan)[3].color, kNoColor) << "pipeline rank 1 of 3 holds no embedding";
  EXPECT_EQ(JobRank(JobLayout{3, 2, 2, true}, RankCoords{1, 1, 1}), (1 * 3 + 1) * 2 + 1);
}

TEST(JobGroupsTest, OneRankJobHasNoGroups) {
  absl::StatusOr<std::vector<GroupRound>> plan = PlanJobGroups(JobLayout{1, 1, 1, true}, RankCoords{});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->empty());
}

TEST(JobGroupsTest, RejectsBadLayoutsAndRanks) {
  EXPECT_EQ(PlanJobGroups(JobLayout{0, 1, 1, false}, RankCoords{}).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::Status outside = PlanJobGroups(JobLayout{2, 1, 1, false}, RankCoords{2, 0, 0}).status();
  EXPECT_EQ(outside.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(outside.message().find("outside the layout"), absl::string_view::npos) << outside;
}

}  // namespace
}  // namespace baton::comm
