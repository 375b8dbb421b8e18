#include "transport/ucx/ucx_wire.h"

#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/fnv.h"

namespace zeroshard::transport::ucx {
namespace {

constexpr char kAddressMagic[4] = {'Z', 'S', 'U', 'A'};
constexpr char kRkeyMagic[4] = {'Z', 'S', 'U', 'K'};

void AppendLe(std::string* out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>(v >> (8 * i)));
}

uint64_t ReadLe(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

std::string Wrap(const char (&magic)[4], absl::string_view payload) {
  std::string out(magic, 4);
  out.reserve(kEnvelopeBytes + payload.size());
  AppendLe(&out, payload.size(), 4);
  out.append(payload.data(), payload.size());
  AppendLe(&out, Fnv1a(payload), 8);
  return out;
}

// The payload, or InvalidArgument; `rest` gets what follows the envelope.
absl::StatusOr<absl::string_view> Unwrap(const char (&magic)[4], absl::string_view bytes,
                                         absl::string_view what, absl::string_view* rest) {
  if (bytes.size() < kEnvelopeBytes || std::memcmp(bytes.data(), magic, 4) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " (", bytes.size(), " bytes) is not a UCX one"));
  }
  const uint64_t size = ReadLe(bytes.data() + 4, 4);
  if (size > bytes.size() - kEnvelopeBytes) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": claims ", size, " payload bytes, has ",
                                                   bytes.size() - kEnvelopeBytes));
  }
  absl::string_view payload = bytes.substr(8, size);
  if (ReadLe(bytes.data() + 8 + size, 8) != Fnv1a(payload)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": checksum mismatch"));
  }
  *rest = bytes.substr(kEnvelopeBytes + size);
  return payload;
}

}  // namespace

std::string EncodeAddress(const PeerIdentity& identity, absl::string_view worker_address,
                          absl::string_view name) {
  std::string payload;
  payload.reserve(kIdentityBytes + worker_address.size());
  AppendLe(&payload, identity.boot, 8);
  AppendLe(&payload, identity.pid, 4);
  AppendLe(&payload, identity.start_time, 8);
  AppendLe(&payload, identity.instance, 8);
  payload.append(worker_address.data(), worker_address.size());
  std::string out = Wrap(kAddressMagic, payload);
  out.append(name.data(), name.size());
  return out;
}

absl::StatusOr<PeerAddress> DecodeAddress(absl::string_view bytes, absl::string_view what) {
  absl::string_view name;
  absl::StatusOr<absl::string_view> payload = Unwrap(kAddressMagic, bytes, what, &name);
  if (!payload.ok()) return payload.status();
  if (payload->size() <= kIdentityBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": too short (", payload->size(), " payload bytes)"));
  }
  PeerAddress address;
  address.identity.boot = ReadLe(payload->data(), 8);
  address.identity.pid = static_cast<uint32_t>(ReadLe(payload->data() + 8, 4));
  address.identity.start_time = ReadLe(payload->data() + 12, 8);
  address.identity.instance = ReadLe(payload->data() + 20, 8);
  address.worker_address = std::string(payload->substr(kIdentityBytes));
  address.name = std::string(name);
  return address;
}

std::string EncodeRkey(absl::string_view packed) { return Wrap(kRkeyMagic, packed); }

absl::StatusOr<absl::string_view> DecodeRkey(absl::string_view bytes, absl::string_view what) {
  absl::string_view rest;
  absl::StatusOr<absl::string_view> payload = Unwrap(kRkeyMagic, bytes, what, &rest);
  if (!payload.ok()) return payload.status();
  if (payload->empty()) return absl::InvalidArgumentError(absl::StrCat(what, ": empty"));
  if (!rest.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", rest.size(), " bytes after the envelope"));
  }
  return payload;
}

}  // namespace zeroshard::transport::ucx
