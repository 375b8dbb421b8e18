#include "server/cache/param_cache.h"

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace zeroshard {
namespace {

constexpr char kJob[] = "job";

// Element e of step s holds s * 1000 + e (fp32), as its owner serves it.
float ValueAt(uint64_t step, uint64_t e) { return static_cast<float>(step * 1000 + e); }

class FakeOwners : public ParamFetcher {
 public:
  absl::StatusOr<uint64_t> Fetch(uint32_t owner, const FlatRange& range, DType dtype,
                                 uint64_t after_step, absl::Time deadline, void* dst) override {
    ++calls;
    if (gate != nullptr) gate->WaitForNotificationWithDeadline(deadline);
    if (owner == fail_owner) return absl::UnavailableError("owner down");
    EXPECT_EQ(dtype, DType::kFp32);
    const uint64_t step = answer_step != 0 ? answer_step : after_step;
    auto* out = static_cast<float*>(dst);
    for (uint64_t e = range.begin; e < range.end; ++e) out[e - range.begin] = ValueAt(step, e);
    absl::MutexLock lock(&mu);
    fetched.push_back({owner, range});
    return step;
  }
  std::atomic<int> calls{0};
  absl::Notification* gate = nullptr;
  uint32_t fail_owner = ~0u;
  uint64_t answer_step = 0;  // 0: the step asked for
  absl::Mutex mu;
  std::vector<std::pair<uint32_t, FlatRange>> fetched ABSL_GUARDED_BY(mu);
};

// Daemon 1 of three owns [10, 20); daemons 0 and 2 own [0, 10) and [20, 25).
ParamCacheOptions Options(MemoryLedger* ledger) {
  ParamCacheOptions o;
  o.job_id = kJob;
  o.dtype = DType::kFp32;
  o.total_elements = 25;
  o.owned = {10, 20};
  o.owners = {{0, {0, 10}}, {2, {20, 25}}};
  o.ledger = ledger;
  return o;
}

uint64_t Booked(const MemoryLedger& ledger) {
  return ledger.JobBytes(kJob)[static_cast<int>(MemoryCategory::kParamCache)];
}

absl::Time Soon() { return absl::Now() + absl::Seconds(10); }

TEST(ParamCacheTest, HoldsExactlyWhatTheOwnersServeAndBooksIt) {
  MemoryLedger ledger(0);
  ParamCache cache(Options(&ledger));
  EXPECT_EQ(cache.copy_bytes(), 15 * sizeof(float));
  FakeOwners owners;
  absl::StatusOr<std::shared_ptr<const ParamCache::Copy>> copy = cache.Get(3, owners, Soon());
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_EQ((*copy)->step(), 3u);
  EXPECT_EQ(Booked(ledger), 15 * sizeof(float));
  for (FlatRange r : {FlatRange{0, 10}, FlatRange{20, 25}, FlatRange{4, 7}, FlatRange{22, 25}}) {
    ASSERT_TRUE((*copy)->Contains(r));
    const float* got = reinterpret_cast<const float*>((*copy)->At(r));
    for (uint64_t e = r.begin; e < r.end; ++e) EXPECT_EQ(got[e - r.begin], ValueAt(3, e)) << e;
  }
  EXPECT_FALSE((*copy)->Contains({5, 11}));   // crosses the owned range
  EXPECT_FALSE((*copy)->Contains({24, 26}));  // past the parameters
  // The same step again: no fetch.
  ASSERT_TRUE(cache.Get(3, owners, Soon()).ok());
  EXPECT_EQ(owners.calls.load(), 2);  // one per owner, once
  EXPECT_EQ(cache.counts().fetches, 1u);
  EXPECT_EQ(cache.counts().hits, 1u);
}

TEST(ParamCacheTest, OneFetchPerStepWhateverTheCallers) {
  MemoryLedger ledger(0);
  ParamCache cache(Options(&ledger));
  FakeOwners owners;
  absl::Notification gate;
  owners.gate = &gate;
  constexpr int kCallers = 6;
  std::vector<std::thread> callers;
  std::atomic<int> ok{0};
  for (int i = 0; i < kCallers; ++i) {
    callers.emplace_back([&] {
      absl::StatusOr<std::shared_ptr<const ParamCache::Copy>> c = cache.Get(1, owners, Soon());
      if (c.ok() && (*c)->step() == 1 &&
          reinterpret_cast<const float*>((*c)->At({20, 25}))[4] == ValueAt(1, 24)) {
        ++ok;
      }
    });
  }
  absl::SleepFor(absl::Milliseconds(100));  // every caller is in Get
  gate.Notify();
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(ok.load(), kCallers);
  EXPECT_EQ(owners.calls.load(), 2);
  EXPECT_EQ(cache.counts().fetches, 1u);
}

TEST(ParamCacheTest, AWaiterGivesUpAtItsDeadlineAndTheFetchGoesOn) {
  MemoryLedger ledger(0);
  ParamCache cache(Options(&ledger));
  FakeOwners owners;
  absl::Notification gate;
  owners.gate = &gate;
  std::thread first([&] { EXPECT_TRUE(cache.Get(1, owners, Soon()).ok()); });
  while (owners.calls.load() == 0) absl::SleepFor(absl::Milliseconds(1));
  const absl::Time start = absl::Now();
  absl::StatusOr<std::shared_ptr<const ParamCache::Copy>> waiter =
      cache.Get(1, owners, absl::Now() + absl::Milliseconds(50));
  EXPECT_EQ(waiter.status().code(), absl::StatusCode::kDeadlineExceeded) << waiter.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  gate.Notify();
  first.join();
  EXPECT_TRUE(cache.Get(1, owners, Soon()).ok());
}

// The cache's lock is not held across a fetch: while an owner stalls one,
// everything that does not need its bytes answers at once.
TEST(ParamCacheTest, AStalledFetchStallsNothingElse) {
  MemoryLedger ledger(0);
  ParamCache cache(Options(&ledger));
  FakeOwners owners;
  ASSERT_TRUE(cache.Get(1, owners, Soon()).ok());
  absl::Notification gate;
  owners.gate = &gate;
  std::thread stalled([&] { EXPECT_TRUE(cache.Get(2, owners, Soon()).ok()); });
  while (owners.calls.load() < 3) absl::SleepFor(absl::Milliseconds(1));
  const absl::Time start = absl::Now();
  EXPECT_EQ(cache.Get(1, owners, Soon()).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(cache.counts().fetches, 1u);
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  gate.Notify();
  stalled.join();
}

TEST(ParamCacheTest, ANewStepReplacesTheCopyAndOlderStepsPassThrough) {
  MemoryLedger ledger(0);
  ParamCache cache(Options(&ledger));
  FakeOwners owners;
  ASSERT_TRUE(cache.Get(1, owners, Soon()).ok());
  absl::StatusOr<std::shared_ptr<const ParamCache::Copy>> two = cache.Get(2, owners, Soon());
  ASSERT_TRUE(two.ok());
  EXPECT_EQ(reinterpret_cast<const float*>((*two)->At({0, 1}))[0], ValueAt(2, 0));
  // One copy booked (the first was reused: nobody held it).
  EXPECT_EQ(Booked(ledger), cache.copy_bytes());
  EXPECT_EQ(cache.Get(1, owners, Soon()).status().code(), absl::StatusCode::kFailedPrecondition);
  // A reader of step 2 holds its copy while step 3 is published: both are
  // booked until the reader lets go.
  ASSERT_TRUE(cache.Get(3, owners, Soon()).ok());
  EXPECT_EQ(Booked(ledger), 2 * cache.copy_bytes());
  EXPECT_EQ((*two)->step(), 2u);
  EXPECT_EQ(reinterpret_cast<const float*>((*two)->At({0, 1}))[0], ValueAt(2, 0));
  two = absl::UnknownError("let go");
  EXPECT_EQ(Booked(ledger), cache.copy_bytes());
}

TEST(ParamCacheTest, ADropForgetsTheCopyAndAFetchInFlight) {
  MemoryLedger ledger(0);
  ParamCache cache(Options(&ledger));
  FakeOwners owners;
  ASSERT_TRUE(cache.Get(1, owners, Soon()).ok());
  cache.Drop();
  EXPECT_EQ(Booked(ledger), 0u);
  absl::Notification gate;
  owners.gate = &gate;
  std::thread fetch([&] {
    EXPECT_EQ(cache.Get(1, owners, Soon()).status().code(), absl::StatusCode::kAborted);
  });
  while (owners.calls.load() < 3) absl::SleepFor(absl::Milliseconds(1));
  cache.Drop();
  gate.Notify();
  fetch.join();
  EXPECT_EQ(Booked(ledger), 0u);
  owners.gate = nullptr;
  EXPECT_TRUE(cache.Get(1, owners, Soon()).ok());
  EXPECT_EQ(cache.counts().fetches, 2u);
}

TEST(ParamCacheTest, FreedWithTheCache) {
  MemoryLedger ledger(0);
  {
    ParamCache cache(Options(&ledger));
    FakeOwners owners;
    ASSERT_TRUE(cache.Get(1, owners, Soon()).ok());
    EXPECT_EQ(Booked(ledger), cache.copy_bytes());
  }
  EXPECT_EQ(Booked(ledger), 0u);
}

TEST(ParamCacheTest, RefusedByTheLedgerBooksNothing) {
  MemoryLedger ledger(15 * sizeof(float) - 1);
  ParamCache cache(Options(&ledger));
  FakeOwners owners;
  EXPECT_EQ(cache.Get(1, owners, Soon()).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(owners.calls.load(), 0);
  EXPECT_EQ(Booked(ledger), 0u);
}

TEST(ParamCacheTest, AFailedFetchIsEveryWaitersErrorAndLeavesNothing) {
  MemoryLedger ledger(0);
  ParamCache cache(Options(&ledger));
  FakeOwners owners;
  owners.fail_owner = 2;
  absl::Notification gate;
  owners.gate = &gate;
  std::thread first([&] {
    EXPECT_EQ(cache.Get(1, owners, Soon()).status().code(), absl::StatusCode::kUnavailable);
  });
  while (owners.calls.load() == 0) absl::SleepFor(absl::Milliseconds(1));
  std::thread waiter([&] {
    EXPECT_EQ(cache.Get(1, owners, Soon()).status().code(), absl::StatusCode::kUnavailable);
  });
  absl::SleepFor(absl::Milliseconds(50));
  gate.Notify();
  first.join();
  waiter.join();
  EXPECT_EQ(Booked(ledger), 0u);
  EXPECT_EQ(cache.counts().fetches, 0u);
  // The owner is back: the next caller fetches again.
  owners.fail_owner = ~0u;
  EXPECT_TRUE(cache.Get(1, owners, Soon()).ok());
}

TEST(ParamCacheTest, AnOwnerAtALaterStepAbortsAndPublishesNothing) {
  MemoryLedger ledger(0);
  ParamCache cache(Options(&ledger));
  FakeOwners owners;
  owners.answer_step = 5;
  EXPECT_EQ(cache.Get(4, owners, Soon()).status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(Booked(ledger), 0u);
  owners.answer_step = 0;
  absl::StatusOr<std::shared_ptr<const ParamCache::Copy>> c = cache.Get(5, owners, Soon());
  ASSERT_TRUE(c.ok());
  EXPECT_EQ((*c)->step(), 5u);
}

// Owners whose Fetch returns only once every owner's Fetch has started (or
// at the caller's deadline, DeadlineExceeded): a cache that fetched them one
// after another fails with it instead of hanging.
class BarrierOwners : public ParamFetcher {
 public:
  explicit BarrierOwners(int owners) : owners_(owners) {}
  absl::StatusOr<uint64_t> Fetch(uint32_t owner, const FlatRange& range, DType,
                                 uint64_t after_step, absl::Time deadline, void* dst) override {
    {
      absl::MutexLock lock(&mu_);
      ++started_;
      auto all = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return started_ >= owners_; };
      if (!mu_.AwaitWithDeadline(absl::Condition(&all), deadline)) {
        return absl::DeadlineExceededError("not every owner's fetch started");
      }
    }
    if (owner == fail_owner) return absl::UnavailableError("owner down");
    auto* out = static_cast<float*>(dst);
    for (uint64_t e = range.begin; e < range.end; ++e) {
      out[e - range.begin] = ValueAt(after_step, e);
    }
    return after_step;
  }
  uint32_t fail_owner = ~0u;

 private:
  const int owners_;
  absl::Mutex mu_;
  int started_ ABSL_GUARDED_BY(mu_) = 0;
};

// Daemon 2 of five owns [20, 30); the others own 10 elements each, the last
// 5 ([40, 45)).
ParamCacheOptions FiveDaemons(MemoryLedger* ledger) {
  ParamCacheOptions o = Options(ledger);
  o.total_elements = 45;
  o.owned = {20, 30};
  o.owners = {{0, {0, 10}}, {1, {10, 20}}, {3, {30, 40}}, {4, {40, 45}}};
  return o;
}

TEST(ParamCacheTest, FetchesEveryOwnerAtOnce) {
  MemoryLedger ledger(0);
  ParamCache cache(FiveDaemons(&ledger));
  BarrierOwners owners(4);
  ParamCache::Counts served;
  absl::StatusOr<std::shared_ptr<const ParamCache::Copy>> copy =
      cache.Get(7, owners, Soon(), &served);
  ASSERT_TRUE(copy.ok()) << copy.status();
  for (FlatRange r : {FlatRange{0, 20}, FlatRange{30, 45}}) {
    const float* got = reinterpret_cast<const float*>((*copy)->At(r));
    for (uint64_t e = r.begin; e < r.end; ++e) EXPECT_EQ(got[e - r.begin], ValueAt(7, e)) << e;
  }
  EXPECT_EQ(served.fetches, 1u);
  EXPECT_EQ(served.hits, 0u);
  EXPECT_EQ(served.bytes_fetched, 35 * sizeof(float));
  ParamCache::Counts again;
  ASSERT_TRUE(cache.Get(7, owners, Soon(), &again).ok());
  EXPECT_EQ(again.fetches, 0u);
  EXPECT_EQ(again.hits, 1u);
  EXPECT_EQ(again.bytes_fetched, 0u);
  EXPECT_EQ(cache.counts().fetches, 1u);
  EXPECT_EQ(cache.counts().hits, 1u);
  EXPECT_EQ(cache.counts().bytes_fetched, 35 * sizeof(float));
}

TEST(ParamCacheTest, OneOwnerFailingAmongConcurrentFetchesFailsTheCopy) {
  MemoryLedger ledger(0);
  ParamCache cache(FiveDaemons(&ledger));
  BarrierOwners owners(4);
  owners.fail_owner = 3;  // while 0, 1 and 4 answer
  ParamCache::Counts served;
  absl::StatusOr<std::shared_ptr<const ParamCache::Copy>> copy =
      cache.Get(7, owners, Soon(), &served);
  EXPECT_EQ(copy.status().code(), absl::StatusCode::kUnavailable) << copy.status();
  EXPECT_EQ(Booked(ledger), 0u);
  EXPECT_EQ(served.fetches, 0u);
  EXPECT_EQ(served.bytes_fetched, 25 * sizeof(float));  // what 0, 1 and 4 sent
  EXPECT_EQ(cache.counts().fetches, 0u);
  // Nothing was published: the next caller fetches again (and the barrier,
  // passed once, no longer holds anyone).
  owners.fail_owner = ~0u;
  ParamCache::Counts next;
  ASSERT_TRUE(cache.Get(7, owners, Soon(), &next).ok());
  EXPECT_EQ(next.fetches, 1u);
  EXPECT_EQ(next.hits, 0u);
}

}  // namespace
}  // namespace zeroshard
