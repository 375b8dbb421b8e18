#pragma once

// One training job's copy of a replica group on one daemon, as the RPC
// services see it: the composition of
//   RankTable       (server/job/rank_table.h)   who may send, and as which process;
//   StepEngine      (server/step/step_engine.h) the model states and the two-phase step;
//   CheckpointAgent (server/checkpoint/)        saves and loads (with --checkpoint_dir);
//   ReplicaGroup    (server/replica/)           state machine replication (replicas = 2).
// Each holds one concern; this class checks who calls, routes, and orders
// what spans two of them (a rank's new process fences its predecessor's
// pushes; a prepare brings the backup along; a commit is sent to the
// backup after it applied here; a state change outside a step makes the
// backup copy the state again).
//
// Locks, in the order they may be taken: the step engine's commit lock,
// then its reduction lock, then its parameter lock (step_engine.h); the
// rank table's and the replica group's locks are leaves. No lock is held
// across a network call of another request's, but the prepared step's
// replication, which holds the commit lock (nothing else waits for it then
// but the step's own commit). Every wait takes a deadline.
//
// Its calls take and answer plain structs (below, server/step/step_types.h,
// server/job/rank_table.h, server/checkpoint/, server/replica/replica_group.h):
// server/rpc decodes the requests and encodes the answers, so nothing here
// sees a request or response message. What stays a protobuf is what is
// persisted or sent to the peer as it is: the registered v1::JobSpec
// (written into checkpoint manifests, re-registered on a replica peer) and
// the checkpoint part manifests a CompleteCheckpoint names.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/auth.h"
#include "common/job_spec.h"
#include "proto/zeroshard/v1/checkpoint.pb.h"
#include "proto/zeroshard/v1/common.pb.h"
#include "server/cache/param_cache.h"
#include "server/checkpoint/checkpoint_agent.h"
#include "server/metrics/daemon_metrics.h"
#include "server/job/rank_table.h"
#include "server/job/staging.h"
#include "server/ledger/memory_ledger.h"
#include "server/optimizer/optimizer.h"
#include "server/replica/replica_group.h"
#include "server/replica/replica_link.h"
#include "server/step/step_engine.h"
#include "server/step/step_types.h"
#include "transport/transport.h"

namespace zeroshard {

// A rank's join (Control.JoinJob): who it is and its view of the job, each
// checked against the registered job.
struct JoinRequest {
  uint32_t rank = 0;
  uint64_t incarnation = 0;  // >= 1
  uint64_t layout_fingerprint = 0;
  uint32_t stage = 0;
  uint32_t world_size = 0;
  WireEnum precision = 0;  // as sent (zeroshard.v1.DType's number)
};

struct JoinResult {
  uint64_t committed_step = 0;
  uint32_t ranks_connected = 0;  // joined ranks
  uint64_t replaced_incarnation = 0;  // the older process fenced; 0: none
  uint32_t dropped_contributions = 0;  // what it left in the reduction
};

// The step as Shard.GetStepState reports it: the engine's view and the
// ranks'.
struct JobStepState {
  StepProgress step;
  uint32_t ranks_joined = 0;
  uint32_t ranks_connected = 0;
  std::vector<RankStatus> ranks;  // every rank in order; empty when brief
};

// Bytes that jobs take and give back: on a daemon with a --state_dir, the
// fp32 masters and optimizer moments jobs may keep in RAM (--state_memory: a
// job whose states fit beside the other RAM-resident jobs' stays in RAM,
// the others go to disk), and the bytes their files may take on disk
// (--state_disk_limit). Thread-safe.
class ByteBudget {
 public:
  explicit ByteBudget(uint64_t bytes) : bytes_(bytes) {}
  // Takes `bytes` when they fit (true), else takes nothing (false).
  bool Take(uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  void Give(uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t used() const ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t bytes() const { return bytes_; }

 private:
  const uint64_t bytes_;
  mutable absl::Mutex mu_;
  uint64_t used_ ABSL_GUARDED_BY(mu_) = 0;
};

// What a job borrows from its daemon; everything must outlive the job.
struct JobResources {
  MemoryLedger* ledger = nullptr;
  ShardOptimizer* optimizer = nullptr;
  transport::Transport* transport = nullptr;  // the bulk transport; may be null
  uint64_t reduction_buffer_bytes = 256ull << 20;  // out-of-order budget
  uint32_t staging_slots = 4;
  absl::Duration reduction_hold = absl::ZeroDuration();  // see DaemonOptions
  std::string checkpoint_dir;        // empty: no checkpoints
  DaemonMetrics* metrics = nullptr;  // may be null
  // Replicated jobs: how a primary reaches its backup (null: a replicated
  // job runs without its backups), and the longest one replication call
  // (a state transfer, a forward, a commit) may take before the group goes
  // on with one copy, plus its bytes at 50 MB/s.
  ReplicaLink* replica_link = nullptr;
  absl::Duration replica_timeout = absl::Seconds(5);
  // How long a peer daemon may stay silent before the replica link's calls
  // to it fail and a primary stops calling it until it answers a probe
  // (ReplicaGroup::Options::liveness_timeout).
  absl::Duration liveness_timeout = absl::Seconds(4);
  // --state_dir: where model states that do not stay in RAM go (`disk.dir`
  // null: all in RAM), and the budget of those that stay.
  DiskResidence state_disk;
  ByteBudget* state_memory = nullptr;
  ByteBudget* state_disk_limit = nullptr;  // null: as much as the disk holds
};

class Job {
 public:
  // Allocates the owned partitions' states (booked whole before anything is
  // allocated: ResourceExhausted, with nothing allocated and no ledger
  // entry left, when it does not fit). `daemon_index` is the replica group
  // this copy holds (the partitions spec.daemons[daemon_index] owns).
  // Replicated jobs: `here` is the index of the daemon the copy lives on
  // (the group's own daemon or its peer), `role` its role at the start; a
  // backup's memory is booked as replica.
  static absl::StatusOr<std::unique_ptr<Job>> Create(JobConfig config, v1::JobSpec spec,
                                                     uint32_t daemon_index,
                                                     const JobResources& resources,
                                                     ReplicaRole role = ReplicaRole::kPrimary,
                                                     uint32_t here = kHereIsGroup);
  static constexpr uint32_t kHereIsGroup = ~0u;
  ~Job();

  const JobConfig& config() const { return *config_; }
  // The digest of the token the job was registered with (common/auth.h).
  // Set by the JobManager before the job is published, then never changed.
  const TokenDigest& token() const { return token_; }
  void set_token(const TokenDigest& token) { token_ = token; }
  const v1::JobSpec& spec() const { return *spec_; }
  uint32_t daemon_index() const { return daemon_index_; }
  const std::vector<uint32_t>& owned_partitions() const { return owned_partitions_; }
  FlatRange owned_range() const { return step_->owned(); }
  // Owned elements below total_elements (real parameters plus alignment gaps).
  FlatRange owned_unpadded() const { return step_->owned_unpadded(); }
  // The bytes of this job's model states on --state_dir (0: all in RAM).
  uint64_t state_disk_bytes() const { return step_->disk_bytes(); }

  // ---- Ranks ----
  // See Control.JoinJob. FailedPrecondition naming the field and both values
  // when the rank's view differs from the registered job, or for an
  // incarnation older than the rank's current one; NotFound once removed.
  absl::StatusOr<JoinResult> Join(const JoinRequest& request);
  // OK iff `rank` is joined as `incarnation` (and records it heard from now).
  absl::Status CheckRank(uint32_t rank, uint64_t incarnation, absl::string_view field) {
    return ranks_.Check(rank, incarnation, field);
  }
  // Leaves; returns true when this was the last joined rank: the job is then
  // marked removed and the caller takes it out of the registry.
  absl::StatusOr<bool> Leave(uint32_t rank, uint64_t incarnation) {
    return ranks_.Leave(rank, incarnation);
  }
  uint32_t ranks_joined() const { return ranks_.joined(); }
  // Whether any rank has joined this copy.
  bool ever_joined() const { return ranks_.ever_joined(); }
  // Joined ranks heard from within `timeout`.
  uint32_t RanksConnected(absl::Duration timeout) const { return ranks_.Connected(timeout); }
  // When any rank was last heard from (InfinitePast: never).
  absl::Time LastHeard() const { return ranks_.LastHeard(); }
  // The rank's staging region (created on first use through the transport).
  absl::StatusOr<std::shared_ptr<RankStaging>> Staging(uint32_t rank, uint64_t incarnation,
                                                       bool create) {
    return ranks_.Staging(rank, incarnation, create);
  }

  // Blocks (without holding any lock other requests need) until `step` is
  // committed or `deadline`; see StepEngine::AwaitCommit.
  bool AwaitCommit(uint64_t step, absl::Time deadline) {
    return step_->AwaitCommit(step, deadline);
  }
  StepEngine::ReductionCounts Reductions() const { return step_->Reductions(); }

  // ---- Data ----
  // See StepEngine::InitParameters; the backup copies the new state.
  absl::Status InitParameters(const std::vector<ParameterChunkIn>& chunks, uint64_t* elements);
  // See StepEngine::PushGradient: every chunk's sender (rank, incarnation)
  // must be its rank's current process.
  absl::StatusOr<PushResult> PushGradient(const std::vector<GradientChunkIn>& chunks,
                                          absl::Time deadline);
  // See StepEngine::Gather.
  absl::Status Gather(uint64_t after_step, const FlatRange& range, DType dtype,
                      absl::Time deadline, uint64_t max_chunk_elements,
                      const std::function<bool(ParameterChunkOut&)>& write) {
    return step_->Gather(after_step, range, dtype, deadline, max_chunk_elements, write);
  }

  // The node cache (JobSpec.node_cache; server/cache/param_cache.h): the
  // other daemons' parameters in the job's precision, one committed step at
  // a time. Null unless the job asked for it.
  ParamCache* param_cache() { return param_cache_.get(); }

  // ---- Step ----
  // A replicated job's primary brings its backup along before it answers a
  // prepare (with `token`, the caller's, passed on), and sends it the
  // commit after applying it here; when a call fails the group goes on with
  // one copy (backup_in_sync false) and tries again at a later step.
  absl::StatusOr<PrepareResult> PrepareStep(uint64_t step, const std::string& token = "");
  absl::StatusOr<CommitResult> CommitStep(const CommitRequest& request,
                                          const std::string& token = "");
  // With `brief`, leaves out the per-rank list and the missing ranges.
  JobStepState StepState(absl::Duration rank_timeout, bool brief) const;
  uint64_t committed_step() const { return step_->committed_step(); }
  float loss_scale() const { return step_->loss_scale(); }

  // ---- State dicts (Shard.ReadState / WriteState) ----
  // A joined rank's (`rank` as `incarnation`; every chunk's for a write);
  // see StepEngine::ReadState / WriteState. A write that changed the state
  // makes the backup copy it again.
  absl::Status ReadState(uint32_t rank, uint64_t incarnation, WireEnum array,
                         const FlatRange& range, uint64_t max_chunk_elements,
                         const std::function<bool(StateChunkOut&)>& write);
  absl::StatusOr<WriteStateResult> WriteState(const std::vector<StateChunkIn>& chunks);

  // ---- Checkpoints (see CheckpointAgent) ----
  // All: FailedPrecondition when the daemon has no --checkpoint_dir.
  absl::StatusOr<CheckpointSaved> SaveCheckpoint(const std::string& name, uint64_t step);
  absl::StatusOr<CheckpointProgress> CheckpointStatus(const std::string& name,
                                                      absl::Duration wait);
  // `parts`: one per daemon of the job, the part manifests as written
  // (the checkpoint files' own format, kept as protobufs).
  absl::StatusOr<uint64_t> CompleteCheckpoint(const std::string& name,
                                              const std::vector<v1::PartManifest>& parts);
  absl::StatusOr<CheckpointLoaded> LoadCheckpoint(const std::string& name);

  // The master (and half) parameter regions when the job has a transport.
  std::vector<ParameterRegion> ParameterRegions() const { return step_->ParameterRegions(); }
  // The last time the job handed out remote access; its regions must stay
  // mapped a read lease past it.
  absl::Time last_remote_access() const { return step_->last_remote_access(); }
  void NoteRemoteAccess() { step_->NoteRemoteAccess(); }

  // ---- Replication (JobSpec.replicas = 2; replica.proto) ----
  bool replicated() const { return replica_ != nullptr; }
  ReplicaRole role() const;
  uint64_t epoch() const;
  const std::string& peer_address() const;
  // OK when this copy serves its group's requests (always, unreplicated).
  absl::Status CheckServing(std::optional<uint64_t> epoch) const;
  // The replica group's state (nullopt when the job is not replicated).
  std::optional<ReplicaGroupStatus> ReplicaState() const;
  // The replica group (null when the job is not replicated).
  ReplicaGroup* replica() { return replica_.get(); }

  // A hash over every piece of mutable state, for tests that check a
  // rejected request changed nothing.
  uint64_t StateHash() const;

 private:
  Job(std::unique_ptr<JobConfig> config, std::unique_ptr<v1::JobSpec> spec,
      uint32_t daemon_index, const JobResources& resources);
  // Rank 0 as its current incarnation, and the commit's own fields; the
  // clip coefficient (0 read as 1).
  absl::StatusOr<float> CheckCommitRequest(const CommitRequest& r);
  absl::Status CheckpointsEnabled() const;
  // A state change outside a step: a replicated primary's backup copies the
  // state again before the next step.
  void StateChangedOutsideAStep();

  // Heap-held so that the components' pointers to them stay put.
  const std::unique_ptr<const JobConfig> config_;
  const std::unique_ptr<const v1::JobSpec> spec_;
  const uint32_t daemon_index_;
  const JobResources resources_;
  std::vector<uint32_t> owned_partitions_;
  TokenDigest token_;

  RankTable ranks_;
  std::unique_ptr<StepEngine> step_;
  std::unique_ptr<CheckpointAgent> checkpoints_;  // null without a checkpoint_dir
  std::unique_ptr<ReplicaGroup> replica_;         // null unless replicated
  std::unique_ptr<ParamCache> param_cache_;       // null unless node_cache
  // What this job took from resources_.state_memory and state_disk_limit
  // (given back when it goes).
  uint64_t state_memory_taken_ = 0;
  uint64_t state_disk_taken_ = 0;
};

}  // namespace zeroshard
