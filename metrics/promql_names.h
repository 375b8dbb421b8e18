#pragma once

// Which exported metric families a PromQL expression (a dashboard panel's or
// an alert rule's) refers to, and with which label matchers, for tests that
// hold queries to the contract in metric_names.h.

#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace zeroshard::metrics::testing {

struct Selector {
  // The family: a histogram's `_bucket`, `_sum` and `_count` series map to
  // their family's name when that family is a histogram in the contract; any
  // other name stays as written (so an unknown one shows up as itself).
  std::string family;
  // Label names in the selector's `{...}` matchers, in order.
  std::vector<std::string> matcher_labels;
};

// Every metric selector in `expr` whose name starts with "zeroshard_",
// outside string literals and comments.
std::vector<Selector> ZeroshardSelectorsIn(absl::string_view expr);

// The families of ZeroshardSelectorsIn(expr).
std::set<std::string> ZeroshardMetricsIn(absl::string_view expr);

// True if `family` is in the contract.
bool IsExportedMetric(absl::string_view family);

// InvalidArgument naming each selector in `expr` whose family is not in the
// contract, or that matches on a label its family does not carry (its own
// labels, "instance" from the scrape, "le" on histograms; "job" only where
// the family has a job label: elsewhere it is the scrape job's name).
absl::Status CheckAgainstContract(absl::string_view expr);

}  // namespace zeroshard::metrics::testing
