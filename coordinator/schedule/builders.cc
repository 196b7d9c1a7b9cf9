#include "coordinator/schedule/builders.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace baton::schedule {
namespace {

Action Op(ActionKind kind, int stage, int mb) { return Action{kind, stage, mb, 0}; }

Schedule Empty(const ScheduleSpec& spec) {
  Schedule s;
  s.kind = spec.kind;
  s.num_ranks = spec.num_ranks;
  s.microbatches = spec.microbatches;
  s.virtual_stages = spec.virtual_stages;
  s.ranks.resize(spec.num_ranks);
  return s;
}

int OneFOneBWarmup(int p, int m, int r) { return std::min(p - r - 1, m); }

Schedule BuildGpipe(const ScheduleSpec& spec) {
  Schedule s = Empty(spec);
  const int m = spec.microbatches;
  for (int r = 0; r < spec.num_ranks; ++r) {
    auto& ops = s.ranks[r];
    for (int mb = 0; mb < m; ++mb) ops.push_back(Op(ActionKind::kForward, r, mb));
    for (int mb = 0; mb < m; ++mb) ops.push_back(Op(ActionKind::kBackward, r, mb));
  }
  return s;
}

Schedule BuildOneFOneB(const ScheduleSpec& spec) {
  Schedule s = Empty(spec);
  const int p = spec.num_ranks, m = spec.microbatches;
  for (int r = 0; r < p; ++r) {
    auto& ops = s.ranks[r];
    const int warmup = OneFOneBWarmup(p, m, r);
    for (int mb = 0; mb < warmup; ++mb) ops.push_back(Op(ActionKind::kForward, r, mb));
    for (int i = 0; i < m - warmup; ++i) {
      ops.push_back(Op(ActionKind::kForward, r, warmup + i));
      ops.push_back(Op(ActionKind::kBackward, r, i));
    }
    for (int mb = m - warmup; mb < m; ++mb) ops.push_back(Op(ActionKind::kBackward, r, mb));
  }
  return s;
}

int InterleavedWarmup(int p, int m, int v, int r) {
  return std::min((p - r - 1) * 2 + (v - 1) * p, v * m);
}

Schedule BuildInterleaved(const ScheduleSpec& spec) {
  Schedule s = Empty(spec);
  const int p = spec.num_ranks, m = spec.microbatches, v = spec.virtual_stages;
  const int total = v * m;
  for (int r = 0; r < p; ++r) {
    // The k-th chunk-forward (backward) of rank r, in Megatron order.
    auto forward = [&](int k) {
      const int group = k / (p * v), within = k % (p * v);
      return Op(ActionKind::kForward, (within / p) * p + r, group * p + within % p);
    };
    auto backward = [&](int k) {
      const int group = k / (p * v), within = k % (p * v);
      return Op(ActionKind::kBackward, (v - 1 - within / p) * p + r, group * p + within % p);
    };
    auto& ops = s.ranks[r];
    const int warmup = InterleavedWarmup(p, m, v, r);
    for (int k = 0; k < warmup; ++k) ops.push_back(forward(k));
    for (int i = 0; i < total - warmup; ++i) {
      ops.push_back(forward(warmup + i));
      ops.push_back(backward(i));
    }
    for (int k = total - warmup; k < total; ++k) ops.push_back(backward(k));
  }
  return s;
}

Schedule BuildZeroBubbleH1(const ScheduleSpec& spec) {
  Schedule s = Empty(spec);
  const int p = spec.num_ranks, m = spec.microbatches;
  for (int r = 0; r < p; ++r) {
    auto& ops = s.ranks[r];
    const int warmup = OneFOneBWarmup(p, m, r);
    int next_w = 0;
    // After I(mb), run the W that is r microbatches behind, if any.
    auto input_then_deferred_weight = [&](int mb) {
      ops.push_back(Op(ActionKind::kBackwardInput, r, mb));
      if (mb - r >= 0) ops.push_back(Op(ActionKind::kBackwardWeight, r, next_w++));
    };
    for (int mb = 0; mb < warmup; ++mb) ops.push_back(Op(ActionKind::kForward, r, mb));
    for (int i = 0; i < m - warmup; ++i) {
      ops.push_back(Op(ActionKind::kForward, r, warmup + i));
      input_then_deferred_weight(i);
    }
    for (int mb = m - warmup; mb < m; ++mb) input_then_deferred_weight(mb);
    while (next_w < m) ops.push_back(Op(ActionKind::kBackwardWeight, r, next_w++));
  }
  return s;
}

// ZB-V (Qi et al., Zero Bubble Pipeline Parallelism, section 6): two chunks
// per rank in a V (rank r holds c0 = r and c1 = 2p - 1 - r). Rank r warms up
// with 2(p - r) - 1 forwards of c0, then r pairs F(c1) F(c0), then p - r
// rounds F(c1) I(c1) W(c1); the steady state repeats F(c0) I(c0) W(c0) F(c1)
// I(c1) W(c1); the drain runs r rounds I(c0) I(c1), then p - r rounds I(c0)
// W(c0), then the weight backwards left. The order is written for
// max(m, 2p - 1) microbatches and the ones beyond m dropped (PyTorch's
// ScheduleZBVZeroBubble leaves them idle). With F = I = W the ranks never
// idle in the steady state, and every rank stores at most 2p
// chunk-activations: 1F1B's p microbatches of a whole stage.
Schedule BuildZeroBubbleV(const ScheduleSpec& spec) {
  Schedule s = Empty(spec);
  s.stage_ranks = VPlacement(spec.num_ranks, 2);
  const int p = spec.num_ranks, m = spec.microbatches, n = std::max(2 * p - 1, m);
  for (int r = 0; r < p; ++r) {
    const int c0 = r, c1 = 2 * p - 1 - r;
    int f0 = 0, f1 = 0, b0 = 0, b1 = 0;
    std::vector<Action> ops;
    auto add = [&](ActionKind kind, int stage, int mb) { ops.push_back(Op(kind, stage, mb)); };
    for (int i = 0; i < 2 * (p - r) - 1; ++i) add(ActionKind::kForward, c0, f0++);
    for (int i = 0; i < r; ++i) {
      add(ActionKind::kForward, c1, f1++);
      add(ActionKind::kForward, c0, f0++);
    }
    for (int i = 0; i < p - r; ++i) {
      add(ActionKind::kForward, c1, f1++);
      add(ActionKind::kBackwardInput, c1, b1);
      add(ActionKind::kBackwardWeight, c1, b1++);
    }
    while (f1 < f0 || f0 < n) {
      if (f0 < n) add(ActionKind::kForward, c0, f0++);
      add(ActionKind::kBackwardInput, c0, b0);
      add(ActionKind::kBackwardWeight, c0, b0++);
      add(ActionKind::kForward, c1, f1++);
      add(ActionKind::kBackwardInput, c1, b1);
      add(ActionKind::kBackwardWeight, c1, b1++);
    }
    int w0 = b0, w1 = b1;
    for (int i = 0; i < r; ++i) {
      add(ActionKind::kBackwardInput, c0, b0++);
      add(ActionKind::kBackwardInput, c1, b1++);
    }
    for (int i = 0; i < p - r; ++i) {
      add(ActionKind::kBackwardInput, c0, b0++);
      add(ActionKind::kBackwardWeight, c0, w0++);
    }
    while (w1 < b1) add(ActionKind::kBackwardWeight, c1, w1++);
    while (w0 < b0) add(ActionKind::kBackwardWeight, c0, w0++);
    for (const Action& a : ops) {
      if (a.microbatch < m) s.ranks[r].push_back(a);
    }
  }
  return s;
}

// DualPipe-V (DeepSeek-V3's DualPipe cut in half, as in PyTorch's
// ScheduleDualPipeV): the V placement, and in the steady state each rank
// overlaps the forward of one chunk with the full backward of the other
// (F&B pairs), so one microbatch's communication hides behind another's
// compute. Needs m >= 2p. Rank r runs, in eight phases:
//   1. 2(p - r - 1) forwards of c0          5. p - r - 1 rounds: B(c1), F(c1)&B(c0)
//   2. r + 1 rounds F(c0) F(c1)              6. r + 1 rounds B(c1) B(c0), switching to
//   3. p - r - 1 rounds I(c1) W F(c1)           I halfway (zero bubble) on the rank's parity
//   4. m - 2p + r + 1 rounds F(c0)&B(c1),    7. p - r - 1 rounds W, B or I(c0)
//      F(c1)&B(c0) (rank p-1 starts with     8. r + 1 weight backwards left
//      a plain F(c0) B(c1))
// A W always takes the oldest input backward still waiting for its weight
// half. Bubble: (p - 1)(F&B + B - 3W) in chunk costs.
Schedule BuildDualPipeV(const ScheduleSpec& spec) {
  Schedule s = Empty(spec);
  s.stage_ranks = VPlacement(spec.num_ranks, 2);
  const int p = spec.num_ranks, m = spec.microbatches;
  for (int r = 0; r < p; ++r) {
    const int c0 = r, c1 = 2 * p - 1 - r;
    std::vector<Action>& ops = s.ranks[r];
    int forwards[2] = {0, 0}, backwards[2] = {0, 0};  // next microbatch per chunk (0: c0, 1: c1)
    std::vector<std::pair<int, int>> pending_w;       // (stage, mb) whose I ran, oldest first
    size_t next_w = 0;
    auto chunk = [&](int stage) { return stage == c0 ? 0 : 1; };
    auto forward = [&](int stage, bool overlap) {
      Action a = Op(ActionKind::kForward, stage, forwards[chunk(stage)]++);
      a.overlap_with_next = overlap;
      ops.push_back(a);
    };
    auto backward = [&](int stage, bool split) {
      const int mb = backwards[chunk(stage)]++;
      ops.push_back(Op(split ? ActionKind::kBackwardInput : ActionKind::kBackward, stage, mb));
      if (split) pending_w.push_back({stage, mb});
    };
    auto weight = [&] {
      if (next_w == pending_w.size()) return;
      ops.push_back(Op(ActionKind::kBackwardWeight, pending_w[next_w].first, pending_w[next_w].second));
      ++next_w;
    };
    auto overlapped = [&](int f_stage, int b_stage) {
      forward(f_stage, true);
      backward(b_stage, false);
    };
    for (int i = 0; i < 2 * (p - r - 1); ++i) forward(c0, false);
    for (int i = 0; i < r + 1; ++i) {
      forward(c0, false);
      forward(c1, false);
    }
    for (int i = 0; i < p - r - 1; ++i) {
      backward(c1, true);
      weight();
      forward(c1, false);
    }
    for (int i = 0; i < m - 2 * p + r + 1; ++i) {
      if (i == 0 && r == p - 1) {
        forward(c0, false);  // not overlapped: a shorter bubble on the last rank
        backward(c1, false);
      } else {
        overlapped(c0, c1);
      }
      overlapped(c1, c0);
    }
    for (int i = 0; i < p - r - 1; ++i) {
      backward(c1, false);
      overlapped(c1, c0);
    }
    bool split = false;
    for (int i = 0; i < r + 1; ++i) {
      if (i == (r + 1) / 2 && r % 2 == 1) split = true;
      backward(c1, split);
      if (i == (r + 1) / 2 && r % 2 == 0) split = true;
      backward(c0, split);
    }
    for (int i = 0; i < p - r - 1; ++i) {
      weight();
      backward(c0, split);
    }
    for (int i = 0; i < r + 1; ++i) weight();
  }
  return s;
}

}  // namespace

const std::vector<std::string>& ScheduleKinds() {
  static const auto* kinds =
      new std::vector<std::string>{"gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe-v"};
  return *kinds;
}

bool IsVShaped(const std::string& kind) { return kind == "zb-v" || kind == "dualpipe-v"; }

std::vector<int> PlacementOf(const std::string& kind, int num_ranks, int virtual_stages) {
  if (IsVShaped(kind)) return VPlacement(num_ranks, virtual_stages);
  return {};
}

absl::StatusOr<Schedule> BuildSchedule(const ScheduleSpec& spec) {
  const auto& kinds = ScheduleKinds();
  if (std::find(kinds.begin(), kinds.end(), spec.kind) == kinds.end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown schedule '", spec.kind, "'; choose one of ", absl::StrJoin(kinds, ", ")));
  }
  if (spec.num_ranks < 1) {
    return absl::InvalidArgumentError(absl::StrCat("pipeline size must be at least 1 (got ",
                                                   spec.num_ranks,
                                                   "); set it to the number of "
                                                   "pipeline ranks"));
  }
  if (spec.microbatches < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("microbatches must be at least 1 (got ", spec.microbatches, ")"));
  }
  if (spec.virtual_stages < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("virtual stages must be at least 1 (got ", spec.virtual_stages, ")"));
  }
  if (spec.kind == "interleaved") {
    if (spec.microbatches % spec.num_ranks != 0) {
      const int fix = (spec.microbatches / spec.num_ranks + 1) * spec.num_ranks;
      return absl::InvalidArgumentError(absl::StrCat(
          "interleaved needs the microbatches to be a multiple of the pipeline size ",
          spec.num_ranks, " (got ", spec.microbatches, "); use ", fix, " microbatches"));
    }
    return BuildInterleaved(spec);
  }
  if (IsVShaped(spec.kind)) {
    if (spec.virtual_stages != 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          spec.kind, " places two chunks on every rank in a V; use virtual stages 2 (got ", spec.virtual_stages,
          spec.virtual_stages % 2 == 1 ? ": a V needs an even chunk count" : "", ")"));
    }
    if (spec.kind == "zb-v") return BuildZeroBubbleV(spec);
    if (spec.microbatches < 2 * spec.num_ranks) {
      return absl::InvalidArgumentError(absl::StrCat("dualpipe-v needs at least 2 x the pipeline size = ",
                                                     2 * spec.num_ranks, " microbatches (got ", spec.microbatches,
                                                     "); use ", 2 * spec.num_ranks, " microbatches or more"));
    }
    return BuildDualPipeV(spec);
  }
  if (spec.virtual_stages != 1) {
    return absl::InvalidArgumentError(absl::StrCat("virtual stages (", spec.virtual_stages,
                                                   ") need the interleaved schedule; use "
                                                   "virtual stages 1 with ",
                                                   spec.kind, " or choose interleaved"));
  }
  if (spec.kind == "gpipe") return BuildGpipe(spec);
  if (spec.kind == "1f1b") return BuildOneFOneB(spec);
  return BuildZeroBubbleH1(spec);
}

int ActivationBound(const std::string& kind, int num_ranks, int microbatches, int virtual_stages,
                    int rank) {
  const int p = num_ranks, m = microbatches, v = virtual_stages;
  if (kind == "1f1b") return std::min(p - rank, m);
  if (kind == "zb-h1") return std::min(p, m);
  if (kind == "interleaved") return std::min(InterleavedWarmup(p, m, v, rank) + 1, v * m);
  // ZB-V: 1F1B's peak of p whole-stage microbatches is 2p chunks.
  if (kind == "zb-v") return std::min(2 * p, v * m);
  // DualPipe-V: the paper's PP + 1 microbatches of a whole stage (c0 and c1).
  if (kind == "dualpipe-v") return std::min(2 * p + 1, v * m);
  return v * m;  // gpipe and imported schedules
}

}  // namespace baton::schedule
