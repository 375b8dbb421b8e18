#include "client/bulk_data_path.h"

#include <poll.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <map>
#include <numeric>
#include <tuple>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "client/rpc.h"
#include "common/protocol.h"
#include "common/status_macros.h"
#include "transport/piece_plan.h"

namespace zeroshard {
namespace {

transport::RegionDescriptor ToDescriptor(const v1::RemoteRegion& r) {
  transport::RegionDescriptor d;
  d.address = r.address();
  d.length = r.length();
  d.rkey = r.rkey();
  return d;
}

// An answer after which the cached endpoint cannot be trusted: the daemon
// went away, lost the job (a restart), or no longer has this rank's staging
// region.
bool LostDaemonOrJob(const absl::Status& s) {
  return absl::IsUnavailable(s) || absl::IsNotFound(s) || absl::IsFailedPrecondition(s);
}

// A transport operation's failure that says its connection is gone: the
// peer failed (Unavailable), or the connection was closed (Cancelled: UCX
// closes a connection with peer error handling to stop an operation aborted
// at its deadline, and the other operations on it fail so). The endpoint is
// dropped and the call tried once more on a fresh one. (The aborted
// operation itself ends DeadlineExceeded, BulkDataPath::Finish.)
bool ConnectionGone(const absl::Status& s) {
  return absl::IsUnavailable(s) || absl::IsCancelled(s);
}

// Folds the status of one of several operations of a call into the call's:
// the first failure, unless a later one says its connection is gone (the
// call is then tried again on a fresh endpoint) and none ran out of time
// (the aborted one's own connection may have been closed to stop it, which
// fails those after it Cancelled: the call timed out).
void FoldStatus(absl::Status* call, absl::Status op) {
  if (call->ok() ||
      (ConnectionGone(op) && !ConnectionGone(*call) && !absl::IsDeadlineExceeded(*call))) {
    *call = std::move(op);
  }
}

std::vector<StagingSlots::PushKey> KeysOf(absl::Span<const GradientPush> pushes) {
  std::vector<StagingSlots::PushKey> keys;
  for (const GradientPush& p : pushes) keys.push_back({p.step, p.micro_batch, p.range});
  return keys;
}

// A region access (PutRegion / GetRegion) of at least twice this many bytes
// is split over the endpoint's connections: parts of about equal length
// (each but the last a whole number of pages), as many as there are
// connections and at most one per this many bytes.
constexpr uint64_t kRegionPartBytes = 1 << 20;
constexpr uint64_t kPageBytes = 4096;

}  // namespace

absl::StatusOr<std::shared_ptr<BulkTransport>> BulkTransport::Create(
    const std::string& name, const transport::BackendOptions& options) {
  // The name first: nothing is created for one that is no bulk transport.
  RETURN_IF_ERROR(TransportKindFromName(name, "ClientConfig.transport").status());
  ASSIGN_OR_RETURN(std::unique_ptr<transport::Transport> t,
                   transport::CreateTransport(name, options),
                   "ClientConfig.transport \"", name, "\"");
  return Of(std::move(t));
}

absl::StatusOr<std::shared_ptr<BulkTransport>> BulkTransport::Of(
    std::unique_ptr<transport::Transport> transport) {
  ASSIGN_OR_RETURN(v1::TransportKind kind,
                   TransportKindFromName(transport->kind(), "the transport's kind"));
  return std::shared_ptr<BulkTransport>(new BulkTransport(kind, std::move(transport)));
}

absl::StatusOr<std::vector<std::unique_ptr<transport::Connection>>> BulkTransport::ConnectAll(
    const std::string& peer_address, int n, absl::Time deadline) {
  std::vector<std::unique_ptr<transport::Connection>> connections;
  absl::MutexLock lock(&connect_mu_);
  for (int i = 0; i < n; ++i) {
    ASSIGN_OR_RETURN(std::unique_ptr<transport::Connection> c,
                     transport_->Connect(peer_address, deadline));
    connections.push_back(std::move(c));
  }
  return connections;
}

struct BulkDataPath::Endpoint {
  JobKey key;
  // connections[0] carries the pushes' Puts; Gets and the parts of region
  // accesses take each in turn.
  std::vector<std::unique_ptr<transport::Connection>> connections;
  mutable std::atomic<size_t> next_connection{0};
  transport::RegionDescriptor staging;
  uint32_t slots = 0;
  uint64_t slot_bytes = 0;
  // No master region: a half-precision job whose masters are on the
  // daemon's --state_dir; fp32 gathers then go over the streaming path.
  bool has_master = false;
  transport::RegionDescriptor master;
  FlatRange master_range;
  bool has_half = false;
  transport::RegionDescriptor half;
  FlatRange half_range;
  // How long after a wait_only Gather its Gets may run.
  absl::Duration read_lease = absl::InfiniteDuration();
  // The newest step wait_only Gathers on this endpoint confirmed committed
  // for `confirmed_dtype`, the end of the latest such answer's read lease,
  // the highest range end the daemon accepted (its parameters end there or
  // later; the region may hold padding past them), and the bytes read under
  // those answers without asking that no request has reported yet
  // (GatherRequest / LeaveRequest.unreported_read_bytes).
  mutable absl::Mutex confirmed_mu;
  mutable uint64_t confirmed_step ABSL_GUARDED_BY(confirmed_mu) = 0;
  mutable DType confirmed_dtype ABSL_GUARDED_BY(confirmed_mu) = DType::kFp32;
  mutable absl::Time confirmed_until ABSL_GUARDED_BY(confirmed_mu) = absl::InfinitePast();
  mutable uint64_t accepted_end ABSL_GUARDED_BY(confirmed_mu) = 0;
  mutable uint64_t unreported_reads ABSL_GUARDED_BY(confirmed_mu) = 0;

  // The lease end under which a Get of `dtype` parameters committed after
  // `after_step`, ending at `end`, may run without asking again: the daemon
  // grants a lease (finite, > 0), the step is no newer than the confirmed
  // one, the daemon has accepted a range ending at `end` or later, and at
  // least half of the lease is left. InfinitePast: ask.
  absl::Time ConfirmedLeaseFor(uint64_t after_step, DType dtype, uint64_t end) const {
    if (read_lease <= absl::ZeroDuration() || read_lease == absl::InfiniteDuration()) {
      return absl::InfinitePast();
    }
    absl::MutexLock lock(&confirmed_mu);
    if (after_step > confirmed_step || dtype != confirmed_dtype || end > accepted_end ||
        absl::Now() + read_lease / 2 > confirmed_until) {
      return absl::InfinitePast();
    }
    return confirmed_until;
  }
  // An answer to a wait_only Gather of (step, dtype) for a range ending at
  // `end` whose lease ends at `lease_end`.
  void Confirm(uint64_t step, DType dtype, uint64_t end, absl::Time lease_end) const {
    absl::MutexLock lock(&confirmed_mu);
    accepted_end = std::max(accepted_end, end);
    if (dtype != confirmed_dtype) {
      confirmed_dtype = dtype;
      confirmed_step = step;
      confirmed_until = lease_end;
      return;
    }
    confirmed_step = std::max(confirmed_step, step);
    confirmed_until = std::max(confirmed_until, lease_end);
  }
  void AddUnreported(uint64_t bytes) const {
    absl::MutexLock lock(&confirmed_mu);
    unreported_reads += bytes;
  }
  // At most kMaxUnreportedReadBytes; the rest waits for the next report.
  uint64_t TakeUnreported() const {
    absl::MutexLock lock(&confirmed_mu);
    const uint64_t taken = std::min(unreported_reads, kMaxUnreportedReadBytes);
    unreported_reads -= taken;
    return taken;
  }
  uint64_t Unreported() const {
    absl::MutexLock lock(&confirmed_mu);
    return unreported_reads;
  }
  // Regions of other purposes (e.g. the activation arena), for PutRegion /
  // GetRegion.
  std::vector<std::pair<v1::RegionPurpose, transport::RegionDescriptor>> others;
  // Push memories by PushMemories serial: the daemon's id for it, 0 when the
  // daemon could not map it (its pushes are Put).
  mutable absl::Mutex pull_mu;
  mutable std::map<uint64_t, uint32_t> pull_ids ABSL_GUARDED_BY(pull_mu);
  mutable int64_t daemon_pid ABSL_GUARDED_BY(pull_mu) = 0;  // from MapPushMemory
  mutable bool pull_refusal_printed ABSL_GUARDED_BY(pull_mu) = false;

  // What the daemon answered for push memory `serial`: its id (0: refused)
  // and the daemon's pid; nullopt while it has not been asked.
  std::optional<std::pair<uint32_t, int64_t>> PullId(uint64_t serial) const {
    absl::MutexLock lock(&pull_mu);
    auto it = pull_ids.find(serial);
    if (it == pull_ids.end()) return std::nullopt;
    return std::make_pair(it->second, daemon_pid);
  }

  // The index of the connection for the next Get or region part, in turn.
  size_t NextConnection() const {
    return next_connection.fetch_add(1, std::memory_order_relaxed) % connections.size();
  }

  const transport::RegionDescriptor* Other(v1::RegionPurpose purpose) const {
    for (const auto& [p, d] : others) {
      if (p == purpose) return &d;
    }
    return nullptr;
  }
};

BulkDataPath::BulkDataPath(std::string address, std::shared_ptr<grpc::Channel> channel,
                           std::shared_ptr<BulkTransport> transport, Options options)
    : transport_(std::move(transport)),
      stream_(std::move(address), std::move(channel)),
      options_(options),
      slots_(stream_.address()) {}

BulkDataPath::~BulkDataPath() = default;

const char* BulkDataPath::name() const {
  return TransportKindName(transport_->kind()).data();  // literals: NUL-terminated
}

absl::StatusOr<std::shared_ptr<const BulkDataPath::Endpoint>> BulkDataPath::GetEndpoint(
    const JobKey& key, absl::Time deadline) {
  {
    absl::MutexLock lock(&mu_);
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !exchanging_; };
    if (!mu_.AwaitWithDeadline(absl::Condition(&idle), deadline)) {
      return absl::DeadlineExceededError(absl::StrCat(
          "daemon ", address(), ": ExchangeEndpoint by another thread still running"));
    }
    if (endpoint_ != nullptr) {
      const JobKey& have = endpoint_->key;
      if (have.job_id != key.job_id || have.rank != key.rank ||
          have.incarnation != key.incarnation) {
        return absl::InvalidArgumentError(absl::StrCat(
            "this data path serves job ", have.job_id, " rank ", have.rank, " incarnation ",
            have.incarnation, ", got job ", key.job_id, " rank ", key.rank, " incarnation ",
            key.incarnation));
      }
      return endpoint_;
    }
    exchanging_ = true;
  }
  absl::StatusOr<std::shared_ptr<const Endpoint>> ep = Exchange(key, deadline);
  absl::MutexLock lock(&mu_);
  exchanging_ = false;
  if (ep.ok()) endpoint_ = *ep;
  return ep;
}

absl::Status BulkDataPath::ParseEndpoint(const v1::ExchangeEndpointResponse& resp,
                                         Endpoint* ep) const {
  auto bad = [&](absl::string_view what) {
    return absl::DataLossError(
        absl::StrCat("daemon ", address(), ": ExchangeEndpoint: ", what));
  };
  if (resp.transport() != transport_->kind()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "daemon ", address(), " serves bulk transport ", TransportKindName(resp.transport()),
        ", this client uses ", TransportKindName(transport_->kind())));
  }
  bool has_staging = false;
  for (const v1::RemoteRegion& r : resp.regions()) {
    const FlatRange range{r.range().begin(), r.range().end()};
    switch (r.purpose()) {
      case v1::REGION_PURPOSE_GRAD_STAGING:
        ep->staging = ToDescriptor(r);
        has_staging = true;
        break;
      case v1::REGION_PURPOSE_PARAM_MASTER:
        ep->master = ToDescriptor(r);
        ep->master_range = range;
        ep->has_master = r.length() >= range.size() * sizeof(float);
        break;
      case v1::REGION_PURPOSE_PARAM_HALF:
        ep->half = ToDescriptor(r);
        ep->half_range = range;
        ep->has_half = r.length() >= range.size() * sizeof(uint16_t);
        break;
      default:
        // Served to callers of PutRegion / GetRegion; the first of a purpose
        // counts.
        if (r.purpose() != v1::REGION_PURPOSE_UNSPECIFIED && ep->Other(r.purpose()) == nullptr) {
          ep->others.emplace_back(r.purpose(), ToDescriptor(r));
        }
        break;
    }
  }
  if (!has_staging || (!ep->has_master && !ep->has_half)) {
    return bad(
        "the reply lacks a GRAD_STAGING or a well-formed PARAM_MASTER or PARAM_HALF region");
  }
  const uint64_t slots = resp.staging_slots(), slot_bytes = resp.staging_slot_bytes();
  if (slots < 1 || slot_bytes < 1 || slot_bytes > ep->staging.length / slots) {
    return bad(absl::StrCat(slots, " staging slots of ", slot_bytes, " bytes do not fit the ",
                            ep->staging.length, "-byte GRAD_STAGING region"));
  }
  ep->slots = static_cast<uint32_t>(slots);
  ep->slot_bytes = slot_bytes;
  if (resp.read_lease_ms() > 0) ep->read_lease = absl::Milliseconds(resp.read_lease_ms());
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const BulkDataPath::Endpoint>> BulkDataPath::Exchange(
    const JobKey& key, absl::Time deadline) {
  v1::ExchangeEndpointRequest req;
  req.set_job_id(key.job_id);
  req.set_rank(key.rank);
  req.set_incarnation(key.incarnation);
  req.set_transport(transport_->kind());
  req.set_worker_address(transport_->local_address());
  v1::ExchangeEndpointResponse resp;
  grpc::ClientContext context;
  SetDeadline(&context, deadline);
  const grpc::Status status = stream_.stub()->ExchangeEndpoint(&context, req, &resp);
  if (!status.ok()) return DaemonError(status, address(), "ExchangeEndpoint");
  auto ep = std::make_shared<Endpoint>();
  ep->key = key;
  RETURN_IF_ERROR(ParseEndpoint(resp, ep.get()));
  ASSIGN_OR_RETURN(ep->connections,
                   transport_->ConnectAll(resp.worker_address(), std::max(1, options_.connections),
                                          deadline),
                   "daemon ", address(), ": ", TransportKindName(transport_->kind()), " connect");
  slots_.SetCount(ep->slots);
  exchanges_.fetch_add(1);
  return std::shared_ptr<const Endpoint>(std::move(ep));
}

void BulkDataPath::DropEndpoint(const Endpoint* stale) {
  absl::MutexLock lock(&mu_);
  if (endpoint_.get() == stale) endpoint_.reset();
}

absl::Status BulkDataPath::Finish(transport::Completion& completion, absl::Time deadline,
                                  absl::FunctionRef<std::string()> what) {
  absl::Status s = completion.Wait(deadline);
  if (absl::IsDeadlineExceeded(s)) {
    completion.Abort();
    // The caller's buffer (a staging buffer, or a trainer's borrowed
    // gradients) is in use until the transport lets go of it, which an
    // aborted operation does promptly; returning earlier would let the
    // caller free memory the transport still reads or writes.
    while (absl::IsDeadlineExceeded(
        completion.Wait(absl::Now() + transport::Completion::kDestroyWait))) {
      std::fprintf(stderr,
                   "zeroshard client: daemon %s: %s: the transport still holds the buffer "
                   "after an abort; waiting\n",
                   address().c_str(), what().c_str());
    }
  }
  if (s.ok()) return s;
  return absl::Status(s.code(),
                      absl::StrCat("daemon ", address(), ": ", what(), ": ", s.message()));
}

absl::Status BulkDataPath::FinishAll(absl::Span<transport::Completion> operations,
                                     absl::Time deadline,
                                     absl::FunctionRef<std::string()> what) {
  absl::Status s;
  for (transport::Completion& op : operations) FoldStatus(&s, Finish(op, deadline, what));
  return s;
}

absl::StatusOr<uint64_t> BulkDataPath::FenceSlot(const GradientPush& push, uint32_t slot,
                                                 uint64_t generation, absl::Time until) {
  v1::FenceStagingSlotRequest req;
  req.set_job_id(push.job_id);
  req.set_rank(push.rank);
  req.set_incarnation(push.incarnation);
  req.set_slot(slot);
  req.set_generation(generation);
  v1::FenceStagingSlotResponse resp;
  grpc::ClientContext context;
  SetDeadline(&context, std::min(until, absl::Now() + options_.fence_timeout));
  const grpc::Status status = stream_.stub()->FenceStagingSlot(&context, req, &resp);
  if (!status.ok()) {
    return DaemonError(status, address(),
                       absl::StrCat("FenceStagingSlot slot ", slot, " generation ", generation));
  }
  return resp.applied_generation();
}

std::optional<PushMemories::Found> BulkDataPath::FindPullable(const void* data, uint64_t bytes,
                                                             uint64_t align) const {
  if (options_.push_memories == nullptr || bytes == 0 || bytes > kMaxChunkBytes) {
    return std::nullopt;
  }
  std::optional<PushMemories::Found> found = options_.push_memories->Find(data, bytes);
  if (!found.has_value() || found->offset % align != 0) return std::nullopt;
  return found;
}

DataPath::PullMemory BulkDataPath::PullMemoryOf(const void* data, uint64_t bytes) const {
  // As PlanPull takes it (at an offset any element size divides), once the
  // daemon has mapped that memory for the current endpoint: a batch
  // PlanPull would not pull is never larger than a slot.
  std::optional<PushMemories::Found> found = FindPullable(data, bytes, sizeof(float));
  if (!found.has_value()) return {};
  std::shared_ptr<const Endpoint> ep;
  {
    absl::MutexLock lock(&mu_);
    ep = endpoint_;
  }
  if (ep == nullptr) return {};
  const std::optional<std::pair<uint32_t, int64_t>> id = ep->PullId(found->serial);
  if (!id.has_value() || id->first == 0) return {};
  return {found->serial, reinterpret_cast<uintptr_t>(found->memory->data()),
          found->memory->size()};
}

BulkDataPath::Pull BulkDataPath::PlanPull(const Endpoint& ep,
                                          absl::Span<const GradientPush> pushes,
                                          absl::Time deadline) {
  Pull pull;
  if (options_.push_memories == nullptr || pushes.empty()) return pull;
  uint64_t serial = 0;
  for (const GradientPush& push : pushes) {
    // The daemon takes offsets that are multiples of the element size.
    std::optional<PushMemories::Found> found =
        FindPullable(push.data, PushBytes(push), DTypeSize(push.dtype));
    if (!found.has_value() || (serial != 0 && found->serial != serial)) return Pull{};
    serial = found->serial;
    pull.memory = std::move(found->memory);
    pull.offsets.push_back(found->offset);
  }
  if (const std::optional<std::pair<uint32_t, int64_t>> id = ep.PullId(serial); id.has_value()) {
    if (id->first == 0) return Pull{};
    std::tie(pull.id, pull.daemon_pid) = *id;
    return pull;
  }
  // Asked once per endpoint; two threads may both ask, and the daemon
  // answers the same id to both (it maps a name once).
  const GradientPush& first = pushes.front();
  v1::MapPushMemoryRequest req;
  req.set_job_id(first.job_id);
  req.set_rank(first.rank);
  req.set_incarnation(first.incarnation);
  req.set_pid(pull.memory->pid());
  req.set_fd(pull.memory->fd());
  req.set_name(pull.memory->name());
  req.set_bytes(pull.memory->size());
  v1::MapPushMemoryResponse resp;
  grpc::ClientContext context;
  // Its own bound: a push that cannot be pulled is still Put in time.
  SetDeadline(&context, std::min(deadline, absl::Now() + absl::Seconds(5)));
  const grpc::Status status = stream_.stub()->MapPushMemory(&context, req, &resp);
  absl::MutexLock lock(&ep.pull_mu);
  if (status.ok() && resp.id() != 0) {
    ep.pull_ids[serial] = pull.id = resp.id();
    ep.daemon_pid = pull.daemon_pid = resp.daemon_pid();
    return pull;
  }
  const absl::Status s = status.ok() ? absl::DataLossError("MapPushMemory answered id 0")
                                     : DaemonError(status, address(), "MapPushMemory");
  // A refusal stays for this endpoint; a lost call is asked again next time.
  if (!absl::IsUnavailable(s) && !absl::IsDeadlineExceeded(s) && !absl::IsCancelled(s)) {
    ep.pull_ids[serial] = 0;
    if (!ep.pull_refusal_printed) {
      ep.pull_refusal_printed = true;
      std::fprintf(stderr,
                   "zeroshard client: daemon %s does not read this rank's push memory in place "
                   "(%s); its gradients are put into the staging slots\n",
                   address().c_str(), std::string(s.message()).c_str());
    }
  }
  return Pull{};
}

bool BulkDataPath::PushStaged(const Endpoint& ep, absl::Span<const GradientPush> pushes,
                              const Pull& pull, absl::Time deadline,
                              std::vector<absl::StatusOr<uint64_t>>* results) {
  auto fence = [&](uint32_t slot, uint64_t generation) {
    return FenceSlot(pushes.front(), slot, generation);
  };
  const std::vector<StagingSlots::PushKey> keys = KeysOf(pushes);
  absl::StatusOr<StagingSlots::Acquired> acquired = slots_.Acquire(keys, deadline, fence);
  if (!acquired.ok()) {
    for (size_t i = 0; i < pushes.size(); ++i) (*results)[i] = acquired.status();
    return false;
  }
  // What earlier attempts delivered is not sent again.
  std::vector<size_t> send;
  for (size_t i = 0; i < pushes.size(); ++i) {
    if (acquired->applied[i]) {
      (*results)[i] = PushBytes(pushes[i]);
    } else {
      send.push_back(i);
    }
  }
  if (acquired->delivered) return false;
  const StagingSlots::Lease lease = acquired->lease;
  std::vector<GradientPush> sent;
  std::vector<StagingSlots::PushKey> sent_keys;
  std::vector<uint64_t> sent_offsets;
  for (size_t i : send) {
    sent.push_back(pushes[i]);
    sent_keys.push_back(keys[i]);
    if (pull.id != 0) sent_offsets.push_back(pull.offsets[i]);
  }
  auto finish = [&](const absl::Status& s) {
    for (size_t i : send)
      (*results)[i] = s.ok() ? absl::StatusOr<uint64_t>(PushBytes(pushes[i])) : s;
  };
  absl::Status s;
  if (pull.id == 0) {
    // Back to back from the slot's start, in order; all in flight at once.
    std::vector<transport::Completion> puts;
    puts.reserve(sent.size());
    uint64_t at = uint64_t{lease.slot} * ep.slot_bytes;
    for (const GradientPush& push : sent) {
      puts.push_back(ep.connections[0]->Put(push.data, PushBytes(push), ep.staging, at));
      at += PushBytes(push);
    }
    s = FinishAll(absl::MakeSpan(puts), deadline,
                  [&] { return DescribePushes(sent) + ": Put"; });
  }
  if (!s.ok()) {
    // Nothing announced: the daemon applies no bytes of this generation.
    slots_.Release(lease);
    const bool lost = ConnectionGone(s);
    if (lost) DropEndpoint(&ep);
    finish(s);
    return lost;
  }
  // No checksum: the transport delivers the bytes intact, and a CRC pass on
  // each side would cost two more sweeps over the gradient. The generation
  // tells the daemon which write of the slot this is.
  s = SendGradientChunks(
      stream_.stub(), sent,
      [&](size_t i, v1::GradientChunk* chunk) {
        *chunk = GradientChunkHeader(sent[i]);
        chunk->set_staged(true);
        chunk->set_staging_slot(lease.slot);
        chunk->set_staging_generation(lease.generation);
        if (pull.id != 0) {
          chunk->set_push_memory(pull.id);
          chunk->set_push_memory_offset(sent_offsets[i]);
        }
      },
      deadline, address());
  // ALREADY_EXISTS: the daemon holds this contribution (the staged bytes have
  // its CRC-32C, or this process replays the open step of a predecessor
  // whose staged push it holds); this generation was not applied. For
  // several chunks, it holds one of them and applied none: the caller sends
  // each alone.
  if (s.ok() || absl::IsAlreadyExists(s)) {
    slots_.Release(lease);
    finish(s.ok() || sent.size() == 1 ? absl::OkStatus() : s);
    return false;
  }
  // The daemon may still be about to read the slot, or may have applied it:
  // fence it before the slot is written again, and learn which.
  absl::StatusOr<bool> applied = slots_.Resolve(lease, sent_keys, fence);
  if (!applied.ok() && pull.id != 0) {
    // The bytes are in the caller's memory, which the quarantined slot does
    // not keep from being reused: wait for a fence, or for the daemon's
    // reads to have ended (it reads a pulled push only before its deadline).
    applied = AwaitPulledFence(sent.front(), pull, lease, deadline, applied.status());
  }
  if (LostDaemonOrJob(s)) DropEndpoint(&ep);
  finish(applied.ok() && *applied ? absl::OkStatus() : s);
  return false;
}

absl::StatusOr<bool> BulkDataPath::AwaitPulledFence(const GradientPush& push, const Pull& pull,
                                                    const StagingSlots::Lease& lease,
                                                    absl::Time deadline, absl::Status failed) {
  // Readable once the daemon's process has exited (a killed daemon).
  int daemon = -1;
  if (pull.daemon_pid > 0 && pull.daemon_pid <= INT32_MAX) {
    daemon = static_cast<int>(::syscall(SYS_pidfd_open, static_cast<pid_t>(pull.daemon_pid), 0));
    if (daemon < 0 && errno == ESRCH) return failed;  // already gone
  }
  absl::Cleanup close_daemon = [daemon] {
    if (daemon >= 0) ::close(daemon);
  };
  const absl::Time give_up = deadline + options_.fence_timeout;
  while (absl::Now() < give_up) {
    const int wait_ms = static_cast<int>(
        absl::ToInt64Milliseconds(std::min(absl::Seconds(1), give_up - absl::Now())));
    if (daemon >= 0) {
      pollfd exited{daemon, POLLIN, 0};
      if (::poll(&exited, 1, wait_ms) > 0) break;
    } else {
      absl::SleepFor(absl::Milliseconds(wait_ms));
    }
    absl::StatusOr<uint64_t> applied = FenceSlot(push, lease.slot, lease.generation, give_up);
    if (applied.ok()) return *applied == lease.generation;
    failed = applied.status();
  }
  return failed;
}

absl::StatusOr<uint64_t> BulkDataPath::PushGradient(const GradientPush& push,
                                                    absl::Time deadline) {
  return PushGradients({push}, deadline)[0];
}

std::vector<absl::StatusOr<uint64_t>> BulkDataPath::PushGradients(
    const std::vector<GradientPush>& pushes, absl::Time deadline) {
  std::vector<absl::StatusOr<uint64_t>> results(pushes.size(),
                                                absl::InternalError("push not attempted"));
  // One slot carries pushes of one rank process and step (the contract of a
  // DataPath's PushGradients, checked here: others go one by one).
  const bool together = std::all_of(pushes.begin(), pushes.end(), [&](const GradientPush& p) {
    return p.job_id == pushes[0].job_id && p.rank == pushes[0].rank &&
           p.incarnation == pushes[0].incarnation && p.step == pushes[0].step &&
           p.dtype == pushes[0].dtype;
  });
  if (pushes.size() > 1 && !together) {
    for (size_t i = 0; i < pushes.size(); ++i) results[i] = PushGradient(pushes[i], deadline);
    return results;
  }
  std::vector<size_t> todo(pushes.size());
  std::iota(todo.begin(), todo.end(), 0);
  for (int attempt = 0; !todo.empty(); ++attempt) {
    std::vector<GradientPush> batch;
    uint64_t bytes = 0;
    for (size_t i : todo) {
      batch.push_back(pushes[i]);
      bytes += PushBytes(pushes[i]);
    }
    absl::StatusOr<std::shared_ptr<const Endpoint>> ep =
        GetEndpoint({batch[0].job_id, batch[0].rank, batch[0].incarnation}, deadline);
    if (!ep.ok()) {
      for (size_t i : todo) results[i] = ep.status();
      break;
    }
    const Pull pull = PlanPull(**ep, batch, deadline);
    if (pull.id == 0 && bytes > (*ep)->slot_bytes) {
      // More than a slot: one by one, and a push larger than a slot alone (a
      // bucket wider in fp32 than in the wire type) inline.
      for (size_t i : todo) {
        results[i] = batch.size() == 1 ? stream_.PushGradient(pushes[i], deadline)
                                       : PushGradient(pushes[i], deadline);
      }
      break;
    }
    std::vector<absl::StatusOr<uint64_t>> got(batch.size());
    const bool retry = PushStaged(**ep, batch, pull, deadline, &got);
    std::vector<size_t> failed;
    bool held_elsewhere = false;
    for (size_t k = 0; k < todo.size(); ++k) {
      results[todo[k]] = got[k];
      if (!got[k].ok()) failed.push_back(todo[k]);
      held_elsewhere = held_elsewhere || absl::IsAlreadyExists(got[k].status());
    }
    if (held_elsewhere) {
      // The daemon holds one of them and applied none: each alone shows which.
      for (size_t i : failed) results[i] = PushGradient(pushes[i], deadline);
      break;
    }
    if (!retry || attempt > 0 || absl::Now() >= deadline) break;
    todo = std::move(failed);
  }
  return results;
}

absl::StatusOr<uint64_t> BulkDataPath::InitParameters(const ParameterUpload& upload,
                                                      absl::Time deadline) {
  return stream_.InitParameters(upload, deadline);
}

BulkDataPath::Attempt BulkDataPath::GetOnce(const Endpoint& ep, const GatherRequestSpec& request,
                                            void* dst, absl::Time deadline) {
  // Fp32 comes from the masters; the job's half precision from its copy.
  const bool half = request.dtype != DType::kFp32;
  // Parameters of a step (and dtype) this endpoint's daemon has confirmed
  // committed are read without asking again while half of that answer's
  // lease is left (shard.proto, read_lease_ms), and those reads are
  // reported with the next request that asks. Else the daemon validates the
  // request and waits for the commit.
  absl::Time lease_end = absl::InfinitePast();
  if (!request.range.empty() && (!half || ep.has_half) &&
      (half ? ep.half_range : ep.master_range).Contains(request.range)) {
    lease_end = ep.ConfirmedLeaseFor(request.after_step, request.dtype, request.range.end);
  }
  const bool asked = lease_end == absl::InfinitePast();
  if (asked) {
    const uint64_t report = ep.TakeUnreported();
    if (absl::Status s = stream_.AwaitCommitted(request, deadline, report); !s.ok()) {
      ep.AddUnreported(report);  // not counted by the daemon (unless only the answer was lost)
      if (LostDaemonOrJob(s)) DropEndpoint(&ep);
      return {s};
    }
    // The regions stay readable for the read lease after that answer.
    lease_end = absl::Now() + ep.read_lease;
    ep.Confirm(request.after_step, request.dtype, request.range.end, lease_end);
  }
  if (half && !ep.has_half) {
    return {absl::InvalidArgumentError(absl::StrCat("daemon ", address(), ": ",
                                                    DescribeGather(request), ": dtype ",
                                                    DTypeName(request.dtype),
                                                    " is not served by this job"))};
  }
  const transport::RegionDescriptor& region = half ? ep.half : ep.master;
  const FlatRange& held = half ? ep.half_range : ep.master_range;
  if (!held.Contains(request.range)) {
    return {absl::DataLossError(absl::StrCat("daemon ", address(), ": ", DescribeGather(request),
                                             ": outside the region's range [", held.begin, ", ",
                                             held.end, ")"))};
  }
  const size_t esize = DTypeSize(request.dtype);
  const uint64_t bytes = request.range.size() * esize;
  transport::Connection& connection = *ep.connections[ep.NextConnection()];
  transport::Completion get =
      connection.Get(dst, bytes, region, (request.range.begin - held.begin) * esize);
  absl::Status s = Finish(get, std::min(deadline, lease_end),
                          [&] { return DescribeGather(request) + ": Get"; });
  if (s.ok()) {
    if (!asked) ep.AddUnreported(bytes);
    return {bytes};
  }
  const bool lost = ConnectionGone(s);
  if (lost) DropEndpoint(&ep);
  return {s, lost};
}

absl::StatusOr<uint64_t> BulkDataPath::Gather(const GatherRequestSpec& request, void* dst,
                                              absl::Time deadline) {
  const JobKey key{request.job_id, request.rank, request.incarnation};
  for (int attempt = 0;; ++attempt) {
    ASSIGN_OR_RETURN(std::shared_ptr<const Endpoint> ep, GetEndpoint(key, deadline));
    if (request.dtype == DType::kFp32 && !ep->has_master) {
      return stream_.Gather(request, dst, deadline);
    }
    Attempt a = GetOnce(*ep, request, dst, deadline);
    if (!a.retry || attempt > 0 || absl::Now() >= deadline) return a.result;
  }
}

std::shared_ptr<const BulkDataPath::Endpoint> BulkDataPath::CachedEndpoint() const {
  absl::MutexLock lock(&mu_);
  return endpoint_;
}

uint64_t BulkDataPath::TakeUnreportedReads() {
  const std::shared_ptr<const Endpoint> ep = CachedEndpoint();
  return ep == nullptr ? 0 : ep->TakeUnreported();
}

uint64_t BulkDataPath::unreported_reads() const {
  const std::shared_ptr<const Endpoint> ep = CachedEndpoint();
  return ep == nullptr ? 0 : ep->Unreported();
}

absl::StatusOr<uint64_t> BulkDataPath::RegionLength(const RegionAccess& at,
                                                    absl::Time deadline) {
  ASSIGN_OR_RETURN(std::shared_ptr<const Endpoint> ep,
                   GetEndpoint({at.job_id, at.rank, at.incarnation}, deadline));
  const transport::RegionDescriptor* region = ep->Other(at.purpose);
  return region == nullptr ? 0 : region->length;
}

BulkDataPath::Attempt BulkDataPath::RegionOnce(const Endpoint& ep, const RegionAccess& at,
                                               bool put, uint64_t offset, void* buffer,
                                               uint64_t bytes, absl::Time deadline,
                                               absl::FunctionRef<void()> while_copying,
                                               bool* ran) {
  const transport::RegionDescriptor* region = ep.Other(at.purpose);
  auto what = [&] {
    return absl::StrCat(put ? "Put" : "Get", " ", bytes, " bytes at ", offset, " of region ",
                        RegionPurposeName(at.purpose));
  };
  if (region == nullptr) {
    return {absl::FailedPreconditionError(absl::StrCat(
        "daemon ", address(), ": ", what(), ": the daemon hands out no such region"))};
  }
  if (absl::Status s = transport::CheckRange(*region, offset, bytes, "the region"); !s.ok()) {
    return {absl::InvalidArgumentError(
        absl::StrCat("daemon ", address(), ": ", what(), ": ", s.message()))};
  }
  // Up to one part per connection, so that one large access is copied by
  // as many progress threads as the connections are on (BulkTransport::
  // ConnectAll puts them on distinct ones where it can).
  const size_t first = ep.NextConnection();
  transport::PiecePlan parts(
      bytes, transport::PartBytes(bytes, ep.connections.size(), kRegionPartBytes, kPageBytes));
  std::vector<transport::Completion> ops;
  while (!parts.done()) {
    const transport::PiecePlan::Piece part = parts.Next();
    transport::Connection& connection =
        *ep.connections[(first + ops.size()) % ep.connections.size()];
    uint8_t* local = static_cast<uint8_t*>(buffer) + part.offset;
    ops.push_back(put ? connection.Put(local, part.length, *region, offset + part.offset)
                      : connection.Get(local, part.length, *region, offset + part.offset));
  }
  if (!*ran) {
    *ran = true;
    while_copying();
  }
  const absl::Status s = FinishAll(absl::MakeSpan(ops), deadline, what);
  if (s.ok()) return {bytes};
  const bool lost = ConnectionGone(s);
  if (lost) DropEndpoint(&ep);
  return {s, lost};
}

absl::Status BulkDataPath::RegionOp(const RegionAccess& at, bool put, uint64_t offset,
                                    void* buffer, uint64_t bytes, absl::Time deadline,
                                    absl::FunctionRef<void()> while_copying) {
  const JobKey key{at.job_id, at.rank, at.incarnation};
  bool ran = false;
  for (int attempt = 0;; ++attempt) {
    ASSIGN_OR_RETURN(std::shared_ptr<const Endpoint> ep, GetEndpoint(key, deadline));
    Attempt a = RegionOnce(*ep, at, put, offset, buffer, bytes, deadline, while_copying, &ran);
    if (!a.retry || attempt > 0 || absl::Now() >= deadline) return a.result.status();
  }
}

absl::Status BulkDataPath::PutRegion(const RegionAccess& at, uint64_t offset, const void* src,
                                     uint64_t bytes, absl::Time deadline,
                                     absl::FunctionRef<void()> while_copying) {
  // The transport only reads `src` on a Put.
  return RegionOp(at, true, offset, const_cast<void*>(src), bytes, deadline, while_copying);
}

absl::Status BulkDataPath::GetRegion(const RegionAccess& at, uint64_t offset, void* dst,
                                     uint64_t bytes, absl::Time deadline,
                                     absl::FunctionRef<void()> while_copying) {
  return RegionOp(at, false, offset, dst, bytes, deadline, while_copying);
}

}  // namespace zeroshard
