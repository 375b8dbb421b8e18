#pragma once

// A job's settings, shared by the client and the daemon: the one settings
// type, the one validator, and the one conversion to and from the wire
// JobSpec. The client validates with the same rules the daemon applies, so
// a config the client accepts is never refused by a daemon for its form.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"
#include "common/layout.h"
#include "common/partition_map.h"
#include "common/protocol.h"
#include "proto/zeroshard/v1/common.pb.h"

namespace zeroshard {

// How gradients are reduced across the N_d ranks (v1::ReductionMode).
enum class ReductionMode : uint8_t {
  kDaemon = 1,             // daemons sum every rank's full gradient (no GPU needed)
  kTrainerCollective = 2,  // ranks reduce-scatter among themselves first
};

// The update rule (v1::OptimizerKind).
enum class OptimizerKind : uint8_t {
  kAdamW = 1,        // Adam with decoupled weight decay: p *= 1 - lr * wd
  kAdam = 2,         // Adam with L2 weight decay: g += wd * p
  kSgdMomentum = 3,  // SGD with optional momentum and weight decay (no Nesterov)
};
absl::string_view OptimizerKindName(OptimizerKind kind);

// Defaults are torch.optim.AdamW's.
struct OptimizerSettings {
  OptimizerKind kind = OptimizerKind::kAdamW;
  float lr = 1e-3f;  // step 1's; each CommitStep carries its own
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.01f;
  float momentum = 0.0f;  // SGD only
};

// One parameter group's hyper-parameters (v1::ParamGroup): its tensors
// (TensorSpec::group) are updated with these in place of the job's
// OptimizerSettings fields of the same names.
struct ParamGroupSettings {
  float lr = 1e-3f;  // step 1's; each commit carries the group's own
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.01f;
};

struct LossScaleSettings {
  bool dynamic = false;  // fp16: grow / back off the scale
  float initial_scale = 1.0f;
  uint32_t growth_interval = 2000;
  float growth_factor = 2.0f;
  float backoff_factor = 0.5f;
};

// Everything every rank and every daemon of a job must agree on, except the
// layout (which the client registers with it).
struct JobSettings {
  std::string job_id;       // kJobIdRule
  uint32_t stage = 2;       // ZeRO stage 1..3
  uint32_t world_size = 1;  // N_d
  DType precision = DType::kBf16;  // what trainers compute in; masters are fp32
  ReductionMode reduction = ReductionMode::kDaemon;
  OptimizerSettings optimizer;
  LossScaleSettings loss_scale;
  uint64_t bucket_bytes = kDefaultBucketBytes;  // C_B
  // Daemon addresses (HOST:PORT) in placement order; partition i lives on
  // daemons[i * daemons.size() / world_size].
  std::vector<std::string> daemons;
  // Copies of each replica group (v1::JobSpec.replicas): 1, or 2 for a
  // primary and a backup. Group g (the partitions daemons[g] owns) is held
  // by daemons[g] and daemons[ReplicaPeer(g)].
  uint32_t replicas = 1;
  // Parameter groups, indexed by TensorSpec::group: empty means one group
  // with `optimizer`'s hyper-parameters; at most Layout::kMaxParamGroups.
  std::vector<ParamGroupSettings> param_groups;
  // The node-level parameter cache (v1::JobSpec.node_cache): a daemon
  // serves streamed gathers of other daemons' ranges from one copy per
  // step. Needs replicas == 1.
  bool node_cache = false;
};

// The number of parameter groups of a job (at least 1).
inline uint32_t GroupCount(const JobSettings& s) {
  return s.param_groups.empty() ? 1 : static_cast<uint32_t>(s.param_groups.size());
}
// The update rule and hyper-parameters group `group` (< GroupCount) uses.
OptimizerSettings GroupOptimizer(const JobSettings& settings, uint32_t group);
// OK iff every tensor of `layout` names one of the job's groups;
// InvalidArgument naming the first that does not (as `prefix` + field).
absl::Status ValidateLayoutGroups(const JobSettings& settings, const Layout& layout,
                                  absl::string_view prefix);

// The other daemon of replica group `group` in a replicated job with
// `daemons` daemons: the next one, wrapping around.
inline uint32_t ReplicaPeer(uint32_t group, uint32_t daemons) { return (group + 1) % daemons; }
// The group daemon `daemon` backs up at the start (whose peer it is).
inline uint32_t BackedUpGroup(uint32_t daemon, uint32_t daemons) {
  return (daemon + daemons - 1) % daemons;
}

// OK, or InvalidArgument naming the field as `prefix` + its name (e.g.
// "ClientConfig.optimizer.beta1: must be in [0, 1), got 1.5").
absl::Status ValidateJobSettings(const JobSettings& settings, absl::string_view prefix);

// A daemon on this machine's unix socket: "unix:" and an absolute path
// (gRPC's form). Only processes that may write the socket file (and search
// its directory) connect: a single-node job's daemon in a 0700 directory is
// out of other users' reach, and nobody else can take its address first.
inline constexpr char kUnixSocketPrefix[] = "unix:";
// sockaddr_un.sun_path holds 108 bytes with the terminating NUL.
inline constexpr size_t kMaxUnixSocketPathBytes = 107;
bool IsUnixSocketAddress(absl::string_view address);

// OK iff `address` is HOST:PORT: at most kMaxAddressBytes, a non-empty host
// before the last ':' and a port of 1..5 digits after it (IPv6 hosts in
// brackets); or unix:/ABSOLUTE/PATH, the path at most
// kMaxUnixSocketPathBytes, without control characters or ','.
// InvalidArgument naming `field` otherwise.
absl::Status ValidateHostPort(absl::string_view address, absl::string_view field);

// The daemon's view of a job: validated settings, the layout and the
// partition map derived from them.
struct JobConfig : JobSettings {
  Layout layout;
  PartitionMap map;
};

// The wire form of `settings` + `layout` (settings assumed valid).
v1::JobSpec ToJobSpec(const JobSettings& settings, const Layout& layout);

// Validates every field of `spec` (as ValidateJobSettings, with prefix
// "spec.") and derives the layout and partition map. Stage 0 is rejected:
// plain data parallelism keeps all model states on the trainers.
absl::StatusOr<JobConfig> ParseJobSpec(const v1::JobSpec& spec);

// Converts a validated layout to / from the wire form.
absl::StatusOr<Layout> LayoutFromProto(const v1::Layout& layout);
v1::Layout LayoutToProto(const Layout& layout);

// The wire enum of a dtype (DTYPE_UNSPECIFIED for none).
v1::DType WireDType(DType t);

// The wire PartitionMap of a job (Control's answers, checkpoint manifests).
void FillPartitionMap(const JobConfig& config, v1::PartitionMap* map);

// Empty when equal; otherwise "field: registered X, got Y" for the first
// field that differs (job specs of ranks joining the same job must match).
std::string DescribeSpecDifference(const v1::JobSpec& registered, const v1::JobSpec& got);

// Model-state bytes a daemon should book for the `owned` flat range of this
// job, following the paper's partitioned terms: K bytes of optimizer state
// (fp32 master + m + v for Adam, master + momentum for SGD), plus in stages
// 2 and 3 the reduced gradient shard (kept in fp32: 4 bytes where the paper
// counts 2 in fp16), plus in stage 3 the half-precision parameter shard (2
// bytes; none for fp32 jobs, which serve the masters). Elements of frozen
// tensors hold no optimizer state: their master in place of K.
uint64_t DaemonModelStateFormulaBytes(const JobConfig& config, FlatRange owned);

}  // namespace zeroshard
