#include "common/json.h"

#include <cmath>
#include <cstdlib>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace baton {

class JsonParser {
 public:
  explicit JsonParser(absl::string_view text) : text_(text) {}

  absl::StatusOr<JsonValue> ParseDocument() {
    BATON_ASSIGN_OR_RETURN(JsonValue value, ParseValue(0));
    SkipSpace();
    if (pos_ != text_.size()) return Error("trailing characters after the JSON value");
    return value;
  }

 private:
  static constexpr int kMaxDepth = 64;

  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat("JSON: ", what, " at byte ", pos_));
  }

  bool AtEnd() const { return pos_ >= text_.size(); }

  void SkipSpace() {
    while (!AtEnd() && (text_[pos_] == ' ' || text_[pos_] == '\n' || text_[pos_] == '\t' ||
                        text_[pos_] == '\r')) {
      ++pos_;
    }
  }

  bool Consume(absl::string_view word) {
    if (text_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }

  absl::StatusOr<JsonValue> ParseValue(int depth) {
    if (depth > kMaxDepth) return Error("nesting deeper than 64 levels");
    SkipSpace();
    if (AtEnd()) return Error("unexpected end of input");
    JsonValue v;
    const char c = text_[pos_];
    if (c == '{') return ParseObject(depth);
    if (c == '[') return ParseArray(depth);
    if (c == '"') {
      v.kind_ = JsonValue::Kind::kString;
      BATON_ASSIGN_OR_RETURN(v.str_, ParseString());
      return v;
    }
    if (c == '-' || (c >= '0' && c <= '9')) return ParseNumber();
    if (Consume("true") || Consume("false")) {
      v.kind_ = JsonValue::Kind::kBool;
      v.bool_ = c == 't';
      return v;
    }
    if (Consume("null")) return v;
    return Error(absl::StrCat("unexpected character '", std::string(1, c), "'"));
  }

  absl::StatusOr<JsonValue> ParseNumber() {
    const size_t begin = pos_;
    auto digits = [&]() {
      const size_t start = pos_;
      while (!AtEnd() && text_[pos_] >= '0' && text_[pos_] <= '9') ++pos_;
      return pos_ > start;
    };
    bool integral = true;
    if (text_[pos_] == '-') ++pos_;
    if (!AtEnd() && text_[pos_] == '0') {
      ++pos_;
    } else if (!digits()) {
      return Error("bad number");
    }
    if (!AtEnd() && text_[pos_] == '.') {
      ++pos_;
      integral = false;
      if (!digits()) return Error("bad number: no digits after '.'");
    }
    if (!AtEnd() && (text_[pos_] == 'e' || text_[pos_] == 'E')) {
      ++pos_;
      integral = false;
      if (!AtEnd() && (text_[pos_] == '+' || text_[pos_] == '-')) ++pos_;
      if (!digits()) return Error("bad number: no digits in the exponent");
    }
    const std::string literal(text_.substr(begin, pos_ - begin));
    JsonValue v;
    v.kind_ = JsonValue::Kind::kNumber;
    v.number_ = std::strtod(literal.c_str(), nullptr);
    int64_t i = 0;
    if (integral && absl::SimpleAtoi(literal, &i)) v.integer_ = i;
    return v;
  }

  absl::StatusOr<uint32_t> ParseHex4() {
    if (pos_ + 4 > text_.size()) return Error("truncated \\u escape");
    uint32_t cp = 0;
    for (int i = 0; i < 4; ++i) {
      const char h = text_[pos_++];
      cp <<= 4;
      if (h >= '0' && h <= '9') {
        cp |= h - '0';
      } else if (h >= 'a' && h <= 'f') {
        cp |= h - 'a' + 10;
      } else if (h >= 'A' && h <= 'F') {
        cp |= h - 'A' + 10;
      } else {
        return Error("bad hex digit in \\u escape");
      }
    }
    return cp;
  }

  static void AppendUtf8(uint32_t cp, std::string* out) {
    if (cp < 0x80) {
      out->push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }

  absl::StatusOr<std::string> ParseString() {
    ++pos_;  // opening quote
    std::string out;
    while (!AtEnd() && text_[pos_] != '"') {
      const char c = text_[pos_++];
      if (static_cast<unsigned char>(c) < 0x20) return Error("control character inside a string");
      if (c != '\\') {
        out.push_back(c);
        continue;
      }
      if (AtEnd()) break;
      const char e = text_[pos_++];
      switch (e) {
        case '"':
        case '\\':
        case '/':
          out.push_back(e);
          break;
        case 'n':
          out.push_back('\n');
          break;
        case 't':
          out.push_back('\t');
          break;
        case 'r':
          out.push_back('\r');
          break;
        case 'b':
          out.push_back('\b');
          break;
        case 'f':
          out.push_back('\f');
          break;
        case 'u': {
          BATON_ASSIGN_OR_RETURN(uint32_t cp, ParseHex4());
          if (cp >= 0xD800 && cp < 0xDC00) {  // high surrogate: a low one must follow
            if (!Consume("\\u")) return Error("unpaired surrogate in \\u escape");
            BATON_ASSIGN_OR_RETURN(uint32_t low, ParseHex4());
            if (low < 0xDC00 || low >= 0xE000) return Error("unpaired surrogate in \\u escape");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          } else if (cp >= 0xDC00 && cp < 0xE000) {
            return Error("unpaired surrogate in \\u escape");
          }
          AppendUtf8(cp, &out);
          break;
        }
        default:
          return Error("unknown string escape");
      }
    }
    if (AtEnd()) return Error("unterminated string");
    ++pos_;  // closing quote
    return out;
  }

  absl::StatusOr<JsonValue> ParseArray(int depth) {
    JsonValue v;
    v.kind_ = JsonValue::Kind::kArray;
    ++pos_;
    SkipSpace();
    if (Consume("]")) return v;
    while (true) {
      BATON_ASSIGN_OR_RETURN(JsonValue item, ParseValue(depth + 1));
      v.items_.push_back(std::move(item));
      SkipSpace();
      if (Consume(",")) continue;
      if (Consume("]")) return v;
      return Error("expected ',' or ']'");
    }
  }

  absl::StatusOr<JsonValue> ParseObject(int depth) {
    JsonValue v;
    v.kind_ = JsonValue::Kind::kObject;
    ++pos_;
    SkipSpace();
    if (Consume("}")) return v;
    while (true) {
      SkipSpace();
      if (AtEnd() || text_[pos_] != '"') return Error("expected a member name");
      BATON_ASSIGN_OR_RETURN(std::string key, ParseString());
      if (v.Find(key) != nullptr) return Error(absl::StrCat("duplicate member \"", key, "\""));
      SkipSpace();
      if (!Consume(":")) return Error("expected ':'");
      BATON_ASSIGN_OR_RETURN(JsonValue value, ParseValue(depth + 1));
      v.members_.emplace_back(std::move(key), std::move(value));
      SkipSpace();
      if (Consume(",")) continue;
      if (Consume("}")) return v;
      return Error("expected ',' or '}'");
    }
  }

  absl::string_view text_;
  size_t pos_ = 0;
};

absl::StatusOr<JsonValue> JsonValue::Parse(absl::string_view text) {
  return JsonParser(text).ParseDocument();
}

const JsonValue* JsonValue::Find(absl::string_view key) const {
  for (const auto& [k, v] : members_) {
    if (k == key) return &v;
  }
  return nullptr;
}

namespace {

// Length of the valid UTF-8 sequence at s[i], or 0 when it is invalid.
size_t Utf8SequenceLength(absl::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  size_t n = 0;
  uint32_t min = 0;
  if (c < 0x80) return 1;
  if ((c & 0xE0) == 0xC0) {
    n = 2;
    min = 0x80;
  } else if ((c & 0xF0) == 0xE0) {
    n = 3;
    min = 0x800;
  } else if ((c & 0xF8) == 0xF0) {
    n = 4;
    min = 0x10000;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  uint32_t cp = c & (0x7F >> n);
  for (size_t k = 1; k < n; ++k) {
    if ((b(i + k) & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (b(i + k) & 0x3F);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp < 0xE000)) return 0;
  return n;
}

}  // namespace

std::string JsonQuote(absl::string_view s) {
  std::string out = "\"";
  for (size_t i = 0; i < s.size();) {
    const char c = s[i];
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(c);
      ++i;
    } else if (c == '\n') {
      out += "\\n";
      ++i;
    } else if (c == '\t') {
      out += "\\t";
      ++i;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += absl::StrFormat("\\u%04x", static_cast<int>(c));
      ++i;
    } else if (const size_t n = Utf8SequenceLength(s, i); n > 0) {
      out.append(s.data() + i, n);
      i += n;
    } else {
      out += "\xEF\xBF\xBD";  // U+FFFD for a byte that is not valid UTF-8
      ++i;
    }
  }
  return out + "\"";
}

std::string JsonNumber(double v) {
  if (!std::isfinite(v)) return "null";
  for (int precision = 1; precision < 17; ++precision) {
    std::string s = absl::StrFormat("%.*g", precision, v);
    if (std::strtod(s.c_str(), nullptr) == v) return s;
  }
  return absl::StrFormat("%.17g", v);
}

}  // namespace baton
