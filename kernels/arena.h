// Arena: a bump allocator for the activations of one microbatch. A training
// step allocates every activation from an arena and releases them all at
// once with Reset(); after the first step the arena has grown to the step's
// high-water mark, so later steps reuse its memory without calling malloc.
// An arena holds memory of one device (host memory by default); on a device
// other than the CPU its blocks come from kernels::AllocateDevice, so they
// count in GetMemoryStats. Not thread-safe: one arena per microbatch in
// flight.
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
  explicit Arena(Device device) : device_(device) {}
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // An uninitialized tensor on device(), 64-byte aligned, valid until Reset().
  // Aborts when the device is out of memory.
  Tensor Allocate(Shape shape, DType dtype = DType::kFloat32);
  // As Allocate, filled with zeros (host arenas only: zero device memory
  // with kernels::FillZero on a stream).
  Tensor AllocateZeroed(Shape shape, DType dtype = DType::kFloat32);

  Device device() const { return device_; }

  // Releases every allocation. Memory is kept; when the last cycle needed
  // more than one block, the blocks are merged into one of the total size.
  void Reset();

  size_t used_bytes() const { return used_; }
  size_t capacity_bytes() const;
  // How many times the arena has asked the system for memory.
  int64_t system_allocations() const { return system_allocations_; }

 private:
  struct Block {
    std::shared_ptr<char> data;  // frees on the arena's device
    size_t size = 0;
    size_t offset = 0;
  };
  void AddBlock(size_t min_bytes);

  Device device_;
  std::vector<Block> blocks_;
  size_t used_ = 0;
  int64_t system_allocations_ = 0;
};

}  // namespace baton::kernels

#endif  // BATON_KERNELS_ARENA_H_
