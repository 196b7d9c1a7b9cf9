// Tensor: a shaped, typed view of memory on one device. A tensor either owns
// its storage (shared, reference-counted) or borrows it (a view into an
// activation arena, a parameter shard, a caller's buffer); copying a Tensor
// copies the handle, never the data. Shapes hold up to four dimensions
// inline, so making tensors in a training step does not allocate.
#ifndef BATON_KERNELS_TENSOR_H_
#define BATON_KERNELS_TENSOR_H_

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>

#include "absl/container/inlined_vector.h"

namespace baton::kernels {

enum class DType { kFloat32, kInt32 };

size_t DTypeSize(DType dtype);

enum class DeviceType { kCpu, kCuda };

struct Device {
  DeviceType type = DeviceType::kCpu;
  int index = 0;  // CUDA ordinal; 0 for the CPU

  static Device Cpu() { return Device{}; }
  bool is_cpu() const { return type == DeviceType::kCpu; }
  bool operator==(const Device& other) const { return type == other.type && index == other.index; }
};

using Shape = absl::InlinedVector<int64_t, 4>;

int64_t NumElements(const Shape& shape);
std::string ShapeToString(const Shape& shape);

class Tensor {
 public:
  Tensor() = default;

  // Owning, zero-filled host tensor.
  static Tensor Zeros(Shape shape, DType dtype = DType::kFloat32);
  // Borrows `data`; the caller keeps it alive while the view is used.
  static Tensor View(void* data, Shape shape, DType dtype = DType::kFloat32,
                     Device device = Device::Cpu());

  const Shape& shape() const { return shape_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t dim(int i) const { return shape_[i < 0 ? i + ndim() : i]; }
  int64_t numel() const { return NumElements(shape_); }
  size_t bytes() const { return static_cast<size_t>(numel()) * DTypeSize(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  bool defined() const { return data_ != nullptr; }
  bool owning() const { return storage_ != nullptr; }

  void* raw() const { return data_; }
  // Typed access; the dtype must match (checked).
  float* f32() const;
  int32_t* i32() const;

  // A view of the same memory with another shape of equal element count;
  // keeps owned storage alive.
  Tensor Reshaped(Shape shape) const;
  // A view of rows [begin, end) along dimension 0.
  Tensor Rows(int64_t begin, int64_t end) const;

 private:
  std::shared_ptr<void> storage_;  // null for views
  void* data_ = nullptr;
  Shape shape_;
  DType dtype_ = DType::kFloat32;
  Device device_;
};

}  // namespace baton::kernels

#endif  // BATON_KERNELS_TENSOR_H_
