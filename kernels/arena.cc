#include "kernels/arena.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <cstring>

#include "absl/base/internal/raw_logging.h"
#include "kernels/backend.h"

namespace baton::kernels {
namespace {

constexpr size_t kAlignment = 64;
constexpr size_t kMinBlockBytes = size_t{1} << 20;

size_t RoundUp(size_t n) { return (n + kAlignment - 1) / kAlignment * kAlignment; }

}  // namespace

Arena::~Arena() {
  if (!device_.is_cpu()) CountInUse(device_, -static_cast<int64_t>(used_));
}

void Arena::AddBlock(size_t min_bytes) {
  const size_t size = RoundUp(std::max(min_bytes, kMinBlockBytes));
  Block block;
  if (device_.is_cpu()) {
    void* p = std::aligned_alloc(kAlignment, size);
    ABSL_RAW_CHECK(p != nullptr, "Arena: out of host memory");
    block.data = std::shared_ptr<char>(static_cast<char*>(p), std::free);
  } else {
    absl::StatusOr<void*> p = AllocateDevice(device_, size);
    if (!p.ok()) {
      std::fprintf(stderr, "baton::kernels::Arena: %s\n", std::string(p.status().message()).c_str());
      std::abort();
    }
    const Device device = device_;
    block.data = std::shared_ptr<char>(static_cast<char*>(*p),
                                       [device, size](char* q) { FreeDevice(device, q, size); });
  }
  ++system_allocations_;
  block.size = size;
  blocks_.push_back(std::move(block));
}

Tensor Arena::Allocate(Shape shape, DType dtype) {
  const size_t bytes = RoundUp(static_cast<size_t>(NumElements(shape)) * DTypeSize(dtype));
  if (blocks_.empty() || blocks_.back().offset + bytes > blocks_.back().size) {
    AddBlock(bytes);
  }
  Block& block = blocks_.back();
  char* p = block.data.get() + block.offset;
  block.offset += bytes;
  used_ += bytes;
  if (!device_.is_cpu()) CountInUse(device_, static_cast<int64_t>(bytes));
  return Tensor::View(p, std::move(shape), dtype, device_);
}

Tensor Arena::AllocateZeroed(Shape shape, DType dtype) {
  ABSL_RAW_CHECK(device_.is_cpu(), "Arena::AllocateZeroed on a device arena");
  Tensor t = Allocate(std::move(shape), dtype);
  std::memset(t.raw(), 0, t.bytes());
  return t;
}

void Arena::Reset() {
  if (blocks_.size() > 1) {
    const size_t total = capacity_bytes();
    blocks_.clear();
    AddBlock(total);
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
