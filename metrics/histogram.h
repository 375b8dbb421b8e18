#pragma once

// Counts observations into buckets with fixed upper bounds (Prometheus `le`
// semantics: a value lands in the first bucket whose bound is >= it), plus
// their sum. Observe() takes a short internal lock (no allocation) so that
// Collect() sees buckets, count and sum from the same set of observations.

#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "metrics/metric_family.h"
#include "metrics/metric_spec.h"

namespace zeroshard::metrics {

class Histogram {
 public:
  static constexpr MetricType kType = MetricType::kHistogram;
  using BucketBoundaries = std::vector<double>;

  // `boundaries` should pass ValidateBucketBoundaries() (families check it);
  // anything else is normalised (sorted, NaN/Inf and duplicates dropped)
  // rather than rejected. The +Inf bucket is always implied.
  explicit Histogram(const BucketBoundaries& boundaries);
  Histogram(const Histogram&) = delete;
  Histogram& operator=(const Histogram&) = delete;

  // NaN counts in the +Inf bucket and makes the sum NaN, as in Prometheus's
  // own clients.
  void Observe(double value);

  // Finite bucket bounds, ascending, without +Inf.
  const BucketBoundaries& boundaries() const { return boundaries_; }

  // A consistent snapshot: cumulative buckets (ending with +Inf), count, sum.
  ClientMetric Collect() const;

 private:
  const BucketBoundaries boundaries_;
  mutable absl::Mutex mu_;
  // counts_[i] for boundaries_[i]; counts_.back() is the +Inf bucket.
  std::vector<std::uint64_t> counts_ ABSL_GUARDED_BY(mu_);
  double sum_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace zeroshard::metrics
