// ShardState against a plain per-tensor reference: each trainable tensor is
// stepped on its own (ShardOptimizer::Step over the tensor alone) with its
// parameter group's hyper-parameters and its own update count, as
// torch.optim.AdamW steps each parameter; a tensor without a gradient in a
// step is left alone, and a frozen one never changes. The shard, over
// ranges that cut tensors, must match it bit for bit; its checkpoint
// (dense) and transfer (compact) forms must restore it whole, and state
// writes must refuse values where it keeps no state.

#include "server/step/shard_state.h"

#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/fnv.h"
#include "common/job_spec.h"
#include "common/layout.h"
#include "gtest/gtest.h"
#include "server/ledger/memory_ledger.h"
#include "server/optimizer/optimizer.h"

namespace zeroshard {
namespace {

// Aligned to 4:  a [0,10) g0 | b [12,17) g1 | frz [20,27) frozen |
// c [28,34) g0 | d [36,45) g1 | e [48,51) g1; 52 elements. d and e are
// neighbours of one group: one kernel call while their counts agree.
constexpr uint32_t kA = 0, kB = 1, kFrozen = 2, kC = 3, kD = 4, kE = 5;
constexpr uint64_t kTotal = 52;

Layout MakeLayout(bool frozen = true) {
  std::vector<TensorSpec> specs = {{"a", {10}, DType::kFp32, 0},
                                   {"b", {5}, DType::kFp32, 0},
                                   {"frz", {7}, DType::kFp32, 0},
                                   {"c", {2, 3}, DType::kFp32, 1},
                                   {"d", {9}, DType::kFp32, 1},
                                   {"e", {3}, DType::kFp32, 1}};
  specs[kB].group = 1;
  specs[kD].group = 1;
  specs[kE].group = 1;
  specs[kFrozen].frozen = frozen;
  absl::StatusOr<Layout> layout = Layout::Create(std::move(specs), 4);
  EXPECT_TRUE(layout.ok()) << layout.status();
  return *std::move(layout);
}

JobConfig MakeConfig(const Layout& layout, OptimizerKind kind = OptimizerKind::kAdamW,
                     DType precision = DType::kFp32) {
  JobConfig c;
  c.job_id = "job";
  c.stage = 2;
  c.precision = precision;
  c.optimizer.kind = kind;
  c.optimizer.momentum = 0.9f;
  // Two groups that differ in every number.
  c.param_groups = {{0.01f, 0.9f, 0.999f, 1e-8f, 0.01f}, {0.05f, 0.8f, 0.95f, 1e-6f, 0.1f}};
  c.layout = layout;
  return c;
}

// Map from tensor index to update count.
std::map<uint32_t, uint64_t> Steps(const std::vector<v1::TensorStep>& steps) {
  std::map<uint32_t, uint64_t> out;
  for (const v1::TensorStep& t : steps) {
    EXPECT_TRUE(out.emplace(t.tensor(), t.steps()).second) << "tensor " << t.tensor() << " twice";
  }
  return out;
}

bool SameBits(const float* a, const float* b, size_t n) {
  return std::memcmp(a, b, n * sizeof(float)) == 0;
}

uint64_t HashOf(const ShardState& s) {
  uint64_t h = kFnv1aOffset;
  s.Hash(h);
  return h;
}

class ShardStateTest : public ::testing::Test {
 protected:
  ShardStateTest() : ledger_(0) {
    optimizer_ = *ShardOptimizer::Create(ShardOptimizer::Options{});
  }

  std::unique_ptr<ShardState> Create(const JobConfig& c, FlatRange owned) {
    absl::StatusOr<LedgerReservation> booked =
        LedgerReservation::Create(&ledger_, c.job_id, ShardState::Footprint(c, owned));
    EXPECT_TRUE(booked.ok()) << booked.status();
    absl::StatusOr<std::unique_ptr<ShardState>> s =
        ShardState::Create(c, owned, &*booked, /*transport=*/nullptr);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *std::move(s) : nullptr;
  }

  // The hyper-parameters of `step` for each group: a schedule that changes
  // every group's lr every step, and a clip/loss-scale factor.
  std::vector<StepHyperParams> GroupsAt(const JobConfig& c, uint64_t step) const {
    std::vector<StepHyperParams> groups = GroupHyperParams(c);
    for (size_t g = 0; g < groups.size(); ++g) {
      groups[g].lr = c.param_groups[g].lr * (1.0 + 0.25 * static_cast<double>(step));
      groups[g].grad_scale = 0.5;
    }
    return groups;
  }

  MemoryLedger ledger_;
  std::unique_ptr<ShardOptimizer> optimizer_;
};

// The reference: every tensor stepped alone over the whole flat space.
struct Reference {
  Reference(const Layout& layout, std::vector<float> init)
      : layout(layout), param(std::move(init)), m(kTotal, 0.0f), v(kTotal, 0.0f) {}

  void Step(ShardOptimizer* optimizer, const std::vector<StepHyperParams>& groups,
            const std::vector<float>& grad, const std::vector<uint32_t>& no_grad) {
    for (size_t i = 0; i < layout.tensors().size(); ++i) {
      const TensorPlacement& t = layout.tensors()[i];
      if (t.spec.frozen) continue;
      bool skipped = false;
      for (uint32_t n : no_grad) skipped = skipped || n == i;
      if (skipped) continue;
      StepHyperParams hp = groups[t.spec.group];
      hp.step = static_cast<int64_t>(++steps[static_cast<uint32_t>(i)]);
      ShardBuffers b;
      b.param = param.data() + t.offset;
      b.grad = grad.data() + t.offset;
      b.exp_avg = m.data() + t.offset;
      b.exp_avg_sq = v.data() + t.offset;
      b.size = t.numel;
      ASSERT_TRUE(optimizer->Step(hp, b).ok());
    }
  }

  // The counts of the trainable tensors overlapping `range`.
  std::map<uint32_t, uint64_t> StepsIn(const FlatRange& range) const {
    std::map<uint32_t, uint64_t> out;
    for (size_t i = 0; i < layout.tensors().size(); ++i) {
      const TensorPlacement& t = layout.tensors()[i];
      if (t.spec.frozen || t.range().Intersect(range).empty()) continue;
      auto it = steps.find(static_cast<uint32_t>(i));
      out[static_cast<uint32_t>(i)] = it == steps.end() ? 0 : it->second;
    }
    return out;
  }

  const Layout& layout;
  std::vector<float> param, m, v;
  std::map<uint32_t, uint64_t> steps;
};

// Values in every tensor element (frozen ones too), zeros in the gaps, as a
// trainer's flat buffers hold them.
std::vector<float> TensorValues(const Layout& layout, std::mt19937& rng, float scale) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> out(kTotal, 0.0f);
  for (const TensorPlacement& t : layout.tensors()) {
    for (uint64_t i = t.offset; i < t.offset + t.numel; ++i) out[i] = dist(rng);
  }
  return out;
}

// The tensors without a gradient in each of the five steps: d in the first,
// b in the second and third, c in the third.
const std::vector<std::vector<uint32_t>> kNoGrad = {{kD}, {kB}, {kB, kC}, {}, {}};

// Five steps of the shard over several owned ranges (each cutting tensors
// differently) against the reference, after every step.
TEST_F(ShardStateTest, StepsMatchAPerTensorReferenceBitForBit) {
  const Layout layout = MakeLayout();
  const JobConfig config = MakeConfig(layout);
  std::mt19937 rng(11);
  const std::vector<float> init = TensorValues(layout, rng, 1.0f);
  Reference ref(layout, init);
  const std::vector<FlatRange> ranges = {{0, kTotal}, {5, 40}, {13, 30}, {30, 50}};
  std::vector<std::unique_ptr<ShardState>> shards;
  for (const FlatRange& r : ranges) {
    shards.push_back(Create(config, r));
    ASSERT_NE(shards.back(), nullptr);
    ASSERT_TRUE(shards.back()
                    ->WriteMasters(optimizer_.get(), r.begin, init.data() + r.begin,
                                   DType::kFp32, r.size())
                    .ok());
  }
  for (uint64_t step = 1; step <= kNoGrad.size(); ++step) {
    SCOPED_TRACE(::testing::Message() << "step " << step);
    // Gradients in frozen and skipped tensors too: they must not be used.
    const std::vector<float> grad = TensorValues(layout, rng, 0.1f);
    const std::vector<StepHyperParams> groups = GroupsAt(config, step);
    const std::vector<uint32_t>& no_grad = kNoGrad[step - 1];
    ref.Step(optimizer_.get(), groups, grad, no_grad);
    for (size_t k = 0; k < ranges.size(); ++k) {
      SCOPED_TRACE(::testing::Message() << "owned [" << ranges[k].begin << ", " << ranges[k].end
                                        << ")");
      const FlatRange r = ranges[k];
      ShardState& s = *shards[k];
      ASSERT_TRUE(s.Step(optimizer_.get(), groups, grad.data() + r.begin, r, no_grad).ok());
      EXPECT_EQ(s.optimizer_steps(), step);
      std::vector<float> got(r.size());
      ASSERT_TRUE(s.ReadArray(StateArrayKind::kMaster, r, got.data()).ok());
      EXPECT_TRUE(SameBits(got.data(), ref.param.data() + r.begin, r.size()));
      ASSERT_TRUE(s.ReadArray(StateArrayKind::kExpAvg, r, got.data()).ok());
      EXPECT_TRUE(SameBits(got.data(), ref.m.data() + r.begin, r.size()));
      ASSERT_TRUE(s.ReadArray(StateArrayKind::kExpAvgSq, r, got.data()).ok());
      EXPECT_TRUE(SameBits(got.data(), ref.v.data() + r.begin, r.size()));
      EXPECT_EQ(Steps(s.TensorStepsIn(r)), ref.StepsIn(r));
    }
  }
  // Each tensor's own count: b missed two steps, c and d one each.
  EXPECT_EQ(ref.steps,
            (std::map<uint32_t, uint64_t>{{kA, 5}, {kB, 3}, {kC, 4}, {kD, 4}, {kE, 5}}));
  // The frozen tensor is bit for bit what it was initialised with, and the
  // gaps are still zeros.
  std::vector<float> all(kTotal);
  ASSERT_TRUE(shards[0]->ReadArray(StateArrayKind::kMaster, {0, kTotal}, all.data()).ok());
  const FlatRange frozen = layout.tensors()[kFrozen].range();
  EXPECT_TRUE(SameBits(all.data() + frozen.begin, init.data() + frozen.begin, frozen.size()));
  for (uint64_t gap : {10, 11, 17, 18, 19, 27, 34, 35, 45, 46, 47, 51}) {
    EXPECT_EQ(all[gap], 0.0f) << gap;
  }
  // The steps did update the others.
  EXPECT_FALSE(SameBits(all.data(), init.data(), 10));
  // Counts apart from the commit count: the lagging ones only.
  EXPECT_EQ(Steps(shards[0]->TensorStepsApart()),
            (std::map<uint32_t, uint64_t>{{kB, 3}, {kC, 4}, {kD, 4}}));
  EXPECT_EQ(Steps(shards[3]->TensorStepsApart()),
            (std::map<uint32_t, uint64_t>{{kC, 4}, {kD, 4}}));
}

// A step of a group that does not validate changes nothing.
TEST_F(ShardStateTest, BadGroupHyperParamsWriteNothing) {
  const Layout layout = MakeLayout();
  const JobConfig config = MakeConfig(layout);
  std::unique_ptr<ShardState> s = Create(config, {0, kTotal});
  std::mt19937 rng(3);
  const std::vector<float> init = TensorValues(layout, rng, 1.0f);
  ASSERT_TRUE(s->WriteMasters(optimizer_.get(), 0, init.data(), DType::kFp32, kTotal).ok());
  const uint64_t before = HashOf(*s);
  std::vector<StepHyperParams> groups = GroupsAt(config, 1);
  groups[1].beta2 = 1.5;
  const std::vector<float> grad = TensorValues(layout, rng, 0.1f);
  const absl::Status st = s->Step(optimizer_.get(), groups, grad.data(), {0, kTotal}, {});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("parameter group 1"), absl::string_view::npos) << st;
  EXPECT_EQ(HashOf(*s), before);
}

// Frozen tensors hold no moments: neither in memory nor in the ledger.
TEST_F(ShardStateTest, FootprintBooksNoMomentsForFrozenTensors) {
  const JobConfig frozen = MakeConfig(MakeLayout(true));
  const JobConfig trainable = MakeConfig(MakeLayout(false));
  auto bytes = [](const CategoryBytes& b, MemoryCategory c) { return b[static_cast<int>(c)]; };
  for (const FlatRange& r : {FlatRange{0, kTotal}, FlatRange{13, 30}, FlatRange{22, 25}}) {
    SCOPED_TRACE(::testing::Message() << "[" << r.begin << ", " << r.end << ")");
    const uint64_t in_frozen = r.Intersect({20, 27}).size();
    const CategoryBytes f = ShardState::Footprint(frozen, r);
    const CategoryBytes t = ShardState::Footprint(trainable, r);
    EXPECT_EQ(bytes(f, MemoryCategory::kParamMaster), r.size() * 4);
    EXPECT_EQ(bytes(t, MemoryCategory::kOptimM), r.size() * 4);
    EXPECT_EQ(bytes(f, MemoryCategory::kOptimM), (r.size() - in_frozen) * 4);
    EXPECT_EQ(bytes(f, MemoryCategory::kOptimV), (r.size() - in_frozen) * 4);
    // What Create allocates is what Footprint books.
    const uint64_t ledger_before = ledger_.total();
    {
      std::unique_ptr<ShardState> s = Create(frozen, r);
      ASSERT_NE(s, nullptr);
      EXPECT_EQ(ledger_.JobBytes("job")[static_cast<int>(MemoryCategory::kOptimM)],
                (r.size() - in_frozen) * 4);
      EXPECT_EQ(s->raw_elements(1, r.size()), r.size() - in_frozen);
    }
    EXPECT_EQ(ledger_.total(), ledger_before);
  }
  // SGD keeps one moment.
  const CategoryBytes sgd =
      ShardState::Footprint(MakeConfig(MakeLayout(true), OptimizerKind::kSgdMomentum), {0, kTotal});
  EXPECT_EQ(bytes(sgd, MemoryCategory::kOptimM), (kTotal - 7) * 4);
  EXPECT_EQ(bytes(sgd, MemoryCategory::kOptimV), 0u);
}

// A state after some steps, over an owned range that cuts tensors.
class TrainedShardTest : public ShardStateTest {
 protected:
  void SetUp() override {
    layout_ = MakeLayout();
    config_ = MakeConfig(layout_);
    shard_ = Train(owned_);
  }

  std::unique_ptr<ShardState> Train(const FlatRange& owned) {
    std::unique_ptr<ShardState> s = Create(config_, owned);
    std::mt19937 rng(5);
    const std::vector<float> init = TensorValues(layout_, rng, 1.0f);
    EXPECT_TRUE(s->WriteMasters(optimizer_.get(), owned.begin, init.data() + owned.begin,
                                DType::kFp32, owned.size())
                    .ok());
    for (uint64_t step = 1; step <= kNoGrad.size(); ++step) {
      const std::vector<float> grad = TensorValues(layout_, rng, 0.1f);
      EXPECT_TRUE(s->Step(optimizer_.get(), GroupsAt(config_, step), grad.data() + owned.begin,
                          owned, kNoGrad[step - 1])
                      .ok());
    }
    return s;
  }

  Layout layout_;
  JobConfig config_;
  const FlatRange owned_{5, 40};  // part of a, b, frz, c, part of d
  std::unique_ptr<ShardState> shard_;
};

TEST_F(TrainedShardTest, CheckpointFormIsDenseWithZerosForFrozenMoments) {
  const size_t n = owned_.size();
  ASSERT_EQ(shard_->checkpoint_arrays(), 3u);
  std::vector<std::vector<float>> out(3, std::vector<float>(n, -1.0f));
  float* dst[3] = {out[0].data(), out[1].data(), out[2].data()};
  ASSERT_TRUE(shard_->CopyOut(n, dst).ok());
  // Dense: indexed like the owned range, what ReadArray reads.
  for (size_t i = 0; i < 3; ++i) {
    std::vector<float> read(n);
    ASSERT_TRUE(shard_->ReadArray(static_cast<StateArrayKind>(i + 1), owned_, read.data()).ok());
    EXPECT_TRUE(SameBits(out[i].data(), read.data(), n)) << "array " << i;
  }
  // The frozen tensor's moments are zeros; its neighbours' are not.
  for (size_t i = 1; i < 3; ++i) {
    for (uint64_t x = 20; x < 27; ++x) EXPECT_EQ(out[i][x - owned_.begin], 0.0f) << i << " " << x;
    EXPECT_NE(out[i][17 - 1 - owned_.begin], 0.0f) << i;  // the last of b
    EXPECT_NE(out[i][28 - owned_.begin], 0.0f) << i;      // the first of c
  }
  // Restored into a fresh state with the counts apart: the same state, even
  // when the frozen tensor's moments in the file are not zeros (ignored).
  for (size_t i = 1; i < 3; ++i) {
    for (uint64_t x = 20; x < 27; ++x) out[i][x - owned_.begin] = 9.0f;
  }
  const float* src[3] = {out[0].data(), out[1].data(), out[2].data()};
  std::unique_ptr<ShardState> restored = Create(config_, owned_);
  ASSERT_TRUE(restored->Restore(optimizer_.get(), n, src, shard_->optimizer_steps(),
                    shard_->TensorStepsApart()).ok());
  EXPECT_EQ(HashOf(*restored), HashOf(*shard_));
  EXPECT_EQ(Steps(restored->TensorStepsIn(owned_)), Steps(shard_->TensorStepsIn(owned_)));
  std::vector<float> m(n);
  ASSERT_TRUE(restored->ReadArray(StateArrayKind::kExpAvg, owned_, m.data()).ok());
  for (uint64_t x = 20; x < 27; ++x) EXPECT_EQ(m[x - owned_.begin], 0.0f) << x;
  // Without the counts every tensor counts the commits: another state.
  std::unique_ptr<ShardState> uncounted = Create(config_, owned_);
  ASSERT_TRUE(uncounted->Restore(optimizer_.get(), n, src, shard_->optimizer_steps(), {}).ok());
  EXPECT_NE(HashOf(*uncounted), HashOf(*shard_));
  EXPECT_TRUE(uncounted->TensorStepsApart().empty());
  // Counts may name tensors the range does not hold (another daemon's part
  // of the checkpoint): ignored.
  std::unique_ptr<ShardState> inner = Create(config_, {13, 30});  // b, frz, c
  std::vector<float> part[3];
  const float* inner_src[3];
  for (size_t i = 0; i < 3; ++i) {
    part[i].assign(out[i].begin() + (13 - owned_.begin), out[i].begin() + (30 - owned_.begin));
    inner_src[i] = part[i].data();
  }
  std::vector<v1::TensorStep> steps = shard_->TensorStepsApart();  // b, c, d
  v1::TensorStep a;
  a.set_tensor(kA);
  a.set_steps(77);
  steps.push_back(a);
  ASSERT_TRUE(inner->Restore(optimizer_.get(), 17, inner_src, shard_->optimizer_steps(), steps).ok());
  EXPECT_EQ(Steps(inner->TensorStepsIn({13, 30})),
            (std::map<uint32_t, uint64_t>{{kB, 3}, {kC, 4}}));
}

TEST_F(TrainedShardTest, TransferFormIsCompactAndRestoresTheSameState) {
  const uint64_t n = owned_.size();
  EXPECT_EQ(shard_->raw_elements(0, n), n);
  EXPECT_EQ(shard_->raw_elements(1, n), n - 7);
  EXPECT_EQ(shard_->raw_elements(2, n), n - 7);
  EXPECT_EQ(shard_->raw_elements(1, 15), 15u);  // [5, 20): before the frozen tensor
  EXPECT_EQ(shard_->raw_elements(1, 18), 15u);  // [5, 23): three of it
  // The raw moment array skips the frozen tensor: element 28 (c's first) sits
  // 7 places earlier than in the dense form.
  std::vector<float> dense(n);
  ASSERT_TRUE(shard_->ReadArray(StateArrayKind::kExpAvg, owned_, dense.data()).ok());
  EXPECT_EQ(shard_->array(1)[28 - owned_.begin - 7], dense[28 - owned_.begin]);
  EXPECT_EQ(shard_->array(1)[19 - owned_.begin], dense[19 - owned_.begin]);
  const float* src[3] = {shard_->array(0), shard_->array(1), shard_->array(2)};
  std::unique_ptr<ShardState> copy = Create(config_, owned_);
  copy->RestoreRaw(optimizer_.get(), n, src, shard_->optimizer_steps(),
                   shard_->TensorStepsApart());
  EXPECT_EQ(HashOf(*copy), HashOf(*shard_));
  std::unique_ptr<ShardState> uncounted = Create(config_, owned_);
  uncounted->RestoreRaw(optimizer_.get(), n, src, shard_->optimizer_steps(), {});
  EXPECT_NE(HashOf(*uncounted), HashOf(*shard_));
  // And the copy steps on exactly as the original does.
  std::mt19937 rng(9);
  const std::vector<float> grad = TensorValues(layout_, rng, 0.1f);
  for (ShardState* s : {shard_.get(), copy.get()}) {
    ASSERT_TRUE(s->Step(optimizer_.get(), GroupsAt(config_, 6), grad.data() + owned_.begin, owned_,
                        {kA})
                    .ok());
  }
  EXPECT_EQ(HashOf(*copy), HashOf(*shard_));
}

TEST_F(TrainedShardTest, WritesNeedZerosWhereThereIsNoState) {
  const FlatRange all{0, kTotal};
  std::unique_ptr<ShardState> s = Train(all);
  const uint64_t trained = HashOf(*s);
  std::vector<float> values(kTotal);
  for (uint64_t i = 0; i < kTotal; ++i) values[i] = 0.5f + static_cast<float>(i);
  auto zero = [&](std::vector<float>& v, FlatRange r) {
    for (uint64_t i = r.begin; i < r.end; ++i) v[i] = 0.0f;
  };
  std::vector<float> masters = values;
  for (const FlatRange& gap : {FlatRange{10, 12}, FlatRange{17, 20}, FlatRange{27, 28},
                               FlatRange{34, 36}, FlatRange{45, 48}, FlatRange{51, 52}}) {
    zero(masters, gap);
  }
  std::vector<float> moments = masters;
  zero(moments, {20, 27});
  // A nonzero alignment gap, in masters or moments.
  for (StateArrayKind array : {StateArrayKind::kMaster, StateArrayKind::kExpAvg}) {
    std::vector<float> bad = array == StateArrayKind::kMaster ? masters : moments;
    bad[18] = 1.0f;
    const absl::Status st = s->CheckWrite(array, {8, 30}, bad.data() + 8, "chunk 3.data");
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find("chunk 3.data: element 18 is an alignment gap"),
              absl::string_view::npos)
        << st;
  }
  // The trailing gap counts as well.
  std::vector<float> tail = masters;
  tail[46] = -2.0f;
  EXPECT_EQ(s->CheckWrite(StateArrayKind::kMaster, {40, 48}, tail.data() + 40, "f").code(),
            absl::StatusCode::kInvalidArgument);
  // A nonzero moment in the frozen tensor; a master there is fine.
  std::vector<float> bad = moments;
  bad[23] = 1e-3f;
  for (StateArrayKind array : {StateArrayKind::kExpAvg, StateArrayKind::kExpAvgSq}) {
    const absl::Status st = s->CheckWrite(array, {8, 30}, bad.data() + 8, "chunk 0.data");
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find("element 23 is in frozen tensor 2"), absl::string_view::npos)
        << st;
  }
  EXPECT_TRUE(s->CheckWrite(StateArrayKind::kMaster, {8, 30}, masters.data() + 8, "f").ok());
  EXPECT_TRUE(s->CheckWrite(StateArrayKind::kExpAvg, {8, 30}, moments.data() + 8, "f").ok());
  EXPECT_EQ(HashOf(*s), trained);
  // Writing moments over [8, 30) changes that range only and reads back.
  std::vector<float> before(kTotal), after(kTotal);
  ASSERT_TRUE(s->ReadArray(StateArrayKind::kExpAvg, all, before.data()).ok());
  ASSERT_TRUE(s->WriteArray(optimizer_.get(), StateArrayKind::kExpAvg, {8, 30}, moments.data() + 8).ok());
  ASSERT_TRUE(s->ReadArray(StateArrayKind::kExpAvg, all, after.data()).ok());
  for (uint64_t i = 0; i < kTotal; ++i) {
    EXPECT_EQ(after[i], i >= 8 && i < 30 ? moments[i] : before[i]) << i;
  }
  // The other moment and the masters did not move.
  std::vector<float> v(kTotal);
  ASSERT_TRUE(s->ReadArray(StateArrayKind::kExpAvgSq, all, v.data()).ok());
  EXPECT_NE(v[8], moments[8]);
  // Masters, frozen ones included.
  ASSERT_TRUE(s->WriteArray(optimizer_.get(), StateArrayKind::kMaster, {8, 30}, masters.data() + 8).ok());
  ASSERT_TRUE(s->ReadArray(StateArrayKind::kMaster, {8, 30}, after.data()).ok());
  EXPECT_TRUE(SameBits(after.data(), masters.data() + 8, 22));
  // SGD has no second moment.
  std::unique_ptr<ShardState> sgd = Create(MakeConfig(layout_, OptimizerKind::kSgdMomentum), all);
  EXPECT_EQ(sgd->checkpoint_arrays(), 2u);
  EXPECT_TRUE(sgd->CheckArray(StateArrayKind::kExpAvg, "array").ok());
  const absl::Status no_v = sgd->CheckArray(StateArrayKind::kExpAvgSq, "array");
  EXPECT_EQ(no_v.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(no_v.message().find("array:"), absl::string_view::npos) << no_v;
}

// A half-precision job's gathers read the half copy: a master write
// rewrites it.
TEST_F(ShardStateTest, MasterWritesRewriteTheHalfCopy) {
  const Layout layout = MakeLayout();
  std::unique_ptr<ShardState> s =
      Create(MakeConfig(layout, OptimizerKind::kAdamW, DType::kBf16), {0, kTotal});
  std::vector<float> values(kTotal, 0.0f);
  for (uint64_t i = 28; i < 34; ++i) values[i] = 1.0f + 0.001f * static_cast<float>(i);
  ASSERT_TRUE(s->WriteArray(optimizer_.get(), StateArrayKind::kMaster, {28, 34}, values.data() + 28).ok());
  std::vector<uint16_t> half(6);
  ASSERT_TRUE(s->Read(28, 6, DType::kBf16, half.data()).ok());
  for (uint64_t i = 0; i < 6; ++i) EXPECT_EQ(half[i], FloatToBf16(values[28 + i])) << i;
}

TEST_F(TrainedShardTest, TensorStepsInApartAndSet) {
  // Over owned [5, 40): a 5, b 3, c 4, d 4 after five commits.
  EXPECT_EQ(shard_->optimizer_steps(), 5u);
  EXPECT_EQ(Steps(shard_->TensorStepsIn(owned_)),
            (std::map<uint32_t, uint64_t>{{kA, 5}, {kB, 3}, {kC, 4}, {kD, 4}}));
  EXPECT_EQ(Steps(shard_->TensorStepsApart()),
            (std::map<uint32_t, uint64_t>{{kB, 3}, {kC, 4}, {kD, 4}}));
  // Sub-ranges: only the trainable tensors they overlap.
  EXPECT_EQ(Steps(shard_->TensorStepsIn({16, 30})),
            (std::map<uint32_t, uint64_t>{{kB, 3}, {kC, 4}}));
  EXPECT_TRUE(shard_->TensorStepsIn({20, 27}).empty());  // the frozen tensor
  EXPECT_TRUE(shard_->TensorStepsIn({17, 20}).empty());  // a gap
  // Only trainable tensors overlapping the owned range have a count.
  const absl::Status frozen = shard_->CheckTensorStep(kFrozen, "chunk 1.tensor_steps[0]");
  EXPECT_EQ(frozen.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(frozen.message().find("chunk 1.tensor_steps[0]: tensor 2 is frozen"),
            absl::string_view::npos)
      << frozen;
  std::unique_ptr<ShardState> inner = Create(config_, {13, 30});
  for (uint32_t outside : {kA, kD, 9u}) {
    const absl::Status st = inner->CheckTensorStep(outside, "f");
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << outside;
    EXPECT_NE(st.message().find("does not overlap"), absl::string_view::npos) << st;
  }
  EXPECT_TRUE(shard_->CheckTensorStep(kA, "f").ok());  // overlaps in part
  EXPECT_TRUE(shard_->CheckTensorStep(kD, "f").ok());
  // Set: the tensor's count, nothing else.
  const uint64_t before = HashOf(*shard_);
  shard_->SetTensorStep(kA, 2);
  shard_->SetTensorStep(kB, 5);
  EXPECT_NE(HashOf(*shard_), before);
  EXPECT_EQ(Steps(shard_->TensorStepsApart()),
            (std::map<uint32_t, uint64_t>{{kA, 2}, {kC, 4}, {kD, 4}}));
  EXPECT_EQ(shard_->optimizer_steps(), 5u);
}

}  // namespace
}  // namespace zeroshard
