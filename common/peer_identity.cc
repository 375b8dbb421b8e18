#include "common/peer_identity.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "grpc/grpc_security_constants.h"

namespace zeroshard {
namespace {

constexpr PeerRole kAllRoles[] = {PeerRole::kDaemon, PeerRole::kTrainer, PeerRole::kAdmin};

}  // namespace

absl::string_view PeerRoleName(PeerRole role) {
  switch (role) {
    case PeerRole::kDaemon:
      return "daemon";
    case PeerRole::kTrainer:
      return "trainer";
    case PeerRole::kAdmin:
      return "admin";
  }
  return "unknown";
}

std::string PeerRoleUri(PeerRole role) {
  return absl::StrCat(kPeerRoleUriPrefix, PeerRoleName(role));
}

std::string PeerRoles::ToString() const {
  std::vector<absl::string_view> names;
  for (PeerRole role : kAllRoles) {
    if (has(role)) names.push_back(PeerRoleName(role));
  }
  return names.empty() ? "no role" : absl::StrJoin(names, ", ");
}

PeerRoles PeerRolesFromUris(const std::vector<absl::string_view>& uris) {
  PeerRoles roles;
  for (absl::string_view uri : uris) {
    for (PeerRole role : kAllRoles) {
      if (uri == PeerRoleUri(role)) roles.add(role);
    }
  }
  return roles;
}

PeerRoles PeerRolesOf(const grpc::AuthContext* auth) {
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return PeerRoles();
  std::vector<absl::string_view> uris;
  for (const grpc::string_ref& value : auth->FindPropertyValues(GRPC_PEER_URI_PROPERTY_NAME)) {
    uris.emplace_back(value.data(), value.size());
  }
  return PeerRolesFromUris(uris);
}

std::string PeerSubjectOf(const grpc::AuthContext* auth) {
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return "";
  for (const char* property : {GRPC_X509_SUBJECT_PROPERTY_NAME, GRPC_X509_CN_PROPERTY_NAME}) {
    for (const grpc::string_ref& value : auth->FindPropertyValues(property)) {
      if (value.size() != 0) return std::string(value.data(), value.size());
    }
  }
  return "";
}

}  // namespace zeroshard
