#pragma once

// The activation store's metric families (metrics/metric_names.h): hits,
// misses, spills and spilled bytes per job, and the fetch latency. Registered
// once at start-up; a job's series go with the job's (the daemon calls
// RemoveJob when the ledger forgets the job). Thread-safe.

#include <string>

#include "absl/time/time.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace zeroshard {

class ActivationMetrics {
 public:
  // Registers the families in `registry`, which must outlive this.
  explicit ActivationMetrics(prometheus::Registry* registry);

  // A fetch served from the arena (hit) or read back from a spill (miss).
  void RecordHit(const std::string& job);
  void RecordMiss(const std::string& job);
  // One slice of `bytes` written to a spill file to make room.
  void RecordSpill(const std::string& job, uint64_t bytes);
  // A LocateActivation, FetchActivation or fetch-ending FreeActivations
  // that succeeded, start to end.
  void RecordFetch(const std::string& job, absl::Duration took);
  // Removes every series of these families labelled with the job. No other
  // thread may still be recording for it.
  void RemoveJob(const std::string& job);

 private:
  // Bucket bounds of fetch_seconds_ (FetchSecondsBuckets()).
  const prometheus::Histogram::BucketBoundaries fetch_buckets_;
  prometheus::Family<prometheus::Counter>& hits_;
  prometheus::Family<prometheus::Counter>& misses_;
  prometheus::Family<prometheus::Counter>& spills_;
  prometheus::Family<prometheus::Counter>& spill_bytes_;
  prometheus::Family<prometheus::Histogram>& fetch_seconds_;
};

}  // namespace zeroshard
