#include "client/executor.h"

#include <atomic>

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

TEST(ExecutorTest, RunsEverythingSubmittedBeforeDestruction) {
  std::atomic<int> ran{0};
  {
    Executor executor(3);
    for (int i = 0; i < 100; ++i) executor.Submit([&ran] { ++ran; });
  }
  EXPECT_EQ(ran.load(), 100);
}

TEST(CountDownTest, KeepsTheFirstErrorAndTimesOut) {
  Executor executor(2);
  CountDown group(3);
  executor.Submit([&] { group.Done(); });
  executor.Submit([&] { group.Done(absl::UnavailableError("first")); });
  EXPECT_EQ(group.Wait(absl::Now() + absl::Milliseconds(50), "test").code(),
            absl::StatusCode::kDeadlineExceeded);
  group.Done(absl::InternalError("second"));
  const absl::Status s = group.Wait(absl::Now() + absl::Seconds(5), "test");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(group.done());
}

}  // namespace
}  // namespace zeroshard
