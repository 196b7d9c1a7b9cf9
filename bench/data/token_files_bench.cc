// token_files_bench: shows that data.tokens_file is mapped, not read — a
// job reads a shard of several GiB while the process's resident memory stays
// a small fraction of it (docs/BENCHMARKS.md, "Token files larger than
// memory"). bench/token_files_bench.sh runs both modes.
//
//   --make: writes DIR/train_000000.bin, an llm.c GPT-2 shard of --gib GiB
//           (at most 2^31 - 1 ids, the llm.c header's limit) of pseudo-random
//           ids below 50257 (--sparse: a header and a hole, all ids 0), then
//           evicts it from the page cache.
//   --read: opens DIR/train_*.bin through MakeDataSource as a worker does
//           (vocab 50257, seq_len 1024, micro_batch_size 8, 4 microbatches)
//           and fills --steps steps, printing open and fill times and the
//           process's VmRSS, RssAnon, RssFile and VmHWM before and after.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "worker/data/file_sources.h"
#include "worker/data/make_data_source.h"
#include "worker/data/token_shards.h"

ABSL_FLAG(std::string, dir, "/tmp/baton_token_files_bench", "directory of the shard (the job's --data_dir)");
ABSL_FLAG(bool, make, false, "write the shard");
ABSL_FLAG(bool, read, false, "read the shard as a job does");
ABSL_FLAG(double, gib, 4.0, "--make: shard size in GiB");
ABSL_FLAG(bool, sparse, false, "--make: leave the ids a hole (zeros) instead of writing them");
ABSL_FLAG(int64_t, steps, 500, "--read: steps to fill (4 microbatches of 8 rows of 1025 ids each)");

namespace {

constexpr int kVocab = 50257;
constexpr int kMicrobatches = 4;

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

// VmRSS, RssAnon, RssFile, VmHWM from /proc/self/status, in MiB.
std::string Memory() {
  std::ifstream status("/proc/self/status");
  std::string line, out;
  while (std::getline(status, line)) {
    for (const char* key : {"VmRSS:", "RssAnon:", "RssFile:", "VmHWM:"}) {
      if (line.rfind(key, 0) == 0) {
        const long kib = std::atol(line.c_str() + std::strlen(key));
        out += std::string(key) + " " + std::to_string(kib / 1024) + " MiB  ";
      }
    }
  }
  return out;
}

uint64_t Mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

int Make(const std::string& dir) {
  const int64_t want = static_cast<int64_t>(absl::GetFlag(FLAGS_gib) * (int64_t{1} << 30)) / 2;
  const int64_t tokens = std::min<int64_t>(want, (int64_t{1} << 31) - 1);
  const std::string path = dir + "/train_000000.bin";
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) {
    std::perror(path.c_str());
    return 1;
  }
  const auto start = std::chrono::steady_clock::now();
  std::vector<int32_t> header(baton::data::kLlmcHeaderInts, 0);
  header[0] = baton::data::kLlmcMagicGpt2;
  header[1] = 1;
  header[2] = static_cast<int32_t>(tokens);
  bool ok = ::write(fd, header.data(), header.size() * 4) == static_cast<ssize_t>(header.size() * 4);
  if (absl::GetFlag(FLAGS_sparse)) {
    ok = ok && ::ftruncate(fd, static_cast<off_t>(header.size() * 4 + tokens * 2)) == 0;
  } else {
    std::vector<uint16_t> chunk(int64_t{1} << 22);  // 8 MiB
    for (int64_t done = 0; ok && done < tokens;) {
      const int64_t n = std::min<int64_t>(static_cast<int64_t>(chunk.size()), tokens - done);
      for (int64_t i = 0; i < n; ++i) chunk[i] = static_cast<uint16_t>(Mix(done + i) % kVocab);
      ok = ::write(fd, chunk.data(), n * 2) == n * 2;
      done += n;
    }
  }
  ok = ok && ::fdatasync(fd) == 0;
  // Start the read from a cold cache: drop this file's pages.
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
  if (!ok) {
    std::fprintf(stderr, "writing %s failed: %s\n", path.c_str(), std::strerror(errno));
    return 1;
  }
  std::printf("make: %s  %lld ids  %lld bytes  %s  %.1f s\n", path.c_str(), static_cast<long long>(tokens),
              static_cast<long long>(header.size() * 4 + tokens * 2), absl::GetFlag(FLAGS_sparse) ? "sparse" : "written",
              Seconds(start));
  return 0;
}

int Read(const std::string& dir) {
  std::printf("read: before open   %s\n", Memory().c_str());
  baton::v1::JobSpec job;
  job.mutable_model()->set_vocab(kVocab);
  job.mutable_model()->set_seq_len(1024);
  job.mutable_train()->set_micro_batch_size(8);
  job.mutable_train()->set_seed(1);
  job.mutable_schedule()->set_microbatches(kMicrobatches);
  job.mutable_data()->set_tokens_file("train_*.bin");
  job.mutable_data()->set_token_format("llmc");
  const auto open_start = std::chrono::steady_clock::now();
  absl::StatusOr<std::unique_ptr<baton::data::DataSource>> source = baton::data::MakeDataSource(job, dir);
  const double open_s = Seconds(open_start);
  if (!source.ok()) {
    std::fprintf(stderr, "%s\n", std::string(source.status().message()).c_str());
    return 1;
  }
  const auto* tokens = dynamic_cast<const baton::data::TokensFileSource*>(source->get());
  std::printf("read: after open    %s (open %.3f s: %lld shards, %lld ids = %.2f GiB, %lld windows an epoch, "
              "%lld ids checked at open)\n",
              Memory().c_str(), open_s, static_cast<long long>(tokens->num_shards()),
              static_cast<long long>(tokens->num_tokens()), tokens->num_tokens() * 2.0 / (1 << 30),
              static_cast<long long>(tokens->windows_per_epoch()),
              static_cast<long long>(tokens->ids_checked_at_open()));
  baton::MicrobatchData data;
  const int64_t steps = absl::GetFlag(FLAGS_steps);
  int64_t checksum = 0;
  const auto fill_start = std::chrono::steady_clock::now();
  for (int64_t step = 0; step < steps; ++step) {
    for (int mb = 0; mb < kMicrobatches; ++mb) {
      if (absl::Status s = (*source)->Fill(step, mb, 0, &data); !s.ok()) {
        std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
        return 1;
      }
      checksum += data.tokens.i32()[0] + data.targets.i32()[data.targets.numel() - 1];
    }
  }
  const double fill_s = Seconds(fill_start);
  const int64_t rows = steps * tokens->rows_per_step();
  std::printf("read: after %lld steps %s (%lld windows = %.1f MiB of ids read; %.1f us a microbatch, %.0f Mtokens/s; "
              "last step in epoch %lld; checksum %lld)\n",
              static_cast<long long>(steps), Memory().c_str(), static_cast<long long>(rows),
              rows * 1025 * 2.0 / (1 << 20), fill_s / (steps * kMicrobatches) * 1e6, rows * 1024 / fill_s / 1e6,
              static_cast<long long>(tokens->EpochOfStep(steps - 1)), static_cast<long long>(checksum));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::string dir = absl::GetFlag(FLAGS_dir);
  if (absl::GetFlag(FLAGS_make)) {
    if (int rc = Make(dir); rc != 0) return rc;
  }
  if (absl::GetFlag(FLAGS_read)) return Read(dir);
  return 0;
}
