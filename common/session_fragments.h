// Session fragments: how a Session message larger than gRPC's 4 MiB receive
// limit crosses the stream (docs/protocol.md, "Fragments"). gRPC's limit is
// left as it is (the coordinator's port takes unauthenticated Register calls
// too); instead a message whose serialized size is over kFragmentPayloadBytes
// is sent as ceil(size / kFragmentPayloadBytes) `v1::Fragment`s in a row, and
// the receiver joins them with a FragmentAssembler, checking every bound
// before it keeps a byte.
//
// Both binaries link this; the fragment payload is a protocol constant (a
// receiver checks every fragment's size against it).
#ifndef BATON_COMMON_SESSION_FRAGMENTS_H_
#define BATON_COMMON_SESSION_FRAGMENTS_H_

#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "baton/v1/coordinator.pb.h"

namespace baton {

// Payload of every fragment but the last; a message of at most this many
// bytes travels whole. 1 MiB under gRPC's 4 MiB default leaves room for the
// envelope.
inline constexpr size_t kFragmentPayloadBytes = size_t{3} << 20;

// The largest message a receiver joins by default: protobuf neither
// serializes nor parses a message of 2 GiB or more.
inline constexpr int64_t kMaxFragmentedMessageBytes = std::numeric_limits<int32_t>::max();

// Whether a message of `serialized_bytes` goes as fragments.
inline bool NeedsFragments(size_t serialized_bytes) { return serialized_bytes > kFragmentPayloadBytes; }

// Fragments a message of `total_bytes` takes: ceil(total / payload).
int64_t FragmentCount(int64_t total_bytes, size_t payload_bytes = kFragmentPayloadBytes);

// Fragment `index` (0-based, < FragmentCount) of `serialized`.
v1::Fragment FragmentOf(absl::string_view serialized, int32_t index, size_t payload_bytes = kFragmentPayloadBytes);

// All fragments of `serialized` (which NeedsFragments), in order.
std::vector<v1::Fragment> SplitIntoFragments(absl::string_view serialized,
                                             size_t payload_bytes = kFragmentPayloadBytes);

// Joins the fragments of one stream's messages, one message at a time.
// Every fragment is checked before its bytes are kept:
//   - total_bytes over the payload (else the message travels whole) and at
//     most `max_total_bytes`;
//   - count == ceil(total_bytes / payload), at most INT32_MAX;
//   - index 0 opens a message; then 1, 2, ... with the same count and
//     total_bytes (another message may not start in between);
//   - each fragment's data is exactly the payload, the last one the rest.
// Memory grows with the bytes received, never ahead of them. Any violation
// is an INVALID_ARGUMENT saying what was wrong; the stream is then to be
// ended (the assembler is Reset). Not thread-safe: one per stream reader.
class FragmentAssembler {
 public:
  explicit FragmentAssembler(int64_t max_total_bytes = kMaxFragmentedMessageBytes,
                             size_t payload_bytes = kFragmentPayloadBytes);

  // Takes the next fragment: the whole serialized message when it was the
  // last one, nullopt while more are due.
  absl::StatusOr<std::optional<std::string>> Add(v1::Fragment fragment);

  // A message is partly received.
  bool in_progress() const { return count_ > 0; }
  // Bytes received of the message in progress.
  int64_t buffered_bytes() const { return static_cast<int64_t>(buffer_.size()); }
  int64_t max_total_bytes() const { return max_total_bytes_; }

  // Drops a message in progress.
  void Reset();

 private:
  const int64_t max_total_bytes_;
  const size_t payload_bytes_;
  int32_t count_ = 0;  // of the message in progress; 0: none
  int32_t next_index_ = 0;
  int64_t total_bytes_ = 0;
  std::string buffer_;
};

}  // namespace baton

#endif  // BATON_COMMON_SESSION_FRAGMENTS_H_
