#pragma once

// What a daemon exports on /metrics (metrics/metric_names.h is the contract).
// Families are registered once at start-up in a prometheus::Registry;
// components hold references. Memory gauges are driven by the MemoryLedger's
// listener, so the exported values are the ledger's. Thread-safe.

#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "metrics/registry.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "server/ledger/memory_ledger.h"

namespace zeroshard {

class DaemonMetrics {
 public:
  // Registers every family in `registry` (which must outlive this) and hooks
  // the ledger's value listener; the owner calls RemoveJob when the ledger
  // forgets a job (MemoryLedger::SetRemoveListener).
  DaemonMetrics(prometheus::Registry* registry, MemoryLedger* ledger, const std::string& version);

  void RecordRequest(absl::string_view rpc, const absl::Status& status);
  // op: "push", "gather", "init"; transport: "stream" (the Shard streaming
  // RPCs), the bulk transport's kind ("ucx", "grpc", "inproc"), or
  // "push_memory" (summed in place from a trainer's push memory).
  void RecordTraffic(const std::string& job, absl::string_view op, absl::string_view transport,
                     uint64_t bytes);
  // A committed step: the optimizer's wall time over `elements` parameters.
  void RecordCommit(const std::string& job, absl::Duration optimizer, uint64_t elements);
  // A checkpoint save's snapshot (the stall) and its background write.
  void RecordCheckpointSnapshot(const std::string& job, absl::Duration took, uint64_t bytes);
  void RecordCheckpointWrite(const std::string& job, absl::Duration took, uint64_t bytes);
  // A checkpoint of the job at `step` was completed (its manifest written).
  void SetCheckpointComplete(const std::string& job, uint64_t step);
  // What one Gather served by the node cache did (ParamCache::Get's
  // `served`): hits, copies fetched and the bytes read from owners.
  void RecordNodeCache(const std::string& job, uint64_t hits, uint64_t fetches,
                       uint64_t bytes_fetched);
  // The bytes of the job's state file on --state_dir (set at registration).
  void SetStateDisk(const std::string& job, uint64_t bytes);
  void SetJobs(size_t jobs);
  void SetRanks(const std::string& job, uint32_t connected, uint32_t world_size);
  // Removes every series of these families labelled with the job. No other
  // thread may still be recording for it.
  void RemoveJob(const std::string& job);

 private:
  // Bucket bounds of the latency histograms (LatencySecondsBuckets()).
  const prometheus::Histogram::BucketBoundaries latency_buckets_;
  prometheus::Family<prometheus::Gauge>& memory_;
  prometheus::Family<prometheus::Counter>& comm_;
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Family<prometheus::Histogram>& step_seconds_;
  prometheus::Family<prometheus::Histogram>& optimizer_seconds_;
  prometheus::Family<prometheus::Histogram>& checkpoint_seconds_;
  prometheus::Family<prometheus::Counter>& checkpoint_bytes_;
  prometheus::Family<prometheus::Gauge>& checkpoint_step_;
  prometheus::Family<prometheus::Gauge>& checkpoint_time_;
  prometheus::Family<prometheus::Counter>& node_cache_hits_;
  prometheus::Family<prometheus::Counter>& node_cache_fetches_;
  prometheus::Family<prometheus::Counter>& node_cache_fetch_bytes_;
  prometheus::Gauge& params_per_second_;
  prometheus::Gauge& jobs_;
  prometheus::Family<prometheus::Gauge>& state_disk_;
  prometheus::Family<prometheus::Gauge>& ranks_;
  prometheus::Family<prometheus::Gauge>& world_size_;

  absl::Mutex mu_;
  std::map<std::string, absl::Time> last_commit_ ABSL_GUARDED_BY(mu_);
};

}  // namespace zeroshard
