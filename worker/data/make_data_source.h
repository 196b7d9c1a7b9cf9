// MakeDataSource: the DataSource a JobSpec asks for — `data { synthetic {
// task: "addition" } }` or no data field (AdditionTask), `data { text_file }`
// (TextFileSource) or `data { tokens_file }` (TokensFileSource) — shaped by
// train.micro_batch_size × model.seq_len and seeded by train.seed.
#ifndef BATON_WORKER_DATA_MAKE_DATA_SOURCE_H_
#define BATON_WORKER_DATA_MAKE_DATA_SOURCE_H_

#include <memory>

#include "absl/status/statusor.h"
#include "baton/v1/job.pb.h"
#include "worker/data/data_source.h"

namespace baton::data {

// Errors are INVALID_ARGUMENT (NOT_FOUND for a missing file) naming the
// JobSpec field to fix: an unknown data.synthetic.task, model.vocab too small
// for the source, a file too short for model.seq_len, and so on.
absl::StatusOr<std::unique_ptr<DataSource>> MakeDataSource(const v1::JobSpec& job);

}  // namespace baton::data

#endif  // BATON_WORKER_DATA_MAKE_DATA_SOURCE_H_
