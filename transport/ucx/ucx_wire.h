#pragma once

// The bytes the "ucx" transport hands to peers, around UCX's own packed
// worker addresses and rkeys: an envelope of a 4-byte magic number ("ZSUA"
// for addresses, "ZSUK" for rkeys), the payload's length (u32), the payload,
// and the payload's FNV-1a (u64), all little endian. UCX's parsers trust
// their input; decoding here refuses wrong or damaged bytes (InvalidArgument)
// before UCX sees them. The checksum catches damage, not forgery.
//
// An address's payload is the owner's identity (boot hash u64, pid u32,
// process start time u64, Transport instance u64) followed by the UCX worker
// address; the owner's name follows the envelope, unchecked, to the end of
// the bytes.
//
// Pure functions on bytes: no UCX, no state. Decode(Encode(x)) == x, and
// any bytes that decode re-encode to exactly those bytes.

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace zeroshard::transport::ucx {

// Who owns an address, for noticing its death where UCX cannot (see
// ucx_transport.h).
struct PeerIdentity {
  uint64_t boot = 0;  // hash of this boot of the host
  uint32_t pid = 0;
  uint64_t start_time = 0;  // process start time (guards against pid reuse)
  uint64_t instance = 0;    // the Transport within its process

  bool operator==(const PeerIdentity& o) const {
    return boot == o.boot && pid == o.pid && start_time == o.start_time && instance == o.instance;
  }
  bool operator!=(const PeerIdentity& o) const { return !(*this == o); }
};

// Bytes of an encoded PeerIdentity at the start of an address's payload.
inline constexpr size_t kIdentityBytes = 8 + 4 + 8 + 8;
// Bytes the envelope adds to its payload: magic, length, checksum.
inline constexpr size_t kEnvelopeBytes = 4 + 4 + 8;

struct PeerAddress {
  PeerIdentity identity;
  std::string worker_address;  // UCX's packed bytes; never empty
  std::string name;            // may be empty
};

// `worker_address` must be non-empty and, with the identity, under 4 GiB.
std::string EncodeAddress(const PeerIdentity& identity, absl::string_view worker_address,
                          absl::string_view name);

// InvalidArgument naming `what` when `bytes` is not an address envelope, is
// cut short, fails its checksum, or carries no worker address.
absl::StatusOr<PeerAddress> DecodeAddress(absl::string_view bytes, absl::string_view what);

// `packed` (UCX's ucp_rkey_pack bytes) must be non-empty and under 4 GiB.
std::string EncodeRkey(absl::string_view packed);

// The packed rkey inside `bytes` (a view into it), or InvalidArgument naming
// `what` when `bytes` is not an rkey envelope, is cut short, fails its
// checksum, carries no rkey, or has bytes after the envelope.
absl::StatusOr<absl::string_view> DecodeRkey(absl::string_view bytes, absl::string_view what);

}  // namespace zeroshard::transport::ucx
