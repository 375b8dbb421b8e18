#pragma once

// The metric families every zeroshardd exports: this list is the contract
// between the daemon, dashboards/zeroshard.json and deploy/prometheus/*.yml,
// whose tests check that they query nothing else. Register them in a
// prometheus::Registry with metrics/registry.h:
//
//   auto& memory = Register<kMemoryBytes>(registry);  // Family<Gauge>&
//   auto& step = Register<kStepSeconds>(registry);    // Family<Histogram>&
//   step.Add({{"job", "a"}}, LatencySecondsBuckets()).Observe(0.2);
//
// Label values:
//   job        the training job's name, as its client registered it; every
//              series of a job is removed when the job leaves
//              (RemoveSeries(family, "job", name)).
//   category   one of kMemoryCategories.
//   op         the kind of transfer (e.g. push, pull), a small fixed set.
//   transport  the transport that carried it (ucx, grpc, inproc).
//   phase      a checkpoint save's phase: snapshot or write.
//   rpc        the gRPC method name.
//   code       absl::StatusCodeToString of the result ("OK", "UNAVAILABLE").
//   version    the daemon's build version.
//
// Prometheus scrapes the daemons with honor_labels (deploy/prometheus), so the
// `job` label above is the training job; families without it carry the scrape
// job's name ("zeroshard").

#include <vector>

#include "absl/strings/string_view.h"
#include "metrics/metric_spec.h"

namespace zeroshard::metrics {

inline constexpr MetricSpec kMemoryBytes = {
    "zeroshard_memory_bytes",
    MetricType::kGauge,
    "Bytes this daemon holds for a job, by ledger category.",
    {"job", "category"}};

inline constexpr MetricSpec kMemoryLimitBytes = {
    "zeroshard_memory_limit_bytes",
    MetricType::kGauge,
    "Bytes this daemon may hold for all jobs together; 0 means no limit.",
    {}};

inline constexpr MetricSpec kCommBytesTotal = {
    "zeroshard_comm_bytes_total",
    MetricType::kCounter,
    "Payload bytes moved for a job, by operation and transport.",
    {"job", "op", "transport"}};

inline constexpr MetricSpec kRequestsTotal = {
    "zeroshard_requests_total",
    MetricType::kCounter,
    "RPCs served, by method and result code.",
    {"rpc", "code"}};

inline constexpr MetricSpec kStepSeconds = {
    "zeroshard_step_seconds",
    MetricType::kHistogram,
    "Wall time of a training step as seen by this daemon.",
    {"job"}};

inline constexpr MetricSpec kOptimizerSeconds = {
    "zeroshard_optimizer_seconds",
    MetricType::kHistogram,
    "Wall time of one optimizer update over this daemon's partition.",
    {"job"}};

inline constexpr MetricSpec kOptimizerParamsPerSecond = {
    "zeroshard_optimizer_params_per_second",
    MetricType::kGauge,
    "Parameters updated per second by the last optimizer step.",
    {}};

inline constexpr MetricSpec kJobs = {
    "zeroshard_jobs",
    MetricType::kGauge,
    "Jobs currently registered with this daemon.",
    {}};

inline constexpr MetricSpec kRanksConnected = {
    "zeroshard_ranks_connected",
    MetricType::kGauge,
    "Ranks of a job currently connected to this daemon.",
    {"job"}};

inline constexpr MetricSpec kWorldSize = {
    "zeroshard_world_size",
    MetricType::kGauge,
    "Ranks a job was registered with (its data-parallel world size).",
    {"job"}};

inline constexpr MetricSpec kActivationFetchSeconds = {
    "zeroshard_activation_fetch_seconds",
    MetricType::kHistogram,
    "The daemon's wall time serving an activation fetch: LocateActivation or FetchActivation, a "
    "read-back from a spill file included, or the FreeActivations (if_placement) that ends a "
    "fetch read without locating.",
    {"job"}};

inline constexpr MetricSpec kActivationHitsTotal = {
    "zeroshard_activation_hits_total",
    MetricType::kCounter,
    "Activation fetches served from memory.",
    {"job"}};

inline constexpr MetricSpec kActivationMissesTotal = {
    "zeroshard_activation_misses_total",
    MetricType::kCounter,
    "Activation fetches that had to be read back from a spill.",
    {"job"}};

inline constexpr MetricSpec kActivationSpillBytesTotal = {
    "zeroshard_activation_spill_bytes_total",
    MetricType::kCounter,
    "Bytes of activations written to spill files to make room in the arena.",
    {"job"}};

inline constexpr MetricSpec kActivationSpillsTotal = {
    "zeroshard_activation_spills_total",
    MetricType::kCounter,
    "Activations moved out of memory to make room.",
    {"job"}};

inline constexpr MetricSpec kNodeCacheHitsTotal = {
    "zeroshard_node_cache_hits_total",
    MetricType::kCounter,
    "Gathers of other daemons' ranges this daemon served from its node cache's copy of a step "
    "(JobSpec.node_cache).",
    {"job"}};

inline constexpr MetricSpec kNodeCacheFetchesTotal = {
    "zeroshard_node_cache_fetches_total",
    MetricType::kCounter,
    "Copies of a step's parameters this daemon's node cache fetched from their owners.",
    {"job"}};

inline constexpr MetricSpec kNodeCacheFetchBytesTotal = {
    "zeroshard_node_cache_fetch_bytes_total",
    MetricType::kCounter,
    "Parameter bytes this daemon's node cache read from their owners (a copy that failed "
    "included).",
    {"job"}};

inline constexpr MetricSpec kCheckpointSeconds = {
    "zeroshard_checkpoint_seconds",
    MetricType::kHistogram,
    "Wall time of a checkpoint save's phases: snapshot (the training stall) and write.",
    {"job", "phase"}};

inline constexpr MetricSpec kCheckpointBytesTotal = {
    "zeroshard_checkpoint_bytes_total",
    MetricType::kCounter,
    "Bytes of checkpoint data this daemon wrote for a job.",
    {"job"}};

inline constexpr MetricSpec kCheckpointLastCompleteStep = {
    "zeroshard_checkpoint_last_complete_step",
    MetricType::kGauge,
    "Step of the job's last checkpoint completed (manifest written) through this daemon.",
    {"job"}};

inline constexpr MetricSpec kCheckpointLastCompleteTimestamp = {
    "zeroshard_checkpoint_last_complete_timestamp_seconds",
    MetricType::kGauge,
    "Unix time at which the job's last checkpoint was completed through this daemon.",
    {"job"}};

inline constexpr MetricSpec kBuildInfo = {
    "zeroshard_build_info",
    MetricType::kGauge,
    "Always 1; the version label says which build runs.",
    {"version"}};

inline constexpr MetricSpec kStateDiskBytes = {
    "zeroshard_state_disk_bytes",
    MetricType::kGauge,
    "Bytes of the job's model states (fp32 masters, optimizer moments) in its file on "
    "--state_dir; absent for a job whose states are all in RAM.",
    {"job"}};

// Every family above, in name order.
inline constexpr MetricSpec kAllMetrics[] = {
    kActivationFetchSeconds,
    kActivationHitsTotal,
    kActivationMissesTotal,
    kActivationSpillBytesTotal,
    kActivationSpillsTotal,
    kBuildInfo,
    kCheckpointBytesTotal,
    kCheckpointLastCompleteStep,
    kCheckpointLastCompleteTimestamp,
    kCheckpointSeconds,
    kCommBytesTotal,
    kJobs,
    kMemoryBytes,
    kMemoryLimitBytes,
    kNodeCacheFetchBytesTotal,
    kNodeCacheFetchesTotal,
    kNodeCacheHitsTotal,
    kOptimizerParamsPerSecond,
    kOptimizerSeconds,
    kRanksConnected,
    kRequestsTotal,
    kStateDiskBytes,
    kStepSeconds,
    kWorldSize,
};

// Values of the `category` label of zeroshard_memory_bytes.
inline constexpr absl::string_view kMemoryCategories[] = {
    "param_master", "param_half", "grad",          "optim_m", "optim_v",
    "activation",   "buffer",     "fragmentation", "replica",  "param_cache",
};

// Bucket bounds for zeroshard_step_seconds, zeroshard_optimizer_seconds and
// zeroshard_checkpoint_seconds:
// 1 ms to 2 min, 2 to 2.5x apart.
inline std::vector<double> LatencySecondsBuckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
          0.5,   1,      2.5,   5,    10,    25,   60,  120};
}

// Bucket bounds for zeroshard_activation_fetch_seconds: 50 us (a fetch from
// memory) to 10 s (a read-back from a busy disk).
inline std::vector<double> FetchSecondsBuckets() {
  return {0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
          0.025,   0.05,   0.1,     0.25,   0.5,   1,      2.5,   10};
}

// The contract entry named `name`, or nullptr.
inline const MetricSpec* FindMetric(absl::string_view name) {
  for (const MetricSpec& spec : kAllMetrics) {
    if (spec.name == name) return &spec;
  }
  return nullptr;
}

}  // namespace zeroshard::metrics
