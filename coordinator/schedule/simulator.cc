#include "coordinator/schedule/simulator.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace baton::schedule {
namespace {

absl::Status CheckNonNegative(const char* name, double value) {
  if (!(value >= 0) || !std::isfinite(value)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " must be a finite number >= 0 (got ", value, ")"));
  }
  return absl::OkStatus();
}

// Checks that every action names a stage and microbatch inside the schedule.
absl::Status CheckRanges(const Schedule& s) {
  if (s.num_ranks < 1 || s.virtual_stages < 1 || s.microbatches < 1 ||
      static_cast<int>(s.ranks.size()) != s.num_ranks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "schedule sizes are inconsistent: ", s.ranks.size(), " programs, num_ranks=", s.num_ranks,
        ", virtual_stages=", s.virtual_stages, ", microbatches=", s.microbatches));
  }
  const int S = s.num_stages();
  for (int r = 0; r < s.num_ranks; ++r) {
    for (size_t i = 0; i < s.ranks[r].size(); ++i) {
      const Action& a = s.ranks[r][i];
      if (a.kind == ActionKind::kReduceGrads || a.kind == ActionKind::kOptimizerStep) continue;
      bool ok = a.stage >= 0 && a.stage < S && a.microbatch >= 0 && a.microbatch < s.microbatches;
      if (a.kind == ActionKind::kRecvF) ok = ok && a.stage > 0;
      if (a.kind == ActionKind::kRecvB) ok = ok && a.stage < S - 1;
      if (!ok) {
        return absl::InvalidArgumentError(absl::StrCat(
            ActionToString(a), " on rank ", r, " (action ", i, ") is outside the schedule: ", S,
            " stages, ", s.microbatches, " microbatches"));
      }
    }
  }
  return absl::OkStatus();
}

// Intrusive lists of ranks waiting for a key; a rank waits on one key at a time.
class WaitLists {
 public:
  WaitLists(size_t keys, int ranks) : head_(keys, -1), next_(ranks, -1) {}
  void Wait(size_t key, int rank) {
    next_[rank] = head_[key];
    head_[key] = rank;
  }
  // Moves the ranks waiting on `key` to `ready`.
  void Wake(size_t key, std::vector<int>* ready) {
    for (int r = head_[key]; r >= 0; r = next_[r]) ready->push_back(r);
    head_[key] = -1;
  }

 private:
  std::vector<int> head_;
  std::vector<int> next_;
};

constexpr double kNotYet = -1;

struct RunState {
  std::vector<size_t> pc;
  std::vector<std::string> waiting_for;  // what a blocked rank waits for
  std::vector<size_t> blocked_at;        // and the action that waits
  std::vector<double> clock;
  std::vector<std::vector<ActionTiming>> timings;
  int64_t sequence = 0;
};

absl::Status Stalled(const Schedule& s, const RunState& st) {
  std::vector<std::string> stuck;
  for (int r = 0; r < s.num_ranks; ++r) {
    if (st.pc[r] < s.ranks[r].size()) {
      stuck.push_back(absl::StrCat("rank ", r, " is stuck at ",
                                   ActionToString(s.ranks[r][st.blocked_at[r]]), " (action ",
                                   st.blocked_at[r], ") waiting for ", st.waiting_for[r]));
    }
  }
  return absl::FailedPreconditionError(absl::StrCat("deadlock: ", absl::StrJoin(stuck, "; ")));
}

void RunCompute(const Schedule& s, const CostModel& c, int r, RunState* st, double ready) {
  const Action& a = s.ranks[r][st->pc[r]];
  ActionTiming& t = st->timings[r][st->pc[r]];
  t.start = std::max(st->clock[r], ready);
  t.end = t.start + c.ComputeCost(a, s.virtual_stages);
  if (IsCompute(a.kind)) t.sequence = st->sequence++;
  st->clock[r] = t.end;
  ++st->pc[r];
}

// Compute-only schedule: data moves eagerly from producer to consumer.
absl::Status RunEager(const Schedule& s, const CostModel& c, RunState* st) {
  const int p = s.num_ranks, S = s.num_stages(), m = s.microbatches;
  const size_t cells = static_cast<size_t>(S) * m;
  // Done times: [0] forward, [1] input gradient (B or I), [2] I.
  std::vector<double> done(3 * cells, kNotYet);
  WaitLists waiters(3 * cells, p);
  const double message = c.MessageCost();
  std::vector<int> ready;
  for (int r = p - 1; r >= 0; --r) ready.push_back(r);
  while (!ready.empty()) {
    const int r = ready.back();
    ready.pop_back();
    while (st->pc[r] < s.ranks[r].size()) {
      const Action& a = s.ranks[r][st->pc[r]];
      if (!IsCompute(a.kind)) {
        RunCompute(s, c, r, st, 0);
        continue;
      }
      const size_t cell = static_cast<size_t>(a.stage) * m + a.microbatch;
      struct Dep {
        size_t key;
        int stage;
        ActionKind kind;
      };
      Dep deps[2];
      int ndeps = 0;
      if (a.kind == ActionKind::kForward) {
        if (a.stage > 0) deps[ndeps++] = {cell - m, a.stage - 1, ActionKind::kForward};
      } else if (a.kind == ActionKind::kBackwardWeight) {
        deps[ndeps++] = {2 * cells + cell, a.stage, ActionKind::kBackwardInput};
      } else {
        deps[ndeps++] = {cell, a.stage, ActionKind::kForward};
        if (a.stage < S - 1) {
          deps[ndeps++] = {cells + cell + m, a.stage + 1, ActionKind::kBackward};
        }
      }
      double at = 0;
      bool blocked = false;
      for (int d = 0; d < ndeps && !blocked; ++d) {
        if (done[deps[d].key] == kNotYet) {
          waiters.Wait(deps[d].key, r);
          blocked = true;
          const char* what = deps[d].kind == ActionKind::kBackward ? "B/I" : KindName(deps[d].kind);
          st->waiting_for[r] = absl::StrCat(what, "(", deps[d].stage, ",", a.microbatch,
                                            ") on rank ", RankOfStage(deps[d].stage, p));
          st->blocked_at[r] = st->pc[r];
        } else {
          const bool remote = RankOfStage(deps[d].stage, p) != r;
          at = std::max(at, done[deps[d].key] + (remote ? message : 0));
        }
      }
      if (blocked) break;
      RunCompute(s, c, r, st, at);
      const double end = st->clock[r];
      size_t produced[2];
      int nproduced = 0;
      if (a.kind == ActionKind::kForward) produced[nproduced++] = cell;
      if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput) {
        produced[nproduced++] = cells + cell;
      }
      if (a.kind == ActionKind::kBackwardInput) produced[nproduced++] = 2 * cells + cell;
      for (int k = 0; k < nproduced; ++k) {
        done[produced[k]] = end;
        waiters.Wake(produced[k], &ready);
      }
    }
  }
  for (int r = 0; r < p; ++r) {
    if (st->pc[r] < s.ranks[r].size()) return Stalled(s, *st);
  }
  return absl::OkStatus();
}

// Identity of the message a SEND/RECV takes part in: direction and producer.
size_t MessageId(const Action& a, int m, size_t cells) {
  switch (a.kind) {
    case ActionKind::kSendF:
      return static_cast<size_t>(a.stage) * m + a.microbatch;
    case ActionKind::kRecvF:
      return static_cast<size_t>(a.stage - 1) * m + a.microbatch;
    case ActionKind::kSendB:
      return cells + static_cast<size_t>(a.stage) * m + a.microbatch;
    default:
      return cells + static_cast<size_t>(a.stage + 1) * m + a.microbatch;  // kRecvB
  }
}

// The action on the peer that matches a SEND/RECV of `rank`.
Action Partner(const Action& a, int rank) {
  switch (a.kind) {
    case ActionKind::kSendF:
      return Action{ActionKind::kRecvF, a.stage + 1, a.microbatch, rank};
    case ActionKind::kRecvF:
      return Action{ActionKind::kSendF, a.stage - 1, a.microbatch, rank};
    case ActionKind::kSendB:
      return Action{ActionKind::kRecvB, a.stage - 1, a.microbatch, rank};
    default:
      return Action{ActionKind::kSendB, a.stage + 1, a.microbatch, rank};  // kRecvB
  }
}

bool IsSend(ActionKind k) { return k == ActionKind::kSendF || k == ActionKind::kSendB; }

// Lowered schedule: batches of sends and receives (see ir.h).
absl::Status RunBatches(const Schedule& s, const CostModel& c, RunState* st) {
  const int p = s.num_ranks, m = s.microbatches;
  const size_t cells = static_cast<size_t>(s.num_stages()) * m;
  std::vector<double> send_post(2 * cells, kNotYet), recv_post(2 * cells, kNotYet);
  WaitLists waiters(2 * cells, p);
  std::vector<size_t> posted_until(p, 0);  // end of the batch a rank has posted
  const double message = c.MessageCost();
  std::vector<int> ready;
  for (int r = p - 1; r >= 0; --r) ready.push_back(r);
  while (!ready.empty()) {
    const int r = ready.back();
    ready.pop_back();
    const auto& program = s.ranks[r];
    while (st->pc[r] < program.size()) {
      const size_t pc = st->pc[r];
      if (!IsCommunication(program[pc].kind)) {
        RunCompute(s, c, r, st, 0);
        continue;
      }
      size_t end = pc;
      while (end < program.size() && IsCommunication(program[end].kind)) ++end;
      if (posted_until[r] < end) {
        posted_until[r] = end;
        for (size_t i = pc; i < end; ++i) {
          const size_t id = MessageId(program[i], m, cells);
          (IsSend(program[i].kind) ? send_post : recv_post)[id] = st->clock[r];
          waiters.Wake(id, &ready);
        }
      }
      double finish = st->clock[r];
      bool blocked = false;
      for (size_t i = pc; i < end && !blocked; ++i) {
        const bool send = IsSend(program[i].kind);
        if (send && !c.blocking_sends) continue;
        const size_t id = MessageId(program[i], m, cells);
        const double other = (send ? recv_post : send_post)[id];
        if (other == kNotYet) {
          waiters.Wait(id, r);
          blocked = true;
          st->waiting_for[r] = absl::StrCat("rank ", program[i].peer, " to post ",
                                            ActionToString(Partner(program[i], r)));
          st->blocked_at[r] = i;
        } else if (c.blocking_sends) {
          finish = std::max(finish, std::max(send_post[id], recv_post[id]) + message);
        } else {
          finish = std::max(finish, std::max(recv_post[id], send_post[id] + message));
        }
      }
      if (blocked) break;
      for (size_t i = pc; i < end; ++i) st->timings[r][i] = ActionTiming{st->clock[r], finish, -1};
      st->clock[r] = finish;
      st->pc[r] = end;
    }
  }
  for (int r = 0; r < p; ++r) {
    if (st->pc[r] < s.ranks[r].size()) return Stalled(s, *st);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CostModel::Check(int num_stages) const {
  const std::pair<const char*, double> values[] = {{"forward cost", forward},
                                                   {"backward_input cost", backward_input},
                                                   {"backward_weight cost", backward_weight},
                                                   {"comm_latency", comm_latency},
                                                   {"activation_bytes", activation_bytes}};
  for (const auto& [name, value] : values) {
    if (absl::Status st = CheckNonNegative(name, value); !st.ok()) return st;
  }
  if (backward.has_value()) {
    if (absl::Status st = CheckNonNegative("backward cost", *backward); !st.ok()) return st;
  }
  if (!(comm_bandwidth > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("comm_bandwidth must be > 0 (got ", comm_bandwidth, "); use inf for free"));
  }
  if (!stage_multipliers.empty()) {
    if (static_cast<int>(stage_multipliers.size()) != num_stages) {
      return absl::InvalidArgumentError(absl::StrCat("got ", stage_multipliers.size(),
                                                     " stage multipliers for ", num_stages,
                                                     " stages; give one per stage"));
    }
    for (double f : stage_multipliers) {
      if (absl::Status st = CheckNonNegative("stage multiplier", f); !st.ok()) return st;
    }
  }
  return absl::OkStatus();
}

double CostModel::ComputeCost(const Action& a, int virtual_stages) const {
  double base = 0;
  switch (a.kind) {
    case ActionKind::kForward:
      base = forward;
      break;
    case ActionKind::kBackward:
      base = backward.value_or(backward_input + backward_weight);
      break;
    case ActionKind::kBackwardInput:
      base = backward_input;
      break;
    case ActionKind::kBackwardWeight:
      base = backward_weight;
      break;
    default:
      return 0;
  }
  const double factor = stage_multipliers.empty() ? 1.0 : stage_multipliers[a.stage];
  return base * factor / virtual_stages;
}

double CostModel::MessageCost() const { return comm_latency + activation_bytes / comm_bandwidth; }

namespace {

absl::Status Run(const Schedule& s, const CostModel& costs, RunState* st) {
  st->pc.assign(s.num_ranks, 0);
  st->clock.assign(s.num_ranks, 0);
  st->waiting_for.resize(s.num_ranks);
  st->blocked_at.resize(s.num_ranks);
  st->timings.resize(s.num_ranks);
  for (int r = 0; r < s.num_ranks; ++r) st->timings[r].resize(s.ranks[r].size());
  return HasCommunication(s) ? RunBatches(s, costs, st) : RunEager(s, costs, st);
}

}  // namespace

std::optional<Deadlock> FindDeadlock(const Schedule& s) {
  RunState st;
  CostModel blocking;
  blocking.blocking_sends = true;
  absl::Status run = Run(s, blocking, &st);
  if (run.ok()) return std::nullopt;
  for (int r = 0; r < s.num_ranks; ++r) {
    if (st.pc[r] < s.ranks[r].size()) {
      return Deadlock{std::string(run.message()), r, static_cast<int>(st.blocked_at[r])};
    }
  }
  return std::nullopt;
}

absl::StatusOr<SimulationResult> Simulate(const Schedule& s, const CostModel& costs) {
  if (absl::Status st = CheckRanges(s); !st.ok()) return st;
  if (absl::Status st = costs.Check(s.num_stages()); !st.ok()) return st;
  RunState st;
  if (absl::Status run = Run(s, costs, &st); !run.ok()) return run;

  SimulationResult result;
  double total_busy = 0;
  for (int r = 0; r < s.num_ranks; ++r) {
    result.makespan = std::max(result.makespan, st.clock[r]);
    RankStats stats;
    stats.rank = r;
    int live = 0;
    for (size_t i = 0; i < s.ranks[r].size(); ++i) {
      const Action& a = s.ranks[r][i];
      if (!IsCompute(a.kind)) continue;
      stats.busy += costs.ComputeCost(a, s.virtual_stages);
      if (a.kind == ActionKind::kForward)
        stats.peak_activations = std::max(stats.peak_activations, ++live);
      if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardWeight) --live;
    }
    total_busy += stats.busy;
    result.ranks.push_back(stats);
  }
  for (RankStats& stats : result.ranks) {
    stats.bubble_ratio = result.makespan > 0 ? 1 - stats.busy / result.makespan : 0;
  }
  result.bubble_ratio = result.makespan > 0 ? 1 - total_busy / (s.num_ranks * result.makespan) : 0;
  result.timings = std::move(st.timings);
  return result;
}

}  // namespace baton::schedule
