#include "server/activation_metrics.h"

#include "metrics/metric_names.h"

namespace zeroshard {

ActivationMetrics::ActivationMetrics(metrics::Registry* registry)
    : hits_(metrics::BuildCounter().Spec(metrics::kActivationHitsTotal).Register(*registry)),
      misses_(metrics::BuildCounter().Spec(metrics::kActivationMissesTotal).Register(*registry)),
      spills_(metrics::BuildCounter().Spec(metrics::kActivationSpillsTotal).Register(*registry)),
      spill_bytes_(
          metrics::BuildCounter().Spec(metrics::kActivationSpillBytesTotal).Register(*registry)),
      fetch_seconds_(metrics::BuildHistogram()
                         .Spec(metrics::kActivationFetchSeconds)
                         .Buckets(metrics::FetchSecondsBuckets())
                         .Register(*registry)) {}

void ActivationMetrics::RecordHit(const std::string& job) {
  hits_.Add({{"job", job}}).Increment();
}

void ActivationMetrics::RecordMiss(const std::string& job) {
  misses_.Add({{"job", job}}).Increment();
}

void ActivationMetrics::RecordSpill(const std::string& job, uint64_t bytes) {
  spills_.Add({{"job", job}}).Increment();
  spill_bytes_.Add({{"job", job}}).Increment(static_cast<double>(bytes));
}

void ActivationMetrics::RecordFetch(const std::string& job, absl::Duration took) {
  fetch_seconds_.Add({{"job", job}}).Observe(absl::ToDoubleSeconds(took));
}

}  // namespace zeroshard
