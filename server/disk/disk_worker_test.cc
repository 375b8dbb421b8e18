#include "server/disk/disk_worker.h"

#include <atomic>
#include <memory>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace zeroshard {
namespace {

constexpr absl::Duration kTimeout = absl::Milliseconds(300);

// Until the worker's call in progress has returned (2 s at most).
void AwaitIdle(const DiskWorker& w) {
  for (int i = 0; i < 200 && w.Busy() > absl::ZeroDuration(); ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
}


TEST(DiskWorkerTest, RunsCallsAndReturnsTheirResults) {
  DiskWorker w("--checkpoint_dir /d", "--disk_timeout_seconds=0.3", kTimeout);
  EXPECT_TRUE(w.Run([] { return absl::OkStatus(); }).ok());
  EXPECT_EQ(w.Run([] { return absl::DataLossError("bad block"); }).code(),
            absl::StatusCode::kDataLoss);
  absl::StatusOr<int> v = w.Call<int>([]() -> absl::StatusOr<int> { return 42; });
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(*v, 42);
  EXPECT_EQ(w.Busy(), absl::ZeroDuration());
}

TEST(DiskWorkerTest, AHungCallTimesOutAndLaterCallsAreRefusedAtOnceUntilItReturns) {
  DiskWorker w("--checkpoint_dir /d", "--disk_timeout_seconds=0.3", kTimeout);
  auto disk = std::make_shared<absl::Notification>();
  auto ran = std::make_shared<std::atomic<int>>(0);

  absl::Time start = absl::Now();
  absl::Status hung = w.Run([disk] {
    disk->WaitForNotification();
    return absl::OkStatus();
  });
  EXPECT_EQ(hung.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(hung.message().find("--checkpoint_dir /d did not answer within "
                                "--disk_timeout_seconds=0.3"),
            absl::string_view::npos)
      << hung;
  EXPECT_GE(absl::Now() - start, kTimeout);

  // Past the timeout the disk counts as hung: refused without waiting, and
  // the refused call never runs.
  absl::SleepFor(kTimeout);
  start = absl::Now();
  absl::Status refused = w.Run([ran] {
    ++*ran;
    return absl::OkStatus();
  });
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(refused.message().find("has not returned for"), absl::string_view::npos) << refused;
  EXPECT_LT(absl::Now() - start, kTimeout / 3);
  EXPECT_GT(w.Busy(), kTimeout);

  // The disk answers: the worker serves again.
  disk->Notify();
  AwaitIdle(w);
  EXPECT_TRUE(w.Run([ran] {
                ++*ran;
                return absl::OkStatus();
              }).ok());
  EXPECT_EQ(ran->load(), 1);
}

TEST(DiskWorkerTest, ACallNobodyWaitsForAnyMoreIsDroppedUnrun) {
  DiskWorker w("--checkpoint_dir /d", "--disk_timeout_seconds=0.3", kTimeout);
  auto disk = std::make_shared<absl::Notification>();
  auto started = std::make_shared<absl::Notification>();
  auto ran = std::make_shared<std::atomic<int>>(0);
  std::thread first([&] {
    EXPECT_EQ(w.Run([disk, started] {
                 started->Notify();
                 disk->WaitForNotification();
                 return absl::OkStatus();
               }).code(),
              absl::StatusCode::kUnavailable);
  });
  started->WaitForNotification();
  // Queued behind the hung call (not yet past the timeout), then given up.
  EXPECT_EQ(w.Run([ran] {
               ++*ran;
               return absl::OkStatus();
             }).code(),
            absl::StatusCode::kUnavailable);
  first.join();
  disk->Notify();
  AwaitIdle(w);
  EXPECT_TRUE(w.Run([] { return absl::OkStatus(); }).ok());
  EXPECT_EQ(ran->load(), 0);
}

TEST(DiskWorkerTest, DestroyingAWorkerWithAHungCallDoesNotWaitForIt) {
  auto disk = std::make_shared<absl::Notification>();
  auto returned = std::make_shared<absl::Notification>();
  const absl::Time start = absl::Now();
  {
    DiskWorker w("--checkpoint_dir /d", "--disk_timeout_seconds=0.3", kTimeout);
    EXPECT_EQ(w.Run([disk, returned] {
                 disk->WaitForNotification();
                 returned->Notify();
                 return absl::OkStatus();
               }).code(),
              absl::StatusCode::kUnavailable);
  }
  EXPECT_LT(absl::Now() - start, 4 * kTimeout);
  // The left thread still ends its call when the disk answers.
  disk->Notify();
  EXPECT_TRUE(returned->WaitForNotificationWithTimeout(absl::Seconds(10)));
}

}  // namespace
}  // namespace zeroshard
