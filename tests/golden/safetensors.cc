#include "tests/golden/safetensors.h"

#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace baton::golden {
namespace {

// The JSON subset safetensors headers use: objects, arrays, strings,
// non-negative integers.
struct Json {
  enum Kind { kObject, kArray, kString, kNumber } kind = kNumber;
  std::string str;
  int64_t number = 0;
  std::vector<Json> items;
  std::vector<std::pair<std::string, Json>> members;
};

class JsonParser {
 public:
  explicit JsonParser(const std::string& text) : text_(text) {}

  absl::StatusOr<Json> ParseDocument() {
    BATON_ASSIGN_OR_RETURN(Json value, ParseValue(0));
    SkipSpace();
    if (pos_ != text_.size()) return Error("trailing characters after the header object");
    return value;
  }

 private:
  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrCat("safetensors header: ", what, " at byte ", pos_));
  }

  void SkipSpace() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\n' ||
                                   text_[pos_] == '\t' || text_[pos_] == '\r')) {
      ++pos_;
    }
  }

  absl::StatusOr<Json> ParseValue(int depth) {
    if (depth > 16) return Error("nesting too deep");
    SkipSpace();
    if (pos_ >= text_.size()) return Error("unexpected end");
    const char c = text_[pos_];
    if (c == '{') return ParseObject(depth);
    if (c == '[') return ParseArray(depth);
    if (c == '"') {
      Json j;
      j.kind = Json::kString;
      BATON_ASSIGN_OR_RETURN(j.str, ParseString());
      return j;
    }
    if (c >= '0' && c <= '9') {
      Json j;
      while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') {
        if (j.number > (INT64_MAX - 9) / 10) return Error("integer too large");
        j.number = j.number * 10 + (text_[pos_++] - '0');
      }
      return j;
    }
    return Error(absl::StrCat("unexpected character '", std::string(1, c), "'"));
  }

  absl::StatusOr<std::string> ParseString() {
    ++pos_;  // opening quote
    std::string out;
    while (pos_ < text_.size() && text_[pos_] != '"') {
      char c = text_[pos_++];
      if (c == '\\') {
        if (pos_ >= text_.size()) break;
        const char e = text_[pos_++];
        switch (e) {
          case '"':
          case '\\':
          case '/':
            c = e;
            break;
          case 'n':
            c = '\n';
            break;
          case 't':
            c = '\t';
            break;
          case 'r':
            c = '\r';
            break;
          case 'b':
            c = '\b';
            break;
          case 'f':
            c = '\f';
            break;
          default:
            return Error("unsupported string escape");
        }
      }
      out.push_back(c);
    }
    if (pos_ >= text_.size()) return Error("unterminated string");
    ++pos_;  // closing quote
    return out;
  }

  absl::StatusOr<Json> ParseArray(int depth) {
    Json j;
    j.kind = Json::kArray;
    ++pos_;
    SkipSpace();
    if (pos_ < text_.size() && text_[pos_] == ']') {
      ++pos_;
      return j;
    }
    while (true) {
      BATON_ASSIGN_OR_RETURN(Json item, ParseValue(depth + 1));
      j.items.push_back(std::move(item));
      SkipSpace();
      if (pos_ < text_.size() && text_[pos_] == ',') {
        ++pos_;
      } else if (pos_ < text_.size() && text_[pos_] == ']') {
        ++pos_;
        return j;
      } else {
        return Error("expected ',' or ']'");
      }
    }
  }

  absl::StatusOr<Json> ParseObject(int depth) {
    Json j;
    j.kind = Json::kObject;
    ++pos_;
    SkipSpace();
    if (pos_ < text_.size() && text_[pos_] == '}') {
      ++pos_;
      return j;
    }
    while (true) {
      SkipSpace();
      if (pos_ >= text_.size() || text_[pos_] != '"') return Error("expected a member name");
      BATON_ASSIGN_OR_RETURN(std::string key, ParseString());
      SkipSpace();
      if (pos_ >= text_.size() || text_[pos_] != ':') return Error("expected ':'");
      ++pos_;
      BATON_ASSIGN_OR_RETURN(Json value, ParseValue(depth + 1));
      j.members.emplace_back(std::move(key), std::move(value));
      SkipSpace();
      if (pos_ < text_.size() && text_[pos_] == ',') {
        ++pos_;
      } else if (pos_ < text_.size() && text_[pos_] == '}') {
        ++pos_;
        return j;
      } else {
        return Error("expected ',' or '}'");
      }
    }
  }

  const std::string& text_;
  size_t pos_ = 0;
};

const Json* Member(const Json& object, absl::string_view key) {
  for (const auto& [k, v] : object.members) {
    if (k == key) return &v;
  }
  return nullptr;
}

size_t DTypeBytes(const std::string& dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL") return 1;
  return 0;
}

absl::StatusOr<TensorEntry> ParseEntry(const std::string& name, const Json& j, size_t data_bytes) {
  auto bad = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("safetensors tensor ", name, ": ", what));
  };
  const Json* dtype = Member(j, "dtype");
  const Json* shape = Member(j, "shape");
  const Json* offsets = Member(j, "data_offsets");
  if (j.kind != Json::kObject || dtype == nullptr || dtype->kind != Json::kString ||
      shape == nullptr || shape->kind != Json::kArray || offsets == nullptr ||
      offsets->kind != Json::kArray || offsets->items.size() != 2) {
    return bad("want {dtype, shape, data_offsets: [begin, end]}");
  }
  TensorEntry e;
  e.dtype = dtype->str;
  const size_t element = DTypeBytes(e.dtype);
  if (element == 0) return bad(absl::StrCat("unknown dtype ", e.dtype));
  int64_t numel = 1;
  for (const Json& d : shape->items) {
    if (d.kind != Json::kNumber || d.number > (int64_t{1} << 40)) return bad("bad shape");
    e.shape.push_back(d.number);
    numel *= d.number;
    if (numel > (int64_t{1} << 40)) return bad("shape too large");
  }
  if (offsets->items[0].kind != Json::kNumber || offsets->items[1].kind != Json::kNumber) {
    return bad("data_offsets must be integers");
  }
  e.begin = static_cast<size_t>(offsets->items[0].number);
  e.end = static_cast<size_t>(offsets->items[1].number);
  if (e.begin > e.end || e.end > data_bytes) {
    return bad(absl::StrCat("data_offsets [", e.begin, ", ", e.end, ") outside the ", data_bytes,
                            "-byte data section"));
  }
  if (e.end - e.begin != static_cast<size_t>(numel) * element) {
    return bad(absl::StrCat(e.end - e.begin, " bytes for ", numel, " elements of ", e.dtype));
  }
  return e;
}

}  // namespace

absl::StatusOr<SafetensorsFile> SafetensorsFile::Read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::ostringstream buffer;
  buffer << in.rdbuf();
  return Parse(buffer.str());
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Parse(std::string bytes) {
  if (bytes.size() < 8) return absl::InvalidArgumentError("safetensors: file shorter than 8 bytes");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>(bytes[i]);
  if (header_len > bytes.size() - 8) {
    return absl::InvalidArgumentError(absl::StrCat("safetensors: header of ", header_len,
                                                   " bytes runs past the end of the file"));
  }
  const std::string header = bytes.substr(8, header_len);
  BATON_ASSIGN_OR_RETURN(Json root, JsonParser(header).ParseDocument());
  if (root.kind != Json::kObject) {
    return absl::InvalidArgumentError("safetensors: header is not a JSON object");
  }
  SafetensorsFile file;
  file.data_start_ = 8 + header_len;
  const size_t data_bytes = bytes.size() - file.data_start_;
  for (const auto& [name, value] : root.members) {
    if (name == "__metadata__") {
      for (const auto& [k, v] : value.members) {
        if (v.kind != Json::kString) {
          return absl::InvalidArgumentError(
              absl::StrCat("safetensors: metadata value of ", k, " is not a string"));
        }
        file.metadata_[k] = v.str;
      }
      continue;
    }
    BATON_ASSIGN_OR_RETURN(TensorEntry entry, ParseEntry(name, value, data_bytes));
    file.tensors_[name] = std::move(entry);
  }
  file.bytes_ = std::move(bytes);
  return file;
}

absl::StatusOr<int64_t> SafetensorsFile::MetadataInt(const std::string& key) const {
  auto it = metadata_.find(key);
  int64_t value = 0;
  if (it == metadata_.end() || !absl::SimpleAtoi(it->second, &value)) {
    return absl::InvalidArgumentError(
        absl::StrCat("safetensors metadata: want an integer \"", key, "\""));
  }
  return value;
}

absl::StatusOr<const TensorEntry*> SafetensorsFile::Entry(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat("safetensors: no tensor named ", name));
  }
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
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("safetensors: ", name, " is ", e->dtype, ", want F32 or F64"));
  }
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
    return absl::InvalidArgumentError(
        absl::StrCat("safetensors: ", name, " is ", e->dtype, ", want I32 or I64"));
  }
  return out;
}

}  // namespace baton::golden
