#pragma once

// One training job on one daemon: the ranks (incarnations, liveness, staging
// regions), the open step's reduction, the model states of the partitions
// this daemon owns, and the two-phase step.
//
// Locks, in the order they may be taken:
//   commit_mu_  serialises InitParameters, PrepareStep and CommitStep (held
//               for the optimizer's run, by nothing else);
//   mu_         the reduction and the step bookkeeping (held for bookkeeping
//               and the pushes' accumulation; never for the optimizer, never
//               for network I/O);
//   params_mu_  the model states (shared for a gather's chunk copy, exclusive
//               for the optimizer's update);
//   ranks_mu_   the rank table (held for bookkeeping only).
// The committed step and the joined-rank count are atomics: Status and
// GetStepState never wait for a step. Every wait takes a deadline.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/auth.h"
#include "common/job_spec.h"
#include "proto/zeroshard/v1/checkpoint.pb.h"
#include "proto/zeroshard/v1/common.pb.h"
#include "proto/zeroshard/v1/control.pb.h"
#include "proto/zeroshard/v1/replica.pb.h"
#include "proto/zeroshard/v1/shard.pb.h"
#include "server/daemon_metrics.h"
#include "server/job_checkpoint.h"
#include "server/memory_ledger.h"
#include "server/optimizer/optimizer.h"
#include "server/reduction.h"
#include "server/replica_link.h"
#include "server/shard_state.h"
#include "server/staging.h"
#include "transport/transport.h"

namespace zeroshard {

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
};

// A job's copy of a replica group (replica.proto).
enum class ReplicaRole : uint8_t { kPrimary, kBackup };

class Job {
 public:
  // Allocates the owned partitions' states. The whole footprint is booked in
  // the ledger in one step before anything is allocated: ResourceExhausted,
  // with nothing allocated and no ledger entry left, when it does not fit.
  // `daemon_index` is the replica group this copy holds (the partitions
  // spec.daemons[daemon_index] owns). Replicated jobs: `here` is the index
  // of the daemon the copy lives on (the group's own daemon or its peer),
  // `role` its role at the start; a backup's memory is booked as replica.
  static absl::StatusOr<std::unique_ptr<Job>> Create(JobConfig config, v1::JobSpec spec,
                                                     uint32_t daemon_index,
                                                     const JobResources& resources,
                                                     ReplicaRole role = ReplicaRole::kPrimary,
                                                     uint32_t here = kHereIsGroup);
  static constexpr uint32_t kHereIsGroup = ~0u;
  ~Job();

  const JobConfig& config() const { return config_; }
  // The digest of the token the job was registered with (common/auth.h).
  // Set by the JobManager before the job is published, then never changed.
  const TokenDigest& token() const { return token_; }
  void set_token(const TokenDigest& token) { token_ = token; }
  const v1::JobSpec& spec() const { return spec_; }
  uint32_t daemon_index() const { return daemon_index_; }
  const std::vector<uint32_t>& owned_partitions() const { return owned_partitions_; }
  FlatRange owned_range() const { return owned_; }
  // Owned elements below total_elements (real parameters plus alignment gaps).
  FlatRange owned_unpadded() const { return owned_unpadded_; }

  // ---- Ranks ----
  // See Control.JoinJob. FailedPrecondition naming the field and both values
  // when the rank's view differs from the registered job, or for an
  // incarnation older than the rank's current one; NotFound once removed.
  absl::Status Join(const v1::JoinJobRequest& request, v1::JoinJobResponse* response);
  // OK iff `rank` is joined as `incarnation` (and records it heard from now).
  absl::Status CheckRank(uint32_t rank, uint64_t incarnation, absl::string_view field);
  // Leaves; returns true when this was the last joined rank: the job is then
  // marked removed (no staging is created for it any more) and the caller
  // takes it out of the registry.
  absl::StatusOr<bool> Leave(uint32_t rank, uint64_t incarnation);
  uint32_t ranks_joined() const { return ranks_joined_.load(std::memory_order_acquire); }
  // Joined ranks heard from within `timeout`.
  uint32_t RanksConnected(absl::Duration timeout) const;
  // The rank's staging region (created on first use through the transport).
  // FailedPrecondition without a transport; NotFound once removed.
  absl::StatusOr<std::shared_ptr<RankStaging>> Staging(uint32_t rank, uint64_t incarnation,
                                                       bool create);

  // Blocks (without holding any lock other requests need) until `step` is
  // committed or `deadline`; whether it is committed. Only the open step is
  // waited for: an older one answers true, a later one false, at once.
  bool AwaitCommit(uint64_t step, absl::Time deadline);
  // Passes over the gradient that summed contributions so far, and the
  // contributions they summed (tests).
  struct ReductionCounts {
    uint64_t passes = 0;
    uint64_t contributions = 0;
  };
  ReductionCounts Reductions() const;

  // ---- Data ----
  // Stores initial parameters; all chunks are validated before any is
  // applied. FailedPrecondition after the first commit.
  absl::Status InitParameters(const std::vector<v1::ParameterChunk>& chunks, uint64_t* elements);
  // Applies one pushed stream atomically: every chunk is validated first; on
  // any error nothing changes. `payloads[i]` holds chunk i's bytes (its data,
  // or bytes in a staging slot the caller holds), read only during the call.
  // When applying would overflow the out-of-order budget, waits (until
  // `deadline`: DeadlineExceeded, nothing applied) for earlier contributions
  // to drain it.
  absl::Status PushGradient(const std::vector<v1::GradientChunk>& chunks,
                            const std::vector<absl::string_view>& payloads, absl::Time deadline,
                            v1::PushGradientResponse* response);
  // Waits until `after_step` is committed (or `deadline`: DeadlineExceeded),
  // then calls `write` with consecutive chunks of at most
  // max_chunk_elements covering `range` in `dtype`. `write` runs with no
  // lock held (a slow reader delays nobody); if a commit changes the
  // parameters between two chunks the gather fails with Aborted (ask again).
  // `write` returning false stops (Cancelled). A null `write` only validates
  // and waits (the caller reads the range from the parameter regions).
  absl::Status Gather(uint64_t after_step, const FlatRange& range, DType dtype,
                      absl::Time deadline, uint64_t max_chunk_elements,
                      const std::function<bool(v1::ParameterChunk&)>& write);

  // ---- Step ----
  // A replicated job's primary also brings its backup along before it
  // answers (replica.proto), with `token` (the caller's, passed on): the
  // state when the backup has none, then the step's reduced gradient; and
  // the commit. The calls hold commit_mu_ (only this job's step calls wait)
  // and no other lock, each within resources.replica_timeout plus its bytes
  // at 50 MB/s; when one
  // fails the group goes on with one copy (backup_in_sync false) and tries
  // again at a later step.
  absl::StatusOr<v1::PrepareStepResponse> PrepareStep(uint64_t step, const std::string& token = "");
  absl::StatusOr<v1::CommitStepResponse> CommitStep(const v1::CommitStepRequest& request,
                                                    const std::string& token = "");
  // With `brief`, leaves out the per-rank list and the missing ranges.
  void FillStepState(absl::Duration rank_timeout, bool brief, v1::StepState* state) const;
  uint64_t committed_step() const { return committed_step_.load(std::memory_order_acquire); }
  float loss_scale() const;

  // ---- Checkpoints (proto/zeroshard/v1/checkpoint.proto) ----
  // All: FailedPrecondition when the daemon has no --checkpoint_dir.
  // Snapshots the committed state (holding the commit lock for the copy
  // only) and starts writing it in the background.
  absl::StatusOr<v1::SaveCheckpointResponse> SaveCheckpoint(const v1::SaveCheckpointRequest& r);
  absl::StatusOr<v1::CheckpointStatus> CheckpointStatus(const std::string& name,
                                                        absl::Duration wait);
  // Writes MANIFEST from every daemon's part (`map` is this job's).
  absl::StatusOr<v1::CompleteCheckpointResponse> CompleteCheckpoint(
      const v1::CompleteCheckpointRequest& r, const v1::PartitionMap& map);
  // Reads the owned range of a complete checkpoint (no lock held), then
  // replaces the state with it (under every lock, a copy). Nothing changes
  // on any error.
  absl::StatusOr<v1::LoadCheckpointResponse> LoadCheckpoint(const std::string& name);

  // ---- State dicts (Shard.ReadState / WriteState) ----
  // The committed `array` over `range` (owned, unpadded) in chunks of at
  // most `max_chunk_elements`, each passed to `write` with no lock held
  // (false stops: Cancelled); the first chunk carries the update counts of
  // the trainable tensors overlapping the range. Aborted when a commit or a
  // write changes the state between two chunks (ask again);
  // FailedPrecondition while the open step is prepared.
  absl::Status ReadState(const v1::ReadStateRequest& request, uint64_t max_chunk_elements,
                         const std::function<bool(v1::StateChunk&)>& write);
  // Checks every chunk (rank, array, range, size, CRC, zeros where there
  // is no state, update counts), then applies them all under every lock.
  // Nothing changes on any error.
  absl::StatusOr<v1::WriteStateResponse> WriteState(const std::vector<v1::StateChunk>& chunks);

  // Adds PARAM_MASTER / PARAM_HALF regions when the job has a transport.
  void FillParameterRegions(v1::ExchangeEndpointResponse* response) const;
  // The last time the job handed out remote access (an endpoint, a gather's
  // go-ahead); its regions must stay mapped a read lease past it.
  absl::Time last_remote_access() const;
  void NoteRemoteAccess();

  // ---- Replication (JobSpec.replicas = 2; proto/zeroshard/v1/replica.proto) ----
  bool replicated() const { return config_.replicas > 1; }
  ReplicaRole role() const;
  uint64_t epoch() const;
  const std::string& peer_address() const { return peer_address_; }
  // OK when this copy serves its group's requests: the job is not
  // replicated, or this copy is the group's primary at `epoch` (nullopt:
  // the caller named none). FailedPrecondition saying why otherwise.
  absl::Status CheckServing(std::optional<uint64_t> epoch) const;
  void FillReplicaState(v1::ReplicaGroupState* out) const;
  // See Replica.Promote.
  absl::Status Promote(const v1::PromoteRequest& request);
  // The backup side of the primary's calls; `first` is the stream's first
  // chunk (which named this copy), `next` reads the following ones (false at
  // the end). Nothing changes on any error; a refused forward or commit
  // marks the copy out of sync (it waits for the next state transfer). A
  // transfer whose first chunk names the primary's arrays (`bulk`) reads
  // them over the bulk transport, blocking until `deadline` at most; when
  // this daemon cannot (no bulk transport, another kind, the primary out of
  // reach) it answers with bulk_refused set and takes nothing: the primary
  // then streams the data.
  absl::StatusOr<v1::TransferStateResponse> AcceptState(
      const v1::ReplicaStateChunk& first, absl::FunctionRef<bool(v1::ReplicaStateChunk*)> next,
      absl::Time deadline);
  absl::StatusOr<v1::ForwardGradientResponse> AcceptGradient(
      const v1::ForwardedGradientChunk& first,
      absl::FunctionRef<bool(v1::ForwardedGradientChunk*)> next);
  absl::StatusOr<v1::CommitStepResponse> CommitReplica(const v1::CommitReplicaRequest& request);
  // OK when a primary at `epoch` may drive this copy: it is the backup at
  // that epoch (`transfer`: or at a lower one, or any role at a lower one).
  absl::Status CheckDrivenBy(uint64_t epoch, bool transfer) const;

  // A hash over every piece of mutable state, for tests that check a
  // rejected request changed nothing.
  uint64_t StateHash() const;

 private:
  TokenDigest token_;
  struct RankEntry {
    uint64_t incarnation = 0;  // 0: never joined
    bool joined = false;
    absl::Time last_seen = absl::InfinitePast();
    uint64_t last_step_pushed = 0;
    std::shared_ptr<RankStaging> staging;
  };
  struct LastCommit {
    v1::CommitStepResponse response;
    float clip_coef = 1.0f;
    float grad_norm = 0.0f;
    float lr = 0.0f;
    std::vector<float> group_lrs;  // as the commit carried them (may be empty)
  };

  Job(JobConfig config, v1::JobSpec spec, uint32_t daemon_index, const JobResources& resources,
      ReplicaRole role, uint32_t here);
  absl::Status CheckChunk(const v1::GradientChunk& c, size_t index, absl::string_view payload,
                          Contribution* out) const;
  absl::Status CheckRankLocked(uint32_t rank, uint64_t incarnation, absl::string_view field)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(ranks_mu_);
  // Validates a CommitStep's own fields and the leader's incarnation;
  // returns the clip coefficient (0 read as 1).
  absl::StatusOr<float> CheckCommitRequest(const v1::CommitStepRequest& r);
  // The decision's own fields (lr, group_lrs, clip_coef) named as `prefix` +
  // field.
  absl::StatusOr<float> CheckCommitFields(const v1::CommitStepRequest& r,
                                          absl::string_view prefix) const;
  void UpdateLossScale(bool skipped) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // 1 / (N_d * loss scale): what the summed gradient is multiplied by before
  // its norm is taken and the optimizer steps.
  float GradScale() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return 1.0f / (static_cast<float>(config_.world_size) * loss_scale_);
  }
  absl::Status CheckpointsEnabled() const;
  // The committed scalars, and putting them back (checkpoints, transfers).
  v1::TrainingState TrainingStateLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RestoreTrainingStateLocked(const v1::TrainingState& state)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The update with a checked clip coefficient (CommitStep, CommitReplica).
  absl::StatusOr<v1::CommitStepResponse> CommitChecked(const v1::CommitStepRequest& r, float clip)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(commit_mu_);
  // The primary's side (commit_mu_ held): brings the backup to the prepared
  // step; returns whether it holds it.
  bool ReplicatePrepared(uint64_t step, const std::string& token)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(commit_mu_);
  // Over the bulk transport when both daemons have the same kind, else in
  // the stream.
  absl::Status SendState(const std::string& token, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(commit_mu_);
  // The state's arrays in 4 MiB chunks of the stream.
  absl::StatusOr<v1::TransferStateResponse> StreamState(const std::string& token,
                                                        const v1::TrainingState& state,
                                                        size_t arrays, uint64_t epoch,
                                                        absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(commit_mu_);
  // The first chunk of a bulk transfer (state and epoch set by the caller),
  // or nullopt when this copy's arrays are not in transport regions.
  std::optional<v1::ReplicaStateChunk> BulkStateChunk(size_t arrays) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(commit_mu_);
  absl::Status SendGradient(uint64_t step, const std::string& token, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(commit_mu_);
  void MarkBackupStale(const absl::Status& why);
  absl::Status PromoteLocked(const v1::PromoteRequest& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(commit_mu_);
  // Books the copy's memory for `role`: a backup's as replica, a primary's
  // under each array's own category.
  void BookForRole(ReplicaRole role) ABSL_EXCLUSIVE_LOCKS_REQUIRED(commit_mu_);
  // FailedPrecondition unless this backup holds a current copy.
  absl::Status RequireCurrentCopy() const;
  // Applies a checked batch, waiting (mu_ released) while the out-of-order
  // buffer is full; `senders_current` (called under mu_) is asked again
  // after every wait.
  // With `held` non-null (a batch of one staged contribution), it may be
  // held rather than summed: *held is then set (ReductionState::Apply).
  absl::Status ApplyPush(const std::vector<Contribution>& batch, uint32_t micro_batches,
                         absl::Time deadline, absl::FunctionRef<absl::Status()> senders_current,
                         uint64_t* elements, std::shared_ptr<HeldContribution>* held = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits (mu_ released) while `held` (contribution `c`) is held, up to
  // the hold time; then, its sender still current, sums or buffers it
  // itself. OK once it is let go; FailedPrecondition if it was dropped (or
  // senders_current's error); DeadlineExceeded (nothing applied) if the
  // buffer or the memory limit had no room for it by `deadline`.
  absl::Status AwaitHeld(const Contribution& c, const std::shared_ptr<HeldContribution>& held,
                         absl::Time deadline, absl::FunctionRef<absl::Status()> senders_current)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const JobConfig config_;
  const v1::JobSpec spec_;
  const uint32_t daemon_index_;
  const JobResources resources_;
  std::vector<uint32_t> owned_partitions_;
  FlatRange owned_;
  FlatRange owned_unpadded_;
  // The owned tensors (shard_'s, immutable), set by Create.
  const OwnedTensors* tensors_ = nullptr;

  mutable absl::Mutex commit_mu_ ABSL_ACQUIRED_BEFORE(mu_);

  mutable absl::Mutex mu_ ABSL_ACQUIRED_BEFORE(params_mu_, ranks_mu_);
  LedgerArray<float> grad_ ABSL_GUARDED_BY(mu_);  // the reduced (summed) gradient
  std::unique_ptr<ReductionState> reduction_ ABSL_GUARDED_BY(mu_);
  uint64_t reduction_changes_ ABSL_GUARDED_BY(mu_) = 0;  // wakes pushes waiting for budget
  bool prepared_ ABSL_GUARDED_BY(mu_) = false;
  // The prepared gradient came from the group's primary (a forward), not
  // from this copy's own reduction: kept to finish a step another copy
  // committed, and dropped when the ranks push the step again (the primary
  // died before any copy committed it).
  bool prepared_by_forward_ ABSL_GUARDED_BY(mu_) = false;
  v1::PrepareStepResponse prepare_result_ ABSL_GUARDED_BY(mu_);
  // The prepared step's tensors without a gradient (layout indices,
  // ascending), which its commit skips: from the reduction, or from the
  // primary's forward.
  std::vector<uint32_t> prepared_no_grad_ ABSL_GUARDED_BY(mu_);
  LastCommit last_commit_ ABSL_GUARDED_BY(mu_);
  float loss_scale_ ABSL_GUARDED_BY(mu_) = 1.0f;
  uint32_t good_steps_ ABSL_GUARDED_BY(mu_) = 0;
  // Written under mu_ (so waiting gathers wake), read anywhere.
  std::atomic<uint64_t> committed_step_{0};

  mutable absl::Mutex params_mu_;
  std::unique_ptr<ShardState> shard_ ABSL_GUARDED_BY(params_mu_);
  // Bumped by every write of the parameters: a gather that sees it change
  // between chunks was torn by a commit.
  uint64_t params_version_ ABSL_GUARDED_BY(params_mu_) = 0;

  mutable absl::Mutex ranks_mu_;
  std::vector<RankEntry> ranks_ ABSL_GUARDED_BY(ranks_mu_);
  bool removed_ ABSL_GUARDED_BY(ranks_mu_) = false;
  std::atomic<uint32_t> ranks_joined_{0};
  std::atomic<int64_t> last_remote_access_ns_{0};

  std::unique_ptr<JobCheckpoints> checkpoints_;  // null without a checkpoint_dir

  // Replication; replica_mu_ is a leaf lock, held for bookkeeping only.
  std::string peer_address_;  // the group's other daemon (replicated jobs)
  uint32_t peer_index_ = 0;
  mutable absl::Mutex replica_mu_;
  ReplicaRole role_ ABSL_GUARDED_BY(replica_mu_) = ReplicaRole::kPrimary;
  uint64_t epoch_ ABSL_GUARDED_BY(replica_mu_) = 1;
  // Backup: holds a copy of the primary's state. Primary: the backup took
  // the last forward.
  bool in_sync_ ABSL_GUARDED_BY(replica_mu_) = false;
  // Backup: where a forward's chunks land until all are in (booked as
  // buffer on first use, released with the job).
  LedgerArray<float> forward_buffer_ ABSL_GUARDED_BY(commit_mu_);
  // Primary out of sync: the next attempt to bring the backup along.
  absl::Time next_resync_ ABSL_GUARDED_BY(replica_mu_) = absl::InfinitePast();
};

}  // namespace zeroshard
