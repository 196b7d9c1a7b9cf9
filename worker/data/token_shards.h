// TokenShard: one file of pre-tokenized ids, memory-mapped and checked
// against its format's header before any step reads it (docs/data.md,
// "Token files"). The formats of `data.token_format`:
//
//   raw_uint16  little-endian uint16 ids, no header (the default)
//   raw_uint32  little-endian uint32 ids, no header
//   llmc        llm.c shards (dev/data/data_common.py): 256 little-endian
//               int32 header words, [0] magic, [1] version, [2] token count,
//               then the ids: magic 20240520 version 1 = uint16 ids (GPT-2),
//               magic 20240801 version 7 = uint32 ids (llama-3)
//   megatron    Megatron-LM indexed dataset (megatron/core/datasets/
//               indexed_dataset.py), PREFIX.idx + PREFIX.bin. The .idx:
//               "MMIDIDX\0\0", uint64 version 1, uint8 dtype code, uint64
//               sequence count S, uint64 document count D, int32 lengths[S],
//               int64 byte pointers[S], int64 document indices[D]; the .bin:
//               the sequences back to back. Integer dtype codes only
//               (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16).
//
// A shard is its ids as one stream in file order (for Megatron: sequences
// in .bin order, documents back to back as Megatron concatenates them).
// Open checks everything the header promises — magic, version, sizes that
// match the header or index exactly, a contiguous Megatron .bin — so a bad
// file fails the job at configure time with its path and what to change.
// The ids themselves are checked against the vocabulary by the reader
// (CopyTokens), not here.
//
// Move-only; immutable after Open, so reads are thread-safe.
#ifndef BATON_WORKER_DATA_TOKEN_SHARDS_H_
#define BATON_WORKER_DATA_TOKEN_SHARDS_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/token_format.h"
#include "worker/data/mapped_file.h"

namespace baton::data {

// data.token_format's names (common/token_format.h).
using ::baton::ParseTokenFormat;
using ::baton::TokenFormat;
using ::baton::TokenFormatName;

// Bounds on what one job maps (checked before mapping).
inline constexpr int64_t kMaxShardBytes = int64_t{1} << 40;  // 1 TiB per file
inline constexpr int64_t kMaxMegatronIndexBytes = int64_t{1} << 34;
inline constexpr int kLlmcHeaderInts = 256;
inline constexpr int32_t kLlmcMagicGpt2 = 20240520;   // version 1, uint16 ids
inline constexpr int32_t kLlmcMagicLlama3 = 20240801;  // version 7, uint32 ids

class TokenShard {
 public:
  // Maps and checks one shard. `path` is the file, or for kMegatron the
  // prefix of PREFIX.idx and PREFIX.bin. Errors start with `field` and the
  // file at fault: NOT_FOUND for a missing file (a Megatron .bin without its
  // .idx or the other way round), INVALID_ARGUMENT for a wrong magic, an
  // unknown version or dtype, a size that does not match the header or
  // index (truncated or padded), a size not a whole number of ids.
  static absl::StatusOr<TokenShard> Open(const std::string& path, TokenFormat format, const std::string& field);

  TokenShard(TokenShard&&) = default;
  TokenShard& operator=(TokenShard&&) = default;

  // The file holding the ids (PREFIX.bin for Megatron).
  const std::string& path() const { return file_.path(); }
  int64_t num_tokens() const { return num_tokens_; }
  int bytes_per_token() const { return width_; }
  // Byte offset of token i in path().
  int64_t ByteOffset(int64_t i) const { return header_bytes_ + i * width_; }

  // Copies ids [begin, begin + n) (within num_tokens()) to out as int32.
  // Returns -1 when every id is in [0, vocab), else the shard index of the
  // first that is not (nothing from it on is written).
  int64_t CopyTokens(int64_t begin, int64_t n, int64_t vocab, int32_t* out) const;
  // Id i as read from the file (for error messages).
  int64_t TokenAt(int64_t i) const;
  // Unmaps the pages of ids [begin, begin + n) from this process once they
  // are copied (MappedFile::Release): resident memory stays at the window
  // being read, not the pages an epoch has touched.
  void Release(int64_t begin, int64_t n) const { file_.Release(ByteOffset(begin), n * width_); }

 private:
  TokenShard() = default;

  MappedFile file_;
  int64_t header_bytes_ = 0;
  int64_t num_tokens_ = 0;
  int width_ = 2;  // bytes per id: 1, 2, 4 or 8
  bool signed_ = false;
};

}  // namespace baton::data

#endif  // BATON_WORKER_DATA_TOKEN_SHARDS_H_
