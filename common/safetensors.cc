#include "common/safetensors.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/file_io.h"
#include "common/json.h"
#include "common/status_macros.h"

namespace baton {
namespace {

// The reference implementation refuses headers above 100 MB.
constexpr uint64_t kMaxHeaderBytes = 100 << 20;
constexpr int64_t kMaxElements = int64_t{1} << 40;

size_t DTypeBytes(const std::string& dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL") return 1;
  return 0;
}

float BFloat16ToFloat(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// IEEE 754 binary16: sign, 5-bit exponent (bias 15), 10-bit fraction.
float Float16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const int exponent = (h >> 10) & 0x1f;
  uint32_t fraction = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (fraction << 13);  // infinity, NaN
  } else if (exponent != 0) {
    bits = sign | (static_cast<uint32_t>(exponent - 15 + 127) << 23) | (fraction << 13);
  } else if (fraction == 0) {
    bits = sign;  // ±0
  } else {
    // Subnormal: normalise the fraction.
    int e = -14;
    while ((fraction & 0x400) == 0) {
      fraction <<= 1;
      --e;
    }
    bits = sign | (static_cast<uint32_t>(e + 127) << 23) | ((fraction & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

absl::Status Bad(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("safetensors: ", what));
}

absl::StatusOr<TensorEntry> ParseEntry(const std::string& name, const JsonValue& j,
                                       size_t data_bytes) {
  auto bad = [&](absl::string_view what) { return Bad(absl::StrCat("tensor ", name, ": ", what)); };
  const JsonValue* dtype = j.Find("dtype");
  const JsonValue* shape = j.Find("shape");
  const JsonValue* offsets = j.Find("data_offsets");
  if (!j.is_object() || dtype == nullptr || !dtype->is_string() || shape == nullptr ||
      !shape->is_array() || offsets == nullptr || !offsets->is_array() ||
      offsets->items().size() != 2) {
    return bad("want {\"dtype\", \"shape\", \"data_offsets\": [begin, end]}");
  }
  TensorEntry e;
  e.dtype = dtype->str();
  const size_t element = DTypeBytes(e.dtype);
  if (element == 0) return bad(absl::StrCat("unknown dtype ", e.dtype));
  int64_t numel = 1;
  for (const JsonValue& d : shape->items()) {
    if (!d.integer().has_value() || *d.integer() < 0 || *d.integer() > kMaxElements) {
      return bad("shape must list non-negative integers");
    }
    e.shape.push_back(*d.integer());
    numel *= *d.integer();
    if (numel > kMaxElements) return bad("shape too large");
  }
  const std::optional<int64_t> begin = offsets->items()[0].integer();
  const std::optional<int64_t> end = offsets->items()[1].integer();
  if (!begin.has_value() || !end.has_value() || *begin < 0 || *end < 0) {
    return bad("data_offsets must be non-negative integers");
  }
  e.begin = static_cast<size_t>(*begin);
  e.end = static_cast<size_t>(*end);
  if (e.begin > e.end || e.end > data_bytes) {
    return bad(absl::StrCat("data_offsets [", e.begin, ", ", e.end, ") outside the ", data_bytes,
                            "-byte data section (truncated file?)"));
  }
  if (e.end - e.begin != static_cast<size_t>(numel) * element) {
    return bad(absl::StrCat(e.end - e.begin, " bytes for ", numel, " elements of ", e.dtype));
  }
  return e;
}

// Tensors must tile the data section exactly: no overlap, no holes.
absl::Status CheckLayout(const std::map<std::string, TensorEntry>& tensors, size_t data_bytes) {
  std::vector<std::pair<const TensorEntry*, const std::string*>> order;
  for (const auto& [name, e] : tensors) order.emplace_back(&e, &name);
  std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    return std::make_pair(a.first->begin, a.first->end) <
           std::make_pair(b.first->begin, b.first->end);
  });
  size_t at = 0;
  const std::string* previous = nullptr;
  for (const auto& [e, name] : order) {
    if (e->begin < at) {
      return Bad(absl::StrCat("tensors ", *previous, " and ", *name, " overlap at byte ", e->begin));
    }
    if (e->begin > at) {
      return Bad(absl::StrCat("bytes [", at, ", ", e->begin, ") of the data section belong to no tensor"));
    }
    at = e->end;
    previous = name;
  }
  if (at != data_bytes) {
    return Bad(absl::StrCat("data section has ", data_bytes, " bytes but the tensors cover ", at));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SafetensorsFile> SafetensorsFile::Read(const std::string& path) {
  BATON_ASSIGN_OR_RETURN(std::string bytes, ReadFile(path));
  absl::StatusOr<SafetensorsFile> file = Parse(std::move(bytes));
  if (!file.ok()) return WithContext(file.status(), path);
  return file;
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Parse(std::string bytes) {
  if (bytes.size() < 8) return Bad(absl::StrCat("file of ", bytes.size(), " bytes is shorter than the 8-byte header length"));
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>(bytes[i]);
  if (header_len > bytes.size() - 8) {
    return Bad(absl::StrCat("header of ", header_len, " bytes runs past the end of the ",
                            bytes.size(), "-byte file (truncated file?)"));
  }
  if (header_len > kMaxHeaderBytes) return Bad(absl::StrCat("header of ", header_len, " bytes is over 100 MB"));
  absl::StatusOr<JsonValue> root = JsonValue::Parse(absl::string_view(bytes).substr(8, header_len));
  if (!root.ok()) return Bad(absl::StrCat("bad header: ", root.status().message()));
  if (!root->is_object()) return Bad("header is not a JSON object");
  SafetensorsFile file;
  file.data_start_ = 8 + header_len;
  const size_t data_bytes = bytes.size() - file.data_start_;
  for (const auto& [name, value] : root->members()) {
    if (name == "__metadata__") {
      if (!value.is_object()) return Bad("__metadata__ is not an object");
      for (const auto& [k, v] : value.members()) {
        if (!v.is_string()) return Bad(absl::StrCat("metadata value of ", k, " is not a string"));
        file.metadata_[k] = v.str();
      }
      continue;
    }
    BATON_ASSIGN_OR_RETURN(TensorEntry entry, ParseEntry(name, value, data_bytes));
    file.tensors_[name] = std::move(entry);
  }
  BATON_RETURN_IF_ERROR(CheckLayout(file.tensors_, data_bytes));
  file.bytes_ = std::move(bytes);
  return file;
}

absl::StatusOr<int64_t> SafetensorsFile::MetadataInt(const std::string& key) const {
  auto it = metadata_.find(key);
  int64_t value = 0;
  if (it == metadata_.end() || !absl::SimpleAtoi(it->second, &value)) {
    return Bad(absl::StrCat("metadata: want an integer \"", key, "\""));
  }
  return value;
}

absl::StatusOr<const TensorEntry*> SafetensorsFile::Entry(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) return absl::NotFoundError(absl::StrCat("safetensors: no tensor named ", name));
  return &it->second;
}

absl::StatusOr<std::vector<double>> SafetensorsFile::Floats(const std::string& name) const {
  BATON_ASSIGN_OR_RETURN(const TensorEntry* e, Entry(name));
  const char* p = bytes_.data() + data_start_ + e->begin;
  std::vector<double> out;
  if (e->dtype == "F32") {
    out.resize((e->end - e->begin) / 4);
    for (size_t i = 0; i < out.size(); ++i) {
      float v;
      std::memcpy(&v, p + 4 * i, 4);
      out[i] = v;
    }
  } else if (e->dtype == "F64") {
    out.resize((e->end - e->begin) / 8);
    std::memcpy(out.data(), p, e->end - e->begin);
  } else if (e->dtype == "F16" || e->dtype == "BF16") {
    // Both widen exactly (to float, hence to double).
    const bool bf16 = e->dtype == "BF16";
    out.resize((e->end - e->begin) / 2);
    for (size_t i = 0; i < out.size(); ++i) {
      uint16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      out[i] = bf16 ? BFloat16ToFloat(h) : Float16ToFloat(h);
    }
  } else {
    return Bad(absl::StrCat(name, " is ", e->dtype, ", want F32, F64, F16 or BF16"));
  }
  return out;
}

absl::StatusOr<std::vector<float>> SafetensorsFile::Float32s(const std::string& name) const {
  BATON_ASSIGN_OR_RETURN(const TensorEntry* e, Entry(name));
  if (e->dtype != "F32") return Bad(absl::StrCat(name, " is ", e->dtype, ", want F32"));
  std::vector<float> out((e->end - e->begin) / 4);
  std::memcpy(out.data(), bytes_.data() + data_start_ + e->begin, e->end - e->begin);
  return out;
}

absl::StatusOr<std::vector<int64_t>> SafetensorsFile::Ints(const std::string& name) const {
  BATON_ASSIGN_OR_RETURN(const TensorEntry* e, Entry(name));
  const char* p = bytes_.data() + data_start_ + e->begin;
  std::vector<int64_t> out;
  if (e->dtype == "I32") {
    out.resize((e->end - e->begin) / 4);
    for (size_t i = 0; i < out.size(); ++i) {
      int32_t v;
      std::memcpy(&v, p + 4 * i, 4);
      out[i] = v;
    }
  } else if (e->dtype == "I64") {
    out.resize((e->end - e->begin) / 8);
    std::memcpy(out.data(), p, e->end - e->begin);
  } else {
    return Bad(absl::StrCat(name, " is ", e->dtype, ", want I32 or I64"));
  }
  return out;
}

absl::Status SafetensorsWriter::Add(const std::string& name, const std::string& dtype,
                                    const std::vector<int64_t>& shape, const void* data,
                                    size_t count, size_t element_bytes) {
  if (name.empty() || name == "__metadata__") {
    return absl::InvalidArgumentError(absl::StrCat("safetensors: \"", name, "\" cannot name a tensor"));
  }
  if (tensors_.count(name) > 0) {
    return absl::InvalidArgumentError(absl::StrCat("safetensors: tensor ", name, " added twice"));
  }
  int64_t numel = 1;
  for (int64_t d : shape) {
    if (d < 0) return absl::InvalidArgumentError(absl::StrCat("safetensors: tensor ", name, " has a negative dimension"));
    numel *= d;
  }
  if (static_cast<size_t>(numel) != count) {
    return absl::InvalidArgumentError(absl::StrCat("safetensors: tensor ", name, " has ", count,
                                                   " values for shape [", absl::StrJoin(shape, ", "), "]"));
  }
  tensors_[name] = Pending{dtype, shape, std::string(static_cast<const char*>(data), count * element_bytes)};
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::AddFloat32(const std::string& name, const std::vector<int64_t>& shape,
                                           absl::Span<const float> values) {
  return Add(name, "F32", shape, values.data(), values.size(), sizeof(float));
}

absl::Status SafetensorsWriter::AddInt32(const std::string& name, const std::vector<int64_t>& shape,
                                         absl::Span<const int32_t> values) {
  return Add(name, "I32", shape, values.data(), values.size(), sizeof(int32_t));
}

std::string SafetensorsWriter::Serialize() const {
  std::string header = "{";
  if (!metadata_.empty()) {
    header += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [k, v] : metadata_) {
      absl::StrAppend(&header, first ? "" : ",", JsonQuote(k), ":", JsonQuote(v));
      first = false;
    }
    header += "}";
  }
  size_t offset = 0;
  for (const auto& [name, t] : tensors_) {
    absl::StrAppend(&header, header.size() > 1 ? "," : "", JsonQuote(name), ":{\"dtype\":\"", t.dtype,
                    "\",\"shape\":[", absl::StrJoin(t.shape, ","), "],\"data_offsets\":[", offset, ",",
                    offset + t.data.size(), "]}");
    offset += t.data.size();
  }
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  out.reserve(8 + header.size() + offset);
  out += header;
  for (const auto& [name, t] : tensors_) out += t.data;
  return out;
}

absl::Status SafetensorsWriter::WriteFile(const std::string& path) const {
  return WriteFileAtomically(path, Serialize());
}

}  // namespace baton
