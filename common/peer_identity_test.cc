#include "common/peer_identity.h"

#include <map>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

PeerRoles Roles(std::initializer_list<PeerRole> roles) {
  PeerRoles r;
  for (PeerRole role : roles) r.add(role);
  return r;
}

TEST(PeerRolesTest, UrisNameRoles) {
  EXPECT_EQ(PeerRoleUri(PeerRole::kDaemon), "urn:zeroshard:role:daemon");
  EXPECT_EQ(PeerRoleUri(PeerRole::kTrainer), "urn:zeroshard:role:trainer");
  EXPECT_EQ(PeerRoleUri(PeerRole::kAdmin), "urn:zeroshard:role:admin");
  EXPECT_EQ(PeerRolesFromUris({"urn:zeroshard:role:daemon"}), Roles({PeerRole::kDaemon}));
  EXPECT_EQ(PeerRolesFromUris({"spiffe://example.org/x", "urn:zeroshard:role:trainer",
                               "urn:zeroshard:role:admin"}),
            Roles({PeerRole::kTrainer, PeerRole::kAdmin}));
  EXPECT_EQ(PeerRolesFromUris({"urn:zeroshard:role:daemon", "urn:zeroshard:role:daemon"}),
            Roles({PeerRole::kDaemon}));
}

TEST(PeerRolesTest, AnythingElseIsNoRole) {
  EXPECT_TRUE(PeerRolesFromUris({}).empty());
  for (absl::string_view uri :
       {"urn:zeroshard:role:", "urn:zeroshard:role:root", "urn:zeroshard:role:daemon ",
        "urn:zeroshard:role:daemonx", "URN:ZEROSHARD:ROLE:DAEMON", "urn:zeroshard:daemon",
        "xurn:zeroshard:role:daemon", "daemon", "https://example.org/urn:zeroshard:role:admin"}) {
    EXPECT_TRUE(PeerRolesFromUris({uri}).empty()) << uri;
  }
  EXPECT_EQ(PeerRoles().ToString(), "no role");
  EXPECT_EQ(Roles({PeerRole::kAdmin, PeerRole::kDaemon}).ToString(), "daemon, admin");
}

// An AuthContext holding the given properties, as gRPC fills one for a
// mutual-TLS call.
class FakeAuthContext final : public grpc::AuthContext {
 public:
  FakeAuthContext(std::multimap<std::string, std::string> properties, bool authenticated)
      : properties_(std::move(properties)), authenticated_(authenticated) {}
  bool IsPeerAuthenticated() const override { return authenticated_; }
  std::vector<grpc::string_ref> GetPeerIdentity() const override { return {}; }
  std::string GetPeerIdentityPropertyName() const override { return ""; }
  std::vector<grpc::string_ref> FindPropertyValues(const std::string& name) const override {
    std::vector<grpc::string_ref> values;
    for (auto [it, end] = properties_.equal_range(name); it != end; ++it) {
      values.emplace_back(it->second);
    }
    return values;
  }
  grpc::AuthPropertyIterator begin() const override { return End(); }
  grpc::AuthPropertyIterator end() const override { return End(); }
  void AddProperty(const std::string&, const grpc::string_ref&) override {}
  bool SetPeerIdentityPropertyName(const std::string&) override { return false; }

 private:
  struct EndIterator : grpc::AuthPropertyIterator {};
  static grpc::AuthPropertyIterator End() { return EndIterator(); }

  const std::multimap<std::string, std::string> properties_;
  const bool authenticated_;
};

TEST(PeerRolesTest, FromTheCallsAuthContext) {
  const FakeAuthContext daemon({{"x509_subject_alternative_name", "node0"},
                                {"x509_subject_alternative_name", "urn:zeroshard:role:daemon"},
                                {"peer_dns", "node0"},
                                {"peer_uri", "urn:zeroshard:role:daemon"}},
                               true);
  EXPECT_EQ(PeerRolesOf(&daemon), Roles({PeerRole::kDaemon}));
  // A DNS name that spells a role's URI is no role.
  const FakeAuthContext dns({{"x509_subject_alternative_name", "urn:zeroshard:role:daemon"},
                             {"peer_dns", "urn:zeroshard:role:daemon"}},
                            true);
  EXPECT_TRUE(PeerRolesOf(&dns).empty());
  const FakeAuthContext unauthenticated({{"peer_uri", "urn:zeroshard:role:admin"}}, false);
  EXPECT_TRUE(PeerRolesOf(&unauthenticated).empty());
  EXPECT_TRUE(PeerRolesOf(nullptr).empty());
}

}  // namespace
}  // namespace zeroshard
