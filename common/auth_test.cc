#include "common/auth.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace zeroshard {
namespace {

using ::testing::HasSubstr;

std::string WriteFile(const std::string& name, const std::string& text, mode_t mode) {
  const std::string path = std::string(std::getenv("TEST_TMPDIR")) + "/" + name;
  std::ofstream(path) << text;
  ::chmod(path.c_str(), mode);
  return path;
}

TEST(AuthTest, GeneratedTokensAreValidAndDistinct) {
  absl::StatusOr<std::string> a = GenerateToken();
  absl::StatusOr<std::string> b = GenerateToken();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->size(), 64u);
  EXPECT_NE(*a, *b);
  EXPECT_TRUE(ValidateToken(*a, "token").ok());
}

TEST(AuthTest, MalformedTokensAreRefused) {
  EXPECT_THAT(ValidateToken("short", "ZS_JOB_TOKEN").message(), HasSubstr("ZS_JOB_TOKEN"));
  EXPECT_FALSE(ValidateToken(std::string(kMaxTokenLength + 1, 'a'), "t").ok());
  EXPECT_FALSE(ValidateToken("has a space in the middle!", "t").ok());
  EXPECT_FALSE(ValidateToken(std::string("abcdefghijklmnop\n"), "t").ok());
}

TEST(AuthTest, DigestsMatchOnlyTheSameToken) {
  const TokenDigest d = TokenDigest::Of("0123456789abcdef0123");
  EXPECT_TRUE(d.Matches(TokenDigest::Of("0123456789abcdef0123")));
  EXPECT_FALSE(d.Matches(TokenDigest::Of("0123456789abcdef0124")));
  EXPECT_FALSE(d.Matches(TokenDigest::Of("")));
}

TEST(AuthTest, DigestsRoundTripThroughHex) {
  const TokenDigest d = TokenDigest::Of("0123456789abcdef0123");
  ASSERT_EQ(d.ToHex().size(), 64u);
  std::optional<TokenDigest> back = TokenDigest::FromHex(d.ToHex());
  ASSERT_TRUE(back.has_value());
  EXPECT_TRUE(back->Matches(d));
  EXPECT_FALSE(TokenDigest::FromHex("abc").has_value());
  EXPECT_FALSE(TokenDigest::FromHex(std::string(64, 'g')).has_value());
}

TEST(AuthTest, TokenFilesMustBePrivate) {
  const std::string token = "secret-secret-secret-1";
  absl::StatusOr<std::string> ok = ReadTokenFile(WriteFile("ok", token + "\n", 0600), "--f");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(*ok, token);
  absl::StatusOr<std::string> open = ReadTokenFile(WriteFile("open", token, 0644), "--f");
  EXPECT_THAT(open.status().message(), HasSubstr("chmod 600"));
  EXPECT_FALSE(ReadTokenFile(WriteFile("empty", "\n", 0600), "--f").ok());
  EXPECT_THAT(ReadTokenFile("/nonexistent/token", "--f").status().message(),
              HasSubstr("cannot read"));
}

// What is read is what is checked: a link to a private file is read (secrets
// in Kubernetes are links), a link to an open one is not; a directory or a
// FIFO at the path is refused at once, not read (a FIFO would block).
TEST(AuthTest, TokenFilesAreCheckedAsOpened) {
  const std::string token = "secret-secret-secret-2";
  const std::string dir = std::string(std::getenv("TEST_TMPDIR"));
  const std::string link = dir + "/link";
  ::unlink(link.c_str());
  ASSERT_EQ(::symlink(WriteFile("target", token, 0600).c_str(), link.c_str()), 0);
  EXPECT_EQ(ReadTokenFile(link, "--f").value_or(""), token);
  const std::string open_link = dir + "/open_link";
  ::unlink(open_link.c_str());
  ASSERT_EQ(::symlink(WriteFile("open_target", token, 0644).c_str(), open_link.c_str()), 0);
  EXPECT_THAT(ReadTokenFile(open_link, "--f").status().message(), HasSubstr("chmod 600"));

  const std::string sub = dir + "/a_directory";
  ::mkdir(sub.c_str(), 0700);
  EXPECT_THAT(ReadTokenFile(sub, "--f").status().message(), HasSubstr("not a regular file"));
  const std::string fifo = dir + "/fifo";
  ::unlink(fifo.c_str());
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_THAT(ReadTokenFile(fifo, "--f").status().message(), HasSubstr("not a regular file"));
}

// A private file of another user: that user can change the token at will.
TEST(AuthTest, TokenFilesOfAnotherUserAreRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give a file to another user";
  const std::string path = WriteFile("other", "secret-secret-secret-3", 0600);
  ASSERT_EQ(::chown(path.c_str(), 65534, 65534), 0);
  absl::StatusOr<std::string> read = ReadTokenFile(path, "--f");
  EXPECT_THAT(read.status().message(), HasSubstr("belongs to uid 65534"));
}

TEST(AuthTest, PresentedTokenReadsBearerMetadata) {
  const std::string key = kAuthorizationMetadataKey;
  const std::string good = "Bearer abcdefghijklmnopq";
  const std::string basic = "Basic abcdefghijklmnopq";
  std::multimap<grpc::string_ref, grpc::string_ref> md;
  EXPECT_FALSE(PresentedToken(md).has_value());
  md.insert({key, basic});
  EXPECT_FALSE(PresentedToken(md).has_value());
  md.clear();
  md.insert({key, good});
  ASSERT_TRUE(PresentedToken(md).has_value());
  EXPECT_EQ(*PresentedToken(md), "abcdefghijklmnopq");
}

TEST(AuthTest, EnvironmentFallback) {
  ::setenv(kJobTokenEnvironment, "from-the-environment", 1);
  EXPECT_EQ(JobTokenOrEnvironment(""), "from-the-environment");
  EXPECT_EQ(JobTokenOrEnvironment("given"), "given");
  ::unsetenv(kJobTokenEnvironment);
  EXPECT_EQ(JobTokenOrEnvironment(""), "");
}

}  // namespace
}  // namespace zeroshard
