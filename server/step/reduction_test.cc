// ReductionState's held contributions, without threads: a held one is
// summed by the arrival that completes its range, or with a later in-order
// arrival, or let go by Unhold / DropHeld / ReplaceRank / Reset, and every
// way gives the bits of summing the contributions in order one by one.
// And the tensors without a gradient: those that no applied contribution
// (any rank, micro-batch or chunk) carried one for.

#include "server/step/reduction.h"

#include <cstring>
#include <deque>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "server/ledger/memory_ledger.h"
#include "server/optimizer/optimizer.h"
#include "server/step/owned_tensors.h"

namespace zeroshard {
namespace {

using State = HeldContribution::State;

constexpr uint32_t kWorld = 3;
constexpr uint64_t kN = 1000;

struct Rig {
  explicit Rig(bool defer_sums = false) : ledger(0), grad(kN, -7.0f) {
    optimizer = *ShardOptimizer::Create(ShardOptimizer::Options{});
    ReductionState::Options o;
    o.job_id = "job";
    o.owned = {0, kN};
    o.owned_unpadded = {0, kN};
    o.partition_elements = kN;
    o.world_size = kWorld;
    o.pending_budget_bytes = 1 << 20;
    o.defer_sums = defer_sums;
    state = std::make_unique<ReductionState>(o, grad.data(), optimizer.get(), &ledger);
    for (uint32_t r = 0; r < kWorld; ++r) {
      payload.emplace_back(kN);
      for (uint64_t i = 0; i < kN; ++i) payload[r][i] = 0.37f * (r + 1) + 1e-3f * i;
    }
  }
  Contribution Of(uint32_t rank) const {
    Contribution c;
    c.range = {0, kN};
    c.rank = rank;
    c.payload = {reinterpret_cast<const char*>(payload[rank].data()), kN * 4};
    return c;
  }
  // Applies rank's contribution, held if `hold`; the handle or null.
  std::shared_ptr<HeldContribution> Push(uint32_t rank, bool hold) {
    const std::vector<Contribution> batch = {Of(rank)};
    uint64_t pending = 0, bookkeeping = 0;
    EXPECT_TRUE(state->Check(batch, 1, &pending, &bookkeeping, hold).ok());
    EXPECT_TRUE(ledger.Reserve("job", MemoryCategory::kBuffer, pending + bookkeeping).ok());
    std::vector<std::shared_ptr<HeldContribution>> held;
    state->Apply(batch, 1, pending, bookkeeping, 1.0f, hold ? &held : nullptr);
    return held.empty() ? nullptr : held[0];
  }
  // The in-order sum, one contribution at a time.
  std::vector<float> Expected() const {
    std::vector<float> want(kN);
    for (uint64_t i = 0; i < kN; ++i) {
      float s = payload[0][i];
      for (uint32_t r = 1; r < kWorld; ++r) s = s + payload[r][i];
      want[i] = s;
    }
    return want;
  }
  bool SumIsExact() const { return std::memcmp(grad.data(), Expected().data(), kN * 4) == 0; }
  // Deferred sums: runs and finishes what is planned (one pass, as the
  // engine does with its lock released); how many there were.
  size_t RunPlanned() {
    std::vector<ReductionState::SumJob> jobs = state->TakeReadySums();
    for (ReductionState::SumJob& job : jobs) ReductionState::RunSum(job);
    for (ReductionState::SumJob& job : jobs) state->FinishSum(std::move(job));
    return jobs.size();
  }

  MemoryLedger ledger;
  std::vector<float> grad;
  std::unique_ptr<ShardOptimizer> optimizer;
  std::unique_ptr<ReductionState> state;
  std::vector<std::vector<float>> payload;
};

TEST(ReductionHoldTest, TheLastArrivalSumsEveryHeldOneInOnePass) {
  Rig rig;
  std::shared_ptr<HeldContribution> h2 = rig.Push(2, true);
  std::shared_ptr<HeldContribution> h0 = rig.Push(0, true);
  ASSERT_NE(h0, nullptr);
  ASSERT_NE(h2, nullptr);
  EXPECT_EQ(h0->state, State::kHeld);
  EXPECT_FALSE(rig.state->Complete());
  // Held ones count as in: the range waits for rank 1.
  EXPECT_EQ(rig.state->Missing(1)[0].rank, 1u);
  EXPECT_EQ(rig.state->Missing(1)[0].contributions, 2u);
  EXPECT_EQ(rig.Push(1, true), nullptr);  // completes: summed, not held
  EXPECT_EQ(h0->state, State::kDone);
  EXPECT_EQ(h2->state, State::kDone);
  EXPECT_TRUE(rig.state->Complete());
  EXPECT_EQ(rig.state->sum_passes(), 1u);
  EXPECT_TRUE(rig.SumIsExact());
  rig.state->Reset();
  EXPECT_EQ(rig.ledger.total(), 0u);
}

TEST(ReductionHoldTest, AnInOrderArrivalSumsTheHeldOnesBeforeIt) {
  Rig rig;
  std::shared_ptr<HeldContribution> h0 = rig.Push(0, true);
  // Rank 1 cannot be held (e.g. an inline push): summed with rank 0's.
  EXPECT_EQ(rig.Push(1, false), nullptr);
  EXPECT_EQ(h0->state, State::kDone);
  EXPECT_EQ(rig.state->sum_passes(), 1u);
  rig.Push(2, false);
  EXPECT_EQ(rig.state->sum_passes(), 2u);
  EXPECT_TRUE(rig.state->Complete());
  EXPECT_TRUE(rig.SumIsExact());
}

TEST(ReductionHoldTest, UnholdSumsTheNextOneAndBuffersALaterOne) {
  Rig rig;
  std::shared_ptr<HeldContribution> h1 = rig.Push(1, true);
  std::shared_ptr<HeldContribution> h0 = rig.Push(0, true);
  // Rank 1 is not next: its bytes are copied into the buffer.
  EXPECT_FALSE(rig.state->NextInOrder(*h1));
  ASSERT_TRUE(rig.ledger.Reserve("job", MemoryCategory::kBuffer, h1->bytes).ok());
  rig.state->Unhold(h1.get(), h1->bytes, 1.0f);
  EXPECT_EQ(h1->state, State::kDone);
  EXPECT_EQ(rig.state->pending_bytes(), kN * 4);
  // Rank 0 is next: summed with the buffered rank 1 in one pass.
  EXPECT_TRUE(rig.state->NextInOrder(*h0));
  rig.state->Unhold(h0.get(), 0, 1.0f);
  EXPECT_EQ(h0->state, State::kDone);
  EXPECT_EQ(rig.state->pending_bytes(), 0u);
  EXPECT_EQ(rig.state->sum_passes(), 1u);
  rig.Push(2, true);
  EXPECT_TRUE(rig.state->Complete());
  EXPECT_TRUE(rig.SumIsExact());
}

TEST(ReductionHoldTest, DroppedHeldOnesAreNotSummed) {
  Rig rig;
  std::shared_ptr<HeldContribution> h0 = rig.Push(0, true);
  std::shared_ptr<HeldContribution> h2 = rig.Push(2, true);
  rig.state->DropHeld(h2.get());
  EXPECT_EQ(h2->state, State::kDropped);
  EXPECT_EQ(rig.state->ReplaceRank(0), 1u);
  EXPECT_EQ(h0->state, State::kDropped);
  EXPECT_EQ(rig.state->sum_passes(), 0u);
  std::shared_ptr<HeldContribution> h1 = rig.Push(1, true);
  rig.state->Reset();
  EXPECT_EQ(h1->state, State::kDropped);
  EXPECT_EQ(rig.ledger.total(), 0u);
  // The step again, in full.
  rig.Push(0, false);
  rig.Push(1, false);
  rig.Push(2, false);
  EXPECT_TRUE(rig.state->Complete());
  EXPECT_TRUE(rig.SumIsExact());
}

// ---- Deferred sums (the engine runs each pass without its lock) ----

TEST(ReductionDeferTest, ArrivalsDuringAPassWaitAndAreSummedByItsFollowUp) {
  Rig rig(/*defer_sums=*/true);
  rig.Push(0, false);  // next in order: planned, not run
  EXPECT_EQ(rig.state->sums_in_flight(), 1u);
  EXPECT_EQ(rig.grad[0], -7.0f);
  // The range is busy: rank 1, next in order, is copied into the buffer
  // (and Check booked the copy), rank 2, which completes it, is held.
  rig.Push(1, false);
  EXPECT_EQ(rig.state->pending_bytes(), kN * 4);
  std::shared_ptr<HeldContribution> h2 = rig.Push(2, true);
  ASSERT_NE(h2, nullptr);
  EXPECT_EQ(h2->state, State::kHeld);
  EXPECT_FALSE(rig.state->NextInOrder(*h2));
  EXPECT_EQ(rig.RunPlanned(), 1u);
  // The pass's follow-up takes ranks 1 and 2 in one pass; rank 2's bytes
  // are being read: a rejoin of rank 2 cannot drop them.
  EXPECT_EQ(h2->state, State::kSumming);  // planned by FinishSum, not yet taken
  EXPECT_EQ(rig.state->ReplaceRank(2), 0u);
  EXPECT_EQ(h2->state, State::kSumming);
  EXPECT_EQ(rig.state->sums_in_flight(), 1u);
  EXPECT_EQ(rig.RunPlanned(), 1u);
  EXPECT_EQ(h2->state, State::kDone);
  EXPECT_EQ(rig.state->sums_in_flight(), 0u);
  EXPECT_EQ(rig.state->pending_bytes(), 0u);
  EXPECT_EQ(rig.state->sum_passes(), 2u);
  EXPECT_TRUE(rig.state->Complete());
  EXPECT_TRUE(rig.SumIsExact());
  // What stays booked is the bookkeeping of a step summed inline.
  Rig inline_rig;
  for (uint32_t r = 0; r < kWorld; ++r) inline_rig.Push(r, false);
  EXPECT_EQ(rig.ledger.total(), inline_rig.ledger.total());
  rig.state->Reset();
  EXPECT_EQ(rig.ledger.total(), 0u);
}

TEST(ReductionDeferTest, AHeldOneThatDoesNotCompleteStaysHeldAfterAPass) {
  Rig rig(/*defer_sums=*/true);
  rig.Push(0, false);
  std::shared_ptr<HeldContribution> h1 = rig.Push(1, true);
  EXPECT_EQ(rig.RunPlanned(), 1u);
  EXPECT_EQ(rig.state->TakeReadySums().size(), 0u);
  EXPECT_EQ(h1->state, State::kHeld);
  EXPECT_TRUE(rig.state->NextInOrder(*h1));
  // The last arrival sums the held one with itself.
  EXPECT_EQ(rig.Push(2, true), nullptr);
  EXPECT_EQ(h1->state, State::kSumming);
  EXPECT_EQ(rig.state->sums_in_flight(), 1u);
  EXPECT_EQ(rig.RunPlanned(), 1u);
  EXPECT_EQ(h1->state, State::kDone);
  EXPECT_EQ(rig.state->sum_passes(), 2u);
  EXPECT_TRUE(rig.SumIsExact());
}

TEST(ReductionDeferTest, AHeldOneIsSummedWithACopyThatCameAfterItDuringAPass) {
  Rig rig(/*defer_sums=*/true);
  rig.Push(0, false);
  std::shared_ptr<HeldContribution> h1 = rig.Push(1, true);
  rig.Push(2, false);  // next but one: a copy, as inline
  EXPECT_EQ(rig.state->pending_bytes(), kN * 4);
  EXPECT_EQ(rig.RunPlanned(), 1u);
  // Inline, rank 2's arrival would have summed rank 1 with it: so does the
  // pass's follow-up.
  EXPECT_EQ(h1->state, State::kSumming);
  EXPECT_EQ(rig.RunPlanned(), 1u);
  EXPECT_EQ(h1->state, State::kDone);
  EXPECT_EQ(rig.state->pending_bytes(), 0u);
  EXPECT_TRUE(rig.state->Complete());
  EXPECT_TRUE(rig.SumIsExact());
}

TEST(ReductionDeferTest, DeferredAndInlineSumsHoldTheSameState) {
  Rig inline_rig;
  Rig deferred(/*defer_sums=*/true);
  for (Rig* rig : {&inline_rig, &deferred}) {
    rig->Push(1, false);
    rig->Push(0, false);
    rig->RunPlanned();
    rig->Push(2, false);
    rig->RunPlanned();
  }
  uint64_t a = 0, b = 0;
  inline_rig.state->Hash(a);
  deferred.state->Hash(b);
  EXPECT_EQ(a, b);
  EXPECT_EQ(inline_rig.ledger.total(), deferred.ledger.total());
  EXPECT_TRUE(deferred.SumIsExact());
}

// ---- Tensors without a gradient ----

// Tensors of 100, 150, 50 (frozen), 100 and 96 elements aligned to 4:
// t0 [0,100) t1 [100,250) t2 [252,302) t3 [304,404) t4 [404,500); every
// rank pushes them as two chunks, [0,200) and [200,500), per micro-batch.
struct NoGradRig {
  static constexpr uint64_t kTotal = 500;
  static constexpr uint32_t kRanks = 2;
  static constexpr uint32_t kMicroBatches = 2;

  explicit NoGradRig(bool with_tensors = true) : ledger(0), grad(512, 0.0f), payload(kTotal, 0.5f) {
    std::vector<TensorSpec> specs = {{"t0", {100}, DType::kFp32, 0},
                                     {"t1", {150}, DType::kFp32, 0},
                                     {"t2", {50}, DType::kFp32, 0},
                                     {"t3", {100}, DType::kFp32, 0},
                                     {"t4", {96}, DType::kFp32, 0}};
    specs[2].frozen = true;
    layout = *Layout::Create(std::move(specs), 4);
    EXPECT_EQ(layout.total_elements(), kTotal);
    tensors = OwnedTensors(layout, {0, 512});
    optimizer = *ShardOptimizer::Create(ShardOptimizer::Options{});
    ReductionState::Options o;
    o.job_id = "job";
    o.owned = {0, 512};
    o.owned_unpadded = {0, kTotal};
    o.partition_elements = 512;
    o.world_size = kRanks;
    o.pending_budget_bytes = 1 << 20;
    o.tensors = with_tensors ? &tensors : nullptr;
    state = std::make_unique<ReductionState>(o, grad.data(), optimizer.get(), &ledger);
  }
  // Applies rank's micro-batch contribution to `range` marking `no_grad`.
  void Push(uint32_t rank, uint32_t mb, FlatRange range, std::vector<uint32_t> no_grad) {
    marks.push_back(std::move(no_grad));
    Contribution c;
    c.range = range;
    c.rank = rank;
    c.micro_batch = mb;
    c.payload = {reinterpret_cast<const char*>(payload.data() + range.begin), range.size() * 4};
    c.no_grad = marks.back();
    const std::vector<Contribution> batch = {c};
    uint64_t pending = 0, bookkeeping = 0;
    ASSERT_TRUE(state->Check(batch, kMicroBatches, &pending, &bookkeeping).ok());
    ASSERT_TRUE(ledger.Reserve("job", MemoryCategory::kBuffer, pending + bookkeeping).ok());
    state->Apply(batch, kMicroBatches, pending, bookkeeping, 1.0f);
  }
  uint64_t Hash() const {
    uint64_t h = 0;
    state->Hash(h);
    return h;
  }

  MemoryLedger ledger;
  std::vector<float> grad;
  std::vector<float> payload;
  Layout layout;
  OwnedTensors tensors;
  std::unique_ptr<ShardOptimizer> optimizer;
  std::unique_ptr<ReductionState> state;
  std::deque<std::vector<uint32_t>> marks;  // what each contribution's no_grad points at
};

using Indices = std::vector<uint32_t>;

// A tensor is without a gradient only if every contribution covering it
// (each rank, each micro-batch, each chunk of it) said so.
TEST(ReductionNoGradTest, ATensorHasNoGradientOnlyIfNoContributionCarriedOne) {
  NoGradRig rig;
  const FlatRange first{0, 200}, second{200, 500};
  // Nothing applied yet: no trainable tensor has a gradient (the frozen
  // one is never listed).
  EXPECT_EQ(rig.state->NoGradTensors(), (Indices{0, 1, 3, 4}));
  // Rank 0 has no gradient for t0, t1, t3, t4 in either micro-batch.
  for (uint32_t mb = 0; mb < NoGradRig::kMicroBatches; ++mb) {
    rig.Push(0, mb, first, {0, 1});
    rig.Push(0, mb, second, {1, 2, 3, 4});
  }
  EXPECT_EQ(rig.state->NoGradTensors(), (Indices{0, 1, 3, 4}));
  // Rank 1's first micro-batch has one for t3 (in its second chunk).
  rig.Push(1, 0, first, {0, 1});
  rig.Push(1, 0, second, {1, 2, 4});
  EXPECT_EQ(rig.state->NoGradTensors(), (Indices{0, 1, 4}));
  // Its second micro-batch has one for t1, in the chunk holding t1's tail
  // only: that is enough; that it has none for t3 changes nothing.
  rig.Push(1, 1, first, {0, 1});
  EXPECT_EQ(rig.state->NoGradTensors(), (Indices{0, 1, 4}));
  rig.Push(1, 1, second, {2, 3, 4});
  EXPECT_TRUE(rig.state->Complete());
  EXPECT_EQ(rig.state->NoGradTensors(), (Indices{0, 4}));
  // A new step starts with no gradient for anything.
  rig.state->Reset();
  EXPECT_EQ(rig.state->NoGradTensors(), (Indices{0, 1, 3, 4}));
  rig.Push(0, 0, first, {});
  EXPECT_EQ(rig.state->NoGradTensors(), (Indices{3, 4}));
  rig.state->Reset();
  EXPECT_EQ(rig.ledger.total(), 0u);
}

// An out-of-order contribution (buffered, not yet summed) counts once it
// is summed.
TEST(ReductionNoGradTest, ABufferedContributionCountsOnceSummed) {
  NoGradRig rig;
  rig.Push(1, 1, {200, 500}, {1, 4});  // waits for the three before it
  EXPECT_GT(rig.state->pending_bytes(), 0u);
  EXPECT_EQ(rig.state->NoGradTensors(), (Indices{0, 1, 3, 4}));
  rig.Push(0, 0, {200, 500}, {1, 2, 3, 4});
  rig.Push(0, 1, {200, 500}, {1, 2, 3, 4});
  EXPECT_EQ(rig.state->NoGradTensors(), (Indices{0, 1, 3, 4}));
  rig.Push(1, 0, {200, 500}, {1, 2, 3, 4});  // the run up to the buffered one sums
  EXPECT_EQ(rig.state->pending_bytes(), 0u);
  EXPECT_EQ(rig.state->NoGradTensors(), (Indices{0, 1, 4}));
  rig.state->Reset();
  EXPECT_EQ(rig.ledger.total(), 0u);
}

// A contribution dropped unsummed (its rank's process was replaced) marks
// nothing: the tensor it carried a gradient for has none unless the new
// process's contribution carries one.
TEST(ReductionNoGradTest, AContributionDroppedUnsummedMarksNothing) {
  NoGradRig rig;
  const FlatRange first{0, 200}, second{200, 500};
  rig.Push(1, 0, second, {1, 2, 4});  // a gradient for t3; waits for rank 0's
  EXPECT_GT(rig.state->pending_bytes(), 0u);
  EXPECT_EQ(rig.state->ReplaceRank(1), 1u);
  for (uint32_t rank = 0; rank < NoGradRig::kRanks; ++rank) {
    for (uint32_t mb = 0; mb < NoGradRig::kMicroBatches; ++mb) {
      rig.Push(rank, mb, first, {0, 1});
      rig.Push(rank, mb, second, {1, 2, 3, 4});
    }
  }
  ASSERT_TRUE(rig.state->Complete());
  EXPECT_EQ(rig.state->NoGradTensors(), (Indices{0, 1, 3, 4}));
  rig.state->Reset();
  EXPECT_EQ(rig.ledger.total(), 0u);
}

// Without the owned tensors every tensor counts as having a gradient.
TEST(ReductionNoGradTest, WithoutTensorsNothingIsSkipped) {
  NoGradRig rig(/*with_tensors=*/false);
  EXPECT_TRUE(rig.state->NoGradTensors().empty());
  rig.Push(0, 0, {0, 200}, {0, 1});
  EXPECT_TRUE(rig.state->NoGradTensors().empty());
  rig.state->Reset();
}

// The marks are part of the state: a step where a contribution marked a
// tensor is not the same state as one where it did not.
TEST(ReductionNoGradTest, MarksChangeTheHash) {
  NoGradRig plain, marked, other;
  const uint64_t fresh = plain.Hash();
  EXPECT_EQ(marked.Hash(), fresh);
  plain.Push(0, 0, {200, 500}, {});
  marked.Push(0, 0, {200, 500}, {4});
  other.Push(0, 0, {200, 500}, {3});
  EXPECT_NE(plain.Hash(), fresh);
  EXPECT_NE(marked.Hash(), plain.Hash());
  EXPECT_NE(other.Hash(), plain.Hash());
  EXPECT_NE(other.Hash(), marked.Hash());
  // Reset forgets them.
  plain.state->Reset();
  marked.state->Reset();
  EXPECT_EQ(marked.Hash(), plain.Hash());
  other.state->Reset();
}

}  // namespace
}  // namespace zeroshard
