// PollWithBackoff, the one poll loop of the step coordinator. The leader and
// follower steps run against real daemons in client_test and
// tests/integration_test.

#include "client/step_coordinator.h"

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace zeroshard {
namespace {

TEST(PollWithBackoffTest, ReturnsOnceNothingIsWaitedFor) {
  int calls = 0;
  const absl::Status s =
      PollWithBackoff(absl::Now() + absl::Seconds(5), "wait", [&](std::string* waiting) {
        if (++calls < 4) *waiting = "not yet";
        return absl::OkStatus();
      });
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(calls, 4);
}

TEST(PollWithBackoffTest, StopsAtThePollsError) {
  int calls = 0;
  const absl::Status s =
      PollWithBackoff(absl::Now() + absl::Seconds(5), "wait", [&](std::string* waiting) {
        *waiting = "x";
        return ++calls == 2 ? absl::UnavailableError("gone") : absl::OkStatus();
      });
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(calls, 2);
}

TEST(PollWithBackoffTest, TimesOutNamingWhatItWaitedFor) {
  const absl::Time start = absl::Now();
  int calls = 0;
  const absl::Status s = PollWithBackoff(start + absl::Milliseconds(200), "Step 3",
                                         [&](std::string* waiting) {
                                           ++calls;
                                           *waiting = "daemon a:1 has not committed it";
                                           return absl::OkStatus();
                                         });
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(s.message(), "Step 3: daemon a:1 has not committed it");
  const absl::Duration took = absl::Now() - start;
  EXPECT_GE(took, absl::Milliseconds(200));
  EXPECT_LT(took, absl::Milliseconds(400));
  // Backoff doubles up to 50 ms: far fewer calls than a busy loop.
  EXPECT_LT(calls, 20);
  EXPECT_GT(calls, 4);
}

}  // namespace
}  // namespace zeroshard
