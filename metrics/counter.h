#pragma once

// A monotonically increasing value. Lock-free: Increment() is a CAS loop on an
// atomic double and never blocks or allocates, from any thread.

#include <atomic>

#include "metrics/metric_family.h"
#include "metrics/metric_spec.h"

namespace zeroshard::metrics {

class Counter {
 public:
  static constexpr MetricType kType = MetricType::kCounter;

  Counter() = default;
  Counter(const Counter&) = delete;
  Counter& operator=(const Counter&) = delete;

  // Adds `value`. Negative and NaN increments are ignored: a counter only goes
  // up. Integers up to 2^53 add exactly.
  void Increment(double value = 1.0) {
    if (!(value >= 0)) return;
    double current = value_.load(std::memory_order_relaxed);
    while (!value_.compare_exchange_weak(current, current + value,
                                         std::memory_order_relaxed)) {
    }
  }

  double Value() const { return value_.load(std::memory_order_relaxed); }

  // The value now, without labels.
  ClientMetric Collect() const;

 private:
  static_assert(std::atomic<double>::is_always_lock_free);
  std::atomic<double> value_{0.0};
};

}  // namespace zeroshard::metrics
