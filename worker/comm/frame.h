// Frames: byte strings of any length over a Communicator, whose Send and
// Recv must agree on sizes. A frame is its length (one int64, tag `tag`)
// and then its bytes (tag `tag + 1`, left out when empty), so a frame
// stream uses two tags. Report groups (docs/protocol.md) pass RunStep and
// StepReport messages this way over a pipeline column.
//
// A frame that does not complete within `timeout`, or whose length is over
// the receiver's bound, aborts the communicator: its pending ops hold the
// callers' buffers, which cannot outlive the call otherwise.
#ifndef BATON_WORKER_COMM_FRAME_H_
#define BATON_WORKER_COMM_FRAME_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/comm/communicator.h"

namespace baton::comm {

// Sends `bytes` to `peer`; `what` names the frame in errors.
absl::Status SendFrame(Communicator& comm, int peer, uint64_t tag, const std::string& bytes, absl::Duration timeout,
                       const std::string& what);

// Receives one frame from `peer`, at most `max_bytes` long. With an
// infinite `timeout` it waits until the frame comes or the communicator is
// aborted.
absl::StatusOr<std::string> RecvFrame(Communicator& comm, int peer, uint64_t tag, size_t max_bytes,
                                      absl::Duration timeout, const std::string& what);

}  // namespace baton::comm

#endif  // BATON_WORKER_COMM_FRAME_H_
