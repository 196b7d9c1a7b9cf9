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
#include "absl/status/statusor.h"

namespace baton::kernels {

// kBFloat16: bf16 GEMM inputs and pipeline messages (backend.h §6; stored as
// the upper 16 bits of a float32, kernels/bfloat16.h); kFloat64 and kInt64:
// scalar accumulators. The kernels/cpu functions take kFloat32 and kInt32.
enum class DType { kFloat32, kInt32, kBFloat16, kFloat64, kInt64 };

size_t DTypeSize(DType dtype);

// kSim: the test-only simulated device (kernels/sim): host memory that only
// its stream threads may touch.
enum class DeviceType { kCpu, kCuda, kSim };

struct Device {
  DeviceType type = DeviceType::kCpu;
  int index = 0;  // CUDA ordinal; 0 for the CPU

  static Device Cpu() { return Device{}; }
  static Device Cuda(int index) { return Device{DeviceType::kCuda, index}; }
  static Device Sim(int index) { return Device{DeviceType::kSim, index}; }
  bool is_cpu() const { return type == DeviceType::kCpu; }
  bool operator==(const Device& other) const { return type == other.type && index == other.index; }
  bool operator!=(const Device& other) const { return !(*this == other); }
};

// "cpu", "cuda:0", "sim:1".
std::string DeviceToString(Device device);

using Shape = absl::InlinedVector<int64_t, 4>;

int64_t NumElements(const Shape& shape);
std::string ShapeToString(const Shape& shape);

// The alignment of every tensor allocation, host or device (vector loads).
constexpr size_t kTensorAlignment = 64;
// The bytes of a tensor of `shape` and `dtype`, rounded up to
// kTensorAlignment; INVALID_ARGUMENT when a dimension is negative or the
// count overflows size_t (checked before anything is allocated for it).
absl::StatusOr<size_t> AlignedBytes(const Shape& shape, DType dtype);

class Tensor {
 public:
  Tensor() = default;

  // Owning, zero-filled host tensor; RESOURCE_EXHAUSTED naming the bytes
  // when the host cannot give them (the caller says what to lower), and
  // INVALID_ARGUMENT for a shape AlignedBytes refuses.
  static absl::StatusOr<Tensor> TryZeros(Shape shape, DType dtype = DType::kFloat32);
  // TryZeros for tensors whose size is bounded by the caller (a batch of
  // validated shape, a test's); aborts, naming the shape, where TryZeros
  // fails. Anything sized by a model or a job goes through TryZeros (or
  // kernels::ZerosOn).
  static Tensor Zeros(Shape shape, DType dtype = DType::kFloat32);
  // Borrows `data`; the caller keeps it alive while the view is used.
  static Tensor View(void* data, Shape shape, DType dtype = DType::kFloat32,
                     Device device = Device::Cpu());
  // Owns `storage` (memory on `device`, freed by its deleter) and views it
  // from its start.
  static Tensor Adopt(std::shared_ptr<void> storage, Shape shape, DType dtype, Device device);

  const Shape& shape() const { return shape_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t dim(int i) const { return shape_[i < 0 ? i + ndim() : i]; }
  int64_t numel() const { return NumElements(shape_); }
  size_t bytes() const { return static_cast<size_t>(numel()) * DTypeSize(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  bool defined() const { return data_ != nullptr; }
  bool owning() const { return storage_ != nullptr; }

  // Host access: the tensor must live in host memory (device().is_cpu();
  // checked, a device tensor aborts). Typed access checks the dtype too.
  void* raw() const;
  float* f32() const;
  int32_t* i32() const;
  // The address on the tensor's device, never dereferenced by the caller on
  // the host unless device().is_cpu(): for backends and communicators.
  void* address() const { return data_; }
  template <typename T>
  T* data() const {
    return static_cast<T*>(data_);
  }

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
