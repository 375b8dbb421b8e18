#pragma once

// The node-level parameter cache of one job copy (JobSpec.node_cache): the
// parameters other daemons own, for one committed step, in the gather dtype,
// fetched from their owners once and read by every gather of that step that
// this daemon serves for its host's ranks (docs/protocol.md, "Node cache").
//
// No gRPC here: the owners are reached through a ParamFetcher
// (server/rpc/grpc_param_fetcher.h over the Shard service; fakes in tests).
//
// Threads: Get is called from gRPC handler threads, concurrently. The first
// caller for a step fetches with no lock held (single flight): every owner
// at once, one thread per owner beyond the first (which the caller's thread
// takes), started for that fetch and joined before it ends; the others
// wait for it until their own deadline. The cache's lock is a leaf, never
// held across a fetch or while the caller copies bytes out.
//
// Memory: a copy's bytes are booked in the ledger as the job's
// `param_cache` before they are allocated, and released when the last
// reader of the copy lets go of it (the cache holds one copy; a reader of
// the previous one may hold it a moment longer). The job's copy is freed
// with the job.

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/dtype.h"
#include "common/flat_range.h"
#include "server/ledger/memory_ledger.h"

namespace zeroshard {

// How the cache reads a range from the daemon that owns it.
class ParamFetcher {
 public:
  virtual ~ParamFetcher() = default;
  // Writes `range` (inside owner `owner`'s partitions) in `dtype` to `dst`
  // (range.size() * DTypeSize(dtype) bytes, the caller's, written only
  // during the call) once the owner has committed `after_step`, and
  // returns the committed step the bytes are at (>= after_step). Blocks
  // until done or `deadline`. Errors as the owner answers them
  // (Unavailable: unreachable; DeadlineExceeded; DataLoss: a reply that
  // does not match its checksum or range). On error `dst` may be partly
  // written. Called from several threads at once, one per owner, for
  // disjoint `dst` ranges.
  virtual absl::StatusOr<uint64_t> Fetch(uint32_t owner, const FlatRange& range, DType dtype,
                                         uint64_t after_step, absl::Time deadline,
                                         void* dst) = 0;
};

struct ParamCacheOptions {
  std::string job_id;  // the ledger entry booked
  DType dtype = DType::kFp32;  // what the cache holds: the job's gather dtype
  uint64_t total_elements = 0;  // the parameters cover [0, total_elements)
  FlatRange owned;              // this daemon's (unpadded): not cached
  // Every other daemon's unpadded range and its index, together tiling
  // [0, total_elements) without `owned`.
  std::vector<std::pair<uint32_t, FlatRange>> owners;
  MemoryLedger* ledger = nullptr;  // outlives the cache
};

class ParamCache {
 public:
  // One committed step's non-owned parameters; immutable once published.
  class Copy {
   public:
    ~Copy();
    uint64_t step() const { return step_; }
    // The bytes of `range`, which must lie outside the owned range and
    // inside the parameters (Contains).
    const uint8_t* At(const FlatRange& range) const;
    bool Contains(const FlatRange& range) const;

   private:
    friend class ParamCache;
    Copy(std::shared_ptr<const ParamCacheOptions> options, uint64_t bytes);
    uint8_t* MutableAt(const FlatRange& range) { return const_cast<uint8_t*>(At(range)); }
    const std::shared_ptr<const ParamCacheOptions> options_;  // a reader may outlive the cache
    const uint64_t bytes_;
    std::unique_ptr<uint8_t[]> data_;
    uint64_t step_ = 0;
  };

  explicit ParamCache(ParamCacheOptions options);
  ParamCache(const ParamCache&) = delete;
  ParamCache& operator=(const ParamCache&) = delete;

  // The bytes one copy takes: the non-owned elements in the cache's dtype.
  uint64_t copy_bytes() const { return copy_bytes_; }
  DType dtype() const { return options_->dtype; }

  // Fetches that completed (a copy published), Get calls answered from a
  // published copy, and the bytes of the owners' Fetch calls that
  // succeeded (those of a copy that failed as a whole included).
  struct Counts {
    uint64_t fetches = 0;
    uint64_t hits = 0;
    uint64_t bytes_fetched = 0;
  };

  // The copy of committed step `step`, held by the caller until it lets go:
  //  - the cached one when it is at `step`;
  //  - otherwise, when a fetch of `step` is in flight, that one's result,
  //    waited for until `deadline` (DeadlineExceeded; the fetch goes on);
  //  - otherwise this call fetches it with `fetcher` (every owner after
  //    `step`, concurrently, each with `deadline`, from threads of this
  //    call: `fetcher` must take concurrent Fetch calls; no lock held),
  //    publishes it and replaces the older copy. It returns once every
  //    owner's Fetch has returned, which each does by `deadline`.
  // Errors: FailedPrecondition when the cache holds or fetches a later
  // step than `step` (the caller passes the request through uncached);
  // ResourceExhausted when the ledger does not allow a copy (nothing
  // booked); Aborted when an owner answered a later step than `step` (it
  // committed the next one meanwhile; nothing published); a fetch's error
  // as it came (the first owner's, in `owners` order, when several
  // failed). A failed fetch leaves nothing (no copy, no booking) and is
  // the error of the callers that waited for it.
  // `served`, when not null, gets what this call added to counts(): a hit,
  // a fetch, and the bytes it read from owners (also when the copy failed).
  absl::StatusOr<std::shared_ptr<const Copy>> Get(uint64_t step, ParamFetcher& fetcher,
                                                  absl::Time deadline, Counts* served = nullptr);

  // Forgets the published copy, and keeps a fetch in flight from
  // publishing (its callers get Aborted): the parameters changed outside a
  // step (a state write, a checkpoint load). Readers keep what they hold.
  void Drop();

  Counts counts() const;

 private:
  // Books and allocates a copy, or reuses `reuse` (the cache's previous
  // copy, when nobody reads it).
  absl::StatusOr<std::shared_ptr<Copy>> NewCopy();
  // Fetches every owner's range into `copy` concurrently (see Get) and adds
  // the bytes of the owners' successful Fetch calls to `*bytes_fetched`.
  absl::Status FetchInto(Copy& copy, uint64_t step, ParamFetcher& fetcher, absl::Time deadline,
                         uint64_t* bytes_fetched);

  const std::shared_ptr<const ParamCacheOptions> options_;
  const uint64_t copy_bytes_;

  mutable absl::Mutex mu_;
  std::shared_ptr<Copy> copy_ ABSL_GUARDED_BY(mu_);  // the published copy, or null
  bool fetching_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t fetching_step_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t fetches_started_ ABSL_GUARDED_BY(mu_) = 0;
  // The last fetch that ended: its number and result.
  uint64_t fetches_ended_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status last_fetch_ ABSL_GUARDED_BY(mu_);
  uint64_t drops_ ABSL_GUARDED_BY(mu_) = 0;
  Counts counts_ ABSL_GUARDED_BY(mu_);
};

}  // namespace zeroshard
