#include "server/activation/activation_store.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <atomic>
#include <cstdio>
#include <deque>
#include <functional>
#include <iterator>
#include <tuple>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/crc32c.h"
#include "common/fnv.h"
#include "common/format.h"
#include "common/status_macros.h"

namespace zeroshard {
namespace {

void Log(const std::string& line) { std::fprintf(stderr, "zeroshardd: %s\n", line.c_str()); }

template <typename T>
void HashValue(uint64_t& h, const T& v) {
  Fnv1aMix(h, &v, sizeof(v));
}

// How long a free waits to queue the hinted read-backs it makes room for.
constexpr absl::Duration kHintQueueWait = absl::Seconds(5);
// How long a free waits for the spill I/O in flight of the slices it freed
// (past it their files still go, after the answer).
constexpr absl::Duration kIoEndWait = absl::Seconds(30);

std::string Bytes(uint64_t b) { return absl::StrCat(FormatBytes(static_cast<double>(b)), " (", b, " B)"); }

}  // namespace

// One slice's life: kPending (a reservation waiting for room) -> kReserved
// (a block; the trainer puts or streams the bytes) -> kCommitting (its CRC
// being checked; a commit without one skips it) -> kStored (in the arena) <-> kSpilling (in the
// arena and being written to its file) -> kSpilled (in the file only) -> kReading (being read back
// into a new block) -> kStored. kCorrupt: its file no longer held its bytes.
struct ActivationStore::Slice {
  enum class State { kPending, kReserved, kCommitting, kStored, kSpilling, kSpilled, kReading, kCorrupt };
  Id id{};
  std::string job;
  uint64_t bytes = 0;
  State state = State::kPending;
  bool stream = false;    // received on a stream: no lease
  bool pinned = false;    // located: stays in the arena until freed
  bool detached = false;  // freed: out of its job's map, released once idle
  // Its bulk reservation's number (SlicePlacement) while it is in that
  // reservation's block; 0 once it has left it, and for a streamed slice
  // (ReleaseFetched).
  uint64_t placement = 0;
  // Requests using the slice without the lock (a reservation waiting for
  // room, a stream writing it, a commit checking it, fetches reading it):
  // while > 0 it neither moves nor goes.
  int holds = 0;
  bool has_block = false;
  uint64_t offset = 0;  // region offset of the block
  uint64_t block = 0;
  std::string file;  // its spill file, if any
  uint64_t file_bytes = 0;
  // What its commit carried, and the checksum of its bytes when known (the
  // commit's, or taken by the daemon when it spilled the slice).
  std::optional<uint32_t> commit_crc;
  std::optional<uint32_t> crc;
  // Read back from its spill file (ahead of a fetch, by a prefetch) and not
  // fetched since: the next fetch reports it as a miss all the same.
  bool read_back = false;
  absl::Time lease_end = absl::InfiniteFuture();
  absl::Status io_error;  // of its last spill write or read-back
};

struct ActivationStore::JobEntry {
  std::weak_ptr<const void> instance;
  bool removed = false;
  std::map<Id, std::shared_ptr<Slice>> slices;  // in spill order
  // Per rank, the spilled slices of its latest Prefetch hint that had no
  // room yet, in the hint's order: read back as frees make room.
  std::map<uint32_t, std::deque<Id>> hinted;
  // Its freed reservations waiting out their lease (in lingering_, not in
  // `slices`), counted against max_slices_per_job.
  size_t lingering = 0;
};

bool ActivationStore::Id::operator<(const Id& o) const {
  return std::tie(key.step, key.layer, key.micro_batch, rank, key.mp_rank, key.mp_size) <
         std::tie(o.key.step, o.key.layer, o.key.micro_batch, o.rank, o.key.mp_rank,
                  o.key.mp_size);
}

namespace {

template <typename IdT>
std::string Describe(const std::string& job, const IdT& id) {
  return absl::StrCat("activation (", DescribeActivationKey(id.key), ") of job ", job, " rank ",
                      id.rank);
}

std::string DescribeCrc(std::optional<uint32_t> crc) {
  return crc.has_value() ? absl::StrFormat("CRC-32C %08x", *crc) : "no CRC-32C";
}

bool SameInstance(const std::weak_ptr<const void>& a, const std::shared_ptr<const void>& b) {
  return !a.owner_before(b) && !b.owner_before(a);
}

}  // namespace

std::string ArenaLentMessage(const std::string& tenant) {
  return absl::StrCat("this daemon's activation arena is lent to job ", tenant,
                      "'s bulk transport (its key reaches the whole arena); keep this job's "
                      "activation checkpoints on the trainer, or on daemons of its own");
}

ActivationStore::Id ActivationStore::MakeId(const SliceOwner& owner, const ActivationKey& key) {
  return Id{key, owner.rank};
}

ActivationStore::ActivationStore(const Options& options, MemoryLedger* ledger,
                                 ActivationMetrics* metrics)
    : options_(options), ledger_(ledger), metrics_(metrics), allocator_(0, 0, 64) {}

absl::StatusOr<std::unique_ptr<ActivationStore>> ActivationStore::Create(
    const Options& options, transport::Transport* transport, MemoryLedger* ledger,
    ActivationMetrics* metrics) {
  if (options.arena_bytes == 0) {
    return absl::InvalidArgumentError("--activation_arena_bytes: must be > 0 for an arena");
  }
  std::unique_ptr<ActivationStore> s(new ActivationStore(options, ledger, metrics));
  if (!options.spill_dir.empty()) {
    if (options.spill_bytes == 0) {
      return absl::InvalidArgumentError("--spill_bytes: must be > 0 with --spill_dir");
    }
    ASSIGN_OR_RETURN(s->spill_dir_,
                     InstanceDirectory::Open(options.spill_dir, InstanceDirectory::SpillNaming()));
    ASSIGN_OR_RETURN(s->io_, SpillIo::Create(options.io_queue_depth));
    if (s->spill_dir_->direct()) s->alignment_ = InstanceDirectory::kDirectAlignment;
    if (options.disk_timeout <= absl::ZeroDuration()) {
      return absl::InvalidArgumentError("--disk_timeout_seconds: must be > 0");
    }
    s->spill_disk_ = std::make_unique<DiskWorker>(
        absl::StrCat("--spill_dir ", options.spill_dir),
        DiskTimeoutFlag(options.disk_timeout), options.disk_timeout);
  }
  // One alignment unit more than asked for, so that the arena holds
  // arena_bytes (rounded down to the alignment) wherever the region starts.
  const uint64_t region_bytes = options.arena_bytes + s->alignment_;
  s->region_bytes_ = region_bytes;
  // Booked before anything is allocated: an arena over the limit costs nothing.
  if (absl::Status st =
          ledger->Reserve(kDaemonLedgerEntry, MemoryCategory::kActivation, region_bytes);
      !st.ok()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("--activation_arena_bytes=", options.arena_bytes, " does not fit the ",
                     "daemon's --memory_limit=", ledger->limit(), ": ", st.message()));
  }
  auto unbook = absl::MakeCleanup([&] {
    ledger->Release(kDaemonLedgerEntry, MemoryCategory::kActivation, region_bytes);
    ledger->RemoveJobIfEmpty(kDaemonLedgerEntry);
  });
  if (transport != nullptr) {
    absl::StatusOr<std::unique_ptr<transport::Region>> region =
        transport->AllocateRegion(region_bytes, transport::Access::kRemoteReadWrite);
    if (!region.ok()) {
      return absl::Status(region.status().code(),
                          absl::StrCat("--activation_arena_bytes: ", region.status().message()));
    }
    s->transport_ = transport;
    s->region_ = *std::move(region);
    s->base_ = static_cast<char*>(s->region_->base());
  } else {
    // Untouched pages cost nothing until a slice lands on them.
    void* m = ::mmap(nullptr, region_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                     -1, 0);
    if (m == MAP_FAILED) {
      return absl::ResourceExhaustedError(
          absl::StrCat("--activation_arena_bytes: cannot map ", Bytes(region_bytes)));
    }
    s->memory_ = m;
    s->base_ = static_cast<char*>(m);
  }
  std::move(unbook).Cancel();
  const uint64_t address = reinterpret_cast<uintptr_t>(s->base_);
  s->skew_ = (s->alignment_ - address % s->alignment_) % s->alignment_;
  {
    absl::MutexLock lock(&s->mu_);
    s->allocator_ = ArenaAllocator(0, options.arena_bytes, s->alignment_);
    s->capacity_ = s->allocator_.capacity();
    // The region's edges outside the aligned arena count as fragmentation.
    s->SyncFreeBookingLocked();
  }
  if (options.janitor_period > absl::ZeroDuration()) {
    s->janitor_ = std::thread([p = s.get()] { p->RunJanitor(); });
  }
  if (s->spill_dir_ != nullptr && options.idle_removals) {
    s->remover_ = std::thread([p = s.get()] { p->RunRemover(); });
  }
  return s;
}

ActivationStore::~ActivationStore() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (janitor_.joinable()) janitor_.join();
  if (remover_.joinable()) remover_.join();
  // Every file I/O in flight completes (its callback takes mu_) first.
  io_.reset();
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, entry] : jobs_) {
      std::vector<std::shared_ptr<Slice>> all;
      for (auto& [key, slice] : entry.slices) all.push_back(slice);
      for (const auto& slice : all) {
        slice->holds = 0;  // nobody is left to let go of it
        DropLocked(entry, slice);
      }
    }
    ReleaseLingeringLocked([](const Slice&) { return true; });
    jobs_.clear();
  }
  RemoveDroppedFiles(Removal::kNow);  // what a hung disk keeps goes with the next start
  ledger_->Release(kDaemonLedgerEntry, MemoryCategory::kActivation, region_bytes_);
  ledger_->Release(kDaemonLedgerEntry, MemoryCategory::kFragmentation, region_bytes_);
  ledger_->RemoveJobIfEmpty(kDaemonLedgerEntry);
  RevokeTenantKey();
  region_.reset();
  if (memory_ != nullptr) ::munmap(memory_, region_bytes_);
  spill_dir_.reset();
}

// ---- Bookkeeping (under mu_) ----

void ActivationStore::SyncFreeBookingLocked() {
  const uint64_t target = allocator_.fragmentation() + (region_bytes_ - capacity_);
  if (target > booked_fragmentation_) {
    ledger_->Move(kDaemonLedgerEntry, MemoryCategory::kActivation, kDaemonLedgerEntry,
                  MemoryCategory::kFragmentation, target - booked_fragmentation_);
  } else if (target < booked_fragmentation_) {
    ledger_->Move(kDaemonLedgerEntry, MemoryCategory::kFragmentation, kDaemonLedgerEntry,
                  MemoryCategory::kActivation, booked_fragmentation_ - target);
  }
  booked_fragmentation_ = target;
}

bool ActivationStore::AllocateBlockLocked(Slice& slice) {
  std::optional<uint64_t> at = allocator_.Allocate(slice.bytes);
  if (!at.has_value()) return false;
  slice.has_block = true;
  slice.offset = skew_ + *at;
  slice.block = allocator_.BlockSize(*at);
  dirty_end_ = std::max(dirty_end_, slice.offset + slice.block);
  ledger_->Move(kDaemonLedgerEntry, MemoryCategory::kActivation, slice.job,
                MemoryCategory::kActivation, slice.block);
  SyncFreeBookingLocked();
  return true;
}

void ActivationStore::FreeBlockLocked(Slice& slice) {
  if (!slice.has_block) return;
  allocator_.Free(slice.offset - skew_);
  slice.has_block = false;
  slice.placement = 0;
  ledger_->Move(slice.job, MemoryCategory::kActivation, kDaemonLedgerEntry,
                MemoryCategory::kActivation, slice.block);
  SyncFreeBookingLocked();
}

void ActivationStore::DropFileLocked(Slice& slice) {
  if (slice.file.empty()) return;
  dropped_files_.push_back({slice.file, slice.file_bytes});
  dropped_bytes_ += slice.file_bytes;
  ForgetFileLocked(slice);
}

void ActivationStore::ForgetFileLocked(Slice& slice) {
  if (slice.file.empty()) return;
  spill_used_ -= std::min(spill_used_, slice.file_bytes);
  --spill_files_;
  slice.file.clear();
}

void ActivationStore::ReleaseIfIdleLocked(Slice& slice) {
  if (!slice.detached || slice.holds > 0 || slice.state == Slice::State::kSpilling ||
      slice.state == Slice::State::kReading) {
    return;
  }
  FreeBlockLocked(slice);
  DropFileLocked(slice);
}

void ActivationStore::DropLocked(JobEntry& entry, const std::shared_ptr<Slice>& slice) {
  auto it = entry.slices.find(slice->id);
  if (it != entry.slices.end() && it->second == slice) entry.slices.erase(it);
  slice->detached = true;
  ReleaseIfIdleLocked(*slice);
  NotifyLocked();
}

void ActivationStore::NotifyLocked() {
  ++generation_;
  changed_.SignalAll();
}

bool ActivationStore::RemovableLocked() const {
  const bool disk_idle = reading_ == 0 && spilling_.empty();
  return !dropped_files_.empty() && disk_idle;
}

bool ActivationStore::OverSpillBytesLocked() const {
  return spill_used_ + dropped_bytes_ > options_.spill_bytes;
}

bool ActivationStore::RemoveDroppedFiles(Removal removal) {
  absl::MutexLock removing(&remove_mu_);
  for (;;) {
    std::vector<DroppedFile> files;
    {
      absl::MutexLock lock(&mu_);
      bool more = false;
      switch (removal) {
        case Removal::kNow:
          more = !dropped_files_.empty();
          break;
        case Removal::kWhenDiskIdle:
          more = RemovableLocked();
          break;
        case Removal::kToFitSpillBytes:
          more = !dropped_files_.empty() && OverSpillBytesLocked();
          break;
      }
      if (!more) return true;
      if (removal == Removal::kNow) {  // all at once
        files.assign(std::make_move_iterator(dropped_files_.begin()),
                     std::make_move_iterator(dropped_files_.end()));
        dropped_files_.clear();
      } else {  // the oldest, one at a time, checking again before each
        files.push_back(std::move(dropped_files_.front()));
        dropped_files_.pop_front();
      }
      removing_files_ = files.size();
    }
    // One file a call, so that the disk timeout bounds one removal.
    uint64_t removed_bytes = 0;
    size_t removed = 0;
    while (removed < files.size() && RemoveSpillFile(files[removed].path)) {
      removed_bytes += files[removed].bytes;
      ++removed;
    }
    absl::MutexLock lock(&mu_);
    removing_files_ = 0;
    dropped_bytes_ -= removed_bytes;
    if (removed < files.size()) {
      // The disk does not answer: the rest kept for a later pass (removing
      // one twice is harmless).
      dropped_files_.insert(dropped_files_.begin(),
                            std::make_move_iterator(files.begin() + removed),
                            std::make_move_iterator(files.end()));
      return false;
    }
  }
}

absl::StatusOr<ActivationStore::JobEntry*> ActivationStore::EntryLocked(const SliceOwner& owner) {
  auto [it, inserted] = jobs_.try_emplace(owner.job_id);
  JobEntry& e = it->second;
  if (inserted) {
    e.instance = owner.instance;
    return &e;
  }
  if (SameInstance(e.instance, owner.instance)) {
    if (e.removed) {
      return absl::NotFoundError(absl::StrCat("job ", owner.job_id, " was removed from this daemon"));
    }
    return &e;
  }
  if (!e.removed && !e.instance.expired()) {
    // The entry's instance is live: the job was removed (its entry became a
    // tombstone) before this one was registered, so the caller is the older.
    return absl::NotFoundError(absl::StrCat(
        "job ", owner.job_id, " was removed from this daemon and registered again since"));
  }
  // The job was registered again: the old instance's slices went with it.
  std::vector<std::shared_ptr<Slice>> old;
  for (auto& [id, slice] : e.slices) old.push_back(slice);
  for (const auto& slice : old) DropLocked(e, slice);
  e.instance = owner.instance;
  e.removed = false;
  return &e;
}

absl::StatusOr<std::shared_ptr<ActivationStore::Slice>> ActivationStore::FindLocked(
    const SliceOwner& owner, const ActivationKey& key) {
  ASSIGN_OR_RETURN(JobEntry * entry, EntryLocked(owner));
  const Id id = MakeId(owner, key);
  auto it = entry->slices.find(id);
  if (it == entry->slices.end()) {
    return absl::NotFoundError(
        absl::StrCat("key: no ", Describe(owner.job_id, id), " is stored here (never offloaded, ",
                     "freed, or a reservation not committed within its lease)"));
  }
  return it->second;
}

std::string ActivationStore::NoRoomMessage(uint64_t bytes, uint64_t block) const {
  std::string spill =
      spill_dir_ == nullptr
          ? std::string("the spill space is 0 (no --spill_dir)")
          : absl::StrCat("the spill space (--spill_bytes=", options_.spill_bytes, " under ",
                         spill_dir_->dir(), ") has ",
                         Bytes(options_.spill_bytes - std::min(options_.spill_bytes, spill_used_)),
                         " free");
  return absl::StrCat("activation slice of ", Bytes(bytes), " (a block of ", block,
                      " B) does not fit: the arena (--activation_arena_bytes=",
                      options_.arena_bytes, ") has ", Bytes(allocator_.free_bytes()),
                      " free, its largest free block ", Bytes(allocator_.largest_free()),
                      ", and the rest is held by slices that cannot move (pinned, reserved, ",
                      "being read, or other jobs'); ", spill,
                      ". Free earlier steps' activations, or give the daemon a larger arena ",
                      "or spill space");
}

bool ActivationStore::SpillHungLocked(absl::Time now) const {
  if (!spilling_.empty() && now - spill_progress_at_ > options_.disk_timeout) return true;
  return spill_disk_ != nullptr && spill_disk_->Busy() > options_.disk_timeout;
}

bool ActivationStore::RemoveSpillFile(const std::string& path) {
  return spill_disk_
      ->Run([dir = spill_dir_, path] {
        dir->Remove(path);
        return absl::OkStatus();
      })
      .ok();
}

std::string ActivationStore::SpillHungMessage() const {
  return absl::StrCat("--spill_dir ", options_.spill_dir,
                      " has not completed a spill write within ",
                      DiskTimeoutFlag(options_.disk_timeout), " (its disk is hung or far too slow): nothing is spilled until it does, so "
                      "there is no room for this slice; keep it in the trainer meanwhile");
}

absl::StatusOr<int> ActivationStore::CreateSpillFile(const std::string& path) {
  // The file, if the creation ends after its caller stopped waiting: closed
  // and removed then, on spill_disk_'s thread.
  struct Created {
    absl::Mutex mu;
    bool abandoned ABSL_GUARDED_BY(mu) = false;
    int fd ABSL_GUARDED_BY(mu) = -1;
  };
  auto created = std::make_shared<Created>();
  const absl::Status s =
      spill_disk_->Run([dir = spill_dir_, path, created]() -> absl::Status {
        absl::StatusOr<int> fd = dir->OpenForWrite(path);
        if (!fd.ok()) return fd.status();
        absl::MutexLock lock(&created->mu);
        if (created->abandoned) {
          ::close(*fd);
          dir->Remove(path);
        } else {
          created->fd = *fd;
        }
        return absl::OkStatus();
      });
  absl::MutexLock lock(&created->mu);
  if (s.ok()) return created->fd;
  created->abandoned = true;
  // Created between the timeout and now: this thread must not wait for a
  // removal on that disk, so the file stays, as one a crash leaves.
  if (created->fd >= 0) ::close(created->fd);
  return s;
}

absl::Status ActivationStore::PlanRoomLocked(const JobEntry& entry, uint64_t block,
                                             const Slice* exclude, uint64_t slice_bytes,
                                             std::vector<std::shared_ptr<Slice>>* victims) const {
  victims->clear();
  ArenaAllocator plan = allocator_;
  // The room of writes in flight comes when they end: not while they hang.
  const bool hung = spill_dir_ != nullptr && SpillHungLocked(absl::Now());
  for (const Slice* s : spilling_) {
    if (!hung && !s->pinned && s->holds == 0) plan.Free(s->offset - skew_);
  }
  bool behind_others = false;  // room goes first to reservations waiting ahead
  for (const Slice* w : waiting_for_room_) {
    if (w == exclude) break;
    // One that would not fit plans its own room.
    behind_others |= plan.Allocate(w->bytes).has_value();
  }
  if (plan.Fits(slice_bytes)) return absl::OkStatus();  // the writes in flight make room
  if (hung) return absl::UnavailableError(SpillHungMessage());
  if (spill_dir_ != nullptr) {
    uint64_t spill_free = options_.spill_bytes - std::min(options_.spill_bytes, spill_used_);
    for (const auto& [id, s] : entry.slices) {
      // Slices being read back (prefetched) can move once they are in:
      // counted here, spilled by a later plan once the caller has waited.
      const bool reading = s->state == Slice::State::kReading;
      if (s.get() == exclude || (s->state != Slice::State::kStored && !reading) || s->pinned ||
          s->holds > 0) {
        continue;
      }
      const uint64_t file_bytes = spill_dir_->direct() ? s->block : s->bytes;
      if (file_bytes > spill_free) continue;
      plan.Free(s->offset - skew_);
      spill_free -= file_bytes;
      if (!reading) victims->push_back(s);
      if (plan.Fits(slice_bytes)) return absl::OkStatus();
    }
  }
  victims->clear();
  // Once those ahead have their room, what they leave may do: wait for them.
  if (behind_others) return absl::OkStatus();
  return absl::ResourceExhaustedError(NoRoomMessage(slice_bytes, block));
}

std::vector<ActivationStore::IoStart> ActivationStore::BeginSpillsLocked(
    const std::vector<std::shared_ptr<Slice>>& victims) {
  std::vector<IoStart> io;
  for (const auto& v : victims) {
    // Progress is counted from the first write of a run.
    if (spilling_.empty()) spill_progress_at_ = absl::Now();
    v->state = Slice::State::kSpilling;
    v->io_error = absl::OkStatus();
    v->file = spill_dir_->NewPath();
    v->file_bytes = spill_dir_->direct() ? v->block : v->bytes;
    spill_used_ += v->file_bytes;
    ++spill_files_;
    spilling_.insert(v.get());
    IoStart start;
    start.slice = v;
    start.write = true;
    start.path = v->file;
    start.address = base_ + v->offset;
    start.length = v->file_bytes;
    start.crc_bytes = v->bytes;
    start.crc = v->crc;
    io.push_back(std::move(start));
  }
  return io;
}

ActivationStore::IoStart ActivationStore::BeginReadLocked(const std::shared_ptr<Slice>& slice) {
  IoStart start;
  if (!AllocateBlockLocked(*slice)) return start;  // the caller checked Fits
  slice->state = Slice::State::kReading;
  slice->io_error = absl::OkStatus();
  ++reading_;
  start.slice = slice;
  start.path = slice->file;
  start.address = base_ + slice->offset;
  start.length = slice->file_bytes;
  start.crc_bytes = slice->bytes;
  start.crc = slice->crc;
  return start;
}

// ---- File I/O (no lock held) ----

void ActivationStore::StartIo(std::vector<IoStart> io, absl::Time deadline) {
  if (std::any_of(io.begin(), io.end(), [](const IoStart& r) { return r.write; })) {
    // The spill files (these writes' booked by BeginSpillsLocked) and the
    // dropped ones still on disk must fit --spill_bytes: the dropped ones go
    // first when they would not.
    bool over;
    {
      absl::MutexLock lock(&mu_);
      over = OverSpillBytesLocked();
    }
    if (over) RemoveDroppedFiles(Removal::kToFitSpillBytes);  // a hung disk: no spill (below)
  }
  std::vector<std::function<void()>> checksums;  // of spills, run once all is queued
  for (IoStart& r : io) {
    if (r.slice == nullptr) continue;
    if (r.write) {
      bool freed;
      {
        absl::MutexLock lock(&mu_);
        freed = r.slice->detached;
      }
      if (freed) {  // before its write began: nothing written, no file to remove
        {
          absl::MutexLock lock(&mu_);
          ForgetFileLocked(*r.slice);
        }
        OnSpillWritten(r.slice, absl::OkStatus(), std::nullopt);
        continue;
      }
    }
    absl::StatusOr<int> fd =
        r.write ? CreateSpillFile(r.path) : spill_dir_->OpenForRead(r.path);
    if (!fd.ok()) {
      if (r.write) {
        // Not created by this call (O_EXCL), or not yet: nothing to remove
        // on a disk that may hang.
        {
          absl::MutexLock lock(&mu_);
          ForgetFileLocked(*r.slice);
        }
        OnSpillWritten(r.slice, fd.status(), std::nullopt);
      } else {
        OnReadBack(r.slice, fd.status(), false);
      }
      continue;
    }
    const int file = *fd;
    const std::shared_ptr<Slice> slice = r.slice;
    absl::Status queued;
    if (r.write) {
      // A slice committed without a checksum gets one as its bytes go to
      // disk, so that the read-back is checked all the same: taken once
      // every write is queued, while they run (both only read the block,
      // which is the spill's while the slice is kSpilling); whichever of
      // the two ends last reports.
      struct Join {
        std::atomic<int> parts{1};
        absl::Status status;          // the write's; set before its part ends
        std::optional<uint32_t> crc;  // set before this thread's part ends
      };
      auto join = std::make_shared<Join>();
      const bool take = !r.crc.has_value();
      if (take) join->parts.store(2, std::memory_order_relaxed);
      auto end_part = [this, slice, join] {
        if (join->parts.fetch_sub(1, std::memory_order_acq_rel) == 1) {
          OnSpillWritten(slice, join->status, join->crc);
        }
      };
      queued =
          io_->Write(file, r.address, r.length, deadline,
                     [this, file, join, end_part](absl::Status s) {
                       ::close(file);
                       {
                         // The disk answered: the hang clock starts again.
                         absl::MutexLock lock(&mu_);
                         spill_progress_at_ = absl::Now();
                       }
                       join->status = std::move(s);
                       end_part();
                     });
      if (queued.ok() && take) {
        checksums.push_back([join, end_part, address = r.address, n = r.crc_bytes] {
          join->crc = Crc32c(address, n);
          end_part();
        });
      }
    } else {
      const char* address = r.address;
      const uint64_t crc_bytes = r.crc_bytes;
      const std::optional<uint32_t> crc = r.crc;
      queued = io_->Read(file, r.address, r.length, deadline,
                         [this, slice, file, address, crc_bytes, crc](absl::Status s) {
                           ::close(file);
                           // The checksum is taken here, on the I/O thread, not under
                           // the store's lock (every spilled slice has one).
                           const bool crc_ok =
                               s.ok() && crc.has_value() && Crc32c(address, crc_bytes) == *crc;
                           OnReadBack(slice, std::move(s), crc_ok);
                         });
    }
    if (!queued.ok()) {
      ::close(file);
      if (r.write) {
        OnSpillWritten(slice, queued, std::nullopt);
      } else {
        OnReadBack(slice, queued, false);
      }
    }
  }
  for (const auto& take : checksums) take();
}

// A spill write's completion. A slice freed, pinned or fetched meanwhile
// (or whose write failed) stays in the arena and its file, if one was
// created, is dropped: removed by the remover thread once the disk has no
// spill I/O left, or first thing when the spill space is needed
// (RemoveDroppedFiles), never on this thread, which completes every other
// spill and read-back.
void ActivationStore::OnSpillWritten(const std::shared_ptr<Slice>& slice, absl::Status status,
                                     std::optional<uint32_t> crc) {
  std::string failure;
  {
    absl::MutexLock lock(&mu_);
    spilling_.erase(slice.get());
    slice->state = Slice::State::kStored;
    // Failed, freed, located or being fetched meanwhile: it stays in the
    // arena (ReleaseIfIdleLocked frees a freed one's block).
    if (!status.ok() || slice->detached || slice->pinned || slice->holds > 0) {
      if (!status.ok()) {
        failure = absl::StrCat("spilling ", Describe(slice->job, slice->id),
                               slice->file.empty() ? "" : absl::StrCat(" to ", slice->file),
                               " failed (it stays in memory): ", status.message());
        slice->io_error = status;
      }
      if (!slice->file.empty()) DropFileLocked(*slice);
    } else {
      if (crc.has_value()) slice->crc = crc;
      FreeBlockLocked(*slice);
      slice->state = Slice::State::kSpilled;
      if (metrics_ != nullptr) metrics_->RecordSpill(slice->job, slice->bytes);
    }
    ReleaseIfIdleLocked(*slice);
    NotifyLocked();
  }
  if (!failure.empty()) Log(failure);
}

// Read back or corrupt, the file is not needed any more: dropped, and
// removed once the disk has no spill I/O left (see the header).
void ActivationStore::OnReadBack(const std::shared_ptr<Slice>& slice, absl::Status status,
                                 bool crc_ok) {
  {
    absl::MutexLock lock(&mu_);
    --reading_;
    if (!status.ok()) {
      FreeBlockLocked(*slice);
      slice->state = Slice::State::kSpilled;
      slice->io_error = absl::Status(
          status.code(), absl::StrCat("reading ", Describe(slice->job, slice->id), " back from ",
                                      slice->file, ": ", status.message()));
    } else if (!crc_ok) {
      slice->io_error = absl::DataLossError(absl::StrCat(
          Describe(slice->job, slice->id), ": its spill file ", slice->file,
          " no longer holds its bytes (CRC-32C mismatch); offload it again"));
      FreeBlockLocked(*slice);
      DropFileLocked(*slice);
      slice->state = Slice::State::kCorrupt;
    } else {
      DropFileLocked(*slice);
      slice->state = Slice::State::kStored;
      slice->read_back = true;
    }
    ReleaseIfIdleLocked(*slice);
    NotifyLocked();
  }
}

void ActivationStore::AwaitIoEndLocked(const std::vector<std::shared_ptr<Slice>>& slices) {
  const absl::Time until = absl::Now() + kIoEndWait;
  // A freed slice whose spill write or read-back is in flight loses its
  // file when that ends (OnSpillWritten, OnReadBack). Not waited for while
  // the disk hangs (checked every second).
  auto busy = [](const Slice& s) {
    return s.state == Slice::State::kSpilling || s.state == Slice::State::kReading;
  };
  for (const auto& s : slices) {
    while (busy(*s) && absl::Now() < until && !SpillHungLocked(absl::Now())) {
      changed_.WaitWithDeadline(&mu_, std::min(until, absl::Now() + absl::Seconds(1)));
    }
  }
}

// ---- Reservations ----

absl::StatusOr<std::shared_ptr<ActivationStore::Slice>> ActivationStore::ReserveSlice(
    const SliceOwner& owner, const ActivationKey& key, uint64_t bytes, bool stream,
    absl::Time deadline) {
  if (bytes == 0) return absl::InvalidArgumentError("bytes: must be >= 1");
  if (bytes > capacity_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bytes: ", Bytes(bytes), " is more than the activation arena holds (",
        "--activation_arena_bytes=", options_.arena_bytes, ", ", capacity_, " B usable)"));
  }
  std::shared_ptr<Slice> slice;
  std::vector<std::shared_ptr<Slice>> victims;
  std::vector<IoStart> io;
  uint64_t seen = 0;  // generation_ when the room was planned
  // Hinted read-backs held back while reservations waited, started once
  // the last one has its room (after the lock is released).
  std::vector<IoStart> resumed;
  auto resume_hints = absl::MakeCleanup([&] { StartIo(std::move(resumed), deadline); });
  {
    absl::MutexLock lock(&mu_);
    if (!tenant_id_.empty() && !SameInstance(tenant_, owner.instance)) {
      return absl::FailedPreconditionError(ArenaLentMessage(tenant_id_));
    }
    ASSIGN_OR_RETURN(JobEntry * entry, EntryLocked(owner));
    const Id id = MakeId(owner, key);
    if (auto it = entry->slices.find(id); it != entry->slices.end()) {
      const Slice::State st = it->second->state;
      return absl::AlreadyExistsError(absl::StrCat(
          "key: ", Describe(owner.job_id, id), " is already ",
          st == Slice::State::kPending || st == Slice::State::kReserved ? "reserved" : "stored",
          "; free it first"));
    }
    if (entry->slices.size() + entry->lingering >= options_.max_slices_per_job) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "job ", owner.job_id, " holds ", entry->slices.size() + entry->lingering,
          " activation slices on this daemon, the most one job may; free those it has fetched "
          "(FreeActivations) before offloading more"));
    }
    slice = std::make_shared<Slice>();
    slice->id = id;
    slice->job = owner.job_id;
    slice->bytes = bytes;
    slice->stream = stream;
    if (!waiting_for_room_.empty() || !AllocateBlockLocked(*slice)) {
      RETURN_IF_ERROR(PlanRoomLocked(*entry, allocator_.RoundUp(bytes), nullptr, bytes, &victims));
      io = BeginSpillsLocked(victims);
      slice->state = Slice::State::kPending;
      slice->holds = 1;  // this request's, until it has a block
      entry->slices.emplace(id, slice);
      waiting_for_room_.push_back(slice.get());
      seen = generation_;
    } else {
      slice->state = Slice::State::kReserved;
      slice->holds = stream ? 1 : 0;
      slice->lease_end = absl::Now() + options_.reservation_lease;
      entry->slices.emplace(id, slice);
      return slice;
    }
  }
  for (;;) {
    StartIo(std::move(io), deadline);
    io.clear();
    absl::MutexLock lock(&mu_);
    auto busy = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      if (slice->detached) return false;
      // A free may make room before the victims' writes end.
      if (waiting_for_room_.front() == slice.get() && allocator_.Fits(bytes)) return false;
      for (const auto& v : victims) {
        if (v->state == Slice::State::kSpilling) return true;
      }
      return false;
    };
    bool timed_out = false;
    // Spill writes that do not end within the disk timeout: the disk hangs.
    const absl::Time wait_until = std::min(deadline, absl::Now() + options_.disk_timeout);
    if (victims.empty()) {
      // Room comes from writes already in flight: wait for any change.
      while (generation_ == seen && !slice->detached && !timed_out) {
        timed_out = changed_.WaitWithDeadline(&mu_, wait_until);
      }
    } else {
      while (busy() && !timed_out) timed_out = changed_.WaitWithDeadline(&mu_, wait_until);
    }
    auto leave_queue = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      waiting_for_room_.remove(slice.get());
      NotifyLocked();  // the next in line may take the room now
    };
    auto give_up = [&](absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      leave_queue();
      slice->holds = 0;
      if (!slice->detached) DropLocked(jobs_.at(slice->job), slice);
      return status;
    };
    if (slice->detached) {
      return give_up(absl::NotFoundError(absl::StrCat(
          "key: ", Describe(owner.job_id, slice->id),
          " was freed (or its job removed) while its reservation waited for room")));
    }
    if (waiting_for_room_.front() == slice.get() && AllocateBlockLocked(*slice)) {
      slice->state = Slice::State::kReserved;
      slice->holds = stream ? 1 : 0;
      slice->lease_end = absl::Now() + options_.reservation_lease;
      leave_queue();
      if (waiting_for_room_.empty()) resumed = ContinueHintsLocked(jobs_.at(slice->job));
      return slice;
    }
    for (const auto& v : victims) {
      if (!v->io_error.ok()) {
        return give_up(absl::Status(v->io_error.code(),
                                    absl::StrCat("making room for ", Describe(owner.job_id, slice->id),
                                                 ": ", v->io_error.message())));
      }
    }
    if (absl::Now() >= deadline) {
      return give_up(absl::DeadlineExceededError(absl::StrCat(
          "waiting for spill writes to make room for ", Describe(owner.job_id, slice->id))));
    }
    if (absl::Status s = PlanRoomLocked(jobs_.at(slice->job), allocator_.RoundUp(bytes),
                                        slice.get(), bytes, &victims);
        !s.ok()) {
      return give_up(s);
    }
    io = BeginSpillsLocked(victims);
    seen = generation_;
  }
}

absl::StatusOr<SlicePlacement> ActivationStore::Reserve(const SliceOwner& owner,
                                                        const ActivationKey& key, uint64_t bytes,
                                                        absl::Time deadline) {
  ASSIGN_OR_RETURN(std::shared_ptr<Slice> slice, ReserveSlice(owner, key, bytes, false, deadline));
  absl::MutexLock lock(&mu_);
  slice->placement = ++last_placement_;
  SlicePlacement p;
  p.offset = slice->offset;
  p.bytes = slice->bytes;
  p.placement = slice->placement;
  return p;
}

absl::StatusOr<std::unique_ptr<ActivationStore::Incoming>> ActivationStore::ReserveIncoming(
    const SliceOwner& owner, const ActivationKey& key, uint64_t bytes, absl::Time deadline) {
  ASSIGN_OR_RETURN(std::shared_ptr<Slice> slice, ReserveSlice(owner, key, bytes, true, deadline));
  uint64_t offset;
  {
    absl::MutexLock lock(&mu_);
    offset = slice->offset;  // fixed while the stream holds it
  }
  return std::unique_ptr<Incoming>(new Incoming(this, slice, base_ + offset, bytes));
}

ActivationStore::Incoming::~Incoming() {
  if (!done_) store_->AbandonIncoming(slice_);
}

absl::Status ActivationStore::Incoming::Commit(uint32_t crc32c) {
  done_ = true;
  return store_->CommitIncoming(slice_, crc32c);
}

absl::Status ActivationStore::CommitIncoming(const std::shared_ptr<Slice>& slice,
                                             uint32_t crc32c) {
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    slice->holds = 0;
    if (slice->detached) {
      ReleaseIfIdleLocked(*slice);
      status = absl::NotFoundError(absl::StrCat(
          "key: ", Describe(slice->job, slice->id),
          " was freed (or its job removed) while it was being received"));
    } else {
      slice->commit_crc = crc32c;
      slice->crc = crc32c;
      slice->state = Slice::State::kStored;
      NotifyLocked();
    }
  }
  return status;
}

void ActivationStore::AbandonIncoming(const std::shared_ptr<Slice>& slice) {
  {
    absl::MutexLock lock(&mu_);
    slice->holds = 0;
    if (slice->detached) {
      ReleaseIfIdleLocked(*slice);
    } else {
      DropLocked(jobs_.at(slice->job), slice);
    }
  }
}

absl::StatusOr<uint64_t> ActivationStore::Commit(const SliceOwner& owner, const ActivationKey& key,
                                                 std::optional<uint32_t> crc32c) {
  std::shared_ptr<Slice> slice;
  const char* data = nullptr;
  {
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(slice, FindLocked(owner, key));
    const std::string what = Describe(owner.job_id, slice->id);
    switch (slice->state) {
      case Slice::State::kReserved:
        if (slice->stream) {
          return absl::FailedPreconditionError(
              absl::StrCat("key: ", what, " is being received on an OffloadActivation stream"));
        }
        if (!crc32c.has_value()) {
          // Trusts the transport: stored as put.
          slice->state = Slice::State::kStored;
          NotifyLocked();
          return slice->bytes;
        }
        slice->state = Slice::State::kCommitting;
        ++slice->holds;
        data = base_ + slice->offset;
        break;
      case Slice::State::kPending:
        return absl::FailedPreconditionError(
            absl::StrCat("key: ", what, " is still waiting for room; commit after the reserve returns"));
      case Slice::State::kCommitting:
        return absl::FailedPreconditionError(
            absl::StrCat("key: a commit of ", what, " is in progress"));
      case Slice::State::kCorrupt:
        return slice->io_error;
      default:
        if (slice->commit_crc == crc32c) return slice->bytes;  // committed like this already
        return absl::AlreadyExistsError(absl::StrCat(
            "key: ", what, " is stored; its commit carried ", DescribeCrc(slice->commit_crc),
            ", this one carries ", DescribeCrc(crc32c)));
    }
  }
  // The checksum of what the trainer put, with no lock held: the block is
  // this request's while the slice is kCommitting.
  const uint32_t actual = Crc32c(data, slice->bytes);
  const uint32_t expected = *crc32c;
  absl::MutexLock lock(&mu_);
  --slice->holds;
  if (slice->detached) {
    ReleaseIfIdleLocked(*slice);
    return absl::NotFoundError(absl::StrCat("key: ", Describe(owner.job_id, slice->id),
                                            " was freed while its commit was being checked"));
  }
  if (actual != expected) {
    DropLocked(jobs_.at(slice->job), slice);
    return absl::DataLossError(absl::StrFormat(
        "crc32c: the %d bytes put for %s have CRC-32C %08x, the commit names %08x (corrupted "
        "or incomplete put); the reservation is dropped, reserve and put again",
        slice->bytes, Describe(owner.job_id, slice->id), actual, expected));
  }
  slice->commit_crc = expected;
  slice->crc = expected;
  slice->state = Slice::State::kStored;
  NotifyLocked();
  return slice->bytes;
}

// ---- Fetches ----

absl::Status ActivationStore::EnsureInArena(const std::shared_ptr<Slice>& slice,
                                            absl::Time deadline, bool* missed) {
  *missed = false;
  bool read_started = false;
  for (;;) {
    if (slice->detached) {
      return absl::NotFoundError(absl::StrCat("key: ", Describe(slice->job, slice->id),
                                              " was freed meanwhile"));
    }
    std::vector<IoStart> io;
    std::vector<std::shared_ptr<Slice>> victims;
    switch (slice->state) {
      case Slice::State::kStored:
      case Slice::State::kSpilling:  // still in the arena; the write leaves it there
        return absl::OkStatus();
      case Slice::State::kPending:
      case Slice::State::kReserved:
      case Slice::State::kCommitting:
        return absl::FailedPreconditionError(absl::StrCat(
            "key: ", Describe(slice->job, slice->id), " is reserved but not committed"));
      case Slice::State::kCorrupt:
        return slice->io_error;
      case Slice::State::kReading:
        *missed = true;
        if (changed_.WaitWithDeadline(&mu_, deadline)) {
          return absl::DeadlineExceededError(absl::StrCat(
              "waiting for ", Describe(slice->job, slice->id), " to be read back from its spill file"));
        }
        continue;
      case Slice::State::kSpilled:
        *missed = true;
        if (read_started && !slice->io_error.ok()) return slice->io_error;
        if (allocator_.Fits(slice->bytes)) {
          io.push_back(BeginReadLocked(slice));
          read_started = true;
        } else {
          RETURN_IF_ERROR(PlanRoomLocked(jobs_.at(slice->job), allocator_.RoundUp(slice->bytes),
                                         slice.get(), slice->bytes, &victims));
          io = BeginSpillsLocked(victims);
        }
        break;
    }
    const uint64_t seen = generation_;
    mu_.Unlock();
    StartIo(std::move(io), deadline);
    mu_.Lock();
    if (read_started) continue;  // kReading now (or done): the top of the loop waits
    // Waiting for room: for the victims' writes, or (none chosen) for the
    // writes already in flight to change anything.
    bool timed_out = false;
    auto waiting = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      if (slice->detached) return false;
      if (victims.empty()) return generation_ == seen;
      for (const auto& v : victims) {
        if (v->state == Slice::State::kSpilling) return true;
      }
      return false;
    };
    // Spill writes that do not end within the disk timeout: the disk hangs.
    const absl::Time wait_until = std::min(deadline, absl::Now() + options_.disk_timeout);
    while (waiting() && !timed_out) timed_out = changed_.WaitWithDeadline(&mu_, wait_until);
    for (const auto& v : victims) {
      if (!v->io_error.ok()) {
        return absl::Status(v->io_error.code(),
                            absl::StrCat("making room to read ", Describe(slice->job, slice->id),
                                         " back: ", v->io_error.message()));
      }
    }
    // Plan again: while the disk hangs, PlanRoomLocked says so.
    if (timed_out && wait_until < deadline) continue;
    if (timed_out && !allocator_.Fits(slice->bytes)) {
      return absl::DeadlineExceededError(absl::StrCat(
          "waiting for room to read ", Describe(slice->job, slice->id), " back"));
    }
  }
}

absl::StatusOr<SlicePlacement> ActivationStore::Locate(const SliceOwner& owner,
                                                       const ActivationKey& key,
                                                       absl::Time deadline) {
  SlicePlacement p;
  {
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(std::shared_ptr<Slice> slice, FindLocked(owner, key));
    bool missed = false;
    RETURN_IF_ERROR(EnsureInArena(slice, deadline, &missed));
    missed |= slice->read_back;
    slice->read_back = false;
    slice->pinned = true;
    p.offset = slice->offset;
    p.bytes = slice->bytes;
    p.crc32c = slice->crc;
    p.was_spilled = missed;
  }
  if (metrics_ != nullptr) {
    p.was_spilled ? metrics_->RecordMiss(owner.job_id) : metrics_->RecordHit(owner.job_id);
  }
  return p;
}

absl::Status ActivationStore::Fetch(const SliceOwner& owner, const ActivationKey& key,
                                    absl::Time deadline, uint64_t chunk_bytes,
                                    const FetchWriter& write) {
  std::shared_ptr<Slice> slice;
  SlicePlacement p;
  {
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(slice, FindLocked(owner, key));
    bool missed = false;
    RETURN_IF_ERROR(EnsureInArena(slice, deadline, &missed));
    missed |= slice->read_back;
    slice->read_back = false;
    ++slice->holds;  // keeps the block in place while the pieces are sent
    p.offset = slice->offset;
    p.bytes = slice->bytes;
    p.crc32c = slice->crc;
    p.was_spilled = missed;
  }
  if (metrics_ != nullptr) {
    p.was_spilled ? metrics_->RecordMiss(owner.job_id) : metrics_->RecordHit(owner.job_id);
  }
  absl::Status status;
  const uint64_t step = std::max<uint64_t>(chunk_bytes, 1);
  for (uint64_t off = 0; off < p.bytes; off += step) {
    const uint64_t n = std::min(step, p.bytes - off);
    if (!write(p, off, absl::string_view(base_ + p.offset + off, n))) {
      status = absl::CancelledError("the client stopped reading the fetch stream");
      break;
    }
  }
  absl::MutexLock lock(&mu_);
  --slice->holds;
  ReleaseIfIdleLocked(*slice);
  NotifyLocked();
  return status;
}

absl::StatusOr<uint32_t> ActivationStore::Prefetch(const SliceOwner& owner,
                                                   const std::vector<ActivationKey>& keys,
                                                   absl::Time deadline) {
  std::vector<IoStart> io;
  {
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(JobEntry * entry, EntryLocked(owner));
    // The latest hint replaces the rank's earlier one.
    std::deque<Id>& later = entry->hinted[owner.rank];
    later.clear();
    for (const ActivationKey& key : keys) {
      const Id id = MakeId(owner, key);
      auto it = entry->slices.find(id);
      if (it == entry->slices.end()) continue;
      const std::shared_ptr<Slice>& s = it->second;
      if (s->state != Slice::State::kSpilled) continue;
      if (!waiting_for_room_.empty() || !allocator_.Fits(s->bytes)) {
        later.push_back(id);  // read back once a free makes room
        continue;
      }
      io.push_back(BeginReadLocked(s));
    }
    if (later.empty()) entry->hinted.erase(owner.rank);
  }
  const uint32_t started = static_cast<uint32_t>(io.size());
  StartIo(std::move(io), deadline);
  return started;
}

std::vector<ActivationStore::IoStart> ActivationStore::ContinueHintsLocked(JobEntry& entry) {
  std::vector<IoStart> io;
  // Room a spill is being made for belongs to the request waiting for it,
  // and free room to the reservations waiting for some.
  if (spill_dir_ == nullptr || !spilling_.empty() || !waiting_for_room_.empty()) return io;
  for (auto h = entry.hinted.begin(); h != entry.hinted.end();) {
    std::deque<Id>& ids = h->second;
    while (!ids.empty()) {
      auto it = entry.slices.find(ids.front());
      if (it == entry.slices.end() || it->second->state != Slice::State::kSpilled) {
        ids.pop_front();  // freed, or in the arena by now
        continue;
      }
      if (!allocator_.Fits(it->second->bytes)) break;  // in the hint's order
      io.push_back(BeginReadLocked(it->second));
      ids.pop_front();
    }
    h = ids.empty() ? entry.hinted.erase(h) : std::next(h);
  }
  return io;
}

// ---- Frees ----

absl::StatusOr<ActivationStore::Freed> ActivationStore::FreeMatching(
    const SliceOwner& owner, const std::function<bool(const Id&, const Slice&)>& match) {
  Freed freed;
  std::vector<IoStart> io;
  std::vector<std::shared_ptr<Slice>> doomed;
  {
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(JobEntry * entry, EntryLocked(owner));
    for (const auto& [id, slice] : entry->slices) {
      if (id.rank == owner.rank && match(id, *slice)) doomed.push_back(slice);
    }
    const absl::Time now = absl::Now();
    for (const auto& slice : doomed) {
      ++freed.slices;
      freed.bytes += slice->bytes;
      if (slice->state == Slice::State::kReserved && !slice->stream && slice->has_block &&
          slice->lease_end > now) {
        // A Put into the reservation may still land until its lease ends
        // (one stopped at its deadline): the block stays its own until then.
        ++slice->holds;
        ++entry->lingering;
        lingering_.push_back(slice);
      }
      DropLocked(*entry, slice);
    }
    // The room just freed: the next hinted slices come back while the
    // caller uses the ones it has (the disk works ahead of the fetches).
    if (freed.slices > 0) io = ContinueHintsLocked(*entry);
  }
  StartIo(std::move(io), absl::Now() + kHintQueueWait);
  {
    absl::MutexLock lock(&mu_);
    AwaitIoEndLocked(doomed);
  }
  return freed;
}

absl::StatusOr<ActivationStore::Freed> ActivationStore::FreeKey(const SliceOwner& owner,
                                                                const ActivationKey& key) {
  {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(FindLocked(owner, key).status());
  }
  const Id want = MakeId(owner, key);
  ASSIGN_OR_RETURN(Freed freed,
                   FreeMatching(owner, [&](const Id& id, const Slice&) { return id == want; }));
  if (freed.slices == 0) {  // freed by someone else in between
    return absl::NotFoundError(absl::StrCat("key: no ", Describe(owner.job_id, want),
                                            " is stored here"));
  }
  return freed;
}

absl::StatusOr<std::optional<ActivationStore::Freed>> ActivationStore::ReleaseFetched(
    const SliceOwner& owner, const ActivationKey& key, uint64_t placement) {
  {
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(std::shared_ptr<Slice> slice, FindLocked(owner, key));
    switch (slice->state) {
      case Slice::State::kPending:
      case Slice::State::kReserved:
      case Slice::State::kCommitting:
        return absl::FailedPreconditionError(absl::StrCat(
            "key: ", Describe(owner.job_id, slice->id), " is reserved but not committed"));
      default:
        break;
    }
  }
  const Id want = MakeId(owner, key);
  // Checked under the lock that frees it. A spill write in flight only
  // reads the block: the bytes are still there, as they were for the Get.
  ASSIGN_OR_RETURN(
      Freed freed, FreeMatching(owner, [&](const Id& id, const Slice& s) {
        return id == want && s.placement == placement &&
               (s.state == Slice::State::kStored || s.state == Slice::State::kSpilling);
      }));
  // Moved (or freed since the look above: the locate that follows says so).
  if (freed.slices == 0) return std::nullopt;
  if (metrics_ != nullptr) metrics_->RecordHit(owner.job_id);
  return freed;
}

absl::StatusOr<ActivationStore::Freed> ActivationStore::FreeStep(const SliceOwner& owner,
                                                                 uint64_t step) {
  ASSIGN_OR_RETURN(Freed freed, FreeMatching(owner, [step](const Id& id, const Slice&) {
                     return id.key.step == step;
                   }));
  RemoveDroppedFiles(Removal::kNow);
  return freed;
}

absl::StatusOr<ActivationStore::Freed> ActivationStore::FreeAll(const SliceOwner& owner) {
  ASSIGN_OR_RETURN(Freed freed, FreeMatching(owner, [](const Id&, const Slice&) { return true; }));
  RemoveDroppedFiles(Removal::kNow);
  return freed;
}

void ActivationStore::RemoveJob(const std::string& job_id,
                                const std::shared_ptr<const void>& instance) {
  std::vector<std::shared_ptr<Slice>> all;
  {
    absl::MutexLock lock(&mu_);
    auto [it, inserted] = jobs_.try_emplace(job_id);
    JobEntry& e = it->second;
    if (!inserted && !SameInstance(e.instance, instance) && !e.removed && !e.instance.expired()) {
      return;  // a newer instance of the job holds the entry
    }
    for (auto& [id, slice] : e.slices) all.push_back(slice);
    for (const auto& slice : all) DropLocked(e, slice);
    // Its freed reservations keep their blocks out their leases (bytes
    // already sent may still land after its key is revoked).
    e.hinted.clear();
    // Kept as a tombstone, so that a request of the removed instance still
    // in flight stores nothing; pruned once the instance is gone.
    e.instance = instance;
    e.removed = true;
    AwaitIoEndLocked(all);
  }
  RemoveDroppedFiles(Removal::kNow);
}

void ActivationStore::ReleaseLingeringLocked(const std::function<bool(const Slice&)>& which) {
  size_t kept = 0;
  bool released = false;
  for (size_t i = 0; i < lingering_.size(); ++i) {
    Slice& slice = *lingering_[i];
    if (!which(slice)) {
      lingering_[kept++] = std::move(lingering_[i]);
      continue;
    }
    --slice.holds;
    ReleaseIfIdleLocked(slice);
    released = true;
    auto job = jobs_.find(slice.job);
    if (job == jobs_.end()) continue;
    JobEntry& e = job->second;
    --e.lingering;
    if ((e.removed || e.instance.expired()) && e.slices.empty() && e.lingering == 0) {
      // The job's own removal found its booking still in use.
      ledger_->RemoveJobIfEmpty(slice.job);
    }
  }
  lingering_.resize(kept);
  if (released) NotifyLocked();
}

void ActivationStore::Tick() { Tick(absl::Now()); }

void ActivationStore::Tick(absl::Time now) {
  {
    absl::MutexLock lock(&mu_);
    ReleaseLingeringLocked([now](const Slice& slice) { return slice.lease_end <= now; });
    for (auto it = jobs_.begin(); it != jobs_.end();) {
      JobEntry& e = it->second;
      std::vector<std::shared_ptr<Slice>> expired;
      for (const auto& [id, slice] : e.slices) {
        if (slice->state == Slice::State::kReserved && !slice->stream && slice->holds == 0 &&
            slice->lease_end <= now) {
          expired.push_back(slice);
        }
      }
      for (const auto& slice : expired) DropLocked(e, slice);
      if (e.slices.empty() && e.lingering == 0 && e.instance.expired()) {
        it = jobs_.erase(it);
      } else {
        ++it;
      }
    }
  }
}

void ActivationStore::RunRemover() {
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      auto work = [this]()
                      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || RemovableLocked(); };
      mu_.Await(absl::Condition(&work));
      if (stop_) return;
    }
    if (!RemoveDroppedFiles(Removal::kWhenDiskIdle)) {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Seconds(1));
    }
  }
}

void ActivationStore::RunJanitor() {
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
      if (mu_.AwaitWithTimeout(absl::Condition(&stopping), options_.janitor_period)) return;
    }
    Tick();
  }
}

// ---- Introspection ----

bool ActivationStore::BeginTenancy(const std::shared_ptr<const void>& instance,
                                   const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  if (!tenant_id_.empty()) return SameInstance(tenant_, instance);
  size_t tenant_blocks = 0;
  for (const auto& [id, e] : jobs_) {
    const bool tenant = SameInstance(e.instance, instance);
    if (!e.slices.empty() && !tenant) return false;
    if (!tenant) continue;
    for (const auto& [slice_id, slice] : e.slices) tenant_blocks += slice->has_block;
  }
  // A block of a slice no longer listed (freed while being read, written,
  // spilled or read back, or a freed reservation waiting out its lease)
  // may hold another job's bytes still: not now.
  if (allocator_.used_blocks() != tenant_blocks) return false;
  // Every block in use is the new tenant's: zero the rest of what blocks
  // ever covered (past dirty_end_ the region is as it was allocated, zero).
  uint64_t at = 0;
  for (const auto& [offset, size] : allocator_.used()) {
    if (at < dirty_end_) std::memset(base_ + at, 0, std::min(skew_ + offset, dirty_end_) - at);
    at = skew_ + offset + size;
  }
  if (at < dirty_end_) std::memset(base_ + at, 0, dirty_end_ - at);
  dirty_end_ = std::min(dirty_end_, at);
  tenant_ = instance;
  tenant_id_ = job_id;
  return true;
}

void ActivationStore::EndTenancy() {
  absl::MutexLock lock(&mu_);
  tenant_.reset();
  tenant_id_.clear();
}

absl::Status ActivationStore::IssueTenantKey() {
  if (transport_ == nullptr || region_ == nullptr) {
    return absl::FailedPreconditionError("the activation arena has no bulk transport");
  }
  absl::StatusOr<std::unique_ptr<transport::Region>> key = transport_->RegisterRegion(
      region_->base(), region_->length(), transport::Access::kRemoteReadWrite);
  if (!key.ok()) {
    return absl::Status(key.status().code(), absl::StrCat("activation arena key: ",
                                                          key.status().message()));
  }
  std::unique_ptr<transport::Region> old = *std::move(key);
  {
    // The key reaches the whole region: from here any byte of it may hold
    // what its holder put there.
    absl::MutexLock lock(&mu_);
    dirty_end_ = region_bytes_;
  }
  {
    absl::MutexLock lock(&key_mu_);
    tenant_key_.swap(old);
  }
  return absl::OkStatus();  // `old`, if any, is revoked here with no lock held
}

void ActivationStore::RevokeTenantKey() {
  std::unique_ptr<transport::Region> old;
  {
    absl::MutexLock lock(&key_mu_);
    tenant_key_.swap(old);
  }
}

void ActivationStore::FillRegion(v1::ExchangeEndpointResponse* response) const {
  absl::MutexLock lock(&key_mu_);
  if (tenant_key_ == nullptr) return;
  const transport::RegionDescriptor& d = tenant_key_->Descriptor();
  v1::RemoteRegion* r = response->add_regions();
  r->set_purpose(v1::REGION_PURPOSE_ACTIVATION_ARENA);
  r->set_address(d.address);
  r->set_length(d.length);
  r->set_rkey(d.rkey);
}

ActivationStore::Stats ActivationStore::GetStats() const {
  absl::MutexLock lock(&mu_);
  Stats s;
  s.arena_free = allocator_.free_bytes();
  s.arena_largest_free = allocator_.largest_free();
  s.fragmentation = allocator_.fragmentation();
  s.spill_used = spill_used_;
  s.dropped_files = dropped_files_.size() + removing_files_;
  s.dropped_bytes = dropped_bytes_;
  s.spill_files = spill_files_;
  for (const auto& [id, e] : jobs_) s.slices += e.slices.size();
  s.in_flight = spilling_.size() + reading_;
  return s;
}

uint64_t ActivationStore::StateHash() const {
  absl::MutexLock lock(&mu_);
  uint64_t h = kFnv1aOffset;
  allocator_.Hash(h);
  HashValue(h, spill_used_);
  for (const auto& [job, e] : jobs_) {
    if (e.slices.empty()) continue;  // an entry alone holds nothing
    Fnv1aMix(h, job.data(), job.size());
    for (const auto& [id, s] : e.slices) {
      HashValue(h, id.key.step);
      HashValue(h, id.key.layer);
      HashValue(h, id.key.micro_batch);
      HashValue(h, id.rank);
      HashValue(h, id.key.mp_rank);
      HashValue(h, id.key.mp_size);
      HashValue(h, s->state);
      HashValue(h, s->bytes);
      HashValue(h, s->has_block);
      HashValue(h, s->offset);
      HashValue(h, s->pinned);
      HashValue(h, s->placement);
      HashValue(h, s->commit_crc.has_value());
      HashValue(h, s->commit_crc.value_or(0));
      HashValue(h, s->crc.has_value());
      HashValue(h, s->crc.value_or(0));
      HashValue(h, s->file_bytes);
    }
  }
  return h;
}

}  // namespace zeroshard
