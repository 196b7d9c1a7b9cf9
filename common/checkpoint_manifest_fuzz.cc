// Fuzzes the checkpoint reader (common/checkpoint_manifest.h) through the
// files it reads: the input is split at "\n--next-file--\n" into
// manifest.json, then chunk0-tp0, chunk0-tp1, chunk1-tp0 and chunk1-tp1
// .safetensors (a part left out or empty
// is no file). They are written to a scratch
// directory and read the way `--resume` and `batonctl checkpoint` do:
// ReadManifest, LoadFullState, ValidateCheckpointForJob for a synthetic and a
// GPT job. Any bytes must give a result or a clear error: no crash, no
// allocation beyond what the files' sizes imply, no hang.
#include <stdlib.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "baton/v1/job.pb.h"
#include "common/checkpoint_manifest.h"

namespace {

constexpr char kSeparator[] = "\n--next-file--\n";
const char* const kFiles[] = {"manifest.json", "chunk0-tp0.safetensors", "chunk0-tp1.safetensors",
                              "chunk1-tp0.safetensors", "chunk1-tp1.safetensors"};

const std::string& ScratchDir() {
  static const std::string* dir = [] {
    const char* tmp = getenv("TEST_TMPDIR");
    std::string pattern = std::string(tmp != nullptr ? tmp : "/tmp") + "/ckpt-fuzz-XXXXXX";
    if (mkdtemp(pattern.data()) == nullptr) {
      std::perror("checkpoint_manifest_fuzz: mkdtemp");
      abort();
    }
    return new std::string(pattern);
  }();
  return *dir;
}

// A plain write: the atomic, fsynced write of common/file_io.h is too slow
// to run thousands of times a second.
void WriteScratch(const std::string& path, absl::string_view bytes) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr || std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size() || std::fclose(f) != 0) {
    std::perror(path.c_str());
    abort();
  }
}

baton::v1::JobSpec SyntheticJob() {
  baton::v1::JobSpec job;
  job.set_name("fuzz");
  job.mutable_model()->mutable_synthetic();
  job.mutable_parallel()->set_pp(2);
  return job;
}

baton::v1::JobSpec GptJob() {
  baton::v1::JobSpec job;
  job.set_name("fuzz");
  baton::v1::ModelSpec* m = job.mutable_model();
  m->set_layers(1);
  m->set_d_model(2);
  m->set_heads(1);
  m->set_vocab(3);
  m->set_seq_len(2);
  job.mutable_parallel()->set_pp(2);
  return job;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& dir = ScratchDir();
  const std::vector<absl::string_view> parts =
      absl::StrSplit(absl::string_view(reinterpret_cast<const char*>(data), size), kSeparator);
  for (size_t i = 0; i < sizeof(kFiles) / sizeof(kFiles[0]); ++i) {
    const std::string path = dir + "/" + kFiles[i];
    unlink(path.c_str());
    if (i < parts.size() && !parts[i].empty()) WriteScratch(path, parts[i]);
  }
  if (!parts.empty()) baton::checkpoint::ParseLayout(std::string(parts[0])).IgnoreError();
  baton::checkpoint::ReadManifest(dir).IgnoreError();
  absl::StatusOr<baton::checkpoint::FullState> full = baton::checkpoint::LoadFullState(dir);
  if (full.ok()) {
    // What was gathered must be consistent with the shapes it claims.
    for (const auto& [name, t] : full->tensors) {
      if (!t.values.empty() && static_cast<int64_t>(t.values.size()) != baton::checkpoint::NumElements(t.shape)) {
        std::fprintf(stderr, "tensor %s: %zu values for shape of %lld\n", name.c_str(), t.values.size(),
                     static_cast<long long>(baton::checkpoint::NumElements(t.shape)));
        abort();
      }
    }
  }
  absl::Status synthetic = baton::checkpoint::ValidateCheckpointForJob(dir, SyntheticJob()).status();
  absl::Status gpt = baton::checkpoint::ValidateCheckpointForJob(dir, GptJob()).status();
  static const bool verbose = getenv("CHECKPOINT_FUZZ_VERBOSE") != nullptr;  // to check what seeds reach
  if (verbose) {
    std::fprintf(stderr, "load: %s\nsynthetic job: %s\ngpt job: %s\n", full.status().ToString().c_str(),
                 synthetic.ToString().c_str(), gpt.ToString().c_str());
  }
  baton::checkpoint::ResolveCheckpoint(dir).IgnoreError();
  return 0;
}
