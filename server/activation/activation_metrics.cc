#include "server/activation/activation_metrics.h"

#include "metrics/metric_names.h"
#include "metrics/registry.h"

namespace zeroshard {

ActivationMetrics::ActivationMetrics(prometheus::Registry* registry)
    : fetch_buckets_(metrics::FetchSecondsBuckets()),
      hits_(metrics::Register<metrics::kActivationHitsTotal>(*registry)),
      misses_(metrics::Register<metrics::kActivationMissesTotal>(*registry)),
      spills_(metrics::Register<metrics::kActivationSpillsTotal>(*registry)),
      spill_bytes_(metrics::Register<metrics::kActivationSpillBytesTotal>(*registry)),
      fetch_seconds_(metrics::Register<metrics::kActivationFetchSeconds>(*registry)) {}

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
  fetch_seconds_.Add({{"job", job}}, fetch_buckets_).Observe(absl::ToDoubleSeconds(took));
}

void ActivationMetrics::RemoveJob(const std::string& job) {
  metrics::RemoveSeries(hits_, "job", job);
  metrics::RemoveSeries(misses_, "job", job);
  metrics::RemoveSeries(spills_, "job", job);
  metrics::RemoveSeries(spill_bytes_, "job", job);
  metrics::RemoveSeries(fetch_seconds_, "job", job);
}

}  // namespace zeroshard
