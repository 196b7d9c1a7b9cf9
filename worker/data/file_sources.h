// Data sources that train on files: TextFileSource (byte-level tokens of any
// file, `data { text_file: PATH }`) and TokensFileSource (pre-tokenized ids,
// `data { tokens_file: PATH token_format: ... }`, docs/data.md).
//
// TextFileSource reads its whole file into memory at Create. Each row of a
// microbatch is a window of seq_len + 1 consecutive bytes starting at a
// position drawn from SampleRng({seed, step, mb, dp_rank, row}): tokens are
// the first seq_len, targets the next token of each (all scored). Windows may
// overlap and repeat; every start position is equally likely.
//
// TokensFileSource maps its shards (token_shards.h) and reads them in epochs.
// Each shard is cut into windows of seq_len + 1 ids at a stride of seq_len
// (a window's last id is the next window's first, as llm.c and Megatron cut
// samples); windows never straddle two shards, and a shard's last
// (num_tokens - 1) % seq_len ids are read by no window. The windows of all
// shards are one list of W. Row `row` of microbatch `mb` of replica
// `dp_rank` at step `step` is sample
//   n = (step * microbatches * dp + dp_rank * microbatches + mb) * B + row
// (B = micro_batch_size, microbatches per replica and dp replicas from the
// job), which is window EpochShuffle(seed, n / W, W).At(n % W): every epoch
// visits each window exactly once, in an order that is a pure function of
// (seed, epoch). Nothing is stateful, so a replayed or resumed step reads
// the same rows, and a layout with the same global batch
// (microbatches * dp * B) reads the same samples.
//
// Token ids are checked against model.vocab twice: at Create on a sample of
// every shard (each gets an equal share of open_check_ids, 2^24 by default:
// all of a shard no larger than its share, else up to 16 blocks of at least
// 4096 ids spread from its first id to its last — a bounded read whatever
// the data set's size: 0.06 s warm, 0.4-1.8 s cold for a 4 GiB shard),
// and in Fill on every id it
// reads, which fails that step with the file, byte offset and step. Fill
// releases each window's pages from the process once copied
// (TokenShard::Release), so resident memory does not grow over an epoch.
#ifndef BATON_WORKER_DATA_FILE_SOURCES_H_
#define BATON_WORKER_DATA_FILE_SOURCES_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/data/data_source.h"
#include "worker/data/token_shards.h"

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

// How a TokensFileSource reads its shards, from the job.
struct TokensFileOptions {
  uint64_t seed = 0;            // train.seed
  int vocab = 0;                // model.vocab: every id read must be below it
  int64_t seq_len = 0;          // model.seq_len
  int64_t micro_batch_size = 0;  // train.micro_batch_size
  int microbatches = 1;         // schedule.microbatches (per replica and step)
  int dp = 1;                   // parallel.dp
  std::string field = "data.tokens_file";  // named in every error
  // Ids the check at Create reads in all, shared equally by the shards
  // (tests set it small to leave ids for Fill's check to find).
  int64_t open_check_ids = int64_t{1} << 24;
};

// Shuffled epochs of windows over memory-mapped token shards.
class TokensFileSource : public DataSource {
 public:
  // Errors name the JobSpec field: a shard with fewer than model.seq_len + 1
  // ids (a window), an id the open-time sample finds outside
  // [0, model.vocab) (with its file and byte offset), model.seq_len,
  // train.micro_batch_size, schedule.microbatches or parallel.dp not
  // positive, no shards.
  static absl::StatusOr<std::unique_ptr<TokensFileSource>> Create(std::vector<TokenShard> shards,
                                                                  const TokensFileOptions& options);
  // One raw uint16 file and one microbatch per step, dp = 1 (errors as
  // above, and those of TokenShard::Open).
  static absl::StatusOr<std::unique_ptr<TokensFileSource>> Create(const std::string& path, uint64_t seed, int vocab,
                                                                  int64_t seq_len, int64_t micro_batch_size);

  // Also INVALID_ARGUMENT for a global microbatch dp_rank * microbatches +
  // mb past the step's microbatches * dp, and for an id outside
  // [0, model.vocab) in a window it reads (naming the file and byte offset).
  absl::Status Fill(int64_t step, int mb, int dp_rank, MicrobatchData* out) const override;
  int64_t micro_batch_size() const override { return batch_; }
  int64_t seq_len() const override { return seq_; }
  int64_t EpochOfStep(int64_t step) const override;

  int64_t num_tokens() const { return num_tokens_; }
  int64_t num_shards() const { return static_cast<int64_t>(shards_.size()); }
  int64_t windows_per_epoch() const { return windows_; }
  int64_t rows_per_step() const { return rows_per_step_; }  // microbatches * dp * micro_batch_size
  // Ids the open-time check read (all of them for small shards).
  int64_t ids_checked_at_open() const { return checked_at_open_; }

  // Where row `row` of (step, mb, dp_rank) comes from: its epoch, its window
  // in the list of all windows, and the shard and first id of that window.
  struct Location {
    int64_t epoch = 0;
    int64_t window = 0;
    int64_t shard = 0;
    int64_t first_token = 0;
  };
  absl::StatusOr<Location> Locate(int64_t step, int mb, int dp_rank, int64_t row) const;

 private:
  TokensFileSource(std::vector<TokenShard> shards, std::vector<int64_t> first_window, const TokensFileOptions& options);

  std::vector<TokenShard> shards_;
  std::vector<int64_t> first_window_;  // shard i's windows are [first_window_[i], first_window_[i + 1])
  uint64_t seed_;
  int64_t vocab_, seq_, batch_;
  int microbatches_, dp_;
  int64_t windows_, rows_per_step_, num_tokens_ = 0, checked_at_open_ = 0;
  std::string field_;
};

}  // namespace baton::data

#endif  // BATON_WORKER_DATA_FILE_SOURCES_H_
