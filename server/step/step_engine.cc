#include "server/step/step_engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/crc32c.h"
#include "common/fnv.h"
#include "common/protocol.h"
#include "common/status_macros.h"

namespace zeroshard {
namespace {

std::string RangeString(const FlatRange& r) {
  return absl::StrCat("[", r.begin, ", ", r.end, ")");
}

template <typename T>
void HashValue(uint64_t& h, const T& v) {
  Fnv1aMix(h, &v, sizeof(v));
}

absl::Status BadRank(uint32_t rank, uint32_t world_size, absl::string_view field) {
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": must be < world_size (", world_size, "), got ", rank));
}

}  // namespace

StepEngine::StepEngine(const JobConfig* config, FlatRange owned, const Options& options)
    : config_(config),
      options_(options),
      owned_(owned),
      owned_unpadded_(owned.Intersect({0, config->map.total_elements()})) {}

StepEngine::~StepEngine() {
  absl::MutexLock lock(&mu_);
  if (reduction_ != nullptr) AwaitSumsLocked();
  reduction_.reset();  // releases its buffer booking before grad_ goes
}

absl::StatusOr<std::unique_ptr<StepEngine>> StepEngine::Create(const JobConfig* config,
                                                               FlatRange owned,
                                                               const Options& options) {
  std::unique_ptr<StepEngine> engine(new StepEngine(config, owned, options));
  const JobConfig& c = *config;
  const uint64_t n = owned.size();
  const bool replica = options.replica;
  // In stage 1 full gradients live on the trainers (the paper's 2Ψ); the
  // daemon's reduction target is a communication buffer. From stage 2 on it
  // is the partitioned gradient.
  const MemoryCategory grad_cat = c.stage >= 2 ? MemoryCategory::kGrad : MemoryCategory::kBuffer;
  // The whole footprint (the shard states and the gradient) is booked in one
  // step before anything is allocated or touched: a job that does not fit is
  // refused whole, and concurrent registrations cannot each pass the limit
  // with part of theirs.
  CategoryBytes footprint = ShardState::Footprint(c, owned, false, options.disk);
  const bool grad_on_disk = options.disk.dir != nullptr && options.disk.gradient;
  if (!grad_on_disk) footprint[static_cast<int>(grad_cat)] += n * sizeof(float);
  if (replica) footprint = BookedAsReplica(footprint);
  absl::Status allocated = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(LedgerReservation booked,
                     LedgerReservation::Create(options.ledger, c.job_id, footprint));
    {
      absl::MutexLock lock(&engine->params_mu_);
      ASSIGN_OR_RETURN(engine->shard_,
                       ShardState::Create(c, owned, &booked, options.transport, replica,
                                          options.disk));
      engine->tensors_ = &engine->shard_->tensors();
      engine->disk_bytes_ = engine->shard_->disk_bytes();
      engine->states_on_disk_ = engine->shard_->on_disk();
    }
    absl::MutexLock lock(&engine->mu_);
    if (grad_on_disk) {
      absl::StatusOr<std::unique_ptr<MappedFile>> file =
          MappedFile::Create(options.disk.dir, std::max<uint64_t>(n, 1) * sizeof(float));
      if (!file.ok()) {
        return absl::Status(file.status().code(),
                            absl::StrCat("job ", c.job_id, ": ", file.status().message()));
      }
      engine->grad_file_ = *std::move(file);
      engine->grad_data_ = static_cast<float*>(engine->grad_file_->data());
      engine->disk_bytes_ += engine->grad_file_->size();
      return absl::OkStatus();
    }
    ASSIGN_OR_RETURN(engine->grad_,
                     LedgerArray<float>::Create(
                         &booked, replica ? MemoryCategory::kReplica : grad_cat, n));
    engine->grad_data_ = engine->grad_.data();
    return absl::OkStatus();
  }();
  if (!allocated.ok()) {
    // Frees and releases what was allocated, then drops the job's ledger
    // entry unless another registration of the same id holds bytes in it.
    const std::string id = c.job_id;
    engine.reset();
    options.ledger->RemoveJobIfEmpty(id);
    return allocated;
  }
  absl::MutexLock lock(&engine->mu_);
  ReductionState::Options ro;
  ro.job_id = c.job_id;
  ro.owned = engine->owned_;
  ro.owned_unpadded = engine->owned_unpadded_;
  ro.partition_elements = c.map.partition_elements();
  ro.world_size = c.world_size;
  ro.mode = c.reduction;
  ro.pending_budget_bytes = options.reduction_buffer_bytes;
  ro.tensors = engine->tensors_;
  // Each range's pass runs outside mu_ (RunReadySums).
  ro.defer_sums = true;
  engine->reduction_ = std::make_unique<ReductionState>(ro, engine->grad_data_,
                                                        options.optimizer, options.ledger);
  engine->loss_scale_ = c.loss_scale.initial_scale;
  return engine;
}

absl::Status StepEngine::disk_damaged() const {
  absl::ReaderMutexLock lock(&params_mu_);
  return shard_->damaged();
}

// ---- Data ----

absl::StatusOr<uint32_t> StepEngine::JoinRank(uint32_t rank,
                                              absl::FunctionRef<absl::StatusOr<uint64_t>()> join) {
  // The reduction lock first: a rank's new process drops what its old one
  // left in the out-of-order buffer before any push of the new one.
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(const uint64_t replaced, join());
  if (replaced == 0) return 0;
  const uint32_t dropped = reduction_->ReplaceRank(rank);
  ++reduction_changes_;  // pushes waiting for the buffer's room may fit now
  return dropped;
}

absl::Status StepEngine::InitParameters(const std::vector<ParameterChunkIn>& chunks,
                                        uint64_t* elements) {
  absl::MutexLock commit_lock(&commit_mu_);
  if (committed_step() > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", config_->job_id, " has committed step ", committed_step(),
        "; initial parameters are only accepted before the first commit"));
  }
  std::vector<DType> types(chunks.size());
  for (size_t i = 0; i < chunks.size(); ++i) {
    const ParameterChunkIn& c = chunks[i];
    const std::string where = absl::StrCat("chunk ", i);
    absl::StatusOr<DType> dt = DTypeFromProto(c.dtype, where + ".dtype");
    if (!dt.ok()) return dt.status();
    if (*dt != DType::kFp32) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".dtype: initial parameters must be fp32, got ", DTypeName(*dt)));
    }
    const FlatRange r = c.range;
    if (r.begin >= r.end || !owned_unpadded_.Contains(r)) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ".range ", RangeString(c.range), " is empty or outside the parameters this ",
          "daemon owns [", owned_unpadded_.begin, ", ", owned_unpadded_.end, ")"));
    }
    if (c.data.size() != r.size() * sizeof(float)) {
      return absl::InvalidArgumentError(absl::StrCat(where, ".data: ", c.data.size(),
                                                     " bytes, expected ", r.size() * 4));
    }
    if (c.crc32c != 0 && Crc32c(c.data.data(), c.data.size()) != c.crc32c) {
      return absl::DataLossError(
          absl::StrCat(where, ": CRC-32C of the data does not match (corrupted in transit)"));
    }
    types[i] = *dt;
  }
  absl::MutexLock lock(&params_mu_);
  RETURN_IF_ERROR(shard_->damaged());
  uint64_t total = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const ParameterChunkIn& c = chunks[i];
    const uint64_t n = c.range.size();
    if (absl::Status s =
            shard_->WriteMasters(options_.optimizer, c.range.begin, c.data.data(), types[i], n);
        !s.ok()) {
      // Only on disk: the chunks before this one have landed.
      if (total > 0) shard_->MarkDamaged(s);
      ++params_version_;
      return s;
    }
    total += n;
  }
  ++params_version_;
  *elements = total;
  return absl::OkStatus();
}

absl::Status StepEngine::CheckChunk(const GradientChunkIn& c, size_t index,
                                    Contribution* out) const {
  const absl::string_view payload = c.payload;
  const std::string where = absl::StrCat("chunk ", index);
  if (c.step != committed_step() + 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        where, ".step: job ", config_->job_id, " is computing step ", committed_step() + 1,
        ", got a gradient for step ", c.step));
  }
  if (c.rank >= config_->world_size) {
    return BadRank(c.rank, config_->world_size, where + ".rank");
  }
  absl::StatusOr<DType> dt = DTypeFromProto(c.dtype, where + ".dtype");
  if (!dt.ok()) return dt.status();
  if (*dt != DType::kFp32 && *dt != config_->precision) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ".dtype: must be fp32 or the job's precision (", DTypeName(config_->precision),
        "), got ", DTypeName(*dt)));
  }
  const FlatRange r = c.range;
  if (r.begin >= r.end || !owned_unpadded_.Contains(r)) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ".range ", RangeString(c.range), " is empty or outside the partitions this ",
        "daemon owns [", owned_unpadded_.begin, ", ", owned_unpadded_.end, ")"));
  }
  // Daemon reduction sums the whole owned range alike: a chunk may span the
  // daemon's partitions. In trainer-collective mode a rank pushes its own
  // partition only.
  if (config_->reduction == ReductionMode::kTrainerCollective) {
    const uint32_t partition = static_cast<uint32_t>(r.begin / config_->map.partition_elements());
    if (!config_->map.Partition(partition).Contains(r)) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ".range ", RangeString(c.range), " crosses the boundary of partition ",
          partition, " (in trainer-collective mode a rank pushes its own partition)"));
    }
    if (c.rank != partition) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": in trainer-collective mode only rank ", partition,
                       " pushes partition ", partition, ", got rank ", c.rank));
    }
  }
  if (payload.size() != r.size() * DTypeSize(*dt)) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, c.staged ? " (staged)" : ".data", ": ", payload.size(), " bytes, expected ",
        r.size() * DTypeSize(*dt), " for ", r.size(), " ", DTypeName(*dt), " elements"));
  }
  const uint32_t mbs = std::max<uint32_t>(c.micro_batches, 1);
  if (mbs > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ".micro_batches: at most 4096, got ", mbs));
  }
  if (c.micro_batch >= mbs) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ".micro_batch: must be < micro_batches (", mbs, "), got ", c.micro_batch));
  }
  if (c.no_grad_tensors.size() > 0) {
    // Ascending layout indices of tensors that overlap the chunk.
    const auto [first, last] = config_->layout.TensorsIn(r);
    uint64_t previous = 0;
    for (size_t i = 0; i < c.no_grad_tensors.size(); ++i) {
      const uint32_t t = c.no_grad_tensors[i];
      if (t < first || t >= last || (i > 0 && t <= previous)) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ".no_grad_tensors[", i, "]: ", t, " is not ascending or does not overlap ",
            "the chunk's range ", RangeString(c.range), " (tensors ", first, "..", last,
            " do)"));
      }
      previous = t;
    }
  }
  if (c.crc32c != 0 && Crc32c(payload.data(), payload.size()) != c.crc32c) {
    return absl::DataLossError(absl::StrCat(where, ": CRC-32C of the data does not match ",
                                            "(corrupted in transit); resend the chunk"));
  }
  out->range = r;
  out->no_grad = c.no_grad_tensors;
  out->rank = c.rank;
  out->micro_batch = c.micro_batch;
  out->dtype = *dt;
  out->payload = payload;
  out->crc32c = c.crc32c;
  return absl::OkStatus();
}

absl::StatusOr<PushResult> StepEngine::PushGradient(
    const std::vector<GradientChunkIn>& chunks, absl::Time deadline,
    absl::FunctionRef<absl::Status()> senders_current) {
  if (chunks.empty()) {
    return absl::InvalidArgumentError("PushGradient: the stream carried no chunk");
  }
  const uint32_t mbs = std::max<uint32_t>(chunks[0].micro_batches, 1);
  absl::MutexLock lock(&mu_);
  // The forwarded step's reset below must not release the lock after the
  // checks.
  if (prepared_ && prepared_by_forward_) AwaitSumsLocked();
  // Every chunk's sender must be its rank's current process, checked under
  // the reduction lock (and again after any wait that released it), so a
  // rank that rejoins meanwhile fences it.
  RETURN_IF_ERROR(senders_current());
  std::vector<Contribution> batch(chunks.size());
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (absl::Status s = CheckChunk(chunks[i], i, &batch[i]); !s.ok()) return s;
    if (std::max<uint32_t>(chunks[i].micro_batches, 1) != mbs) {
      return absl::InvalidArgumentError(absl::StrCat(
          "chunk ", i, ".micro_batches: differs from chunk 0's (", mbs, ") in one push"));
    }
  }
  if (prepared_ && prepared_by_forward_ && !committing_) {
    // A promoted backup holding its dead primary's forward of a step no copy
    // committed: the ranks compute the step again, and it is reduced here.
    // A push the fresh reduction would refuse throws nothing away.
    RETURN_IF_ERROR(reduction_->CheckFresh(batch, mbs));
    ResetReductionLocked();
    prepared_ = false;
    prepared_by_forward_ = false;
    ++reduction_changes_;
  }
  if (prepared_) {
    // A restarted rank replaying the step: what the frozen gradient holds
    // is a duplicate (ALREADY_EXISTS, delivered), as before the prepare.
    uint64_t pending = 0, bookkeeping = 0;
    absl::Status duplicate = reduction_->Check(batch, mbs, &pending, &bookkeeping);
    if (absl::IsAlreadyExists(duplicate)) return duplicate;
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", config_->job_id, " step ", committed_step() + 1,
        " is prepared: its gradient is complete and frozen until the commit"));
  }
  uint64_t elements = 0;
  // Staged contributions may wait in their slot (or the trainer's push
  // memory) for the rest of their ranges, which the ranks' last
  // micro-batch completes (earlier ones would only wait out the hold), when
  // the push's deadline leaves room for twice the hold (its answer must
  // reach the rank in time): a push of one chunk, or of several pulled from
  // the trainer's push memory (one announcement per rank), which share one
  // hold. Several chunks put into one slot are applied all or none.
  const bool may_hold =
      options_.reduction_hold > absl::ZeroDuration() &&
      config_->reduction == ReductionMode::kDaemon &&
      std::all_of(chunks.begin(), chunks.end(),
                  [&](const GradientChunkIn& c) {
                    return c.staged && c.micro_batch + 1 == mbs &&
                           (chunks.size() == 1 || c.pulled);
                  }) &&
      deadline - absl::Now() >= 2 * options_.reduction_hold;
  std::vector<std::shared_ptr<HeldContribution>> held;
  RETURN_IF_ERROR(
      ApplyPush(batch, mbs, deadline, senders_current, &elements, may_hold ? &held : nullptr));
  const absl::Time hold_until = absl::Now() + options_.reduction_hold;
  for (size_t i = 0; i < held.size(); ++i) {
    if (held[i] == nullptr) continue;
    absl::Status s = AwaitHeld(batch[i], held[i], hold_until, deadline, senders_current);
    if (s.ok()) continue;
    ReleaseHeld(held);
    if (batch.size() == 1) return s;
    return absl::Status(
        s.code(),
        absl::StrCat("chunk ", i, " of ", batch.size(), ": ", s.message(),
                     "; other chunks of this push may have been applied before it failed (see "
                     "docs/protocol.md: its generation is not applied as a whole, and the rank's "
                     "next process replays the step)"));
  }
  PushResult result;
  result.elements = elements;
  result.ranks_complete = reduction_->Complete() ? config_->world_size : 0;
  return result;
}

absl::Status StepEngine::ApplyPush(const std::vector<Contribution>& batch, uint32_t micro_batches,
                            absl::Time deadline, absl::FunctionRef<absl::Status()> senders_current,
                            uint64_t* elements,
                            std::vector<std::shared_ptr<HeldContribution>>* held) {
  const uint64_t step = committed_step() + 1;
  for (;;) {
    uint64_t pending = 0;
    uint64_t bookkeeping = 0;
    if (absl::Status s =
            reduction_->Check(batch, micro_batches, &pending, &bookkeeping, held != nullptr);
        !s.ok()) {
      return s;
    }
    if (reduction_->Admit(pending)) {
      // Both booked before the reduction allocates anything for them.
      if (absl::Status s = options_.ledger->Reserve(config_->job_id, MemoryCategory::kBuffer,
                                                      pending + bookkeeping);
          s.ok()) {
        *elements =
            reduction_->Apply(batch, micro_batches, pending, bookkeeping, GradScale(), held);
        ++reduction_changes_;
        // Before returning: a pass may read the batch's payloads.
        RunReadySums();
        return absl::OkStatus();
      } else if (reduction_->pending_bytes() == 0 && reduction_->sums_in_flight() == 0) {
        return s;  // over the daemon's memory limit with nothing left to drain
      }
    }
    // Back-pressure: wait for earlier contributions to drain the buffer.
    const uint64_t seen = reduction_changes_;
    auto changed = [this, seen, step]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return reduction_changes_ != seen || committed_step() + 1 != step;
    };
    if (!mu_.AwaitWithDeadline(absl::Condition(&changed), deadline)) {
      return absl::DeadlineExceededError(absl::StrCat(
          "job ", config_->job_id, " step ", step, ": the out-of-order buffer (",
          options_.reduction_buffer_bytes, " bytes) stayed full until the deadline; it waits ",
          "for ", reduction_->DescribeIncomplete(), "; nothing was applied"));
    }
    if (committed_step() + 1 != step) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job ", config_->job_id, " committed step ", step, " while this push waited"));
    }
    if (prepared_) {
      // A forward from the group's primary froze the step meanwhile.
      return absl::FailedPreconditionError(absl::StrCat(
          "job ", config_->job_id, " step ", step,
          " was prepared while this push waited: its gradient is frozen until the commit"));
    }
    RETURN_IF_ERROR(senders_current());
  }
}

absl::Status StepEngine::AwaitHeld(const Contribution& c, const std::shared_ptr<HeldContribution>& held,
                            absl::Time hold_until, absl::Time deadline,
                            absl::FunctionRef<absl::Status()> senders_current) {
  using State = HeldContribution::State;
  auto let_go = [&held]() { return held->state != State::kHeld; };
  mu_.AwaitWithDeadline(absl::Condition(&let_go), std::min(deadline, hold_until));
  // Only kHeld may be dropped or unheld below: a kSumming one is being
  // read by another push's pass, which lets it go.
  while (held->state == State::kHeld) {
    // Still from the rank's current process (the lock was released)?
    if (absl::Status s = senders_current(); !s.ok()) {
      DropHeldLocked(held.get());
      return s;
    }
    if (prepared_) {
      // Only a forwarded step is prepared with contributions waiting
      // (TakeForwardedStep): it supersedes them, and its gradient is frozen.
      DropHeldLocked(held.get());
      break;
    }
    // Held long enough: summed now if it is next in order, else buffered.
    const uint64_t bytes = reduction_->NextInOrder(*held) ? 0 : held->bytes;
    absl::Status booked;
    if (reduction_->Admit(bytes) &&
        (bytes == 0 ||
         (booked = options_.ledger->Reserve(config_->job_id, MemoryCategory::kBuffer, bytes))
             .ok())) {
      reduction_->Unhold(held.get(), bytes, GradScale());
      ++reduction_changes_;
      RunReadySums();
      break;
    }
    // Back-pressure: wait for the buffer to drain, or for a later arrival
    // to sum it.
    const uint64_t seen = reduction_changes_;
    auto changed = [this, seen, &held]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return reduction_changes_ != seen || held->state != State::kHeld;
    };
    if (!mu_.AwaitWithDeadline(absl::Condition(&changed), deadline) &&
        held->state == State::kHeld) {
      DropHeldLocked(held.get());
      return absl::DeadlineExceededError(absl::StrCat(
          "job ", config_->job_id, ": rank ", c.rank, "'s range [", c.range.begin, ", ", c.range.end,
          ") was held for its range's other contributions, and then ",
          booked.ok()
              ? absl::StrCat("the out-of-order buffer (", options_.reduction_buffer_bytes,
                             " bytes) stayed full")
              : absl::StrCat("the daemon's memory limit refused its copy (", booked.message(), ")"),
          " until the deadline; it waits for ", reduction_->DescribeIncomplete(),
          "; nothing was applied"));
    }
  }
  AwaitNotSumming(*held);
  if (held->state == State::kDropped) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", config_->job_id, ": rank ", c.rank, "'s range [", c.range.begin, ", ", c.range.end,
        ") was dropped unsummed while it was held (the rank rejoined, the "
        "step was reset, or its primary's forward prepared it); push it again"));
  }
  return absl::OkStatus();
}

void StepEngine::ReleaseHeld(const std::vector<std::shared_ptr<HeldContribution>>& held) {
  for (const std::shared_ptr<HeldContribution>& h : held) {
    if (h == nullptr) continue;
    if (h->state == HeldContribution::State::kHeld) DropHeldLocked(h.get());
    AwaitNotSumming(*h);
  }
}

void StepEngine::DropHeldLocked(HeldContribution* held) {
  reduction_->DropHeld(held);
  ++reduction_changes_;
}

void StepEngine::AwaitNotSumming(const HeldContribution& held) const {
  // Its bytes are read until the pass that took them ends (in-process
  // work: no peer, bounded by one range's sum).
  auto not_summing = [&held]() { return held.state != HeldContribution::State::kSumming; };
  mu_.Await(absl::Condition(&not_summing));
}

void StepEngine::RunReadySums() {
  for (;;) {
    std::vector<ReductionState::SumJob> jobs = reduction_->TakeReadySums();
    if (jobs.empty()) return;
    // Each job owns its range until FinishSum: pushes of other ranges, and
    // of this one (they wait as held or buffered), go on meanwhile.
    mu_.Unlock();
    for (ReductionState::SumJob& job : jobs) ReductionState::RunSum(job);
    mu_.Lock();
    for (ReductionState::SumJob& job : jobs) reduction_->FinishSum(std::move(job));
    ++reduction_changes_;
  }
}

void StepEngine::AwaitSumsLocked() const {
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return reduction_->sums_in_flight() == 0;
  };
  mu_.Await(absl::Condition(&idle));
}

void StepEngine::ResetReductionLocked() {
  AwaitSumsLocked();
  reduction_->Reset();
}

StepEngine::ReductionCounts StepEngine::Reductions() const {
  absl::MutexLock lock(&mu_);
  AwaitSumsLocked();
  return {reduction_->sum_passes(), reduction_->summed_contributions()};
}

bool StepEngine::AwaitCommit(uint64_t step, absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  // Only the open step can become committed by waiting.
  if (step != committed_step() + 1) return committed_step() >= step;
  auto committed = [this, step]()
                       ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return committed_step() >= step; };
  return mu_.AwaitWithDeadline(absl::Condition(&committed), deadline);
}

absl::Status StepEngine::Gather(uint64_t after_step, const FlatRange& range, DType dtype,
                         absl::Time deadline, uint64_t max_chunk_elements,
                                const std::function<bool(ParameterChunkOut&)>& write) {
  if (range.begin >= range.end || !owned_unpadded_.Contains(range)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "range: [", range.begin, ", ", range.end, ") is empty or outside the parameters this ",
        "daemon owns [", owned_unpadded_.begin, ", ", owned_unpadded_.end, ")"));
  }
  {
    absl::MutexLock lock(&mu_);
    if (after_step > committed_step() + 1) {
      return absl::FailedPreconditionError(absl::StrCat(
          "after_step: job ", config_->job_id, " has committed step ", committed_step(), "; step ",
          after_step, " cannot be committed before step ", committed_step() + 1));
    }
    auto committed = [this, after_step]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return committed_step() >= after_step;
    };
    if (!mu_.AwaitWithDeadline(absl::Condition(&committed), deadline)) {
      return absl::DeadlineExceededError(absl::StrCat(
          "job ", config_->job_id, ": step ", after_step, " was not committed in time (committed: ",
          committed_step(), ")"));
    }
  }
  if (!write) {
    // The reader reads the regions itself: a damaged state is refused here.
    RETURN_IF_ERROR(disk_damaged());
    NoteRemoteAccess();
    return absl::OkStatus();
  }
  ParameterChunkOut chunk;
  chunk.dtype = dtype;
  const size_t esize = DTypeSize(dtype);
  uint64_t version = 0;
  {
    absl::ReaderMutexLock lock(&params_mu_);
    version = params_version_;
    chunk.step = params_step_;
  }
  for (uint64_t pos = range.begin; pos < range.end;) {
    const uint64_t end = std::min(range.end, pos + max_chunk_elements);
    std::string* data = &chunk.data;
    data->resize((end - pos) * esize);
    {
      // Only the copy holds the lock; the write below holds none.
      absl::ReaderMutexLock lock(&params_mu_);
      if (params_version_ != version) {
        return absl::AbortedError(absl::StrCat(
            "job ", config_->job_id, ": the parameters changed (step ", committed_step(),
            " was committed) while they were being gathered; gather again"));
      }
      RETURN_IF_ERROR(shard_->damaged());
      RETURN_IF_ERROR(shard_->Read(pos, end - pos, dtype, data->data()));
    }
    chunk.range = {pos, end};
    chunk.crc32c = Crc32c(data->data(), data->size());
    if (!write(chunk)) return absl::CancelledError("the gathering client went away");
    pos = end;
  }
  return absl::OkStatus();
}

// ---- Step ----

absl::StatusOr<StepEngine::Prepared> StepEngine::PrepareLocked(uint64_t step) {
  RETURN_IF_ERROR(disk_damaged());
  absl::MutexLock lock(&mu_);
  // A range counts as complete once its last pass is planned: its norm and
  // its gradient are there when the pass ends.
  AwaitSumsLocked();
  if (step != committed_step() + 1) {
    return absl::FailedPreconditionError(absl::StrCat("step: job ", config_->job_id,
                                                      " is computing step ",
                                                      committed_step() + 1, ", got ", step));
  }
  Prepared prepared;
  prepared.step = step;
  if (!prepared_) {
    if (!reduction_->Complete()) {
      return absl::FailedPreconditionError(absl::StrCat("job ", config_->job_id, " step ", step,
                                                        ": gradients incomplete: ",
                                                        reduction_->DescribeIncomplete()));
    }
    // Each range's norm was taken in the pass of its last contribution.
    const GradStats r = reduction_->GradStatsOfStep();
    prepare_result_.grad_sq_sum = r.sum_sq;
    prepare_result_.found_inf_nan = r.found_inf_nan;
    prepare_result_.elements = owned_unpadded_.size();
    prepare_result_.loss_scale = loss_scale_;
    prepare_result_.backup_in_sync = false;
    prepared_no_grad_ = reduction_->NoGradTensors();
    prepared_ = true;
    prepared_by_forward_ = false;
    ++reduction_changes_;
    prepared.fresh = true;
  }
  prepared.grad = reduction_->grad();
  prepared.no_grad = prepared_no_grad_;
  prepared.result = prepare_result_;
  return prepared;
}

PrepareResult StepEngine::FinishPrepare(bool backup_in_sync) {
  absl::MutexLock lock(&mu_);
  prepare_result_.backup_in_sync = backup_in_sync;
  return prepare_result_;
}

absl::StatusOr<float> StepEngine::CheckCommitFields(const CommitRequest& r,
                                                    absl::string_view prefix) const {
  if (!std::isfinite(r.lr) || r.lr < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, "lr: must be finite and >= 0, got ", r.lr));
  }
  const uint32_t groups = GroupCount(*config_);
  if (!r.group_lrs.empty() && r.group_lrs.size() != groups) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, "group_lrs: job ", config_->job_id,
                                                   " has ", groups, " parameter groups, got ",
                                                   r.group_lrs.size(), " learning rates"));
  }
  for (size_t g = 0; g < r.group_lrs.size(); ++g) {
    if (!std::isfinite(r.group_lrs[g]) || r.group_lrs[g] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          prefix, "group_lrs[", g, "]: must be finite and >= 0, got ", r.group_lrs[g]));
    }
  }
  const float clip = r.clip_coef == 0 ? 1.0f : r.clip_coef;
  if (!(clip > 0 && clip <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, "clip_coef: must be in (0, 1] (0 means 1), got ", r.clip_coef));
  }
  return clip;
}

void StepEngine::UpdateLossScale(bool skipped) {
  if (!config_->loss_scale.dynamic) return;
  // Dynamic loss scaling, identical on every daemon of the job.
  if (skipped) {
    loss_scale_ = std::max(loss_scale_ * config_->loss_scale.backoff_factor, 1e-30f);
    good_steps_ = 0;
  } else if (++good_steps_ >= config_->loss_scale.growth_interval) {
    const float grown = loss_scale_ * config_->loss_scale.growth_factor;
    if (std::isfinite(grown)) loss_scale_ = grown;
    good_steps_ = 0;
  }
}

absl::StatusOr<CommitResult> StepEngine::Commit(const CommitRequest& r, float clip) {
  absl::MutexLock commit_lock(&commit_mu_);
  return CommitLocked(r, clip);
}

absl::StatusOr<CommitResult> StepEngine::CommitLocked(const CommitRequest& r, float clip) {
  RETURN_IF_ERROR(disk_damaged());
  const float* grad = nullptr;
  double grad_scale = 1.0;
  std::vector<uint32_t> no_grad;
  {
    absl::MutexLock lock(&mu_);
    const uint64_t committed = committed_step();
    if (r.step == committed && committed > 0) return last_commit_.response;
    if (r.step != committed + 1) {
      return absl::FailedPreconditionError(absl::StrCat(
          "step: job ", config_->job_id, " is computing step ", committed + 1, ", got ", r.step));
    }
    if (!prepared_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job ", config_->job_id, " step ", r.step, ": CommitStep before PrepareStep (",
          reduction_->Complete() ? "gradients complete" : reduction_->DescribeIncomplete(),
          "); the leader prepares every daemon, then commits"));
    }
    grad = reduction_->grad();
    grad_scale = static_cast<double>(clip) / (static_cast<double>(config_->world_size) *
                                              static_cast<double>(loss_scale_));
    no_grad = prepared_no_grad_;
    committing_ = true;
  }
  auto committed = absl::MakeCleanup([this] {
    absl::MutexLock lock(&mu_);
    committing_ = false;
  });
  if (options_.while_committing) options_.while_committing();
  if (!r.skip) {
    // The frozen gradient is read without the reduction lock: pushes are
    // refused while prepared (committing_: also a step prepared by forward),
    // and commit_mu_ keeps other commits out.
    absl::MutexLock params_lock(&params_mu_);
    std::vector<StepHyperParams> groups = GroupHyperParams(*config_);
    for (size_t g = 0; g < groups.size(); ++g) {
      groups[g].lr = r.group_lrs.empty() ? r.lr : r.group_lrs[g];
      groups[g].grad_scale = grad_scale;
    }
    const absl::Time start = absl::Now();
    if (absl::Status s = shard_->Step(options_.optimizer, groups, grad, owned_unpadded_, no_grad);
        !s.ok()) {
      // On disk, part of the step may have landed (the state is damaged).
      ++params_version_;
      return s;
    }
    // The update alone: what zeroshard_optimizer_seconds measures.
    if (options_.metrics != nullptr) {
      options_.metrics->RecordCommit(config_->job_id, absl::Now() - start,
                                     owned_unpadded_.size());
    }
    ++params_version_;
    params_step_ = r.step;
  } else {
    // Unchanged parameters, now those of this step.
    absl::MutexLock params_lock(&params_mu_);
    params_step_ = r.step;
  }
  absl::MutexLock lock(&mu_);
  AwaitSumsLocked();  // none: pushes are refused while prepared
  UpdateLossScale(r.skip);
  reduction_->Reset();
  prepared_ = false;
  prepared_by_forward_ = false;
  ++reduction_changes_;
  last_commit_.response.committed_step = r.step;
  last_commit_.response.loss_scale = loss_scale_;
  last_commit_.response.skipped = r.skip;
  last_commit_.clip_coef = clip;
  last_commit_.grad_norm = r.grad_norm;
  last_commit_.lr = r.lr;
  last_commit_.group_lrs = r.group_lrs;
  // Published last, under mu_: whoever sees the step sees a reset reduction.
  committed_step_.store(r.step, std::memory_order_release);
  return last_commit_.response;
}

// ---- Snapshots and restores ----

v1::TrainingState StepEngine::TrainingStateLocked() const {
  v1::TrainingState state;
  state.set_committed_step(committed_step());
  state.set_loss_scale(loss_scale_);
  state.set_good_steps(good_steps_);
  if (committed_step() > 0) {
    v1::CommitRecord* c = state.mutable_last_commit();
    c->set_step(committed_step());
    c->set_lr(last_commit_.lr);
    c->set_clip_coef(last_commit_.clip_coef);
    c->set_skipped(last_commit_.response.skipped);
    c->set_grad_norm(last_commit_.grad_norm);
    for (float lr : last_commit_.group_lrs) c->add_group_lrs(lr);
  }
  return state;
}

v1::TrainingState StepEngine::TrainingState() const {
  absl::MutexLock lock(&mu_);
  return TrainingStateLocked();
}

std::vector<uint64_t> StepEngine::TransferSizes() const {
  absl::ReaderMutexLock params_lock(&params_mu_);
  std::vector<uint64_t> sizes;
  for (size_t a = 0; a < shard_->checkpoint_arrays(); ++a) {
    sizes.push_back(shard_->raw_elements(a, owned_unpadded_.size()));
  }
  return sizes;
}

void StepEngine::ReadModelStates(absl::FunctionRef<void(const ShardState&)> read) const {
  absl::ReaderMutexLock params_lock(&params_mu_);
  read(*shard_);
}

absl::Status StepEngine::Restore(const v1::TrainingState& state,
                                 absl::FunctionRef<absl::Status(ShardState&)> restore) {
  absl::MutexLock lock(&mu_);
  AwaitSumsLocked();  // held from here on: no pass starts before the reset
  {
    absl::MutexLock params_lock(&params_mu_);
    const absl::Status restored = restore(*shard_);
    ++params_version_;
    if (!restored.ok()) return restored;
    params_step_ = state.committed_step();
  }
  RestoreTrainingStateLocked(state);
  return absl::OkStatus();
}

absl::Status StepEngine::TakeForwardedStep(uint64_t step, const float* grad,
                                           const PrepareResult& result,
                                           std::vector<uint32_t> no_grad) {
  absl::MutexLock lock(&mu_);
  AwaitSumsLocked();  // the gradient is overwritten below
  if (step != committed_step() + 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step: the backup of job ", config_->job_id, " is at committed step ", committed_step(),
        ", got the gradient of step ", step));
  }
  std::memcpy(grad_data_ + (owned_unpadded_.begin - owned_.begin), grad,
              owned_unpadded_.size() * sizeof(float));
  prepared_no_grad_ = std::move(no_grad);
  prepare_result_ = result;
  prepared_ = true;
  prepared_by_forward_ = true;
  ++reduction_changes_;
  return absl::OkStatus();
}

void StepEngine::Rebook(bool replica) {
  absl::MutexLock lock(&mu_);
  grad_.Rebook(replica               ? MemoryCategory::kReplica
               : config_->stage >= 2 ? MemoryCategory::kGrad
                                     : MemoryCategory::kBuffer);
  absl::MutexLock params_lock(&params_mu_);
  shard_->Rebook(replica);
}

bool StepEngine::prepared() const {
  absl::MutexLock lock(&mu_);
  return prepared_;
}

void StepEngine::RestoreTrainingStateLocked(const v1::TrainingState& state) {
  // The open step's contributions belong to the replaced state.
  ResetReductionLocked();
  prepared_ = false;
  prepared_by_forward_ = false;
  ++reduction_changes_;
  loss_scale_ = state.loss_scale();
  good_steps_ = state.good_steps();
  last_commit_ = LastCommit();
  last_commit_.response.committed_step = state.committed_step();
  last_commit_.response.loss_scale = loss_scale_;
  last_commit_.response.skipped = state.last_commit().skipped();
  last_commit_.clip_coef = state.last_commit().clip_coef();
  last_commit_.grad_norm = state.last_commit().grad_norm();
  last_commit_.lr = state.last_commit().lr();
  last_commit_.group_lrs.assign(state.last_commit().group_lrs().begin(),
                                state.last_commit().group_lrs().end());
  committed_step_.store(state.committed_step(), std::memory_order_release);
}

namespace {

// The wire numbers of zeroshard.v1.StateArray, which StateArrayKind's
// values are.
absl::StatusOr<StateArrayKind> StateArrayOf(WireEnum array, absl::string_view field) {
  switch (array) {
    case static_cast<int>(StateArrayKind::kMaster): return StateArrayKind::kMaster;
    case static_cast<int>(StateArrayKind::kExpAvg): return StateArrayKind::kExpAvg;
    case static_cast<int>(StateArrayKind::kExpAvgSq): return StateArrayKind::kExpAvgSq;
    default: break;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": must be MASTER (1), EXP_AVG (2) or EXP_AVG_SQ (3), got ", static_cast<int>(array)));
}

}  // namespace

absl::Status StepEngine::ReadState(WireEnum wire_array, const FlatRange& range,
                                   uint64_t max_chunk_elements,
                                   const std::function<bool(StateChunkOut&)>& write) {
  ASSIGN_OR_RETURN(const StateArrayKind array, StateArrayOf(wire_array, "array"));
  if (range.begin >= range.end || !owned_unpadded_.Contains(range)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "range [", range.begin, ", ", range.end, ") is empty or outside the parameters this ",
        "daemon owns [", owned_unpadded_.begin, ", ", owned_unpadded_.end, ")"));
  }
  StateChunkOut chunk;
  uint64_t version = 0;
  {
    absl::MutexLock lock(&mu_);
    if (prepared_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job ", config_->job_id, " step ", committed_step() + 1,
          " is prepared: read the state once it is committed"));
    }
    absl::ReaderMutexLock params_lock(&params_mu_);
    RETURN_IF_ERROR(shard_->CheckArray(array, "array"));
    RETURN_IF_ERROR(shard_->damaged());
    version = params_version_;
    for (const v1::TensorStep& t : shard_->TensorStepsIn(range)) {
      chunk.tensor_steps.push_back({t.tensor(), t.steps()});
    }
  }
  for (uint64_t pos = range.begin; pos < range.end;) {
    const uint64_t end = std::min(range.end, pos + max_chunk_elements);
    std::string* data = &chunk.data;
    data->resize((end - pos) * sizeof(float));
    {
      // Only the copy holds the lock; the write below holds none.
      absl::ReaderMutexLock lock(&params_mu_);
      if (params_version_ != version) {
        return absl::AbortedError(absl::StrCat("job ", config_->job_id,
                                               ": the state changed while it was being read; "
                                               "read it again"));
      }
      RETURN_IF_ERROR(
          shard_->ReadArray(array, {pos, end}, reinterpret_cast<float*>(data->data())));
    }
    chunk.range = {pos, end};
    chunk.crc32c = Crc32c(data->data(), data->size());
    if (!write(chunk)) return absl::CancelledError("the reading client went away");
    chunk.tensor_steps.clear();
    pos = end;
  }
  return absl::OkStatus();
}

absl::StatusOr<WriteStateResult> StepEngine::WriteState(const std::vector<StateChunkIn>& chunks,
                                                         bool* changed) {
  *changed = false;
  // Checked in full before anything changes.
  std::vector<StateArrayKind> arrays(chunks.size());
  std::vector<uint32_t> stepped;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const StateChunkIn& c = chunks[i];
    const std::string where = absl::StrCat("chunk ", i);
    const FlatRange r = c.range;
    if (!r.empty() || c.data.size() > 0) {
      ASSIGN_OR_RETURN(arrays[i], StateArrayOf(c.array, where + ".array"));
      if (r.begin > r.end || !owned_unpadded_.Contains(r)) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ".range ", RangeString(c.range), " is outside the parameters this daemon ",
            "owns [", owned_unpadded_.begin, ", ", owned_unpadded_.end, ")"));
      }
      if (c.data.size() != r.size() * sizeof(float)) {
        return absl::InvalidArgumentError(absl::StrCat(where, ".data: ", c.data.size(),
                                                       " bytes, expected ", r.size() * 4, " for ",
                                                       r.size(), " fp32 elements"));
      }
      if (c.crc32c != 0 && Crc32c(c.data.data(), c.data.size()) != c.crc32c) {
        return absl::DataLossError(
            absl::StrCat(where, ": CRC-32C of the data does not match (corrupted in transit)"));
      }
      for (size_t j = 0; j < i; ++j) {
        const FlatRange other = chunks[j].range;
        if (arrays[j] == arrays[i] && !other.Intersect(r).empty()) {
          return absl::InvalidArgumentError(absl::StrCat(where, ".range ", RangeString(c.range),
                                                         " overlaps chunk ", j,
                                                         "'s of the same array"));
        }
      }
    }
    for (const TensorStepCount& t : c.tensor_steps) stepped.push_back(t.tensor);
  }
  std::sort(stepped.begin(), stepped.end());
  if (std::adjacent_find(stepped.begin(), stepped.end()) != stepped.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor_steps: tensor ", *std::adjacent_find(stepped.begin(), stepped.end()),
                     " is set twice in one stream"));
  }
  absl::MutexLock commit_lock(&commit_mu_);
  absl::MutexLock lock(&mu_);
  if (prepared_) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", config_->job_id, " step ", committed_step() + 1,
                     " is prepared: write the state once it is committed"));
  }
  absl::MutexLock params_lock(&params_mu_);
  RETURN_IF_ERROR(shard_->damaged());
  uint64_t elements = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const StateChunkIn& c = chunks[i];
    const std::string where = absl::StrCat("chunk ", i);
    for (size_t k = 0; k < c.tensor_steps.size(); ++k) {
      RETURN_IF_ERROR(shard_->CheckTensorStep(c.tensor_steps[k].tensor,
                                              absl::StrCat(where, ".tensor_steps[", k, "]")));
    }
    if (c.data.empty()) continue;
    RETURN_IF_ERROR(shard_->CheckArray(arrays[i], where + ".array"));
    RETURN_IF_ERROR(shard_->CheckWrite(arrays[i], c.range,
                                       reinterpret_cast<const float*>(c.data.data()),
                                       where + ".data"));
  }
  // A write of what is held changes nothing: every rank of a job may load
  // the same state dict without gathers being aborted by the others.
  bool changes = false;
  for (size_t i = 0; i < chunks.size() && !changes; ++i) {
    const StateChunkIn& c = chunks[i];
    for (const TensorStepCount& t : c.tensor_steps) {
      changes = changes || !shard_->HasTensorStep(t.tensor, t.steps);
    }
    if (!changes && !c.data.empty()) {
      ASSIGN_OR_RETURN(const bool holds,
                       shard_->Holds(arrays[i], c.range,
                                     reinterpret_cast<const float*>(c.data.data())));
      changes = !holds;
    }
  }
  uint32_t steps = 0;
  for (size_t i = 0; i < chunks.size() && changes; ++i) {
    const StateChunkIn& c = chunks[i];
    for (const TensorStepCount& t : c.tensor_steps) {
      shard_->SetTensorStep(t.tensor, t.steps);
      ++steps;
    }
    if (c.data.empty()) continue;
    const FlatRange r = c.range;
    if (absl::Status s = shard_->WriteArray(options_.optimizer, arrays[i], r,
                                            reinterpret_cast<const float*>(c.data.data()));
        !s.ok()) {
      // Only on disk. Part of the stream may have landed: the state is
      // neither the old one nor the new one.
      if (steps > 0 || elements > 0) shard_->MarkDamaged(s);
      ++params_version_;
      return s;
    }
    elements += r.size();
  }
  if (changes) ++params_version_;
  *changed = changes;
  WriteStateResult out;
  out.elements = elements;
  out.tensor_steps = steps;
  return out;
}

StepProgress StepEngine::Progress(bool brief) const {
  StepProgress state;
  state.world_size = config_->world_size;
  absl::MutexLock lock(&mu_);
  state.committed_step = committed_step();
  state.loss_scale = loss_scale_;
  if (committed_step() > 0) {
    state.last_skipped = last_commit_.response.skipped;
    state.last_clip_coef = last_commit_.clip_coef;
    state.last_grad_norm = last_commit_.grad_norm;
    state.last_lr = last_commit_.lr;
  }
  state.prepared = prepared_;
  state.complete_elements = reduction_->CompleteElements();
  state.owned_elements = owned_unpadded_.size();
  if (!brief) state.missing = reduction_->Missing(kMaxMissingReported);
  return state;
}

float StepEngine::loss_scale() const {
  absl::MutexLock lock(&mu_);
  return loss_scale_;
}

std::vector<ParameterRegion> StepEngine::ParameterRegions() const {
  std::vector<ParameterRegion> out;
  absl::ReaderMutexLock lock(&params_mu_);
  auto add = [&](ParameterRegion::Purpose purpose, const transport::Region* region) {
    if (region == nullptr) return;
    ParameterRegion r;
    r.purpose = purpose;
    r.address = region->Descriptor().address;
    r.length = region->Descriptor().length;
    r.rkey = region->Descriptor().rkey;
    r.range = owned_;
    out.push_back(std::move(r));
  };
  add(ParameterRegion::Purpose::kMaster, shard_->array_region(0));
  add(ParameterRegion::Purpose::kHalf, shard_->half_region());
  return out;
}

absl::Time StepEngine::last_remote_access() const {
  return absl::FromUnixNanos(last_remote_access_ns_.load(std::memory_order_acquire));
}

void StepEngine::NoteRemoteAccess() {
  last_remote_access_ns_.store(absl::ToUnixNanos(absl::Now()), std::memory_order_release);
}

void StepEngine::Hash(uint64_t& h) const {
  absl::MutexLock lock(&mu_);
  AwaitSumsLocked();
  absl::ReaderMutexLock params_lock(&params_mu_);
  shard_->Hash(h);
  reduction_->Hash(h);
  HashValue(h, committed_step());
  HashValue(h, loss_scale_);
  HashValue(h, good_steps_);
  HashValue(h, prepared_);
}

}  // namespace zeroshard
