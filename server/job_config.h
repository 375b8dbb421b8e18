#pragma once

// A job's validated configuration, parsed from the wire JobSpec.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "common/layout.h"
#include "common/partition_map.h"
#include "proto/zeroshard/v1/common.pb.h"

namespace zeroshard {

enum class ReductionMode { kDaemon = 1, kTrainerCollective = 2 };
enum class OptimizerKindConfig { kAdamW = 1, kAdam = 2, kSgdMomentum = 3 };

struct OptimizerSettings {
  OptimizerKindConfig kind = OptimizerKindConfig::kAdamW;
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  float momentum = 0.0f;
};

struct LossScaleSettings {
  bool dynamic = false;
  float initial_scale = 1.0f;
  uint32_t growth_interval = 2000;
  float growth_factor = 2.0f;
  float backoff_factor = 0.5f;
};

struct JobConfig {
  std::string id;
  Layout layout;
  PartitionMap map;
  uint32_t stage = 1;
  uint32_t world_size = 1;
  DType precision = DType::kFp32;
  ReductionMode reduction = ReductionMode::kDaemon;
  OptimizerSettings optimizer;
  LossScaleSettings loss_scale;
  uint64_t bucket_bytes = 0;
  std::vector<std::string> daemons;
};

inline constexpr uint64_t kDefaultBucketBytes = 32ull << 20;

// Validates every field of `spec` and derives the layout and partition map.
// InvalidArgument names the field (e.g. "spec.optimizer.beta1: must be in
// [0, 1), got 1.5"). Stage 0 is rejected: plain data parallelism keeps all
// model states on the trainers and needs no daemon.
absl::StatusOr<JobConfig> ParseJobSpec(const v1::JobSpec& spec);

// Converts a validated layout back to / from the wire form.
absl::StatusOr<Layout> LayoutFromProto(const v1::Layout& layout);
v1::Layout LayoutToProto(const Layout& layout);

// Empty when equal; otherwise "field: registered X, got Y" for the first
// field that differs (job specs of ranks joining the same job must match).
std::string DescribeSpecDifference(const v1::JobSpec& registered, const v1::JobSpec& got);

// Model-state bytes the daemon should book for `owned_elements` of this job,
// following the paper's partitioned terms: K bytes of optimizer state
// (fp32 master + m + v for Adam, master + momentum for SGD), plus in stages 2
// and 3 the reduced gradient shard (kept in fp32 here: 4 bytes where the
// paper counts 2 in fp16), plus in stage 3 the half-precision parameter shard
// (2 bytes; none for fp32 jobs, which serve the masters).
uint64_t DaemonModelStateFormulaBytes(const JobConfig& config, uint64_t owned_elements);

}  // namespace zeroshard
