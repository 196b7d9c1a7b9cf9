// SafetensorsFile: reads the safetensors format (8-byte little-endian header
// length, a JSON header naming each tensor's dtype, shape and byte range,
// then the raw little-endian data) with a small JSON parser of its own.
// Every malformed input — truncated file, bad JSON, ranges out of bounds,
// sizes that disagree with shapes — is an absl::Status, never a crash.
// Assumes a little-endian host, as the format's data is little-endian.
#ifndef BATON_TESTS_GOLDEN_SAFETENSORS_H_
#define BATON_TESTS_GOLDEN_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace baton::golden {

struct TensorEntry {
  std::string dtype;  // "F32", "F64", "I32", "I64", ...
  std::vector<int64_t> shape;
  size_t begin = 0;  // byte range inside the data section
  size_t end = 0;
};

class SafetensorsFile {
 public:
  static absl::StatusOr<SafetensorsFile> Read(const std::string& path);
  static absl::StatusOr<SafetensorsFile> Parse(std::string bytes);

  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::map<std::string, TensorEntry>& tensors() const { return tensors_; }
  // An integer from the metadata; errors name the key.
  absl::StatusOr<int64_t> MetadataInt(const std::string& key) const;

  // Values converted from F32 or F64.
  absl::StatusOr<std::vector<double>> Floats(const std::string& name) const;
  // Values converted from I32 or I64.
  absl::StatusOr<std::vector<int64_t>> Ints(const std::string& name) const;

 private:
  absl::StatusOr<const TensorEntry*> Entry(const std::string& name) const;

  std::string bytes_;
  size_t data_start_ = 0;
  std::map<std::string, std::string> metadata_;
  std::map<std::string, TensorEntry> tensors_;
};

}  // namespace baton::golden

#endif  // BATON_TESTS_GOLDEN_SAFETENSORS_H_
