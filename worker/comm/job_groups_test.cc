#include "worker/comm/job_groups.h"

#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"

namespace baton::comm {
namespace {

// In global-rank order: TP innermost, then CP, then PP, then DP.
std::vector<RankCoords> AllRanks(const JobLayout& l) {
  std::vector<RankCoords> ranks;
  for (int d = 0; d < l.dp; ++d)
    for (int p = 0; p < l.pp; ++p)
      for (int c = 0; c < l.cp; ++c)
        for (int t = 0; t < l.tp; ++t) ranks.push_back(RankCoords{p, t, d, c});
  return ranks;
}

std::string Cp(const JobLayout& l, const RankCoords& r) {
  return l.cp > 1 ? "-c" + std::to_string(r.cp_rank) : "";
}

// What each split of the parent produces, checked against the groups the
// layout defines: every rank calls the same rounds in the same order, and in
// each round the ranks of one color are exactly one group, ordered by key.
void CheckLayout(const JobLayout& l) {
  SCOPED_TRACE(testing::Message() << "pp " << l.pp << " tp " << l.tp << " dp " << l.dp << " cp " << l.cp << " ep "
                                  << l.ep << " tie " << l.tied_embedding);
  const std::vector<RankCoords> ranks = AllRanks(l);
  std::vector<std::vector<GroupRound>> plans;
  std::set<int> job_ranks;
  for (size_t k = 0; k < ranks.size(); ++k) {
    const RankCoords& r = ranks[k];
    absl::StatusOr<std::vector<GroupRound>> plan = PlanJobGroups(l, r);
    ASSERT_TRUE(plan.ok()) << plan.status();
    plans.push_back(*plan);
    const int g = JobRank(l, r);
    EXPECT_EQ(g, static_cast<int>(k)) << "TP innermost, then CP, then PP, then DP";
    EXPECT_LT(g, JobSize(l));
    job_ranks.insert(g);
  }
  EXPECT_EQ(job_ranks.size(), ranks.size()) << "job ranks are a permutation";
  EXPECT_EQ(JobSize(l), static_cast<int>(ranks.size()));

  // The kinds, in the one order; the planned axes' rounds only when they are > 1.
  std::vector<GroupKind> want_kinds;
  if (l.tp > 1) want_kinds.push_back(GroupKind::kTp);
  if (l.pp > 1) want_kinds.push_back(GroupKind::kPipeline);
  if (l.dp * l.cp > 1) want_kinds.push_back(GroupKind::kDp);
  if (l.pp > 1 && l.tied_embedding) want_kinds.push_back(GroupKind::kTie);
  if (l.cp > 1) want_kinds.push_back(GroupKind::kCp);
  if (l.ep > 1) want_kinds.push_back(GroupKind::kEp);
  if (l.ep > 1 && l.dp / l.ep > 1) want_kinds.push_back(GroupKind::kExpertDp);
  const size_t rounds = plans[0].size();
  ASSERT_EQ(rounds, want_kinds.size());
  std::set<std::string> all_names;  // across rounds: one key scope per group
  for (size_t i = 0; i < rounds; ++i) {
    const GroupKind kind = plans[0][i].kind;
    EXPECT_EQ(kind, want_kinds[i]) << "round " << i;
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
      EXPECT_TRUE(all_names.insert(name).second) << name << " names groups of two rounds";
      const int size = static_cast<int>(by_key.size());
      int expect_key = 0;
      for (const auto& [key, r] : by_key) {
        EXPECT_EQ(key, expect_key++) << name << ": keys are 0..size-1";
        const RankCoords& first = by_key.begin()->second;
        const std::string c = Cp(l, r);
        switch (kind) {
          case GroupKind::kTp:
            EXPECT_EQ(size, l.tp);
            EXPECT_EQ(key, r.tp_rank);
            EXPECT_EQ(std::tie(r.pp_rank, r.dp_rank, r.cp_rank), std::tie(first.pp_rank, first.dp_rank, first.cp_rank));
            EXPECT_EQ(name, "tp-d" + std::to_string(r.dp_rank) + "-p" + std::to_string(r.pp_rank) + c);
            break;
          case GroupKind::kPipeline:
            EXPECT_EQ(size, l.pp);
            EXPECT_EQ(key, r.pp_rank);
            EXPECT_EQ(std::tie(r.tp_rank, r.dp_rank, r.cp_rank), std::tie(first.tp_rank, first.dp_rank, first.cp_rank));
            EXPECT_EQ(name, "pp-d" + std::to_string(r.dp_rank) + c + "-t" + std::to_string(r.tp_rank));
            break;
          case GroupKind::kDp:
            EXPECT_EQ(size, l.dp * l.cp) << "the dp x cp ranks that hold the same parameters";
            EXPECT_EQ(key, r.dp_rank * l.cp + r.cp_rank);
            EXPECT_EQ(std::tie(r.pp_rank, r.tp_rank), std::tie(first.pp_rank, first.tp_rank));
            EXPECT_EQ(name, "dp-p" + std::to_string(r.pp_rank) + "-t" + std::to_string(r.tp_rank));
            break;
          case GroupKind::kTie:
            EXPECT_EQ(size, 2);
            EXPECT_EQ(r.pp_rank, key == 0 ? 0 : l.pp - 1);
            EXPECT_EQ(std::tie(r.tp_rank, r.dp_rank, r.cp_rank), std::tie(first.tp_rank, first.dp_rank, first.cp_rank));
            EXPECT_EQ(name, "tie-d" + std::to_string(r.dp_rank) + c + "-t" + std::to_string(r.tp_rank));
            break;
          case GroupKind::kCp:
            EXPECT_EQ(size, l.cp);
            EXPECT_EQ(key, r.cp_rank);
            EXPECT_EQ(std::tie(r.pp_rank, r.tp_rank, r.dp_rank), std::tie(first.pp_rank, first.tp_rank, first.dp_rank));
            EXPECT_EQ(name, "cp-d" + std::to_string(r.dp_rank) + "-p" + std::to_string(r.pp_rank) + "-t" +
                                std::to_string(r.tp_rank));
            break;
          case GroupKind::kEp:
            EXPECT_EQ(size, l.ep);
            EXPECT_EQ(key, r.dp_rank % l.ep);
            EXPECT_EQ(r.dp_rank / l.ep, first.dp_rank / l.ep) << "ep consecutive dp ranks";
            EXPECT_EQ(std::tie(r.pp_rank, r.tp_rank, r.cp_rank), std::tie(first.pp_rank, first.tp_rank, first.cp_rank));
            EXPECT_EQ(name, "ep-p" + std::to_string(r.pp_rank) + c + "-t" + std::to_string(r.tp_rank) + "-g" +
                                std::to_string(r.dp_rank / l.ep));
            break;
          case GroupKind::kExpertDp:
            EXPECT_EQ(size, l.dp / l.ep);
            EXPECT_EQ(key, r.dp_rank / l.ep);
            EXPECT_EQ(r.dp_rank % l.ep, first.dp_rank % l.ep) << "one expert slot";
            EXPECT_EQ(std::tie(r.pp_rank, r.tp_rank, r.cp_rank), std::tie(first.pp_rank, first.tp_rank, first.cp_rank));
            EXPECT_EQ(name, "edp-p" + std::to_string(r.pp_rank) + c + "-t" + std::to_string(r.tp_rank) + "-s" +
                                std::to_string(r.dp_rank % l.ep));
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

JobLayout Mesh(int pp, int tp, int dp, int cp, int ep, bool tie) {
  JobLayout l{pp, tp, dp, tie};
  l.cp = cp;
  l.ep = ep;
  return l;
}

TEST(JobGroupsTest, EverySplitOfEveryMeshWithCpAndEpYieldsExactlyItsGroups) {
  for (int pp : {1, 2, 3})
    for (int tp : {1, 2})
      for (int cp : {1, 2, 3})
        for (int dp : {1, 2, 4, 6})
          for (int ep = 1; ep <= dp; ++ep) {
            if (dp % ep != 0) continue;
            for (bool tie : {false, true}) CheckLayout(Mesh(pp, tp, dp, cp, ep, tie));
          }
}

TEST(JobGroupsTest, CpAndEpOfOneChangeNothing) {
  for (const RankCoords& r : AllRanks(JobLayout{3, 2, 2, true})) {
    absl::StatusOr<std::vector<GroupRound>> before = PlanJobGroups(JobLayout{3, 2, 2, true}, r);
    absl::StatusOr<std::vector<GroupRound>> after = PlanJobGroups(Mesh(3, 2, 2, 1, 1, true), r);
    ASSERT_TRUE(before.ok() && after.ok());
    ASSERT_EQ(before->size(), after->size());
    for (size_t i = 0; i < before->size(); ++i) {
      EXPECT_EQ((*before)[i].kind, (*after)[i].kind);
      EXPECT_EQ((*before)[i].color, (*after)[i].color);
      EXPECT_EQ((*before)[i].key, (*after)[i].key);
      EXPECT_EQ((*before)[i].size, (*after)[i].size);
      EXPECT_EQ((*before)[i].group, (*after)[i].group);
    }
    EXPECT_EQ(JobRank(Mesh(3, 2, 2, 1, 1, true), r), (r.dp_rank * 3 + r.pp_rank) * 2 + r.tp_rank);
  }
}

TEST(JobGroupsTest, OrderIsTpPipelineDpTieCpEpEdp) {
  const JobLayout l = Mesh(2, 2, 4, 2, 2, true);
  const RankCoords r{1, 1, 3, 1};
  absl::StatusOr<std::vector<GroupRound>> plan = PlanJobGroups(l, r);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->size(), 7u);
  const std::vector<std::tuple<GroupKind, std::string, int, int>> want = {
      {GroupKind::kTp, "tp-d3-p1-c1", 1, 2},      {GroupKind::kPipeline, "pp-d3-c1-t1", 1, 2},
      {GroupKind::kDp, "dp-p1-t1", 7, 8},      {GroupKind::kTie, "tie-d3-c1-t1", 1, 2},
      {GroupKind::kCp, "cp-d3-p1-t1", 1, 2},      {GroupKind::kEp, "ep-p1-c1-t1-g1", 1, 2},
      {GroupKind::kExpertDp, "edp-p1-c1-t1-s1", 1, 2},
  };
  for (size_t i = 0; i < want.size(); ++i) {
    const auto& [kind, group, key, size] = want[i];
    EXPECT_EQ((*plan)[i].kind, kind) << i;
    EXPECT_EQ((*plan)[i].group, group) << i;
    EXPECT_EQ((*plan)[i].key, key) << group;
    EXPECT_EQ((*plan)[i].size, size) << group;
  }
  EXPECT_EQ(JobRank(l, r), ((3 * 2 + 1) * 2 + 1) * 2 + 1);
  EXPECT_EQ(JobSize(l), 2 * 2 * 4 * 2) << "ep adds no ranks";
  EXPECT_STREQ(GroupKindName(GroupKind::kCp), "cp");
  EXPECT_STREQ(GroupKindName(GroupKind::kEp), "ep");
  EXPECT_STREQ(GroupKindName(GroupKind::kExpertDp), "edp");
}

TEST(JobGroupsTest, RejectsBadCpAndEp) {
  absl::Status ep = PlanJobGroups(Mesh(1, 1, 4, 1, 3, false), RankCoords{}).status();
  EXPECT_EQ(ep.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(ep.message().find("does not divide dp"), absl::string_view::npos) << ep;
  EXPECT_EQ(PlanJobGroups(Mesh(1, 1, 1, 0, 1, false), RankCoords{}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanJobGroups(Mesh(1, 1, 2, 1, 0, false), RankCoords{}).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::Status outside = PlanJobGroups(Mesh(1, 1, 1, 2, 1, false), RankCoords{0, 0, 0, 2}).status();
  EXPECT_EQ(outside.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(outside.message().find("outside the layout"), absl::string_view::npos) << outside;
}

}  // namespace
}  // namespace baton::comm
