// Helpers shared by the schedule tests: compact parsing and printing of
// programs ("F0 F1 B0", "0F0 2F0" with stages) so tests state orders plainly.
#ifndef BATON_COORDINATOR_SCHEDULE_TEST_UTIL_H_
#define BATON_COORDINATOR_SCHEDULE_TEST_UTIL_H_

#include <string>
#include <vector>

#include "absl/strings/str_join.h"
#include "coordinator/schedule/ir.h"

namespace baton::schedule {

// The compute actions of one rank as grid labels, space-separated.
inline std::string Labels(const Schedule& s, int rank) {
  std::vector<std::string> out;
  for (const Action& a : s.ranks[rank]) {
    if (IsCompute(a.kind)) out.push_back(CellLabel(a, s.virtual_stages));
  }
  return absl::StrJoin(out, " ");
}

// Every action of one rank, ActionToString, space-separated.
inline std::string Actions(const Schedule& s, int rank) {
  std::vector<std::string> out;
  for (const Action& a : s.ranks[rank]) out.push_back(ActionToString(a));
  return absl::StrJoin(out, " ");
}

inline Action F(int stage, int mb) { return {ActionKind::kForward, stage, mb, 0}; }
inline Action B(int stage, int mb) { return {ActionKind::kBackward, stage, mb, 0}; }
inline Action SendF(int stage, int mb, int peer) { return {ActionKind::kSendF, stage, mb, peer}; }
inline Action RecvF(int stage, int mb, int peer) { return {ActionKind::kRecvF, stage, mb, peer}; }
inline Action SendB(int stage, int mb, int peer) { return {ActionKind::kSendB, stage, mb, peer}; }
inline Action RecvB(int stage, int mb, int peer) { return {ActionKind::kRecvB, stage, mb, peer}; }

inline Schedule Make(const std::string& kind, int p, int m,
                     std::vector<std::vector<Action>> ranks) {
  Schedule s;
  s.kind = kind;
  s.num_ranks = p;
  s.microbatches = m;
  s.ranks = std::move(ranks);
  return s;
}

}  // namespace baton::schedule

#endif  // BATON_COORDINATOR_SCHEDULE_TEST_UTIL_H_
