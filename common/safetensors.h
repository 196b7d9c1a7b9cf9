// Safetensors files: an 8-byte little-endian header length, a JSON header
// naming each tensor's dtype, shape and byte range, an optional
// "__metadata__" string map, then the raw little-endian data.
//
// SafetensorsFile reads any file the format allows (F64/F32/F16/BF16 and
// integer dtypes are listed; values convert from F32/F64/F16/BF16 and
// I32/I64) and turns every malformed input — truncated file, header length past the end,
// bad JSON, ranges out of bounds, overlapping or leaving holes, sizes that
// disagree with shapes — into an INVALID_ARGUMENT, never a crash.
// SafetensorsWriter writes F32 and I32 tensors with metadata, header padded
// to 8 bytes as the reference implementation does. Both assume a
// little-endian host, as the format's data is little-endian.
#ifndef BATON_COMMON_SAFETENSORS_H_
#define BATON_COMMON_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace baton {

struct TensorEntry {
  std::string dtype;  // "F32", "F64", "I32", "I64", ...
  std::vector<int64_t> shape;
  size_t begin = 0;  // byte range inside the data section
  size_t end = 0;
};

class SafetensorsFile {
 public:
  // NOT_FOUND when `path` does not exist; parse errors name the path.
  static absl::StatusOr<SafetensorsFile> Read(const std::string& path);
  static absl::StatusOr<SafetensorsFile> Parse(std::string bytes);

  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::map<std::string, TensorEntry>& tensors() const { return tensors_; }
  // An integer from the metadata; errors name the key.
  absl::StatusOr<int64_t> MetadataInt(const std::string& key) const;

  // Values converted from F32, F64, F16 or BF16 (the last three exactly).
  absl::StatusOr<std::vector<double>> Floats(const std::string& name) const;
  // Values converted from I32 or I64.
  absl::StatusOr<std::vector<int64_t>> Ints(const std::string& name) const;
  // The exact values of an F32 tensor (other dtypes are an error).
  absl::StatusOr<std::vector<float>> Float32s(const std::string& name) const;

 private:
  absl::StatusOr<const TensorEntry*> Entry(const std::string& name) const;

  std::string bytes_;
  size_t data_start_ = 0;
  std::map<std::string, std::string> metadata_;
  std::map<std::string, TensorEntry> tensors_;
};

class SafetensorsWriter {
 public:
  void SetMetadata(const std::string& key, const std::string& value) { metadata_[key] = value; }
  // Errors: a name used twice or reserved ("__metadata__", empty), a negative
  // dimension, or a value count that disagrees with the shape.
  absl::Status AddFloat32(const std::string& name, const std::vector<int64_t>& shape,
                          absl::Span<const float> values);
  absl::Status AddInt32(const std::string& name, const std::vector<int64_t>& shape,
                        absl::Span<const int32_t> values);

  // The whole file; tensors are laid out in name order.
  std::string Serialize() const;
  // Writes Serialize() to `path` atomically (temporary file + rename).
  absl::Status WriteFile(const std::string& path) const;

 private:
  absl::Status Add(const std::string& name, const std::string& dtype,
                   const std::vector<int64_t>& shape, const void* data, size_t count,
                   size_t element_bytes);

  struct Pending {
    std::string dtype;
    std::vector<int64_t> shape;
    std::string data;
  };
  std::map<std::string, std::string> metadata_;
  std::map<std::string, Pending> tensors_;
};

}  // namespace baton

#endif  // BATON_COMMON_SAFETENSORS_H_
