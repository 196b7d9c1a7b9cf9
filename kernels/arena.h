// Arena: a bump allocator for the activations of one microbatch. A training
// step allocates every activation from an arena and releases them all at
// once with Reset(); after the first step the arena has grown to the step's
// high-water mark, so later steps reuse its memory without calling malloc.
// An arena holds memory of one device (host memory by default); on a device
// other than the CPU its blocks come from kernels::AllocateDevice, so they
// count in GetMemoryStats.
//
// Errors. When the device (or the host) cannot give the arena a new block,
// Allocate returns RESOURCE_EXHAUSTED naming the device, the bytes asked, the
// arena's capacity and what the device holds for this process
// (GetMemoryStats reserved_bytes), e.g. "cuda:0 is out of memory: an
// activation arena needs 512 MiB more (536870912 bytes; the arena holds
// 3.1 GiB; 78.2 GiB held on the device by this process)"; the caller adds
// what to change (GptStage: the micro-batch size). Another failure of the
// device's allocator keeps its code and message. A host arena reports a
// failed aligned_alloc the same way. A shape whose byte count does not
// fit in size_t (or has a negative dimension) is INVALID_ARGUMENT, checked
// before anything is allocated. A failed Allocate changes nothing: tensors
// allocated before stay valid, used_bytes(), capacity_bytes() and the
// device's in-use count are as before, and later allocations that fit work.
// The caller fails its action (a step) and calls Reset() before the next.
//
// Not thread-safe: one arena per microbatch in flight.
#ifndef BATON_KERNELS_ARENA_H_
#define BATON_KERNELS_ARENA_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/tensor.h"

namespace baton::kernels {

class Arena {
 public:
  Arena() = default;
  // `what` names the arena in errors ("an activation arena").
  explicit Arena(Device device, std::string what = "an arena")
      : device_(device), what_(std::move(what)) {}
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // An uninitialized tensor on device(), 64-byte aligned, valid until Reset().
  // RESOURCE_EXHAUSTED when the device is out of memory, INVALID_ARGUMENT for
  // a shape too large to address (see Errors above).
  absl::StatusOr<Tensor> Allocate(Shape shape, DType dtype = DType::kFloat32);
  // As Allocate, filled with zeros (host arenas only: zero device memory
  // with kernels::FillZero on a stream).
  absl::StatusOr<Tensor> AllocateZeroed(Shape shape, DType dtype = DType::kFloat32);

  Device device() const { return device_; }

  // Releases every allocation. Memory is kept; when the last cycle needed
  // more than one block, the blocks are merged into one of the total size
  // (if that allocation fails the arena is left empty and grows again).
  void Reset();

  size_t used_bytes() const { return used_; }
  size_t capacity_bytes() const;
  // How many times the arena has asked the system for memory (successfully).
  int64_t system_allocations() const { return system_allocations_; }

 private:
  struct Block {
    std::shared_ptr<char> data;  // frees on the arena's device
    size_t size = 0;
    size_t offset = 0;
  };
  // Appends a block of at least `min_bytes`; on failure the arena is unchanged.
  absl::Status AddBlock(size_t min_bytes);

  Device device_;
  std::string what_ = "an arena";
  std::vector<Block> blocks_;
  size_t used_ = 0;
  int64_t system_allocations_ = 0;
};

}  // namespace baton::kernels

#endif  // BATON_KERNELS_ARENA_H_
