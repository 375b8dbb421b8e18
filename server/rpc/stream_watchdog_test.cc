#include "server/rpc/stream_watchdog.h"

#include <atomic>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace zeroshard {
namespace {

TEST(StreamWatchdogTest, CancelsAWaitOnThePeerPastTheIdleLimit) {
  StreamWatchdog watchdog(absl::Milliseconds(100));
  absl::Notification cancelled;
  std::unique_ptr<StreamWatch> watch = watchdog.Watch([&] { cancelled.Notify(); });
  // A read that only ends when the call is cancelled, as gRPC's does.
  const bool ok = watch->Wait([&] {
    return !cancelled.WaitForNotificationWithTimeout(absl::Seconds(10));
  });
  EXPECT_FALSE(ok);
  EXPECT_TRUE(watch->expired());
  EXPECT_EQ(watchdog.cancelled(), 1u);
}

TEST(StreamWatchdogTest, TimeBetweenWaitsIsNotIdle) {
  StreamWatchdog watchdog(absl::Milliseconds(100));
  std::atomic<int> cancels{0};
  std::unique_ptr<StreamWatch> watch = watchdog.Watch([&] { ++cancels; });
  // The handler's own work (here 400 ms) between short reads.
  for (int i = 0; i < 4; ++i) {
    EXPECT_TRUE(watch->Wait([] {
      absl::SleepFor(absl::Milliseconds(20));
      return true;
    }));
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_EQ(cancels.load(), 0);
  EXPECT_FALSE(watch->expired());
}

TEST(StreamWatchdogTest, CancelsOnceAndForgetsDestroyedWatches) {
  StreamWatchdog watchdog(absl::Milliseconds(50));
  std::atomic<int> cancels{0};
  {
    std::unique_ptr<StreamWatch> watch = watchdog.Watch([&] { ++cancels; });
    watch->Wait([] {
      absl::SleepFor(absl::Milliseconds(400));  // ignores the cancel
      return false;
    });
    EXPECT_TRUE(watch->expired());
  }
  absl::SleepFor(absl::Milliseconds(100));  // the thread must not touch the freed watch
  EXPECT_EQ(cancels.load(), 1);
}

TEST(StreamWatchdogTest, AWatchWithoutWatchdogOnlyRunsTheIO) {
  StreamWatch watch;
  EXPECT_TRUE(watch.Wait([] { return true; }));
  EXPECT_FALSE(watch.Wait([] { return false; }));
  EXPECT_FALSE(watch.expired());
}

}  // namespace
}  // namespace zeroshard
