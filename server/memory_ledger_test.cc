#include "server/memory_ledger.h"

#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

TEST(MemoryLedger, BooksByJobAndCategory) {
  MemoryLedger ledger(0);
  std::vector<std::tuple<std::string, MemoryCategory, uint64_t>> seen;
  ledger.SetListener([&](const std::string& j, MemoryCategory c, uint64_t b) {
    seen.emplace_back(j, c, b);
  });
  ASSERT_TRUE(ledger.Reserve("a", MemoryCategory::kOptimM, 100).ok());
  ASSERT_TRUE(ledger.Reserve("b", MemoryCategory::kGrad, 50).ok());
  ASSERT_TRUE(ledger.Reserve("a", MemoryCategory::kOptimM, 20).ok());
  EXPECT_EQ(ledger.total(), 170u);
  EXPECT_EQ(ledger.JobBytes("a")[static_cast<int>(MemoryCategory::kOptimM)], 120u);
  ledger.Release("a", MemoryCategory::kOptimM, 120);
  EXPECT_EQ(ledger.total(), 50u);
  EXPECT_EQ(std::get<2>(seen.back()), 0u);
  EXPECT_TRUE(ledger.RemoveJobIfEmpty("a"));
  EXPECT_FALSE(ledger.RemoveJobIfEmpty("b"));
  EXPECT_EQ(ledger.Snapshot().size(), 1u);
  // Releasing for a removed job is ignored.
  ledger.Release("a", MemoryCategory::kOptimM, 5);
  EXPECT_EQ(ledger.total(), 50u);
  EXPECT_STREQ(MemoryCategoryName(MemoryCategory::kFragmentation), "fragmentation");
}

TEST(MemoryLedger, LimitIsCheckedBeforeBooking) {
  MemoryLedger ledger(1000);
  ASSERT_TRUE(ledger.Reserve("a", MemoryCategory::kParamMaster, 900).ok());
  absl::Status s = ledger.Reserve("a", MemoryCategory::kOptimV, 200);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("--memory_limit"), absl::string_view::npos);
  EXPECT_EQ(ledger.total(), 900u);
  EXPECT_EQ(ledger.CheckFits("a", 101).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(ledger.CheckFits("a", 100).ok());
  EXPECT_EQ(ledger.Reserve("a", MemoryCategory::kOptimV, ~uint64_t{0}).code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(MemoryLedger, MoveRebooksWithoutTouchingTheTotal) {
  MemoryLedger ledger(1000);
  std::vector<std::tuple<std::string, MemoryCategory, uint64_t>> seen;
  ledger.SetListener([&](const std::string& j, MemoryCategory c, uint64_t b) {
    seen.emplace_back(j, c, b);
  });
  ASSERT_TRUE(ledger.Reserve(kDaemonLedgerEntry, MemoryCategory::kActivation, 1000).ok());
  // At the limit, moving into a job's entry still works: nothing new is held.
  ledger.Move(kDaemonLedgerEntry, MemoryCategory::kActivation, "a", MemoryCategory::kActivation,
              300);
  ledger.Move(kDaemonLedgerEntry, MemoryCategory::kActivation, kDaemonLedgerEntry,
              MemoryCategory::kFragmentation, 100);
  EXPECT_EQ(ledger.total(), 1000u);
  EXPECT_EQ(ledger.JobBytes("a")[static_cast<int>(MemoryCategory::kActivation)], 300u);
  const CategoryBytes daemon = ledger.JobBytes(kDaemonLedgerEntry);
  EXPECT_EQ(daemon[static_cast<int>(MemoryCategory::kActivation)], 600u);
  EXPECT_EQ(daemon[static_cast<int>(MemoryCategory::kFragmentation)], 100u);
  EXPECT_EQ(seen.back(), std::make_tuple(std::string(kDaemonLedgerEntry),
                                         MemoryCategory::kFragmentation, uint64_t{100}));
  // At most what the source holds moves.
  ledger.Move("a", MemoryCategory::kActivation, kDaemonLedgerEntry, MemoryCategory::kActivation,
              5000);
  EXPECT_EQ(ledger.JobBytes("a")[static_cast<int>(MemoryCategory::kActivation)], 0u);
  EXPECT_EQ(ledger.total(), 1000u);
  EXPECT_TRUE(ledger.RemoveJobIfEmpty("a"));
  EXPECT_EQ(ledger.Reserve("b", MemoryCategory::kGrad, 1).code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(MemoryLedger, ArrayIsBookedForItsLifetime) {
  MemoryLedger ledger(1 << 20);
  {
    auto a = LedgerArray<float>::Create(&ledger, "j", MemoryCategory::kParamMaster, 1000);
    ASSERT_TRUE(a.ok());
    EXPECT_EQ(ledger.total(), 4000u);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a->data()) % 64, 0u);
    EXPECT_EQ((*a)[999], 0.0f);
    LedgerArray<float> moved = *std::move(a);
    EXPECT_EQ(ledger.total(), 4000u);
  }
  EXPECT_EQ(ledger.total(), 0u);
  EXPECT_FALSE(LedgerArray<float>::Create(&ledger, "j", MemoryCategory::kGrad, 1 << 20).ok());
  EXPECT_EQ(ledger.total(), 0u);
}

TEST(MemoryLedger, ConcurrentBookingIsExact) {
  MemoryLedger ledger(0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 10000; ++i) {
        ASSERT_TRUE(ledger.Reserve("j", MemoryCategory::kBuffer, 3).ok());
        ledger.Release("j", MemoryCategory::kBuffer, 1);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ledger.total(), 4u * 10000 * 2);
}

}  // namespace
}  // namespace zeroshard
