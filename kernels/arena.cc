#include "kernels/arena.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "absl/base/internal/raw_logging.h"

namespace baton::kernels {
namespace {

constexpr size_t kAlignment = 64;
constexpr size_t kMinBlockBytes = size_t{1} << 20;

size_t RoundUp(size_t n) { return (n + kAlignment - 1) / kAlignment * kAlignment; }

}  // namespace

void Arena::AddBlock(size_t min_bytes) {
  const size_t size = RoundUp(std::max(min_bytes, kMinBlockBytes));
  void* p = std::aligned_alloc(kAlignment, size);
  ABSL_RAW_CHECK(p != nullptr, "Arena: out of host memory");
  ++system_allocations_;
  Block block;
  block.data = std::unique_ptr<char, void (*)(void*)>(static_cast<char*>(p), std::free);
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
  return Tensor::View(p, std::move(shape), dtype);
}

Tensor Arena::AllocateZeroed(Shape shape, DType dtype) {
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
  used_ = 0;
}

size_t Arena::capacity_bytes() const {
  size_t total = 0;
  for (const Block& block : blocks_) total += block.size;
  return total;
}

}  // namespace baton::kernels
