// `batonctl checkpoint import-hf HF_DIR --out=CKPT [--seq_len=N] [--force]`
// and `batonctl checkpoint export-hf CKPT --out=HF_DIR [--force]`: Hugging
// Face GPT-2 directories to and from baton checkpoints (cli/hf_checkpoint.h);
// exit 0 done, 2 bad input (the message names the file, tensor or field), 1
// a failure to write.
//
// `batonctl checkpoint diff DIR_A DIR_B [--json]`: loads two checkpoints of
// any layouts (gathered to full tensors, worker/checkpoint/checkpoint.h) and
// prints how far apart they are (worker/checkpoint/weights_diff.h):
// max_abs_diff = max |a − b| over all elements; max_rel_diff = the largest
// per-tensor ‖a − b‖₂ / ‖b‖₂, with DIR_B as the reference.
#ifndef BATON_CLI_CHECKPOINT_CMD_H_
#define BATON_CLI_CHECKPOINT_CMD_H_

#include <ostream>
#include <string>
#include <vector>

namespace baton::cli {

// Text: overall values, then one line per tensor. --json: exactly
// {"max_abs_diff": x, "max_rel_diff": y, "tensors": N} (a non-finite value,
// from NaN or infinity in the weights, is null).
// Returns 0 when both hold the same tensors (whatever the values), 1 when
// tensor names or shapes differ (the message says which), 2 for bad usage or
// a directory that is not a readable, consistent checkpoint.
int RunCheckpointCommand(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

}  // namespace baton::cli

#endif  // BATON_CLI_CHECKPOINT_CMD_H_
