#pragma once

// Roles in certificates (docs/security.md): under mutual TLS every
// certificate the deployment's CA signs is let in, so a certificate also
// names what its holder may act as, with one subjectAltName URI per role:
//
//   urn:zeroshard:role:daemon    a shard daemon (zeroshardd; it also calls
//                                its peers' Replica service with it)
//   urn:zeroshard:role:trainer   a trainer (the client library, gpt_train)
//   urn:zeroshard:role:admin     an operator (zsctl)
//
// e.g. `subjectAltName=DNS:node0,IP:10.0.0.5,URI:urn:zeroshard:role:daemon`.
// A certificate with none of them has no role. Only URI names count: a DNS
// name spelling the same text does not.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "grpcpp/security/auth_context.h"

namespace zeroshard {

enum class PeerRole : uint8_t {
  kDaemon = 1 << 0,
  kTrainer = 1 << 1,
  kAdmin = 1 << 2,
};

// "urn:zeroshard:role:"; a role's URI is this and its name.
inline constexpr char kPeerRoleUriPrefix[] = "urn:zeroshard:role:";

// "daemon", "trainer", "admin".
absl::string_view PeerRoleName(PeerRole role);
// "urn:zeroshard:role:daemon", ...
std::string PeerRoleUri(PeerRole role);

// A set of roles.
class PeerRoles {
 public:
  PeerRoles() = default;
  bool has(PeerRole role) const { return (bits_ & static_cast<uint8_t>(role)) != 0; }
  void add(PeerRole role) { bits_ |= static_cast<uint8_t>(role); }
  bool empty() const { return bits_ == 0; }
  uint8_t bits() const { return bits_; }
  // "daemon, trainer", or "no role".
  std::string ToString() const;
  bool operator==(const PeerRoles& other) const { return bits_ == other.bits_; }

 private:
  uint8_t bits_ = 0;
};

// The roles among a certificate's URI subjectAltNames: exact matches of a
// role's URI; other URIs (and unknown roles) are ignored.
PeerRoles PeerRolesFromUris(const std::vector<absl::string_view>& uris);

// The roles of the peer's certificate as gRPC verified it: the URI names of
// `auth` (property "peer_uri", one value per URI name; gRPC also lists them
// among "x509_subject_alternative_name", mixed with DNS, IP and e-mail
// names, which is why that one is not read). None for a null context, a
// peer gRPC did not authenticate, or a plaintext call.
PeerRoles PeerRolesOf(const grpc::AuthContext* auth);

// Who the peer's certificate names, for quotas and logs: its subject
// distinguished name as gRPC prints it ("x509_subject", e.g.
// "CN=trainer-a,O=lab"), else its common name; empty for a null context, a
// peer gRPC did not authenticate, or a plaintext call.
std::string PeerSubjectOf(const grpc::AuthContext* auth);

}  // namespace zeroshard
