#pragma once

// The kind of a metric family and a compile-time description of one family
// (name, type, help, label names). metric_names.h lists the families every
// zeroshard daemon exports as MetricSpecs; Register<spec>() (registry.h)
// registers one in a prometheus::Registry.

#include <array>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace zeroshard::metrics {

enum class MetricType { kCounter, kGauge, kHistogram };

// Up to kMaxLabels label names; unused trailing entries are empty.
struct MetricSpec {
  static constexpr int kMaxLabels = 4;

  absl::string_view name;
  MetricType type;
  absl::string_view help;
  std::array<absl::string_view, kMaxLabels> labels;

  std::vector<std::string> LabelNames() const {
    std::vector<std::string> names;
    for (absl::string_view label : labels) {
      if (!label.empty()) names.emplace_back(label);
    }
    return names;
  }
};

}  // namespace zeroshard::metrics
