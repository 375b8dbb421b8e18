#pragma once

// Activation checkpoints kept outside the trainer (ZeRO-R P_a+cpu), bytes in
// and bytes out: a stage-3 trainer offloads each layer's checkpoint as its
// forward pass ends, fetches it back for the layer's recomputation in
// backward, and frees it. With model parallelism of degree M each MP rank
// stores only its slice of a checkpoint (P_a; client/activation_slices.h
// cuts and reassembles), under a key naming its mp_rank and M. The key
// (ActivationKey) and its validator are common/activation_protocol.h's,
// the daemon's own.
//
// Two implementations:
//  - LocalSliceStore: copies in the trainer's own memory (the
//    reference the daemon-backed store must equal, and tests);
//  - DaemonSliceStore: the slices live on ONE daemon's Activation
//    service (proto/zeroshard/v1/activation.proto), in its arena or its
//    spill files. Over a bulk transport the bytes are Put into the daemon's
//    ACTIVATION_ARENA region at the offset ReserveActivation returned and
//    announced by CommitActivation (with their CRC-32C when
//    Options::checksums); a fetch is LocateActivation, a Get at the
//    placement, a check of the slice's CRC-32C and (by default)
//    FreeActivations. A fetch that frees the slice skips the locate when the
//    daemon numbered the slice's reservation (ActivationPlacement.placement):
//    a Get at the offset the slice was reserved at, then a FreeActivations
//    (if_placement) that frees it only if it never left that place (else
//    the fetch locates it and gets it again). Without a bulk transport, or
//    when the daemon hands out no arena region, the streaming RPCs
//    (OffloadActivation / FetchActivation) carry the bytes in checksummed
//    chunks; so does a slice larger than the arena region (a daemon that
//    cannot hold it answers InvalidArgument).
//
// Threads: every method is thread-safe. Offload, StartFetch and Prefetch
// return at once with a ticket; the work runs on the store's own worker
// threads (DaemonSliceStore::Options::threads), in submission order as
// far as the workers allow: a fetch, prefetch or free of a key waits for the
// offload of that key submitted before it, so "offload then fetch" needs no
// wait in between. FreeStep and Free block their caller.
//
// Deadlines: nothing blocks without one. Each RPC and each transport
// operation is bounded by Options::rpc_timeout from the moment a worker
// starts it, and the Put into a reservation also by half the reservation's
// lease (ActivationPlacement.lease_ms); a ticket's Wait takes the caller's
// deadline.
//
// Errors (one meaning per code, the daemon's address and the key in the
// message): InvalidArgument: a bad key, size or buffer, or a fetch whose
// buffer does not match the slice's size (nothing was sent, or nothing
// written into the buffer); AlreadyExists: the key is stored or being
// offloaded already; NotFound: no such slice (never offloaded, or freed);
// ResourceExhausted: the daemon's arena and spill space are full (nothing
// stored is lost); DataLoss: a checksum or a reply's shape did not match;
// Unavailable: the daemon cannot be reached; DeadlineExceeded.

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/bulk_data_path.h"
#include "client/executor.h"
#include "common/activation_protocol.h"
#include "grpcpp/grpcpp.h"
#include "proto/zeroshard/v1/activation.grpc.pb.h"

namespace zeroshard {

// Completion of one asynchronous store operation. Copyable; copies share
// state. A default-constructed ticket is complete and OK.
class ActivationTicket {
 public:
  ActivationTicket() = default;
  explicit ActivationTicket(std::shared_ptr<CountDown> state) : state_(std::move(state)) {}
  // A ticket that is already complete with `status`.
  static ActivationTicket Ready(const absl::Status& status);

  // Blocks until the operation is done (its status) or `deadline`
  // (DeadlineExceeded; the operation goes on and still owns its buffer).
  // Any thread, any number of times.
  absl::Status Wait(absl::Time deadline) const;
  bool done() const { return state_ == nullptr || state_->done(); }

 private:
  std::shared_ptr<CountDown> state_;
};

// What to do with a slice once a fetch has its bytes.
enum class AfterFetch {
  kFree,  // free it in the store (the slice is used once: backward)
  kKeep,  // keep it (it may be fetched again)
};

struct SliceStoreStats {
  // Bytes of slices the store holds for the caller now (committed, not yet
  // freed), wherever they are: the daemon's arena or spill files, or the
  // trainer's memory for LocalSliceStore.
  uint64_t stored_bytes = 0;
  uint64_t peak_stored_bytes = 0;
  // Bytes of the trainer's memory the store holds: LocalSliceStore's
  // copies, or the caller's buffers lent to offloads and fetches in flight
  // (the store allocates none of its own then).
  uint64_t trainer_bytes = 0;
  uint64_t peak_trainer_bytes = 0;
  uint64_t offloads = 0, fetches = 0;  // completed successfully
  uint64_t offload_bytes = 0, fetch_bytes = 0;
  uint64_t failures = 0;          // operations that ended in an error
  uint64_t spilled_offloads = 0;  // daemon: stored straight to a spill file
  uint64_t spilled_fetches = 0;   // daemon: read back from a spill file (misses)
  uint64_t streamed = 0;          // daemon: operations over the streaming RPCs
};

class ActivationSliceStore {
 public:
  virtual ~ActivationSliceStore() = default;

  // "local", or "daemon <address> (<data path>)": the bulk transport's
  // name, or "stream" (once known: after the first operation).
  virtual std::string name() const = 0;

  // Starts storing `bytes` (1..kMaxActivationSliceBytes) bytes from `data`
  // under `key`. `data` is borrowed: the store reads it until the ticket
  // completes, errors included, and the caller must neither modify nor free
  // it before then.
  // InvalidArgument / AlreadyExists at once (nothing sent); other errors
  // reach the ticket.
  virtual absl::StatusOr<ActivationTicket> Offload(const ActivationKey& key, const void* data,
                                                   uint64_t bytes) = 0;

  // Starts fetching the slice `key` into `dst`, which must be exactly the
  // slice's size (`bytes`; InvalidArgument otherwise, on the ticket). `dst`
  // belongs to the store until the ticket completes (its contents are
  // undefined on error). Waits for an offload of `key` submitted before.
  virtual absl::StatusOr<ActivationTicket> StartFetch(const ActivationKey& key, void* dst,
                                                      uint64_t bytes, AfterFetch then) = 0;

  // StartFetch and wait for it until `deadline`. On DeadlineExceeded the
  // fetch still owns `dst` (wait on nothing else: the store's destructor
  // waits for it).
  absl::Status Fetch(const ActivationKey& key, void* dst, uint64_t bytes, AfterFetch then,
                     absl::Time deadline);

  // A hint that these slices will be fetched soon, in this order: a daemon
  // reads spilled ones back into its arena as room allows. Unknown keys are
  // ignored. Asynchronous; the ticket says whether the hint was delivered.
  virtual absl::StatusOr<ActivationTicket> Prefetch(absl::Span<const ActivationKey> keys) = 0;

  // Frees one slice (OK if it is not there), or every slice of `step`,
  // after the operations on them submitted before have ended. Blocks until
  // done or `deadline`; returns the bytes freed (DaemonSliceStore: FreeStep
  // sends nothing, and returns 0, when the daemon has confirmed freed every
  // slice of the step this store offloaded; it knows nothing of slices
  // another store of the same rank put there).
  virtual absl::StatusOr<uint64_t> Free(const ActivationKey& key, absl::Time deadline) = 0;
  virtual absl::StatusOr<uint64_t> FreeStep(uint64_t step, absl::Time deadline) = 0;

  virtual SliceStoreStats Stats() const = 0;
};

// Copies in the trainer's memory. Every operation is done when its call
// returns (the tickets are complete).
class LocalSliceStore final : public ActivationSliceStore {
 public:
  std::string name() const override { return "local"; }
  absl::StatusOr<ActivationTicket> Offload(const ActivationKey& key, const void* data,
                                           uint64_t bytes) override;
  absl::StatusOr<ActivationTicket> StartFetch(const ActivationKey& key, void* dst, uint64_t bytes,
                                              AfterFetch then) override;
  absl::StatusOr<ActivationTicket> Prefetch(absl::Span<const ActivationKey> keys) override;
  absl::StatusOr<uint64_t> Free(const ActivationKey& key, absl::Time deadline) override;
  absl::StatusOr<uint64_t> FreeStep(uint64_t step, absl::Time deadline) override;
  SliceStoreStats Stats() const override;

 private:
  mutable absl::Mutex mu_;
  std::map<ActivationKey, std::string> slices_ ABSL_GUARDED_BY(mu_);
  SliceStoreStats stats_ ABSL_GUARDED_BY(mu_);
};

// The slices on one daemon. Create it through Client::OpenActivationStore,
// which passes the client's rank, incarnation, channel and bulk data path
// (the rank must have joined the job on the daemon).
class DaemonSliceStore final : public ActivationSliceStore {
 public:
  struct Owner {
    std::string job_id;
    uint32_t rank = 0;
    uint64_t incarnation = 0;  // the rank's, >= 1
  };
  struct Options {
    // Workers running offloads, fetches and prefetch hints (1..16): with
    // two, one offload's Commit overlaps the next one's Put.
    int threads = 2;
    // Bounds each RPC and transport operation (from when a worker starts
    // it), and each wait for an earlier operation on the same key.
    absl::Duration rpc_timeout = absl::Seconds(60);
    // Payload of one streamed chunk (4 KiB .. kMaxChunkBytes).
    uint64_t stream_chunk_bytes = 4ull << 20;
    // Checksums on the bulk transport: each offload sends the CRC-32C of
    // its slice (taken while the transport moves it), which the daemon
    // checks before storing, and each fetch is checked against it. That is
    // one more read of every byte on each side, which costs about a third
    // of the offload and fetch throughput on shared memory (see
    // bench/activation_bench). Off, the bulk transport is trusted as it is
    // for gradients and parameters; the streaming path checks every chunk
    // either way, and the daemon checksums the slices it spills to disk.
    bool checksums = false;
  };

  // `channel` is the daemon's (shared with the client's control plane).
  // `bulk` is the client's data path to the daemon, or null for the
  // streaming RPCs only; it must outlive the store. Connects to nothing
  // yet: the first operation finds out whether the daemon hands out an
  // activation arena (else every slice is streamed).
  DaemonSliceStore(Owner owner, std::string address, std::shared_ptr<grpc::Channel> channel,
                   BulkDataPath* bulk, Options options);
  // Waits for every operation in flight (each bounded by its deadlines).
  // Frees nothing on the daemon: FreeStep does, and the daemon frees a
  // job's slices when the job is removed.
  ~DaemonSliceStore() override;

  std::string name() const override;
  absl::StatusOr<ActivationTicket> Offload(const ActivationKey& key, const void* data,
                                           uint64_t bytes) override;
  absl::StatusOr<ActivationTicket> StartFetch(const ActivationKey& key, void* dst, uint64_t bytes,
                                              AfterFetch then) override;
  absl::StatusOr<ActivationTicket> Prefetch(absl::Span<const ActivationKey> keys) override;
  absl::StatusOr<uint64_t> Free(const ActivationKey& key, absl::Time deadline) override;
  absl::StatusOr<uint64_t> FreeStep(uint64_t step, absl::Time deadline) override;
  SliceStoreStats Stats() const override;

  const std::string& address() const { return address_; }

 private:
  // How slices move: decided by the first operation.
  struct Path {
    bool bulk = false;         // Put/Get into the arena
    uint64_t arena_bytes = 0;  // larger slices are streamed
  };
  // A slice the daemon committed. A bulk offload's reservation: `offset`,
  // where the slice stays unless the daemon spills it, and `placement`, its
  // number (0: none, the daemon does not serve if_placement). `crc32c`: the
  // one the commit carried.
  struct Stored {
    uint64_t bytes = 0;
    uint64_t offset = 0;
    uint64_t placement = 0;
    std::optional<uint32_t> crc32c;
  };
  // How a fetch without a locate ended.
  enum class InPlace {
    kFreed,        // the daemon freed the slice there: `dst` holds its bytes
    kUnconfirmed,  // the bytes match the commit's CRC-32C; the free got no answer
    kMoved,        // not there (or not known to be): locate it and get it again
  };
  // An operation in flight on a key.
  struct Pending {
    std::shared_ptr<CountDown> done;
    bool offload = false;
  };

  v1::ActivationOwner OwnerProto() const;
  absl::Time Deadline() const { return absl::Now() + options_.rpc_timeout; }
  std::string What(absl::string_view rpc, const ActivationKey& key) const;
  absl::StatusOr<Path> GetPath(absl::Time deadline);
  // Registers an operation on `key`; returns the earlier ones to wait for
  // (all of them, or only offloads).
  std::vector<std::shared_ptr<CountDown>> Track(const ActivationKey& key,
                                                const std::shared_ptr<CountDown>& done,
                                                bool offload, bool wait_for_all)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Untrack(const ActivationKey& key, const CountDown* done) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits for `earlier` until `deadline`.
  static absl::Status AwaitAll(const std::vector<std::shared_ptr<CountDown>>& earlier,
                               absl::Time deadline, const std::string& what);

  // Run on a worker.
  absl::Status DoOffload(const ActivationKey& key, const void* data, uint64_t bytes, bool* spilled,
                         bool* streamed, Stored* stored);
  absl::Status OffloadBulk(const ActivationKey& key, const void* data, uint64_t bytes,
                           absl::Time deadline, bool* spilled, Stored* stored);
  absl::Status OffloadStream(const ActivationKey& key, const void* data, uint64_t bytes,
                             absl::Time deadline, bool* spilled);
  // *freed: the daemon confirmed the slice freed (with AfterFetch::kFree).
  absl::Status DoFetch(const ActivationKey& key, void* dst, uint64_t bytes, AfterFetch then,
                       bool* was_spilled, bool* streamed, bool* freed);
  absl::Status FetchBulk(const ActivationKey& key, void* dst, uint64_t bytes, absl::Time deadline,
                         bool* was_spilled);
  // A Get at the slice's reserved offset, then FreeActivations
  // if_placement. Errors: the Get's, or a size that does not match.
  absl::StatusOr<InPlace> FetchInPlace(const ActivationKey& key, const Stored& at, void* dst,
                                       uint64_t bytes, absl::Time deadline);
  absl::Status FetchStream(const ActivationKey& key, void* dst, uint64_t bytes,
                           absl::Time deadline);
  // Puts (`put`) or gets `bytes` at `offset` of the daemon's arena. With
  // `crc`, in pieces, each piece's CRC-32C taken while the next one moves;
  // *crc is the whole's. Blocks until done or `deadline`.
  absl::Status MoveRegion(bool put, uint64_t offset, uint8_t* buffer, uint64_t bytes,
                          absl::Time deadline, uint32_t* crc);
  // FreeActivations of one key (`whole_step` false; only if it is still
  // where reservation `if_placement` put it, when given) or of key.step.
  absl::StatusOr<v1::FreeActivationsResponse> FreeRpc(
      const ActivationKey& key, bool whole_step, absl::Time deadline,
      std::optional<uint64_t> if_placement = std::nullopt);
  // The slice is not on the daemon (freed, or never there): FreeStep need
  // not free it.
  void Forget(const ActivationKey& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Not stored as far as the caller is concerned, but it may be on the
  // daemon (an offload or a free that failed): FreeStep frees it.
  void MarkUnsure(const ActivationKey& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Owner owner_;
  const std::string address_;
  const std::unique_ptr<v1::Activation::Stub> stub_;
  BulkDataPath* const bulk_;
  const Options options_;

  absl::Mutex path_mu_;  // held while the path is being decided (one RPC)
  std::optional<Path> path_ ABSL_GUARDED_BY(path_mu_);
  std::atomic<bool> streaming_{false};  // decided: no arena, every slice streamed

  mutable absl::Mutex mu_;
  std::multimap<ActivationKey, Pending> pending_ ABSL_GUARDED_BY(mu_);
  std::map<ActivationKey, Stored> stored_ ABSL_GUARDED_BY(mu_);  // committed slices
  std::set<ActivationKey> unsure_ ABSL_GUARDED_BY(mu_);          // see MarkUnsure
  SliceStoreStats stats_ ABSL_GUARDED_BY(mu_);

  // Destroyed first: its workers use everything above.
  std::unique_ptr<Executor> workers_;
};

}  // namespace zeroshard
