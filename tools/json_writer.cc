#include "tools/json_writer.h"

#include <cassert>
#include <cmath>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace zeroshard::tools {

size_t Utf8SequenceLength(absl::string_view s) {
  if (s.empty()) return 0;
  const auto byte = [&](size_t i) { return static_cast<unsigned char>(s[i]); };
  const unsigned char b0 = byte(0);
  size_t n;
  unsigned char lo = 0x80, hi = 0xBF;  // the range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    n = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    n = 3;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    n = 4;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  if (s.size() < n || byte(1) < lo || byte(1) > hi) return 0;
  for (size_t i = 2; i < n; ++i) {
    if (byte(i) < 0x80 || byte(i) > 0xBF) return 0;
  }
  return n;
}

void AppendJsonString(absl::string_view text, std::string* out) {
  out->push_back('"');
  size_t i = 0;
  while (i < text.size()) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c == '"' || c == '\\') {
      out->push_back('\\');
      out->push_back(static_cast<char>(c));
      ++i;
    } else if (c < 0x20) {
      absl::StrAppendFormat(out, "\\u%04x", c);
      ++i;
    } else if (c < 0x80) {
      out->push_back(static_cast<char>(c));
      ++i;
    } else if (const size_t n = Utf8SequenceLength(text.substr(i)); n > 0) {
      out->append(text.data() + i, n);
      i += n;
    } else {
      out->append("\xEF\xBF\xBD");  // U+FFFD REPLACEMENT CHARACTER
      ++i;
    }
  }
  out->push_back('"');
}

void JsonWriter::BeforeValue() {
  assert(!done_ && "a second top-level value");
  if (levels_.empty()) return;
  Level& level = levels_.back();
  if (level.object) {
    assert(level.after_key && "an object member without its Key()");
    level.after_key = false;
    return;
  }
  if (!level.empty) out_.push_back(',');
  level.empty = false;
}

JsonWriter& JsonWriter::BeginObject() {
  BeforeValue();
  out_.push_back('{');
  levels_.push_back(Level{true});
  return *this;
}

JsonWriter& JsonWriter::EndObject() {
  assert(!levels_.empty() && levels_.back().object && !levels_.back().after_key);
  levels_.pop_back();
  out_.push_back('}');
  done_ = levels_.empty();
  return *this;
}

JsonWriter& JsonWriter::BeginArray() {
  BeforeValue();
  out_.push_back('[');
  levels_.push_back(Level{false});
  return *this;
}

JsonWriter& JsonWriter::EndArray() {
  assert(!levels_.empty() && !levels_.back().object);
  levels_.pop_back();
  out_.push_back(']');
  done_ = levels_.empty();
  return *this;
}

JsonWriter& JsonWriter::Key(absl::string_view key) {
  assert(!levels_.empty() && levels_.back().object && !levels_.back().after_key);
  Level& level = levels_.back();
  if (!level.empty) out_.push_back(',');
  level.empty = false;
  level.after_key = true;
  AppendJsonString(key, &out_);
  out_.push_back(':');
  return *this;
}

JsonWriter& JsonWriter::String(absl::string_view value) {
  BeforeValue();
  AppendJsonString(value, &out_);
  done_ = levels_.empty();
  return *this;
}

JsonWriter& JsonWriter::Int(int64_t value) {
  BeforeValue();
  absl::StrAppend(&out_, value);
  done_ = levels_.empty();
  return *this;
}

JsonWriter& JsonWriter::Uint(uint64_t value) {
  BeforeValue();
  absl::StrAppend(&out_, value);
  done_ = levels_.empty();
  return *this;
}

JsonWriter& JsonWriter::Double(double value) {
  if (!std::isfinite(value)) return Null();
  BeforeValue();
  // %g writes only digits, '-', '.', 'e' and '+' for finite values: a JSON
  // number (no locale: zsctl never calls setlocale).
  std::string text = absl::StrFormat("%.15g", value);
  double back;
  if (!absl::SimpleAtod(text, &back) || back != value) text = absl::StrFormat("%.17g", value);
  out_.append(text);
  done_ = levels_.empty();
  return *this;
}

JsonWriter& JsonWriter::Bool(bool value) {
  BeforeValue();
  out_.append(value ? "true" : "false");
  done_ = levels_.empty();
  return *this;
}

JsonWriter& JsonWriter::Null() {
  BeforeValue();
  out_.append("null");
  done_ = levels_.empty();
  return *this;
}

std::string JsonWriter::Finish() {
  assert(done_ && levels_.empty() && "an unfinished document");
  std::string doc = std::move(out_);
  doc.push_back('\n');
  out_.clear();
  levels_.clear();
  done_ = false;
  return doc;
}

}  // namespace zeroshard::tools
