#include "worker/data/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace baton::data {

absl::StatusOr<MappedFile> MappedFile::Open(const std::string& path, const std::string& field, int64_t max_bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError(absl::StrCat(field, ": \"", path, "\": cannot open: ", std::strerror(errno)));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(field, ": \"", path, "\" is not a regular file"));
  }
  if (st.st_size > max_bytes) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(field, ": \"", path, "\" holds ", st.st_size,
                                                   " bytes; baton maps at most ", max_bytes,
                                                   " per file: split it into shards"));
  }
  MappedFile file;
  file.path_ = path;
  file.size_ = st.st_size;
  if (file.size_ > 0) {
    void* p = ::mmap(nullptr, static_cast<size_t>(file.size_), PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return absl::InternalError(absl::StrCat(field, ": \"", path, "\": mmap of ", file.size_,
                                              " bytes failed: ", std::strerror(err)));
    }
    ::madvise(p, static_cast<size_t>(file.size_), MADV_RANDOM);  // advice only: failure changes nothing
    file.data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
  return file;
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : path_(std::move(other.path_)), data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    Unmap();
    path_ = std::move(other.path_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

MappedFile::~MappedFile() { Unmap(); }

void MappedFile::Unmap() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), static_cast<size_t>(size_));
  data_ = nullptr;
  size_ = 0;
}

void MappedFile::Release(int64_t offset, int64_t length) const {
  // Linux maps up to fault_around_bytes (64 KiB by default) of cached pages
  // around a faulting one, aligned to that size: release whole such blocks,
  // or the neighbours a read mapped in stay resident. A block shared with a
  // neighbouring window is mapped again when that window is read.
  constexpr int64_t kBlock = 64 << 10;
  if (data_ == nullptr || length <= 0 || offset < 0 || offset >= size_) return;
  const int64_t begin = offset / kBlock * kBlock;
  const int64_t end = std::min(size_, (offset + length + kBlock - 1) / kBlock * kBlock);
  ::madvise(const_cast<uint8_t*>(data_) + begin, static_cast<size_t>(end - begin), MADV_DONTNEED);
}

}  // namespace baton::data
