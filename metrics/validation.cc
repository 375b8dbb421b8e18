#include "metrics/validation.h"

#include <cmath>
#include <cstdint>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace zeroshard::metrics {
namespace {

bool IsAlpha(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
}
bool IsDigit(char c) { return c >= '0' && c <= '9'; }

// Returns the number of bytes of the UTF-8 sequence starting at s[i], or 0 if
// it is not a well-formed, shortest-form, non-surrogate code point.
int Utf8SequenceLength(absl::string_view s, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<uint8_t>(s[k]); };
  const uint8_t b0 = byte(i);
  if (b0 < 0x80) return 1;
  int len;
  uint32_t cp;
  if ((b0 & 0xE0) == 0xC0) {
    len = 2;
    cp = b0 & 0x1F;
  } else if ((b0 & 0xF0) == 0xE0) {
    len = 3;
    cp = b0 & 0x0F;
  } else if ((b0 & 0xF8) == 0xF0) {
    len = 4;
    cp = b0 & 0x07;
  } else {
    return 0;
  }
  if (i + len > s.size()) return 0;
  for (int k = 1; k < len; ++k) {
    const uint8_t b = byte(i + k);
    if ((b & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (b & 0x3F);
  }
  static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < kMin[len] || cp > 0x10FFFF) return 0;
  if (cp >= 0xD800 && cp <= 0xDFFF) return 0;
  return len;
}

}  // namespace

absl::Status ValidateMetricName(absl::string_view name) {
  if (name.empty()) {
    return absl::InvalidArgumentError("metric name is empty");
  }
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool ok = IsAlpha(c) || c == '_' || c == ':' || (i > 0 && IsDigit(c));
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrCat("invalid metric name \"", name,
                       "\": must match [a-zA-Z_:][a-zA-Z0-9_:]*"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateLabelName(absl::string_view name) {
  if (name.empty()) {
    return absl::InvalidArgumentError("label name is empty");
  }
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool ok = IsAlpha(c) || c == '_' || (i > 0 && IsDigit(c));
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrCat("invalid label name \"", name,
                       "\": must match [a-zA-Z_][a-zA-Z0-9_]*"));
    }
  }
  if (name.size() >= 2 && name[0] == '_' && name[1] == '_') {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid label name \"", name,
                     "\": names starting with __ are reserved"));
  }
  return absl::OkStatus();
}

absl::Status ValidateLabelValue(absl::string_view value) {
  for (size_t i = 0; i < value.size();) {
    const int len = Utf8SequenceLength(value, i);
    if (len == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("label value is not valid UTF-8 (byte offset ", i, ")"));
    }
    i += len;
  }
  return absl::OkStatus();
}

absl::Status ValidateLabelNames(const std::vector<std::string>& names,
                                MetricType type) {
  std::set<absl::string_view> seen;
  for (const std::string& name : names) {
    if (absl::Status s = ValidateLabelName(name); !s.ok()) return s;
    if (!seen.insert(name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("label name \"", name, "\" declared twice"));
    }
    if (type == MetricType::kHistogram && name == "le") {
      return absl::InvalidArgumentError(
          "label name \"le\" is reserved for histogram buckets");
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateLabels(const Labels& labels,
                            const std::vector<std::string>& declared) {
  bool names_match = labels.size() == declared.size();
  for (const std::string& name : declared) {
    if (!names_match) break;
    names_match = labels.count(name) > 0;
  }
  if (!names_match) {
    std::vector<absl::string_view> given;
    for (const auto& [name, value] : labels) given.push_back(name);
    return absl::InvalidArgumentError(
        absl::StrCat("label names {", absl::StrJoin(given, ","),
                     "} differ from the family's declared {",
                     absl::StrJoin(declared, ","), "}"));
  }
  for (const auto& [name, value] : labels) {
    if (absl::Status s = ValidateLabelValue(value); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("label \"", name, "\": ", s.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateBucketBoundaries(const std::vector<double>& boundaries) {
  for (size_t i = 0; i < boundaries.size(); ++i) {
    const double b = boundaries[i];
    const bool last = i + 1 == boundaries.size();
    if (!std::isfinite(b) && !(last && b == INFINITY)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "bucket boundary ", i, " is ", b, "; boundaries must be finite"));
    }
    if (i > 0 && !(boundaries[i - 1] < b)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "bucket boundaries must be strictly increasing; boundary ", i, " (",
          b, ") follows ", boundaries[i - 1]));
    }
  }
  return absl::OkStatus();
}

}  // namespace zeroshard::metrics
