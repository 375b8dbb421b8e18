#pragma once

// A small JSON (RFC 8259) writer for zsctl --output=json: compact output,
// keys in the order written. Not thread-safe; one writer per document.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace zeroshard::tools {

// The length of the well-formed UTF-8 sequence at the start of `s` (Unicode
// table 3-7: no overlong forms, no surrogates, nothing above U+10FFFF), or 0.
size_t Utf8SequenceLength(absl::string_view s);

// Appends `text` to *out as a JSON string literal: `"` and `\` escaped with a
// backslash, control characters (U+0000..U+001F) as \u00XX, valid UTF-8
// copied as is, and each byte of invalid UTF-8 replaced by U+FFFD, so the
// result is always valid UTF-8 JSON.
void AppendJsonString(absl::string_view text, std::string* out);

// A document built by calls in document order:
//   JsonWriter w;
//   w.BeginObject().Key("jobs").BeginArray().Uint(3).EndArray().EndObject();
//   std::string doc = w.Finish();  // {"jobs":[3]}
// Inside an object every value follows a Key(). Calls out of order (a value
// without its key, an unbalanced End, Finish before the document is whole)
// are the caller's bug: they assert in debug builds.
class JsonWriter {
 public:
  JsonWriter& BeginObject();
  JsonWriter& EndObject();
  JsonWriter& BeginArray();
  JsonWriter& EndArray();
  JsonWriter& Key(absl::string_view key);

  JsonWriter& String(absl::string_view value);
  JsonWriter& Int(int64_t value);
  JsonWriter& Uint(uint64_t value);
  // The shortest of %.15g and %.17g that reads back as `value`; NaN and
  // infinities (which JSON cannot represent) as null.
  JsonWriter& Double(double value);
  JsonWriter& Bool(bool value);
  JsonWriter& Null();

  // The document, followed by a newline. The writer is empty afterwards.
  std::string Finish();

 private:
  // Before a value: the comma after its preceding sibling, if any.
  void BeforeValue();

  struct Level {
    bool object;
    bool empty = true;       // no member or element yet
    bool after_key = false;  // an object's Key() awaits its value
  };
  std::string out_;
  std::vector<Level> levels_;
  bool done_ = false;  // the top-level value is complete
};

}  // namespace zeroshard::tools
