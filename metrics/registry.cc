#include "metrics/registry.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "metrics/metric_names.h"
#include "prometheus/metric_type.h"

namespace zeroshard::metrics {
namespace {

bool SameType(prometheus::MetricType exported, MetricType spec) {
  switch (spec) {
    case MetricType::kCounter:
      return exported == prometheus::MetricType::Counter;
    case MetricType::kGauge:
      return exported == prometheus::MetricType::Gauge;
    case MetricType::kHistogram:
      return exported == prometheus::MetricType::Histogram;
  }
  return false;
}

}  // namespace

double SumOf(const std::vector<prometheus::MetricFamily>& families, absl::string_view name,
             const prometheus::Labels& match) {
  double sum = 0;
  for (const prometheus::MetricFamily& family : families) {
    if (family.name != name) continue;
    for (const prometheus::ClientMetric& series : family.metric) {
      const bool matches = std::all_of(match.begin(), match.end(), [&](const auto& wanted) {
        return std::any_of(series.label.begin(), series.label.end(), [&](const auto& label) {
          return label.name == wanted.first && label.value == wanted.second;
        });
      });
      if (!matches) continue;
      sum += family.type == prometheus::MetricType::Counter ? series.counter.value
                                                            : series.gauge.value;
    }
  }
  return sum;
}

absl::Status CheckExportsContract(const std::vector<prometheus::MetricFamily>& families) {
  for (const prometheus::MetricFamily& family : families) {
    const MetricSpec* spec = FindMetric(family.name);
    if (spec == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(family.name, " is not in the contract"));
    }
    if (!SameType(family.type, spec->type) || family.help != spec->help) {
      return absl::InvalidArgumentError(
          absl::StrCat(family.name, " is exported with another type or help text"));
    }
    std::vector<std::string> declared = spec->LabelNames();
    std::sort(declared.begin(), declared.end());
    for (const prometheus::ClientMetric& series : family.metric) {
      std::vector<std::string> names;
      for (const prometheus::ClientMetric::Label& label : series.label) {
        names.push_back(label.name);
      }
      std::sort(names.begin(), names.end());
      if (names != declared) {
        return absl::InvalidArgumentError(
            absl::StrCat(family.name, " has a series labelled {", absl::StrJoin(names, ","),
                         "}, not {", absl::StrJoin(declared, ","), "}"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace zeroshard::metrics
