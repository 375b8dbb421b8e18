#include "server/rpc/peer_role.h"

#include "absl/strings/str_cat.h"

namespace zeroshard {

absl::Status RequirePeerRole(const grpc::ServerContext& call, PeerRole role, bool tls) {
  if (!tls) return absl::OkStatus();
  const PeerRoles roles = PeerRolesOf(call.auth_context().get());
  if (roles.has(role)) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      "this call needs a client certificate with the ", PeerRoleName(role),
      " role (subjectAltName URI:", PeerRoleUri(role), "); the caller's certificate has ",
      roles.empty() ? "no role" : absl::StrCat("the role(s) ", roles.ToString()),
      ": issue the caller a certificate with that URI (docs/security.md)"));
}

}  // namespace zeroshard
