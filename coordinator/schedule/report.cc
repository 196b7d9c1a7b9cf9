#include "coordinator/schedule/report.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace baton::schedule {
namespace {

std::string Num(double x) { return absl::StrFormat("%.12g", x); }

}  // namespace

std::string FormatSimulationText(const Schedule& schedule, const SimulationResult& result) {
  std::string out = absl::StrFormat(
      "schedule %s: p=%d v=%d m=%d\nmakespan      %s\nbubble_ratio  %.4f\n\n",
      schedule.kind.empty() ? "(imported)" : schedule.kind, schedule.num_ranks,
      schedule.virtual_stages, schedule.microbatches, Num(result.makespan), result.bubble_ratio);
  absl::StrAppend(&out, "rank  busy          bubble_ratio  peak_activations\n");
  for (const RankStats& r : result.ranks) {
    absl::StrAppend(&out, absl::StrFormat("%-5d %-13s %-13.4f %d\n", r.rank, Num(r.busy),
                                          r.bubble_ratio, r.peak_activations));
  }
  return out;
}

std::string FormatSimulationJson(const SimulationResult& result) {
  std::string out =
      absl::StrCat("{\"makespan\": ", Num(result.makespan),
                   ", \"bubble_ratio\": ", Num(result.bubble_ratio), ", \"stages\": [");
  for (size_t i = 0; i < result.ranks.size(); ++i) {
    const RankStats& r = result.ranks[i];
    absl::StrAppend(&out, i ? ", " : "", "{\"rank\": ", r.rank, ", \"busy\": ", Num(r.busy),
                    ", \"bubble_ratio\": ", Num(r.bubble_ratio),
                    ", \"peak_activations\": ", r.peak_activations, "}");
  }
  absl::StrAppend(&out, "]}\n");
  return out;
}

std::string FormatChromeTrace(const Schedule& schedule, const SimulationResult& result) {
  std::string out = "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n";
  bool first = true;
  auto event = [&](const std::string& body) {
    absl::StrAppend(&out, first ? "" : ",\n", body);
    first = false;
  };
  event(
      "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": 0, \"args\": {\"name\": "
      "\"pipeline\"}}");
  for (int r = 0; r < schedule.num_ranks; ++r) {
    event(
        absl::StrFormat("{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": 0, \"tid\": %d, "
                        "\"args\": {\"name\": \"rank %d\"}}",
                        r, r));
    for (size_t i = 0; i < schedule.ranks[r].size(); ++i) {
      const Action& a = schedule.ranks[r][i];
      const ActionTiming& t = result.timings[r][i];
      if (t.end <= t.start) continue;
      const bool compute = IsCompute(a.kind);
      event(absl::StrFormat(
          "{\"name\": \"%s\", \"cat\": \"%s\", \"ph\": \"X\", \"pid\": 0, \"tid\": %d, "
          "\"ts\": %.3f, \"dur\": %.3f, \"args\": {\"stage\": %d, \"microbatch\": %d}}",
          compute ? CellLabel(a, schedule.virtual_stages) : ActionToString(a),
          compute ? KindName(a.kind) : "comm", r, t.start * 1000, (t.end - t.start) * 1000, a.stage,
          a.microbatch));
    }
  }
  absl::StrAppend(&out, "\n]}\n");
  return out;
}

}  // namespace baton::schedule
