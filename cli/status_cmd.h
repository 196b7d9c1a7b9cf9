// `batonctl status`: the coordinator's view of its workers, as a table or JSON.
#ifndef BATON_CLI_STATUS_CMD_H_
#define BATON_CLI_STATUS_CMD_H_

#include <ostream>
#include <string>
#include <vector>

#include "baton/v1/coordinator.pb.h"

namespace baton::cli {

// `batonctl status --json`'s document for the coordinator at `target`: every
// field the text output shows, and per worker its device facts as registered
// (device, device_uuid, fused_attention_bf16, memory_bytes).
std::string StatusJson(const std::string& target, const v1::GetStatusResponse& status);

// The per-stage table of `batonctl status` (header and one line per stage);
// an MoE job's has a MOE DROP column (StageStatus.moe_dropped_ratio).
std::string StagesTable(const v1::GetStatusResponse& status);

// `args` are the words after "batonctl" other than the subcommand itself.
// Flags: --coordinator=HOST:PORT (required), --json, --timeout_ms (default 5000).
// Returns 0, 1 when the coordinator cannot be reached in time, 2 for bad flags.
int RunStatusCommand(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

}  // namespace baton::cli

#endif  // BATON_CLI_STATUS_CMD_H_
