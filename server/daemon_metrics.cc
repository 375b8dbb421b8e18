#include "server/daemon_metrics.h"

#include "metrics/metric_names.h"

namespace zeroshard {
namespace {

template <typename T>
metrics::Family<T>& Register(metrics::Registry* r, const metrics::MetricSpec& spec) {
  metrics::Builder<T> b;
  b.Spec(spec);
  if constexpr (std::is_same_v<T, metrics::Histogram>) b.Buckets(metrics::LatencySecondsBuckets());
  return b.Register(*r);
}

}  // namespace

DaemonMetrics::DaemonMetrics(metrics::Registry* registry, MemoryLedger* ledger,
                             const std::string& version)
    : registry_(registry),
      memory_(Register<metrics::Gauge>(registry, metrics::kMemoryBytes)),
      comm_(Register<metrics::Counter>(registry, metrics::kCommBytesTotal)),
      requests_(Register<metrics::Counter>(registry, metrics::kRequestsTotal)),
      step_seconds_(Register<metrics::Histogram>(registry, metrics::kStepSeconds)),
      optimizer_seconds_(Register<metrics::Histogram>(registry, metrics::kOptimizerSeconds)),
      checkpoint_seconds_(Register<metrics::Histogram>(registry, metrics::kCheckpointSeconds)),
      checkpoint_bytes_(Register<metrics::Counter>(registry, metrics::kCheckpointBytesTotal)),
      checkpoint_step_(Register<metrics::Gauge>(registry, metrics::kCheckpointLastCompleteStep)),
      checkpoint_time_(
          Register<metrics::Gauge>(registry, metrics::kCheckpointLastCompleteTimestamp)),
      params_per_second_(
          Register<metrics::Gauge>(registry, metrics::kOptimizerParamsPerSecond).Add({})),
      jobs_(Register<metrics::Gauge>(registry, metrics::kJobs).Add({})),
      ranks_(Register<metrics::Gauge>(registry, metrics::kRanksConnected)),
      world_size_(Register<metrics::Gauge>(registry, metrics::kWorldSize)) {
  Register<metrics::Gauge>(registry, metrics::kMemoryLimitBytes)
      .Add({})
      .Set(static_cast<double>(ledger->limit()));
  Register<metrics::Gauge>(registry, metrics::kBuildInfo).Add({{"version", version}}).Set(1);
  ledger->SetListener([this](const std::string& job, MemoryCategory c, uint64_t bytes) {
    memory_.Add({{"job", job}, {"category", MemoryCategoryName(c)}})
        .Set(static_cast<double>(bytes));
  });
  ledger->SetRemoveListener([this](const std::string& job) { RemoveJob(job); });
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
  optimizer_seconds_.Add({{"job", job}}).Observe(seconds);
  if (seconds > 0 && elements > 0) params_per_second_.Set(elements / seconds);
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mu_);
  auto [it, first] = last_commit_.try_emplace(job, now);
  if (!first) {
    step_seconds_.Add({{"job", job}}).Observe(absl::ToDoubleSeconds(now - it->second));
    it->second = now;
  }
}

void DaemonMetrics::RecordCheckpointSnapshot(const std::string& job, absl::Duration took,
                                             uint64_t) {
  checkpoint_seconds_.Add({{"job", job}, {"phase", "snapshot"}})
      .Observe(absl::ToDoubleSeconds(took));
}

void DaemonMetrics::RecordCheckpointWrite(const std::string& job, absl::Duration took,
                                          uint64_t bytes) {
  checkpoint_seconds_.Add({{"job", job}, {"phase", "write"}}).Observe(absl::ToDoubleSeconds(took));
  checkpoint_bytes_.Add({{"job", job}}).Increment(static_cast<double>(bytes));
}

void DaemonMetrics::SetCheckpointComplete(const std::string& job, uint64_t step) {
  checkpoint_step_.Add({{"job", job}}).Set(static_cast<double>(step));
  checkpoint_time_.Add({{"job", job}}).Set(absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()));
}

void DaemonMetrics::SetJobs(size_t jobs) { jobs_.Set(static_cast<double>(jobs)); }

void DaemonMetrics::SetRanks(const std::string& job, uint32_t connected, uint32_t world_size) {
  ranks_.Add({{"job", job}}).Set(connected);
  world_size_.Add({{"job", job}}).Set(world_size);
}

void DaemonMetrics::RemoveJob(const std::string& job) {
  registry_->RemoveIf("job", job);
  absl::MutexLock lock(&mu_);
  last_commit_.erase(job);
}

}  // namespace zeroshard
