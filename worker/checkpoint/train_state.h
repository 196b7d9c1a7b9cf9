// A ChunkState (worker/stage_model.h) as bytes: for host-memory snapshots
// sent to a buddy worker, state transfers during recovery, and anything else
// that must move one chunk's complete training state in one piece.
//
// Format (little-endian, version 1):
//   offset  0  8 bytes  magic "BATONCS1"
//           8  u32      version (1)
//          12  u32      flags (0)
//          16  i64      optimizer_step (>= 0)
//          24  u64      number of values
//          32  u64      number of adam_m
//          40  u64      number of adam_v
//          48  f32 × (values + adam_m + adam_v), in that order
//        end-4 u32      CRC-32 (zlib) of every byte before it
// The bytes describe themselves completely: DecodeChunkState needs nothing
// but them. It checks the length against the counts (before allocating
// anything) and the checksum, and turns every malformed input — truncated,
// padded, bit-flipped, another format — into an INVALID_ARGUMENT that says
// what is wrong; it never crashes and never allocates more than the input
// implies.
#ifndef BATON_WORKER_CHECKPOINT_TRAIN_STATE_H_
#define BATON_WORKER_CHECKPOINT_TRAIN_STATE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/crc32.h"
#include "worker/stage_model.h"

namespace baton {

inline constexpr size_t kChunkStateHeaderBytes = 48;

std::string EncodeChunkState(const ChunkState& s);
absl::StatusOr<ChunkState> DecodeChunkState(absl::string_view bytes);

}  // namespace baton

#endif  // BATON_WORKER_CHECKPOINT_TRAIN_STATE_H_
