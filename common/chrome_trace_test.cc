#include "common/chrome_trace.h"

#include "common/json.h"
#include "gtest/gtest.h"

namespace baton {
namespace {

const JsonValue* FindEvent(const JsonValue& events, const std::string& ph, const std::string& name) {
  for (const JsonValue& e : events.items()) {
    if (e.Find("ph")->str() == ph && e.Find("name")->str() == name) return &e;
  }
  return nullptr;
}

TEST(ChromeTraceTest, SpansBecomeCompleteEventsOnLabelledTracks) {
  const std::string json = ChromeTraceJson({
      {"stage 0 / worker-0", "compute", "F0", "compute", 100, 20},
      {"stage 1 / worker-1", "compute", "F0", "compute", 125, 20},
      {"stage 0 / worker-0", "comm", "SEND_ACT mb0", "p2p", 120, 3},
  });
  auto trace = JsonValue::Parse(json);
  ASSERT_TRUE(trace.ok()) << trace.status() << "\n" << json;
  const JsonValue& events = *trace->Find("traceEvents");
  ASSERT_EQ(events.items().size(), 3u + 2 * 2 + 3);  // spans, 2 processes × 2, 3 threads

  const JsonValue* send = FindEvent(events, "X", "SEND_ACT mb0");
  ASSERT_NE(send, nullptr);
  EXPECT_EQ(send->Find("cat")->str(), "p2p");
  EXPECT_EQ(*send->Find("ts")->integer(), 120);
  EXPECT_EQ(*send->Find("dur")->integer(), 3);
  // Same process as worker-0's compute span, another thread.
  const JsonValue& f0 = events.items()[7];
  EXPECT_EQ(*f0.Find("pid")->integer(), *send->Find("pid")->integer());
  EXPECT_NE(*f0.Find("tid")->integer(), *send->Find("tid")->integer());

  int named_processes = 0, named_threads = 0;
  for (const JsonValue& e : events.items()) {
    if (e.Find("ph")->str() != "M") continue;
    const std::string& kind = e.Find("name")->str();
    if (kind == "process_name") {
      ++named_processes;
      EXPECT_EQ(e.Find("args")->Find("name")->str(),
                *e.Find("pid")->integer() == 1 ? "stage 0 / worker-0" : "stage 1 / worker-1");
    } else if (kind == "thread_name") {
      ++named_threads;
    }
  }
  EXPECT_EQ(named_processes, 2);
  EXPECT_EQ(named_threads, 3);
}

TEST(ChromeTraceTest, LabelsAreEscaped) {
  const std::string label = "w\"orker\\1\n\x01 \xff";
  auto trace = JsonValue::Parse(ChromeTraceJson({{label, "t\"", "n\"ame", "c", 0, 1}}));
  ASSERT_TRUE(trace.ok()) << trace.status();
  const JsonValue& events = *trace->Find("traceEvents");
  EXPECT_EQ(events.items()[0].Find("args")->Find("name")->str(), "w\"orker\\1\n\x01 \xEF\xBF\xBD");
  EXPECT_EQ(FindEvent(events, "X", "n\"ame")->Find("cat")->str(), "c");
}

TEST(ChromeTraceTest, NoSpansIsAnEmptyTrace) {
  auto trace = JsonValue::Parse(ChromeTraceJson({}));
  ASSERT_TRUE(trace.ok()) << trace.status();
  EXPECT_TRUE(trace->Find("traceEvents")->items().empty());
}

}  // namespace
}  // namespace baton

namespace baton {
namespace {

TEST(ChromeTraceTest, ASpansArgsAreShownEscaped) {
  const std::string json = ChromeTraceJson({
      {"coordinator", "recovery", "recovery 1", "recovery", 10, 5, {{"cause", "worker_lost"}, {"detail", "a \"q\"\n"}}},
      {"stage 0 / worker-0", "compute", "F0", "compute", 100, 20},
  });
  auto trace = JsonValue::Parse(json);
  ASSERT_TRUE(trace.ok()) << trace.status() << "\n" << json;
  const JsonValue* recovery = FindEvent(*trace->Find("traceEvents"), "X", "recovery 1");
  ASSERT_NE(recovery, nullptr);
  ASSERT_NE(recovery->Find("args"), nullptr) << json;
  EXPECT_EQ(recovery->Find("args")->Find("cause")->str(), "worker_lost");
  EXPECT_EQ(recovery->Find("args")->Find("detail")->str(), "a \"q\"\n");
  EXPECT_EQ(FindEvent(*trace->Find("traceEvents"), "X", "F0")->Find("args"), nullptr);
}

}  // namespace
}  // namespace baton
