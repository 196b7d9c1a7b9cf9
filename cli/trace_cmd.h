// `batonctl trace --coordinator=HOST:PORT --steps=N --out=trace.json`: fetches
// the coordinator's Chrome/Perfetto trace of the last N traced steps (all
// workers on the coordinator's clock) and writes it to a file that
// ui.perfetto.dev or chrome://tracing opens.
#ifndef BATON_CLI_TRACE_CMD_H_
#define BATON_CLI_TRACE_CMD_H_

#include <ostream>
#include <string>
#include <vector>

namespace baton::cli {

// Flags: --coordinator (required), --out (required), --steps (default 1),
// --timeout_ms (default 5000). Returns 0, 1 when the coordinator cannot be
// reached, refuses (the message says why) or the file cannot be written,
// 2 for bad flags.
int RunTraceCommand(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

}  // namespace baton::cli

#endif  // BATON_CLI_TRACE_CMD_H_
