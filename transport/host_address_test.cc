#include "transport/host_address.h"

#include <arpa/inet.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace zeroshard::transport {
namespace {

using ::testing::StartsWith;

TEST(HostAddressTest, Wildcards) {
  for (const char* wildcard : {"0.0.0.0", "[::]", "::", "[0:0:0:0:0:0:0:0]"}) {
    EXPECT_TRUE(IsWildcardHost(wildcard)) << wildcard;
  }
  for (const char* host : {"127.0.0.1", "10.0.0.5", "[::1]", "node0", "localhost", ""}) {
    EXPECT_FALSE(IsWildcardHost(host)) << host;
  }
}

TEST(HostAddressTest, CanonicalHost) {
  EXPECT_EQ(*CanonicalHost("10.1.2.3", "--advertise_address"), "10.1.2.3");
  EXPECT_EQ(*CanonicalHost("node-7.cluster_a", "--advertise_address"), "node-7.cluster_a");
  // Kubernetes' status.podIP gives IPv6 without brackets.
  EXPECT_EQ(*CanonicalHost("fd00::12", "--advertise_address"), "[fd00::12]");
  EXPECT_EQ(*CanonicalHost("[fd00::12]", "--advertise_address"), "[fd00::12]");
  for (const char* bad :
       {"", "10.1.2.3:7070", "0.0.0.0", "[::]", "node0:1", "[node0]", "a b", "[fd00::12"}) {
    SCOPED_TRACE(bad);
    absl::StatusOr<std::string> host = CanonicalHost(bad, "--advertise_address");
    EXPECT_TRUE(absl::IsInvalidArgument(host.status())) << host.status();
    EXPECT_THAT(host.status().message(), StartsWith("--advertise_address: "));
  }
}

TEST(HostAddressTest, PrimaryAddressIsDialable) {
  if (NonLoopbackIpv4Addresses().empty()) {
    GTEST_SKIP() << "this machine has no non-loopback IPv4 address";
  }
  absl::StatusOr<std::string> primary = PrimaryHostAddress();
  ASSERT_TRUE(primary.ok()) << primary.status();
  EXPECT_FALSE(IsWildcardHost(*primary)) << *primary;
  in_addr v4;
  if (inet_pton(AF_INET, primary->c_str(), &v4) == 1) {
    EXPECT_NE(ntohl(v4.s_addr) >> 24, 127u) << *primary;
  } else {
    EXPECT_THAT(*primary, StartsWith("[")) << "neither IPv4 nor bracketed IPv6";
    EXPECT_NE(*primary, "[::1]");
  }
}

TEST(HostAddressTest, InterfaceAddressesAreNotLoopback) {
  for (const InterfaceAddress& a : NonLoopbackIpv4Addresses()) {
    EXPECT_THAT(a.address, ::testing::Not(StartsWith("127."))) << a.interface;
    EXPECT_NE(a.address, "0.0.0.0") << a.interface;
    EXPECT_FALSE(a.interface.empty());
  }
}

}  // namespace
}  // namespace zeroshard::transport
