#pragma once

// One copy of a replicated job's replica group on one daemon
// (JobSpec.replicas = 2; proto/zeroshard/v1/replica.proto): its role
// (primary or backup) and epoch, and state machine replication over the
// step engine. The primary brings its backup along inside each prepare
// (the state when the backup holds none, then the step's reduced gradient
// and its no-grad list) and sends each commit after it; the backup takes
// transfers, forwards and commits, and is promoted by the leader when its
// primary is gone. Requests a daemon serves for a group go to its primary
// at the current epoch (CheckServing).
//
// Locks: mu_ is a leaf, held for bookkeeping only. The primary's
// transfer and forward run inside the step's prepare, with the step
// engine's commit lock held (the step is frozen; nothing else waits for
// the lock then but the step's commit); its commit is sent with no lock
// held. The backup reads a forward from the network with no lock of the
// step engine held (a stalled primary delays no Promote), then takes the
// commit lock to apply it. Every network wait has a deadline.
//
// The replica protocol's messages (replica.proto: transfers, forwards,
// commits, promotions) are this package's peer format, kept as protobufs:
// the Replica service hands them through as received. What the job asks of
// the group (State, SendCommit) is in plain structs.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/zeroshard/v1/common.pb.h"
#include "proto/zeroshard/v1/replica.pb.h"
#include "proto/zeroshard/v1/shard.pb.h"
#include "server/ledger/memory_ledger.h"
#include "server/replica/replica_link.h"
#include "server/step/step_engine.h"
#include "transport/transport.h"

namespace zeroshard {

// A copy's role in its replica group.
enum class ReplicaRole : uint8_t { kPrimary, kBackup };

// A copy's place in its replica group (Replica.GetReplicaState and the step
// state report it).
struct ReplicaGroupStatus {
  uint32_t group = 0;
  ReplicaRole role = ReplicaRole::kPrimary;
  uint64_t epoch = 0;
  uint64_t committed_step = 0;
  bool prepared = false;
  bool in_sync = false;
  std::string peer_address;
};

class ReplicaGroup {
 public:
  struct Options {
    uint32_t group = 0;         // the replica group (its daemon's index)
    uint32_t peer_index = 0;    // the group's other daemon
    std::string peer_address;   // its HOST:PORT
    ReplicaRole role = ReplicaRole::kPrimary;  // at the start
    // How a primary reaches its backup (null: it runs without one).
    ReplicaLink* link = nullptr;
    // The longest one replication call may take before the group goes on
    // with one copy, plus its bytes at 50 MB/s.
    absl::Duration timeout = absl::Seconds(5);
    // Heartbeats from a primary to its backup's daemon: a thread of the
    // group's probes it every liveness_timeout / 4 (ReplicaLink::Probe, each
    // bounded by liveness_timeout / 2, no lock held). A backup whose daemon
    // has not answered for liveness_timeout, or whose replication call
    // ended UNAVAILABLE or DEADLINE_EXCEEDED, is silent: no step calls it
    // (the group goes on with one copy, and no prepare waits out a dead
    // peer's deadline) until a probe is answered; then the next step copies
    // the state to it. Before a state transfer (a backup not current, as
    // the old primary after a promotion) the step probes it itself, for
    // liveness_timeout / 4 (1 s at most). Zero: no heartbeats; a failed
    // backup is tried again a second later.
    absl::Duration liveness_timeout = absl::Seconds(4);
    transport::Transport* transport = nullptr;  // bulk state transfers; may be null
    MemoryLedger* ledger = nullptr;
  };

  // `spec` (re-registered on a peer that lost the job) and `step` must
  // outlive the group.
  ReplicaGroup(Options options, const v1::JobSpec* spec, StepEngine* step);
  // Stops the probe thread (at most one probe's deadline).
  ~ReplicaGroup();
  ReplicaGroup(const ReplicaGroup&) = delete;
  ReplicaGroup& operator=(const ReplicaGroup&) = delete;

  ReplicaRole role() const;
  uint64_t epoch() const;
  const std::string& peer_address() const { return options_.peer_address; }
  // OK when this copy serves its group's requests: it is the group's
  // primary at `epoch` (nullopt: the caller named none). FailedPrecondition
  // saying why otherwise.
  absl::Status CheckServing(std::optional<uint64_t> epoch) const;
  ReplicaGroupStatus State() const;
  // The primary's copy changed outside a step (initial parameters, a load,
  // a state write): the backup copies the state again before the next
  // step. `why` non-OK: a failure, logged, and retried after a pause; one
  // that says the backup's daemon did not answer (UNAVAILABLE,
  // DEADLINE_EXCEEDED) waits for a probe to be answered instead
  // (Options::liveness_timeout).
  void MarkBackupStale(const absl::Status& why);

  // ---- The primary's side ----
  // Brings the backup along to the prepared step `prepared`, with the step
  // engine's commit lock held by the caller: the state when the backup has
  // none (a restarted peer gets the job registered again), then the
  // reduced gradient. Whether the backup holds the step; on failure the
  // group goes on with one copy and tries again at a later step.
  bool ReplicatePrepared(const StepEngine::Prepared& prepared, const std::string& token);
  // Sends the leader's commit `request` to an in-sync backup, with no lock
  // held (the caller committed it here first). A failure marks the backup
  // stale.
  void SendCommit(const CommitRequest& request, const std::string& token);

  // ---- The backup's side (the Replica service) ----
  // See Replica.Promote.
  absl::Status Promote(const v1::PromoteRequest& request);
  // Before a Promote from a caller that may not replace a primary that
  // still serves (a trainer: docs/security.md): asks the primary's daemon,
  // over the link with `token` and no lock held, which copies of the job it
  // holds, waiting until `deadline` at most. OK when it does not serve the
  // group any more: it did not answer (UNAVAILABLE, DEADLINE_EXCEEDED), no
  // longer has the job (NOT_FOUND), or holds the group only as a backup or
  // at an older epoch; also when this copy is the primary already (the
  // promotion is then idempotent or refused by Promote). Aborted when the
  // primary answers as the group's primary at this copy's epoch or a newer
  // one, or when its daemon's answer is another error (it is not known to
  // be gone); FailedPrecondition without a link.
  absl::Status CheckPrimaryGone(const std::string& token, absl::Time deadline) const;
  // `first` is the stream's first chunk (which named this copy), `next`
  // reads the following ones (false at the end). Nothing changes on any
  // error; a refused forward or commit marks the copy out of sync (it waits
  // for the next state transfer). A transfer whose first chunk names the
  // primary's arrays (`bulk`) reads them over the bulk transport, blocking
  // until `deadline` at most; when this daemon cannot it answers with
  // bulk_refused set and takes nothing: the primary then streams the data.
  absl::StatusOr<v1::TransferStateResponse> AcceptState(
      const v1::ReplicaStateChunk& first, absl::FunctionRef<bool(v1::ReplicaStateChunk*)> next,
      absl::Time deadline);
  absl::StatusOr<v1::ForwardGradientResponse> AcceptGradient(
      const v1::ForwardedGradientChunk& first,
      absl::FunctionRef<bool(v1::ForwardedGradientChunk*)> next);
  absl::StatusOr<v1::CommitStepResponse> CommitReplica(const v1::CommitReplicaRequest& request);
  // OK when a primary at `epoch` may drive this copy: it is the backup at
  // that epoch (`transfer`: or any role at a lower one; a copy that holds
  // state only at epoch - 1, and never to the largest epoch).
  absl::Status CheckDrivenBy(uint64_t epoch, bool transfer) const;

 private:
  // FailedPrecondition unless this backup holds a current copy.
  absl::Status RequireCurrentCopy() const;
  // The backup answered ABORTED (`why`): it is at a newer epoch, so a
  // promotion replaced this primary. Becomes a backup that is not current
  // (its bytes booked as replica again) and says so on stderr; the new
  // primary copies its state here. Nothing when already a backup.
  void StepDownLocked(const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_->commit_lock());
  absl::Status PromoteLocked(const v1::PromoteRequest& r)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_->commit_lock());
  // Over the bulk transport when both daemons have the same kind, else in
  // the stream.
  absl::Status SendState(const std::string& token, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_->commit_lock());
  // The state's arrays in 4 MiB chunks of the stream.
  absl::StatusOr<v1::TransferStateResponse> StreamState(const std::string& token,
                                                        const v1::TrainingState& state,
                                                        size_t arrays, uint64_t epoch,
                                                        absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_->commit_lock());
  // The first chunk of a bulk transfer (state and epoch set by the caller),
  // or nullopt when this copy's arrays are not in transport regions.
  std::optional<v1::ReplicaStateChunk> BulkStateChunk(size_t arrays) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_->commit_lock());
  absl::Status SendGradient(const StepEngine::Prepared& prepared, const std::string& token,
                            absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_->commit_lock());
  // Starts the probe thread unless it runs (joining a finished one first),
  // when there is a link and a liveness timeout.
  void StartProberLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The probe thread: heartbeats to the backup's daemon while this copy is
  // the primary and the group runs.
  void RunProber();

  const Options options_;
  const v1::JobSpec* const spec_;
  StepEngine* const step_;
  const JobConfig& config_;

  mutable absl::Mutex mu_;
  ReplicaRole role_ ABSL_GUARDED_BY(mu_);
  uint64_t epoch_ ABSL_GUARDED_BY(mu_) = 1;
  // Backup: holds a copy of the primary's state. Primary: the backup took
  // the last forward.
  bool in_sync_ ABSL_GUARDED_BY(mu_) = false;
  // This copy holds the group's state (a primary, or a backup that took a
  // transfer): a transfer's epoch may then be at most one above its own.
  bool held_state_ ABSL_GUARDED_BY(mu_) = false;
  // Primary out of sync: the next attempt to bring the backup along.
  absl::Time next_resync_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  // Primary: the backup's daemon did not answer; no step calls it until a
  // probe is answered. Since when (its last answer).
  bool peer_silent_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time silent_since_ ABSL_GUARDED_BY(mu_);
  // Primary: when the backup's daemon last answered (a heartbeat, or a
  // replication call that succeeded).
  absl::Time last_answer_ ABSL_GUARDED_BY(mu_);
  // Primary: since when the group has had one current copy (this one), for
  // the report once the backup is current again; unset while in sync.
  std::optional<absl::Time> one_copy_since_ ABSL_GUARDED_BY(mu_);
  bool prober_running_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread prober_ ABSL_GUARDED_BY(mu_);

  // Backup: where a forward's chunks land until all are in (booked as
  // buffer on first use, released with the job). forward_mu_ lets one
  // forward at a time read into it; the step engine's locks are not held
  // while it reads the network.
  absl::Mutex forward_mu_;
  LedgerArray<float> forward_buffer_ ABSL_GUARDED_BY(forward_mu_);
};

}  // namespace zeroshard
