#include "server/job/job.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/fnv.h"
#include "common/protocol.h"
#include "common/status_macros.h"

namespace zeroshard {
namespace {

RankTable::Options RankOptions(const JobConfig& c, const JobResources& resources,
                               FlatRange owned) {
  RankTable::Options o;
  o.job_id = c.job_id;
  o.world_size = c.world_size;
  o.transport = resources.transport;
  o.ledger = resources.ledger;
  o.staging_slots = resources.staging_slots;
  // A slot holds a bucket of C_B, or the elements this daemon owns in fp32
  // when they are fewer (the client sends pushes that do not fit a slot
  // together one by one: several micro-batches of one range); a multiple
  // of 64 bytes, so every slot starts aligned.
  o.staging_slot_bytes = std::max<uint64_t>(
      64, std::min({c.bucket_bytes, kMaxChunkBytes, owned.size() * 4}) / 64 * 64);
  return o;
}

}  // namespace

Job::Job(std::unique_ptr<JobConfig> config, std::unique_ptr<v1::JobSpec> spec,
         uint32_t daemon_index, const JobResources& resources)
    : config_(std::move(config)),
      spec_(std::move(spec)),
      daemon_index_(daemon_index),
      resources_(resources),
      owned_partitions_(config_->map.PartitionsOfDaemon(daemon_index)),
      ranks_(RankOptions(*config_, resources, config_->map.DaemonRange(daemon_index))) {}

Job::~Job() {
  if (state_memory_taken_ > 0) resources_.state_memory->Give(state_memory_taken_);
  if (state_disk_taken_ > 0) resources_.state_disk_limit->Give(state_disk_taken_);
}

bool ByteBudget::Take(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  if (bytes > bytes_ - used_) return false;
  used_ += bytes;
  return true;
}

void ByteBudget::Give(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  used_ -= std::min(bytes, used_);
}

uint64_t ByteBudget::used() const {
  absl::MutexLock lock(&mu_);
  return used_;
}

absl::StatusOr<std::unique_ptr<Job>> Job::Create(JobConfig config, v1::JobSpec spec,
                                                 uint32_t daemon_index,
                                                 const JobResources& resources, ReplicaRole role,
                                                 uint32_t here) {
  if (daemon_index >= config.daemons.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "daemon_index: must be < the number of daemons in spec.daemons (", config.daemons.size(),
        "), got ", daemon_index));
  }
  std::unique_ptr<Job> job(new Job(std::make_unique<JobConfig>(std::move(config)),
                                   std::make_unique<v1::JobSpec>(std::move(spec)), daemon_index,
                                   resources));
  const JobConfig& c = *job->config_;
  StepEngine::Options so;
  so.ledger = resources.ledger;
  so.optimizer = resources.optimizer;
  so.transport = resources.transport;
  so.metrics = resources.metrics;
  so.reduction_buffer_bytes = resources.reduction_buffer_bytes;
  so.reduction_hold = resources.reduction_hold;
  so.replica = role == ReplicaRole::kBackup;
  // With a --state_dir, the masters and moments go to disk unless they fit
  // in --state_memory; a replicated job's stay in RAM (a backup reads them).
  if (resources.state_disk.dir != nullptr && c.replicas <= 1) {
    const FlatRange owned = c.map.DaemonRange(daemon_index);
    CategoryBytes in_ram = ShardState::Footprint(c, owned);
    const uint64_t states = in_ram[static_cast<int>(MemoryCategory::kParamMaster)] +
                            in_ram[static_cast<int>(MemoryCategory::kOptimM)] +
                            in_ram[static_cast<int>(MemoryCategory::kOptimV)];
    if (resources.state_memory != nullptr && resources.state_memory->Take(states)) {
      job->state_memory_taken_ = states;
    } else {
      so.disk = resources.state_disk;
      const uint64_t on_disk =
          ShardState::DiskFootprint(c, owned, so.disk) +
          (so.disk.gradient ? std::max<uint64_t>(owned.size(), 1) * sizeof(float) : 0);
      ByteBudget* limit = resources.state_disk_limit;
      if (limit != nullptr) {
        if (!limit->Take(on_disk)) {
          return absl::ResourceExhaustedError(absl::StrCat(
              "job ", c.job_id, ": its model states need ", on_disk,
              " bytes on --state_dir, and --state_disk_limit (", limit->bytes(), " bytes) has ",
              limit->bytes() - std::min(limit->used(), limit->bytes()), " left"));
        }
        job->state_disk_taken_ = on_disk;
      }
    }
  }
  ASSIGN_OR_RETURN(job->step_,
                   StepEngine::Create(job->config_.get(), c.map.DaemonRange(daemon_index), so));
  if (job->state_disk_bytes() > 0 && resources.metrics != nullptr) {
    resources.metrics->SetStateDisk(c.job_id, job->state_disk_bytes());
  }
  if (!resources.checkpoint_dir.empty()) {
    CheckpointAgent::Options co;
    co.root = resources.checkpoint_dir;
    co.daemon_index = daemon_index;
    co.ledger = resources.ledger;
    co.metrics = resources.metrics;
    job->checkpoints_ =
        std::make_unique<CheckpointAgent>(co, job->spec_.get(), job->step_.get());
  }
  if (c.replicas > 1) {
    const uint32_t daemons = static_cast<uint32_t>(c.daemons.size());
    if (here == kHereIsGroup) here = daemon_index;
    ReplicaGroup::Options ro;
    ro.group = daemon_index;
    ro.peer_index = here == daemon_index ? ReplicaPeer(daemon_index, daemons) : daemon_index;
    ro.peer_address = c.daemons[ro.peer_index];
    ro.role = role;
    ro.link = resources.replica_link;
    ro.timeout = resources.replica_timeout;
    ro.liveness_timeout = resources.liveness_timeout;
    ro.transport = resources.transport;
    ro.ledger = resources.ledger;
    job->replica_ = std::make_unique<ReplicaGroup>(ro, job->spec_.get(), job->step_.get());
  }
  if (c.node_cache && c.daemons.size() > 1) {
    ParamCacheOptions po;
    po.job_id = c.job_id;
    po.dtype = c.precision;
    po.total_elements = c.map.total_elements();
    po.owned = job->owned_unpadded();
    for (uint32_t d = 0; d < c.daemons.size(); ++d) {
      if (d == daemon_index) continue;
      po.owners.push_back({d, c.map.DaemonRange(d).Intersect({0, po.total_elements})});
    }
    po.ledger = resources.ledger;
    job->param_cache_ = std::make_unique<ParamCache>(std::move(po));
  }
  return job;
}

// ---- Ranks ----

absl::StatusOr<JoinResult> Job::Join(const JoinRequest& r) {
  const JobConfig& c = *config_;
  auto mismatch = [&](absl::string_view field, auto registered, auto got) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", c.job_id, ": ", field, " differs from the registered job (registered ",
        registered, ", rank ", r.rank, " has ", got, ")"));
  };
  if (r.rank >= c.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank: must be < world_size (", c.world_size, "), got ", r.rank));
  }
  if (r.incarnation == 0) {
    return absl::InvalidArgumentError("incarnation: must be >= 1 (the client's start time in us)");
  }
  if (r.layout_fingerprint != c.layout.fingerprint()) {
    return mismatch("layout_fingerprint", c.layout.fingerprint(), r.layout_fingerprint);
  }
  if (r.stage != c.stage) return mismatch("stage", c.stage, r.stage);
  if (r.world_size != c.world_size) return mismatch("world_size", c.world_size, r.world_size);
  if (r.precision != DTypeToProto(c.precision)) {
    return mismatch("precision", DTypeToProto(c.precision), r.precision);
  }
  // A newer process of the rank fences the older one, and drops what the
  // older one left waiting in the reduction, before any push of the new one.
  uint64_t replaced = 0;
  ASSIGN_OR_RETURN(const uint32_t dropped,
                   step_->JoinRank(r.rank, [&]() -> absl::StatusOr<uint64_t> {
                     ASSIGN_OR_RETURN(replaced, ranks_.Join(r.rank, r.incarnation));
                     return replaced;
                   }));
  JoinResult result;
  if (replaced != 0) {
    result.replaced_incarnation = replaced;
    result.dropped_contributions = dropped;
  }
  result.ranks_connected = ranks_.joined();
  result.committed_step = step_->committed_step();
  return result;
}

// ---- Data ----

absl::Status Job::InitParameters(const std::vector<ParameterChunkIn>& chunks,
                                 uint64_t* elements) {
  RETURN_IF_ERROR(step_->InitParameters(chunks, elements));
  StateChangedOutsideAStep();
  return absl::OkStatus();
}

absl::StatusOr<PushResult> Job::PushGradient(const std::vector<GradientChunkIn>& chunks,
                                             absl::Time deadline) {
  const uint64_t step = step_->committed_step() + 1;
  ASSIGN_OR_RETURN(const PushResult result,
                   step_->PushGradient(chunks, deadline, [&]() -> absl::Status {
                     for (size_t i = 0; i < chunks.size(); ++i) {
                       RETURN_IF_ERROR(ranks_.Check(chunks[i].rank, chunks[i].incarnation,
                                                    absl::StrCat("chunk ", i, ".")));
                     }
                     return absl::OkStatus();
                   }));
  // (A held push may be answered after the leader committed its step.)
  for (const GradientChunkIn& c : chunks) ranks_.NotePushed(c.rank, step);
  return result;
}

// ---- Step ----

absl::StatusOr<PrepareResult> Job::PrepareStep(uint64_t step, const std::string& token) {
  absl::MutexLock commit_lock(&step_->commit_lock());
  if (replica_ != nullptr && replica_->role() != ReplicaRole::kPrimary) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", config_->job_id, " replica group ", daemon_index_,
                     ": this copy is the backup; prepare the group's primary"));
  }
  ASSIGN_OR_RETURN(const StepEngine::Prepared prepared, step_->PrepareLocked(step));
  if (!prepared.fresh) return prepared.result;
  // The backup is brought along with the step frozen (see job.h).
  const bool in_sync = replica_ != nullptr && replica_->ReplicatePrepared(prepared, token);
  if (replica_ != nullptr && replica_->role() != ReplicaRole::kPrimary) {
    // The backup said a promotion replaced this copy (it stepped down).
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", config_->job_id, " replica group ", daemon_index_,
        ": this copy was replaced (its backup was promoted) and stepped down; read the "
        "placement with Replica.GetReplicaState"));
  }
  return step_->FinishPrepare(in_sync);
}

absl::StatusOr<float> Job::CheckCommitRequest(const CommitRequest& r) {
  if (r.rank != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank: only the job leader (rank 0) commits, got rank ", r.rank));
  }
  RETURN_IF_ERROR(ranks_.Check(r.rank, r.incarnation, ""));
  return step_->CheckCommitFields(r, "");
}

absl::StatusOr<CommitResult> Job::CommitStep(const CommitRequest& r, const std::string& token) {
  ASSIGN_OR_RETURN(const float clip, CheckCommitRequest(r));
  uint64_t before = 0;
  absl::StatusOr<CommitResult> done;
  {
    absl::MutexLock commit_lock(&step_->commit_lock());
    if (replica_ != nullptr && replica_->role() != ReplicaRole::kPrimary) {
      return absl::FailedPreconditionError(
          absl::StrCat("job ", config_->job_id, " replica group ", daemon_index_,
                       ": this copy is the backup; commit the group's primary"));
    }
    before = step_->committed_step();
    done = step_->CommitLocked(r, clip);
  }
  // Sent to the backup after the lock is released: a stalled backup keeps
  // no other request of this job waiting.
  if (done.ok() && replica_ != nullptr && step_->committed_step() != before) {
    replica_->SendCommit(r, token);
  }
  return done;
}

JobStepState Job::StepState(absl::Duration rank_timeout, bool brief) const {
  JobStepState state;
  state.ranks_joined = ranks_.joined();
  state.ranks_connected = ranks_.Connected(rank_timeout);
  if (!brief) state.ranks = ranks_.Ranks(rank_timeout);
  state.step = step_->Progress(brief);
  return state;
}

// ---- State dicts ----

absl::Status Job::ReadState(uint32_t rank, uint64_t incarnation, WireEnum array,
                            const FlatRange& range, uint64_t max_chunk_elements,
                            const std::function<bool(StateChunkOut&)>& write) {
  RETURN_IF_ERROR(ranks_.Check(rank, incarnation, ""));
  return step_->ReadState(array, range, max_chunk_elements, write);
}

absl::StatusOr<WriteStateResult> Job::WriteState(const std::vector<StateChunkIn>& chunks) {
  for (size_t i = 0; i < chunks.size(); ++i) {
    RETURN_IF_ERROR(ranks_.Check(chunks[i].rank, chunks[i].incarnation,
                                 absl::StrCat("chunk ", i, ".")));
  }
  bool changed = false;
  ASSIGN_OR_RETURN(WriteStateResult out, step_->WriteState(chunks, &changed));
  if (changed) StateChangedOutsideAStep();
  return out;
}

// ---- Checkpoints ----

absl::Status Job::CheckpointsEnabled() const {
  if (checkpoints_ != nullptr) return absl::OkStatus();
  return absl::FailedPreconditionError(
      "checkpoints: this daemon was started without --checkpoint_dir");
}

absl::StatusOr<CheckpointSaved> Job::SaveCheckpoint(const std::string& name, uint64_t step) {
  RETURN_IF_ERROR(CheckpointsEnabled());
  return checkpoints_->Save(name, step);
}

absl::StatusOr<CheckpointProgress> Job::CheckpointStatus(const std::string& name,
                                                         absl::Duration wait) {
  RETURN_IF_ERROR(CheckpointsEnabled());
  return checkpoints_->Status(name, wait);
}

absl::StatusOr<uint64_t> Job::CompleteCheckpoint(const std::string& name,
                                                 const std::vector<v1::PartManifest>& parts) {
  RETURN_IF_ERROR(CheckpointsEnabled());
  return checkpoints_->Complete(name, parts);
}

absl::StatusOr<CheckpointLoaded> Job::LoadCheckpoint(const std::string& name) {
  RETURN_IF_ERROR(CheckpointsEnabled());
  ASSIGN_OR_RETURN(CheckpointLoaded out, checkpoints_->Load(name));
  StateChangedOutsideAStep();
  return out;
}

// ---- Replication ----

void Job::StateChangedOutsideAStep() {
  if (replica_ != nullptr) replica_->MarkBackupStale(absl::OkStatus());
  // The other daemons' parameters may have changed with this daemon's (a
  // state dict or a checkpoint is written to every daemon): fetch again.
  if (param_cache_ != nullptr) param_cache_->Drop();
}

ReplicaRole Job::role() const {
  return replica_ == nullptr ? ReplicaRole::kPrimary : replica_->role();
}

uint64_t Job::epoch() const { return replica_ == nullptr ? 1 : replica_->epoch(); }

const std::string& Job::peer_address() const {
  static const std::string* const kNone = new std::string();
  return replica_ == nullptr ? *kNone : replica_->peer_address();
}

absl::Status Job::CheckServing(std::optional<uint64_t> epoch) const {
  return replica_ == nullptr ? absl::OkStatus() : replica_->CheckServing(epoch);
}

std::optional<ReplicaGroupStatus> Job::ReplicaState() const {
  if (replica_ == nullptr) return std::nullopt;
  return replica_->State();
}

uint64_t Job::StateHash() const {
  uint64_t h = kFnv1aOffset;
  step_->Hash(h);
  ranks_.Hash(h);
  return h;
}

}  // namespace zeroshard
