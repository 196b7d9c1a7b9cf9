// Data sources that train on a file: TextFileSource (byte-level tokens of any
// file, `data { text_file: PATH }`) and TokensFileSource (pre-tokenized
// little-endian uint16 ids, `data { tokens_file: PATH }`).
//
// The whole file is read into memory at Create. Each row of a microbatch is a
// window of seq_len + 1 consecutive tokens starting at a position drawn from
// SampleRng({seed, step, mb, dp_rank, row}): tokens are the first seq_len,
// targets the next token of each (all scored). Windows may overlap and
// repeat; every start position is equally likely.
#ifndef BATON_WORKER_DATA_FILE_SOURCES_H_
#define BATON_WORKER_DATA_FILE_SOURCES_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/data/data_source.h"

namespace baton::data {

// Random windows of a token sequence held in memory.
class TokenWindowSource : public DataSource {
 public:
  absl::Status Fill(int64_t step, int mb, int dp_rank, MicrobatchData* out) const override;
  int64_t micro_batch_size() const override { return batch_; }
  int64_t seq_len() const override { return seq_; }
  int64_t num_tokens() const { return static_cast<int64_t>(ids_.size()); }

 protected:
  TokenWindowSource(std::vector<uint16_t> ids, uint64_t seed, int64_t seq_len,
                    int64_t micro_batch_size);

 private:
  std::vector<uint16_t> ids_;
  uint64_t seed_;
  int64_t seq_, batch_;
};

// Byte-level: token id = byte value, so model.vocab must be at least 256.
class TextFileSource : public TokenWindowSource {
 public:
  // Errors name the JobSpec field: model.vocab below 256, data.text_file
  // unreadable or shorter than model.seq_len + 1 bytes,
  // train.micro_batch_size or model.seq_len not positive.
  static absl::StatusOr<std::unique_ptr<TextFileSource>> Create(const std::string& path,
                                                                uint64_t seed, int vocab,
                                                                int64_t seq_len,
                                                                int64_t micro_batch_size);

 private:
  using TokenWindowSource::TokenWindowSource;
};

// Little-endian uint16 token ids, each below model.vocab.
class TokensFileSource : public TokenWindowSource {
 public:
  // Errors name the JobSpec field: data.tokens_file unreadable, of odd size,
  // shorter than model.seq_len + 1 ids, or holding an id ≥ model.vocab (the
  // message gives the byte offset of the first); train.micro_batch_size or
  // model.seq_len not positive.
  static absl::StatusOr<std::unique_ptr<TokensFileSource>> Create(const std::string& path,
                                                                  uint64_t seed, int vocab,
                                                                  int64_t seq_len,
                                                                  int64_t micro_batch_size);

 private:
  using TokenWindowSource::TokenWindowSource;
};

}  // namespace baton::data

#endif  // BATON_WORKER_DATA_FILE_SOURCES_H_
