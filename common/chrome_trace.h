// ChromeTraceJson: a Chrome / Perfetto trace (the JSON "traceEvents" format
// that chrome://tracing and ui.perfetto.dev open) from timeline spans.
//
// Each distinct `process` label (a worker or stage, e.g. "stage 1 / worker-3")
// becomes one process track and each distinct `thread` inside it one thread
// track, numbered in order of first appearance, with process_name,
// process_sort_index and thread_name metadata events so the UI shows the
// labels in that order. Spans are complete events ("ph": "X") in
// microseconds. All strings are escaped (invalid UTF-8 becomes U+FFFD), so
// the output always parses.
#ifndef BATON_COMMON_CHROME_TRACE_H_
#define BATON_COMMON_CHROME_TRACE_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace baton {

struct TraceSpan {
  std::string process;   // worker / stage label
  std::string thread;    // e.g. "compute", "comm"
  std::string name;      // e.g. "F3", "RECV_ACT mb3"
  std::string category;  // compute | p2p | tp | dp | bubble | optimizer
  int64_t start_us = 0;
  int64_t duration_us = 0;
  // Shown when the span is selected ("args"; string values), e.g. what a
  // recovery did. Optional.
  std::vector<std::pair<std::string, std::string>> args = {};
};

std::string ChromeTraceJson(const std::vector<TraceSpan>& spans);

}  // namespace baton

#endif  // BATON_COMMON_CHROME_TRACE_H_
