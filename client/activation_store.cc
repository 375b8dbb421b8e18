#include "client/activation_store.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/rpc.h"
#include "common/crc32c.h"
#include "common/protocol.h"
#include "common/status_macros.h"

namespace zeroshard {
namespace {

// The keys of `step` in `keys`, a map or set ordered by ActivationKey (step
// first): [first, last).
template <typename Ordered>
auto KeysOfStep(Ordered& keys, uint64_t step) {
  constexpr uint32_t kMax = std::numeric_limits<uint32_t>::max();
  return std::make_pair(keys.lower_bound(ActivationKey{step, 0, 0, 0, 0}),
                        keys.upper_bound(ActivationKey{step, kMax, kMax, kMax, kMax}));
}

// Bulk offloads and fetches move a slice in pieces of this size; the
// checksum of each piece is taken while the transport moves the next one.
constexpr uint64_t kRegionPieceBytes = 4 << 20;

absl::Status CheckArgs(const ActivationKey& key, const void* buffer, uint64_t bytes,
                       const char* buffer_name) {
  RETURN_IF_ERROR(ValidateActivationKey(key));
  if (absl::Status s = ValidateActivationSliceBytes(bytes, "bytes"); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(s.message(), " (", DescribeActivationKey(key), ")"));
  }
  if (buffer == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(buffer_name, ": null (", DescribeActivationKey(key), ")"));
  }
  return absl::OkStatus();
}

void AddTrainer(SliceStoreStats& s, uint64_t bytes) {
  s.trainer_bytes += bytes;
  s.peak_trainer_bytes = std::max(s.peak_trainer_bytes, s.trainer_bytes);
}

void AddStored(SliceStoreStats& s, uint64_t bytes) {
  s.stored_bytes += bytes;
  s.peak_stored_bytes = std::max(s.peak_stored_bytes, s.stored_bytes);
}

// `s` with the key named after its message.
absl::Status AddActivationContext(const absl::Status& s, const ActivationKey& key) {
  return absl::Status(s.code(),
                      absl::StrCat(s.message(), " (activation ", DescribeActivationKey(key), ")"));
}

}  // namespace

ActivationTicket ActivationTicket::Ready(const absl::Status& status) {
  auto state = std::make_shared<CountDown>(1);
  state->Done(status);
  return ActivationTicket(std::move(state));
}

absl::Status ActivationTicket::Wait(absl::Time deadline) const {
  if (state_ == nullptr) return absl::OkStatus();
  return state_->Wait(deadline, "activation store operation");
}

absl::Status ActivationSliceStore::Fetch(const ActivationKey& key, void* dst, uint64_t bytes,
                                         AfterFetch then, absl::Time deadline) {
  ASSIGN_OR_RETURN(ActivationTicket ticket, StartFetch(key, dst, bytes, then));
  return ticket.Wait(deadline);
}

// ---- LocalSliceStore ----

absl::StatusOr<ActivationTicket> LocalSliceStore::Offload(const ActivationKey& key,
                                                          const void* data, uint64_t bytes) {
  RETURN_IF_ERROR(CheckArgs(key, data, bytes, "data"));
  absl::MutexLock lock(&mu_);
  auto [it, inserted] = slices_.try_emplace(key);
  if (!inserted) {
    return absl::AlreadyExistsError(
        absl::StrCat("activation ", DescribeActivationKey(key), " is stored"));
  }
  it->second.assign(static_cast<const char*>(data), bytes);
  ++stats_.offloads;
  stats_.offload_bytes += bytes;
  AddStored(stats_, bytes);
  AddTrainer(stats_, bytes);
  return ActivationTicket();
}

absl::StatusOr<ActivationTicket> LocalSliceStore::StartFetch(const ActivationKey& key, void* dst,
                                                             uint64_t bytes, AfterFetch then) {
  RETURN_IF_ERROR(CheckArgs(key, dst, bytes, "dst"));
  absl::MutexLock lock(&mu_);
  auto it = slices_.find(key);
  absl::Status s;
  if (it == slices_.end()) {
    s = absl::NotFoundError(
        absl::StrCat("activation ", DescribeActivationKey(key), ": none stored"));
  } else if (it->second.size() != bytes) {
    s = absl::InvalidArgumentError(absl::StrCat("activation ", DescribeActivationKey(key),
                                                ": the slice holds ", it->second.size(),
                                                " bytes, dst ", bytes));
  }
  if (!s.ok()) {
    ++stats_.failures;
    return ActivationTicket::Ready(s);
  }
  std::memcpy(dst, it->second.data(), bytes);
  ++stats_.fetches;
  stats_.fetch_bytes += bytes;
  if (then == AfterFetch::kFree) {
    stats_.stored_bytes -= bytes;
    stats_.trainer_bytes -= bytes;
    slices_.erase(it);
  }
  return ActivationTicket();
}

absl::StatusOr<ActivationTicket> LocalSliceStore::Prefetch(absl::Span<const ActivationKey> keys) {
  for (const ActivationKey& k : keys) RETURN_IF_ERROR(ValidateActivationKey(k));
  return ActivationTicket();
}

absl::StatusOr<uint64_t> LocalSliceStore::Free(const ActivationKey& key, absl::Time) {
  RETURN_IF_ERROR(ValidateActivationKey(key));
  absl::MutexLock lock(&mu_);
  auto it = slices_.find(key);
  if (it == slices_.end()) return 0;
  const uint64_t bytes = it->second.size();
  stats_.stored_bytes -= bytes;
  stats_.trainer_bytes -= bytes;
  slices_.erase(it);
  return bytes;
}

absl::StatusOr<uint64_t> LocalSliceStore::FreeStep(uint64_t step, absl::Time) {
  absl::MutexLock lock(&mu_);
  uint64_t freed = 0;
  for (auto it = slices_.begin(); it != slices_.end();) {
    if (it->first.step != step) {
      ++it;
      continue;
    }
    freed += it->second.size();
    it = slices_.erase(it);
  }
  stats_.stored_bytes -= freed;
  stats_.trainer_bytes -= freed;
  return freed;
}

SliceStoreStats LocalSliceStore::Stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

// ---- DaemonSliceStore ----

DaemonSliceStore::DaemonSliceStore(Owner owner, std::string address,
                                   std::shared_ptr<grpc::Channel> channel, BulkDataPath* bulk,
                                   Options options)
    : owner_(std::move(owner)),
      address_(std::move(address)),
      stub_(v1::Activation::NewStub(channel)),
      bulk_(bulk),
      options_(options),
      workers_(std::make_unique<Executor>(std::clamp(options.threads, 1, 16))) {}

DaemonSliceStore::~DaemonSliceStore() {
  workers_.reset();  // runs what is queued; each task bounded by its deadlines
}

std::string DaemonSliceStore::name() const {
  const bool bulk = bulk_ != nullptr && !streaming_.load();
  return absl::StrCat("daemon ", address_, " (", bulk ? bulk_->name() : "stream", ")");
}

v1::ActivationOwner DaemonSliceStore::OwnerProto() const {
  v1::ActivationOwner o;
  o.set_job_id(owner_.job_id);
  o.set_rank(owner_.rank);
  o.set_incarnation(owner_.incarnation);
  return o;
}

std::string DaemonSliceStore::What(absl::string_view rpc, const ActivationKey& key) const {
  return absl::StrCat(rpc, " ", DescribeActivationKey(key));
}

absl::StatusOr<DaemonSliceStore::Path> DaemonSliceStore::GetPath(absl::Time deadline) {
  absl::MutexLock lock(&path_mu_);
  if (path_.has_value()) return *path_;
  Path p;
  if (bulk_ != nullptr) {
    BulkDataPath::RegionAccess at{owner_.job_id, owner_.rank, owner_.incarnation,
                                  v1::REGION_PURPOSE_ACTIVATION_ARENA};
    ASSIGN_OR_RETURN(p.arena_bytes, bulk_->RegionLength(at, deadline));
    p.bulk = p.arena_bytes > 0;
  }
  // Decided once: a daemon's arena is allocated at its start.
  path_ = p;
  streaming_ = !p.bulk;
  return p;
}

std::vector<std::shared_ptr<CountDown>> DaemonSliceStore::Track(
    const ActivationKey& key, const std::shared_ptr<CountDown>& done, bool offload,
    bool wait_for_all) {
  std::vector<std::shared_ptr<CountDown>> earlier;
  auto [b, e] = pending_.equal_range(key);
  for (auto it = b; it != e; ++it) {
    if (wait_for_all || it->second.offload) earlier.push_back(it->second.done);
  }
  if (done != nullptr) pending_.emplace(key, Pending{done, offload});
  return earlier;
}

void DaemonSliceStore::Untrack(const ActivationKey& key, const CountDown* done) {
  auto [b, e] = pending_.equal_range(key);
  for (auto it = b; it != e; ++it) {
    if (it->second.done.get() == done) {
      pending_.erase(it);
      return;
    }
  }
}

absl::Status DaemonSliceStore::AwaitAll(const std::vector<std::shared_ptr<CountDown>>& earlier,
                                        absl::Time deadline, const std::string& what) {
  for (const auto& e : earlier) {
    // The earlier operation's own error is its caller's to see.
    absl::Status s = e->Wait(deadline, what);
    if (absl::IsDeadlineExceeded(s)) return s;
  }
  return absl::OkStatus();
}

void DaemonSliceStore::Forget(const ActivationKey& key) {
  unsure_.erase(key);
  auto it = stored_.find(key);
  if (it == stored_.end()) return;
  stats_.stored_bytes -= it->second.bytes;
  stored_.erase(it);
}

void DaemonSliceStore::MarkUnsure(const ActivationKey& key) {
  Forget(key);
  unsure_.insert(key);
}

absl::StatusOr<ActivationTicket> DaemonSliceStore::Offload(const ActivationKey& key,
                                                           const void* data, uint64_t bytes) {
  RETURN_IF_ERROR(CheckArgs(key, data, bytes, "data"));
  auto done = std::make_shared<CountDown>(1);
  {
    absl::MutexLock lock(&mu_);
    bool offloading = false;
    for (auto [b, e] = pending_.equal_range(key); b != e; ++b) offloading |= b->second.offload;
    if (offloading || stored_.count(key) > 0) {
      return absl::AlreadyExistsError(absl::StrCat("daemon ", address_, ": activation ",
                                                   DescribeActivationKey(key),
                                                   " is stored or being offloaded"));
    }
    Track(key, done, /*offload=*/true, /*wait_for_all=*/false);
    AddTrainer(stats_, bytes);
  }
  workers_->Submit([this, key, data, bytes, done] {
    bool spilled = false, streamed = false;
    Stored stored;
    stored.bytes = bytes;
    const absl::Status s = DoOffload(key, data, bytes, &spilled, &streamed, &stored);
    {
      absl::MutexLock lock(&mu_);
      Untrack(key, done.get());
      stats_.trainer_bytes -= bytes;
      stats_.streamed += streamed;
      if (s.ok()) {
        stored_[key] = stored;
        unsure_.erase(key);
        AddStored(stats_, bytes);
        ++stats_.offloads;
        stats_.offload_bytes += bytes;
        stats_.spilled_offloads += spilled;
      } else {
        ++stats_.failures;
        // It may have reached the daemon (a lost answer): FreeStep frees it.
        MarkUnsure(key);
      }
    }
    done->Done(s);  // the caller's buffer is free from here
  });
  return ActivationTicket(done);
}

absl::Status DaemonSliceStore::DoOffload(const ActivationKey& key, const void* data, uint64_t bytes,
                                         bool* spilled, bool* streamed, Stored* stored) {
  const absl::Time deadline = Deadline();
  ASSIGN_OR_RETURN(Path path, GetPath(deadline));
  if (path.bulk && bytes <= path.arena_bytes) {
    return OffloadBulk(key, data, bytes, deadline, spilled, stored);
  }
  *streamed = true;
  return OffloadStream(key, data, bytes, deadline, spilled);
}

absl::Status DaemonSliceStore::OffloadBulk(const ActivationKey& key, const void* data,
                                           uint64_t bytes, absl::Time deadline, bool* spilled,
                                           Stored* where) {
  v1::ReserveActivationRequest reserve;
  *reserve.mutable_owner() = OwnerProto();
  ActivationKeyToProto(key, reserve.mutable_key());
  reserve.set_bytes(bytes);
  v1::ActivationPlacement placement;
  const absl::Time asked = absl::Now();
  {
    grpc::ClientContext context;
    SetDeadline(&context, deadline);
    const grpc::Status s = stub_->ReserveActivation(&context, reserve, &placement);
    if (!s.ok()) return DaemonError(s, address_, What("ReserveActivation", key));
  }
  if (placement.bytes() != bytes) {
    return absl::DataLossError(absl::StrCat("daemon ", address_, ": ",
                                            What("ReserveActivation", key), ": reserved ",
                                            placement.bytes(), " bytes, asked for ", bytes));
  }
  // The daemon drops the reservation at the end of its lease, counted from
  // its answer (after `asked`), and may hand the block out again: the Put
  // has half of it, and a Put stopped there leaves the other half for bytes
  // already on their way (a transport that closes its connection to stop a
  // Put lets them land) before that can happen.
  absl::Time put_by = deadline;
  if (placement.lease_ms() > 0) {
    put_by = std::min(deadline, asked + absl::Milliseconds(placement.lease_ms()) / 2);
  }
  uint32_t crc = 0;
  // The transport only reads `data` on a put.
  if (absl::Status s = MoveRegion(true, placement.offset(),
                                  const_cast<uint8_t*>(static_cast<const uint8_t*>(data)), bytes,
                                  put_by, options_.checksums ? &crc : nullptr);
      !s.ok()) {
    // Hand the reservation back rather than let it wait out the lease (the
    // daemon keeps its block until then, for bytes still on their way); the
    // daemon drops it by itself if this does not arrive.
    FreeRpc(key, false, Deadline()).IgnoreError();
    return AddActivationContext(s, key);
  }
  v1::CommitActivationRequest commit;
  *commit.mutable_owner() = OwnerProto();
  ActivationKeyToProto(key, commit.mutable_key());
  if (options_.checksums) commit.set_crc32c(crc);
  v1::ActivationStored stored;
  grpc::ClientContext context;
  SetDeadline(&context, deadline);
  const grpc::Status s = stub_->CommitActivation(&context, commit, &stored);
  if (!s.ok()) return DaemonError(s, address_, What("CommitActivation", key));
  if (stored.bytes() != bytes) {
    return absl::DataLossError(absl::StrCat("daemon ", address_, ": ",
                                            What("CommitActivation", key), ": stored ",
                                            stored.bytes(), " bytes, sent ", bytes));
  }
  *spilled = stored.spilled();
  where->offset = placement.offset();
  where->placement = placement.placement();
  if (options_.checksums) where->crc32c = crc;
  return absl::OkStatus();
}

absl::Status DaemonSliceStore::OffloadStream(const ActivationKey& key, const void* data,
                                             uint64_t bytes, absl::Time deadline, bool* spilled) {
  const uint64_t piece = std::clamp<uint64_t>(options_.stream_chunk_bytes, 4096, kMaxChunkBytes);
  grpc::ClientContext context;
  SetDeadline(&context, deadline);
  v1::ActivationStored stored;
  std::unique_ptr<grpc::ClientWriter<v1::ActivationChunk>> writer =
      stub_->OffloadActivation(&context, &stored);
  v1::ActivationChunk chunk;
  *chunk.mutable_owner() = OwnerProto();
  ActivationKeyToProto(key, chunk.mutable_key());
  chunk.set_total_bytes(bytes);
  bool broken = false;
  for (uint64_t off = 0; off < bytes && !broken; off += piece) {
    const uint64_t n = std::min(piece, bytes - off);
    const char* src = static_cast<const char*>(data) + off;
    chunk.set_offset(off);
    chunk.set_data(src, n);
    chunk.set_crc32c(Crc32c(src, n));
    broken = !writer->Write(chunk);
    if (off == 0) {
      // Only the first chunk names the owner, the key and the size.
      chunk.clear_owner();
      chunk.clear_key();
      chunk.clear_total_bytes();
    }
  }
  // A failed Write means the stream is broken; Finish reports why.
  if (!broken) writer->WritesDone();
  const grpc::Status s = writer->Finish();
  if (!s.ok()) return DaemonError(s, address_, What("OffloadActivation", key));
  if (stored.bytes() != bytes) {
    return absl::DataLossError(absl::StrCat("daemon ", address_, ": ",
                                            What("OffloadActivation", key), ": stored ",
                                            stored.bytes(), " bytes, sent ", bytes));
  }
  *spilled = stored.spilled();
  return absl::OkStatus();
}

absl::StatusOr<ActivationTicket> DaemonSliceStore::StartFetch(const ActivationKey& key, void* dst,
                                                              uint64_t bytes, AfterFetch then) {
  RETURN_IF_ERROR(CheckArgs(key, dst, bytes, "dst"));
  auto done = std::make_shared<CountDown>(1);
  std::vector<std::shared_ptr<CountDown>> earlier;
  {
    absl::MutexLock lock(&mu_);
    earlier = Track(key, done, /*offload=*/false, /*wait_for_all=*/false);
    AddTrainer(stats_, bytes);
  }
  workers_->Submit([this, key, dst, bytes, then, done, earlier = std::move(earlier)] {
    bool was_spilled = false, streamed = false, freed = false;
    absl::Status s = AwaitAll(earlier, Deadline(),
                              absl::StrCat("daemon ", address_, ": fetch of activation ",
                                           DescribeActivationKey(key), " waiting for its offload"));
    if (s.ok()) s = DoFetch(key, dst, bytes, then, &was_spilled, &streamed, &freed);
    {
      absl::MutexLock lock(&mu_);
      Untrack(key, done.get());
      stats_.trainer_bytes -= bytes;
      stats_.streamed += streamed;
      if (s.ok()) {
        ++stats_.fetches;
        stats_.fetch_bytes += bytes;
        stats_.spilled_fetches += was_spilled;
        if (freed) {
          Forget(key);
        } else if (then == AfterFetch::kFree) {
          MarkUnsure(key);  // its free failed: FreeStep frees it
        }
      } else {
        ++stats_.failures;
        if (absl::IsNotFound(s)) Forget(key);
      }
    }
    done->Done(s);  // `dst` is the caller's again from here
  });
  return ActivationTicket(done);
}

absl::Status DaemonSliceStore::DoFetch(const ActivationKey& key, void* dst, uint64_t bytes,
                                       AfterFetch then, bool* was_spilled, bool* streamed,
                                       bool* freed) {
  const absl::Time deadline = Deadline();
  ASSIGN_OR_RETURN(Path path, GetPath(deadline));
  if (path.bulk && bytes <= path.arena_bytes) {
    std::optional<Stored> at;
    if (then == AfterFetch::kFree) {
      absl::MutexLock lock(&mu_);
      if (auto it = stored_.find(key); it != stored_.end() && it->second.placement != 0) {
        at = it->second;
      }
    }
    if (at.has_value()) {
      ASSIGN_OR_RETURN(InPlace in_place, FetchInPlace(key, *at, dst, bytes, deadline));
      *freed = in_place == InPlace::kFreed;
      if (in_place != InPlace::kMoved) return absl::OkStatus();
    }
    RETURN_IF_ERROR(FetchBulk(key, dst, bytes, deadline, was_spilled));
  } else {
    *streamed = true;
    RETURN_IF_ERROR(FetchStream(key, dst, bytes, deadline));
  }
  if (then == AfterFetch::kFree) {
    // The bytes are in `dst`: the slice is not needed any more. A free that
    // fails leaves the slice to FreeStep (or the rank's Leave); the fetch
    // itself succeeded.
    absl::StatusOr<v1::FreeActivationsResponse> r = FreeRpc(key, false, Deadline());
    *freed = r.ok() || absl::IsNotFound(r.status());
  }
  return absl::OkStatus();
}

absl::StatusOr<DaemonSliceStore::InPlace> DaemonSliceStore::FetchInPlace(const ActivationKey& key,
                                                                         const Stored& at,
                                                                         void* dst, uint64_t bytes,
                                                                         absl::Time deadline) {
  if (at.bytes != bytes) {
    return absl::InvalidArgumentError(absl::StrCat("daemon ", address_, ": activation ",
                                                   DescribeActivationKey(key), ": the slice holds ",
                                                   at.bytes, " bytes, dst ", bytes));
  }
  const bool verify = at.crc32c.has_value();
  uint32_t crc = 0;
  if (absl::Status s = MoveRegion(false, at.offset, static_cast<uint8_t*>(dst), bytes, deadline,
                                  verify ? &crc : nullptr);
      !s.ok()) {
    return AddActivationContext(s, key);
  }
  // Other bytes than those committed: the slice moved and its place was
  // reused, or the arena was corrupted; the located fetch finds out which.
  if (verify && crc != *at.crc32c) return InPlace::kMoved;
  absl::StatusOr<v1::FreeActivationsResponse> r = FreeRpc(key, false, deadline, at.placement);
  if (r.ok()) return r->moved() ? InPlace::kMoved : InPlace::kFreed;
  // No answer: only the checksum can vouch for the bytes; without one the
  // located fetch decides (it fails too if the slice is gone).
  return verify ? InPlace::kUnconfirmed : InPlace::kMoved;
}

absl::Status DaemonSliceStore::FetchBulk(const ActivationKey& key, void* dst, uint64_t bytes,
                                         absl::Time deadline, bool* was_spilled) {
  v1::LocateActivationRequest locate;
  *locate.mutable_owner() = OwnerProto();
  ActivationKeyToProto(key, locate.mutable_key());
  v1::ActivationPlacement placement;
  {
    grpc::ClientContext context;
    SetDeadline(&context, deadline);
    const grpc::Status s = stub_->LocateActivation(&context, locate, &placement);
    if (!s.ok()) return DaemonError(s, address_, What("LocateActivation", key));
  }
  if (placement.bytes() != bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("daemon ", address_, ": ", What("LocateActivation", key), ": the slice holds ",
                     placement.bytes(), " bytes, dst ", bytes));
  }
  *was_spilled = placement.was_spilled();
  // A slice committed without a checksum but spilled has the daemon's,
  // which the daemon checked on reading it back.
  const bool verify = options_.checksums && placement.has_crc32c();
  uint32_t crc = 0;
  if (absl::Status s = MoveRegion(false, placement.offset(), static_cast<uint8_t*>(dst), bytes,
                                  deadline, verify ? &crc : nullptr);
      !s.ok()) {
    return AddActivationContext(s, key);
  }
  if (verify && crc != placement.crc32c()) {
    return absl::DataLossError(absl::StrCat("daemon ", address_, ": ",
                                            What("LocateActivation", key),
                                            ": the bytes read fail the slice's CRC-32C"));
  }
  return absl::OkStatus();
}

absl::Status DaemonSliceStore::MoveRegion(bool put, uint64_t offset, uint8_t* buffer,
                                          uint64_t bytes, absl::Time deadline, uint32_t* crc) {
  const BulkDataPath::RegionAccess at{owner_.job_id, owner_.rank, owner_.incarnation,
                                      v1::REGION_PURPOSE_ACTIVATION_ARENA};
  const uint64_t piece = crc != nullptr ? kRegionPieceBytes : bytes;
  uint64_t checked = 0;
  auto check_upto = [&](uint64_t end) {
    if (crc != nullptr && checked < end) {
      *crc = Crc32c(buffer + checked, end - checked, *crc);
      checked = end;
    }
  };
  for (uint64_t at_byte = 0; at_byte < bytes; at_byte += piece) {
    const uint64_t n = std::min(piece, bytes - at_byte);
    auto while_moving = [&] { check_upto(at_byte); };
    RETURN_IF_ERROR(
        put ? bulk_->PutRegion(at, offset + at_byte, buffer + at_byte, n, deadline, while_moving)
            : bulk_->GetRegion(at, offset + at_byte, buffer + at_byte, n, deadline, while_moving));
  }
  check_upto(bytes);
  return absl::OkStatus();
}

absl::Status DaemonSliceStore::FetchStream(const ActivationKey& key, void* dst, uint64_t bytes,
                                           absl::Time deadline) {
  const std::string what = What("FetchActivation", key);
  v1::FetchActivationRequest req;
  *req.mutable_owner() = OwnerProto();
  ActivationKeyToProto(key, req.mutable_key());
  req.set_max_chunk_bytes(std::clamp<uint64_t>(options_.stream_chunk_bytes, 4096, kMaxChunkBytes));
  grpc::ClientContext context;
  SetDeadline(&context, deadline);
  std::unique_ptr<grpc::ClientReader<v1::ActivationChunk>> reader =
      stub_->FetchActivation(&context, req);
  uint64_t pos = 0;
  v1::ActivationChunk chunk;
  absl::Status bad;
  while (reader->Read(&chunk)) {
    if (chunk.total_bytes() != 0 && chunk.total_bytes() != bytes) {
      bad = absl::InvalidArgumentError(absl::StrCat("daemon ", address_, ": ", what,
                                                    ": the slice holds ", chunk.total_bytes(),
                                                    " bytes, dst ", bytes));
      break;
    }
    const uint64_t n = chunk.data().size();
    if (chunk.offset() != pos || n == 0 || n > bytes - pos) {
      bad = absl::DataLossError(
          absl::StrCat("daemon ", address_, ": ", what, ": unexpected chunk of ", n, " bytes at ",
                       chunk.offset(), ", expected one at ", pos, " of ", bytes));
      break;
    }
    if (Crc32c(chunk.data().data(), n) != chunk.crc32c()) {
      bad = absl::DataLossError(absl::StrCat("daemon ", address_, ": ", what, ": the chunk at ",
                                             pos, " fails its CRC-32C"));
      break;
    }
    std::memcpy(static_cast<char*>(dst) + pos, chunk.data().data(), n);
    pos += n;
  }
  if (!bad.ok()) {
    context.TryCancel();
    reader->Finish();
    return bad;
  }
  const grpc::Status s = reader->Finish();
  if (!s.ok()) return DaemonError(s, address_, what);
  if (pos != bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "daemon ", address_, ": ", what, ": the slice holds ", pos, " bytes, dst ", bytes));
  }
  return absl::OkStatus();
}

absl::StatusOr<ActivationTicket> DaemonSliceStore::Prefetch(absl::Span<const ActivationKey> keys) {
  for (const ActivationKey& k : keys) RETURN_IF_ERROR(ValidateActivationKey(k));
  if (keys.empty()) return ActivationTicket();
  auto done = std::make_shared<CountDown>(1);
  std::vector<std::shared_ptr<CountDown>> earlier;
  {
    absl::MutexLock lock(&mu_);
    for (const ActivationKey& k : keys) {
      for (auto& e : Track(k, nullptr, false, false)) earlier.push_back(std::move(e));
    }
  }
  std::vector<ActivationKey> list(keys.begin(), keys.end());
  workers_->Submit([this, list = std::move(list), done, earlier = std::move(earlier)] {
    // Hints name slices the daemon holds: wait for their offloads.
    absl::Status s = AwaitAll(earlier, Deadline(),
                              absl::StrCat("daemon ", address_,
                                           ": prefetch hint waiting for "
                                           "offloads"));
    for (size_t b = 0; s.ok() && b < list.size(); b += kMaxPrefetchKeys) {
      v1::PrefetchActivationsRequest req;
      *req.mutable_owner() = OwnerProto();
      for (size_t i = b; i < std::min(list.size(), b + kMaxPrefetchKeys); ++i) {
        ActivationKeyToProto(list[i], req.add_keys());
      }
      v1::PrefetchActivationsResponse resp;
      grpc::ClientContext context;
      SetDeadline(&context, Deadline());
      const grpc::Status g = stub_->PrefetchActivations(&context, req, &resp);
      if (!g.ok()) s = DaemonError(g, address_, "PrefetchActivations");
    }
    done->Done(s);
  });
  return ActivationTicket(done);
}

absl::StatusOr<v1::FreeActivationsResponse> DaemonSliceStore::FreeRpc(
    const ActivationKey& key, bool whole_step, absl::Time deadline,
    std::optional<uint64_t> if_placement) {
  v1::FreeActivationsRequest req;
  *req.mutable_owner() = OwnerProto();
  ActivationKeyToProto(key, req.mutable_key());
  req.set_whole_step(whole_step);
  if (if_placement.has_value()) req.set_if_placement(*if_placement);
  v1::FreeActivationsResponse resp;
  grpc::ClientContext context;
  SetDeadline(&context, deadline);
  const grpc::Status s = stub_->FreeActivations(&context, req, &resp);
  if (!s.ok()) {
    return DaemonError(s, address_,
                       whole_step ? absl::StrCat("FreeActivations step ", key.step)
                                  : What("FreeActivations", key));
  }
  return resp;
}

absl::StatusOr<uint64_t> DaemonSliceStore::Free(const ActivationKey& key, absl::Time deadline) {
  RETURN_IF_ERROR(ValidateActivationKey(key));
  std::vector<std::shared_ptr<CountDown>> earlier;
  {
    absl::MutexLock lock(&mu_);
    earlier = Track(key, nullptr, false, /*wait_for_all=*/true);
  }
  RETURN_IF_ERROR(
      AwaitAll(earlier, deadline,
               absl::StrCat("daemon ", address_, ": free of activation ",
                            DescribeActivationKey(key), " waiting for its operations")));
  absl::StatusOr<v1::FreeActivationsResponse> r = FreeRpc(key, false, deadline);
  absl::MutexLock lock(&mu_);
  // Not there (never stored, or freed already): nothing to free.
  if (!r.ok() && !absl::IsNotFound(r.status())) {
    MarkUnsure(key);
    return r.status();
  }
  Forget(key);
  return r.ok() ? r->bytes() : 0;
}

absl::StatusOr<uint64_t> DaemonSliceStore::FreeStep(uint64_t step, absl::Time deadline) {
  std::vector<std::shared_ptr<CountDown>> earlier;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [k, p] : pending_) {
      if (k.step == step) earlier.push_back(p.done);
    }
  }
  RETURN_IF_ERROR(AwaitAll(
      earlier, deadline,
      absl::StrCat("daemon ", address_, ": free of step ", step, " waiting for its operations")));
  {
    absl::MutexLock lock(&mu_);
    // Every slice of the step that reached the daemon was freed, and the
    // daemon said so: nothing to send.
    auto [stored, stored_end] = KeysOfStep(stored_, step);
    auto [unsure, unsure_end] = KeysOfStep(unsure_, step);
    if (stored == stored_end && unsure == unsure_end) return 0;
  }
  ActivationKey key;
  key.step = step;
  ASSIGN_OR_RETURN(v1::FreeActivationsResponse r, FreeRpc(key, true, deadline));
  absl::MutexLock lock(&mu_);
  auto [stored, stored_end] = KeysOfStep(stored_, step);
  for (auto it = stored; it != stored_end; ++it) stats_.stored_bytes -= it->second.bytes;
  stored_.erase(stored, stored_end);
  auto [unsure, unsure_end] = KeysOfStep(unsure_, step);
  unsure_.erase(unsure, unsure_end);
  return r.bytes();
}

SliceStoreStats DaemonSliceStore::Stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

}  // namespace zeroshard
