#include "coordinator/schedule/report.h"

#include "coordinator/schedule/builders.h"
#include "gtest/gtest.h"

namespace baton::schedule {
namespace {

SimulationResult SimulateDefault(const Schedule& s) {
  auto sim = Simulate(s, CostModel());
  EXPECT_TRUE(sim.ok()) << sim.status();
  return *sim;
}

TEST(Report, JsonHasExactlyTheDocumentedFields) {
  auto s = BuildSchedule({"gpipe", 2, 1, 1});
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(FormatSimulationJson(SimulateDefault(*s)),
            "{\"makespan\": 6, \"bubble_ratio\": 0.5, \"stages\": ["
            "{\"rank\": 0, \"busy\": 3, \"bubble_ratio\": 0.5, \"peak_activations\": 1}, "
            "{\"rank\": 1, \"busy\": 3, \"bubble_ratio\": 0.5, \"peak_activations\": 1}]}\n");
}

TEST(Report, TextTable) {
  auto s = BuildSchedule({"1f1b", 2, 2, 1});
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(FormatSimulationText(*s, SimulateDefault(*s)),
            "schedule 1f1b: p=2 v=1 m=2\n"
            "makespan      9\n"
            "bubble_ratio  0.3333\n"
            "\n"
            "rank  busy          bubble_ratio  peak_activations\n"
            "0     6             0.3333        2\n"
            "1     6             0.3333        1\n");
}

TEST(Report, ChromeTraceHasOneThreadPerRankAndTimedEvents) {
  auto s = BuildSchedule({"gpipe", 2, 1, 1});
  ASSERT_TRUE(s.ok());
  const std::string trace = FormatChromeTrace(*s, SimulateDefault(*s));
  EXPECT_NE(trace.find("\"traceEvents\""), std::string::npos);
  EXPECT_NE(trace.find("\"args\": {\"name\": \"rank 1\"}"), std::string::npos);
  // B0 on rank 0 runs [4, 6] units = [4000, 6000] us.
  EXPECT_NE(trace.find("{\"name\": \"B0\", \"cat\": \"B\", \"ph\": \"X\", \"pid\": 0, \"tid\": 0, "
                       "\"ts\": 4000.000, \"dur\": 2000.000, "
                       "\"args\": {\"stage\": 0, \"microbatch\": 0}}"),
            std::string::npos)
      << trace;
}

}  // namespace
}  // namespace baton::schedule
