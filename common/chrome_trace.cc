#include "common/chrome_trace.h"

#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/json.h"

namespace baton {

std::string ChromeTraceJson(const std::vector<TraceSpan>& spans) {
  std::map<std::string, int> pids;
  std::map<std::pair<int, std::string>, int> tids;
  std::string metadata, events;
  auto append = [](std::string& out, const std::string& event) {
    absl::StrAppend(&out, out.empty() ? "" : ",\n", event);
  };
  for (const TraceSpan& s : spans) {
    auto [p, new_process] = pids.emplace(s.process, static_cast<int>(pids.size()) + 1);
    const int pid = p->second;
    if (new_process) {
      append(metadata, absl::StrCat("{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":", pid,
                                    ",\"tid\":0,\"args\":{\"name\":", JsonQuote(s.process), "}}"));
      append(metadata, absl::StrCat("{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":", pid,
                                    ",\"tid\":0,\"args\":{\"sort_index\":", pid, "}}"));
    }
    auto [t, new_thread] = tids.emplace(std::make_pair(pid, s.thread), static_cast<int>(tids.size()) + 1);
    const int tid = t->second;
    if (new_thread) {
      append(metadata, absl::StrCat("{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":", pid, ",\"tid\":", tid,
                                    ",\"args\":{\"name\":", JsonQuote(s.thread), "}}"));
    }
    std::string args;
    for (const auto& [key, value] : s.args) {
      absl::StrAppend(&args, args.empty() ? ",\"args\":{" : ",", JsonQuote(key), ":", JsonQuote(value));
    }
    if (!args.empty()) args += "}";
    append(events, absl::StrCat("{\"name\":", JsonQuote(s.name), ",\"cat\":", JsonQuote(s.category),
                                ",\"ph\":\"X\",\"ts\":", s.start_us, ",\"dur\":", s.duration_us,
                                ",\"pid\":", pid, ",\"tid\":", tid, args, "}"));
  }
  const char* sep = !metadata.empty() && !events.empty() ? ",\n" : "";
  return absl::StrCat("{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n", metadata, sep, events, "\n]}\n");
}

}  // namespace baton
