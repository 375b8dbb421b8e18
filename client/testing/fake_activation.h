#pragma once

// A stand-in for a daemon's Activation service (activation.proto) for
// client tests: slices live in an arena region of an "inproc" transport
// (handed out by FakeShard as ACTIVATION_ARENA) with a first-fit allocator,
// and past it in memory standing in for spill files, oldest step and lowest
// layer first, like the daemon. Knobs a daemon does not have: the checksum
// Locate reports and the bytes in the arena can be corrupted, commits can be
// slowed, and the spill space bounded. It records the owners it saw and counts each RPC.
//
// Thread-safe. Any job, rank and incarnation is served (keys of different
// owners are kept apart).

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/activation_protocol.h"
#include "grpcpp/grpcpp.h"
#include "proto/zeroshard/v1/activation.grpc.pb.h"
#include "transport/transport.h"

namespace zeroshard::testing {

class FakeActivation final : public v1::Activation::Service {
 public:
  // `arena` (may be null: every slice is "spilled") must outlive this.
  FakeActivation(transport::Region* arena, uint64_t spill_capacity);

  struct Counts {
    int reserve = 0, commit = 0, offload_stream = 0, locate = 0, fetch_stream = 0;
    int prefetch = 0, free = 0;
    int free_in_place = 0;     // FreeActivations calls with if_placement (within `free`)
    int commits_with_crc = 0;  // CommitActivation calls that carried a CRC-32C
    uint64_t spills = 0;     // slices moved from the arena to "spill"
    uint64_t readbacks = 0;  // slices brought back into the arena
  };
  Counts counts() const;
  // Slices held now (committed), and their bytes.
  size_t slices() const;
  uint64_t bytes() const;
  // The owner of the last request ("job/rank/incarnation").
  std::string last_owner() const;
  // Locate reports a wrong checksum from now on.
  void set_corrupt_locate_crc(bool on);
  // Flips the first byte of every committed slice in the arena (its
  // checksum stays that of the bytes committed).
  void CorruptArenaSlices();
  // Whether ReserveActivation answers a placement number (on by default);
  // off, it is a daemon that does not serve FreeActivations.if_placement.
  void set_placements(bool on);
  // FreeActivations with if_placement fails UNAVAILABLE from now on.
  void set_fail_releases(bool on);
  // CommitActivation and OffloadActivation wait this long first.
  void set_commit_delay(absl::Duration d);
  // ReserveActivation answers this lease (ActivationPlacement.lease_ms; 0
  // by default: none said). Reservations are not dropped at its end.
  void set_reservation_lease(absl::Duration d);

  grpc::Status ReserveActivation(grpc::ServerContext*, const v1::ReserveActivationRequest* req,
                                 v1::ActivationPlacement* resp) override;
  grpc::Status CommitActivation(grpc::ServerContext*, const v1::CommitActivationRequest* req,
                                v1::ActivationStored* resp) override;
  grpc::Status OffloadActivation(grpc::ServerContext*,
                                 grpc::ServerReader<v1::ActivationChunk>* reader,
                                 v1::ActivationStored* resp) override;
  grpc::Status LocateActivation(grpc::ServerContext*, const v1::LocateActivationRequest* req,
                                v1::ActivationPlacement* resp) override;
  grpc::Status FetchActivation(grpc::ServerContext*, const v1::FetchActivationRequest* req,
                               grpc::ServerWriter<v1::ActivationChunk>* writer) override;
  grpc::Status PrefetchActivations(grpc::ServerContext*, const v1::PrefetchActivationsRequest* req,
                                   v1::PrefetchActivationsResponse* resp) override;
  grpc::Status FreeActivations(grpc::ServerContext*, const v1::FreeActivationsRequest* req,
                               v1::FreeActivationsResponse* resp) override;

 private:
  // A slice's owner (job, rank) and its key, the one key type of
  // common/activation_protocol.h: ordered by owner, then as the key orders
  // (step first).
  struct Key {
    std::string job_id;
    uint32_t rank = 0;
    ActivationKey key;
    auto tie() const { return std::tie(job_id, rank, key); }
    friend bool operator<(const Key& a, const Key& b) { return a.tie() < b.tie(); }
    friend bool operator==(const Key& a, const Key& b) { return a.tie() == b.tie(); }
  };
  struct Slice {
    bool committed = false;
    bool in_arena = false;
    bool pinned = false;
    bool moved = false;      // spilled since its commit (if_placement answers `moved`)
    uint64_t placement = 0;  // its reservation's number
    uint64_t offset = 0;
    uint64_t bytes = 0;
    std::optional<uint32_t> crc;  // taken at commit, with or without the client's
    std::string spilled;  // the bytes when not in the arena
  };

  Key MakeKey(const v1::ActivationOwner& owner, const v1::ActivationKey& key)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // First-fit offset for `bytes`, spilling unpinned committed slices (oldest
  // step, lowest layer first) while there is no room; false if none frees it.
  bool Allocate(uint64_t bytes, uint64_t* offset) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool FindGap(uint64_t bytes, uint64_t* offset) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t SpillUsed() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Stores `data` as a committed slice (arena if room, else spill).
  grpc::Status Store(const Key& key, std::string data, bool* spilled)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Brings a spilled slice into the arena; false if there is no room.
  bool ReadBack(Slice& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  char* arena_base() const { return static_cast<char*>(arena_->base()); }

  transport::Region* const arena_;
  const uint64_t spill_capacity_;
  mutable absl::Mutex mu_;
  std::map<Key, Slice> slices_ ABSL_GUARDED_BY(mu_);
  Counts counts_ ABSL_GUARDED_BY(mu_);
  std::string last_owner_ ABSL_GUARDED_BY(mu_);
  bool corrupt_crc_ ABSL_GUARDED_BY(mu_) = false;
  absl::Duration commit_delay_ ABSL_GUARDED_BY(mu_) = absl::ZeroDuration();
  absl::Duration reservation_lease_ ABSL_GUARDED_BY(mu_) = absl::ZeroDuration();
  uint64_t last_placement_ ABSL_GUARDED_BY(mu_) = 0;
  bool placements_ ABSL_GUARDED_BY(mu_) = true;
  bool fail_releases_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace zeroshard::testing
