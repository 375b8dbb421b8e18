#pragma once

// zsctl --output=json's documents, built with nlohmann::json: ordered_json
// keeps members in the order they are set, and JsonDocument writes compact.

#include <string>

#include "nlohmann/json.hpp"

namespace zeroshard::tools {

using Json = nlohmann::ordered_json;

// `value` as a JSON number: an integer when it is whole and a double holds it
// exactly (|value| <= 2^53), so that 7.5e9 reads 7500000000 rather than
// nlohmann's 7500000000.0; null for NaN and infinities, which JSON cannot
// represent.
Json JsonNumber(double value);

// `document` in one line, then a newline. Invalid UTF-8 in a string (a
// daemon's error message, say) is written as U+FFFD, so the result is always
// valid JSON; never throws.
std::string JsonDocument(const Json& document);

}  // namespace zeroshard::tools
