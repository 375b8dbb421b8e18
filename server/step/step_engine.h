#pragma once

// One job copy's step on one daemon: the model states of the flat range it
// owns (ShardState), the open step's reduction (ReductionState), and the
// two-phase step over them, with what reads or replaces that state: initial
// parameters, gathers, state reads and writes, and the snapshots and
// restores that checkpoints and replica transfers are made of. It knows no
// ranks (the caller checks who sends a push), no files and no peers: a
// checkpoint agent and a replica group use it through the calls below.
//
// Locks, in the order they may be taken:
//   commit_mu_  state changes one at a time: initial parameters, prepare,
//               commit, state writes, restores, snapshots. Held for the
//               optimizer's run, and by the callers of commit_lock() for
//               work on the frozen state (a replica transfer of the
//               prepared step; a checkpoint's snapshot copy). Never taken
//               by pushes, gathers, state reads or step-state reads;
//   mu_         the reduction and the step bookkeeping (held for
//               bookkeeping; released for the pushes' accumulation, which
//               runs each range's pass while that range is marked busy
//               (ReductionState::SumJob); never held for the optimizer,
//               never for network I/O);
//   params_mu_  the model states (shared for a gather's chunk copy,
//               exclusive for the optimizer's update).
// The committed step is an atomic: step-state reads never wait for a step.
// Every wait takes a deadline.
//
// Its calls take and answer the plain structs of step_types.h; server/rpc
// does the wire decoding. One protobuf stays: v1::TrainingState, the
// committed scalars as checkpoint files and replica transfers persist them
// (TrainingState, Restore).

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/job_spec.h"
#include "proto/zeroshard/v1/checkpoint.pb.h"
#include "server/metrics/daemon_metrics.h"
#include "server/ledger/memory_ledger.h"
#include "server/optimizer/optimizer.h"
#include "server/step/reduction.h"
#include "server/disk/mapped_file.h"
#include "server/step/shard_state.h"
#include "server/step/step_types.h"
#include "transport/transport.h"

namespace zeroshard {

class StepEngine {
 public:
  struct Options {
    MemoryLedger* ledger = nullptr;
    ShardOptimizer* optimizer = nullptr;
    transport::Transport* transport = nullptr;  // the bulk transport; may be null
    DaemonMetrics* metrics = nullptr;           // may be null
    uint64_t reduction_buffer_bytes = 256ull << 20;  // out-of-order budget
    // How long a staged push that does not complete its range may be held
    // for the range's other contributions (DaemonOptions).
    absl::Duration reduction_hold = absl::ZeroDuration();
    // A backup's copy: every byte booked as replica.
    bool replica = false;
    // Where the masters and moments live when not in RAM (ShardState).
    DiskResidence disk;
    // Tests: called by Commit while it reads the prepared step's gradient,
    // with none of the engine's locks held but commit_lock().
    std::function<void()> while_committing;
  };

  // Allocates the model states of `owned` (the daemon's padded range) and
  // the gradient, booking the whole footprint in the ledger in one step
  // before anything is allocated: ResourceExhausted, with nothing allocated
  // and no ledger entry left, when it does not fit. `config` must outlive
  // the engine.
  static absl::StatusOr<std::unique_ptr<StepEngine>> Create(const JobConfig* config,
                                                            FlatRange owned,
                                                            const Options& options);
  ~StepEngine();

  const JobConfig& config() const { return *config_; }
  // The kernels the model states are updated and converted with (for a
  // restore's half copy).
  ShardOptimizer* optimizer() const { return options_.optimizer; }
  FlatRange owned() const { return owned_; }
  // Owned elements below total_elements (parameters plus alignment gaps).
  FlatRange owned_unpadded() const { return owned_unpadded_; }
  // The owned tensors (immutable).
  const OwnedTensors& tensors() const { return *tensors_; }
  uint64_t committed_step() const { return committed_step_.load(std::memory_order_acquire); }
  float loss_scale() const;
  // The bytes of the model states' file on --state_dir (0: all in RAM), and
  // what is known of its health (ShardState::damaged).
  uint64_t disk_bytes() const { return disk_bytes_; }
  // Whether the masters and moments live in a file (ShardState::on_disk).
  bool states_on_disk() const { return states_on_disk_; }
  absl::Status disk_damaged() const;

  // ---- Data ----
  // Stores initial parameters; every chunk is checked before any is
  // applied. FailedPrecondition after the first commit.
  absl::Status InitParameters(const std::vector<ParameterChunkIn>& chunks, uint64_t* elements);
  // Applies one pushed stream atomically: every chunk is checked first; on
  // any error nothing changes. Each chunk's payload is read only during the
  // call. `senders_current` (called with the reduction lock
  // held, and again after every wait that released it) says whether the
  // chunks' senders are still their ranks' current processes. Waits (until
  // `deadline`: DeadlineExceeded, nothing applied) while the out-of-order
  // budget is full.
  absl::StatusOr<PushResult> PushGradient(const std::vector<GradientChunkIn>& chunks,
                                          absl::Time deadline,
                                          absl::FunctionRef<absl::Status()> senders_current);
  // Runs `join` (a rank table's update, which returns the incarnation a
  // newer process replaces, or 0) with the reduction lock held, then drops
  // what the replaced process left waiting in the reduction: a new
  // process's pushes never meet its predecessor's. Returns `join`'s error,
  // or the contributions dropped.
  absl::StatusOr<uint32_t> JoinRank(uint32_t rank,
                                    absl::FunctionRef<absl::StatusOr<uint64_t>()> join);
  // Waits until `after_step` is committed (or `deadline`: DeadlineExceeded),
  // then calls `write` with consecutive chunks of at most
  // max_chunk_elements covering `range` in `dtype`, with no lock held (a
  // slow reader delays nobody); Aborted if a commit changes the parameters
  // between two chunks. Each chunk names the committed step its data is
  // at (its `step`; at least after_step). `write` returning false stops
  // (Cancelled); it may swap the chunk's data out (step_types.h). A null
  // `write` only validates and waits.
  absl::Status Gather(uint64_t after_step, const FlatRange& range, DType dtype,
                      absl::Time deadline, uint64_t max_chunk_elements,
                      const std::function<bool(ParameterChunkOut&)>& write);
  // Blocks (without holding any lock other requests need) until `step` is
  // committed or `deadline`; whether it is committed. Only the open step is
  // waited for: an older one answers true, a later one false, at once.
  bool AwaitCommit(uint64_t step, absl::Time deadline);

  // ---- Step ----
  // What a prepared step is, for its replication: valid while commit_lock()
  // is held (the gradient is frozen until the commit).
  struct Prepared {
    uint64_t step = 0;
    bool fresh = false;  // prepared by this call (not earlier)
    const float* grad = nullptr;  // indexed like the owned range
    std::vector<uint32_t> no_grad;
    PrepareResult result;
  };
  // Phase 1, with commit_lock() held by the caller: checks the step's
  // gradient is complete, freezes it and answers its norm (a step prepared
  // already answers its result again, not fresh). The caller may then work
  // on the frozen step (a replica's forward) before FinishPrepare, still
  // holding the lock: nothing can change it, and nothing else waits for
  // the lock while a step is prepared but the step's own commit.
  absl::StatusOr<Prepared> PrepareLocked(uint64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(commit_mu_);
  // Records whether the group's backup holds the prepared step; the
  // prepare's answer.
  PrepareResult FinishPrepare(bool backup_in_sync)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(commit_mu_);
  // Phase 2 with a checked clip coefficient: the update (or the skip), the
  // loss scale, the committed step. The committed step answers its
  // recorded commit. Times the optimizer's update alone (the metrics'
  // zeroshard_optimizer_seconds). Commit takes commit_lock(); CommitLocked
  // runs with it held by the caller.
  absl::StatusOr<CommitResult> Commit(const CommitRequest& request, float clip)
      ABSL_LOCKS_EXCLUDED(commit_mu_);
  absl::StatusOr<CommitResult> CommitLocked(const CommitRequest& request, float clip)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(commit_mu_);
  // The commit's fields checked (lr, group_lrs, clip_coef named as `prefix`
  // + field); the clip coefficient (0 read as 1).
  absl::StatusOr<float> CheckCommitFields(const CommitRequest& request,
                                          absl::string_view prefix) const;
  // The open step's state (committed step, last commit, prepared, progress,
  // the missing ranges unless `brief`); not the ranks.
  StepProgress Progress(bool brief) const;
  bool prepared() const;
  // Passes over the gradient that summed contributions so far, and the
  // contributions they summed (tests).
  struct ReductionCounts {
    uint64_t passes = 0;
    uint64_t contributions = 0;
  };
  ReductionCounts Reductions() const;

  // ---- State dicts ----
  // The committed `array` over `range` in chunks (the first with the update
  // counts), each written with no lock held; Aborted when the state changes
  // between two chunks; FailedPrecondition while prepared. `array` as sent
  // (InvalidArgument naming "array" unless MASTER, EXP_AVG or EXP_AVG_SQ);
  // `write` may swap the chunk's data out (step_types.h).
  absl::Status ReadState(WireEnum array, const FlatRange& range, uint64_t max_chunk_elements,
                         const std::function<bool(StateChunkOut&)>& write);
  // Checks every chunk (array, range, size, CRC, zeros where there is no
  // state, update counts; not the ranks), then applies them all. *changed
  // tells whether anything differed from what was held. Nothing changes on
  // any error.
  absl::StatusOr<WriteStateResult> WriteState(const std::vector<StateChunkIn>& chunks,
                                              bool* changed);

  // ---- Snapshots and restores (checkpoints, replica transfers) ----
  // The lock that keeps every state change out; see the class comment.
  absl::Mutex& commit_lock() ABSL_LOCK_RETURNED(commit_mu_) { return commit_mu_; }
  // The committed scalars (step, loss scale, last commit; not the update
  // counts, which ShardState holds), in the form checkpoint files and
  // replica transfers persist them: a protobuf on purpose.
  v1::TrainingState TrainingState() const;
  // The element counts of the model-state arrays a replica transfer sends
  // (ShardState's raw form, over the owned unpadded range), in order.
  std::vector<uint64_t> TransferSizes() const;
  // Runs `read` on the model states (shared), with commit_lock() held by
  // the caller: nothing writes them meanwhile.
  void ReadModelStates(absl::FunctionRef<void(const ShardState&)> read) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(commit_mu_);
  // Replaces the state: the model states by `restore` (exclusive), the
  // scalars by `state`; the open step's contributions are dropped. With
  // commit_lock() held by the caller. When `restore` fails, its error is
  // returned and the scalars stay as they were (a restore that failed half
  // way on disk has damaged the model states: ShardState).
  absl::Status Restore(const v1::TrainingState& state,
                       absl::FunctionRef<absl::Status(ShardState&)> restore)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(commit_mu_);
  // A backup takes its primary's prepared step (the reduced gradient of the
  // owned unpadded range, its result and its no-grad list): the step is
  // then prepared here, by forward. FailedPrecondition unless `step` is the
  // open step. With commit_lock() held.
  absl::Status TakeForwardedStep(uint64_t step, const float* grad,
                                 const PrepareResult& result,
                                 std::vector<uint32_t> no_grad)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(commit_mu_);
  // Books the copy's memory as replica (a backup) or under each array's
  // own category (a primary).
  void Rebook(bool replica);

  // The master (and half) parameter regions over the owned range; none
  // without a transport.
  std::vector<ParameterRegion> ParameterRegions() const;
  // The last time the job handed out remote access to its regions (an
  // endpoint, a gather's go-ahead); they must stay mapped a read lease past.
  absl::Time last_remote_access() const;
  void NoteRemoteAccess();

  // A hash over every piece of mutable state (tests).
  void Hash(uint64_t& h) const;

 private:
  struct LastCommit {
    CommitResult response;
    float clip_coef = 1.0f;
    float grad_norm = 0.0f;
    float lr = 0.0f;
    std::vector<float> group_lrs;  // as the commit carried them (may be empty)
  };

  StepEngine(const JobConfig* config, FlatRange owned, const Options& options);
  absl::Status CheckChunk(const GradientChunkIn& c, size_t index, Contribution* out) const;
  void UpdateLossScale(bool skipped) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // 1 / (N_d * loss scale): what the summed gradient is multiplied by before
  // its norm is taken and the optimizer steps.
  float GradScale() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return 1.0f / (static_cast<float>(config_->world_size) * loss_scale_);
  }
  v1::TrainingState TrainingStateLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RestoreTrainingStateLocked(const v1::TrainingState& state)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Applies a checked batch, waiting (mu_ released) while the out-of-order
  // buffer is full; see Job::PushGradient.
  absl::Status ApplyPush(const std::vector<Contribution>& batch, uint32_t micro_batches,
                         absl::Time deadline, absl::FunctionRef<absl::Status()> senders_current,
                         uint64_t* elements,
                         std::vector<std::shared_ptr<HeldContribution>>* held = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits (mu_ released) while `held` (contribution `c`) is held, up to
  // `hold_until`; then, its sender still current, sums or buffers it
  // itself. OK once it is let go; FailedPrecondition if it was dropped (or
  // senders_current's error); DeadlineExceeded (nothing applied) if the
  // buffer or the memory limit had no room for it by `deadline`.
  absl::Status AwaitHeld(const Contribution& c, const std::shared_ptr<HeldContribution>& held,
                         absl::Time hold_until, absl::Time deadline,
                         absl::FunctionRef<absl::Status()> senders_current)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Lets go of every contribution of `held` still waiting (dropped
  // unsummed) and waits for those being summed: the caller's payloads are
  // read by no one once it returns. For a push that fails part way.
  void ReleaseHeld(const std::vector<std::shared_ptr<HeldContribution>>& held)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops a held contribution unsummed (ReductionState::DropHeld) and
  // wakes the waiters on the reduction.
  void DropHeldLocked(HeldContribution* held) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits (mu_ released) while another push's pass reads `held`.
  void AwaitNotSumming(const HeldContribution& held) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs the reduction's planned passes (ReductionState::TakeReadySums)
  // with mu_ released, then finishes them under it, until none is left:
  // pushes of other ranges register while a range is summed. Blocks for
  // the passes (the optimizer's threads).
  void RunReadySums() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits (mu_ released meanwhile) until no planned pass is in flight:
  // before anything reads the whole gradient, overwrites it, or forgets
  // the step. In-process work, no peer: bounded by the passes themselves.
  void AwaitSumsLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // AwaitSumsLocked, then ReductionState::Reset.
  void ResetReductionLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const JobConfig* const config_;
  const Options options_;
  const FlatRange owned_;
  const FlatRange owned_unpadded_;
  // shard_'s tensors (immutable), set by Create.
  const OwnedTensors* tensors_ = nullptr;

  mutable absl::Mutex commit_mu_ ABSL_ACQUIRED_BEFORE(mu_);

  mutable absl::Mutex mu_ ABSL_ACQUIRED_BEFORE(params_mu_);
  LedgerArray<float> grad_ ABSL_GUARDED_BY(mu_);  // the reduced (summed) gradient
  // On disk (DiskResidence::gradient): the gradient's file mapping in place
  // of grad_'s memory.
  std::unique_ptr<MappedFile> grad_file_ ABSL_GUARDED_BY(mu_);
  float* grad_data_ ABSL_GUARDED_BY(mu_) = nullptr;  // grad_'s or grad_file_'s
  std::unique_ptr<ReductionState> reduction_ ABSL_GUARDED_BY(mu_);
  uint64_t reduction_changes_ ABSL_GUARDED_BY(mu_) = 0;  // wakes pushes waiting for budget
  bool prepared_ ABSL_GUARDED_BY(mu_) = false;
  // The prepared gradient came from the group's primary (a forward), not
  // from this copy's own reduction: kept to finish a step another copy
  // committed, and dropped when the ranks push the step again (the primary
  // died before any copy committed it).
  bool prepared_by_forward_ ABSL_GUARDED_BY(mu_) = false;
  // CommitLocked is reading the prepared step's frozen gradient (with mu_
  // released): a push then finds the step prepared, even one prepared by
  // forward, which it would otherwise throw away.
  bool committing_ ABSL_GUARDED_BY(mu_) = false;
  PrepareResult prepare_result_ ABSL_GUARDED_BY(mu_);
  // The prepared step's tensors without a gradient (layout indices,
  // ascending), which its commit skips.
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
  // The committed step the parameters are at (a commit changes them before
  // it publishes committed_step_): what a gather's chunks name.
  uint64_t params_step_ ABSL_GUARDED_BY(params_mu_) = 0;

  std::atomic<int64_t> last_remote_access_ns_{0};
  uint64_t disk_bytes_ = 0;  // set by Create
  bool states_on_disk_ = false;  // set by Create
};

}  // namespace zeroshard
