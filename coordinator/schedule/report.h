// Renderings of a simulation result: a text table, the JSON summary that
// `batonctl schedule simulate --format=json` prints, and a Chrome trace
// (chrome://tracing, Perfetto) with one thread per pipeline rank.
#ifndef BATON_COORDINATOR_SCHEDULE_REPORT_H_
#define BATON_COORDINATOR_SCHEDULE_REPORT_H_

#include <string>

#include "coordinator/schedule/ir.h"
#include "coordinator/schedule/simulator.h"

namespace baton::schedule {

// Makespan, overall bubble, then one line per rank.
std::string FormatSimulationText(const Schedule& schedule, const SimulationResult& result);

// Exactly {"makespan", "bubble_ratio", "stages": [{"rank", "busy",
// "bubble_ratio", "peak_activations"}]}.
std::string FormatSimulationJson(const SimulationResult& result);

// Trace Event Format; one cost unit is drawn as one millisecond. Compute
// actions and communication batches that take time become complete events.
std::string FormatChromeTrace(const Schedule& schedule, const SimulationResult& result);

}  // namespace baton::schedule

#endif  // BATON_COORDINATOR_SCHEDULE_REPORT_H_
