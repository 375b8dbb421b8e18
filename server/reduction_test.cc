// ReductionState's held contributions, without threads: a held one is
// summed by the arrival that completes its range, or with a later in-order
// arrival, or let go by Unhold / DropHeld / ReplaceRank / Reset, and every
// way gives the bits of summing the contributions in order one by one.

#include "server/reduction.h"

#include <cstring>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "server/memory_ledger.h"
#include "server/optimizer/optimizer.h"

namespace zeroshard {
namespace {

using State = HeldContribution::State;

constexpr uint32_t kWorld = 3;
constexpr uint64_t kN = 1000;

struct Rig {
  Rig() : ledger(0), grad(kN, -7.0f) {
    optimizer = *ShardOptimizer::Create(ShardOptimizer::Options{});
    ReductionState::Options o;
    o.job_id = "job";
    o.owned = {0, kN};
    o.owned_unpadded = {0, kN};
    o.partition_elements = kN;
    o.world_size = kWorld;
    o.pending_budget_bytes = 1 << 20;
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
    std::shared_ptr<HeldContribution> held;
    state->Apply(batch, 1, pending, bookkeeping, 1.0f, hold ? &held : nullptr);
    return held;
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

}  // namespace
}  // namespace zeroshard
