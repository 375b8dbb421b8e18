#pragma once

// The activation store's metric families (metrics/metric_names.h): hits,
// misses, spills and spilled bytes per job, and the fetch latency. Registered
// once at start-up; a job's series go with the job's (DaemonMetrics::RemoveJob
// removes every series labelled with it). Thread-safe.

#include <string>

#include "absl/time/time.h"
#include "metrics/counter.h"
#include "metrics/family.h"
#include "metrics/histogram.h"
#include "metrics/registry.h"

namespace zeroshard {

class ActivationMetrics {
 public:
  // Registers the families in `registry`, which must outlive this.
  explicit ActivationMetrics(metrics::Registry* registry);

  // A fetch served from the arena (hit) or read back from a spill (miss).
  void RecordHit(const std::string& job);
  void RecordMiss(const std::string& job);
  // One slice of `bytes` written to a spill file to make room.
  void RecordSpill(const std::string& job, uint64_t bytes);
  // A LocateActivation, FetchActivation or fetch-ending FreeActivations
  // that succeeded, start to end.
  void RecordFetch(const std::string& job, absl::Duration took);

 private:
  metrics::Family<metrics::Counter>& hits_;
  metrics::Family<metrics::Counter>& misses_;
  metrics::Family<metrics::Counter>& spills_;
  metrics::Family<metrics::Counter>& spill_bytes_;
  metrics::Family<metrics::Histogram>& fetch_seconds_;
};

}  // namespace zeroshard
