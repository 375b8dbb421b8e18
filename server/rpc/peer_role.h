#pragma once

// The role a daemon demands of a caller's certificate, per service
// (docs/security.md). Under mutual TLS any certificate the deployment's CA
// signed passes the handshake; this is what keeps a trainer's certificate
// from acting as a daemon.

#include "absl/status/status.h"
#include "common/peer_identity.h"
#include "grpcpp/server_context.h"

namespace zeroshard {

// OK when the daemon serves plaintext (`tls` false: tokens alone guard a
// plaintext daemon, which listens on loopback unless --insecure), or when
// the certificate the caller presented names `role`
// (common/peer_identity.h); PermissionDenied otherwise, saying which role
// the call needs, which roles the certificate has, and the subjectAltName
// URI a certificate of that role carries.
absl::Status RequirePeerRole(const grpc::ServerContext& call, PeerRole role, bool tls);

}  // namespace zeroshard
