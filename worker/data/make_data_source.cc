#include "worker/data/make_data_source.h"

#include "absl/strings/str_cat.h"
#include "worker/data/addition_task.h"
#include "worker/data/file_sources.h"

namespace baton::data {
namespace {

template <typename T>
absl::StatusOr<std::unique_ptr<DataSource>> Upcast(absl::StatusOr<std::unique_ptr<T>> source) {
  if (!source.ok()) return source.status();
  return std::unique_ptr<DataSource>(std::move(*source));
}

}  // namespace

absl::StatusOr<std::unique_ptr<DataSource>> MakeDataSource(const v1::JobSpec& job) {
  const uint64_t seed = job.train().seed();
  const int vocab = job.model().vocab();
  const int64_t seq_len = job.model().seq_len();
  const int64_t batch = job.train().micro_batch_size();
  const v1::DataSpec& data = job.data();
  switch (data.source_case()) {
    case v1::DataSpec::kTextFile:
      return Upcast(TextFileSource::Create(data.text_file(), seed, vocab, seq_len, batch));
    case v1::DataSpec::kTokensFile:
      return Upcast(TokensFileSource::Create(data.tokens_file(), seed, vocab, seq_len, batch));
    case v1::DataSpec::kSynthetic:
      if (!data.synthetic().task().empty() && data.synthetic().task() != "addition") {
        return absl::InvalidArgumentError(absl::StrCat("data.synthetic.task = \"",
                                                       data.synthetic().task(),
                                                       "\": unknown task; the one task is "
                                                       "\"addition\""));
      }
      return Upcast(AdditionTask::Create(seed, vocab, seq_len, batch));
    case v1::DataSpec::SOURCE_NOT_SET:
      return Upcast(AdditionTask::Create(seed, vocab, seq_len, batch));
  }
  return absl::InvalidArgumentError("data: unknown source");
}

}  // namespace baton::data
