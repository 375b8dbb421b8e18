#pragma once

// The client's view of one daemon's GRAD_STAGING slots: which are free, in
// use, or quarantined, and the generation of each slot's latest write.
//
// The rule this keeps (shard.proto, FenceStagingSlot): once a staged push is
// announced, the slot is not written again until the push was answered OK or
// a FenceStagingSlot of its generation has answered. A push whose RPC failed
// or timed out is resolved by fencing its slot at once (Resolve); when that
// fence fails too, the slot is quarantined and fenced again before any reuse
// (Acquire). Generations of a slot strictly increase from 1 for the life of
// the object (across endpoint re-exchanges), so the daemon never mistakes a
// new write for an old one.
//
// Thread-safe. Acquire and Resolve call the fence function without holding
// the lock; each slot is fenced by one thread at a time.

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/flat_range.h"

namespace zeroshard {

class StagingSlots {
 public:
  // One contribution (a later push of it may reuse a quarantined attempt's
  // outcome). A slot carries one or several, back to back.
  struct PushKey {
    uint64_t step = 0;
    uint32_t micro_batch = 0;
    FlatRange range;
    bool operator==(const PushKey& o) const {
      return step == o.step && micro_batch == o.micro_batch && range == o.range;
    }
  };
  // A slot held by one push, with the generation that push announces.
  struct Lease {
    uint32_t slot = 0;
    uint64_t generation = 0;
  };
  struct Acquired {
    // Every contribution asked for turned out to be applied by an earlier,
    // unanswered attempt (its slot was fenced): nothing more to send; no
    // lease.
    bool delivered = false;
    // Per contribution asked for, in order: applied by an earlier attempt,
    // not to be sent again (all true when `delivered`).
    std::vector<bool> applied;
    Lease lease;
  };
  // Fences `slot` at `generation` on the daemon (FenceStagingSlot); returns
  // the newest generation of the slot the daemon applied. Chooses its own
  // deadline.
  using FenceFn = absl::FunctionRef<absl::StatusOr<uint64_t>(uint32_t slot, uint64_t generation)>;

  // `daemon` names the daemon in errors.
  explicit StagingSlots(std::string daemon) : daemon_(std::move(daemon)) {}

  // The number of slots the daemon's region has (ExchangeEndpoint). Existing
  // slots keep their state and generation; slots at or past `count` are no
  // longer handed out.
  void SetCount(uint32_t count);

  // Takes a free slot with its next generation for the contributions `keys`,
  // waiting up to `deadline` for one. Before that, every quarantined slot
  // that holds an earlier attempt of one of them is fenced (Acquired.applied
  // says which were applied; a slot's attempt is applied whole or not at
  // all), and quarantined slots are fenced before they are reused.
  // Unavailable naming the daemon when no slot is usable because every fence
  // failed; DeadlineExceeded when none became free in time.
  absl::StatusOr<Acquired> Acquire(absl::Span<const PushKey> keys, absl::Time deadline,
                                   FenceFn fence);
  absl::StatusOr<Acquired> Acquire(const PushKey& key, absl::Time deadline, FenceFn fence) {
    return Acquire(absl::MakeConstSpan(&key, 1), deadline, fence);
  }

  // The push holding `lease` has finished with a known outcome (answered, or
  // never announced): the slot is free again.
  void Release(const Lease& lease);

  // The push holding `lease` failed without a known outcome: fences the slot
  // now. true if the daemon applied this generation, false if it did not
  // (the slot is free either way); the fence's error if it failed (the slot
  // is then quarantined with `keys`, the contributions the push carried).
  absl::StatusOr<bool> Resolve(const Lease& lease, absl::Span<const PushKey> keys, FenceFn fence);
  absl::StatusOr<bool> Resolve(const Lease& lease, const PushKey& key, FenceFn fence) {
    return Resolve(lease, absl::MakeConstSpan(&key, 1), fence);
  }

  // Slots quarantined now (for tests and messages).
  int quarantined() const;

 private:
  enum class State { kFree, kBusy, kQuarantined, kFencing };
  struct Slot {
    State state = State::kFree;
    uint64_t generation = 0;  // latest handed out (0: never written)
    std::vector<PushKey> keys;  // the quarantined push's contributions
  };

  // Fences quarantined slot `i` (marked kFencing, lock released meanwhile).
  // Returns whether the quarantined generation was applied; on a failed
  // fence the slot is quarantined again and the error returned.
  absl::StatusOr<bool> FenceLocked(uint32_t i, FenceFn fence) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks in *applied (one per key) the contributions an earlier attempt is
  // known, or (by fencing the quarantined slots holding them) found, to have
  // applied. Fences that fail are marked in `failed`.
  void ResolveEarlierAttempts(absl::Span<const PushKey> keys, FenceFn fence,
                              std::vector<bool>* applied, std::vector<bool>* failed,
                              absl::Status* last_error) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A slot below count_ in `state` (and, for kQuarantined, not in `skip`).
  std::optional<uint32_t> Find(State state, const std::vector<bool>& skip) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string daemon_;
  mutable absl::Mutex mu_;
  std::vector<Slot> slots_ ABSL_GUARDED_BY(mu_);
  uint32_t count_ ABSL_GUARDED_BY(mu_) = 0;
  // Contributions found applied by fencing their quarantined slot for
  // another push (oldest first, bounded): a later push of one is delivered.
  std::vector<PushKey> resolved_ ABSL_GUARDED_BY(mu_);
};

}  // namespace zeroshard
