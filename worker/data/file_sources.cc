#include "worker/data/file_sources.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace baton::data {
namespace {

// The bytes of `path`; errors name `field` (the JobSpec field holding it).
absl::StatusOr<std::string> ReadFile(const std::string& path, const char* field) {
  if (path.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(field, " is empty: give a file path"));
  }
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    return absl::NotFoundError(
        absl::StrCat(field, " = \"", path, "\": cannot open: ", std::strerror(errno)));
  }
  std::string bytes;
  char buffer[1 << 16];
  size_t n = 0;
  while ((n = std::fread(buffer, 1, sizeof(buffer), f)) > 0) bytes.append(buffer, n);
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  if (failed) {
    return absl::DataLossError(absl::StrCat(field, " = \"", path, "\": read error"));
  }
  return bytes;
}

absl::Status CheckShape(int64_t seq_len, int64_t micro_batch_size) {
  if (seq_len <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.seq_len = ", seq_len, ": must be positive"));
  }
  if (micro_batch_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("train.micro_batch_size = ", micro_batch_size, ": must be positive"));
  }
  return absl::OkStatus();
}

absl::Status CheckLength(const char* field, const std::string& path, int64_t tokens,
                         const char* unit, int64_t seq_len) {
  if (tokens >= seq_len + 1) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      field, " = \"", path, "\": holds ", tokens, " ", unit, ", fewer than model.seq_len + 1 = ",
      seq_len + 1, "; use a longer file or a shorter model.seq_len"));
}

}  // namespace

TokenWindowSource::TokenWindowSource(std::vector<uint16_t> ids, uint64_t seed, int64_t seq_len,
                                     int64_t micro_batch_size)
    : ids_(std::move(ids)), seed_(seed), seq_(seq_len), batch_(micro_batch_size) {}

absl::Status TokenWindowSource::Fill(int64_t step, int mb, int dp_rank,
                                     MicrobatchData* out) const {
  if (absl::Status s = PrepareMicrobatch(step, mb, dp_rank, batch_, seq_, out); !s.ok()) return s;
  const uint64_t starts = ids_.size() - static_cast<uint64_t>(seq_);  // windows of seq_ + 1
  for (int64_t row = 0; row < batch_; ++row) {
    SampleRng rng({seed_, static_cast<uint64_t>(step), static_cast<uint64_t>(mb),
                   static_cast<uint64_t>(dp_rank), static_cast<uint64_t>(row)});
    const uint16_t* window = ids_.data() + rng.Below(starts);
    int32_t* tokens = out->tokens.i32() + row * seq_;
    int32_t* targets = out->targets.i32() + row * seq_;
    for (int64_t i = 0; i < seq_; ++i) {
      tokens[i] = window[i];
      targets[i] = window[i + 1];
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<TextFileSource>> TextFileSource::Create(const std::string& path,
                                                                       uint64_t seed, int vocab,
                                                                       int64_t seq_len,
                                                                       int64_t micro_batch_size) {
  if (vocab < 256) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model.vocab = ", vocab, ": data.text_file trains on bytes and needs at least 256"));
  }
  if (absl::Status s = CheckShape(seq_len, micro_batch_size); !s.ok()) return s;
  absl::StatusOr<std::string> bytes = ReadFile(path, "data.text_file");
  if (!bytes.ok()) return bytes.status();
  const int64_t size = static_cast<int64_t>(bytes->size());
  if (absl::Status s = CheckLength("data.text_file", path, size, "bytes", seq_len); !s.ok()) {
    return s;
  }
  std::vector<uint16_t> ids(bytes->size());
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<unsigned char>((*bytes)[i]);
  return std::unique_ptr<TextFileSource>(
      new TextFileSource(std::move(ids), seed, seq_len, micro_batch_size));
}

absl::StatusOr<std::unique_ptr<TokensFileSource>> TokensFileSource::Create(
    const std::string& path, uint64_t seed, int vocab, int64_t seq_len, int64_t micro_batch_size) {
  if (absl::Status s = CheckShape(seq_len, micro_batch_size); !s.ok()) return s;
  absl::StatusOr<std::string> bytes = ReadFile(path, "data.tokens_file");
  if (!bytes.ok()) return bytes.status();
  if (bytes->size() % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("data.tokens_file = \"", path, "\": ", bytes->size(),
                     " bytes is not a whole number of uint16 token ids"));
  }
  const int64_t count = static_cast<int64_t>(bytes->size() / 2);
  if (absl::Status s = CheckLength("data.tokens_file", path, count, "token ids", seq_len);
      !s.ok()) {
    return s;
  }
  std::vector<uint16_t> ids(count);
  for (int64_t i = 0; i < count; ++i) {
    const auto lo = static_cast<unsigned char>((*bytes)[2 * i]);
    const auto hi = static_cast<unsigned char>((*bytes)[2 * i + 1]);
    ids[i] = static_cast<uint16_t>(lo | (hi << 8));
    if (ids[i] >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat(
          "data.tokens_file = \"", path, "\": token id ", ids[i], " at byte offset ", 2 * i,
          " is not below model.vocab = ", vocab, "; raise model.vocab or re-tokenize"));
    }
  }
  return std::unique_ptr<TokensFileSource>(
      new TokensFileSource(std::move(ids), seed, seq_len, micro_batch_size));
}

}  // namespace baton::data
