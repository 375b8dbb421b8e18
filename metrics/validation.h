#pragma once

// Checks on names, labels and bucket boundaries. Each returns OK or
// InvalidArgument with a message naming the offending input.

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "metrics/metric_family.h"
#include "metrics/metric_spec.h"

namespace zeroshard::metrics {

// [a-zA-Z_:][a-zA-Z0-9_:]*
absl::Status ValidateMetricName(absl::string_view name);

// [a-zA-Z_][a-zA-Z0-9_]*, not starting with "__" (reserved by Prometheus).
absl::Status ValidateLabelName(absl::string_view name);

// Any valid UTF-8 (Prometheus rejects a scrape containing anything else).
absl::Status ValidateLabelValue(absl::string_view value);

// Each name valid, no duplicates, and no "le" for histograms.
absl::Status ValidateLabelNames(const std::vector<std::string>& names,
                                MetricType type);

// `labels` uses exactly `declared` names (any order) with valid values.
absl::Status ValidateLabels(const Labels& labels,
                            const std::vector<std::string>& declared);

// Finite and strictly increasing; a trailing +Inf is allowed (it is implied
// anyway). Empty is allowed: the histogram then has only the +Inf bucket.
absl::Status ValidateBucketBoundaries(const std::vector<double>& boundaries);

}  // namespace zeroshard::metrics
