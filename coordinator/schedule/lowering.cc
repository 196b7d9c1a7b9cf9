#include "coordinator/schedule/lowering.h"

#include <algorithm>
#include <tuple>

#include "absl/strings/str_cat.h"

namespace baton::schedule {

// Invariant (why the result cannot deadlock).
//
// Simulate the compute-only schedule (eager messages). Every message gets a
// key (T, seq): T is a time between the producer's end and the consumer's
// start, seq the producer's execution sequence number. Keys are distinct, so
// they order all messages globally. Every rank lists its sends and receives in
// increasing key order, so each rank's communication is the restriction of
// that one global order; a send comes after its producer (T >= end) and a
// receive before its consumer (T <= start).
//
// Suppose the programs got stuck, and take the stuck message M with the
// smallest key. Both its ranks have completed every message with a smaller key
// (minimality), compute never blocks, and every earlier batch of theirs holds
// only smaller keys, so both have posted the batch that holds M: M completes, a
// contradiction. Batching consecutive sends and receives, and matching
// messages per channel in posting order, fit this argument because each
// channel's messages are posted in key order on both ends.
//
// Choosing T: the earliest time at or after the producer's end at which
// neither the sender nor the receiver is in the middle of a compute action
// (if that is no later than the consumer's start; else the producer's end).
// Under blocking semantics both ranks then meet at T without waiting, so the
// lowered programs keep the simulated timeline. It also pairs messages: in
// the 1F1B steady state rank r ends F(k) exactly when rank r+1 ends B(j), so
// SEND_F(k) and RECV_B(j) become adjacent on rank r (one batch, one round
// trip) and SEND_B(j), RECV_F(k) on rank r+1, like Megatron's
// send_forward_recv_backward.
namespace {

// (time, 0 for a message / 1 for a compute action, sequence): at equal times
// messages go first, so a rank meets its peers before starting the next op.
using Key = std::tuple<double, int, int64_t>;

struct Message {
  Key key;
  Action action;
};

// Compute intervals of one rank, in program order (starts never decrease).
class Busy {
 public:
  void Add(double start, double end) { spans_.push_back({start, end}); }
  // The earliest time >= t at which the rank is not inside an action.
  double NextFree(double t) const {
    auto it =
        std::lower_bound(spans_.begin(), spans_.end(), t,
                         [](const std::pair<double, double>& s, double x) { return s.first < x; });
    if (it == spans_.begin()) return t;
    --it;  // the last action starting before t
    return it->second > t ? it->second : t;
  }

 private:
  std::vector<std::pair<double, double>> spans_;
};

// Time for a message from a producer ending at `ready` to a consumer starting
// at `deadline`, as described above.
double MeetingTime(const Busy& sender, const Busy& receiver, double ready, double deadline) {
  double t = ready;
  for (int round = 0; round < 16; ++round) {
    const double a = sender.NextFree(t);
    const double b = receiver.NextFree(a);
    if (b > deadline) break;
    if (b == a) return a;
    t = b;
  }
  return ready;
}

// Lowering times the schedule with strictly positive costs, so that a
// producer always ends after it starts and its send sorts after it.
CostModel PositiveCosts(CostModel costs) {
  constexpr double kTiny = 1e-6;
  for (double* c : {&costs.forward, &costs.backward_input, &costs.backward_weight}) {
    *c = std::max(*c, kTiny);
  }
  if (costs.backward) costs.backward = std::max(*costs.backward, kTiny);
  for (double& f : costs.stage_multipliers) f = std::max(f, kTiny);
  return costs;
}

}  // namespace

absl::StatusOr<Schedule> Lower(const Schedule& compute, const CostModel& costs) {
  for (int r = 0; r < static_cast<int>(compute.ranks.size()); ++r) {
    for (const Action& a : compute.ranks[r]) {
      if (!IsCompute(a.kind)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "lowering takes a compute-only schedule, but rank ", r, " already has ",
            ActionToString(a), "; lower the builder's output, or use ComputeOnly() first"));
      }
    }
  }
  auto sim = Simulate(compute, PositiveCosts(costs));
  if (!sim.ok()) {
    return absl::Status(sim.status().code(),
                        absl::StrCat("cannot lower: ", sim.status().message()));
  }
  const int p = compute.num_ranks, S = compute.num_stages(), m = compute.microbatches;
  // Start time of each consumer: [0] = F(stage, mb), [1] = B or I(stage, mb).
  std::vector<double> start[2];
  for (auto& v : start) v.assign(static_cast<size_t>(S) * m, 0);
  std::vector<Busy> busy(p);
  for (int r = 0; r < p; ++r) {
    for (size_t i = 0; i < compute.ranks[r].size(); ++i) {
      const Action& a = compute.ranks[r][i];
      const ActionTiming& t = sim->timings[r][i];
      busy[r].Add(t.start, t.end);
      const size_t cell = static_cast<size_t>(a.stage) * m + a.microbatch;
      if (a.kind == ActionKind::kForward) start[0][cell] = t.start;
      if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput) {
        start[1][cell] = t.start;
      }
    }
  }
  std::vector<std::vector<Message>> messages(p);
  for (int r = 0; r < p; ++r) {
    for (size_t i = 0; i < compute.ranks[r].size(); ++i) {
      const Action& a = compute.ranks[r][i];
      const ActionTiming& t = sim->timings[r][i];
      const bool forward = a.kind == ActionKind::kForward;
      const bool input_grad =
          a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput;
      if (!(forward && a.stage < S - 1) && !(input_grad && a.stage > 0)) continue;
      const int next = forward ? a.stage + 1 : a.stage - 1;
      const int to = compute.RankOf(next);
      if (to == r) continue;
      const double deadline = start[forward ? 0 : 1][static_cast<size_t>(next) * m + a.microbatch];
      const Key key{MeetingTime(busy[r], busy[to], t.end, deadline), 0, t.sequence};
      const ActionKind send = forward ? ActionKind::kSendF : ActionKind::kSendB;
      const ActionKind recv = forward ? ActionKind::kRecvF : ActionKind::kRecvB;
      messages[r].push_back({key, Action{send, a.stage, a.microbatch, to}});
      messages[to].push_back({key, Action{recv, next, a.microbatch, r}});
    }
  }

  Schedule out = compute;
  for (int r = 0; r < p; ++r) {
    auto& msgs = messages[r];
    std::sort(msgs.begin(), msgs.end(),
              [](const Message& x, const Message& y) { return x.key < y.key; });
    const auto& ops = compute.ranks[r];
    std::vector<Action>& program = out.ranks[r];
    program.clear();
    program.reserve(ops.size() + msgs.size() + 2);
    // Merge by key: a receive precedes its consumer (T <= its start) and a
    // send follows its producer (T >= its end > its start).
    size_t next = 0;
    for (size_t i = 0; i < ops.size(); ++i) {
      const ActionTiming& t = sim->timings[r][i];
      const Key op_key{t.start, 1, t.sequence};
      while (next < msgs.size() && msgs[next].key < op_key) program.push_back(msgs[next++].action);
      program.push_back(ops[i]);
    }
    while (next < msgs.size()) program.push_back(msgs[next++].action);
    program.push_back(Action{ActionKind::kReduceGrads, 0, 0, 0});
    program.push_back(Action{ActionKind::kOptimizerStep, 0, 0, 0});
  }
  return out;
}

}  // namespace baton::schedule
