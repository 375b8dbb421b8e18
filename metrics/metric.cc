#include <algorithm>
#include <chrono>
#include <cmath>

#include "metrics/counter.h"
#include "metrics/gauge.h"
#include "metrics/histogram.h"

namespace zeroshard::metrics {
namespace {

Histogram::BucketBoundaries Normalize(Histogram::BucketBoundaries b) {
  b.erase(std::remove_if(b.begin(), b.end(),
                         [](double x) { return !std::isfinite(x); }),
          b.end());
  std::sort(b.begin(), b.end());
  b.erase(std::unique(b.begin(), b.end()), b.end());
  return b;
}

}  // namespace

ClientMetric Counter::Collect() const {
  ClientMetric m;
  m.value = Value();
  return m;
}

void Gauge::SetToCurrentTime() {
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  Set(std::chrono::duration<double>(now).count());
}

ClientMetric Gauge::Collect() const {
  ClientMetric m;
  m.value = Value();
  return m;
}

Histogram::Histogram(const BucketBoundaries& boundaries)
    : boundaries_(Normalize(boundaries)), counts_(boundaries_.size() + 1, 0) {}

void Histogram::Observe(double value) {
  // lower_bound: first bound >= value. NaN compares false everywhere and so
  // lands past the end, in +Inf.
  const size_t bucket =
      std::isnan(value)
          ? boundaries_.size()
          : std::lower_bound(boundaries_.begin(), boundaries_.end(), value) -
                boundaries_.begin();
  absl::MutexLock lock(&mu_);
  ++counts_[bucket];
  sum_ += value;
}

ClientMetric Histogram::Collect() const {
  ClientMetric m;
  m.buckets.resize(boundaries_.size() + 1);
  absl::MutexLock lock(&mu_);
  std::uint64_t cumulative = 0;
  for (size_t i = 0; i < counts_.size(); ++i) {
    cumulative += counts_[i];
    m.buckets[i].upper_bound =
        i < boundaries_.size() ? boundaries_[i] : INFINITY;
    m.buckets[i].cumulative_count = cumulative;
  }
  m.sample_count = cumulative;
  m.sample_sum = sum_;
  return m;
}

}  // namespace zeroshard::metrics
