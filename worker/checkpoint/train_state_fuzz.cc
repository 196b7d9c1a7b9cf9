// Fuzzes DecodeChunkState (worker/checkpoint/train_state.h), which reads
// state bytes that come over the network from a buddy worker or the
// coordinator. Any bytes must decode or give INVALID_ARGUMENT: no crash, no
// allocation beyond what the input holds. What decodes must re-encode to the
// same bytes. Because the checksum stops almost every mutation, each input
// is decoded a second time with its trailing CRC-32 recomputed, so the
// checks behind it are reached too.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "common/crc32.h"
#include "worker/checkpoint/train_state.h"

namespace {

void DecodeAndCheck(const std::string& bytes) {
  absl::StatusOr<baton::ChunkState> s = baton::DecodeChunkState(bytes);
  if (!s.ok()) {
    if (s.status().code() != absl::StatusCode::kInvalidArgument || s.status().message().empty()) {
      std::fprintf(stderr, "DecodeChunkState: unexpected status %s\n", s.status().ToString().c_str());
      abort();
    }
    return;
  }
  if (baton::EncodeChunkState(*s) != bytes) {
    std::fprintf(stderr, "DecodeChunkState accepted %zu bytes that do not re-encode to themselves\n", bytes.size());
    abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string bytes(reinterpret_cast<const char*>(data), size);
  DecodeAndCheck(bytes);
  if (bytes.size() >= 4) {
    const uint32_t crc = baton::Crc32(absl::string_view(bytes).substr(0, bytes.size() - 4));
    for (int i = 0; i < 4; ++i) bytes[bytes.size() - 4 + i] = static_cast<char>((crc >> (8 * i)) & 0xff);
    DecodeAndCheck(bytes);
  }
  return 0;
}
