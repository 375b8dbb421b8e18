#pragma once

// Stage-3 layer buffers: a fixed set of buffers, each as large as the
// largest layer, holding layers gathered ahead of use (prefetch) and layers
// the trainer holds a view of. A buffer is filled for one committed step;
// Step discards them all.
//
// A buffer is free, being fetched (on the cache's prefetch thread), ready
// (fetched, nobody asked yet) or held (a view). Discarding never waits: a
// buffer whose fetch is still running is marked discarded and returns to the
// pool when its fetch ends; until then it is neither found nor reused.
//
// Threads: every method except the destructor may be called from the
// training thread while fetches run on the prefetch thread; calls from
// several threads at once are safe but see each other's effects.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/executor.h"
#include "common/dtype.h"
#include "common/layout.h"

namespace zeroshard {

class LayerCache {
 public:
  // Writes flat elements `range` of the parameters committed after
  // `after_step`, as the cache's dtype, into `dst`. Must return by its own
  // deadline. Runs on the prefetch thread, or on the caller's for a miss.
  using FetchFn =
      std::function<absl::Status(const FlatRange& range, uint64_t after_step, void* dst)>;

  struct Options {
    DType dtype = DType::kFp32;   // of the buffers (the job's precision)
    uint32_t buffers = 0;         // 0: no buffers, every Gather fetches on demand
    uint32_t prefetch_depth = 2;  // layers fetched ahead in the direction of travel
    absl::Duration timeout = absl::Minutes(5);  // longest wait for a fetch
  };

  // `layout` must outlive the cache. Allocates the buffers.
  LayerCache(const Layout* layout, Options options, FetchFn fetch);
  // Waits for the fetches in flight (each bounded by its deadline).
  ~LayerCache();

  LayerCache(const LayerCache&) = delete;
  LayerCache& operator=(const LayerCache&) = delete;

  // Copies layer `index` (position in layout.layers()) as of committed step
  // `step` into `dst`: from a buffer fetched for that step if there is one
  // (which is then freed), else fetched on demand. Then prefetches ahead.
  absl::Status Gather(size_t index, uint64_t step, void* dst);
  // Gather with the two ways out supplied: `deliver(src)` copies a buffer
  // fetched for `step` (src: the layer's bytes, valid during the call; a
  // buffer the caller holds as a view stays held), `fetch_miss()` gets the
  // layer when no buffer has it. Then prefetches ahead.
  absl::Status GatherWith(size_t index, uint64_t step,
                          absl::FunctionRef<absl::Status(const void* src)> deliver,
                          absl::FunctionRef<absl::Status()> fetch_miss);
  // Like Gather, but returns the buffer itself, held until Release(index) or
  // DiscardAll. ResourceExhausted if every buffer is held; DeadlineExceeded if
  // none became free within the timeout.
  absl::StatusOr<const void*> View(size_t index, uint64_t step);
  // Drops the cache's copy of layer `index` (a view, or a prefetched buffer).
  void Release(size_t index);
  // Starts fetching layer `index` for `step` into a free buffer; a no-op if
  // it is there already or no buffer is free.
  void Prefetch(size_t index, uint64_t step);
  // FailedPrecondition naming the layer if a view is held.
  absl::Status CheckNoneHeld() const;
  // Forgets every buffer (the parameters changed) and the direction of
  // travel. Never blocks and never fails: fetches in flight free their buffer
  // when they end.
  void DiscardAll();

  // Bytes of the buffers (fixed at construction).
  uint64_t bytes() const { return buffer_bytes_ * slots_count_; }
  uint64_t hits() const { return hits_.load(); }
  uint64_t misses() const { return misses_.load(); }

 private:
  struct Slot;

  // The buffer holding layer `index` fetched for `step`, if any.
  Slot* FindSlot(size_t index, uint64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Starts fetching layer `index` for `step` into a free buffer; null if none.
  Slot* StartFetch(size_t index, uint64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A buffer holding (or fetching) layer `index`, or the fetch to wait for
  // before one frees up; ResourceExhausted when every buffer is held.
  absl::StatusOr<Slot*> ClaimSlot(size_t index, uint64_t step,
                                  std::shared_ptr<CountDown>* wait_for)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fetches the next prefetch_depth layers after `index` in the direction
  // of travel (backward once a layer repeats or ids decrease).
  void PrefetchAfter(size_t index, uint64_t step);
  FlatRange RangeOf(size_t index) const;

  const Layout* const layout_;
  const Options options_;
  const FetchFn fetch_;
  uint64_t buffer_bytes_ = 0;
  size_t slots_count_ = 0;
  std::atomic<uint64_t> hits_{0};
  std::atomic<uint64_t> misses_{0};

  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Slot>> slots_ ABSL_GUARDED_BY(mu_);
  int64_t last_index_ ABSL_GUARDED_BY(mu_) = -1;  // last layer gathered since DiscardAll

  // Destroyed first: its tasks use the members above.
  std::unique_ptr<Executor> prefetcher_;
};

}  // namespace zeroshard
