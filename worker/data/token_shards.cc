#include "worker/data/token_shards.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace baton::data {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "token files are little-endian and are read in place: port CopyTokens before building for this host");

constexpr char kMegatronMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr int64_t kMegatronHeaderBytes = 9 + 8 + 1 + 8 + 8;  // magic, version, dtype, sequences, documents
constexpr int64_t kLlmcHeaderBytes = int64_t{kLlmcHeaderInts} * 4;

template <typename T>
T Load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <typename T>
int64_t CopyAs(const uint8_t* p, int64_t begin, int64_t n, int64_t vocab, int32_t* out) {
  const uint8_t* first = p + begin * static_cast<int64_t>(sizeof(T));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = static_cast<int64_t>(Load<T>(first + i * static_cast<int64_t>(sizeof(T))));
    if (id < 0 || id >= vocab) return begin + i;
    out[i] = static_cast<int32_t>(id);
  }
  return -1;
}

std::string At(const std::string& field, const std::string& path) { return absl::StrCat(field, ": \"", path, "\""); }

// The width and signedness of a Megatron dtype code (DType in
// megatron/core/datasets/indexed_dataset.py); false for float codes and
// unknown ones.
bool MegatronDType(uint8_t code, int* width, bool* is_signed) {
  switch (code) {
    case 1: *width = 1; *is_signed = false; return true;  // uint8
    case 2: *width = 1; *is_signed = true; return true;   // int8
    case 3: *width = 2; *is_signed = true; return true;   // int16
    case 4: *width = 4; *is_signed = true; return true;   // int32
    case 5: *width = 8; *is_signed = true; return true;   // int64
    case 8: *width = 2; *is_signed = false; return true;  // uint16
    default: return false;                                // 6 float64, 7 float32, others unknown
  }
}

// A raw file that is really an llm.c shard or a Megatron index would train
// on its header words: say which format it is instead.
absl::Status CheckNotAHeaderFormat(const MappedFile& file, const std::string& field, TokenFormat format) {
  const int64_t size = file.size();
  if (size >= kMegatronHeaderBytes && std::memcmp(file.data(), kMegatronMagic, sizeof(kMegatronMagic)) == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        At(field, file.path()), " is a Megatron index (.idx), not ", TokenFormatName(format),
        " ids: set data.token_format: \"megatron\" and give the prefix without .idx/.bin"));
  }
  if (size >= kLlmcHeaderBytes) {
    const int32_t magic = Load<int32_t>(file.data());
    const int32_t count = Load<int32_t>(file.data() + 8);
    const bool llmc = (magic == kLlmcMagicGpt2 && size == kLlmcHeaderBytes + int64_t{count} * 2) ||
                      (magic == kLlmcMagicLlama3 && size == kLlmcHeaderBytes + int64_t{count} * 4);
    if (llmc) {
      return absl::InvalidArgumentError(absl::StrCat(At(field, file.path()), " starts with llm.c's header (magic ",
                                                     magic, ", ", count, " tokens), not ", TokenFormatName(format),
                                                     " ids: set data.token_format: \"llmc\""));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<TokenShard> TokenShard::Open(const std::string& path, TokenFormat format, const std::string& field) {
  TokenShard shard;
  if (format == TokenFormat::kRawUint16 || format == TokenFormat::kRawUint32) {
    absl::StatusOr<MappedFile> file = MappedFile::Open(path, field, kMaxShardBytes);
    if (!file.ok()) return file.status();
    if (absl::Status s = CheckNotAHeaderFormat(*file, field, format); !s.ok()) return s;
    shard.width_ = format == TokenFormat::kRawUint16 ? 2 : 4;
    if (file->size() % shard.width_ != 0) {
      return absl::InvalidArgumentError(absl::StrCat(At(field, path), ": ", file->size(),
                                                     " bytes is not a whole number of ",
                                                     format == TokenFormat::kRawUint16 ? "uint16" : "uint32",
                                                     " token ids: truncated, or another data.token_format"));
    }
    shard.num_tokens_ = file->size() / shard.width_;
    shard.file_ = *std::move(file);
    return shard;
  }

  if (format == TokenFormat::kLlmc) {
    absl::StatusOr<MappedFile> file = MappedFile::Open(path, field, kMaxShardBytes);
    if (!file.ok()) return file.status();
    if (file->size() < kLlmcHeaderBytes) {
      return absl::InvalidArgumentError(absl::StrCat(At(field, path), " holds ", file->size(),
                                                     " bytes, less than llm.c's ", kLlmcHeaderBytes,
                                                     "-byte header: truncated, or not an llm.c shard"));
    }
    const int32_t magic = Load<int32_t>(file->data());
    const int32_t version = Load<int32_t>(file->data() + 4);
    const int32_t count = Load<int32_t>(file->data() + 8);
    if (magic == kLlmcMagicGpt2) {
      if (version != 1) {
        return absl::InvalidArgumentError(absl::StrCat(At(field, path), ": llm.c GPT-2 shard of unknown version ",
                                                       version, " (baton reads version 1, uint16 ids)"));
      }
      shard.width_ = 2;
    } else if (magic == kLlmcMagicLlama3) {
      if (version != 7) {
        return absl::InvalidArgumentError(absl::StrCat(At(field, path), ": llm.c llama-3 shard of unknown version ",
                                                       version, " (baton reads version 7, uint32 ids)"));
      }
      shard.width_ = 4;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          At(field, path), ": wrong magic ", magic, " for an llm.c shard (want ", kLlmcMagicGpt2, " for GPT-2 or ",
          kLlmcMagicLlama3, " for llama-3); for a file of bare ids set data.token_format: \"raw_uint16\" or "
          "\"raw_uint32\""));
    }
    if (count < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(At(field, path), ": llm.c header says ", count, " tokens; re-run the data preparation"));
    }
    const int64_t want = kLlmcHeaderBytes + int64_t{count} * shard.width_;
    if (file->size() != want) {
      return absl::InvalidArgumentError(absl::StrCat(
          At(field, path), " holds ", file->size(), " bytes; its llm.c header says ", count, " tokens = ", want,
          " bytes: ", file->size() < want ? "truncated (copy it again)" : "trailing bytes (rewrite it)"));
    }
    shard.header_bytes_ = kLlmcHeaderBytes;
    shard.num_tokens_ = count;
    shard.file_ = *std::move(file);
    return shard;
  }

  // Megatron: check the whole .idx, then map the .bin it describes.
  const std::string idx_path = path + ".idx", bin_path = path + ".bin";
  absl::StatusOr<MappedFile> idx = MappedFile::Open(idx_path, field, kMaxMegatronIndexBytes);
  if (!idx.ok()) {
    if (idx.status().code() != absl::StatusCode::kNotFound) return idx.status();
    return absl::NotFoundError(absl::StrCat(idx.status().message(),
                                            "; a Megatron data set is PREFIX.idx + PREFIX.bin and "
                                            "data.tokens_file names PREFIX"));
  }
  const uint8_t* p = idx->data();
  const int64_t size = idx->size();
  if (size < kMegatronHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(At(field, idx_path), " holds ", size, " bytes, less than the ",
                                                   kMegatronHeaderBytes,
                                                   "-byte MMIDIDX header: truncated, or not a Megatron index"));
  }
  if (std::memcmp(p, kMegatronMagic, sizeof(kMegatronMagic)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        At(field, idx_path), ": wrong magic (want \"MMIDIDX\\0\\0\"): not a Megatron indexed-dataset index"));
  }
  const uint64_t version = Load<uint64_t>(p + 9);
  if (version != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(At(field, idx_path), ": Megatron index of unknown version ", version, " (baton reads version 1)"));
  }
  const uint8_t code = p[17];
  if (!MegatronDType(code, &shard.width_, &shard.signed_)) {
    return absl::InvalidArgumentError(absl::StrCat(
        At(field, idx_path), ": dtype code ", int{code},
        " is not an integer token type (baton reads 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16)"));
  }
  const uint64_t sequences = Load<uint64_t>(p + 18);
  const uint64_t documents = Load<uint64_t>(p + 26);
  const uint64_t body = static_cast<uint64_t>(size - kMegatronHeaderBytes);
  // Bound each count by what the file could hold before multiplying.
  const bool fits = sequences <= body / 12 && documents <= body / 8 && 12 * sequences + 8 * documents == body;
  if (!fits) {
    return absl::InvalidArgumentError(absl::StrCat(
        At(field, idx_path), " holds ", size, " bytes, which does not match its header (", sequences,
        " sequences, ", documents, " document indices need ", kMegatronHeaderBytes,
        " + 12 x sequences + 8 x documents bytes): truncated, or a multimodal index (not read by baton)"));
  }
  const uint8_t* lengths = p + kMegatronHeaderBytes;
  const uint8_t* pointers = lengths + 4 * sequences;
  const uint8_t* doc_index = pointers + 8 * sequences;
  const int64_t max_tokens = kMaxShardBytes / shard.width_;
  int64_t tokens = 0;
  for (uint64_t i = 0; i < sequences; ++i) {
    const int32_t length = Load<int32_t>(lengths + 4 * i);
    const int64_t pointer = Load<int64_t>(pointers + 8 * i);
    if (length < 0 || pointer != tokens * shard.width_) {
      return absl::InvalidArgumentError(absl::StrCat(
          At(field, idx_path), ": sequence ", i, " has length ", length, " at byte ", pointer,
          "; baton reads a .bin whose sequences lie back to back from byte 0 (expected byte ", tokens * shard.width_,
          "): rebuild it with Megatron's tools/preprocess_data.py"));
    }
    tokens += length;
    if (tokens > max_tokens) {
      return absl::InvalidArgumentError(absl::StrCat(At(field, idx_path), ": its sequences hold more than ",
                                                     max_tokens, " tokens (", kMaxShardBytes,
                                                     " bytes): split the data set"));
    }
  }
  if (documents < 1 || Load<int64_t>(doc_index) != 0 ||
      Load<int64_t>(doc_index + 8 * (documents - 1)) != static_cast<int64_t>(sequences)) {
    return absl::InvalidArgumentError(absl::StrCat(
        At(field, idx_path), ": document indices must run from 0 to the sequence count ", sequences,
        ": a damaged index; rebuild it with Megatron's tools/preprocess_data.py"));
  }
  for (uint64_t d = 1; d < documents; ++d) {
    if (Load<int64_t>(doc_index + 8 * d) < Load<int64_t>(doc_index + 8 * (d - 1))) {
      return absl::InvalidArgumentError(absl::StrCat(At(field, idx_path), ": document index ", d,
                                                     " decreases: a damaged index; rebuild it"));
    }
  }
  absl::StatusOr<MappedFile> bin = MappedFile::Open(bin_path, field, kMaxShardBytes);
  if (!bin.ok()) {
    if (bin.status().code() != absl::StatusCode::kNotFound) return bin.status();
    return absl::NotFoundError(absl::StrCat(bin.status().message(), "; ", idx_path,
                                            " exists: copy its .bin beside it"));
  }
  if (bin->size() != tokens * shard.width_) {
    return absl::InvalidArgumentError(absl::StrCat(
        At(field, bin_path), " holds ", bin->size(), " bytes; ", idx_path, " says ", sequences, " sequences of ",
        tokens, " tokens = ", tokens * shard.width_, " bytes: ",
        bin->size() < tokens * shard.width_ ? "truncated (copy it again)" : "not the .bin of this index"));
  }
  shard.num_tokens_ = tokens;
  shard.file_ = *std::move(bin);
  return shard;
}

int64_t TokenShard::CopyTokens(int64_t begin, int64_t n, int64_t vocab, int32_t* out) const {
  const uint8_t* p = file_.data() + header_bytes_;
  switch (width_) {
    case 1: return signed_ ? CopyAs<int8_t>(p, begin, n, vocab, out) : CopyAs<uint8_t>(p, begin, n, vocab, out);
    case 2: return signed_ ? CopyAs<int16_t>(p, begin, n, vocab, out) : CopyAs<uint16_t>(p, begin, n, vocab, out);
    case 4: return signed_ ? CopyAs<int32_t>(p, begin, n, vocab, out) : CopyAs<uint32_t>(p, begin, n, vocab, out);
    default: return CopyAs<int64_t>(p, begin, n, vocab, out);
  }
}

int64_t TokenShard::TokenAt(int64_t i) const {
  const uint8_t* p = file_.data() + header_bytes_ + i * width_;
  switch (width_) {
    case 1: return signed_ ? int64_t{Load<int8_t>(p)} : int64_t{Load<uint8_t>(p)};
    case 2: return signed_ ? int64_t{Load<int16_t>(p)} : int64_t{Load<uint16_t>(p)};
    case 4: return signed_ ? int64_t{Load<int32_t>(p)} : int64_t{Load<uint32_t>(p)};
    default: return Load<int64_t>(p);
  }
}

}  // namespace baton::data
