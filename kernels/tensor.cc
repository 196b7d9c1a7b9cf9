#include "kernels/tensor.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <limits>
#include <string>

#include "absl/base/internal/raw_logging.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace baton::kernels {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kBFloat16:
      return 2;
    case DType::kFloat64:
    case DType::kInt64:
      return 8;
  }
  return 4;
}

int64_t NumElements(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string ShapeToString(const Shape& shape) { return "[" + absl::StrJoin(shape, ", ") + "]"; }

std::string DeviceToString(Device device) {
  switch (device.type) {
    case DeviceType::kCpu:
      return "cpu";
    case DeviceType::kCuda:
      return "cuda:" + std::to_string(device.index);
    case DeviceType::kSim:
      return "sim:" + std::to_string(device.index);
  }
  return "?";
}

namespace {

void RequireHost(const Tensor& t, const char* accessor) {
  if (t.device().is_cpu()) return;
  // A device tensor read or written on the host: a missing Copy in the
  // caller. Name it, then abort (a programming error).
  std::fprintf(stderr, "baton::kernels::Tensor::%s: host access to a tensor on %s %s\n", accessor,
               DeviceToString(t.device()).c_str(), ShapeToString(t.shape()).c_str());
  std::abort();
}

}  // namespace

absl::StatusOr<size_t> AlignedBytes(const Shape& shape, DType dtype) {
  size_t bytes = DTypeSize(dtype);
  for (int64_t dim : shape) {
    if (dim < 0 || __builtin_mul_overflow(bytes, static_cast<size_t>(dim), &bytes)) {
      return absl::InvalidArgumentError(absl::StrCat("a tensor of shape ", ShapeToString(shape),
                                                     dim < 0 ? " has a negative dimension"
                                                             : ": its byte count overflows"));
    }
  }
  if (bytes > std::numeric_limits<size_t>::max() - kTensorAlignment) {
    return absl::InvalidArgumentError(
        absl::StrCat("a tensor of shape ", ShapeToString(shape), ": its byte count overflows"));
  }
  return (bytes + kTensorAlignment - 1) / kTensorAlignment * kTensorAlignment;
}

absl::StatusOr<Tensor> Tensor::TryZeros(Shape shape, DType dtype) {
  absl::StatusOr<size_t> aligned = AlignedBytes(shape, dtype);
  if (!aligned.ok()) return aligned.status();
  const size_t size = *aligned == 0 ? kTensorAlignment : *aligned;
  void* p = std::aligned_alloc(kTensorAlignment, size);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("out of host memory: a tensor of shape ", ShapeToString(shape),
                                                     " needs ", size, " bytes"));
  }
  std::memset(p, 0, size);
  Tensor t;
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.storage_ = std::shared_ptr<void>(p, std::free);
  t.data_ = p;
  return t;
}

Tensor Tensor::Zeros(Shape shape, DType dtype) {
  absl::StatusOr<Tensor> t = TryZeros(std::move(shape), dtype);
  if (!t.ok()) {
    std::fprintf(stderr, "baton::kernels::Tensor::Zeros: %s\n", std::string(t.status().message()).c_str());
    std::abort();
  }
  return *std::move(t);
}

Tensor Tensor::View(void* data, Shape shape, DType dtype, Device device) {
  Tensor t;
  t.data_ = data;
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.device_ = device;
  return t;
}

Tensor Tensor::Adopt(std::shared_ptr<void> storage, Shape shape, DType dtype, Device device) {
  Tensor t;
  t.data_ = storage.get();
  t.storage_ = std::move(storage);
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.device_ = device;
  return t;
}

void* Tensor::raw() const {
  RequireHost(*this, "raw");
  return data_;
}

float* Tensor::f32() const {
  RequireHost(*this, "f32");
  ABSL_RAW_CHECK(dtype_ == DType::kFloat32, "Tensor::f32 on a non-float32 tensor");
  return static_cast<float*>(data_);
}

int32_t* Tensor::i32() const {
  RequireHost(*this, "i32");
  ABSL_RAW_CHECK(dtype_ == DType::kInt32, "Tensor::i32 on a non-int32 tensor");
  return static_cast<int32_t*>(data_);
}

Tensor Tensor::Reshaped(Shape shape) const {
  ABSL_RAW_CHECK(NumElements(shape) == numel(), "Tensor::Reshaped: element count differs");
  Tensor t = *this;
  t.shape_ = std::move(shape);
  return t;
}

Tensor Tensor::Rows(int64_t begin, int64_t end) const {
  ABSL_RAW_CHECK(ndim() >= 1 && 0 <= begin && begin <= end && end <= shape_[0],
                 "Tensor::Rows: range outside dimension 0");
  Tensor t = *this;
  const int64_t row = shape_[0] == 0 ? 0 : numel() / shape_[0];
  t.data_ = static_cast<char*>(data_) + static_cast<size_t>(begin * row) * DTypeSize(dtype_);
  t.shape_[0] = end - begin;
  return t;
}

}  // namespace baton::kernels
