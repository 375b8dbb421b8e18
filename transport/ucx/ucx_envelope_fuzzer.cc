// libFuzzer target: the bytes a peer hands the "ucx" transport as an address
// (Connect) or as a region descriptor's rkey (Put/Get), through the decoders
// that stand between them and UCX's trusting parsers. Bytes that decode must
// re-encode to exactly themselves; anything else must be refused with
// InvalidArgument; nothing may read outside the input (ASan). Encoding what
// the input holds must decode back to it.
// Run: tools/fuzz.sh //transport/ucx:ucx_envelope_fuzzer 60
//
// Input: one mode byte, then the bytes to decode. Mode bit 0: an address
// (set) or an rkey. Bit 1: first make the checksum match the payload the
// length field claims (where there is room for one), so that mutations get
// past it to the checks behind it. Bit 2: first put the right magic number
// in place.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "transport/ucx/ucx_wire.h"

namespace {

using zeroshard::transport::ucx::DecodeAddress;
using zeroshard::transport::ucx::DecodeRkey;
using zeroshard::transport::ucx::EncodeAddress;
using zeroshard::transport::ucx::EncodeRkey;
using zeroshard::transport::ucx::kEnvelopeBytes;
using zeroshard::transport::ucx::kIdentityBytes;
using zeroshard::transport::ucx::PeerAddress;
using zeroshard::transport::ucx::PeerIdentity;

uint64_t ReadLe(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

// Repairs the checksum of the envelope at the start of `bytes` (n bytes),
// by the length field, when the claimed payload and a checksum fit.
void RepairChecksum(char* bytes, size_t n) {
  if (n < kEnvelopeBytes) return;
  const uint64_t size = ReadLe(bytes + 4, 4);
  if (size > n - kEnvelopeBytes) return;
  // An encoding of the same payload carries the right checksum.
  const std::string encoded = EncodeRkey(absl::string_view(bytes + 8, size));
  std::memcpy(bytes + 8 + size, encoded.data() + 8 + size, 8);
}

void CheckRefusal(const absl::Status& status) {
  if (!absl::IsInvalidArgument(status)) std::abort();
}

void CheckAddress(absl::string_view bytes) {
  absl::StatusOr<PeerAddress> address = DecodeAddress(bytes, "fuzzed address");
  if (!address.ok()) return CheckRefusal(address.status());
  if (address->worker_address.empty()) std::abort();
  if (EncodeAddress(address->identity, address->worker_address, address->name) != bytes) {
    std::abort();
  }
}

void CheckRkey(absl::string_view bytes) {
  absl::StatusOr<absl::string_view> rkey = DecodeRkey(bytes, "fuzzed rkey");
  if (!rkey.ok()) return CheckRefusal(rkey.status());
  // A view into the input, never past it.
  if (rkey->empty() || rkey->data() < bytes.data() ||
      rkey->data() + rkey->size() > bytes.data() + bytes.size()) {
    std::abort();
  }
  if (EncodeRkey(*rkey) != bytes) std::abort();
}

// The input's bytes as a payload: encoding then decoding gives them back.
void CheckEncodings(absl::string_view bytes) {
  if (!bytes.empty()) {
    const std::string encoded = EncodeRkey(bytes);
    absl::StatusOr<absl::string_view> rkey = DecodeRkey(encoded, "rkey");
    if (!rkey.ok() || *rkey != bytes) std::abort();
  }
  if (bytes.size() > kIdentityBytes) {
    // The first bytes as an identity, then the worker address and a name.
    PeerIdentity identity;
    identity.boot = ReadLe(bytes.data(), 8);
    identity.pid = static_cast<uint32_t>(ReadLe(bytes.data() + 8, 4));
    identity.start_time = ReadLe(bytes.data() + 12, 8);
    identity.instance = ReadLe(bytes.data() + 20, 8);
    absl::string_view rest = bytes.substr(kIdentityBytes);
    const size_t worker_bytes = 1 + static_cast<uint8_t>(bytes[0]) % rest.size();
    const absl::string_view worker = rest.substr(0, worker_bytes);
    const absl::string_view name = rest.substr(worker_bytes);
    absl::StatusOr<PeerAddress> address =
        DecodeAddress(EncodeAddress(identity, worker, name), "address");
    if (!address.ok() || address->identity != identity || address->worker_address != worker ||
        address->name != name) {
      std::abort();
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t mode = data[0];
  const size_t n = size - 1;
  // An exact-size copy, so that ASan sees a read one byte past the end.
  std::unique_ptr<char[]> bytes(new char[n == 0 ? 1 : n]);
  if (n > 0) std::memcpy(bytes.get(), data + 1, n);
  const bool address = (mode & 1) != 0;
  if ((mode & 4) != 0 && n >= 4) std::memcpy(bytes.get(), address ? "ZSUA" : "ZSUK", 4);
  if ((mode & 2) != 0) RepairChecksum(bytes.get(), n);
  const absl::string_view view(bytes.get(), n);
  if (address) {
    CheckAddress(view);
  } else {
    CheckRkey(view);
  }
  CheckEncodings(view);
  return 0;
}
