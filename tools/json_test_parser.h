#pragma once

// Test-only: a strict RFC 8259 parser, to check that zsctl's JSON documents
// parse and to read values back out of them.

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace zeroshard::tools {

struct JsonValue {
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject };
  Type type = Type::kNull;
  bool boolean = false;
  double number = 0;
  std::string number_text;          // the number as written, e.g. "7500000000"
  std::string string;               // decoded
  std::vector<JsonValue> elements;  // array elements; object member values
  std::vector<std::string> keys;    // object member keys, in document order

  bool is_null() const { return type == Type::kNull; }
  // The member named `key` of an object, or nullptr.
  const JsonValue* Find(absl::string_view key) const;
};

// One JSON value with optional whitespace around it. InvalidArgument with the
// byte offset for anything RFC 8259 does not allow (raw control characters in
// strings, invalid UTF-8, lone surrogate escapes, leading zeros, trailing
// text), and for duplicate keys in an object.
absl::StatusOr<JsonValue> ParseJson(absl::string_view text);

}  // namespace zeroshard::tools
