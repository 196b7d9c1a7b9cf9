// Fuzzes the safetensors reader: any bytes must give a file or an
// INVALID_ARGUMENT, and reading every tensor of what parses must stay inside
// the buffer.
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  absl::StatusOr<baton::SafetensorsFile> f =
      baton::SafetensorsFile::Parse(std::string(reinterpret_cast<const char*>(data), size));
  if (!f.ok()) return 0;
  for (const auto& [name, entry] : f->tensors()) {
    f->Floats(name).IgnoreError();
    f->Ints(name).IgnoreError();
    f->Float32s(name).IgnoreError();
  }
  for (const auto& [key, value] : f->metadata()) f->MetadataInt(key).IgnoreError();
  return 0;
}
