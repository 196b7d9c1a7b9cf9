// MakeDataSource: the DataSource a JobSpec asks for — `data { synthetic {
// task: "addition" } }` or no data field (AdditionTask), `data { text_file }`
// (TextFileSource) or `data { tokens_file token_format }` (TokensFileSource
// over the shards ExpandTokenShards finds) — shaped by
// train.micro_batch_size × model.seq_len, seeded by train.seed, and for
// tokens_file with the global batch of schedule.microbatches × parallel.dp.
#ifndef BATON_WORKER_DATA_MAKE_DATA_SOURCE_H_
#define BATON_WORKER_DATA_MAKE_DATA_SOURCE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "baton/v1/job.pb.h"
#include "worker/data/data_source.h"

namespace baton::data {

// Data files (data.text_file, data.tokens_file) are read only from under
// `data_dir`, the worker's --data_dir: a path relative to it, or an absolute
// one inside it (after resolving symlinks), naming regular files. A text_file
// is read into memory and holds at most kMaxDataFileBytes; tokens_file shards
// are mapped, at most kMaxShardBytes each (token_shards.h). An empty data_dir
// refuses every data file (synthetic data needs none).
inline constexpr int64_t kMaxDataFileBytes = int64_t{1} << 30;

// Errors are INVALID_ARGUMENT (NOT_FOUND for a missing file,
// PERMISSION_DENIED for a file outside data_dir) naming the JobSpec field to
// fix: an unknown data.synthetic.task or data.token_format, model.vocab too
// small for the source, a file too short for model.seq_len, a bad shard
// (token_shards.h, shard_paths.h), and so on.
absl::StatusOr<std::unique_ptr<DataSource>> MakeDataSource(const v1::JobSpec& job, const std::string& data_dir);

// The held-out source of train.eval_data, shaped like the training data and
// seeded by train.seed ^ kEvalSeedSalt: a synthetic task draws other samples
// than training's, a file is read in another order. Errors as above, naming
// train.eval_data's fields.
inline constexpr uint64_t kEvalSeedSalt = 0x5eed'e7a1'0000'0001;
absl::StatusOr<std::unique_ptr<DataSource>> MakeEvalDataSource(const v1::JobSpec& job, const std::string& data_dir);

// The canonical path of data file `path` (see above); errors name `field`.
absl::StatusOr<std::string> ResolveDataFile(const std::string& data_dir, const std::string& path,
                                            const char* field);

}  // namespace baton::data

#endif  // BATON_WORKER_DATA_MAKE_DATA_SOURCE_H_
