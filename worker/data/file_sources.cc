#include "worker/data/file_sources.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "worker/data/epoch_shuffle.h"

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

namespace {

// The open-time check: a shard larger than its share of
// TokensFileOptions::open_check_ids is read in up to kOpenCheckBlocks blocks
// of at least kOpenCheckBlockIds (one block when the share is smaller),
// spread from its first id to its last: with thousands of shards each is one
// read more than its header, not sixteen.
constexpr int64_t kOpenCheckBlocks = 16;
constexpr int64_t kOpenCheckBlockIds = 4096;

std::string BadIdMessage(const std::string& field, const TokenShard& shard, int64_t index, int64_t vocab,
                         const std::string& context = "") {
  const int64_t id = shard.TokenAt(index);
  return absl::StrCat(field, ": \"", shard.path(), "\": token id ", id, " at byte offset ", shard.ByteOffset(index),
                      id < 0 ? " is negative" : absl::StrCat(" is not below model.vocab = ", vocab), context,
                      "; raise model.vocab or re-tokenize");
}

// Checks ids [begin, begin + n) of `shard`; returns how many it read.
absl::StatusOr<int64_t> CheckIds(const std::string& field, const TokenShard& shard, int64_t begin, int64_t n,
                                 int64_t vocab, std::vector<int32_t>* scratch) {
  constexpr int64_t kChunk = 1 << 16;
  scratch->resize(static_cast<size_t>(std::min(n, kChunk)));
  for (int64_t done = 0; done < n; done += kChunk) {
    const int64_t count = std::min(kChunk, n - done);
    const int64_t bad = shard.CopyTokens(begin + done, count, vocab, scratch->data());
    if (bad >= 0) return absl::InvalidArgumentError(BadIdMessage(field, shard, bad, vocab));
    shard.Release(begin + done, count);
  }
  return n;
}

absl::Status CheckPositive(const char* field, int64_t value) {
  if (value > 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, " = ", value, ": must be positive"));
}

}  // namespace

TokensFileSource::TokensFileSource(std::vector<TokenShard> shards, std::vector<int64_t> first_window,
                                   const TokensFileOptions& options)
    : shards_(std::move(shards)),
      first_window_(std::move(first_window)),
      seed_(options.seed),
      vocab_(options.vocab),
      seq_(options.seq_len),
      batch_(options.micro_batch_size),
      microbatches_(options.microbatches),
      dp_(options.dp),
      windows_(first_window_.back()),
      rows_per_step_(int64_t{options.microbatches} * options.dp * options.micro_batch_size),
      field_(options.field) {
  for (const TokenShard& shard : shards_) num_tokens_ += shard.num_tokens();
}

absl::StatusOr<std::unique_ptr<TokensFileSource>> TokensFileSource::Create(std::vector<TokenShard> shards,
                                                                           const TokensFileOptions& options) {
  if (absl::Status s = CheckShape(options.seq_len, options.micro_batch_size); !s.ok()) return s;
  if (absl::Status s = CheckPositive("schedule.microbatches", options.microbatches); !s.ok()) return s;
  if (absl::Status s = CheckPositive("parallel.dp", options.dp); !s.ok()) return s;
  if (absl::Status s = CheckPositive("model.vocab", options.vocab); !s.ok()) return s;
  // Each factor is below 2^31, so the product of two fits; bound the third.
  const int64_t replicas_rows = int64_t{options.microbatches} * options.dp;
  if (options.micro_batch_size > (int64_t{1} << 62) / replicas_rows) {
    return absl::InvalidArgumentError(absl::StrCat(
        "train.micro_batch_size x schedule.microbatches x parallel.dp is too large for ", options.field));
  }
  if (shards.empty()) return absl::InvalidArgumentError(absl::StrCat(options.field, ": names no shard"));
  std::vector<int64_t> first_window = {0};
  first_window.reserve(shards.size() + 1);
  for (const TokenShard& shard : shards) {
    if (shard.num_tokens() < options.seq_len + 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          options.field, ": \"", shard.path(), "\": holds ", shard.num_tokens(),
          " token ids, fewer than model.seq_len + 1 = ", options.seq_len + 1,
          " (one window); use a longer file, drop this shard from the set, or a shorter model.seq_len"));
    }
    first_window.push_back(first_window.back() + (shard.num_tokens() - 1) / options.seq_len);
  }
  std::unique_ptr<TokensFileSource> source(
      new TokensFileSource(std::move(shards), std::move(first_window), options));

  // The sampled vocabulary check (see the header): every shard gets an equal
  // share of open_check_ids, at least one id.
  const int64_t share = std::max<int64_t>(1, options.open_check_ids / static_cast<int64_t>(source->shards_.size()));
  const int64_t blocks = std::clamp<int64_t>(share / kOpenCheckBlockIds, 1, kOpenCheckBlocks);
  const int64_t block = share / blocks;
  std::vector<int32_t> scratch;
  for (const TokenShard& shard : source->shards_) {
    const int64_t n = shard.num_tokens();
    if (n <= share) {
      absl::StatusOr<int64_t> read = CheckIds(options.field, shard, 0, n, options.vocab, &scratch);
      if (!read.ok()) return read.status();
      source->checked_at_open_ += *read;
      continue;
    }
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t begin = blocks == 1 ? 0 : b * (n - block) / (blocks - 1);
      absl::StatusOr<int64_t> read = CheckIds(options.field, shard, begin, block, options.vocab, &scratch);
      if (!read.ok()) return read.status();
      source->checked_at_open_ += *read;
    }
  }
  return source;
}

absl::StatusOr<std::unique_ptr<TokensFileSource>> TokensFileSource::Create(const std::string& path, uint64_t seed,
                                                                           int vocab, int64_t seq_len,
                                                                           int64_t micro_batch_size) {
  if (absl::Status s = CheckShape(seq_len, micro_batch_size); !s.ok()) return s;
  absl::StatusOr<TokenShard> shard = TokenShard::Open(path, TokenFormat::kRawUint16, "data.tokens_file");
  if (!shard.ok()) return shard.status();
  std::vector<TokenShard> shards;
  shards.push_back(*std::move(shard));
  TokensFileOptions options;
  options.seed = seed;
  options.vocab = vocab;
  options.seq_len = seq_len;
  options.micro_batch_size = micro_batch_size;
  return Create(std::move(shards), options);
}

absl::StatusOr<TokensFileSource::Location> TokensFileSource::Locate(int64_t step, int mb, int dp_rank,
                                                                    int64_t row) const {
  if (step < 0 || mb < 0 || dp_rank < 0 || row < 0 || row >= batch_) {
    return absl::InvalidArgumentError(absl::StrCat("data: step ", step, ", microbatch ", mb, ", dp rank ", dp_rank,
                                                   ", row ", row, ": none may be negative, row below ", batch_));
  }
  const int64_t global_mb = int64_t{dp_rank} * microbatches_ + mb;
  if (global_mb >= int64_t{microbatches_} * dp_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data: microbatch ", mb, " of dp rank ", dp_rank, " is global microbatch ", global_mb,
        ", past the step's schedule.microbatches x parallel.dp = ", int64_t{microbatches_} * dp_));
  }
  if (step > std::numeric_limits<int64_t>::max() / rows_per_step_ - 1) {
    return absl::InvalidArgumentError(absl::StrCat("data: step ", step, " is past the samples ", field_,
                                                   " can count (", rows_per_step_, " rows per step)"));
  }
  const int64_t n = step * rows_per_step_ + global_mb * batch_ + row;
  Location at;
  at.epoch = n / windows_;
  at.window = static_cast<int64_t>(EpochShuffle(seed_, static_cast<uint64_t>(at.epoch), static_cast<uint64_t>(windows_))
                                       .At(static_cast<uint64_t>(n % windows_)));
  at.shard = std::upper_bound(first_window_.begin(), first_window_.end(), at.window) - first_window_.begin() - 1;
  at.first_token = (at.window - first_window_[at.shard]) * seq_;
  return at;
}

int64_t TokensFileSource::EpochOfStep(int64_t step) const {
  if (step < 0 || step > std::numeric_limits<int64_t>::max() / rows_per_step_) return -1;
  return step * rows_per_step_ / windows_;
}

absl::Status TokensFileSource::Fill(int64_t step, int mb, int dp_rank, MicrobatchData* out) const {
  if (absl::Status s = PrepareMicrobatch(step, mb, dp_rank, batch_, seq_, out); !s.ok()) return s;
  for (int64_t row = 0; row < batch_; ++row) {
    absl::StatusOr<Location> at = Locate(step, mb, dp_rank, row);
    if (!at.ok()) return at.status();
    const TokenShard& shard = shards_[at->shard];
    int32_t* tokens = out->tokens.i32() + row * seq_;
    int32_t* targets = out->targets.i32() + row * seq_;
    int64_t bad = shard.CopyTokens(at->first_token, seq_, vocab_, tokens);
    int32_t last = 0;
    if (bad < 0) bad = shard.CopyTokens(at->first_token + seq_, 1, vocab_, &last);
    if (bad >= 0) {
      return absl::InvalidArgumentError(BadIdMessage(
          field_, shard, bad, vocab_,
          absl::StrCat(" (read by step ", step, ", microbatch ", mb, ", dp rank ", dp_rank, ", epoch ", at->epoch,
                       ": the check at open samples ids, every id a step reads is checked)")));
    }
    shard.Release(at->first_token, seq_ + 1);
    std::copy(tokens + 1, tokens + seq_, targets);
    targets[seq_ - 1] = last;
  }
  return absl::OkStatus();
}

}  // namespace baton::data
