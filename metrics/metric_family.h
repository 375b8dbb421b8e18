#pragma once

// Snapshots of collected metrics: what Registry::Collect() returns and
// TextSerializer renders. Plain values, safe to use on any thread.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "metrics/metric_spec.h"

namespace zeroshard::metrics {

// Label name -> value. Ordered, so series with the same label names sort by
// their values in label-name order.
using Labels = std::map<std::string, std::string>;

// One series at the instant it was read.
struct ClientMetric {
  struct Bucket {
    double upper_bound = 0;  // The last bucket's bound is +Inf.
    std::uint64_t cumulative_count = 0;
  };

  Labels labels;
  double value = 0;  // Counters and gauges.
  // Histograms only: cumulative buckets ending with +Inf, whose count equals
  // sample_count.
  std::vector<Bucket> buckets;
  std::uint64_t sample_count = 0;
  double sample_sum = 0;
};

struct MetricFamily {
  std::string name;
  std::string help;
  MetricType type = MetricType::kGauge;
  std::vector<ClientMetric> metrics;
};

}  // namespace zeroshard::metrics
