#pragma once

// Prometheus text exposition format, version 0.0.4:
// https://prometheus.io/docs/instrumenting/exposition_formats/

#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "metrics/metric_family.h"

namespace zeroshard::metrics {

// The Content-Type of what TextSerializer writes.
inline constexpr absl::string_view kTextContentType =
    "text/plain; version=0.0.4; charset=utf-8";

class TextSerializer {
 public:
  // `# HELP`, `# TYPE` and the samples of each family, in the given order
  // (Registry::Collect sorts families by name and series by labels). Labels
  // are written in name order; a histogram's `le` comes last. Families
  // without series are skipped. Empty input gives "".
  std::string Serialize(const std::vector<MetricFamily>& families) const;
};

// Shortest text that parses back to the same double ("0.1", "1e+06"), or
// "+Inf", "-Inf", "NaN".
std::string FormatDouble(double value);

// For `# HELP` text: `\` -> `\\`, newline -> `\n`.
std::string EscapeHelp(absl::string_view help);

// For label values: `\` -> `\\`, `"` -> `\"`, newline -> `\n`.
std::string EscapeLabelValue(absl::string_view value);

}  // namespace zeroshard::metrics
