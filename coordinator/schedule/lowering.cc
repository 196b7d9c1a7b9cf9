#include "coordinator/schedule/lowering.h"

#include <algorithm>
#include <tuple>

#include "absl/strings/str_cat.h"

namespace baton::schedule {

// Invariant (why the result cannot deadlock).
//
// Every message gets one key: (end time of its producer in a simulation of the
// compute-only schedule, the producer's execution sequence number). Keys are
// distinct, so they order all messages globally. On every rank, the sends and
// receives appear in increasing key order, so each rank's communication is the
// restriction of that one global order; a send comes after its producer and a
// receive before its consumer (the consumer started at or after the producer
// ended, later in the simulation's sequence).
//
// Suppose the programs got stuck, and take the stuck message M with the
// smallest key. Both its ranks have completed every message with a smaller key
// (minimality), compute never blocks, and every earlier batch of theirs holds
// only smaller keys, so both have posted the batch that holds M: M completes, a
// contradiction. Batching consecutive sends and receives, and matching
// messages per channel in posting order, are compatible with this because each
// channel's messages are posted in key order on both ends.
//
// Placing messages by simulated time also pairs them: in the 1F1B steady state
// rank r ends F(k) exactly when rank r+1 ends B(j), so SEND_F(k) and RECV_B(j)
// become adjacent on rank r (one batch, one round trip) and SEND_B(j),
// RECV_F(k) adjacent on rank r+1, as in Megatron's send_forward_recv_backward.
namespace {

using Key = std::tuple<double, int64_t>;

struct Message {
  Key key;
  Action action;
};

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
  auto sim = Simulate(compute, costs);
  if (!sim.ok()) {
    return absl::Status(sim.status().code(),
                        absl::StrCat("cannot lower: ", sim.status().message()));
  }
  const int p = compute.num_ranks, S = compute.num_stages();
  std::vector<std::vector<Message>> messages(p);
  for (int r = 0; r < p; ++r) {
    for (size_t i = 0; i < compute.ranks[r].size(); ++i) {
      const Action& a = compute.ranks[r][i];
      const ActionTiming& t = sim->timings[r][i];
      const Key key{t.end, t.sequence};
      if (a.kind == ActionKind::kForward && a.stage < S - 1) {
        const int to = RankOfStage(a.stage + 1, p);
        if (to == r) continue;
        messages[r].push_back({key, Action{ActionKind::kSendF, a.stage, a.microbatch, to}});
        messages[to].push_back({key, Action{ActionKind::kRecvF, a.stage + 1, a.microbatch, r}});
      } else if ((a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput) &&
                 a.stage > 0) {
        const int to = RankOfStage(a.stage - 1, p);
        if (to == r) continue;
        messages[r].push_back({key, Action{ActionKind::kSendB, a.stage, a.microbatch, to}});
        messages[to].push_back({key, Action{ActionKind::kRecvB, a.stage - 1, a.microbatch, r}});
      }
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
    // Merge: a message goes before the compute op whose (start, sequence) is
    // larger than its key, so a receive precedes its consumer and a send
    // follows its producer (whose key is its own end, >= its start).
    size_t next = 0;
    for (size_t i = 0; i < ops.size(); ++i) {
      const ActionTiming& t = sim->timings[r][i];
      const Key op_key{t.start, t.sequence};
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
