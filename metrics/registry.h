#pragma once

// The contract's families (metric_names.h) in a prometheus-cpp registry,
// which holds the series and writes the text exposition:
//
//   prometheus::Registry registry;  // one per process, owned by main()
//   prometheus::Family<prometheus::Gauge>& memory =
//       metrics::Register<metrics::kMemoryBytes>(registry);
//   memory.Add({{"job", "a"}, {"category", "grad"}}).Set(1 << 20);
//   ...
//   metrics::RemoveSeries(memory, "job", "a");  // job "a" left
//
// prometheus-cpp throws std::invalid_argument for an invalid metric or label
// name, for a name registered again as another type and for unsorted bucket
// bounds. All of those are constants here (metric_names_test registers every
// family), so a throw is our bug at start-up, never bad input.

#include <cstddef>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "metrics/metric_spec.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/labels.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"

namespace zeroshard::metrics {

// prometheus-cpp's class for each MetricType.
template <MetricType type>
struct MetricClass;
template <>
struct MetricClass<MetricType::kCounter> {
  using type = prometheus::Counter;
};
template <>
struct MetricClass<MetricType::kGauge> {
  using type = prometheus::Gauge;
};
template <>
struct MetricClass<MetricType::kHistogram> {
  using type = prometheus::Histogram;
};

template <const MetricSpec& spec>
using FamilyOf = prometheus::Family<typename MetricClass<spec.type>::type>;

// Registers the family `spec` names, with its help text and its type, in
// `registry` (or returns the one registered there before). Label names are
// not declared: each Add names them, and CheckExportsContract holds the
// series to the spec's. A histogram's Add takes the bucket bounds.
template <const MetricSpec& spec>
FamilyOf<spec>& Register(prometheus::Registry& registry) {
  auto builder = [] {
    if constexpr (spec.type == MetricType::kCounter) {
      return prometheus::BuildCounter();
    } else if constexpr (spec.type == MetricType::kGauge) {
      return prometheus::BuildGauge();
    } else {
      return prometheus::BuildHistogram();
    }
  }();
  return builder.Name(std::string(spec.name)).Help(std::string(spec.help)).Register(registry);
}

// Removes from `family` every series whose label `name` is `value` (e.g.
// "job", "a" when job a leaves) and returns how many went. References to them
// dangle afterwards: no other thread may still use them. Collects the family
// once, so it is for rare events, not per step.
template <typename T>
std::size_t RemoveSeries(prometheus::Family<T>& family, const std::string& name,
                         const std::string& value) {
  static_assert(std::is_same_v<T, prometheus::Counter> || std::is_same_v<T, prometheus::Gauge> ||
                std::is_same_v<T, prometheus::Histogram>);
  std::size_t removed = 0;
  for (const prometheus::MetricFamily& collected : family.Collect()) {
    for (const prometheus::ClientMetric& series : collected.metric) {
      prometheus::Labels labels;
      for (const prometheus::ClientMetric::Label& label : series.label) {
        labels.emplace(label.name, label.value);
      }
      const auto it = labels.find(name);
      if (it == labels.end() || it->second != value) continue;
      // prometheus-cpp removes by pointer, and Add returns the existing
      // series (the bucket bounds are only used for a new one, which would
      // go at once).
      if constexpr (std::is_same_v<T, prometheus::Histogram>) {
        family.Remove(&family.Add(labels, prometheus::Histogram::BucketBoundaries{}));
      } else {
        family.Remove(&family.Add(labels));
      }
      ++removed;
    }
  }
  return removed;
}

// The sum of the values of the counter or gauge series of family `name` whose
// labels include every pair of `match` (all of its series when empty); 0 when
// there is none.
double SumOf(const std::vector<prometheus::MetricFamily>& families, absl::string_view name,
             const prometheus::Labels& match = {});

// OK when every family in `families` is in the contract with its type and
// help text, and every series carries exactly its spec's label names;
// otherwise InvalidArgument naming the first family or series that is not.
absl::Status CheckExportsContract(const std::vector<prometheus::MetricFamily>& families);

}  // namespace zeroshard::metrics
