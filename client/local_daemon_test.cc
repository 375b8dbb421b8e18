#include "client/local_daemon.h"

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

TEST(LocalDaemonTest, HostOfAddress) {
  EXPECT_EQ(HostOfAddress("10.0.0.1:7070"), "10.0.0.1");
  EXPECT_EQ(HostOfAddress("[::1]:7070"), "::1");
  EXPECT_EQ(HostOfAddress("node-b:7070"), "node-b");
}

TEST(LocalDaemonTest, TheFirstDaemonOnThisMachine) {
  // 192.0.2.0/24 (TEST-NET-1) is no interface's address.
  absl::StatusOr<int> d = FindLocalDaemon({"192.0.2.7:7070", "127.0.0.1:7071", "[::1]:7072"});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(*d, 1);
  d = FindLocalDaemon({"192.0.2.7:7070", "192.0.2.8:7070"});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(*d, -1);
}

}  // namespace
}  // namespace zeroshard
