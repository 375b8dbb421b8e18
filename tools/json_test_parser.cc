#include "tools/json_test_parser.h"

#include <cstdint>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "tools/json_writer.h"

namespace zeroshard::tools {
namespace {

bool IsDigit(char c) { return c >= '0' && c <= '9'; }

void AppendUtf8(uint32_t cp, std::string* out) {
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

class Parser {
 public:
  explicit Parser(absl::string_view text) : s_(text) {}

  absl::StatusOr<JsonValue> Document() {
    JsonValue v;
    SkipSpace();
    if (absl::Status st = Value(&v, 0); !st.ok()) return st;
    SkipSpace();
    if (pos_ != s_.size()) return Error("text after the value");
    return v;
  }

 private:
  static constexpr int kMaxDepth = 64;

  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat("JSON: ", what, " at byte ", pos_));
  }

  bool AtEnd() const { return pos_ >= s_.size(); }
  char Peek() const { return AtEnd() ? '\0' : s_[pos_]; }

  void SkipSpace() {
    while (!AtEnd() &&
           (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) {
      ++pos_;
    }
  }

  bool Literal(absl::string_view word) {
    if (s_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }

  absl::Status Value(JsonValue* v, int depth) {
    if (depth > kMaxDepth) return Error("nesting too deep");
    switch (Peek()) {
      case '{':
        return Object(v, depth);
      case '[':
        return Array(v, depth);
      case '"':
        v->type = JsonValue::Type::kString;
        return String(&v->string);
      case 't':
      case 'f':
        v->type = JsonValue::Type::kBool;
        v->boolean = Peek() == 't';
        return Literal(v->boolean ? "true" : "false") ? absl::OkStatus() : Error("bad literal");
      case 'n':
        v->type = JsonValue::Type::kNull;
        return Literal("null") ? absl::OkStatus() : Error("bad literal");
      default:
        v->type = JsonValue::Type::kNumber;
        return Number(v);
    }
  }

  absl::Status Object(JsonValue* v, int depth) {
    v->type = JsonValue::Type::kObject;
    ++pos_;  // {
    SkipSpace();
    if (Peek() == '}') {
      ++pos_;
      return absl::OkStatus();
    }
    while (true) {
      SkipSpace();
      if (Peek() != '"') return Error("expected a key");
      std::string key;
      if (absl::Status st = String(&key); !st.ok()) return st;
      if (v->Find(key) != nullptr) return Error(absl::StrCat("duplicate key \"", key, "\""));
      SkipSpace();
      if (Peek() != ':') return Error("expected ':'");
      ++pos_;
      SkipSpace();
      JsonValue member;
      if (absl::Status st = Value(&member, depth + 1); !st.ok()) return st;
      v->keys.push_back(std::move(key));
      v->elements.push_back(std::move(member));
      SkipSpace();
      if (Peek() == ',') {
        ++pos_;
      } else if (Peek() == '}') {
        ++pos_;
        return absl::OkStatus();
      } else {
        return Error("expected ',' or '}'");
      }
    }
  }

  absl::Status Array(JsonValue* v, int depth) {
    v->type = JsonValue::Type::kArray;
    ++pos_;  // [
    SkipSpace();
    if (Peek() == ']') {
      ++pos_;
      return absl::OkStatus();
    }
    while (true) {
      SkipSpace();
      JsonValue element;
      if (absl::Status st = Value(&element, depth + 1); !st.ok()) return st;
      v->elements.push_back(std::move(element));
      SkipSpace();
      if (Peek() == ',') {
        ++pos_;
      } else if (Peek() == ']') {
        ++pos_;
        return absl::OkStatus();
      } else {
        return Error("expected ',' or ']'");
      }
    }
  }

  absl::Status Number(JsonValue* v) {
    const size_t start = pos_;
    if (Peek() == '-') ++pos_;
    if (Peek() == '0') {
      ++pos_;
    } else if (IsDigit(Peek())) {
      while (IsDigit(Peek())) ++pos_;
    } else {
      return Error("expected a value");
    }
    if (Peek() == '.') {
      ++pos_;
      if (!IsDigit(Peek())) return Error("expected a digit after '.'");
      while (IsDigit(Peek())) ++pos_;
    }
    if (Peek() == 'e' || Peek() == 'E') {
      ++pos_;
      if (Peek() == '+' || Peek() == '-') ++pos_;
      if (!IsDigit(Peek())) return Error("expected an exponent");
      while (IsDigit(Peek())) ++pos_;
    }
    v->number_text = std::string(s_.substr(start, pos_ - start));
    if (!absl::SimpleAtod(v->number_text, &v->number)) return Error("bad number");
    return absl::OkStatus();
  }

  absl::Status Hex4(uint32_t* out) {
    if (s_.size() - pos_ < 4) return Error("short \\u escape");
    *out = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = s_[pos_++];
      uint32_t d;
      if (IsDigit(c)) {
        d = c - '0';
      } else if (c >= 'a' && c <= 'f') {
        d = c - 'a' + 10;
      } else if (c >= 'A' && c <= 'F') {
        d = c - 'A' + 10;
      } else {
        return Error("bad hex digit in \\u escape");
      }
      *out = *out * 16 + d;
    }
    return absl::OkStatus();
  }

  // A raw UTF-8 sequence (Unicode table 3-7), appended to *out.
  absl::Status Utf8(std::string* out) {
    const size_t n = Utf8SequenceLength(s_.substr(pos_));
    if (n == 0) return Error("invalid UTF-8");
    out->append(s_.data() + pos_, n);
    pos_ += n;
    return absl::OkStatus();
  }

  absl::Status String(std::string* out) {
    ++pos_;  // "
    while (true) {
      if (AtEnd()) return Error("unterminated string");
      const unsigned char c = static_cast<unsigned char>(s_[pos_]);
      if (c == '"') {
        ++pos_;
        return absl::OkStatus();
      }
      if (c < 0x20) return Error("raw control character in a string");
      if (c >= 0x80) {
        if (absl::Status st = Utf8(out); !st.ok()) return st;
        continue;
      }
      ++pos_;
      if (c != '\\') {
        out->push_back(static_cast<char>(c));
        continue;
      }
      if (AtEnd()) return Error("unterminated escape");
      const char e = s_[pos_++];
      switch (e) {
        case '"':
        case '\\':
        case '/':
          out->push_back(e);
          break;
        case 'b':
          out->push_back('\b');
          break;
        case 'f':
          out->push_back('\f');
          break;
        case 'n':
          out->push_back('\n');
          break;
        case 'r':
          out->push_back('\r');
          break;
        case 't':
          out->push_back('\t');
          break;
        case 'u': {
          uint32_t cp;
          if (absl::Status st = Hex4(&cp); !st.ok()) return st;
          if (cp >= 0xDC00 && cp <= 0xDFFF) return Error("lone low surrogate");
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            uint32_t low;
            if (!Literal("\\u")) return Error("lone high surrogate");
            if (absl::Status st = Hex4(&low); !st.ok()) return st;
            if (low < 0xDC00 || low > 0xDFFF) return Error("lone high surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          }
          AppendUtf8(cp, out);
          break;
        }
        default:
          return Error("bad escape");
      }
    }
  }

  absl::string_view s_;
  size_t pos_ = 0;
};

}  // namespace

const JsonValue* JsonValue::Find(absl::string_view key) const {
  if (type != Type::kObject) return nullptr;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (keys[i] == key) return &elements[i];
  }
  return nullptr;
}

absl::StatusOr<JsonValue> ParseJson(absl::string_view text) { return Parser(text).Document(); }

}  // namespace zeroshard::tools
