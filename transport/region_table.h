#pragma once

// The registered regions of a transport's serving side, by id, for transport
// implementations (inproc/, grpc/). A record is shared by the table, the
// Region that registered it and any copy under way; revoking it removes it
// from the table and then waits for those copies, so that once a Region is
// destroyed no copy touches its memory.
//
// Threads: every RegionTable method is thread-safe. Add and Find never block
// beyond the table's own short lock; Revoke and RevokeOwnedBy block the
// calling thread until every copy holding a revoked record's `mu` (shared)
// has let go, and must not be called by a thread that holds one.

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/random/random.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "transport/transport.h"

namespace zeroshard::transport {

// One registration. The memory at `base` is not owned: its registrant keeps
// it valid until it has revoked the record.
struct RegionRecord {
  uint64_t id = 0;     // unique within its table
  uint64_t owner = 0;  // whatever the caller groups records by (0: none)
  uint64_t token = 0;  // random; transports may make a peer present it
  char* base = nullptr;
  size_t length = 0;
  Access access = Access::kRemoteReadWrite;
  // A copy holds it shared, checks `live`, and touches the memory only while
  // it holds it; revocation takes it exclusively to clear `live`.
  absl::Mutex mu;
  bool live ABSL_GUARDED_BY(mu) = true;
};

// The checks a serving side runs on a peer's access to `record` before it
// touches memory: [offset, offset + length) lies within the region
// (InvalidArgument) and the region allows `needed` (PermissionDenied).
// Messages name the region as "region <id> of <owner>", e.g. owner
// `"daemon"` or `inproc peer "daemon"`. Reads only fields fixed at Add().
absl::Status CheckAccess(const RegionRecord& record, uint64_t offset,
                         uint64_t length, Access needed,
                         absl::string_view owner);

class RegionTable {
 public:
  RegionTable() = default;
  RegionTable(const RegionTable&) = delete;
  RegionTable& operator=(const RegionTable&) = delete;

  // A live record with a fresh id (never 0, never reused by this table) and
  // a fresh random token, findable until revoked.
  std::shared_ptr<RegionRecord> Add(uint64_t owner, char* base, size_t length,
                                    Access access) ABSL_LOCKS_EXCLUDED(mu_);

  // Null if `id` is not registered (any more). The record returned may be
  // revoked at any time: check `live` under its `mu`.
  std::shared_ptr<RegionRecord> Find(uint64_t id) ABSL_LOCKS_EXCLUDED(mu_);

  // Removes `record` from the table, then blocks until no copy holds its
  // `mu` and marks it dead. Idempotent.
  void Revoke(RegionRecord& record) ABSL_LOCKS_EXCLUDED(mu_);

  // Revoke() for every record added with `owner`; returns once all of them
  // are dead. Records added for `owner` afterwards are not affected.
  void RevokeOwnedBy(uint64_t owner) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  static void Kill(RegionRecord& record);

  absl::Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::BitGen bitgen_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, std::shared_ptr<RegionRecord>> regions_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace zeroshard::transport
