// Arena: a bump allocator for the activations of one microbatch. A training
// step allocates every activation from an arena and releases them all at
// once with Reset(); after the first step the arena has grown to the step's
// high-water mark, so later steps reuse its memory without calling malloc.
// Not thread-safe: one arena per microbatch in flight.
#ifndef BATON_KERNELS_ARENA_H_
#define BATON_KERNELS_ARENA_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/tensor.h"

namespace baton::kernels {

class Arena {
 public:
  Arena() = default;
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // An uninitialized host tensor, 64-byte aligned, valid until Reset().
  Tensor Allocate(Shape shape, DType dtype = DType::kFloat32);
  // As Allocate, filled with zeros.
  Tensor AllocateZeroed(Shape shape, DType dtype = DType::kFloat32);

  // Releases every allocation. Memory is kept; when the last cycle needed
  // more than one block, the blocks are merged into one of the total size.
  void Reset();

  size_t used_bytes() const { return used_; }
  size_t capacity_bytes() const;
  // How many times the arena has asked the system for memory.
  int64_t system_allocations() const { return system_allocations_; }

 private:
  struct Block {
    std::unique_ptr<char, void (*)(void*)> data{nullptr, nullptr};
    size_t size = 0;
    size_t offset = 0;
  };
  void AddBlock(size_t min_bytes);

  std::vector<Block> blocks_;
  size_t used_ = 0;
  int64_t system_allocations_ = 0;
};

}  // namespace baton::kernels

#endif  // BATON_KERNELS_ARENA_H_
