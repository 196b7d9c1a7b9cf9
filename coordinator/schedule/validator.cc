#include "coordinator/schedule/validator.h"

#include <map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "coordinator/schedule/builders.h"
#include "coordinator/schedule/simulator.h"

namespace baton::schedule {
namespace {

// Kinds indexed in the position tables.
enum Slot { kF, kB, kI, kW, kSendF, kRecvF, kSendB, kRecvB, kNumSlots };

int SlotOf(ActionKind kind) {
  switch (kind) {
    case ActionKind::kForward:
      return kF;
    case ActionKind::kBackward:
      return kB;
    case ActionKind::kBackwardInput:
      return kI;
    case ActionKind::kBackwardWeight:
      return kW;
    case ActionKind::kSendF:
      return kSendF;
    case ActionKind::kRecvF:
      return kRecvF;
    case ActionKind::kSendB:
      return kSendB;
    case ActionKind::kRecvB:
      return kRecvB;
    default:
      return -1;
  }
}

constexpr ActionKind kSlotKinds[kNumSlots] = {
    ActionKind::kForward,        ActionKind::kBackward, ActionKind::kBackwardInput,
    ActionKind::kBackwardWeight, ActionKind::kSendF,    ActionKind::kRecvF,
    ActionKind::kSendB,          ActionKind::kRecvB};

Violation At(int rank, int action, std::string message) {
  return Violation{std::move(message), CellRef{rank, action}};
}

class Checker {
 public:
  explicit Checker(const Schedule& s)
      : s_(s), p_(s.num_ranks), S_(s.num_stages()), m_(s.microbatches) {}

  std::optional<Violation> Run() {
    if (auto v = CheckShape()) return v;
    if (auto v = FillPositions()) return v;
    if (auto v = CheckCounts()) return v;
    if (auto v = CheckLocalOrder()) return v;
    if (HasCommunication(s_)) {
      if (auto v = CheckMessages()) return v;
      if (auto v = CheckChannelOrder()) return v;
    }
    if (auto d = FindDeadlock(s_)) return At(d->rank, d->action, d->message);
    return CheckActivations();
  }

 private:
  size_t Cell(int stage, int mb) const { return static_cast<size_t>(stage) * m_ + mb; }
  int Pos(int slot, int stage, int mb) const { return pos_[slot][Cell(stage, mb)]; }
  int RankOf(int stage) const { return s_.RankOf(stage); }
  // "F(1,3)", "SEND_F(1,3)": the kind and cell, without a peer.
  std::string Name(int slot, int stage, int mb) const {
    return absl::StrCat(KindName(kSlotKinds[slot]), "(", stage, ",", mb, ")");
  }
  // "F(1,3) on rank 1 (action 4)"
  std::string Where(int slot, int stage, int mb) const {
    return absl::StrCat(ActionToString(s_.ranks[RankOf(stage)][Pos(slot, stage, mb)]), " on rank ",
                        RankOf(stage), " (action ", Pos(slot, stage, mb), ")");
  }
  Violation AtSlot(int slot, int stage, int mb, std::string message) const {
    return At(RankOf(stage), Pos(slot, stage, mb), std::move(message));
  }

  std::optional<Violation> CheckShape() const {
    if (p_ < 1 || s_.virtual_stages < 1 || m_ < 1 || static_cast<int>(s_.ranks.size()) != p_) {
      return Violation{absl::StrCat("schedule sizes are inconsistent: ", s_.ranks.size(),
                                    " programs for num_ranks=", p_,
                                    ", virtual_stages=", s_.virtual_stages, ", microbatches=", m_),
                       std::nullopt};
    }
    if (absl::Status placement = CheckPlacement(s_.stage_ranks, p_, S_); !placement.ok()) {
      return Violation{std::string(placement.message()), std::nullopt};
    }
    for (int r = 0; r < p_; ++r) {
      bool finished = false;  // a REDUCE_GRADS/OPTIMIZER_STEP was seen
      int reduce = -1, step = -1;
      for (size_t i = 0; i < s_.ranks[r].size(); ++i) {
        const Action& a = s_.ranks[r][i];
        const int at = static_cast<int>(i);
        const std::string name =
            absl::StrCat(ActionToString(a), " on rank ", r, " (action ", i, ")");
        if (a.kind == ActionKind::kReduceGrads || a.kind == ActionKind::kOptimizerStep) {
          int& seen = a.kind == ActionKind::kReduceGrads ? reduce : step;
          if (seen >= 0) {
            return At(r, at, absl::StrCat("duplicate ", name, "; it also is action ", seen));
          }
          if (a.kind == ActionKind::kReduceGrads && step >= 0) {
            return At(r, at,
                      absl::StrCat(name, " comes after OPTIMIZER_STEP (action ", step,
                                   "); gradients must be reduced before the step"));
          }
          seen = at;
          finished = true;
          continue;
        }
        if (finished) {
          return At(r, at,
                    absl::StrCat(name,
                                 " comes after REDUCE_GRADS/OPTIMIZER_STEP; those "
                                 "must end the program"));
        }
        if (a.stage < 0 || a.stage >= S_ || a.microbatch < 0 || a.microbatch >= m_) {
          return At(r, at,
                    absl::StrCat(name, " is outside the schedule: stages 0..", S_ - 1,
                                 ", microbatches 0..", m_ - 1));
        }
        if (RankOf(a.stage) != r) {
          return At(r, at,
                    absl::StrCat(name, " is on the wrong rank: stage ", a.stage, " lives on rank ",
                                 RankOf(a.stage), " (", PlacementName(s_), " placement)"));
        }
        if (!IsCommunication(a.kind)) continue;
        const bool forward = a.kind == ActionKind::kSendF || a.kind == ActionKind::kRecvB;
        const int partner = forward ? a.stage + 1 : a.stage - 1;
        if (partner < 0 || partner >= S_) {
          return At(r, at,
                    absl::StrCat(name, " has no partner: stage ", partner, " does not exist"));
        }
        if (RankOf(partner) == r) {
          return At(r, at,
                    absl::StrCat(name, " is not needed: stages ", a.stage, " and ", partner,
                                 " are both on rank ", r));
        }
        if (a.peer != RankOf(partner)) {
          return At(r, at,
                    absl::StrCat(name, " names peer ", a.peer, ", but stage ", partner,
                                 " lives on rank ", RankOf(partner)));
        }
      }
    }
    int pair_rank = 0, pair_index = 0;
    if (absl::Status pairs = CheckOverlapPairs(s_, &pair_rank, &pair_index); !pairs.ok()) {
      return At(pair_rank, pair_index, std::string(pairs.message()));
    }
    return std::nullopt;
  }

  std::optional<Violation> FillPositions() {
    const size_t cells = static_cast<size_t>(S_) * m_;
    for (auto& table : pos_) table.assign(cells, -1);
    for (int r = 0; r < p_; ++r) {
      for (size_t i = 0; i < s_.ranks[r].size(); ++i) {
        const Action& a = s_.ranks[r][i];
        const int slot = SlotOf(a.kind);
        if (slot < 0) continue;
        int& pos = pos_[slot][Cell(a.stage, a.microbatch)];
        if (pos >= 0) {
          return At(r, static_cast<int>(i),
                    absl::StrCat("duplicate ", ActionToString(a), " on rank ", r, " (actions ", pos,
                                 " and ", i, "); each must appear exactly once"));
        }
        pos = static_cast<int>(i);
      }
    }
    return std::nullopt;
  }

  // Some existing action of (stage, mb) to point at, if any.
  std::optional<CellRef> AnyOf(int stage, int mb) const {
    for (int slot : {kF, kB, kI, kW}) {
      if (Pos(slot, stage, mb) >= 0) return CellRef{RankOf(stage), Pos(slot, stage, mb)};
    }
    return std::nullopt;
  }

  std::optional<Violation> CheckCounts() const {
    for (int st = 0; st < S_; ++st) {
      for (int mb = 0; mb < m_; ++mb) {
        const bool f = Pos(kF, st, mb) >= 0, b = Pos(kB, st, mb) >= 0;
        const bool i = Pos(kI, st, mb) >= 0, w = Pos(kW, st, mb) >= 0;
        const std::string rank = absl::StrCat(" (stage ", st, " is on rank ", RankOf(st), ")");
        if (!f) {
          return Violation{absl::StrCat("missing ", Name(kF, st, mb), rank), AnyOf(st, mb)};
        }
        if (b && (i || w)) {
          return AtSlot(kB, st, mb,
                        absl::StrCat(Where(kB, st, mb),
                                     " duplicates the split "
                                     "backward of the same microbatch; use B or I+W"));
        }
        if (b) continue;
        if (!i && !w) {
          return AtSlot(kF, st, mb,
                        absl::StrCat("missing ", Name(kB, st, mb), " (or ", Name(kI, st, mb),
                                     " and ", Name(kW, st, mb), ") for ", Where(kF, st, mb)));
        }
        if (!w) {
          return AtSlot(kI, st, mb,
                        absl::StrCat("missing ", Name(kW, st, mb), ": ", Where(kI, st, mb),
                                     " has no weight backward"));
        }
        if (!i) {
          return AtSlot(kW, st, mb,
                        absl::StrCat("missing ", Name(kI, st, mb), ": ", Where(kW, st, mb),
                                     " has no input backward"));
        }
      }
    }
    return std::nullopt;
  }

  // The position of the backward that produces the input gradient (B or I).
  int GradSlot(int stage, int mb) const { return Pos(kB, stage, mb) >= 0 ? kB : kI; }

  std::optional<Violation> CheckLocalOrder() const {
    for (int st = 0; st < S_; ++st) {
      for (int mb = 0; mb < m_; ++mb) {
        const int g = GradSlot(st, mb);
        if (Pos(g, st, mb) < Pos(kF, st, mb)) {
          return AtSlot(
              g, st, mb,
              absl::StrCat(Where(g, st, mb), " comes before its forward ", Where(kF, st, mb)));
        }
        if (g == kI && Pos(kW, st, mb) < Pos(kI, st, mb)) {
          return AtSlot(kW, st, mb,
                        absl::StrCat(Where(kW, st, mb), " comes before ", Where(kI, st, mb),
                                     "; I must precede W"));
        }
        if (st > 0 && RankOf(st - 1) == RankOf(st) && Pos(kF, st, mb) < Pos(kF, st - 1, mb)) {
          return AtSlot(kF, st, mb,
                        absl::StrCat(Where(kF, st, mb), " comes before the upstream ",
                                     Where(kF, st - 1, mb), " that feeds it"));
        }
        if (st < S_ - 1 && RankOf(st + 1) == RankOf(st)) {
          const int down = GradSlot(st + 1, mb);
          if (Pos(g, st, mb) < Pos(down, st + 1, mb)) {
            return AtSlot(g, st, mb,
                          absl::StrCat(Where(g, st, mb), " comes before the downstream ",
                                       Where(down, st + 1, mb), " that feeds it"));
          }
        }
      }
    }
    return std::nullopt;
  }

  // The producer (`slot` at `from`) sends via `send`, the consumer
  // (`consumer_slot` at `to`) receives via `recv` first.
  std::optional<Violation> CheckEdge(int from, int to, int mb, int slot, int send,
                                     int consumer_slot, int recv) const {
    if (Pos(send, from, mb) < 0) {
      return AtSlot(slot, from, mb,
                    absl::StrCat(Where(slot, from, mb), " has no ", Name(send, from, mb),
                                 " after it; rank ", RankOf(to), " needs its output"));
    }
    if (Pos(send, from, mb) < Pos(slot, from, mb)) {
      return AtSlot(send, from, mb,
                    absl::StrCat(Where(send, from, mb), " comes before its producer ",
                                 Where(slot, from, mb)));
    }
    if (Pos(recv, to, mb) < 0) {
      return AtSlot(consumer_slot, to, mb,
                    absl::StrCat(Where(consumer_slot, to, mb), " has no ", Name(recv, to, mb),
                                 " before it; its input comes from rank ", RankOf(from)));
    }
    if (Pos(recv, to, mb) > Pos(consumer_slot, to, mb)) {
      return AtSlot(consumer_slot, to, mb,
                    absl::StrCat(Where(consumer_slot, to, mb), " runs before its input arrives: ",
                                 Where(recv, to, mb), " comes after it"));
    }
    return std::nullopt;
  }

  std::optional<Violation> CheckMessages() const {
    for (int st = 0; st < S_; ++st) {
      for (int mb = 0; mb < m_; ++mb) {
        if (st + 1 < S_ && RankOf(st + 1) != RankOf(st)) {
          if (auto v = CheckEdge(st, st + 1, mb, kF, kSendF, kF, kRecvF)) return v;
        }
        if (st > 0 && RankOf(st - 1) != RankOf(st)) {
          if (auto v = CheckEdge(st, st - 1, mb, GradSlot(st, mb), kSendB, GradSlot(st - 1, mb),
                                 kRecvB)) {
            return v;
          }
        }
      }
    }
    // The shape check tied every send and receive to one of these edges.
    return std::nullopt;
  }

  std::optional<Violation> CheckChannelOrder() const {
    struct Entry {
      int stage;
      int mb;
      int rank;
      int action;
      bool forward;
    };
    // (from, to) -> messages in program order, from the sender's and the
    // receiver's side. A message is named by its producer stage.
    std::map<std::pair<int, int>, std::vector<Entry>> sends, recvs;
    for (int r = 0; r < p_; ++r) {
      for (size_t i = 0; i < s_.ranks[r].size(); ++i) {
        const Action& a = s_.ranks[r][i];
        const int at = static_cast<int>(i);
        switch (a.kind) {
          case ActionKind::kSendF:
            sends[{r, a.peer}].push_back({a.stage, a.microbatch, r, at, true});
            break;
          case ActionKind::kSendB:
            sends[{r, a.peer}].push_back({a.stage, a.microbatch, r, at, false});
            break;
          case ActionKind::kRecvF:
            recvs[{a.peer, r}].push_back({a.stage - 1, a.microbatch, r, at, true});
            break;
          case ActionKind::kRecvB:
            recvs[{a.peer, r}].push_back({a.stage + 1, a.microbatch, r, at, false});
            break;
          default:
            break;
        }
      }
    }
    for (const auto& [channel, sent] : sends) {
      const std::vector<Entry>& got = recvs[channel];
      for (size_t k = 0; k < sent.size() && k < got.size(); ++k) {
        const Entry& x = sent[k];
        const Entry& y = got[k];
        if (x.stage == y.stage && x.mb == y.mb && x.forward == y.forward) continue;
        const Action& sa = s_.ranks[x.rank][x.action];
        const Action& ra = s_.ranks[y.rank][y.action];
        return At(y.rank, y.action,
                  absl::StrCat("rank ", y.rank, " receives from rank ", x.rank,
                               " in a different order than it sends: receive #", k + 1, " is ",
                               ActionToString(ra), " (action ", y.action, ") but send #", k + 1,
                               " is ", ActionToString(sa), " (action ", x.action,
                               "); messages between two ranks match in posting order"));
      }
    }
    return std::nullopt;
  }

  std::optional<Violation> CheckActivations() const {
    for (int r = 0; r < p_; ++r) {
      const int bound = ActivationBound(s_.kind, p_, m_, s_.virtual_stages, r);
      int live = 0;
      for (size_t i = 0; i < s_.ranks[r].size(); ++i) {
        const Action& a = s_.ranks[r][i];
        if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardWeight) --live;
        if (a.kind != ActionKind::kForward || ++live <= bound) continue;
        return At(
            r, static_cast<int>(i),
            absl::StrCat("rank ", r, " stores ", live, " activations after ", ActionToString(a),
                         " (action ", i, "), above the bound of ", bound, " for ",
                         s_.kind.empty() ? "this" : s_.kind, " schedules on rank ", r));
      }
    }
    return std::nullopt;
  }

  const Schedule& s_;
  const int p_;
  const int S_;
  const int m_;
  std::vector<int> pos_[kNumSlots];  // [slot][stage * m + mb] = action index or -1
};

}  // namespace

std::optional<Violation> FindViolation(const Schedule& schedule) { return Checker(schedule).Run(); }

absl::Status Validate(const Schedule& schedule) {
  std::optional<Violation> v = FindViolation(schedule);
  if (!v) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat(v->message, "\n", RenderProgramGrid(schedule, v->cell)));
}

}  // namespace baton::schedule
