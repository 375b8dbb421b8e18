#include "common/tls.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/testing/test_pki.h"
#include "gtest/gtest.h"

namespace zeroshard {
namespace {

class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { pki_ = testing::TestPki::Create().release(); }
  static void TearDownTestSuite() { delete pki_; }
  void SetUp() override { ASSERT_NE(pki_, nullptr); }
  static std::string File(const std::string& name) { return pki_->File(name); }
  static TlsFiles Good() { return {File("server.crt"), File("server.key"), File("ca.crt")}; }
  static testing::TestPki* pki_;
};

testing::TestPki* TlsTest::pki_ = nullptr;

TEST_F(TlsTest, NoneOrAllThreeFiles) {
  EXPECT_TRUE(ValidateTlsFiles({}, "--").ok());
  EXPECT_TRUE(ValidateTlsFiles(Good(), "--").ok());
  TlsFiles no_key = Good();
  no_key.key.clear();
  absl::Status s = ValidateTlsFiles(no_key, "--");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("--tls_key"), std::string::npos) << s;
  TlsFiles missing = Good();
  missing.ca = File("nope.crt");
  s = ValidateTlsFiles(missing, "ClientConfig.");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("ClientConfig.tls_ca"), std::string::npos) << s;
}

TEST_F(TlsTest, CredentialsFromPemFiles) {
  EXPECT_TRUE(MakeServerCredentials(Good(), "--").ok());
  EXPECT_TRUE(MakeChannelCredentials({File("client.crt"), File("client.key"), File("ca.crt")},
                                     "--")
                  .ok());
  EXPECT_TRUE(MakeServerCredentials({}, "--").ok());  // plaintext
  // A file that is not PEM.
  std::ofstream(File("garbage.pem")) << "not a certificate";
  TlsFiles bad = Good();
  bad.cert = File("garbage.pem");
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> c = MakeServerCredentials(bad, "--");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("no PEM block"), std::string::npos) << c.status();
}

TEST_F(TlsTest, EnvironmentFillsEmptyFields) {
  ::setenv("ZS_TLS_CERT", "/env/cert", 1);
  ::setenv("ZS_TLS_KEY", "/env/key", 1);
  ::setenv("ZS_TLS_CA", "/env/ca", 1);
  TlsFiles f = TlsFilesFromEnvironment({"/flag/cert", "", ""});
  EXPECT_EQ(f.cert, "/flag/cert");
  EXPECT_EQ(f.key, "/env/key");
  EXPECT_EQ(f.ca, "/env/ca");
  ::unsetenv("ZS_TLS_CERT");
  ::unsetenv("ZS_TLS_KEY");
  ::unsetenv("ZS_TLS_CA");
  EXPECT_FALSE(TlsFilesFromEnvironment({}).enabled());
}

TEST(LoopbackTest, OnlyThisHost) {
  EXPECT_TRUE(IsLoopbackAddress("127.0.0.1:7070"));
  EXPECT_TRUE(IsLoopbackAddress("127.3.4.5:1"));
  EXPECT_TRUE(IsLoopbackAddress("localhost:7070"));
  EXPECT_TRUE(IsLoopbackAddress("[::1]:7070"));
  EXPECT_FALSE(IsLoopbackAddress("0.0.0.0:7070"));
  EXPECT_FALSE(IsLoopbackAddress("10.0.0.5:7070"));
  EXPECT_FALSE(IsLoopbackAddress("[::]:7070"));
  EXPECT_FALSE(IsLoopbackAddress("node0:7070"));
  EXPECT_FALSE(IsLoopbackAddress("127.0.0.1.example.com:7070"));
  // IPv6 in brackets, any spelling of ::1; IPv4-mapped loopback.
  EXPECT_TRUE(IsLoopbackAddress("[::1]"));
  EXPECT_TRUE(IsLoopbackAddress("[0:0:0:0:0:0:0:1]:7070"));
  EXPECT_TRUE(IsLoopbackAddress("[::ffff:127.0.0.1]:7070"));
  EXPECT_FALSE(IsLoopbackAddress("[::ffff:10.0.0.5]:7070"));
  EXPECT_FALSE(IsLoopbackAddress("[fe80::1]:7070"));
  EXPECT_FALSE(IsLoopbackAddress("[::1]x:7070"));
  EXPECT_FALSE(IsLoopbackAddress("[::1:7070"));
  EXPECT_FALSE(IsLoopbackAddress("::1"));  // without brackets: host "::" and port 1
  // Hostnames: localhost alone.
  EXPECT_TRUE(IsLoopbackAddress("localhost"));
  EXPECT_FALSE(IsLoopbackAddress("localhost.example.com:7070"));
  EXPECT_FALSE(IsLoopbackAddress("mylocalhost:7070"));
  EXPECT_FALSE(IsLoopbackAddress("192.168.1.2:7070"));
  EXPECT_FALSE(IsLoopbackAddress("128.0.0.1:7070"));
  EXPECT_FALSE(IsLoopbackAddress(""));
}

TEST(PlaintextAddressTest, TokensInPlaintextStayOnThisHost) {
  auto check = [](absl::string_view address, bool tls, bool insecure) {
    return CheckPlaintextAddress(address, tls, insecure, "ClientConfig.daemons",
                                 "ClientConfig.tls", "ClientConfig.insecure");
  };
  for (absl::string_view loopback : {"127.0.0.1:7070", "[::1]:7070", "localhost:7070"}) {
    EXPECT_TRUE(check(loopback, false, false).ok()) << loopback;
  }
  for (absl::string_view remote : {"10.0.0.5:7070", "[fe80::1]:7070", "node0:7070",
                                   "0.0.0.0:7070"}) {
    const absl::Status s = check(remote, false, false);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << remote;
    EXPECT_NE(s.message().find(absl::StrCat("ClientConfig.daemons: ", remote)), std::string::npos)
        << s;
    EXPECT_NE(s.message().find("give ClientConfig.tls"), std::string::npos) << s;
    EXPECT_NE(s.message().find("or ClientConfig.insecure"), std::string::npos) << s;
    EXPECT_TRUE(check(remote, true, false).ok()) << remote;   // TLS
    EXPECT_TRUE(check(remote, false, true).ok()) << remote;   // said so
  }
}

TEST(PlaintextAddressTest, InsecureFromTheEnvironment) {
  ::unsetenv("ZS_INSECURE");
  EXPECT_FALSE(InsecureOrEnvironment(false));
  EXPECT_TRUE(InsecureOrEnvironment(true));
  ::setenv("ZS_INSECURE", "0", 1);
  EXPECT_FALSE(InsecureOrEnvironment(false));
  ::setenv("ZS_INSECURE", "yes", 1);
  EXPECT_FALSE(InsecureOrEnvironment(false));
  ::setenv("ZS_INSECURE", "1", 1);
  EXPECT_TRUE(InsecureOrEnvironment(false));
  ::unsetenv("ZS_INSECURE");
}

}  // namespace
}  // namespace zeroshard
