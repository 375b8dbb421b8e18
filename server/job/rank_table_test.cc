// RankTable: incarnations that fence older processes, the checks every
// rank-scoped request passes, leaving and removal, staging regions created
// on demand and dropped with the process that asked for them, and the
// liveness the step state reports.

#include "server/job/rank_table.h"

#include <limits>
#include <memory>
#include <thread>
#include <vector>
#include <string>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/fnv.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/ledger/memory_ledger.h"
#include "transport/inproc/inproc_transport.h"

namespace zeroshard {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kSlotBytes = 128;

uint64_t Buffer(const MemoryLedger& ledger) {
  return ledger.JobBytes("job")[static_cast<int>(MemoryCategory::kBuffer)];
}

uint64_t HashOf(const RankTable& t) {
  uint64_t h = kFnv1aOffset;
  t.Hash(h);
  return h;
}

class RankTableTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<transport::Transport>> t =
        transport::inproc::CreateInprocTransport();
    ASSERT_TRUE(t.ok()) << t.status();
    transport_ = *std::move(t);
  }
  RankTable::Options Options(uint32_t world, bool with_transport = true) {
    RankTable::Options o;
    o.job_id = "job";
    o.world_size = world;
    o.transport = with_transport ? transport_.get() : nullptr;
    o.ledger = &ledger_;
    o.staging_slots = 2;
    o.staging_slot_bytes = kSlotBytes;
    return o;
  }

  MemoryLedger ledger_{0};
  std::unique_ptr<transport::Transport> transport_;
};

TEST_F(RankTableTest, NewerIncarnationsFenceOlderOnes) {
  RankTable t(Options(2));
  EXPECT_EQ(t.joined(), 0u);
  EXPECT_EQ(t.Join(0, 3).value_or(99), 0u) << "nothing replaced";
  EXPECT_EQ(t.joined(), 1u);
  EXPECT_EQ(t.Join(0, 3).value_or(99), 0u) << "the same incarnation again";
  EXPECT_EQ(t.joined(), 1u) << "a rank is counted once";
  EXPECT_TRUE(t.Check(0, 3, "").ok());
  // A new process of rank 0.
  EXPECT_EQ(t.Join(0, 5).value_or(99), 3u);
  EXPECT_EQ(t.joined(), 1u);
  absl::Status s = t.Check(0, 3, "");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("fenced"));
  absl::StatusOr<uint64_t> old = t.Join(0, 4);
  EXPECT_EQ(old.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(old.status().message(), HasSubstr("fenced"));
  EXPECT_TRUE(t.Check(0, 5, "").ok());
  // Rank 1 is its own.
  EXPECT_EQ(t.Join(1, 1).value_or(99), 0u);
  EXPECT_EQ(t.joined(), 2u);
}

TEST_F(RankTableTest, AnIncarnationFarAheadIsRefused) {
  RankTable t(Options(1));
  // UINT64_MAX would fence every later process of rank 0 for good.
  absl::StatusOr<uint64_t> far = t.Join(0, std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(far.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(far.status().message(), HasSubstr("incarnation: at most"));
  EXPECT_EQ(t.joined(), 0u);
  // A trainer's start time, and one a few hours ahead (clock skew), join.
  const uint64_t now = static_cast<uint64_t>(absl::ToUnixMicros(absl::Now()));
  EXPECT_TRUE(t.Join(0, now).ok());
  EXPECT_TRUE(t.Join(0, now + uint64_t{3600} * 1000 * 1000 * 5).ok());
  EXPECT_EQ(t.Join(0, now + 2 * RankTable::kMaxIncarnationAheadMicros).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(RankTableTest, CheckNamesTheFieldThatIsWrong) {
  RankTable t(Options(2));
  ASSERT_TRUE(t.Join(1, 2).ok());
  absl::Status s = t.Check(2, 2, "chunk.");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("chunk.rank"));
  s = t.Check(1, 0, "chunk.");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("chunk.incarnation"));
  // Never joined, or a newer incarnation than the one that joined.
  for (const auto& [rank, incarnation] : {std::pair<uint32_t, uint64_t>{0, 1}, {1, 3}}) {
    s = t.Check(rank, incarnation, "");
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << rank;
    EXPECT_THAT(s.message(), HasSubstr("has not joined")) << rank;
  }
}

TEST_F(RankTableTest, TheLastRankToLeaveRemovesTheJob) {
  RankTable t(Options(2));
  ASSERT_TRUE(t.Join(0, 1).ok());
  ASSERT_TRUE(t.Join(1, 1).ok());
  // Only the joined incarnation may leave.
  EXPECT_EQ(t.Leave(0, 2).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(t.joined(), 2u);
  EXPECT_EQ(t.Leave(0, 1).value_or(true), false);
  EXPECT_EQ(t.joined(), 1u);
  EXPECT_EQ(t.Check(0, 1, "").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(t.Leave(0, 1).status().code(), absl::StatusCode::kFailedPrecondition)
      << "left twice";
  // A rank that left joins again while others remain, as a newer
  // incarnation only: pushes of the one that left may still be in flight.
  absl::Status again = t.Join(0, 1).status();
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(again.message(), HasSubstr("left as incarnation 1"));
  absl::Status check = t.Check(0, 1, "");
  EXPECT_EQ(check.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(check.message(), HasSubstr("incarnation 1 left job job"));
  EXPECT_EQ(t.joined(), 1u);
  EXPECT_EQ(t.Join(0, 2).value_or(0), 1u);
  EXPECT_EQ(t.Leave(0, 2).value_or(true), false);
  EXPECT_EQ(t.Leave(1, 1).value_or(false), true);
  EXPECT_EQ(t.joined(), 0u);
  // Removed: no rank joins any more.
  absl::StatusOr<uint64_t> late = t.Join(0, 2);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(late.status().message(), HasSubstr("job job was removed"));
  EXPECT_EQ(t.joined(), 0u);
}

TEST_F(RankTableTest, StagingIsCreatedOnDemandForTheJoinedProcess) {
  RankTable t(Options(2));
  // Not joined: no region, nothing booked.
  EXPECT_EQ(t.Staging(0, 1, true).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Buffer(ledger_), 0u);
  ASSERT_TRUE(t.Join(0, 1).ok());
  absl::StatusOr<std::shared_ptr<RankStaging>> none = t.Staging(0, 1, false);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(none.status().message(), HasSubstr("ExchangeEndpoint"));
  absl::StatusOr<std::shared_ptr<RankStaging>> made = t.Staging(0, 1, true);
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_EQ((*made)->slots(), 2u);
  EXPECT_EQ((*made)->slot_bytes(), kSlotBytes);
  EXPECT_EQ(Buffer(ledger_), 2 * kSlotBytes);
  // The same region on later calls, with or without create.
  EXPECT_EQ(t.Staging(0, 1, false).value_or(nullptr), *made);
  EXPECT_EQ(t.Staging(0, 1, true).value_or(nullptr), *made);
  EXPECT_EQ(Buffer(ledger_), 2 * kSlotBytes);
  // Another rank has its own.
  ASSERT_TRUE(t.Join(1, 1).ok());
  absl::StatusOr<std::shared_ptr<RankStaging>> other = t.Staging(1, 1, true);
  ASSERT_TRUE(other.ok());
  EXPECT_NE(*other, *made);
  EXPECT_EQ(Buffer(ledger_), 4 * kSlotBytes);
}

TEST_F(RankTableTest, ANewProcessOrALeaveDropsTheStaging) {
  RankTable t(Options(2));
  ASSERT_TRUE(t.Join(0, 1).ok());
  ASSERT_TRUE(t.Join(1, 1).ok());
  ASSERT_TRUE(t.Staging(0, 1, true).ok());
  ASSERT_TRUE(t.Staging(1, 1, true).ok());
  EXPECT_EQ(Buffer(ledger_), 4 * kSlotBytes);
  // Rank 0 restarts: its old process's region goes (nobody else holds it).
  ASSERT_EQ(t.Join(0, 2).value_or(0), 1u);
  EXPECT_EQ(Buffer(ledger_), 2 * kSlotBytes);
  EXPECT_EQ(t.Staging(0, 2, false).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(t.Staging(0, 1, true).status().code(), absl::StatusCode::kFailedPrecondition)
      << "the fenced process gets no region";
  // Rank 1 leaves: its region goes too.
  ASSERT_TRUE(t.Leave(1, 1).ok());
  EXPECT_EQ(Buffer(ledger_), 0u);
}

// A staging region is registered and booked with no table lock held: while
// one rank's region is being made, another rank's heartbeat check goes
// through. A rank fenced meanwhile gets no region, and nothing stays booked.
TEST_F(RankTableTest, StagingIsMadeWithNoLockHeld) {
  RankTable* table = nullptr;
  bool other_rank_checked = false;
  bool fence_while_booking = false;
  // The other call runs on its own thread, joined after Staging returns (a
  // table that held its lock here would block it, not deadlock the test).
  std::vector<std::thread> others;
  ledger_.SetListener([&](const std::string&, MemoryCategory, uint64_t bytes) {
    if (table == nullptr || bytes == 0) return;
    auto done = std::make_shared<absl::Notification>();
    auto ok = std::make_shared<bool>(false);
    RankTable* const target = table;
    const bool fence = fence_while_booking;
    others.emplace_back([target, fence, done, ok] {
      *ok = fence ? target->Join(0, 2).ok() : target->Check(1, 1, "").ok();
      done->Notify();
    });
    other_rank_checked = done->WaitForNotificationWithTimeout(absl::Seconds(5)) && *ok;
  });
  auto join_others = [&] {
    for (std::thread& th : others) th.join();
    others.clear();
  };
  RankTable t(Options(2));
  ASSERT_TRUE(t.Join(0, 1).ok());
  ASSERT_TRUE(t.Join(1, 1).ok());
  table = &t;
  EXPECT_TRUE(t.Staging(0, 1, true).ok());
  table = nullptr;
  join_others();
  EXPECT_TRUE(other_rank_checked) << "rank 1's check waited for rank 0's region";

  // Rank 1's process is replaced while its region is being made.
  RankTable u(Options(2));
  ASSERT_TRUE(u.Join(0, 1).ok());
  ASSERT_TRUE(u.Join(1, 1).ok());
  fence_while_booking = true;
  other_rank_checked = false;
  const uint64_t before = Buffer(ledger_);
  table = &u;
  absl::StatusOr<std::shared_ptr<RankStaging>> fenced = u.Staging(0, 1, true);
  table = nullptr;
  join_others();
  EXPECT_TRUE(other_rank_checked);
  EXPECT_EQ(fenced.status().code(), absl::StatusCode::kFailedPrecondition) << fenced.status();
  EXPECT_EQ(Buffer(ledger_), before) << "the fenced process's region stayed booked";
  EXPECT_EQ(u.Staging(0, 2, false).status().code(), absl::StatusCode::kFailedPrecondition);
  ledger_.SetListener(nullptr);
}

TEST_F(RankTableTest, StagingNeedsATransportAndALiveJob) {
  RankTable none(Options(1, /*with_transport=*/false));
  ASSERT_TRUE(none.Join(0, 1).ok());
  absl::StatusOr<std::shared_ptr<RankStaging>> s = none.Staging(0, 1, true);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.status().message(), HasSubstr("no bulk transport"));

  RankTable t(Options(1));
  ASSERT_TRUE(t.Join(0, 1).ok());
  ASSERT_TRUE(t.Leave(0, 1).value_or(false));
  EXPECT_EQ(t.Staging(0, 1, true).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Buffer(ledger_), 0u);
}

TEST_F(RankTableTest, AStagingRegionPastTheLimitIsRefused) {
  MemoryLedger small(kSlotBytes);  // half a region
  RankTable::Options o = Options(1);
  o.ledger = &small;
  RankTable t(o);
  ASSERT_TRUE(t.Join(0, 1).ok());
  EXPECT_EQ(t.Staging(0, 1, true).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(small.total(), 0u);
  EXPECT_EQ(t.Staging(0, 1, false).status().code(), absl::StatusCode::kFailedPrecondition)
      << "a refused region is not kept";
}

TEST_F(RankTableTest, ConnectedCountsRanksHeardFromRecently) {
  RankTable t(Options(3));
  ASSERT_TRUE(t.Join(0, 1).ok());
  ASSERT_TRUE(t.Join(2, 1).ok());
  EXPECT_EQ(t.Connected(absl::Hours(1)), 2u);
  // Wide margins: a busy machine may stall this thread between two lines.
  constexpr absl::Duration kTimeout = absl::Milliseconds(250);
  absl::SleepFor(2 * kTimeout);
  EXPECT_EQ(t.Connected(kTimeout), 0u);
  // A request that passes Check counts as hearing from the rank.
  ASSERT_TRUE(t.Check(2, 1, "").ok());
  EXPECT_EQ(t.Connected(kTimeout), 1u);
  // A refused request does not.
  EXPECT_FALSE(t.Check(0, 7, "").ok());
  EXPECT_EQ(t.Connected(kTimeout), 1u);
  // A rank that left is not connected.
  ASSERT_TRUE(t.Leave(2, 1).ok());
  EXPECT_EQ(t.Connected(absl::Hours(1)), 1u);
}

TEST_F(RankTableTest, RanksListsEveryRankInOrder) {
  RankTable t(Options(3));
  ASSERT_TRUE(t.Join(0, 4).ok());
  ASSERT_TRUE(t.Join(2, 9).ok());
  t.NotePushed(2, 17);
  t.NotePushed(5, 1);  // past world_size: ignored
  EXPECT_EQ(t.joined(), 2u);
  EXPECT_EQ(t.Connected(absl::Hours(1)), 2u);
  const std::vector<RankStatus> full = t.Ranks(absl::Hours(1));
  ASSERT_EQ(full.size(), 3u);
  for (uint32_t r = 0; r < 3; ++r) EXPECT_EQ(full[r].rank, r);
  EXPECT_TRUE(full[0].joined);
  EXPECT_TRUE(full[0].connected);
  EXPECT_EQ(full[0].incarnation, 4u);
  EXPECT_GE(full[0].seconds_since_heard, 0.0);
  EXPECT_LT(full[0].seconds_since_heard, 60.0);
  EXPECT_FALSE(full[1].joined);
  EXPECT_FALSE(full[1].connected);
  EXPECT_EQ(full[1].incarnation, 0u);
  EXPECT_EQ(full[1].seconds_since_heard, -1.0) << "never heard from";
  EXPECT_EQ(full[2].incarnation, 9u);
  EXPECT_EQ(full[2].last_step_pushed, 17u);
  EXPECT_EQ(full[0].last_step_pushed, 0u);
}

TEST_F(RankTableTest, HashFollowsIncarnationsAndJoins) {
  RankTable a(Options(2)), b(Options(2));
  EXPECT_EQ(HashOf(a), HashOf(b));
  ASSERT_TRUE(a.Join(0, 1).ok());
  const uint64_t joined = HashOf(a);
  EXPECT_NE(joined, HashOf(b));
  ASSERT_TRUE(b.Join(0, 1).ok());
  EXPECT_EQ(HashOf(a), HashOf(b));
  ASSERT_TRUE(a.Join(0, 2).ok());
  EXPECT_NE(HashOf(a), joined);
  // Refused requests change nothing.
  const uint64_t before = HashOf(a);
  EXPECT_FALSE(a.Join(0, 1).ok());
  EXPECT_FALSE(a.Leave(1, 1).ok());
  EXPECT_EQ(HashOf(a), before);
}

}  // namespace
}  // namespace zeroshard
