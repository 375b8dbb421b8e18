#pragma once

// One step's gradient reduction over the range a daemon owns: contributions
// are summed in a fixed order (rank-major, then micro-batch), whatever order
// they arrive in, so the result is bit-identical to a single process summing
// them in rank order. A contribution that arrives ahead of its turn is kept
// as a copy of its payload (in the wire dtype: a bf16 contribution waits in
// half the bytes of fp32) in the out-of-order buffer, which is bounded: its
// bytes are booked in the ledger (category `buffer`) and may not exceed the
// budget given at construction; Admit() tells the caller to wait (back-pressure)
// rather than grow it. The bookkeeping of the step (an entry per distinct
// chunk range and per contribution) is booked as `buffer` too, outside that
// budget, so that pushes of many tiny chunks are held to the daemon's limit.
//
// Wire-free: this sees flat ranges, order numbers and payload bytes, never a
// protobuf. Not thread-safe: the Job calls it under its reduction lock
// (with Options::defer_sums, the passes themselves run outside it).

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/dtype.h"
#include "common/flat_range.h"
#include "common/job_spec.h"
#include "server/ledger/memory_ledger.h"
#include "server/optimizer/optimizer.h"
#include "server/step/owned_tensors.h"

namespace zeroshard {

// One chunk of one rank's gradient for the open step.
struct Contribution {
  FlatRange range;  // inside the owned range (trainer-collective: one partition)
  uint32_t rank = 0;
  uint32_t micro_batch = 0;
  DType dtype = DType::kFp32;
  // range.size() * DTypeSize(dtype) bytes, read during Check and Apply only
  // (with Options::defer_sums, also until the passes Apply planned finish).
  absl::string_view payload;
  // Of payload as the sender computed it; 0 = not sent (a staged push).
  uint32_t crc32c = 0;
  // Layout indices (ascending) of the tensors overlapping `range` that this
  // contribution carries no gradient for; read during Apply only.
  absl::Span<const uint32_t> no_grad;
};

// A contribution held where it arrived (ReductionState::Apply with `hold`):
// its payload stays valid, untouched, while the state is kHeld; the
// reduction reads it from there when the range's last contribution comes
// and sums every contribution in one pass. Shared by the state and the
// caller, which waits (under the reduction lock's condition) until it
// leaves kHeld.
struct HeldContribution {
  enum class State {
    kHeld,     // the reduction may still read the payload
    kSumming,  // in a deferred sum (ReductionState::SumJob): still read, not droppable
    kDone,     // summed, or copied into the out-of-order buffer: let go
    kDropped,  // removed unsummed (the rank was replaced, the step reset)
  };
  State state = State::kHeld;
  uint64_t begin = 0;  // of its range
  uint32_t order = 0;  // its place in the range's sum
  uint64_t bytes = 0;  // of its payload
};

// A range of the open step still waiting for a contribution.
struct MissingRange {
  FlatRange range;
  uint32_t rank = 0;  // whose contribution it waits for next
  uint32_t contributions = 0;
  uint32_t expected = 0;
};

class ReductionState {
 public:
  struct Options {
    std::string job_id;
    FlatRange owned;           // padded range `grad` covers
    FlatRange owned_unpadded;  // what must be complete
    uint64_t partition_elements = 0;
    uint32_t world_size = 1;
    ReductionMode mode = ReductionMode::kDaemon;
    uint64_t pending_budget_bytes = 0;  // out-of-order buffer bound
    // The tensors of the owned range (outlives the state); null: every
    // tensor counts as having a gradient.
    const OwnedTensors* tensors = nullptr;
    // Sums are planned, not run: Apply and Unhold queue each range's pass
    // as a SumJob that the caller takes (TakeReadySums), runs without its
    // lock (RunSum) and hands back (FinishSum). Until then the range is
    // busy: its next contributions wait (held or buffered) and are summed
    // by FinishSum's follow-up. Off: every pass runs inside the call.
    bool defer_sums = false;
  };

  // One planned pass over one range: its next contributions, in order,
  // summed into grad (overwriting it when `first`); `last` when it
  // ends the range, and then its norm lands in `stats`. Owns the
  // out-of-order copies it reads (moved out of the buffer, still booked);
  // the held contributions it reads are kSumming until FinishSum.
  struct SumJob {
    uint64_t begin = 0;
    float* dst = nullptr;
    size_t n = 0;
    bool first = false;
    bool last = false;
    float grad_scale = 1.0f;
    ShardOptimizer* optimizer = nullptr;
    absl::InlinedVector<ShardOptimizer::Source, 8> run;
    GradStats stats;  // set by RunSum when `last`
   private:
    friend class ReductionState;
    std::vector<std::shared_ptr<HeldContribution>> held;
    std::vector<std::vector<uint8_t>> copies;
    uint32_t entries = 0;  // out-of-order entries taken (held or copied)
  };

  // `grad` (owned.size() floats), `optimizer` and `ledger` must outlive this.
  ReductionState(Options options, float* grad, ShardOptimizer* optimizer, MemoryLedger* ledger);
  ~ReductionState();

  // Checks `batch` (all with `micro_batches` per rank, 1..4096) as if applied
  // in order: ranges must match earlier keys exactly or not overlap them, and
  // no (range, order) may be in already. Error codes: FailedPrecondition
  // (overlapping cut, micro_batches differing from the step's, a duplicate
  // whose bytes differ from the held one's or cannot be compared),
  // AlreadyExists (a duplicate whose payload has the held one's CRC-32C,
  // computed from the payload if the chunk carries none: a resend or a
  // restarted rank's replay is never counted twice; or, from a rank replaced
  // during this step (ReplaceRank), a duplicate of a held contribution that
  // carried no CRC-32C: kept, not compared), InvalidArgument (a duplicate
  // inside `batch`). Sets *pending_bytes to the out-of-order bytes applying
  // it would buffer, and *bookkeeping_bytes to an upper bound of what its
  // bookkeeping would grow by. Changes nothing.
  // With `hold` (a batch to be held), pending_bytes is 0: a held
  // contribution is not copied.
  absl::Status Check(const std::vector<Contribution>& batch, uint32_t micro_batches,
                     uint64_t* pending_bytes, uint64_t* bookkeeping_bytes, bool hold = false) const;
  // Check against an empty reduction (what Reset leaves): the batch's own
  // errors only, for a push that would throw the state away first.
  absl::Status CheckFresh(const std::vector<Contribution>& batch, uint32_t micro_batches) const;
  // Whether a checked batch needing `pending_bytes` fits the budget now: it
  // does when it buffers nothing, or when the buffer stays within budget.
  bool Admit(uint64_t pending_bytes) const;
  // Applies a batch that Check accepted and Admit admitted (nothing changed
  // in between). The caller has booked Check's `pending_bytes` and
  // `bookkeeping_bytes` in the ledger (category buffer) and passes them as
  // `reserved_pending` and `reserved_bookkeeping`; the state owns that
  // booking from now on and gives back what it does not hold. The pass that
  // adds a range's last contribution also takes the range's squared norm,
  // every element scaled by `grad_scale` (the step's 1 / (N_d * loss
  // scale), the same for every call of a step), for GradStatsOfStep.
  // Returns the elements applied.
  // A contribution that arrives when every other contribution of its range
  // from the next one in order on is waiting (buffered or held) is summed
  // with all of them in one pass. With `hold` (non-null; a batch whose
  // payloads the caller keeps valid until each handle leaves kHeld and
  // kSumming), a contribution that does not complete its range is held
  // there instead of being summed or copied: (*hold)[i] is chunk i's
  // handle, null for a chunk summed at once.
  uint64_t Apply(const std::vector<Contribution>& batch, uint32_t micro_batches,
                 uint64_t reserved_pending, uint64_t reserved_bookkeeping, float grad_scale,
                 std::vector<std::shared_ptr<HeldContribution>>* hold = nullptr);
  // Ends the holding of `held` if it is still kHeld: summed with the
  // contributions after it when it is next in order, else copied into the
  // out-of-order buffer, for which the caller has booked `reserved_pending`
  // (held.bytes; see Admit), which the state owns from now on. Sets kDone.
  void Unhold(HeldContribution* held, uint64_t reserved_pending, float grad_scale);
  // Removes `held` unsummed (kDropped): the caller gives up waiting.
  void DropHeld(HeldContribution* held);
  // Whether `held` is next in its range's order (Unhold then needs no room).
  bool NextInOrder(const HeldContribution& held) const;

  // The trainable owned tensors that no applied contribution of the step
  // carried a gradient for (each overlapping contribution named it in
  // no_grad), as layout indices, ascending: the commit skips them. Only
  // summed contributions count: one dropped unsummed (DropHeld, ReplaceRank)
  // marks nothing.
  std::vector<uint32_t> NoGradTensors() const;

  // Owned unpadded elements whose every contribution is in.
  uint64_t CompleteElements() const;
  bool Complete() const { return CompleteElements() == options_.owned_unpadded.size(); }
  // Once Complete(): the summed gradient's squared norm (scaled by Apply's
  // `grad_scale`) and whether it holds an inf or NaN, from the ranges' sums
  // taken in the pass of their last contribution, added in flat order: no
  // separate pass over the gradient, and the same bits whatever order the
  // contributions came in (for a given cut into chunks).
  GradStats GradStatsOfStep() const;
  // The first `max` ranges still waiting, in flat order; an owned stretch
  // nobody pushed yet is reported as waiting for rank 0 with 0 contributions.
  std::vector<MissingRange> Missing(size_t max) const;
  // One line for errors: the first missing range and whom it waits for.
  std::string DescribeIncomplete() const;
  // A new process took over `rank` (it rejoined with a newer incarnation)
  // during this step: until the step ends, its duplicates of contributions
  // held without a CRC-32C are accepted as replays (Check). Daemon
  // reduction: also drops the rank's contributions that wait in the
  // out-of-order buffer, so that its new process's pushes take their place;
  // what is applied stays. Returns how many were dropped; gives their bytes
  // back to the ledger.
  uint32_t ReplaceRank(uint32_t rank);
  // Forgets the step (the summed gradient in `grad` stays until overwritten
  // by the next step's first contributions) and frees the buffer. No sum
  // may be in flight (sums_in_flight() == 0).
  void Reset();

  // ---- Deferred sums (Options::defer_sums) ----
  // The passes planned since the last call, in the order planned (each on
  // its own range). The caller runs them with RunSum, with no lock of this
  // state's held (it reads and writes only its job and its range of
  // `grad`), then hands each back with FinishSum.
  std::vector<SumJob> TakeReadySums();
  // Runs one planned pass: blocks for the pass (the optimizer's threads).
  static void RunSum(SumJob& job);
  // Ends a pass: its range's norm recorded, its held contributions let go
  // (kDone), its copies freed; the range is free again, and a run of
  // contributions that waited for it is planned as the next job.
  void FinishSum(SumJob job);
  // Planned or running passes not yet finished.
  uint32_t sums_in_flight() const { return sums_in_flight_; }

  const float* grad() const { return grad_; }
  // Passes over the gradient buffer that summed contributions, since
  // construction (not reset with the step).
  uint64_t sum_passes() const { return sum_passes_; }
  // Contributions those passes summed, since construction.
  uint64_t summed_contributions() const { return summed_contributions_; }
  uint64_t pending_bytes() const { return pending_bytes_; }
  uint32_t micro_batches() const { return micro_batches_; }
  // Mixes every piece of state (bookkeeping, applied gradient, buffer) into h.
  void Hash(uint64_t& h) const;

 private:
  struct Pending {
    std::vector<uint8_t> bytes;  // the payload as it came, in `dtype`
    DType dtype = DType::kFp32;
    uint32_t crc32c = 0;
    // Held where it arrived instead (`bytes` empty): the sender's payload,
    // and the handle its sender waits on.
    absl::string_view view;
    std::shared_ptr<HeldContribution> held;
    // The contribution's no_grad, marked into has_grad_ once it is summed
    // (a contribution dropped unsummed marks nothing).
    std::vector<uint32_t> no_grad;
    const uint8_t* data() const {
      return view.data() != nullptr ? reinterpret_cast<const uint8_t*>(view.data()) : bytes.data();
    }
    size_t size() const { return view.data() != nullptr ? view.size() : bytes.size(); }
  };
  struct Key {
    uint64_t end = 0;
    uint32_t partition = 0;
    uint32_t next_order = 0;     // contributions applied (or in a planned sum) so far, in order
    bool summing = false;        // a deferred sum over the range is in flight
    std::vector<uint32_t> crcs;  // of the applied ones, by order
    std::map<uint32_t, Pending> pending;  // arrived ahead of their turn
    GradStats stats;                      // of the summed range, set by its last contribution
  };

  // What the bookkeeping is charged, generously: a key (a map node holding
  // a Key), an applied contribution (its CRC, with the vector's growth), and
  // an out-of-order contribution beyond its booked payload copy (a map node
  // and the copy's allocation), and the copy of its no_grad marks.
  static constexpr uint64_t kKeyBytes = 160;
  static constexpr uint64_t kAppliedBytes = 8;
  static constexpr uint64_t kPendingEntryBytes = 256;  // with a held one's handle
  static uint64_t MarksBytes(size_t marks) {
    return marks == 0 ? 0 : marks * sizeof(uint32_t) + 16;  // with its allocation's header
  }

  uint64_t BookkeepingNow() const;
  // Whether every contribution of `key` from next_order up to `order` is
  // waiting (buffered or held), so that `order` would be summed with them.
  static bool WaitingUpTo(const Key& key, uint32_t order);
  // Whether one more contribution completes `key`'s waiting set.
  bool Completes(const Key& key, uint32_t micro_batches) const;
  // Gives the ledger back the booked bytes beyond what the buffer and the
  // bookkeeping hold now.
  void ReleaseUnheld();
  uint32_t Order(const Contribution& c, uint32_t micro_batches) const;
  uint32_t Expected(uint32_t micro_batches) const;
  // Check's work against `keys` (keys_, or none) and `micro_batches_now`.
  absl::Status CheckAgainst(const std::map<uint64_t, Key>& keys, uint32_t micro_batches_now,
                            const std::vector<Contribution>& batch, uint32_t micro_batches,
                            uint64_t* pending_bytes, uint64_t* bookkeeping_bytes,
                            bool hold) const;
  absl::Status CheckOne(const std::map<uint64_t, Key>& keys, const Contribution& c, size_t index,
                        uint32_t order, const std::map<uint64_t, uint64_t>& new_keys) const;
  // Sums, in one pass, the contributions from key.next_order on as far as
  // they are consecutive: `c` (if given) as number `order`, the others
  // waiting in key.pending, which are let go; deferred (Options), plans
  // the pass instead and marks the range busy.
  void SumRun(uint64_t begin, Key& key, const Contribution* c, uint32_t order, float grad_scale);
  // Whether the range's next contributions could be summed now: it is not
  // busy, and every one from next_order up to `order` waits.
  bool SumsNow(const Key& key, uint32_t order) const {
    return !key.summing && WaitingUpTo(key, order);
  }
  // A pending entry for `c` at `order`, counted, with c's dtype, CRC and
  // no_grad; the caller gives it its bytes (buffered or held where they are).
  Pending& AddPending(Key& key, uint32_t order, const Contribution& c);
  // Removes pending entry `p` (its bytes no longer buffered; a held one
  // marked `state`).
  std::map<uint32_t, Pending>::iterator ErasePending(Key& key,
                                                     std::map<uint32_t, Pending>::iterator p,
                                                     HeldContribution::State state);
  // Records that the contribution to `range` that named `no_grad` is summed:
  // every tensor overlapping `range` that it does not name has a gradient.
  void MarkGrads(FlatRange range, absl::Span<const uint32_t> no_grad);
  // Lets a finished pass's contributions go and records its norm.
  void Settle(Key& key, SumJob& job);

  const Options options_;
  float* const grad_;
  ShardOptimizer* const optimizer_;
  MemoryLedger* const ledger_;
  std::map<uint64_t, Key> keys_;  // by range begin
  // By position in options_.tensors->entries(): some applied contribution
  // carried a gradient for it.
  std::vector<uint8_t> has_grad_;
  std::set<uint32_t> replacing_;  // ranks replaced during this step (ReplaceRank)
  uint32_t micro_batches_ = 0;    // 0: nothing pushed yet this step
  uint64_t pending_bytes_ = 0;    // booked as buffer
  uint64_t buffered_bytes_ = 0;   // held in `pending` entries
  uint64_t applied_ = 0;          // contributions applied (CRCs kept) this step
  uint64_t pending_entries_ = 0;  // contributions held in `pending` entries
  uint64_t pending_marks_bytes_ = 0;  // MarksBytes of the `pending` entries' no_grad
  uint64_t bookkeeping_bytes_ = 0;  // booked as buffer, >= BookkeepingNow()
  uint64_t sum_passes_ = 0;
  uint64_t summed_contributions_ = 0;
  std::vector<SumJob> ready_;   // planned, not yet taken (defer_sums)
  uint32_t sums_in_flight_ = 0;  // planned, not yet finished
};

}  // namespace zeroshard
