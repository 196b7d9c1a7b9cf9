#include "kernels/arena.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "absl/base/internal/raw_logging.h"
#include "absl/strings/str_cat.h"
#include "common/format_bytes.h"
#include "kernels/backend.h"

namespace baton::kernels {
namespace {

constexpr size_t kMinBlockBytes = size_t{1} << 20;

size_t RoundUp(size_t n) { return (n + kTensorAlignment - 1) / kTensorAlignment * kTensorAlignment; }

}  // namespace

Arena::~Arena() {
  if (!device_.is_cpu()) CountInUse(device_, -static_cast<int64_t>(used_));
}

absl::Status Arena::AddBlock(size_t min_bytes) {
  const size_t size = RoundUp(std::max(min_bytes, kMinBlockBytes));
  Block block;
  absl::Status failed;
  if (device_.is_cpu()) {
    void* p = std::aligned_alloc(kTensorAlignment, size);
    if (p == nullptr) {
      failed = OutOfMemoryError(absl::StrCat("aligned_alloc of ", size, " bytes failed"));
    } else {
      block.data = std::shared_ptr<char>(static_cast<char*>(p), std::free);
    }
  } else {
    absl::StatusOr<void*> p = AllocateDevice(device_, size);
    if (!p.ok()) {
      failed = p.status();
    } else {
      const Device device = device_;
      block.data = std::shared_ptr<char>(static_cast<char*>(*p),
                                         [device, size](char* q) { FreeDevice(device, q, size); });
    }
  }
  if (!failed.ok()) {
    const std::string held =
        device_.is_cpu()
            ? ""
            : absl::StrCat("; ", FormatBytes(static_cast<double>(GetMemoryStats(device_).reserved_bytes)),
                           " held on the device by this process");
    const std::string what =
        absl::StrCat(what_, " needs ", FormatBytes(static_cast<double>(size)), " more (", size,
                     " bytes; the arena holds ", FormatBytes(static_cast<double>(capacity_bytes())), held, ")");
    if (IsOutOfMemory(failed)) {
      return OutOfMemoryError(absl::StrCat(DeviceToString(device_), " is out of memory: ", what));
    }
    return absl::Status(failed.code(), absl::StrCat(DeviceToString(device_), ": ", what, ": ",
                                                    failed.message()));
  }
  ++system_allocations_;
  block.size = size;
  blocks_.push_back(std::move(block));
  return absl::OkStatus();
}

absl::StatusOr<Tensor> Arena::Allocate(Shape shape, DType dtype) {
  absl::StatusOr<size_t> aligned = AlignedBytes(shape, dtype);
  if (!aligned.ok()) return absl::InvalidArgumentError(absl::StrCat("arena allocation: ", aligned.status().message()));
  const size_t bytes = *aligned;
  if (blocks_.empty() || bytes > blocks_.back().size - blocks_.back().offset) {
    absl::Status grown = AddBlock(bytes);
    if (!grown.ok()) return grown;
  }
  Block& block = blocks_.back();
  char* p = block.data.get() + block.offset;
  block.offset += bytes;
  used_ += bytes;
  if (!device_.is_cpu()) CountInUse(device_, static_cast<int64_t>(bytes));
  return Tensor::View(p, std::move(shape), dtype, device_);
}

absl::StatusOr<Tensor> Arena::AllocateZeroed(Shape shape, DType dtype) {
  ABSL_RAW_CHECK(device_.is_cpu(), "Arena::AllocateZeroed on a device arena");
  absl::StatusOr<Tensor> t = Allocate(std::move(shape), dtype);
  if (t.ok()) std::memset(t->raw(), 0, t->bytes());
  return t;
}

void Arena::Reset() {
  if (blocks_.size() > 1) {
    const size_t total = capacity_bytes();
    blocks_.clear();
    // On failure the arena is empty; the next Allocate grows it again and
    // reports the shortage.
    AddBlock(total).IgnoreError();
  }
  for (Block& block : blocks_) block.offset = 0;
  if (!device_.is_cpu()) CountInUse(device_, -static_cast<int64_t>(used_));
  used_ = 0;
}

size_t Arena::capacity_bytes() const {
  size_t total = 0;
  for (const Block& block : blocks_) total += block.size;
  return total;
}

}  // namespace baton::kernels
