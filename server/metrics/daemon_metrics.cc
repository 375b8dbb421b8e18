#include "server/metrics/daemon_metrics.h"

#include "metrics/metric_names.h"

namespace zeroshard {

DaemonMetrics::DaemonMetrics(prometheus::Registry* registry, MemoryLedger* ledger,
                             const std::string& version)
    : latency_buckets_(metrics::LatencySecondsBuckets()),
      memory_(metrics::Register<metrics::kMemoryBytes>(*registry)),
      comm_(metrics::Register<metrics::kCommBytesTotal>(*registry)),
      requests_(metrics::Register<metrics::kRequestsTotal>(*registry)),
      step_seconds_(metrics::Register<metrics::kStepSeconds>(*registry)),
      optimizer_seconds_(metrics::Register<metrics::kOptimizerSeconds>(*registry)),
      checkpoint_seconds_(metrics::Register<metrics::kCheckpointSeconds>(*registry)),
      checkpoint_bytes_(metrics::Register<metrics::kCheckpointBytesTotal>(*registry)),
      checkpoint_step_(metrics::Register<metrics::kCheckpointLastCompleteStep>(*registry)),
      checkpoint_time_(metrics::Register<metrics::kCheckpointLastCompleteTimestamp>(*registry)),
      node_cache_hits_(metrics::Register<metrics::kNodeCacheHitsTotal>(*registry)),
      node_cache_fetches_(metrics::Register<metrics::kNodeCacheFetchesTotal>(*registry)),
      node_cache_fetch_bytes_(metrics::Register<metrics::kNodeCacheFetchBytesTotal>(*registry)),
      params_per_second_(metrics::Register<metrics::kOptimizerParamsPerSecond>(*registry).Add({})),
      jobs_(metrics::Register<metrics::kJobs>(*registry).Add({})),
      state_disk_(metrics::Register<metrics::kStateDiskBytes>(*registry)),
      ranks_(metrics::Register<metrics::kRanksConnected>(*registry)),
      world_size_(metrics::Register<metrics::kWorldSize>(*registry)) {
  metrics::Register<metrics::kMemoryLimitBytes>(*registry).Add({}).Set(
      static_cast<double>(ledger->limit()));
  metrics::Register<metrics::kBuildInfo>(*registry).Add({{"version", version}}).Set(1);
  ledger->SetListener([this](const std::string& job, MemoryCategory c, uint64_t bytes) {
    memory_.Add({{"job", job}, {"category", MemoryCategoryName(c)}})
        .Set(static_cast<double>(bytes));
  });
}

void DaemonMetrics::RecordRequest(absl::string_view rpc, const absl::Status& status) {
  requests_
      .Add({{"rpc", std::string(rpc)}, {"code", absl::StatusCodeToString(status.code())}})
      .Increment();
}

void DaemonMetrics::RecordTraffic(const std::string& job, absl::string_view op,
                                  absl::string_view transport, uint64_t bytes) {
  comm_.Add({{"job", job}, {"op", std::string(op)}, {"transport", std::string(transport)}})
      .Increment(static_cast<double>(bytes));
}

void DaemonMetrics::RecordCommit(const std::string& job, absl::Duration optimizer,
                                 uint64_t elements) {
  const double seconds = absl::ToDoubleSeconds(optimizer);
  optimizer_seconds_.Add({{"job", job}}, latency_buckets_).Observe(seconds);
  if (seconds > 0 && elements > 0) params_per_second_.Set(elements / seconds);
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mu_);
  auto [it, first] = last_commit_.try_emplace(job, now);
  if (!first) {
    step_seconds_.Add({{"job", job}}, latency_buckets_)
        .Observe(absl::ToDoubleSeconds(now - it->second));
    it->second = now;
  }
}

void DaemonMetrics::RecordCheckpointSnapshot(const std::string& job, absl::Duration took,
                                             uint64_t) {
  checkpoint_seconds_.Add({{"job", job}, {"phase", "snapshot"}}, latency_buckets_)
      .Observe(absl::ToDoubleSeconds(took));
}

void DaemonMetrics::RecordCheckpointWrite(const std::string& job, absl::Duration took,
                                          uint64_t bytes) {
  checkpoint_seconds_.Add({{"job", job}, {"phase", "write"}}, latency_buckets_)
      .Observe(absl::ToDoubleSeconds(took));
  checkpoint_bytes_.Add({{"job", job}}).Increment(static_cast<double>(bytes));
}

void DaemonMetrics::SetCheckpointComplete(const std::string& job, uint64_t step) {
  checkpoint_step_.Add({{"job", job}}).Set(static_cast<double>(step));
  checkpoint_time_.Add({{"job", job}}).Set(absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()));
}

void DaemonMetrics::RecordNodeCache(const std::string& job, uint64_t hits, uint64_t fetches,
                                    uint64_t bytes_fetched) {
  // Every family gets the job's series at its first record, zeros included,
  // so a job's hit rate reads 0 rather than nothing.
  node_cache_hits_.Add({{"job", job}}).Increment(static_cast<double>(hits));
  node_cache_fetches_.Add({{"job", job}}).Increment(static_cast<double>(fetches));
  node_cache_fetch_bytes_.Add({{"job", job}}).Increment(static_cast<double>(bytes_fetched));
}

void DaemonMetrics::SetJobs(size_t jobs) { jobs_.Set(static_cast<double>(jobs)); }

void DaemonMetrics::SetRanks(const std::string& job, uint32_t connected, uint32_t world_size) {
  ranks_.Add({{"job", job}}).Set(connected);
  world_size_.Add({{"job", job}}).Set(world_size);
}

void DaemonMetrics::SetStateDisk(const std::string& job, uint64_t bytes) {
  state_disk_.Add({{"job", job}}).Set(static_cast<double>(bytes));
}

void DaemonMetrics::RemoveJob(const std::string& job) {
  metrics::RemoveSeries(state_disk_, "job", job);
  metrics::RemoveSeries(memory_, "job", job);
  metrics::RemoveSeries(comm_, "job", job);
  metrics::RemoveSeries(step_seconds_, "job", job);
  metrics::RemoveSeries(optimizer_seconds_, "job", job);
  metrics::RemoveSeries(checkpoint_seconds_, "job", job);
  metrics::RemoveSeries(checkpoint_bytes_, "job", job);
  metrics::RemoveSeries(checkpoint_step_, "job", job);
  metrics::RemoveSeries(checkpoint_time_, "job", job);
  metrics::RemoveSeries(node_cache_hits_, "job", job);
  metrics::RemoveSeries(node_cache_fetches_, "job", job);
  metrics::RemoveSeries(node_cache_fetch_bytes_, "job", job);
  metrics::RemoveSeries(ranks_, "job", job);
  metrics::RemoveSeries(world_size_, "job", job);
  absl::MutexLock lock(&mu_);
  last_commit_.erase(job);
}

}  // namespace zeroshard
