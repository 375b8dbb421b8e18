#include "client/staging_slots.h"

#include <atomic>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace zeroshard {
namespace {

using Key = StagingSlots::PushKey;

absl::Time Soon() { return absl::Now() + absl::Seconds(5); }

Key K(uint64_t begin) { return Key{1, 0, {begin, begin + 10}}; }

TEST(StagingSlotsTest, GenerationsIncreasePerSlotFromOne) {
  StagingSlots slots("d:1");
  slots.SetCount(2);
  auto never = [](uint32_t, uint64_t) -> absl::StatusOr<uint64_t> {
    ADD_FAILURE() << "no fence expected";
    return 0;
  };
  absl::StatusOr<StagingSlots::Acquired> a = slots.Acquire(K(0), Soon(), never);
  absl::StatusOr<StagingSlots::Acquired> b = slots.Acquire(K(10), Soon(), never);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->lease.slot, 0u);
  EXPECT_EQ(b->lease.slot, 1u);
  EXPECT_EQ(a->lease.generation, 1u);
  EXPECT_EQ(b->lease.generation, 1u);
  slots.Release(a->lease);
  absl::StatusOr<StagingSlots::Acquired> c = slots.Acquire(K(20), Soon(), never);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->lease.slot, 0u);
  EXPECT_EQ(c->lease.generation, 2u);
  // Every slot busy: waits, then DeadlineExceeded naming the daemon.
  const absl::Status s =
      slots.Acquire(K(30), absl::Now() + absl::Milliseconds(20), never).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "d:1")) << s;
}

TEST(StagingSlotsTest, ResolveReportsWhetherTheGenerationWasApplied) {
  StagingSlots slots("d:1");
  slots.SetCount(1);
  auto unused = [](uint32_t, uint64_t) -> absl::StatusOr<uint64_t> { return 0; };
  StagingSlots::Lease lease = slots.Acquire(K(0), Soon(), unused)->lease;
  std::vector<std::pair<uint32_t, uint64_t>> fenced;
  auto applied = [&](uint32_t s, uint64_t g) -> absl::StatusOr<uint64_t> {
    fenced.push_back({s, g});
    return g;
  };
  EXPECT_EQ(slots.Resolve(lease, K(0), applied), absl::StatusOr<bool>(true));
  lease = slots.Acquire(K(0), Soon(), unused)->lease;
  EXPECT_EQ(lease.generation, 2u);
  auto not_applied = [&](uint32_t s, uint64_t g) -> absl::StatusOr<uint64_t> {
    fenced.push_back({s, g});
    return g - 1;
  };
  EXPECT_EQ(slots.Resolve(lease, K(0), not_applied), absl::StatusOr<bool>(false));
  EXPECT_EQ(fenced, (std::vector<std::pair<uint32_t, uint64_t>>{{0, 1}, {0, 2}}));
  EXPECT_EQ(slots.quarantined(), 0);
}

TEST(StagingSlotsTest, AQuarantinedSlotIsFencedBeforeReuse) {
  StagingSlots slots("d:1");
  slots.SetCount(1);
  auto unused = [](uint32_t, uint64_t) -> absl::StatusOr<uint64_t> { return 0; };
  auto down = [](uint32_t, uint64_t) -> absl::StatusOr<uint64_t> {
    return absl::UnavailableError("down");
  };
  const StagingSlots::Lease lease = slots.Acquire(K(0), Soon(), unused)->lease;
  EXPECT_EQ(slots.Resolve(lease, K(0), down).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(slots.quarantined(), 1);
  // No usable slot, and its fence fails again: Unavailable naming the daemon.
  const absl::Status s = slots.Acquire(K(10), Soon(), down).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "d:1")) << s;
  // A fence that answers frees it; the next write gets a newer generation.
  std::vector<uint64_t> fenced;
  auto answers = [&](uint32_t, uint64_t g) -> absl::StatusOr<uint64_t> {
    fenced.push_back(g);
    return 0;
  };
  absl::StatusOr<StagingSlots::Acquired> a = slots.Acquire(K(10), Soon(), answers);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_FALSE(a->delivered);
  EXPECT_EQ(a->lease.generation, 2u);
  EXPECT_EQ(fenced, std::vector<uint64_t>{1});
}

TEST(StagingSlotsTest, TheSamePushLearnsItsQuarantinedAttemptWasApplied) {
  StagingSlots slots("d:1");
  slots.SetCount(2);
  auto unused = [](uint32_t, uint64_t) -> absl::StatusOr<uint64_t> { return 0; };
  auto down = [](uint32_t, uint64_t) -> absl::StatusOr<uint64_t> {
    return absl::UnavailableError("down");
  };
  auto applied = [](uint32_t, uint64_t g) -> absl::StatusOr<uint64_t> { return g; };
  const StagingSlots::Lease lease = slots.Acquire(K(0), Soon(), unused)->lease;
  ASSERT_FALSE(slots.Resolve(lease, K(0), down).ok());
  absl::StatusOr<StagingSlots::Acquired> again = slots.Acquire(K(0), Soon(), applied);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->delivered);
  EXPECT_EQ(slots.quarantined(), 0);
  // Learned while fencing for another push: remembered for the same one.
  const StagingSlots::Lease l2 = slots.Acquire(K(20), Soon(), unused)->lease;
  const StagingSlots::Lease l3 = slots.Acquire(K(30), Soon(), unused)->lease;
  ASSERT_FALSE(slots.Resolve(l2, K(20), down).ok());
  slots.Release(l3);
  const StagingSlots::Lease l4 = slots.Acquire(K(40), Soon(), unused)->lease;  // slot of l3
  absl::StatusOr<StagingSlots::Acquired> other = slots.Acquire(K(50), Soon(), applied);
  ASSERT_TRUE(other.ok());
  EXPECT_FALSE(other->delivered);
  EXPECT_EQ(other->lease.slot, l2.slot);
  slots.Release(l4);
  slots.Release(other->lease);
  absl::StatusOr<StagingSlots::Acquired> retry = slots.Acquire(K(20), Soon(), unused);
  ASSERT_TRUE(retry.ok());
  EXPECT_TRUE(retry->delivered);
}

// Threads acquire, fail, resolve (with fences that fail at random) and
// release: a slot never has two holders, and its generations only grow.
// Every thread gets slots (the checks above would pass vacuously if Acquire
// always failed), every slot is handed out, a push of a key never sent
// before is never "delivered", and an Acquire that fails says why with one
// of the two codes the header names.
TEST(StagingSlotsTest, ConcurrentUseNeverSharesASlot) {
  constexpr int kThreads = 8;
  constexpr int kPushes = 300;
  StagingSlots slots("d:1");
  slots.SetCount(3);
  std::vector<std::atomic<int>> holders(3);
  std::vector<std::atomic<uint64_t>> last(3);
  std::atomic<int> failures{0};
  std::atomic<int> delivered{0};
  std::atomic<int> unexpected_codes{0};
  std::vector<int> leases(kThreads, 0);  // per thread, written by that thread only
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      std::mutex rng_mu;
      auto fence = [&](uint32_t, uint64_t g) -> absl::StatusOr<uint64_t> {
        std::lock_guard<std::mutex> l(rng_mu);
        if (rng() % 3 == 0) return absl::UnavailableError("down");
        return rng() % 2 ? g : g - 1;
      };
      for (int k = 0; k < kPushes; ++k) {
        absl::StatusOr<StagingSlots::Acquired> a =
            slots.Acquire(K(1000 * t + k), absl::Now() + absl::Milliseconds(50), fence);
        if (!a.ok()) {
          const absl::StatusCode code = a.status().code();
          if (code != absl::StatusCode::kDeadlineExceeded &&
              code != absl::StatusCode::kUnavailable) {
            ++unexpected_codes;
          }
          continue;
        }
        // Every key is pushed once: no earlier attempt can have applied it.
        if (a->delivered) {
          ++delivered;
          continue;
        }
        ++leases[t];
        const uint32_t s = a->lease.slot;
        if (holders[s].fetch_add(1) != 0) ++failures;
        if (a->lease.generation <= last[s].exchange(a->lease.generation)) ++failures;
        std::this_thread::yield();
        holders[s].fetch_sub(1);
        if (rng() % 4 == 0) {
          slots.Resolve(a->lease, K(1000 * t + k), fence).IgnoreError();
        } else {
          slots.Release(a->lease);
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(delivered.load(), 0);
  EXPECT_EQ(unexpected_codes.load(), 0);
  int total = 0;
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_GT(leases[t], 0) << "thread " << t << " never got a slot";
    total += leases[t];
  }
  // A third of the fences fail, and a quarantined slot waits for one that
  // answers, but most pushes find a slot within 50 ms.
  EXPECT_GE(total, kThreads * kPushes / 4) << total << " of " << kThreads * kPushes;
  for (uint32_t s = 0; s < 3; ++s) EXPECT_GE(last[s].load(), 1u) << "slot " << s << " unused";
}

}  // namespace
}  // namespace zeroshard
