#pragma once

// A value that goes up and down. Lock-free: every mutation is one atomic store
// or a CAS loop on an atomic double; never blocks or allocates.

#include <atomic>

#include "metrics/metric_family.h"
#include "metrics/metric_spec.h"

namespace zeroshard::metrics {

class Gauge {
 public:
  static constexpr MetricType kType = MetricType::kGauge;

  Gauge() = default;
  Gauge(const Gauge&) = delete;
  Gauge& operator=(const Gauge&) = delete;

  void Set(double value) { value_.store(value, std::memory_order_relaxed); }
  void Increment(double value = 1.0) { Add(value); }
  void Decrement(double value = 1.0) { Add(-value); }
  // Seconds since the Unix epoch.
  void SetToCurrentTime();

  double Value() const { return value_.load(std::memory_order_relaxed); }

  // The value now, without labels.
  ClientMetric Collect() const;

 private:
  void Add(double delta) {
    double current = value_.load(std::memory_order_relaxed);
    while (!value_.compare_exchange_weak(current, current + delta,
                                         std::memory_order_relaxed)) {
    }
  }

  static_assert(std::atomic<double>::is_always_lock_free);
  std::atomic<double> value_{0.0};
};

}  // namespace zeroshard::metrics
