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
  if (absl::Status placement = CheckPlacement(s.stage_ranks, s.num_ranks, S); !placement.ok()) return placement;
  int pair_rank = 0, pair_index = 0;
  if (absl::Status pairs = CheckOverlapPairs(s, &pair_rank, &pair_index); !pairs.ok()) return pairs;
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

// The next action of rank r, or the overlapped pair starting there: the
// number of actions it covers (2 for a pair) and its duration.
int Width(const Schedule& s, int r, size_t pc) {
  const auto& program = s.ranks[r];
  return program[pc].overlap_with_next && pc + 1 < program.size() ? 2 : 1;
}

void RunCompute(const Schedule& s, const CostModel& c, int r, RunState* st, double ready) {
  const size_t pc = st->pc[r];
  const int width = Width(s, r, pc);
  const double start = std::max(st->clock[r], ready);
  const double cost = width == 2 ? c.PairCost(s.ranks[r][pc], s.ranks[r][pc + 1], s.virtual_stages)
                                 : c.ComputeCost(s.ranks[r][pc], s.virtual_stages);
  for (int k = 0; k < width; ++k) {
    ActionTiming& t = st->timings[r][pc + k];
    t.start = start;
    t.end = start + cost;
    if (IsCompute(s.ranks[r][pc + k].kind)) t.sequence = st->sequence++;
  }
  st->clock[r] = start + cost;
  st->pc[r] += width;
}

// Compute-only schedule: data moves eagerly from producer to consumer.
absl::Status RunEager(const Schedule& s, const CostModel& c, RunState* st) {
  const int p = s.num_ranks, S = s.num_stages(), m = s.microbatches;
  const size_t cells = static_cast<size_t>(S) * m;
  // Done times: [0] forward, [1] input gradient (B or I), [2] I.
  std::vector<double> done(3 * cells, kNotYet);
  WaitLists waiters(3 * cells, p);
  const double message = c.MessageCost();
  struct Dep {
    size_t key;
    int stage;
    ActionKind kind;
    int mb;
  };
  // What a compute action waits for (at most two inputs).
  auto deps_of = [&](const Action& a, Dep* deps) {
    const size_t cell = static_cast<size_t>(a.stage) * m + a.microbatch;
    int n = 0;
    if (a.kind == ActionKind::kForward) {
      if (a.stage > 0) deps[n++] = {cell - m, a.stage - 1, ActionKind::kForward, a.microbatch};
    } else if (a.kind == ActionKind::kBackwardWeight) {
      deps[n++] = {2 * cells + cell, a.stage, ActionKind::kBackwardInput, a.microbatch};
    } else {
      deps[n++] = {cell, a.stage, ActionKind::kForward, a.microbatch};
      if (a.stage < S - 1) deps[n++] = {cells + cell + m, a.stage + 1, ActionKind::kBackward, a.microbatch};
    }
    return n;
  };
  std::vector<int> ready;
  for (int r = p - 1; r >= 0; --r) ready.push_back(r);
  while (!ready.empty()) {
    const int r = ready.back();
    ready.pop_back();
    while (st->pc[r] < s.ranks[r].size()) {
      const size_t pc = st->pc[r];
      const Action& a = s.ranks[r][pc];
      if (!IsCompute(a.kind)) {
        RunCompute(s, c, r, st, 0);
        continue;
      }
      const int width = Width(s, r, pc);
      Dep deps[4];
      int ndeps = 0;
      for (int k = 0; k < width; ++k) ndeps += deps_of(s.ranks[r][pc + k], deps + ndeps);
      double at = 0;
      bool blocked = false;
      for (int d = 0; d < ndeps && !blocked; ++d) {
        if (done[deps[d].key] == kNotYet) {
          waiters.Wait(deps[d].key, r);
          blocked = true;
          const char* what = deps[d].kind == ActionKind::kBackward ? "B/I" : KindName(deps[d].kind);
          st->waiting_for[r] = absl::StrCat(what, "(", deps[d].stage, ",", deps[d].mb, ") on rank ",
                                            s.RankOf(deps[d].stage));
          st->blocked_at[r] = pc;
        } else {
          const bool remote = s.RankOf(deps[d].stage) != r;
          at = std::max(at, done[deps[d].key] + (remote ? message : 0));
        }
      }
      if (blocked) break;
      RunCompute(s, c, r, st, at);
      const double end = st->clock[r];
      for (int k = 0; k < width; ++k) {
        const Action& x = s.ranks[r][pc + k];
        const size_t cell = static_cast<size_t>(x.stage) * m + x.microbatch;
        size_t produced[2];
        int nproduced = 0;
        if (x.kind == ActionKind::kForward) produced[nproduced++] = cell;
        if (x.kind == ActionKind::kBackward || x.kind == ActionKind::kBackwardInput) {
          produced[nproduced++] = cells + cell;
        }
        if (x.kind == ActionKind::kBackwardInput) produced[nproduced++] = 2 * cells + cell;
        for (int j = 0; j < nproduced; ++j) {
          done[produced[j]] = end;
          waiters.Wake(produced[j], &ready);
        }
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
  if (overlapped.has_value()) {
    if (absl::Status st = CheckNonNegative("overlapped F&B cost", *overlapped); !st.ok()) return st;
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

double CostModel::PairCost(const Action& forward_half, const Action& backward_half, int virtual_stages) const {
  if (!overlapped.has_value()) {
    return ComputeCost(forward_half, virtual_stages) + ComputeCost(backward_half, virtual_stages);
  }
  const double factor = stage_multipliers.empty()
                            ? 1.0
                            : (stage_multipliers[forward_half.stage] + stage_multipliers[backward_half.stage]) / 2;
  return *overlapped * factor / virtual_stages;
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
      if (a.overlap_with_next && i + 1 < s.ranks[r].size()) {
        // The pair's time is counted once, on its first half.
        stats.busy += costs.PairCost(a, s.ranks[r][i + 1], s.virtual_stages) -
                      costs.ComputeCost(s.ranks[r][i + 1], s.virtual_stages);
      } else {
        stats.busy += costs.ComputeCost(a, s.virtual_stages);
      }
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
