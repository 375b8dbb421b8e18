// RankStaging over the inproc transport: what it books, the checks Apply
// makes before it reads a slot, generations applied at most once and never
// after a fence, and a fence that waits for the push reading its slot.

#include "server/job/staging.h"

#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/ledger/memory_ledger.h"
#include "transport/inproc/inproc_transport.h"

namespace zeroshard {
namespace {

absl::Time In(absl::Duration d) { return absl::Now() + d; }


using ::testing::HasSubstr;

constexpr uint32_t kSlots = 3;
constexpr uint64_t kSlotBytes = 64;

uint64_t Buffer(const MemoryLedger& ledger, const std::string& job) {
  return ledger.JobBytes(job)[static_cast<int>(MemoryCategory::kBuffer)];
}

class RankStagingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<transport::Transport>> t =
        transport::inproc::CreateInprocTransport();
    ASSERT_TRUE(t.ok()) << t.status();
    transport_ = *std::move(t);
    absl::StatusOr<std::unique_ptr<RankStaging>> s =
        RankStaging::Create(transport_.get(), &ledger_, "job", kSlots, kSlotBytes);
    ASSERT_TRUE(s.ok()) << s.status();
    staging_ = *std::move(s);
  }

  // What the rank's one-sided Put leaves in slot `slot` (inproc descriptors
  // carry the region's real address).
  void Write(uint32_t slot, const std::string& bytes) {
    ASSERT_LE(bytes.size(), kSlotBytes);
    char* base = reinterpret_cast<char*>(staging_->descriptor().address);
    std::memcpy(base + slot * kSlotBytes, bytes.data(), bytes.size());
  }

  // Apply that records the payload it was given.
  absl::Status Apply(uint32_t slot, uint64_t generation, uint64_t length,
                     std::string* payload = nullptr, absl::Status result = absl::OkStatus()) {
    return staging_->Apply(slot, generation, length, [&](absl::string_view p) {
      ++applies_;
      if (payload != nullptr) *payload = std::string(p);
      return result;
    });
  }

  MemoryLedger ledger_{0};
  std::unique_ptr<transport::Transport> transport_;
  std::unique_ptr<RankStaging> staging_;
  int applies_ = 0;
};

TEST_F(RankStagingTest, BooksItsRegionForItsLifetime) {
  EXPECT_EQ(staging_->slots(), kSlots);
  EXPECT_EQ(staging_->slot_bytes(), kSlotBytes);
  EXPECT_EQ(staging_->descriptor().length, kSlots * kSlotBytes);
  EXPECT_NE(staging_->descriptor().address, 0u);
  EXPECT_EQ(Buffer(ledger_, "job"), kSlots * kSlotBytes);
  EXPECT_EQ(ledger_.total(), kSlots * kSlotBytes);
  staging_.reset();
  EXPECT_EQ(Buffer(ledger_, "job"), 0u);
  EXPECT_EQ(ledger_.total(), 0u);
}

TEST_F(RankStagingTest, ARegionPastTheLimitIsRefusedAndNothingBooked) {
  MemoryLedger small(kSlots * kSlotBytes - 1);
  absl::StatusOr<std::unique_ptr<RankStaging>> s =
      RankStaging::Create(transport_.get(), &small, "job", kSlots, kSlotBytes);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kResourceExhausted) << s.status();
  EXPECT_EQ(small.total(), 0u);
}

TEST_F(RankStagingTest, ApplyReadsTheSlotsFirstBytes) {
  Write(0, "slot zero bytes");
  Write(1, "the second slot");
  std::string payload;
  ASSERT_TRUE(Apply(1, 1, 10, &payload).ok());
  EXPECT_EQ(payload, "the second");
  ASSERT_TRUE(Apply(0, 1, 4, &payload).ok());
  EXPECT_EQ(payload, "slot");
  // A full slot, the last one.
  Write(2, std::string(kSlotBytes, 'z'));
  ASSERT_TRUE(Apply(2, 7, kSlotBytes, &payload).ok());
  EXPECT_EQ(payload, std::string(kSlotBytes, 'z'));
  EXPECT_EQ(applies_, 3);
}

TEST_F(RankStagingTest, BadArgumentsAreRefusedBeforeAnyRead) {
  absl::Status s = Apply(kSlots, 1, 8);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("staging_slot"));
  s = Apply(0, 1, kSlotBytes + 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("do not fit"));
  s = Apply(0, 0, 8);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("staging_generation"));
  EXPECT_EQ(applies_, 0);
  // None of them consumed a generation.
  EXPECT_TRUE(Apply(0, 1, 8).ok());
  EXPECT_EQ(staging_->Fence(kSlots, 1, In(absl::Seconds(10))).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(RankStagingTest, AGenerationIsAppliedAtMostOnce) {
  ASSERT_TRUE(Apply(0, 5, 8).ok());
  for (uint64_t g : {5, 4, 1}) {
    const absl::Status s = Apply(0, g, 8);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << g;
    EXPECT_THAT(s.message(), HasSubstr("already applied")) << g;
  }
  EXPECT_EQ(applies_, 1);
  EXPECT_TRUE(Apply(0, 6, 8).ok());
  // Slots keep their own generations.
  EXPECT_TRUE(Apply(1, 1, 8).ok());
  EXPECT_EQ(applies_, 3);
}

TEST_F(RankStagingTest, AFailedApplyLeavesItsGenerationUnapplied) {
  const absl::Status s = Apply(0, 3, 8, nullptr, absl::DataLossError("bad chunk"));
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << "apply's own error is returned";
  EXPECT_EQ(staging_->Fence(0, 0, In(absl::Seconds(10))).value_or(99), 0u) << "nothing applied";
  EXPECT_TRUE(Apply(0, 3, 8).ok());
  EXPECT_EQ(staging_->Fence(0, 0, In(absl::Seconds(10))).value_or(99), 3u);
}

TEST_F(RankStagingTest, AFenceRefusesEveryGenerationUpToIt) {
  EXPECT_EQ(staging_->Fence(0, 4, In(absl::Seconds(10))).value_or(99), 0u);
  for (uint64_t g : {1, 4}) {
    const absl::Status s = Apply(0, g, 8);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << g;
    EXPECT_THAT(s.message(), HasSubstr("fenced")) << g;
  }
  EXPECT_EQ(applies_, 0);
  ASSERT_TRUE(Apply(0, 5, 8).ok());
  // A fence answers the newest applied generation, and a lower fence does
  // not lower the bar.
  EXPECT_EQ(staging_->Fence(0, 2, In(absl::Seconds(10))).value_or(99), 5u);
  EXPECT_EQ(Apply(0, 5, 8).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Apply(0, 6, 8).ok());
  // Other slots are not fenced.
  EXPECT_TRUE(Apply(1, 1, 8).ok());
}

// The rule the header states: once a fence has answered, nothing reads the
// slot's old bytes. A fence that comes while a push reads the slot waits
// for it (and then reports it applied); a fence of another slot does not.
TEST_F(RankStagingTest, AFenceWaitsForThePushReadingItsSlot) {
  absl::Notification reading, finish;
  std::thread push([&] {
    EXPECT_TRUE(staging_
                    ->Apply(0, 2, 8,
                            [&](absl::string_view) {
                              reading.Notify();
                              finish.WaitForNotification();
                              return absl::OkStatus();
                            })
                    .ok());
  });
  reading.WaitForNotification();
  std::atomic<bool> fenced{false};
  uint64_t applied = 99;
  std::thread fence([&] {
    applied = staging_->Fence(0, 2, In(absl::Seconds(10))).value_or(99);
    fenced = true;
  });
  // Another slot is fenced at once.
  EXPECT_EQ(staging_->Fence(1, 1, In(absl::Seconds(10))).value_or(99), 0u);
  // A fence whose deadline passes while the push reads fences nothing.
  EXPECT_EQ(staging_->Fence(0, 2, In(absl::Milliseconds(50))).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_FALSE(fenced.load()) << "the fence answered while the push was reading the slot";
  finish.Notify();
  push.join();
  fence.join();
  EXPECT_TRUE(fenced.load());
  EXPECT_EQ(applied, 2u);
  EXPECT_EQ(Apply(0, 2, 8).code(), absl::StatusCode::kFailedPrecondition);
}

// Push memory: the same name maps once; what a rank process may map is
// bounded; a pulled push reads the whole memory, never once its deadline has
// passed, and only under its slot's generation rules.
TEST_F(RankStagingTest, PushMemoriesAreBoundedAndReadOnlyInTime) {
  absl::StatusOr<std::unique_ptr<transport::PushMemory>> m = transport::PushMemory::Create(4096);
  ASSERT_TRUE(m.ok());
  std::memcpy((*m)->data(), "pulled", 6);
  const uint64_t max = uint64_t{1} << 20;
  absl::StatusOr<uint32_t> id = staging_->MapPushMemory((*m)->pid(), (*m)->fd(), (*m)->name(),
                                                        (*m)->size(), max);
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_NE(*id, 0u);
  EXPECT_EQ(*staging_->MapPushMemory((*m)->pid(), (*m)->fd(), (*m)->name(), (*m)->size(), max),
            *id);
  EXPECT_EQ(staging_->push_memories(), 1u);
  // Past the bytes a rank process may map: refused before anything is opened.
  absl::StatusOr<std::unique_ptr<transport::PushMemory>> big =
      transport::PushMemory::Create(max);
  ASSERT_TRUE(big.ok());
  EXPECT_THAT(staging_->MapPushMemory((*big)->pid(), (*big)->fd(), (*big)->name(),
                                      (*big)->size(), max).status().message(),
              HasSubstr("at most 1048576 bytes of push memory"));
  // A pulled push gets the memory, not the slot, and is applied once.
  std::string payload;
  auto pull = [&](uint64_t generation, absl::Time deadline) {
    return staging_->Apply(
        0, generation, 6,
        [&](absl::string_view p) {
          ++applies_;
          payload = std::string(p.substr(0, 6));
          return absl::OkStatus();
        },
        *id, deadline);
  };
  EXPECT_EQ(pull(1, absl::InfinitePast()).code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(applies_, 0);
  ASSERT_TRUE(pull(1, absl::InfiniteFuture()).ok());
  EXPECT_EQ(payload, "pulled");
  EXPECT_EQ(staging_->pulled_bytes(), 6u);
  EXPECT_THAT(pull(1, absl::InfiniteFuture()).message(), HasSubstr("already applied"));
  EXPECT_EQ(staging_->Apply(0, 2, 6, [](absl::string_view) { return absl::OkStatus(); }, *id + 1)
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(applies_, 1);
  // Calls that try to open a memory are counted, mapped or refused; the
  // same name again is not.
  for (uint32_t i = 1; i < RankStaging::kMaxPushMemoryCalls; ++i) {
    staging_->MapPushMemory(1 << 30, 0, (*m)->name() + "x", 4096, max).IgnoreError();
  }
  EXPECT_EQ(*staging_->MapPushMemory((*m)->pid(), (*m)->fd(), (*m)->name(), (*m)->size(), max),
            *id);
  EXPECT_THAT(staging_->MapPushMemory((*big)->pid(), (*big)->fd(), (*big)->name(), 4096, max)
                  .status()
                  .message(),
              HasSubstr("map a push memory 64 times"));
}

}  // namespace
}  // namespace zeroshard
