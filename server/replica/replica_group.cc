#include "server/replica/replica_group.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/crc32c.h"
#include "common/protocol.h"
#include "common/status_macros.h"

namespace zeroshard {
namespace {

// Elements per forwarded or transferred chunk (4 MiB of fp32).
constexpr uint64_t kReplicaChunkElements = uint64_t{1} << 20;
// The slowest a replication call may move its bytes before it counts as
// failed (on top of the daemon's replica timeout).
constexpr double kMinReplicaBytesPerSecond = 50e6;
// How long a primary whose backup failed goes on alone before trying again.
constexpr absl::Duration kResyncInterval = absl::Seconds(1);

// A later chunk of a stream naming another job than the stream's.
std::string ForeignChunk(absl::string_view where, const std::string& job_id) {
  return absl::StrCat(where, ".job_id: every chunk of the stream must name job ", job_id,
                      " (or none)");
}

const char* RoleName(ReplicaRole role) {
  return role == ReplicaRole::kPrimary ? "primary" : "backup";
}

// CRC-32C of each kReplicaChunkElements piece of data[0, n).
void AddPieceCrcs(const float* data, uint64_t n, v1::BulkStateArray* out) {
  for (uint64_t pos = 0; pos < n; pos += kReplicaChunkElements) {
    const uint64_t count = std::min(kReplicaChunkElements, n - pos);
    out->add_crc32c(Crc32c(data + pos, count * sizeof(float)));
  }
}

// How long a bulk read cut short may take to let go of its buffer.
constexpr absl::Duration kAbortedReadWait = absl::Seconds(10);

// Reads cut short: aborts them and waits for the transport to let go of
// their buffers. A read still not done after kAbortedReadWait may go on
// writing into its buffer, so the buffers of `held` are then leaked rather
// than freed (logged): bytes lost beat memory that a late read overwrites.
void SettleAbortedReads(std::vector<transport::Completion> reads,
                        std::vector<std::unique_ptr<float[]>>* held, uint64_t bytes_each) {
  for (transport::Completion& read : reads) read.Abort();
  const absl::Time until = absl::Now() + kAbortedReadWait;
  bool settled = true;
  for (transport::Completion& read : reads) {
    if (absl::IsDeadlineExceeded(read.Wait(until))) settled = false;
  }
  if (settled) return;
  for (std::unique_ptr<float[]>& buffer : *held) (void)buffer.release();
  // Their destructors would wait again: they are leaked with the buffers.
  (void)new std::vector<transport::Completion>(std::move(reads));
  std::fprintf(stderr,
               "zeroshardd: a state transfer's reads over the bulk transport did not stop within "
               "%lld s of being aborted; leaving their %llu bytes of buffers allocated\n",
               static_cast<long long>(absl::ToInt64Seconds(kAbortedReadWait)),
               static_cast<unsigned long long>(held->size() * bytes_each));
}

// A bulk state transfer, the backup's side: reads the primary's arrays named
// in `source` (n elements each) into (*held)[a] over `transport`, every
// piece checked against its CRC-32C. Blocks until `deadline` at most (the
// connection until `connect_deadline`); reads cut short are settled before
// this returns (SettleAbortedReads). When this daemon cannot read them (no
// bulk transport, another kind, the primary's address out of its reach) it
// reads nothing and sets *refused to why: the primary then streams the data.
absl::StatusOr<uint64_t> PullState(transport::Transport* transport,
                                   const v1::BulkStateSource& source,
                                   const std::vector<uint64_t>& sizes,
                                   std::vector<std::unique_ptr<float[]>>* held,
                                   absl::Time connect_deadline, absl::Time deadline,
                                   std::string* refused) {
  if (transport == nullptr) {
    *refused = "this daemon runs no bulk transport: send the state in the stream";
    return 0;
  }
  absl::StatusOr<v1::TransportKind> mine = TransportKindFromName(transport->kind(), "bulk");
  if (!mine.ok() || *mine != source.transport()) {
    *refused =
        absl::StrCat("this daemon's bulk transport is ", transport->kind(), ", the primary's ",
                     TransportKindName(source.transport()), ": send the state in the stream");
    return 0;
  }
  if (static_cast<size_t>(source.arrays_size()) != held->size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bulk.arrays: this job's state has ", held->size(), " arrays, got ", source.arrays_size()));
  }
  for (int a = 0; a < source.arrays_size(); ++a) {
    const uint64_t n = sizes[a];
    const uint64_t bytes = n * sizeof(float);
    const int pieces = static_cast<int>((n + kReplicaChunkElements - 1) / kReplicaChunkElements);
    const v1::BulkStateArray& array = source.arrays(a);
    if (array.length() != bytes || array.crc32c_size() != pieces) {
      return absl::InvalidArgumentError(
          absl::StrCat("bulk.arrays[", a, "]: ", array.length(), " bytes in ", array.crc32c_size(),
                       " pieces, expected ", bytes, " bytes (", n, " fp32 elements) in ", pieces));
    }
  }
  absl::StatusOr<std::unique_ptr<transport::Connection>> connection =
      transport->Connect(source.worker_address(), std::min(connect_deadline, deadline));
  if (absl::IsInvalidArgument(connection.status())) return connection.status();
  if (!connection.ok()) {
    *refused = absl::StrCat("this daemon cannot reach the primary's bulk transport (",
                            connection.status().ToString(), "): send the state in the stream");
    return 0;
  }
  std::vector<transport::Completion> reads;
  for (int a = 0; a < source.arrays_size(); ++a) {
    const v1::BulkStateArray& array = source.arrays(a);
    const transport::RegionDescriptor from{array.address(), array.length(), array.rkey()};
    reads.push_back((*connection)->Get((*held)[a].get(), array.length(), from, 0));
  }
  uint64_t total = 0;
  for (uint64_t n : sizes) total += n * sizeof(float);
  for (transport::Completion& read : reads) {
    if (absl::Status s = read.Wait(deadline); !s.ok()) {
      SettleAbortedReads(std::move(reads), held, total / std::max<size_t>(held->size(), 1));
      return absl::Status(s.code(), absl::StrCat("reading the primary's state over the bulk "
                                                 "transport: ",
                                                 s.message()));
    }
  }
  for (int a = 0; a < source.arrays_size(); ++a) {
    const uint64_t n = sizes[a];
    const int pieces = static_cast<int>((n + kReplicaChunkElements - 1) / kReplicaChunkElements);
    for (int p = 0; p < pieces; ++p) {
      const uint64_t pos = static_cast<uint64_t>(p) * kReplicaChunkElements;
      const uint64_t count = std::min(kReplicaChunkElements, n - pos);
      if (Crc32c((*held)[a].get() + pos, count * sizeof(float)) != source.arrays(a).crc32c(p)) {
        return absl::DataLossError(absl::StrCat("bulk.arrays[", a, "] piece ", p,
                                                ": CRC-32C of the data read does not match (the "
                                                "primary's state changed during the read?)"));
      }
    }
  }
  return total;
}

}  // namespace

ReplicaGroup::ReplicaGroup(Options options, const v1::JobSpec* spec, StepEngine* step)
    : options_(std::move(options)), spec_(spec), step_(step), config_(step->config()) {
  absl::MutexLock lock(&mu_);
  role_ = options_.role;
  held_state_ = role_ == ReplicaRole::kPrimary;
  if (role_ == ReplicaRole::kPrimary) StartProberLocked();
}

ReplicaGroup::~ReplicaGroup() {
  std::thread prober;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    prober = std::move(prober_);
  }
  if (prober.joinable()) prober.join();
}

void ReplicaGroup::StartProberLocked() {
  if (prober_running_ || stopping_ || options_.link == nullptr ||
      options_.liveness_timeout <= absl::ZeroDuration()) {
    return;
  }
  // A thread that left its loop has set prober_running_ to false under mu_
  // and takes no lock again: joining it here waits only for its return.
  if (prober_.joinable()) prober_.join();
  prober_running_ = true;
  prober_ = std::thread([this] { RunProber(); });
}

void ReplicaGroup::RunProber() {
  const absl::Duration period = std::max(options_.liveness_timeout / 4, absl::Milliseconds(100));
  const absl::Duration probe_timeout =
      std::max(options_.liveness_timeout / 2, absl::Milliseconds(200));
  {
    absl::MutexLock lock(&mu_);
    last_answer_ = absl::Now();
  }
  for (;;) {
    uint64_t epoch = 0;
    {
      absl::MutexLock lock(&mu_);
      if (stopping_ || role_ != ReplicaRole::kPrimary) {
        prober_running_ = false;
        return;
      }
      epoch = epoch_;
    }
    const absl::Status answered =
        options_.link->Probe(options_.peer_address, absl::Now() + probe_timeout);
    const absl::Time now = absl::Now();
    absl::MutexLock lock(&mu_);
    // Demoted (or promoted again) during the probe: its answer is about a
    // group this copy no longer leads at that epoch.
    if (stopping_ || role_ != ReplicaRole::kPrimary || epoch_ != epoch) continue;
    if (answered.ok()) {
      last_answer_ = now;
      if (peer_silent_) {
        peer_silent_ = false;
        next_resync_ = absl::InfinitePast();
        std::fprintf(stderr,
                     "zeroshardd: job %s replica group %u: the backup's daemon %s answers again "
                     "(silent for %.1f s); its copy is brought up to date at the next step\n",
                     config_.job_id.c_str(), options_.group, options_.peer_address.c_str(),
                     absl::ToDoubleSeconds(now - silent_since_));
      }
    } else if (!peer_silent_ && now - last_answer_ >= options_.liveness_timeout) {
      peer_silent_ = true;
      silent_since_ = last_answer_;
      in_sync_ = false;
      if (!one_copy_since_) one_copy_since_ = now;
      std::fprintf(stderr,
                   "zeroshardd: job %s replica group %u: the backup's daemon %s has not answered "
                   "for %.1f s (%s; --liveness_timeout_seconds): the group goes on with one copy "
                   "and calls it again once it answers\n",
                   config_.job_id.c_str(), options_.group, options_.peer_address.c_str(),
                   absl::ToDoubleSeconds(now - last_answer_), std::string(answered.message()).c_str());
    }
    auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_; };
    mu_.AwaitWithTimeout(absl::Condition(&stopping), period);
  }
}

ReplicaRole ReplicaGroup::role() const {
  absl::MutexLock lock(&mu_);
  return role_;
}

uint64_t ReplicaGroup::epoch() const {
  absl::MutexLock lock(&mu_);
  return epoch_;
}

absl::Status ReplicaGroup::CheckServing(std::optional<uint64_t> epoch) const {
  absl::MutexLock lock(&mu_);
  if (role_ != ReplicaRole::kPrimary) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", config_.job_id, ": this daemon holds replica group ", options_.group,
                     " as its backup (epoch ", epoch_, "); the group's primary is ", options_.peer_address,
                     " unless it was replaced: read the placement with Replica.GetReplicaState"));
  }
  if (epoch.has_value() && *epoch != epoch_) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", config_.job_id, " replica group ", options_.group, " is at epoch ",
                     epoch_, " here, the request carries epoch ", *epoch, ": ",
                     *epoch < epoch_ ? "the group was promoted since; read the placement again"
                                     : "this copy was replaced; nothing was changed"));
  }
  return absl::OkStatus();
}

ReplicaGroupStatus ReplicaGroup::State() const {
  ReplicaGroupStatus out;
  out.group = options_.group;
  out.peer_address = options_.peer_address;
  {
    absl::MutexLock lock(&mu_);
    out.role = role_;
    out.epoch = epoch_;
    out.in_sync = in_sync_;
  }
  out.committed_step = step_->committed_step();
  out.prepared = step_->prepared();
  return out;
}

void ReplicaGroup::MarkBackupStale(const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  if (role_ != ReplicaRole::kPrimary) return;
  // A backup that did not answer waits for the probe thread to hear from it.
  const bool silent =
      prober_running_ && (absl::IsUnavailable(why) || absl::IsDeadlineExceeded(why));
  if (!why.ok()) {
    // At most once per resync interval (or silence) while the backup stays away.
    std::fprintf(stderr,
                 "zeroshardd: job %s replica group %u: %s (%s); the group goes on with one copy "
                 "and %s\n",
                 config_.job_id.c_str(), options_.group,
                 in_sync_ ? "the backup fell behind" : "the backup is still not current",
                 std::string(why.message()).c_str(),
                 silent ? "calls it again once its daemon answers"
                        : absl::StrCat("tries again in ", absl::FormatDuration(kResyncInterval))
                              .c_str());
  }
  in_sync_ = false;
  next_resync_ = why.ok() ? absl::InfinitePast() : absl::Now() + kResyncInterval;
  if (!why.ok() && !one_copy_since_) one_copy_since_ = absl::Now();
  if (silent && !peer_silent_) {
    peer_silent_ = true;
    silent_since_ = absl::Now();
  }
}

absl::Status ReplicaGroup::CheckPrimaryGone(const std::string& token, absl::Time deadline) const {
  uint64_t epoch = 0;
  {
    absl::MutexLock lock(&mu_);
    if (role_ == ReplicaRole::kPrimary) return absl::OkStatus();
    epoch = epoch_;
  }
  const std::string what = absl::StrCat("job ", config_.job_id, " replica group ", options_.group);
  if (options_.link == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": this daemon has no link to the group's primary at ", options_.peer_address,
        " to check it is gone; only a daemon or admin certificate, or the admin token, may "
        "promote this backup"));
  }
  absl::StatusOr<v1::ReplicaState> peer =
      options_.link->GetReplicaState(options_.peer_address, token, config_.job_id, deadline);
  if (!peer.ok()) {
    if (absl::IsUnavailable(peer.status()) || absl::IsDeadlineExceeded(peer.status()) ||
        absl::IsNotFound(peer.status())) {
      return absl::OkStatus();
    }
    return absl::AbortedError(absl::StrCat(
        what, ": could not tell whether the primary at ", options_.peer_address,
        " is gone (", peer.status().message(), "); the backup stays a backup: try again"));
  }
  for (const v1::ReplicaGroupState& g : peer->groups()) {
    if (g.group() == options_.group && g.role() == v1::REPLICA_ROLE_PRIMARY && g.epoch() >= epoch) {
      return absl::AbortedError(absl::StrCat(
          what, ": its primary at ", options_.peer_address, " still serves it (epoch ", g.epoch(),
          ", committed step ", g.committed_step(),
          "); a trainer's Promote replaces only a primary that its backup cannot reach either "
          "(a daemon or admin certificate, or the admin token, may replace a live one): "
          "nothing was changed"));
    }
  }
  return absl::OkStatus();
}

absl::Status ReplicaGroup::Promote(const v1::PromoteRequest& r) {
  absl::MutexLock commit_lock(&step_->commit_lock());
  const bool was_backup = role() == ReplicaRole::kBackup;
  absl::Status promoted = PromoteLocked(r);
  // Its bytes are a primary's from now on.
  if (promoted.ok() && was_backup) step_->Rebook(/*replica=*/false);
  return promoted;
}

absl::Status ReplicaGroup::PromoteLocked(const v1::PromoteRequest& r) {
  const uint64_t committed = step_->committed_step();
  const bool prepared = step_->prepared();
  absl::MutexLock lock(&mu_);
  if (role_ == ReplicaRole::kPrimary) {
    if (r.epoch() == epoch_) return absl::OkStatus();  // promoted already
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", config_.job_id, " replica group ", options_.group, " is primary here at epoch ",
        epoch_, "; asked to promote at epoch ", r.epoch()));
  }
  // One step up from the epoch both copies agreed on: a caller cannot jump
  // the group to an epoch (UINT64_MAX) that no later promotion could pass.
  if (epoch_ == std::numeric_limits<uint64_t>::max() || r.epoch() != epoch_ + 1) {
    return absl::FailedPreconditionError(
        absl::StrCat("epoch: a promotion steps the backup's epoch (", epoch_,
                     ") by one: must be ", epoch_ + 1, ", got ", r.epoch()));
  }
  // A backup holding the prepared step counts it: the leader finishes it.
  if (!in_sync_ || committed + (prepared ? 1 : 0) < r.committed_step()) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", config_.job_id, " replica group ", options_.group,
                     ": the backup here is behind (", in_sync_ ? "" : "it holds no current copy, ",
                     "committed step ", committed, ", the job has committed ", r.committed_step(),
                     "); the group's state is lost with its primary: resume from a checkpoint"));
  }
  role_ = ReplicaRole::kPrimary;
  epoch_ = r.epoch();
  in_sync_ = false;  // its peer is gone; the next PrepareStep tries it again
  next_resync_ = absl::InfinitePast();
  one_copy_since_ = absl::Now();
  StartProberLocked();
  std::fprintf(stderr, "zeroshardd: job %s replica group %u promoted to primary at epoch %llu\n",
               config_.job_id.c_str(), options_.group, static_cast<unsigned long long>(epoch_));
  return absl::OkStatus();
}

absl::Status ReplicaGroup::CheckDrivenBy(uint64_t epoch, bool transfer) const {
  absl::MutexLock lock(&mu_);
  if (transfer && epoch == std::numeric_limits<uint64_t>::max()) {
    return absl::FailedPreconditionError(
        "epoch: a transfer cannot carry the largest epoch (no later promotion could pass it)");
  }
  // A copy that holds state knows its group's epoch: the only newer one a
  // primary can have is the next (a promotion steps it by one, and the
  // group has no third copy to be promoted further while this one held
  // state). A copy registered afresh (a restarted daemon) knows none yet.
  if (transfer && held_state_ && epoch > epoch_ + 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "epoch: job ", config_.job_id, " replica group ", options_.group,
        " holds state here at epoch ", epoch_, "; a transfer may carry ", epoch_, " or ",
        epoch_ + 1, " (one promotion later), got ", epoch, "; nothing was changed"));
  }
  const bool older = epoch < epoch_;
  const bool ok = transfer ? (epoch > epoch_ || (epoch == epoch_ && role_ == ReplicaRole::kBackup))
                           : (epoch == epoch_ && role_ == ReplicaRole::kBackup);
  if (ok) return absl::OkStatus();
  const std::string why =
      absl::StrCat("job ", config_.job_id, " replica group ", options_.group, " is ",
                   RoleName(role_), " here at epoch ", epoch_, "; a primary at epoch ", epoch,
                   " cannot drive it", older ? " (the sender was replaced)" : "");
  // ABORTED tells a sender at an older epoch that a promotion replaced it
  // (epochs grow only by promotion): it steps down.
  return older ? absl::AbortedError(why) : absl::FailedPreconditionError(why);
}

// ---- The primary's side ----

bool ReplicaGroup::ReplicatePrepared(const StepEngine::Prepared& prepared,
                                     const std::string& token) {
  // The caller (the job's prepare) holds it: the step is frozen.
  step_->commit_lock().AssertHeld();
  ReplicaLink* link = options_.link;
  bool in_sync = false;
  {
    absl::MutexLock lock(&mu_);
    if (role_ != ReplicaRole::kPrimary || link == nullptr) return false;
    if (!in_sync_ && (peer_silent_ || absl::Now() < next_resync_)) return false;
    in_sync = in_sync_;
  }
  // Each call gets replica_timeout plus its bytes at the slowest rate
  // allowed, so that a large group's state can be copied at all.
  const uint64_t n = step_->owned_unpadded().size();
  auto deadline = [this](uint64_t bytes) {
    return absl::Now() + options_.timeout +
           absl::Seconds(static_cast<double>(bytes) / kMinReplicaBytesPerSecond);
  };
  if (!in_sync) {
    // A backup that is not current (the old primary after a promotion, a
    // restarted or silent peer): ask its daemon first, briefly, so that a
    // peer that is gone costs this step a probe, not a transfer's deadline.
    if (options_.liveness_timeout > absl::ZeroDuration()) {
      absl::Status answered = link->Probe(
          options_.peer_address,
          absl::Now() + std::min(options_.liveness_timeout / 4, absl::Seconds(1)));
      if (!answered.ok()) {
        MarkBackupStale(answered);
        return false;
      }
    }
    const uint64_t state_bytes = 3 * n * sizeof(float);
    absl::Status s = SendState(token, deadline(state_bytes));
    if (absl::IsNotFound(s)) {
      // The peer restarted without the job: give it back, as backups.
      s = link->RegisterBackup(options_.peer_address, token, *spec_, options_.peer_index,
                               deadline(0));
      if (s.ok()) s = SendState(token, deadline(state_bytes));
    }
    if (!s.ok()) {
      if (absl::IsAborted(s)) {
        StepDownLocked(s);
      } else {
        MarkBackupStale(s);
      }
      return false;
    }
  }
  if (absl::Status s = SendGradient(prepared, token, deadline(n * sizeof(float))); !s.ok()) {
    if (absl::IsAborted(s)) {
      StepDownLocked(s);
    } else {
      MarkBackupStale(s);
    }
    return false;
  }
  absl::MutexLock lock(&mu_);
  in_sync_ = true;
  // The backup answered: a heartbeat that failed meanwhile is outdated.
  peer_silent_ = false;
  last_answer_ = absl::Now();
  if (one_copy_since_) {
    // The window in which a fault of this daemon would have lost the group.
    std::fprintf(stderr,
                 "zeroshardd: job %s replica group %u: the backup on %s is current again at step "
                 "%llu; the group had one copy for %.1f s\n",
                 config_.job_id.c_str(), options_.group, options_.peer_address.c_str(),
                 static_cast<unsigned long long>(prepared.step),
                 absl::ToDoubleSeconds(absl::Now() - *one_copy_since_));
    one_copy_since_.reset();
  }
  return true;
}

absl::Status ReplicaGroup::SendState(const std::string& token, absl::Time deadline) {
  v1::TrainingState state = step_->TrainingState();
  size_t arrays = 0;
  step_->ReadModelStates([&](const ShardState& shard) {
    state.set_optimizer_steps(shard.optimizer_steps());
    for (v1::TensorStep& t : shard.TensorStepsApart()) *state.add_tensor_steps() = std::move(t);
    arrays = shard.checkpoint_arrays();
  });
  const uint64_t epoch = this->epoch();
  const absl::Time start = absl::Now();
  std::optional<absl::StatusOr<v1::TransferStateResponse>> r;
  const char* how = "over the bulk transport";
  if (std::optional<v1::ReplicaStateChunk> bulk = BulkStateChunk(arrays); bulk.has_value()) {
    bulk->set_job_id(config_.job_id);
    bulk->set_group(options_.group);
    bulk->set_epoch(epoch);
    *bulk->mutable_state() = state;
    bool sent = false;
    r = options_.link->TransferState(
        options_.peer_address, token,
        [&](v1::ReplicaStateChunk* chunk) {
          if (sent) return false;
          *chunk = *bulk;
          sent = true;
          return true;
        },
        deadline);
  }
  // Without a bulk source, or when the backup could not read it (and took
  // nothing), the data goes in the stream.
  if (!r.has_value() || (r->ok() && !(*r)->bulk_refused().empty())) {
    how = "in the stream";
    r = StreamState(token, state, arrays, epoch, deadline);
  }
  if (!r->ok()) return r->status();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  std::fprintf(stderr,
               "zeroshardd: job %s replica group %u: copied the state of step %llu to the backup "
               "on %s %s: %llu bytes in %.3f s (%.2f GB/s)\n",
               config_.job_id.c_str(), options_.group,
               static_cast<unsigned long long>(state.committed_step()), options_.peer_address.c_str(), how,
               static_cast<unsigned long long>((*r)->bytes()), seconds,
               seconds > 0 ? static_cast<double>((*r)->bytes()) / seconds / 1e9 : 0.0);
  return absl::OkStatus();
}

std::optional<v1::ReplicaStateChunk> ReplicaGroup::BulkStateChunk(size_t arrays) const {
  transport::Transport* transport = options_.transport;
  if (transport == nullptr) return std::nullopt;
  absl::StatusOr<v1::TransportKind> kind = TransportKindFromName(transport->kind(), "bulk");
  if (!kind.ok()) return std::nullopt;
  const uint64_t n = step_->owned_unpadded().size();
  v1::ReplicaStateChunk chunk;
  v1::BulkStateSource* source = chunk.mutable_bulk();
  source->set_transport(*kind);
  source->set_worker_address(transport->LocalAddress());
  // The commit lock (held) keeps every writer of the arrays out until the
  // backup has answered.
  bool in_regions = true;
  step_->ReadModelStates([&](const ShardState& shard) {
  for (size_t a = 0; a < arrays && in_regions; ++a) {
    const transport::Region* region = shard.array_region(a);
    if (region == nullptr) {
      in_regions = false;
      break;
    }
    const float* data = shard.array(a);
    const uint64_t elements = shard.raw_elements(a, n);
    const uint64_t offset = static_cast<uint64_t>(reinterpret_cast<const char*>(data) -
                                                  static_cast<const char*>(region->base()));
    v1::BulkStateArray* out = source->add_arrays();
    out->set_address(region->Descriptor().address + offset);
    out->set_length(elements * sizeof(float));
    out->set_rkey(region->Descriptor().rkey);
    AddPieceCrcs(data, elements, out);
  }
  });
  if (!in_regions) return std::nullopt;
  return chunk;
}

absl::StatusOr<v1::TransferStateResponse> ReplicaGroup::StreamState(const std::string& token,
                                                           const v1::TrainingState& state,
                                                           size_t arrays, uint64_t epoch,
                                                           absl::Time deadline) {
  const std::vector<uint64_t> sizes = step_->TransferSizes();
  size_t array = 0;
  uint64_t offset = 0;
  bool first = true;
  return options_.link->TransferState(
      options_.peer_address, token,
      [&](v1::ReplicaStateChunk* chunk) {
        while (array < arrays && sizes[array] == 0) ++array;
        if (array == arrays) return false;
        const uint64_t n = sizes[array];
        chunk->Clear();
        chunk->set_job_id(config_.job_id);
        chunk->set_group(options_.group);
        chunk->set_epoch(epoch);
        if (first) *chunk->mutable_state() = state;
        first = false;
        const uint64_t count = std::min(kReplicaChunkElements, n - offset);
        chunk->set_array(static_cast<uint32_t>(array));
        chunk->set_offset(offset);
        std::string* data = chunk->mutable_data();
        data->resize(count * sizeof(float));
        // The commit lock (held by this thread, which the link calls back
        // on) keeps every writer of the arrays out.
        step_->commit_lock().AssertHeld();
        step_->ReadModelStates([&](const ShardState& shard) {
          std::memcpy(data->data(), shard.array(array) + offset, data->size());
        });
        chunk->set_crc32c(Crc32c(data->data(), data->size()));
        offset += count;
        if (offset == n) {
          ++array;
          offset = 0;
        }
        return true;
      },
      deadline);
}

absl::Status ReplicaGroup::SendGradient(const StepEngine::Prepared& prepared,
                                        const std::string& token, absl::Time deadline) {
  const uint64_t epoch = this->epoch();
  const FlatRange owned_unpadded = step_->owned_unpadded();
  const uint64_t off = owned_unpadded.begin - step_->owned().begin;
  uint64_t pos = owned_unpadded.begin;
  bool first = true;
  return options_.link->ForwardGradient(
      options_.peer_address, token,
      [&](v1::ForwardedGradientChunk* chunk) {
        if (pos == owned_unpadded.end) return false;
        chunk->Clear();
        chunk->set_job_id(config_.job_id);
        chunk->set_group(options_.group);
        chunk->set_epoch(epoch);
        chunk->set_step(prepared.step);
        if (first) {
          v1::PrepareStepResponse* result = chunk->mutable_prepared();
          result->set_grad_sq_sum(prepared.result.grad_sq_sum);
          result->set_found_inf_nan(prepared.result.found_inf_nan);
          result->set_elements(prepared.result.elements);
          result->set_loss_scale(prepared.result.loss_scale);
          result->set_backup_in_sync(prepared.result.backup_in_sync);
          chunk->mutable_no_grad_tensors()->Add(prepared.no_grad.begin(), prepared.no_grad.end());
        }
        first = false;
        const uint64_t end = std::min(owned_unpadded.end, pos + kReplicaChunkElements);
        chunk->mutable_range()->set_begin(pos);
        chunk->mutable_range()->set_end(end);
        std::string* data = chunk->mutable_data();
        data->resize((end - pos) * sizeof(float));
        // Frozen while prepared; the commit lock (held) keeps commits out.
        std::memcpy(data->data(), prepared.grad + off + (pos - owned_unpadded.begin),
                    data->size());
        chunk->set_crc32c(Crc32c(data->data(), data->size()));
        pos = end;
        return true;
      },
      deadline);
}

void ReplicaGroup::SendCommit(const CommitRequest& request, const std::string& token) {
  bool in_sync = false;
  uint64_t epoch = 0;
  {
    absl::MutexLock lock(&mu_);
    in_sync = in_sync_ && role_ == ReplicaRole::kPrimary;
    epoch = epoch_;
  }
  if (!in_sync || options_.link == nullptr) return;
  v1::CommitReplicaRequest forward;
  forward.set_job_id(config_.job_id);
  forward.set_group(options_.group);
  forward.set_epoch(epoch);
  v1::CommitStepRequest* commit = forward.mutable_commit();
  commit->set_job_id(config_.job_id);
  commit->set_step(request.step);
  commit->set_clip_coef(request.clip_coef);
  commit->set_skip(request.skip);
  commit->set_lr(request.lr);
  commit->set_grad_norm(request.grad_norm);
  commit->set_rank(request.rank);
  commit->set_incarnation(request.incarnation);
  commit->mutable_group_lrs()->Add(request.group_lrs.begin(), request.group_lrs.end());
  // No lock held: a stalled backup delays this commit's answer (up to the
  // replica timeout), never another request. Commits reach the backup in
  // step order: the leader commits step s + 1 only after this answer, and a
  // backup refuses a step it is not at.
  absl::Status s = options_.link->CommitReplica(options_.peer_address, token, forward,
                                                absl::Now() + options_.timeout);
  if (absl::IsAborted(s)) {
    absl::MutexLock commit_lock(&step_->commit_lock());
    StepDownLocked(s);
  } else if (!s.ok()) {
    MarkBackupStale(s);
  }
}

void ReplicaGroup::StepDownLocked(const absl::Status& why) {
  {
    absl::MutexLock lock(&mu_);
    if (role_ != ReplicaRole::kPrimary) return;
  }
  step_->Rebook(/*replica=*/true);
  uint64_t epoch = 0;
  {
    absl::MutexLock lock(&mu_);
    role_ = ReplicaRole::kBackup;
    in_sync_ = false;  // not a current copy until the new primary sends its state
    epoch = epoch_;
  }
  std::fprintf(stderr,
               "zeroshardd: job %s replica group %u: this primary (epoch %llu) was replaced: its "
               "backup answered %s; it steps down to a backup and serves nobody until the new "
               "primary copies its state here\n",
               config_.job_id.c_str(), options_.group, static_cast<unsigned long long>(epoch),
               std::string(why.message()).c_str());
}

// ---- The backup's side ----

absl::Status ReplicaGroup::RequireCurrentCopy() const {
  absl::MutexLock lock(&mu_);
  if (in_sync_) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("job ", config_.job_id, " replica group ", options_.group,
                   ": the backup here holds no current copy; transfer the state first"));
}

absl::StatusOr<v1::TransferStateResponse> ReplicaGroup::AcceptState(
    const v1::ReplicaStateChunk& first, absl::FunctionRef<bool(v1::ReplicaStateChunk*)> next,
    absl::Time deadline) {
  RETURN_IF_ERROR(CheckDrivenBy(first.epoch(), /*transfer=*/true));
  if (!first.has_state()) {
    return absl::InvalidArgumentError("state: the first chunk of a transfer carries the state");
  }
  const uint64_t n = step_->owned_unpadded().size();
  const std::vector<uint64_t> sizes = step_->TransferSizes();  // of each raw array
  const size_t arrays = sizes.size();
  uint64_t held_total = 0;
  for (uint64_t size : sizes) held_total += size;
  // Held, booked as buffer, until every chunk is in.
  CategoryBytes held_bytes{};
  held_bytes[static_cast<int>(MemoryCategory::kBuffer)] = held_total * sizeof(float);
  ASSIGN_OR_RETURN(const LedgerReservation booking,
                   LedgerReservation::Create(options_.ledger, config_.job_id, held_bytes));
  // Not zero-filled: every element is written by a chunk before it is read.
  std::vector<std::unique_ptr<float[]>> held;
  for (size_t a = 0; a < arrays; ++a) held.emplace_back(new float[sizes[a]]);
  uint64_t bytes = 0;
  if (first.has_bulk()) {
    if (!first.data().empty()) {
      return absl::InvalidArgumentError("data: a bulk transfer's chunk carries no data");
    }
    std::string refused;
    ASSIGN_OR_RETURN(bytes, PullState(options_.transport, first.bulk(), sizes, &held,
                                      absl::Now() + options_.timeout, deadline,
                                      &refused));
    v1::ReplicaStateChunk extra;
    if (next(&extra)) {
      return absl::InvalidArgumentError("a bulk transfer's stream carries one chunk, got more");
    }
    if (!refused.empty()) {  // nothing taken: the primary streams
      v1::TransferStateResponse out;
      out.set_bulk_refused(refused);
      return out;
    }
  }
  std::vector<uint64_t> filled(arrays, 0);
  if (first.has_bulk()) filled = sizes;
  v1::ReplicaStateChunk chunk = first;
  for (size_t i = 0; !first.has_bulk(); ++i) {
    const std::string where = absl::StrCat("chunk ", i);
    if (!chunk.job_id().empty() && chunk.job_id() != config_.job_id) {
      return absl::InvalidArgumentError(ForeignChunk(where, config_.job_id));
    }
    if (chunk.group() != options_.group || chunk.epoch() != first.epoch()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": group and epoch must be the first chunk's"));
    }
    if (chunk.array() >= arrays) {
      return absl::InvalidArgumentError(absl::StrCat(where, ".array: this job's state has ", arrays,
                                                     " arrays, got ", chunk.array()));
    }
    const uint64_t count = chunk.data().size() / sizeof(float);
    const uint64_t size = sizes[chunk.array()];
    if (chunk.data().size() % sizeof(float) != 0 || chunk.offset() != filled[chunk.array()] ||
        count > size - chunk.offset() || count > kReplicaChunkElements) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": ", chunk.data().size(), " bytes at offset ", chunk.offset(), " of array ",
          chunk.array(), " do not continue it (", filled[chunk.array()], " of ", size,
          " elements in, at most ", kReplicaChunkElements, " per chunk)"));
    }
    if (chunk.crc32c() != 0 && Crc32c(chunk.data().data(), chunk.data().size()) != chunk.crc32c()) {
      return absl::DataLossError(absl::StrCat(where, ": CRC-32C of the data does not match"));
    }
    std::memcpy(held[chunk.array()].get() + chunk.offset(), chunk.data().data(),
                chunk.data().size());
    filled[chunk.array()] += count;
    bytes += chunk.data().size();
    if (!next(&chunk)) break;
  }
  for (size_t a = 0; a < arrays; ++a) {
    if (filled[a] != sizes[a]) {
      return absl::InvalidArgumentError(absl::StrCat("the transfer ended with ", filled[a], " of ",
                                                     sizes[a], " elements of array ", a));
    }
  }
  std::vector<const float*> src;
  for (const std::unique_ptr<float[]>& a : held) src.push_back(a.get());
  const v1::TrainingState& state = first.state();
  {
    absl::MutexLock commit_lock(&step_->commit_lock());
    // Checked again: a promotion may have run meanwhile.
    RETURN_IF_ERROR(CheckDrivenBy(first.epoch(), /*transfer=*/true));
    // A primary replaced meanwhile becomes the backup: its bytes are booked
    // as replica from now on.
    if (role() == ReplicaRole::kPrimary) step_->Rebook(/*replica=*/true);
    const std::vector<v1::TensorStep> tensor_steps(state.tensor_steps().begin(),
                                                   state.tensor_steps().end());
    // In RAM (a replicated job's states never go to disk): cannot fail.
    step_->Restore(state, [&](ShardState& shard) {
      shard.RestoreRaw(step_->optimizer(), n, src.data(), state.optimizer_steps(), tensor_steps);
      return absl::OkStatus();
    }).IgnoreError();
    absl::MutexLock lock(&mu_);
    if (role_ == ReplicaRole::kPrimary) {
      // A daemon that was silent (stopped, hung, cut off) past its peers'
      // liveness timeout wakes to find its group promoted elsewhere.
      std::fprintf(stderr,
                   "zeroshardd: job %s replica group %u: this primary (epoch %llu) was replaced "
                   "by the primary at epoch %llu on %s (this daemon was silent or cut off); it "
                   "is the group's backup from now on, holding that primary's state\n",
                   config_.job_id.c_str(), options_.group, static_cast<unsigned long long>(epoch_),
                   static_cast<unsigned long long>(first.epoch()), options_.peer_address.c_str());
    }
    role_ = ReplicaRole::kBackup;
    epoch_ = first.epoch();
    in_sync_ = true;
    held_state_ = true;
    one_copy_since_.reset();
    peer_silent_ = false;
  }
  v1::TransferStateResponse out;
  out.set_committed_step(state.committed_step());
  out.set_bytes(bytes);
  return out;
}

absl::StatusOr<v1::ForwardGradientResponse> ReplicaGroup::AcceptGradient(
    const v1::ForwardedGradientChunk& first,
    absl::FunctionRef<bool(v1::ForwardedGradientChunk*)> next) {
  auto refuse = [&](absl::Status s) {
    absl::MutexLock lock(&mu_);
    in_sync_ = false;
    return s;
  };
  RETURN_IF_ERROR(CheckDrivenBy(first.epoch(), /*transfer=*/false));
  RETURN_IF_ERROR(RequireCurrentCopy());
  if (first.step() != step_->committed_step() + 1) {
    return refuse(absl::FailedPreconditionError(absl::StrCat(
        "step: the backup of job ", config_.job_id, " replica group ", options_.group,
        " is at committed step ", step_->committed_step(), ", got the gradient of step ",
        first.step())));
  }
  // The chunks land in a buffer of this copy's (allocated and booked once)
  // with no lock of the step engine held: a primary that stalls mid-stream
  // keeps no Promote (nor anything else) waiting. The copy's state changes
  // only once the whole forward is in and checked.
  const FlatRange owned_unpadded = step_->owned_unpadded();
  const uint64_t n = owned_unpadded.size();
  absl::MutexLock forward_lock(&forward_mu_);
  if (forward_buffer_.size() != n) {
    ASSIGN_OR_RETURN(forward_buffer_, LedgerArray<float>::Create(options_.ledger, config_.job_id,
                                                                 MemoryCategory::kBuffer, n));
  }
  v1::ForwardedGradientChunk chunk = first;
  uint64_t pos = owned_unpadded.begin;
  for (size_t i = 0;; ++i) {
    const std::string where = absl::StrCat("chunk ", i);
    const uint64_t begin = chunk.range().begin();
    const uint64_t end = chunk.range().end();
    if (!chunk.job_id().empty() && chunk.job_id() != config_.job_id) {
      return refuse(absl::InvalidArgumentError(ForeignChunk(where, config_.job_id)));
    }
    if (chunk.group() != options_.group || chunk.epoch() != first.epoch() ||
        chunk.step() != first.step()) {
      return refuse(absl::InvalidArgumentError(
          absl::StrCat(where, ": group, epoch and step must be the first chunk's")));
    }
    if (begin != pos || end <= begin || end > owned_unpadded.end ||
        end - begin > kReplicaChunkElements ||
        chunk.data().size() != (end - begin) * sizeof(float)) {
      return refuse(absl::InvalidArgumentError(
          absl::StrCat(where, ".range [", begin, ", ", end, ") with ", chunk.data().size(),
                       " bytes does not continue the group's range at ", pos, " (ends at ",
                       owned_unpadded.end, ")")));
    }
    if (chunk.crc32c() != 0 && Crc32c(chunk.data().data(), chunk.data().size()) != chunk.crc32c()) {
      return refuse(
          absl::DataLossError(absl::StrCat(where, ": CRC-32C of the data does not match")));
    }
    std::memcpy(forward_buffer_.data() + (begin - owned_unpadded.begin), chunk.data().data(),
                chunk.data().size());
    pos = end;
    if (!next(&chunk)) break;
  }
  if (pos != owned_unpadded.end) {
    return refuse(absl::InvalidArgumentError(absl::StrCat("the forward ended at element ", pos,
                                                          " of the group's range ending at ",
                                                          owned_unpadded.end)));
  }
  for (int i = 0; i < first.no_grad_tensors_size(); ++i) {
    const uint32_t t = first.no_grad_tensors(i);
    if (step_->tensors().Find(t) < 0 || (i > 0 && t <= first.no_grad_tensors(i - 1))) {
      return refuse(absl::InvalidArgumentError(
          absl::StrCat("no_grad_tensors[", i, "]: ", t, " is not ascending or not a tensor of ",
                       "replica group ", options_.group)));
    }
  }
  {
    absl::MutexLock commit_lock(&step_->commit_lock());
    // Checked again: a promotion or a transfer may have run meanwhile.
    RETURN_IF_ERROR(CheckDrivenBy(first.epoch(), /*transfer=*/false));
    RETURN_IF_ERROR(RequireCurrentCopy());
    PrepareResult result;
    result.grad_sq_sum = first.prepared().grad_sq_sum();
    result.found_inf_nan = first.prepared().found_inf_nan();
    result.elements = first.prepared().elements();
    result.loss_scale = first.prepared().loss_scale();
    result.backup_in_sync = first.prepared().backup_in_sync();
    if (absl::Status s = step_->TakeForwardedStep(
            first.step(), forward_buffer_.data(), result,
            std::vector<uint32_t>(first.no_grad_tensors().begin(),
                                  first.no_grad_tensors().end()));
        !s.ok()) {
      return refuse(s);
    }
  }
  v1::ForwardGradientResponse out;
  out.set_elements(n);
  return out;
}

absl::StatusOr<v1::CommitStepResponse> ReplicaGroup::CommitReplica(const v1::CommitReplicaRequest& r) {
  CommitRequest commit;
  commit.step = r.commit().step();
  commit.clip_coef = r.commit().clip_coef();
  commit.skip = r.commit().skip();
  commit.lr = r.commit().lr();
  commit.grad_norm = r.commit().grad_norm();
  commit.rank = r.commit().rank();
  commit.incarnation = r.commit().incarnation();
  commit.group_lrs.assign(r.commit().group_lrs().begin(), r.commit().group_lrs().end());
  ASSIGN_OR_RETURN(const float clip, step_->CheckCommitFields(commit, "commit."));
  absl::MutexLock commit_lock(&step_->commit_lock());
  RETURN_IF_ERROR(CheckDrivenBy(r.epoch(), /*transfer=*/false));
  RETURN_IF_ERROR(RequireCurrentCopy());
  absl::StatusOr<CommitResult> done = step_->CommitLocked(commit, clip);
  if (!done.ok()) {
    absl::MutexLock lock(&mu_);
    in_sync_ = false;
    return done.status();
  }
  v1::CommitStepResponse out;
  out.set_committed_step(done->committed_step);
  out.set_loss_scale(done->loss_scale);
  out.set_skipped(done->skipped);
  return out;
}

}  // namespace zeroshard

