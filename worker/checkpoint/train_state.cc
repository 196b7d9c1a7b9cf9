#include "worker/checkpoint/train_state.h"

#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"

namespace baton {
namespace {

constexpr char kMagic[8] = {'B', 'A', 'T', 'O', 'N', 'C', 'S', '1'};
constexpr uint32_t kVersion = 1;
constexpr size_t kTrailerBytes = 4;

void PutU32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void PutU64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint32_t GetU32(const char* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

uint64_t GetU64(const char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

void PutFloats(std::string& out, const std::vector<float>& v) {
  // Little-endian host (as common/safetensors.h assumes).
  out.append(reinterpret_cast<const char*>(v.data()), sizeof(float) * v.size());
}

absl::Status Bad(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("chunk state: ", what));
}

}  // namespace

std::string EncodeChunkState(const ChunkState& s) {
  std::string out;
  out.reserve(kChunkStateHeaderBytes +
              sizeof(float) * (s.values.size() + s.adam_m.size() + s.adam_v.size()) +
              kTrailerBytes);
  out.append(kMagic, sizeof(kMagic));
  PutU32(out, kVersion);
  PutU32(out, 0);
  PutU64(out, static_cast<uint64_t>(s.optimizer_step));
  PutU64(out, s.values.size());
  PutU64(out, s.adam_m.size());
  PutU64(out, s.adam_v.size());
  PutFloats(out, s.values);
  PutFloats(out, s.adam_m);
  PutFloats(out, s.adam_v);
  PutU32(out, Crc32(out));
  return out;
}

absl::StatusOr<ChunkState> DecodeChunkState(absl::string_view bytes) {
  if (bytes.size() < kChunkStateHeaderBytes + kTrailerBytes) {
    return Bad(absl::StrCat(bytes.size(), " bytes is shorter than the ",
                            kChunkStateHeaderBytes + kTrailerBytes,
                            "-byte header and checksum; the data is truncated or not a chunk "
                            "state"));
  }
  const char* p = bytes.data();
  if (std::memcmp(p, kMagic, sizeof(kMagic)) != 0) {
    return Bad("does not start with \"BATONCS1\"; not a baton chunk state");
  }
  const uint32_t version = GetU32(p + 8);
  if (version != kVersion) {
    return Bad(absl::StrCat("format version ", version, " is not supported (this build reads ",
                            kVersion, ")"));
  }
  const uint32_t flags = GetU32(p + 12);
  const uint64_t step = GetU64(p + 16);
  const uint64_t counts[3] = {GetU64(p + 24), GetU64(p + 32), GetU64(p + 40)};
  // Every count is bounded by the payload before they are added or multiplied.
  const uint64_t payload = bytes.size() - kChunkStateHeaderBytes - kTrailerBytes;
  uint64_t floats = 0;
  for (uint64_t c : counts) {
    if (c > payload / sizeof(float) || floats + c > payload / sizeof(float)) {
      return Bad(absl::StrCat("header counts ", counts[0], " + ", counts[1], " + ", counts[2],
                              " floats, more than the ", payload,
                              " payload bytes hold; the data is truncated or corrupted"));
    }
    floats += c;
  }
  if (floats * sizeof(float) != payload) {
    return Bad(absl::StrCat("header counts ", floats, " floats (", floats * sizeof(float),
                            " bytes) but the payload has ", payload,
                            " bytes; the data is truncated, padded or corrupted"));
  }
  const uint32_t want = GetU32(p + bytes.size() - kTrailerBytes);
  const uint32_t have = Crc32(bytes.substr(0, bytes.size() - kTrailerBytes));
  if (want != have) {
    return Bad(absl::StrCat("checksum mismatch (stored ", want, ", computed ", have,
                            "); the data is corrupted"));
  }
  if (flags != 0) return Bad(absl::StrCat("unknown flags ", flags));
  if (step > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return Bad("optimizer_step is negative");
  }
  ChunkState s;
  s.optimizer_step = static_cast<int64_t>(step);
  const char* data = p + kChunkStateHeaderBytes;
  std::vector<float>* parts[3] = {&s.values, &s.adam_m, &s.adam_v};
  for (int i = 0; i < 3; ++i) {
    parts[i]->resize(counts[i]);
    if (counts[i] > 0) std::memcpy(parts[i]->data(), data, sizeof(float) * counts[i]);
    data += sizeof(float) * counts[i];
  }
  return s;
}

}  // namespace baton
