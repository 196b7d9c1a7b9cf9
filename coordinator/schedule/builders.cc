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

}  // namespace

const std::vector<std::string>& ScheduleKinds() {
  static const auto* kinds = new std::vector<std::string>{"gpipe", "1f1b", "interleaved", "zb-h1"};
  return *kinds;
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
  return v * m;  // gpipe and imported schedules
}

}  // namespace baton::schedule
