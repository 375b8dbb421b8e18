#pragma once

// One rank's gradient staging region on a daemon: `slots` slots of
// `slot_bytes` each, written by the rank with one-sided Puts and announced
// by staged PushGradient chunks. Every write into a slot has a generation
// (strictly increasing per slot, chosen by the rank). A generation is
// applied at most once, and never after FenceStagingSlot fenced it: the
// daemon reads a slot only while holding that slot's lock, and a fence takes
// the same lock, so once a fence has answered nothing reads the slot's old
// bytes any more and the rank may write it again.
//
// A staged push's bytes may instead lie in the rank's push memory
// (MapPushMemory: a trainer on the same host keeps its gradients in sealed
// shared memory the daemon maps read-only): the slot's generation then
// fences the read of those bytes exactly as it fences the slot's.
//
// Thread-safe. Books its region as `buffer` in the ledger for its lifetime
// (push memories are the trainer's memory: booked nowhere here).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/ledger/memory_ledger.h"
#include "transport/shm/push_memory.h"
#include "transport/transport.h"

namespace zeroshard {

class RankStaging {
 public:
  // Books slots * slot_bytes in the ledger (ResourceExhausted past the limit)
  // and allocates the region, remote-writable, through `transport`.
  static absl::StatusOr<std::unique_ptr<RankStaging>> Create(transport::Transport* transport,
                                                             MemoryLedger* ledger,
                                                             std::string job_id, uint32_t slots,
                                                             uint64_t slot_bytes);
  ~RankStaging();

  const transport::RegionDescriptor& descriptor() const { return region_->Descriptor(); }
  uint32_t slots() const { return slots_; }
  uint64_t slot_bytes() const { return slot_bytes_; }

  // Holds slot `slot`'s lock while it checks `generation` (InvalidArgument
  // for slot or length out of range or generation 0; FailedPrecondition when
  // the generation was applied or fenced already), calls `apply` with the
  // slot's first `length` bytes, and on OK records the generation as
  // applied. Blocks while another push or a fence holds the slot.
  // With `push_memory` (an id MapPushMemory returned; InvalidArgument
  // otherwise), `apply` gets that whole memory instead, whatever `length`:
  // it slices and bounds-checks the payloads itself; and a push whose
  // `deadline` has passed when it gets the slot is DeadlineExceeded, unread
  // (a trainer that could not fence the slot may reuse its memory once the
  // deadline is well past, docs/protocol.md).
  absl::Status Apply(uint32_t slot, uint64_t generation, uint64_t length,
                     absl::FunctionRef<absl::Status(absl::string_view payload)> apply,
                     uint32_t push_memory = 0, absl::Time deadline = absl::InfiniteFuture());
  // Maps the rank's push memory (transport::PeerMemory::Open, which the
  // caller's arguments go to unchanged) and returns its id: never 0, unique
  // within this daemon process. The same name again answers the same id
  // (nothing is opened). Blocks while the descriptor is taken and mapped,
  // holding no slot. ResourceExhausted past kMaxPushMemories memories, past
  // `max_bytes` mapped in all, or past kMaxPushMemoryCalls calls that tried
  // to open a memory (mapped or refused: a rank process that keeps naming
  // what cannot be mapped stops being heard); Open's error otherwise. The
  // mapped bytes are booked in the ledger as `buffer` (reads of holes in
  // the memory could make this daemon's memory grow by as much), so the
  // ledger's refusal is ResourceExhausted too.
  static constexpr uint32_t kMaxPushMemories = 16;
  static constexpr uint32_t kMaxPushMemoryCalls = 64;
  absl::StatusOr<uint32_t> MapPushMemory(int64_t pid, int64_t fd, absl::string_view name,
                                         uint64_t bytes, uint64_t max_bytes);
  // Push memories mapped, and bytes of them handed to an `apply` that
  // succeeded, since creation.
  uint32_t push_memories() const;
  uint64_t pulled_bytes() const;
  // Fences every generation <= `generation` of `slot`, after waiting (until
  // `deadline`) for a push that reads the slot to finish; returns the slot's
  // newest applied generation (0: none). InvalidArgument for a slot out of
  // range; DeadlineExceeded, with nothing fenced, when the push still reads
  // it at the deadline.
  absl::StatusOr<uint64_t> Fence(uint32_t slot, uint64_t generation, absl::Time deadline);

 private:
  struct Slot {
    absl::Mutex mu;
    uint64_t applied ABSL_GUARDED_BY(mu) = 0;  // newest applied generation
    uint64_t fenced ABSL_GUARDED_BY(mu) = 0;   // every generation <= this is refused
  };

  RankStaging(MemoryLedger* ledger, std::string job_id, uint32_t slots, uint64_t slot_bytes);

  MemoryLedger* const ledger_;
  const std::string job_id_;
  const uint32_t slots_;
  const uint64_t slot_bytes_;
  std::unique_ptr<transport::Region> region_;
  std::unique_ptr<Slot[]> slot_state_;
  struct Mapped {
    uint32_t id = 0;
    std::string name;
    std::shared_ptr<const transport::PeerMemory> memory;  // shared with the pushes reading it
  };
  mutable absl::Mutex memories_mu_;
  std::vector<Mapped> memories_ ABSL_GUARDED_BY(memories_mu_);
  uint64_t mapped_bytes_ ABSL_GUARDED_BY(memories_mu_) = 0;
  uint32_t map_calls_ ABSL_GUARDED_BY(memories_mu_) = 0;
  uint64_t pulled_bytes_ ABSL_GUARDED_BY(memories_mu_) = 0;
};

}  // namespace zeroshard
