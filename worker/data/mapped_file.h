// MappedFile: a whole regular file mapped read-only into memory (mmap(2),
// PROT_READ, MAP_SHARED), so a data set larger than RAM is paged in on demand
// and shared with the page cache instead of being copied into the process.
//
// The descriptor is closed once the mapping exists (a job with thousands of
// shards holds no file descriptors for them). The mapping is advised
// MADV_RANDOM: training reads short windows at shuffled positions, and
// readahead would page in data no step asks for.
//
// A file that shrinks while it is mapped makes a read past its new end raise
// SIGBUS: data files must not be truncated or rewritten while a job reads
// them (write a new file and point the next job at it).
//
// Move-only; the bytes are immutable, so reads (and Release) are
// thread-safe.
#ifndef BATON_WORKER_DATA_MAPPED_FILE_H_
#define BATON_WORKER_DATA_MAPPED_FILE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace baton::data {

class MappedFile {
 public:
  // Maps `path`. Errors name `field` (the JobSpec field the path came from)
  // and the path: NOT_FOUND when it cannot be opened, INVALID_ARGUMENT when
  // it is not a regular file or holds more than `max_bytes`, INTERNAL when
  // mmap fails. An empty file maps to size() == 0 and data() == nullptr.
  static absl::StatusOr<MappedFile> Open(const std::string& path, const std::string& field, int64_t max_bytes);

  MappedFile() = default;
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  const uint8_t* data() const { return data_; }
  int64_t size() const { return size_; }
  const std::string& path() const { return path_; }

  // Drops this process's mapping of the pages holding bytes
  // [offset, offset + length), rounded out to 64 KiB blocks (madvise
  // MADV_DONTNEED; the kernel maps a fault's cached neighbours within such a
  // block, see the .cc): the next read of them
  // maps them again from the page cache or the file, with the same bytes.
  // A reader that releases what it has copied keeps its resident memory at
  // what it is reading now, instead of growing towards the file size as an
  // epoch touches every page (the pages stay in the kernel's page cache,
  // which the kernel reclaims as it needs).
  void Release(int64_t offset, int64_t length) const;

 private:
  void Unmap();

  std::string path_;
  const uint8_t* data_ = nullptr;
  int64_t size_ = 0;
};

}  // namespace baton::data

#endif  // BATON_WORKER_DATA_MAPPED_FILE_H_
