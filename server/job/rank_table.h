#pragma once

// The ranks of one job copy on one daemon: which process (incarnation) each
// rank joined as — a newer incarnation fences the older process, whose
// requests are refused from then on — when each was last heard from, the
// last step it pushed for, and each rank's staging region for bulk pushes.
//
// Thread-safe. Its lock is a leaf, held for bookkeeping only: callers may
// hold their own locks (the step engine's reduction lock) while calling in.

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/job/staging.h"
#include "server/ledger/memory_ledger.h"
#include "transport/transport.h"

namespace zeroshard {

// A rank as Shard.GetStepState reports it.
struct RankStatus {
  uint32_t rank = 0;
  bool joined = false;     // joined and not left
  bool connected = false;  // heard from within the timeout
  uint64_t incarnation = 0;  // 0: never joined
  double seconds_since_heard = -1;  // -1: never
  uint64_t last_step_pushed = 0;
};

class RankTable {
 public:
  struct Options {
    std::string job_id;
    uint32_t world_size = 1;
    // Staging regions (Staging with create): allocated through `transport`
    // (null: none) and booked in `ledger`, `staging_slots` slots of
    // `staging_slot_bytes` each.
    transport::Transport* transport = nullptr;
    MemoryLedger* ledger = nullptr;
    uint32_t staging_slots = 4;
    uint64_t staging_slot_bytes = 0;
  };

  explicit RankTable(Options options);

  // `rank` joins as `incarnation` (>= 1; the caller checked both). A newer
  // incarnation than the rank's replaces the older process, whose staging
  // region is dropped: returns the replaced incarnation (0 when none). The
  // same incarnation again is idempotent while it is joined; once it left,
  // only a newer one joins (a push of the one that left may still be in
  // flight against the staging region its Leave dropped). FailedPrecondition
  // for an older incarnation (it is fenced) or one that left; InvalidArgument for one more than
  // kMaxIncarnationAheadMicros past both this daemon's clock (microseconds
  // since the Unix epoch, what clients use) and the rank's incarnation;
  // NotFound once the job was removed.
  static constexpr uint64_t kMaxIncarnationAheadMicros = uint64_t{86400} * 1000 * 1000;
  absl::StatusOr<uint64_t> Join(uint32_t rank, uint64_t incarnation);
  // OK iff `rank` is joined as `incarnation` (and records it heard from
  // now). InvalidArgument / FailedPrecondition naming `field` + "rank" /
  // "incarnation" otherwise.
  absl::Status Check(uint32_t rank, uint64_t incarnation, absl::string_view field);
  // Leaves; true when this was the last joined rank: the job is then marked
  // removed (Join and Staging answer NotFound from then on).
  absl::StatusOr<bool> Leave(uint32_t rank, uint64_t incarnation);
  // The rank's staging region, created on first use when `create`.
  // FailedPrecondition without a transport, or (create false) before the
  // rank asked for one; NotFound once removed.
  absl::StatusOr<std::shared_ptr<RankStaging>> Staging(uint32_t rank, uint64_t incarnation,
                                                       bool create);
  // Records that `rank` pushed for `step` (the step-state's last_step_pushed).
  void NotePushed(uint32_t rank, uint64_t step);

  uint32_t joined() const { return joined_.load(std::memory_order_acquire); }
  // Whether any rank has joined since the table was made.
  bool ever_joined() const;
  // Joined ranks heard from within `timeout`.
  uint32_t Connected(absl::Duration timeout) const;
  // When any rank was last heard from (InfinitePast: never).
  absl::Time LastHeard() const;
  // Every rank, in rank order, as heard from within `timeout`.
  std::vector<RankStatus> Ranks(absl::Duration timeout) const;
  // Mixes the incarnations and the joined and left flags into h (tests).
  void Hash(uint64_t& h) const;

 private:
  struct Entry {
    uint64_t incarnation = 0;  // 0: never joined
    bool joined = false;
    bool left = false;  // `incarnation` left: it never joins again
    absl::Time last_seen = absl::InfinitePast();
    uint64_t last_step_pushed = 0;
    std::shared_ptr<RankStaging> staging;
  };

  absl::Status CheckLocked(uint32_t rank, uint64_t incarnation, absl::string_view field)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  mutable absl::Mutex mu_;
  std::vector<Entry> ranks_ ABSL_GUARDED_BY(mu_);
  bool removed_ ABSL_GUARDED_BY(mu_) = false;
  bool ever_joined_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<uint32_t> joined_{0};
};

}  // namespace zeroshard
