// A small JSON reader and writer helpers for the files baton reads and writes
// itself (safetensors headers, checkpoint manifests, summary.json, traces).
// Parse() accepts RFC 8259 JSON (objects keep their member order; duplicate
// member names are an error) with a nesting limit, and reports the byte
// offset of the first problem. JsonQuote() escapes a string for output and
// replaces invalid UTF-8 with U+FFFD, so what baton writes always parses.
#ifndef BATON_COMMON_JSON_H_
#define BATON_COMMON_JSON_H_

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace baton {

class JsonValue {
 public:
  enum class Kind { kNull, kBool, kNumber, kString, kArray, kObject };

  // INVALID_ARGUMENT naming the byte offset for anything that is not one
  // complete JSON value (trailing characters included).
  static absl::StatusOr<JsonValue> Parse(absl::string_view text);

  Kind kind() const { return kind_; }
  bool is_object() const { return kind_ == Kind::kObject; }
  bool is_array() const { return kind_ == Kind::kArray; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_number() const { return kind_ == Kind::kNumber; }

  bool bool_value() const { return bool_; }
  double number() const { return number_; }
  // The number as an int64 when it was written as an integer that fits.
  std::optional<int64_t> integer() const { return integer_; }
  const std::string& str() const { return str_; }
  const std::vector<JsonValue>& items() const { return items_; }
  const std::vector<std::pair<std::string, JsonValue>>& members() const { return members_; }
  // The member named `key` of an object; null when absent or not an object.
  const JsonValue* Find(absl::string_view key) const;

 private:
  friend class JsonParser;

  Kind kind_ = Kind::kNull;
  bool bool_ = false;
  double number_ = 0;
  std::optional<int64_t> integer_;
  std::string str_;
  std::vector<JsonValue> items_;
  std::vector<std::pair<std::string, JsonValue>> members_;
};

// `s` as a quoted JSON string literal.
std::string JsonQuote(absl::string_view s);

// A finite number as a JSON number (shortest form that reads back the same
// double); infinities and NaN, which JSON cannot hold, as null.
std::string JsonNumber(double v);

}  // namespace baton

#endif  // BATON_COMMON_JSON_H_
