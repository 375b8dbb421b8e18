#pragma once

// An activation checkpoint's key, shared by the client and the daemon: the
// one key type, the one validator and the one conversion to and from the
// wire ActivationKey (proto/zeroshard/v1/activation.proto). The client
// validates with the rule the daemon applies, so a key the client accepts is
// never refused by a daemon for its form. The limits are in common/protocol.h.
//
// Pure functions; no threads, no I/O.

#include <cstdint>
#include <string>
#include <tuple>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/protocol.h"
#include "proto/zeroshard/v1/activation.pb.h"

namespace zeroshard {

// One slice of one activation checkpoint. The owner (job, rank) is not part
// of it: every request names that beside the key.
struct ActivationKey {
  uint64_t step = 0;
  uint32_t micro_batch = 0;
  uint32_t layer = 0;
  uint32_t mp_rank = 0;  // < mp_size
  uint32_t mp_size = 1;  // the model-parallel degree M, 1..kMaxModelParallel

  // Ordered by step first (then micro-batch, layer, mp_rank, mp_size): the
  // keys of one step are adjacent in a map or set.
  auto tie() const { return std::tie(step, micro_batch, layer, mp_rank, mp_size); }
  friend bool operator<(const ActivationKey& a, const ActivationKey& b) {
    return a.tie() < b.tie();
  }
  friend bool operator==(const ActivationKey& a, const ActivationKey& b) {
    return a.tie() == b.tie();
  }
  friend bool operator!=(const ActivationKey& a, const ActivationKey& b) { return !(a == b); }
  template <typename H>
  friend H AbslHashValue(H h, const ActivationKey& k) {
    return H::combine(std::move(h), k.step, k.micro_batch, k.layer, k.mp_rank, k.mp_size);
  }
};

// "step S micro-batch B layer L mp R/M", for messages.
std::string DescribeActivationKey(const ActivationKey& key);

// OK iff 1 <= mp_size <= kMaxModelParallel and mp_rank < mp_size;
// otherwise InvalidArgument naming the field as `prefix` + "mp_size" or
// "mp_rank" (e.g. "key.mp_size: must be in [1, 4096], got 0").
absl::Status ValidateModelParallelRank(uint32_t mp_rank, uint32_t mp_size,
                                       absl::string_view prefix);

// OK, or InvalidArgument naming the field of the key called `field` (e.g.
// "key.mp_rank: must be < mp_size (2), got 2"; "keys[3].mp_size: ...").
absl::Status ValidateActivationKey(const ActivationKey& key, absl::string_view field = "key");

// OK iff a slice of `bytes` bytes may be named on the wire: 1 ..
// kMaxActivationSliceBytes (a daemon also refuses more than its arena
// holds). InvalidArgument naming `field` otherwise.
absl::Status ValidateActivationSliceBytes(uint64_t bytes, absl::string_view field);

// The wire form of `key` (not validated).
void ActivationKeyToProto(const ActivationKey& key, v1::ActivationKey* out);
v1::ActivationKey ActivationKeyToProto(const ActivationKey& key);
// The key of a wire ActivationKey, as it is (not validated).
ActivationKey ActivationKeyFromProto(const v1::ActivationKey& key);
// The key of a wire ActivationKey, validated as ValidateActivationKey(key,
// field) does.
absl::StatusOr<ActivationKey> ParseActivationKey(const v1::ActivationKey& key,
                                                 absl::string_view field = "key");

}  // namespace zeroshard
