#include "worker/data/make_data_source.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/path_confinement.h"
#include "worker/data/addition_task.h"
#include "worker/data/file_sources.h"
#include "worker/data/shard_paths.h"
#include "worker/data/token_shards.h"

namespace baton::data {
namespace {

template <typename T>
absl::StatusOr<std::unique_ptr<DataSource>> Upcast(absl::StatusOr<std::unique_ptr<T>> source) {
  if (!source.ok()) return source.status();
  return std::unique_ptr<DataSource>(std::move(*source));
}

}  // namespace

absl::StatusOr<std::string> ResolveDataFile(const std::string& data_dir, const std::string& path,
                                            const char* field) {
  if (data_dir.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        field, " = \"", path, "\": this worker reads no data files; start it with --data_dir=DIR and put the "
        "file under DIR"));
  }
  if (path.empty()) return absl::InvalidArgumentError(absl::StrCat(field, " is empty: give a file path"));
  absl::StatusOr<std::string> root = RealPath(data_dir);
  if (!root.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("--data_dir=", data_dir, " cannot be resolved: ", root.status().message()));
  }
  const std::string joined = path.front() == '/' ? path : absl::StrCat(*root, "/", path);
  absl::StatusOr<std::string> file = RealPath(joined);
  if (!file.ok()) {
    return absl::NotFoundError(absl::StrCat(field, " = \"", path, "\": cannot open under --data_dir=", data_dir,
                                            ": ", std::strerror(errno)));
  }
  if (!IsUnder(*file, *root)) {
    return absl::PermissionDeniedError(absl::StrCat(field, " = \"", path, "\" resolves to ", *file,
                                                    ", outside this worker's --data_dir=", *root,
                                                    "; put the file under it"));
  }
  struct stat st;
  if (stat(file->c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(field, " = \"", path, "\" is not a regular file"));
  }
  if (st.st_size > kMaxDataFileBytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, " = \"", path, "\" holds ", st.st_size,
                                                   " bytes; at most ", kMaxDataFileBytes,
                                                   " are read into memory: use a smaller file"));
  }
  return *file;
}

namespace {

// The source `data` (at field `at` of the job: "data" or "train.eval_data")
// shaped by the job and seeded by `seed`.
absl::StatusOr<std::unique_ptr<DataSource>> MakeSource(const v1::JobSpec& job, const v1::DataSpec& data,
                                                       const std::string& at, uint64_t seed,
                                                       const std::string& data_dir) {
  const std::string text_field = at + ".text_file", tokens_field = at + ".tokens_file";
  const int vocab = job.model().vocab();
  const int64_t seq_len = job.model().seq_len();
  const int64_t batch = job.train().micro_batch_size();
  if (!data.token_format().empty() && data.source_case() != v1::DataSpec::kTokensFile) {
    return absl::InvalidArgumentError(absl::StrCat(at, ".token_format = \"", data.token_format(),
                                                   "\": applies to data.tokens_file only; remove it"));
  }
  switch (data.source_case()) {
    case v1::DataSpec::kTextFile: {
      absl::StatusOr<std::string> path = ResolveDataFile(data_dir, data.text_file(), text_field.c_str());
      if (!path.ok()) return path.status();
      return Upcast(TextFileSource::Create(*path, seed, vocab, seq_len, batch));
    }
    case v1::DataSpec::kTokensFile: {
      absl::StatusOr<TokenFormat> format = ParseTokenFormat(data.token_format());
      if (!format.ok()) return format.status();
      absl::StatusOr<std::vector<std::string>> paths =
          ExpandTokenShards(data_dir, data.tokens_file(), *format, tokens_field.c_str());
      if (!paths.ok()) return paths.status();
      std::vector<TokenShard> shards;
      shards.reserve(paths->size());
      for (const std::string& path : *paths) {
        absl::StatusOr<TokenShard> shard = TokenShard::Open(path, *format, tokens_field.c_str());
        if (!shard.ok()) return shard.status();
        shards.push_back(*std::move(shard));
      }
      TokensFileOptions options;
      options.seed = seed;
      options.vocab = vocab;
      options.seq_len = seq_len;
      options.micro_batch_size = batch;
      options.microbatches = std::max(1, job.schedule().microbatches());
      options.dp = job.parallel().has_dp() ? job.parallel().dp() : 1;
      return Upcast(TokensFileSource::Create(std::move(shards), options));
    }
    case v1::DataSpec::kSynthetic:
      if (!data.synthetic().task().empty() && data.synthetic().task() != "addition") {
        return absl::InvalidArgumentError(absl::StrCat(at, ".synthetic.task = \"",
                                                       data.synthetic().task(),
                                                       "\": unknown task; the one task is "
                                                       "\"addition\""));
      }
      return Upcast(AdditionTask::Create(seed, vocab, seq_len, batch));
    case v1::DataSpec::SOURCE_NOT_SET:
      return Upcast(AdditionTask::Create(seed, vocab, seq_len, batch));
  }
  return absl::InvalidArgumentError(absl::StrCat(at, ": unknown source"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<DataSource>> MakeDataSource(const v1::JobSpec& job, const std::string& data_dir) {
  return MakeSource(job, job.data(), "data", job.train().seed(), data_dir);
}

absl::StatusOr<std::unique_ptr<DataSource>> MakeEvalDataSource(const v1::JobSpec& job, const std::string& data_dir) {
  if (!job.train().has_eval_data()) {
    return absl::InvalidArgumentError("train.eval_data: not set; name the held-out data to evaluate on");
  }
  return MakeSource(job, job.train().eval_data(), "train.eval_data", job.train().seed() ^ kEvalSeedSalt, data_dir);
}

}  // namespace baton::data
