#pragma once

// What a daemon exports on /metrics (metrics/metric_names.h is the contract).
// Families are registered once at start-up; components hold references.
// Memory gauges are driven by the MemoryLedger's listener, so the exported
// values are the ledger's. Thread-safe.

#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "metrics/counter.h"
#include "metrics/family.h"
#include "metrics/gauge.h"
#include "metrics/histogram.h"
#include "metrics/registry.h"
#include "server/memory_ledger.h"

namespace zeroshard {

class DaemonMetrics {
 public:
  // Registers every family in `registry` (which must outlive this) and hooks
  // the ledger's listeners.
  DaemonMetrics(metrics::Registry* registry, MemoryLedger* ledger, const std::string& version);

  void RecordRequest(absl::string_view rpc, const absl::Status& status);
  // op: "push", "gather", "init"; transport: "stream" (the Shard streaming
  // RPCs) or the bulk transport's kind ("ucx", "grpc", "inproc").
  void RecordTraffic(const std::string& job, absl::string_view op, absl::string_view transport,
                     uint64_t bytes);
  // A committed step: the optimizer's wall time over `elements` parameters.
  void RecordCommit(const std::string& job, absl::Duration optimizer, uint64_t elements);
  // A checkpoint save's snapshot (the stall) and its background write.
  void RecordCheckpointSnapshot(const std::string& job, absl::Duration took, uint64_t bytes);
  void RecordCheckpointWrite(const std::string& job, absl::Duration took, uint64_t bytes);
  // A checkpoint of the job at `step` was completed (its manifest written).
  void SetCheckpointComplete(const std::string& job, uint64_t step);
  void SetJobs(size_t jobs);
  void SetRanks(const std::string& job, uint32_t connected, uint32_t world_size);
  // Removes every series labelled with the job.
  void RemoveJob(const std::string& job);

 private:
  metrics::Registry* const registry_;
  metrics::Family<metrics::Gauge>& memory_;
  metrics::Family<metrics::Counter>& comm_;
  metrics::Family<metrics::Counter>& requests_;
  metrics::Family<metrics::Histogram>& step_seconds_;
  metrics::Family<metrics::Histogram>& optimizer_seconds_;
  metrics::Family<metrics::Histogram>& checkpoint_seconds_;
  metrics::Family<metrics::Counter>& checkpoint_bytes_;
  metrics::Family<metrics::Gauge>& checkpoint_step_;
  metrics::Family<metrics::Gauge>& checkpoint_time_;
  metrics::Gauge& params_per_second_;
  metrics::Gauge& jobs_;
  metrics::Family<metrics::Gauge>& ranks_;
  metrics::Family<metrics::Gauge>& world_size_;

  absl::Mutex mu_;
  std::map<std::string, absl::Time> last_commit_ ABSL_GUARDED_BY(mu_);
};

}  // namespace zeroshard
