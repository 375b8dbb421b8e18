#include "server/ledger/memory_ledger.h"

#include <string>
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

TEST(MemoryLedger, OneOwnersJobsShareTheOwnerLimit) {
  MemoryLedger ledger(10000, 1000);
  ledger.SetOwner("a1", "cert:CN=alice");
  ledger.SetOwner("a2", "cert:CN=alice");
  ledger.SetOwner("b1", "cert:CN=bob");
  ASSERT_TRUE(ledger.Reserve("a1", MemoryCategory::kParamMaster, 700).ok());
  // Alice's second job does not fit beside her first; nothing is booked.
  absl::Status s = ledger.ReserveAll("a2", CategoryBytes{400});
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("--max_memory_per_identity"), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("cert:CN=alice"), absl::string_view::npos) << s;
  EXPECT_EQ(ledger.Reserve("a2", MemoryCategory::kGrad, 301).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(ledger.CheckFits("a1", 301).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(ledger.total(), 700u);
  EXPECT_EQ(ledger.OwnerBytes("cert:CN=alice"), 700u);
  ASSERT_TRUE(ledger.Reserve("a2", MemoryCategory::kGrad, 300).ok());
  // Bob's and ownerless jobs are not held back by Alice's.
  ASSERT_TRUE(ledger.Reserve("b1", MemoryCategory::kGrad, 1000).ok());
  ASSERT_TRUE(ledger.Reserve("x", MemoryCategory::kGrad, 5000).ok());
  // Bytes moved between an owned and an ownerless entry follow the owner.
  ledger.Move("x", MemoryCategory::kGrad, "b1", MemoryCategory::kActivation, 10);
  EXPECT_EQ(ledger.OwnerBytes("cert:CN=bob"), 1010u);
  ledger.Move("b1", MemoryCategory::kActivation, "x", MemoryCategory::kGrad, 10);
  // Released bytes leave the owner's total; a dropped entry its binding.
  ledger.Release("a1", MemoryCategory::kParamMaster, 700);
  EXPECT_EQ(ledger.OwnerBytes("cert:CN=alice"), 300u);
  EXPECT_TRUE(ledger.RemoveJobIfEmpty("a1"));
  ASSERT_TRUE(ledger.Reserve("a1", MemoryCategory::kGrad, 900).ok());  // no owner now
  EXPECT_EQ(ledger.OwnerBytes("cert:CN=alice"), 300u);
  // Binding an entry that holds bytes brings them along.
  ledger.SetOwner("a1", "cert:CN=bob");
  EXPECT_EQ(ledger.OwnerBytes("cert:CN=bob"), 1900u);
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

CategoryBytes Bytes(std::initializer_list<std::pair<MemoryCategory, uint64_t>> parts) {
  CategoryBytes b{};
  for (const auto& [c, n] : parts) b[static_cast<int>(c)] = n;
  return b;
}

TEST(MemoryLedger, ReserveAllBooksEveryCategoryOrNothing) {
  MemoryLedger ledger(1000);
  ASSERT_TRUE(ledger.Reserve("other", MemoryCategory::kBuffer, 100).ok());
  absl::Status s = ledger.ReserveAll(
      "a", Bytes({{MemoryCategory::kParamMaster, 400}, {MemoryCategory::kOptimM, 501}}));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("param_master"), absl::string_view::npos) << s.message();
  EXPECT_NE(s.message().find("--memory_limit"), absl::string_view::npos) << s.message();
  EXPECT_EQ(ledger.total(), 100u);
  EXPECT_EQ(ledger.Snapshot().count("a"), 0u);
  ASSERT_TRUE(ledger
                  .ReserveAll("a", Bytes({{MemoryCategory::kParamMaster, 400},
                                          {MemoryCategory::kOptimM, 500}}))
                  .ok());
  EXPECT_EQ(ledger.total(), 1000u);
  EXPECT_EQ(ledger.JobBytes("a")[static_cast<int>(MemoryCategory::kOptimM)], 500u);
  // Sums past 2^64 are refused, not wrapped.
  MemoryLedger unlimited(0);
  EXPECT_EQ(unlimited
                .ReserveAll("a", Bytes({{MemoryCategory::kParamMaster, ~uint64_t{0}},
                                        {MemoryCategory::kOptimM, 2}}))
                .code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(unlimited.total(), 0u);
}

// Eight requests of 40% of the limit each, booked whole and at once: exactly
// two fit, whatever the interleaving.
TEST(MemoryLedger, ConcurrentReservationsCannotPassTheLimitTogether) {
  for (int round = 0; round < 50; ++round) {
    MemoryLedger ledger(1000);
    std::vector<absl::StatusOr<LedgerReservation>> results(8);
    std::vector<std::thread> threads;
    for (int t = 0; t < 8; ++t) {
      threads.emplace_back([&, t] {
        results[t] = LedgerReservation::Create(&ledger, "j" + std::to_string(t),
                                               Bytes({{MemoryCategory::kParamMaster, 100},
                                                      {MemoryCategory::kOptimM, 100},
                                                      {MemoryCategory::kOptimV, 100},
                                                      {MemoryCategory::kGrad, 100}}));
      });
    }
    for (auto& t : threads) t.join();
    int granted = 0;
    for (auto& r : results) {
      if (!r.ok()) {
        EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
        continue;
      }
      ++granted;
      r->Take(MemoryCategory::kParamMaster, 100);  // stays booked past the reservation
    }
    EXPECT_EQ(granted, 2);
    EXPECT_EQ(ledger.total(), 800u);
    EXPECT_EQ(ledger.Snapshot().size(), 2u);
    // What the winners did not take goes back with their reservations.
    results.clear();
    EXPECT_EQ(ledger.total(), 200u);
  }
}

TEST(MemoryLedger, ArraysTakeTheirBytesFromAReservation) {
  MemoryLedger ledger(1 << 20);
  LedgerArray<float> kept;
  {
    absl::StatusOr<LedgerReservation> r = LedgerReservation::Create(
        &ledger, "j", Bytes({{MemoryCategory::kParamMaster, 4000}, {MemoryCategory::kGrad, 400}}));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(ledger.total(), 4400u);
    // More than the reservation holds under the category: nothing allocated.
    EXPECT_EQ(LedgerArray<float>::Create(&*r, MemoryCategory::kGrad, 101).status().code(),
              absl::StatusCode::kInternal);
    EXPECT_EQ(LedgerArray<float>::Create(&*r, MemoryCategory::kOptimV, 1).status().code(),
              absl::StatusCode::kInternal);
    absl::StatusOr<LedgerArray<float>> a =
        LedgerArray<float>::Create(&*r, MemoryCategory::kParamMaster, 1000);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a->data()) % 64, 0u);
    EXPECT_EQ(r->held(MemoryCategory::kParamMaster), 0u);
    alignas(64) static float outside[100];
    absl::StatusOr<LedgerArray<float>> in =
        LedgerArray<float>::Create(&*r, MemoryCategory::kGrad, 50, outside);
    ASSERT_TRUE(in.ok());
    EXPECT_EQ(in->data(), outside);
    EXPECT_EQ(ledger.total(), 4400u);
    kept = *std::move(a);
  }
  // The reservation's rest (200 B of grad) and the array in `outside` are gone.
  EXPECT_EQ(ledger.total(), 4000u);
  EXPECT_EQ(ledger.JobBytes("j")[static_cast<int>(MemoryCategory::kGrad)], 0u);
  kept = LedgerArray<float>();
  EXPECT_EQ(ledger.total(), 0u);
}

}  // namespace
}  // namespace zeroshard
