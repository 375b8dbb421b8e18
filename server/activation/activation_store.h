#pragma once

// A daemon's activation checkpoints (ZeRO-R P_a+cpu; the wire API is
// proto/zeroshard/v1/activation.proto, served by ActivationService).
//
// Memory: one arena of --activation_arena_bytes, in a region allocated once
// at start through the bulk transport (remote read and write, handed out as
// the ACTIVATION_ARENA region) or as plain memory without one, one alignment
// unit larger so that the arena can start aligned wherever the region does.
// ArenaAllocator places slices in it. The ledger books the whole region at
// start (the --memory_limit check applies then): each job's blocks as that
// job's `activation`, the arena's largest free block as `activation` of
// kDaemonLedgerEntry, and the rest of the free space, which no slice larger
// than the largest block can use, as its `fragmentation` (with the region's
// few bytes outside the aligned arena). So the jobs' activation bytes, the
// free block and the fragmentation always add up to the region, and they
// move between those entries without changing the total.
//
// Spill: with an InstanceDirectory (server/disk) at --spill_dir, a slice that
// does not fit makes room by moving the same job's oldest stored slices
// (lowest step, then lowest layer: backward fetches them last) to files, up
// to --spill_bytes; pinned, reserved and busy slices never move. A fetch of a
// spilled slice reads it back (a miss); a prefetch does so ahead of time. A
// file is dropped when its slice is read back or freed (or, once its spill
// write ends, when the slice was pinned, fetched or freed meanwhile or the
// write failed: the slice stays in the arena), and removed once no
// spill write or read-back is in flight: on a file system mounted with online
// discard (`-o discard`) each removal sends the disk a discard of the file's
// blocks, which slowed reads of 32 MiB spill files on ext4 by about a fifth
// when each file was removed right after its read. So a backward pass's files
// go when its read-backs pause or end (on the store's remover thread, one
// file at a time while the disk stays idle; "idle" is this store's own spill
// I/O: daemons sharing a directory do not see each other's). The oldest go at
// once when a spill needs their space, and every dropped file of the store
// (any job's) before a free of a whole step, of all of a rank's slices or of
// a job returns. With direct I/O, blocks are aligned to
// InstanceDirectory::kDirectAlignment so that they go to the files without a
// copy; otherwise to 64 bytes.
//
// Slices are keyed by their owner (job, rank) and their ActivationKey
// (common/activation_protocol.h: step, micro-batch, layer, mp_rank,
// mp_size; the service validates it) and belong to one job instance: a job
// removed (every rank left) loses all of them at once, and a job registered
// again under the same id is a new instance that starts empty.
//
// Threads: every method is thread-safe. One lock guards the store's state;
// no disk I/O, network I/O, waiting or checksum over a slice happens under
// it. Waits (for room, for a read-back) end at the caller's deadline
// (DeadlineExceeded; what was started goes on in the background and changes
// nothing the caller relied on); a free's wait for the spill I/O of the
// slices it freed ends after 30 s, or at once while the disk hangs. File I/O
// completes on SpillIo's thread; a janitor thread drops bulk reservations
// not committed within their lease; a remover thread removes dropped files
// once the disk is idle.
//
// Room in the arena: reservations that must wait for spills get it in the
// order they came (one waiting reservation holds up later ones, of any job,
// until its spills end); prefetch read-backs do not start while any wait.
// A fetch of a spilled slice reads it back as soon as it fits: a backward
// pass waiting for its activations goes first.

#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/activation_protocol.h"
#include "proto/zeroshard/v1/shard.pb.h"
#include "server/activation/activation_allocator.h"
#include "server/disk/disk_worker.h"
#include "server/activation/activation_metrics.h"
#include "server/activation/activation_spill.h"
#include "server/disk/instance_directory.h"
#include "server/ledger/memory_ledger.h"
#include "transport/transport.h"

namespace zeroshard {

// Whose slices: a rank of one job instance. `instance` identifies the job
// object (the daemon passes its Job); it is compared, never dereferenced.
struct SliceOwner {
  std::string job_id;
  std::shared_ptr<const void> instance;
  uint32_t rank = 0;
};

// Where a slice lies in the arena region.
struct SlicePlacement {
  uint64_t offset = 0;  // bytes from the start of the arena region
  uint64_t bytes = 0;
  // Its checksum when known: the commit's, or the daemon's from when it
  // spilled the slice.
  std::optional<uint32_t> crc32c;
  // Read back from a spill file for this request, or ahead of it by a
  // prefetch since the slice was last fetched (a miss either way).
  bool was_spilled = false;
  // Reserve: the reservation's number (never 0, never the same twice), for
  // ReleaseFetched.
  uint64_t placement = 0;
};

// Why another job's activation request is refused while the arena's key
// is lent to job `tenant` (ArenaTenancy).
std::string ArenaLentMessage(const std::string& tenant);

class ActivationStore {
 private:
  struct Slice;

 public:
  struct Options {
    uint64_t arena_bytes = 0;  // > 0
    std::string spill_dir;     // empty: no spilling
    uint64_t spill_bytes = 0;  // bytes of spill files at most
    // A bulk reservation not committed within this is dropped.
    absl::Duration reservation_lease = absl::Seconds(30);
    // Slices one job may hold (reserved, stored or spilled) at once: each
    // costs the daemon bookkeeping and, spilled, a file, whatever its size.
    // RESOURCE_EXHAUSTED past it.
    size_t max_slices_per_job = size_t{1} << 16;
    // How often the janitor looks for expired reservations; zero: no janitor
    // thread (tests call Tick()).
    absl::Duration janitor_period = absl::Milliseconds(100);
    unsigned io_queue_depth = 64;
    // Spill writes in flight of which none ends within this (or a file's
    // creation or removal that runs this long) count the spill directory as
    // hung: a reservation waiting for room ends UNAVAILABLE, and while it is
    // hung nothing more is spilled (room that needs a spill is UNAVAILABLE
    // at once). Creations and removals run on a thread of their own, so
    // that a hung disk holds no request's thread. Longer than the write of
    // the largest slice.
    absl::Duration disk_timeout = absl::Seconds(10);
    // Whether a remover thread removes dropped files once the disk is idle
    // (see the top). false (tests): only spills that need their space, frees
    // of a step or more and the destructor remove them.
    bool idle_removals = true;
  };

  // Allocates the arena (through `transport` when not null, remote read and
  // write) and books it in `ledger` (ResourceExhausted naming
  // --activation_arena_bytes and --memory_limit when it does not fit); opens
  // the spill directory (removing files of dead daemons) and its io_uring.
  // `metrics` may be null. Everything borrowed must outlive the store.
  static absl::StatusOr<std::unique_ptr<ActivationStore>> Create(
      const Options& options, transport::Transport* transport, MemoryLedger* ledger,
      ActivationMetrics* metrics);
  // Waits for file I/O in flight, frees every slice, removes the spill files
  // and releases the arena's booking.
  ~ActivationStore();

  // ---- The bulk path ----
  // Allocates `bytes` for `key`, spilling the owner's job's oldest stored
  // slices when the arena has no room, and waiting (until `deadline`) for
  // those writes. ALREADY_EXISTS when the key is stored or reserved;
  // INVALID_ARGUMENT for 0 bytes or more than the arena; RESOURCE_EXHAUSTED
  // naming the arena and spill sizes when they cannot hold it (nothing
  // changes); NOT_FOUND when the job instance was removed. The reservation
  // is dropped unless committed within the reservation lease.
  absl::StatusOr<SlicePlacement> Reserve(const SliceOwner& owner, const ActivationKey& key,
                                         uint64_t bytes, absl::Time deadline);
  // Stores the slice, checking the CRC-32C of the reserved bytes first when
  // one is given (DATA_LOSS, and the reservation is dropped, on a mismatch);
  // returns its size. Committing a stored slice again with the same CRC-32C
  // (or again none) answers as the first commit did; otherwise
  // ALREADY_EXISTS. NOT_FOUND without a
  // reservation (never made, expired or freed); FAILED_PRECONDITION while it
  // waits for room or is being streamed.
  absl::StatusOr<uint64_t> Commit(const SliceOwner& owner, const ActivationKey& key,
                                  std::optional<uint32_t> crc32c);
  // Brings the slice into the arena (reading it back from its spill file,
  // making room like Reserve, waiting until `deadline`), pins it there until
  // it is freed, and says where it is. NOT_FOUND for an unknown or freed
  // key; FAILED_PRECONDITION for one not committed; DATA_LOSS when its spill
  // file no longer holds its bytes.
  absl::StatusOr<SlicePlacement> Locate(const SliceOwner& owner, const ActivationKey& key,
                                        absl::Time deadline);

  // ---- The streaming path ----
  // A slice received on a stream: its reserved arena bytes, which the one
  // thread holding this writes with no lock. Destroying it uncommitted drops
  // the reservation; it never expires meanwhile.
  class Incoming {
   public:
    ~Incoming();
    Incoming(const Incoming&) = delete;
    Incoming& operator=(const Incoming&) = delete;
    char* data() const { return data_; }
    uint64_t bytes() const { return bytes_; }
    // Stores the slice with `crc32c`, the checksum of the bytes written
    // (computed by the caller as they came). NOT_FOUND when it was freed
    // meanwhile (FreeActivations, or the job left).
    absl::Status Commit(uint32_t crc32c);

   private:
    friend class ActivationStore;
    Incoming(ActivationStore* store, std::shared_ptr<Slice> slice, char* data, uint64_t bytes)
        : store_(store), slice_(std::move(slice)), data_(data), bytes_(bytes) {}
    ActivationStore* const store_;
    const std::shared_ptr<Slice> slice_;
    char* const data_;
    const uint64_t bytes_;
    bool done_ = false;  // Commit was called
  };
  // Reserve for a stream: same rules and errors.
  absl::StatusOr<std::unique_ptr<Incoming>> ReserveIncoming(const SliceOwner& owner,
                                                            const ActivationKey& key,
                                                            uint64_t bytes, absl::Time deadline);
  // Brings the slice into the arena like Locate (without pinning it), then
  // calls `write` with consecutive pieces of at most `chunk_bytes` (>= 1),
  // with no lock held; the slice stays in place until the last returns.
  // `write` returning false stops with CANCELLED. Errors as Locate.
  using FetchWriter = std::function<bool(const SlicePlacement& slice, uint64_t offset,
                                         absl::string_view data)>;
  absl::Status Fetch(const SliceOwner& owner, const ActivationKey& key, absl::Time deadline,
                     uint64_t chunk_bytes, const FetchWriter& write);

  // ---- Both ----
  // Starts reading the given spilled slices back into the arena, in order,
  // while there is room without spilling anything; unknown keys and slices
  // not spilled are skipped. Returns how many read-backs started (each
  // completes in the background). Blocks only to queue the reads, at most
  // until `deadline`. The spilled slices that had no room are remembered
  // (the rank's latest hint replaces its earlier one) and read back, in the
  // hint's order, as frees of the rank's slices make room, unless spill
  // writes are in flight or reservations wait for room then: so the disk
  // reads ahead of a backward pass that frees each slice once fetched.
  absl::StatusOr<uint32_t> Prefetch(const SliceOwner& owner, const std::vector<ActivationKey>& keys,
                                    absl::Time deadline);
  struct Freed {
    uint32_t slices = 0;
    uint64_t bytes = 0;  // the slices' sizes
  };
  // Frees one key (NOT_FOUND when unknown), every key of the owner's rank at
  // `step`, or every slice of the owner's rank. Reservations go too. Their
  // spill files are dropped (see the top): FreeStep and FreeAll return once
  // every dropped file of the store is gone (unless the spill I/O in flight
  // of the slices they free has not ended within 30 s, or the disk hangs:
  // those files go later), FreeKey leaves them to be removed when the disk's spill I/O
  // pauses.
  absl::StatusOr<Freed> FreeKey(const SliceOwner& owner, const ActivationKey& key);
  // The end of a bulk fetch that read the slice where its reservation put
  // it, without locating it (`placement`: that Reserve's): frees the slice
  // like FreeKey, counting a fetch from the arena, if it is still in the
  // block of that reservation and has not left it since its commit (so a Get
  // from there that ended before this call read its bytes); the check and
  // the free are one step under the lock. Otherwise changes nothing and
  // returns nullopt: the trainer locates the slice and gets it again.
  // NOT_FOUND for an unknown key, FAILED_PRECONDITION for one not committed.
  absl::StatusOr<std::optional<Freed>> ReleaseFetched(const SliceOwner& owner,
                                                      const ActivationKey& key,
                                                      uint64_t placement);
  absl::StatusOr<Freed> FreeStep(const SliceOwner& owner, uint64_t step);
  absl::StatusOr<Freed> FreeAll(const SliceOwner& owner);

  // Frees every slice of the job instance and refuses its later requests
  // (NOT_FOUND). A newer instance under the same id is left alone. Call it
  // before a newer instance can exist (JobManager::Options::on_remove).
  void RemoveJob(const std::string& job_id, const std::shared_ptr<const void>& instance);

  // One janitor pass (exposed for tests): drops bulk reservations past their
  // lease, and lets go of the blocks of freed ones whose lease has ended;
  // `now` stands for the time (tests).
  void Tick();
  void Tick(absl::Time now);

  // The arena's tenancy (ArenaTenancy lends the key): makes `instance` (job
  // `job_id`) the one job whose slices the arena holds, unless another job
  // instance holds any slice (reserved, stored, spilled or being read back)
  // or a block of a slice no longer listed is still in use (a freed slice
  // being read, written or read back, a freed reservation waiting out its
  // lease): false then, and nothing changes. On true, every byte of the
  // arena region outside the tenant's own blocks is zeroed first (under the
  // store's lock; before any key was issued, only what blocks covered),
  // so what former jobs left in freed blocks is not readable with the key;
  // until
  // EndTenancy(), other jobs' reservations are refused with
  // FAILED_PRECONDITION naming the tenant. Checked under the lock every
  // reservation takes, so no other job's slice enters the arena meanwhile.
  bool BeginTenancy(const std::shared_ptr<const void>& instance, const std::string& job_id)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Ends the tenancy: every job may reserve again.
  void EndTenancy() ABSL_LOCKS_EXCLUDED(mu_);

  // The arena's key for its tenant (the one job the arena is lent to, see
  // ArenaTenancy): a registration of the arena's memory of its own, made when
  // a job becomes the tenant and destroyed when it stops being one, so that
  // a key a former tenant kept reaches nothing (where the transport enforces
  // keys). IssueTenantKey replaces any key issued before; it blocks while the
  // memory is registered. FailedPrecondition without a transport.
  absl::Status IssueTenantKey() ABSL_LOCKS_EXCLUDED(key_mu_);
  void RevokeTenantKey() ABSL_LOCKS_EXCLUDED(key_mu_);
  // Adds the ACTIVATION_ARENA region under the tenant's key; nothing when no
  // key is issued.
  void FillRegion(v1::ExchangeEndpointResponse* response) const ABSL_LOCKS_EXCLUDED(key_mu_);
  // Bytes a slice may have: the arena's usable size (arena_bytes rounded
  // down to the alignment).
  uint64_t capacity() const { return capacity_; }
  uint64_t arena_bytes() const { return options_.arena_bytes; }
  // How long a bulk reservation waits for its commit (Options).
  absl::Duration reservation_lease() const { return options_.reservation_lease; }
  // The region's size, all booked: the arena and one alignment unit, of
  // which what lies outside the aligned arena counts as fragmentation.
  uint64_t region_bytes() const { return region_bytes_; }
  uint64_t spill_capacity() const { return spill_dir_ == nullptr ? 0 : options_.spill_bytes; }
  // The arena's block alignment.
  uint64_t alignment() const { return alignment_; }
  const InstanceDirectory* spill_directory() const { return spill_dir_.get(); }

  struct Stats {
    uint64_t arena_free = 0;
    uint64_t arena_largest_free = 0;
    uint64_t fragmentation = 0;  // as booked: free outside the largest block
    uint64_t spill_used = 0;     // bytes in live spill files (and writes in flight)
    size_t spill_files = 0;
    // Files dropped and not removed yet, and their bytes (not in spill_used).
    size_t dropped_files = 0;
    uint64_t dropped_bytes = 0;
    size_t slices = 0;       // every job's, stored or reserved
    size_t in_flight = 0;    // spill writes and read-backs
  };
  Stats GetStats() const;
  // A hash of every slice's state and the allocator's, for tests that check
  // a refused request changed nothing.
  uint64_t StateHash() const;

 private:
  struct JobEntry;
  // A slice within its job: the owner's rank and the key. Ordered for
  // spilling: lowest step, then lowest layer (backward fetches them last),
  // then micro-batch, rank, mp_rank, mp_size.
  struct Id {
    ActivationKey key;
    uint32_t rank = 0;
    bool operator<(const Id& o) const;
    bool operator==(const Id& o) const { return key == o.key && rank == o.rank; }
  };
  // Which dropped files RemoveDroppedFiles removes. kWhenDiskIdle (the
  // remover thread): one at a time while no spill write or read-back is in
  // flight. kToFitSpillBytes (spills): the oldest, one at a time, until the
  // spill files and the dropped ones fit --spill_bytes. kNow (frees of a
  // step or more, the destructor): all; it returns once every file dropped
  // before the call is gone, also those another thread took.
  enum class Removal { kWhenDiskIdle, kToFitSpillBytes, kNow };
  // One file read or write to start once the lock is released.
  struct IoStart {
    std::shared_ptr<Slice> slice;
    bool write = false;
    std::string path;
    char* address = nullptr;
    uint64_t length = 0;
    uint64_t crc_bytes = 0;  // the bytes the CRC covers
    // read: the CRC expected; write: unset when the daemon is to take it
    // before writing (the commit carried none).
    std::optional<uint32_t> crc;
  };

  ActivationStore(const Options& options, MemoryLedger* ledger, ActivationMetrics* metrics);
  static Id MakeId(const SliceOwner& owner, const ActivationKey& key);
  // The owner's job entry, created on first use, and taken over by a new
  // instance of the job once the old one was removed (RemoveJob) or is gone.
  // NOT_FOUND for a removed instance, and for one older than the entry's.
  absl::StatusOr<JobEntry*> EntryLocked(const SliceOwner& owner)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::shared_ptr<Slice>> FindLocked(const SliceOwner& owner,
                                                    const ActivationKey& key)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::shared_ptr<Slice>> ReserveSlice(const SliceOwner& owner,
                                                      const ActivationKey& key, uint64_t bytes,
                                                      bool stream, absl::Time deadline);
  // Whether spill writes are in flight and none has ended for longer than
  // options_.disk_timeout, or a file's creation or removal has run that
  // long; the sentence that says so.
  bool SpillHungLocked(absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string SpillHungMessage() const;
  // A new spill file, created on spill_disk_ (Unavailable when the disk
  // does not answer within options_.disk_timeout).
  absl::StatusOr<int> CreateSpillFile(const std::string& path);
  // Removes a spill file on spill_disk_; false when the disk did not
  // answer within options_.disk_timeout (it may go later, or not at all).
  bool RemoveSpillFile(const std::string& path);
  // Makes room for a block of `block` bytes: picks victims (the job's oldest
  // stored slices, never `exclude`) whose spilling, with the spills already
  // in flight, frees a block that large once the reservations waiting
  // ahead of `exclude` (all of them when it is not waiting) have their
  // blocks; starts nothing. No victims with OK: wait for the I/O in flight
  // (spills, and read-backs whose slices can then move) or for those ahead
  // to have their room, and plan again. RESOURCE_EXHAUSTED when even all of
  // them would not do; UNAVAILABLE when it would need a spill while the
  // spill directory is hung (SpillHungLocked).
  absl::Status PlanRoomLocked(const JobEntry& entry, uint64_t block, const Slice* exclude,
                              uint64_t slice_bytes, std::vector<std::shared_ptr<Slice>>* victims)
      const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks the victims spilling and returns their writes.
  std::vector<IoStart> BeginSpillsLocked(const std::vector<std::shared_ptr<Slice>>& victims)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Allocates the slice's block and returns its read-back.
  IoStart BeginReadLocked(const std::shared_ptr<Slice>& slice) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Opens the files and queues the I/O (no lock held; the store's lock is
  // taken by the completions).
  void StartIo(std::vector<IoStart> io, absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);
  // `crc`: the checksum the daemon took of the slice before writing it, if
  // it had none.
  void OnSpillWritten(const std::shared_ptr<Slice>& slice, absl::Status status,
                      std::optional<uint32_t> crc) ABSL_LOCKS_EXCLUDED(mu_);
  // Waits (at most kIoEndWait, and not while the spill disk hangs; mu_
  // released meanwhile) until none of `slices` has a spill write or
  // read-back in flight (whose end drops the file of a freed slice).
  void AwaitIoEndLocked(const std::vector<std::shared_ptr<Slice>>& slices)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnReadBack(const std::shared_ptr<Slice>& slice, absl::Status status, bool crc_ok)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Begins the read-backs of the job's remembered hints (Prefetch) that
  // fit now, in each hint's order; none while spills are in flight (their
  // room is for the request waiting on them) or reservations wait for room.
  std::vector<IoStart> ContinueHintsLocked(JobEntry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Brings a committed slice into the arena (see Locate); on OK it is
  // stored in the arena (possibly still being written to its file) and
  // *missed says whether it had to be read back. Releases the lock while it
  // starts file I/O and while it waits (until `deadline`).
  absl::Status EnsureInArena(const std::shared_ptr<Slice>& slice, absl::Time deadline,
                             bool* missed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes the slice out of its job's map and frees it, or, while I/O or a
  // reader holds it, marks it for the holder to free.
  void DropLocked(JobEntry& entry, const std::shared_ptr<Slice>& slice)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees a detached slice's block and file once nothing holds it.
  void ReleaseIfIdleLocked(Slice& slice) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FreeBlockLocked(Slice& slice) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves the slice's file to dropped_files_ (removed by RemoveDroppedFiles).
  void DropFileLocked(Slice& slice) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The file's booking only, for a file already removed (or never written).
  void ForgetFileLocked(Slice& slice) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool AllocateBlockLocked(Slice& slice) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Books the free space's split into largest block and fragmentation.
  void SyncFreeBookingLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees the owner's matching slices (`match` runs under the lock) and
  // waits for their spill I/O to end (their files are dropped; removing them
  // is the caller's choice).
  absl::StatusOr<Freed> FreeMatching(const SliceOwner& owner,
                                     const std::function<bool(const Id&, const Slice&)>& match);
  std::string NoRoomMessage(uint64_t bytes, uint64_t block) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts a state change and wakes every waiter.
  void NotifyLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes dropped files (on spill_disk_, no lock held but remove_mu_ and
  // mu_ briefly) until none is left that `removal` takes. False when the
  // disk did not answer within options_.disk_timeout: those files stay
  // dropped, for a later call.
  bool RemoveDroppedFiles(Removal removal) ABSL_LOCKS_EXCLUDED(mu_, remove_mu_);
  // Whether the remover thread has files to remove now.
  bool RemovableLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether the live spill files and the dropped ones together pass
  // --spill_bytes.
  bool OverSpillBytesLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // remover_: RemoveDroppedFiles(kWhenDiskIdle) whenever RemovableLocked(),
  // until stop_ (once a second while the disk does not answer). Request
  // threads and SpillIo's thread never wait for those removals.
  void RunRemover();
  absl::Status CommitIncoming(const std::shared_ptr<Slice>& slice, uint32_t crc32c)
      ABSL_LOCKS_EXCLUDED(mu_);
  void AbandonIncoming(const std::shared_ptr<Slice>& slice) ABSL_LOCKS_EXCLUDED(mu_);
  void RunJanitor();
  // Lets go of the lingering reservations `which` picks (their block is
  // freed unless something else holds it).
  void ReleaseLingeringLocked(const std::function<bool(const Slice&)>& which)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  MemoryLedger* const ledger_;
  ActivationMetrics* const metrics_;
  transport::Transport* transport_ = nullptr;
  std::unique_ptr<transport::Region> region_;  // with a transport; its own key is never lent
  // A leaf: taken by nothing else while held.
  mutable absl::Mutex key_mu_;
  std::unique_ptr<transport::Region> tenant_key_ ABSL_GUARDED_BY(key_mu_);
  void* memory_ = nullptr;                     // without one (mmap)
  char* base_ = nullptr;                       // the region's first byte
  uint64_t region_bytes_ = 0;
  // Blocks start at region offset skew_ + k * alignment_, aligned in memory.
  uint64_t skew_ = 0;
  uint64_t alignment_ = 64;
  uint64_t capacity_ = 0;
  // Shared with the calls left on spill_disk_ by a hung disk.
  std::shared_ptr<InstanceDirectory> spill_dir_;
  // Creates and removes spill files; with spill_dir_.
  std::unique_ptr<DiskWorker> spill_disk_;
  // Declared after everything its callbacks touch except the state below,
  // and reset first by the destructor.
  std::unique_ptr<SpillIo> io_;

  // Held while dropped files are taken and removed (file system calls, no
  // other lock held but mu_ briefly inside it).
  absl::Mutex remove_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  mutable absl::Mutex mu_;
  absl::CondVar changed_;  // any slice changed state
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;  // counts those changes
  uint64_t last_placement_ ABSL_GUARDED_BY(mu_) = 0;  // Reserve's numbers
  ArenaAllocator allocator_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, JobEntry> jobs_ ABSL_GUARDED_BY(mu_);
  // Freed bulk reservations whose lease has not ended, each with a hold on
  // its block (a Put stopped at its deadline may still land there).
  std::vector<std::shared_ptr<Slice>> lingering_ ABSL_GUARDED_BY(mu_);
  // Region bytes below this may hold what a slice (or a key's holder) left;
  // past it the region is as allocated (zero). The whole region once a key
  // has been issued.
  uint64_t dirty_end_ ABSL_GUARDED_BY(mu_) = 0;
  // The tenant (BeginTenancy) and its job id; an empty id: none (job ids
  // are never empty).
  std::weak_ptr<const void> tenant_ ABSL_GUARDED_BY(mu_);
  std::string tenant_id_ ABSL_GUARDED_BY(mu_);
  std::set<Slice*> spilling_ ABSL_GUARDED_BY(mu_);  // writes in flight
  // When the disk last completed a spill write, or the first of spilling_
  // began.
  absl::Time spill_progress_at_ ABSL_GUARDED_BY(mu_);
  // Reservations waiting for room, oldest first. Room goes to them in this
  // order, and each plans its spills counting the room of those ahead of it
  // that fit the plan: a later one does not take the room an earlier one's
  // spill makes.
  std::list<const Slice*> waiting_for_room_ ABSL_GUARDED_BY(mu_);
  size_t reading_ ABSL_GUARDED_BY(mu_) = 0;         // read-backs in flight
  uint64_t spill_used_ ABSL_GUARDED_BY(mu_) = 0;
  size_t spill_files_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t booked_fragmentation_ ABSL_GUARDED_BY(mu_) = 0;
  struct DroppedFile {
    std::string path;
    uint64_t bytes = 0;
  };
  std::deque<DroppedFile> dropped_files_ ABSL_GUARDED_BY(mu_);  // oldest first
  size_t removing_files_ ABSL_GUARDED_BY(mu_) = 0;   // taken by a remover, not yet gone
  uint64_t dropped_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // of both
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread janitor_;
  std::thread remover_;  // with a spill directory
};

}  // namespace zeroshard
