// The step engine alone, with no job, rank table, replica or gRPC service:
// pushes from two ranks reduced, a two-phase step, gathers, state writes,
// against torch::optim::AdamW over the averaged gradient; and its refusals,
// each of which must leave every piece of its state (StepEngine::Hash) and
// the ledger as they were.

#include "server/step/step_engine.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "common/crc32c.h"
#include "common/job_spec.h"
#include "common/layout.h"
#include "gtest/gtest.h"
#include "server/ledger/memory_ledger.h"
#include "server/optimizer/optimizer.h"
#include "torch/torch.h"

namespace zeroshard {
namespace {

constexpr uint32_t kWorld = 2;
const std::vector<int64_t> kShapeA = {3, 5};  // 15 elements at [0, 15)
const std::vector<int64_t> kShapeB = {7};     // 7 elements at [16, 23)

JobConfig MakeConfig(uint32_t world = kWorld) {
  JobSettings s;
  s.job_id = "engine";
  s.stage = 2;
  s.world_size = world;
  s.precision = DType::kFp32;
  s.optimizer.lr = 0.01f;
  s.optimizer.weight_decay = 0.1f;
  s.daemons = {"127.0.0.1:1"};
  absl::StatusOr<Layout> layout =
      Layout::Create({{"a", kShapeA, DType::kFp32, 0}, {"b", kShapeB, DType::kFp32, 1}}, 16);
  EXPECT_TRUE(layout.ok()) << layout.status();
  absl::StatusOr<JobConfig> c = ParseJobSpec(ToJobSpec(s, *layout));
  EXPECT_TRUE(c.ok()) << c.status();
  return *std::move(c);
}

std::vector<float> Random(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d;
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

class StepEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    config_ = MakeConfig();
    optimizer_ = *ShardOptimizer::Create(ShardOptimizer::Options{});
    owned_ = config_.map.DaemonRange(0);
    MakeEngine(absl::ZeroDuration());
  }

  // A new engine whose staged pushes of the last micro-batch are held up
  // to `hold` (StepEngine::Options::reduction_hold).
  void MakeEngine(absl::Duration hold) {
    engine_.reset();
    StepEngine::Options o;
    o.ledger = &ledger_;
    o.optimizer = optimizer_.get();
    o.reduction_hold = hold;
    absl::StatusOr<std::unique_ptr<StepEngine>> e = StepEngine::Create(&config_, owned_, o);
    ASSERT_TRUE(e.ok()) << e.status();
    engine_ = *std::move(e);
  }

  // Rank `rank`'s gradient for step 1 over `ranges`, one staged chunk each
  // (the payloads read from `grad`, which must outlive the call; pulled
  // from push memory, or put into a slot), in one push due within
  // `timeout`; `current` stands for the sender check.
  absl::Status PushStaged(uint32_t rank, const std::vector<FlatRange>& ranges,
                          const std::vector<float>& grad,
                          absl::FunctionRef<absl::Status()> current, bool pulled = true,
                          absl::Duration timeout = absl::Seconds(10)) {
    std::vector<GradientChunkIn> chunks;
    for (const FlatRange& r : ranges) {
      GradientChunkIn c;
      c.step = 1;
      c.rank = rank;
      c.incarnation = 1;
      c.range = r;
      c.dtype = DTypeToProto(DType::kFp32);
      c.staged = true;
      c.pulled = pulled;
      c.payload = absl::string_view(reinterpret_cast<const char*>(grad.data() + r.begin),
                                    r.size() * sizeof(float));
      chunks.push_back(c);
    }
    return engine_->PushGradient(chunks, absl::Now() + timeout, current).status();
  }

  // Both ranks' gradients for step 1, zero in the gap between the tensors.
  std::vector<float> GapFree(uint64_t seed) {
    std::vector<float> g = Random(Total(), seed);
    for (uint64_t i = kShapeA[0] * kShapeA[1]; i < 16; ++i) g[i] = 0;
    return g;
  }
  // The squared norm of the ranks' mean gradient, as PrepareStep answers it.
  static double MeanNormSq(const std::vector<float>& g0, const std::vector<float>& g1) {
    double sum = 0;
    for (size_t i = 0; i < g0.size(); ++i) {
      const double m = static_cast<double>(g0[i] + g1[i]) / kWorld;
      sum += m * m;
    }
    return sum;
  }

  uint64_t Total() const { return config_.layout.total_elements(); }

  // The whole flat space (gaps zero) as one chunk.
  static void Fill(FlatRange range, const std::vector<float>& values, std::string* bytes,
                   uint32_t* crc) {
    bytes->assign(reinterpret_cast<const char*>(values.data()) + range.begin * sizeof(float),
                  range.size() * sizeof(float));
    *crc = Crc32c(bytes->data(), bytes->size());
  }

  absl::Status Init(const std::vector<float>& params) {
    std::string data;
    ParameterChunkIn c;
    c.range = {0, Total()};
    c.dtype = DTypeToProto(DType::kFp32);
    Fill({0, Total()}, params, &data, &c.crc32c);
    c.data = data;
    uint64_t elements = 0;
    return engine_->InitParameters({c}, &elements);
  }

  // Rank `rank`'s gradient for `step` over [0, total) as one chunk.
  absl::Status Push(uint64_t step, uint32_t rank, const std::vector<float>& grad,
                    bool corrupt_crc = false) {
    GradientChunkIn c;
    c.step = step;
    c.rank = rank;
    c.incarnation = 1;
    c.range = {0, Total()};
    c.dtype = DTypeToProto(DType::kFp32);
    uint32_t crc = 0;
    std::string payload;
    Fill({0, Total()}, grad, &payload, &crc);
    c.crc32c = corrupt_crc ? crc ^ 1 : crc;
    c.payload = payload;
    return engine_
        ->PushGradient({c}, absl::Now() + absl::Seconds(10), [] { return absl::OkStatus(); })
        .status();
  }

  absl::StatusOr<PrepareResult> Prepare(uint64_t step) {
    absl::MutexLock lock(&engine_->commit_lock());
    absl::StatusOr<StepEngine::Prepared> p = engine_->PrepareLocked(step);
    if (!p.ok()) return p.status();
    return engine_->FinishPrepare(false);
  }

  absl::StatusOr<CommitResult> Commit(uint64_t step, float lr) {
    CommitRequest r;
    r.step = step;
    r.lr = lr;
    absl::StatusOr<float> clip = engine_->CheckCommitFields(r, "");
    if (!clip.ok()) return clip.status();
    return engine_->Commit(r, *clip);
  }

  std::vector<float> Gather(uint64_t after_step) {
    std::vector<float> out(Total(), 0.0f);
    absl::Status s = engine_->Gather(
        after_step, {0, Total()}, DType::kFp32, absl::Now() + absl::Seconds(10), 1 << 20,
        [&](ParameterChunkOut& c) {
          std::memcpy(out.data() + c.range.begin, c.data.data(), c.data.size());
          return true;
        });
    EXPECT_TRUE(s.ok()) << s;
    return out;
  }

  uint64_t StateHash() const {
    uint64_t h = 0;
    engine_->Hash(h);
    return h;
  }

  JobConfig config_;
  MemoryLedger ledger_{0};
  std::unique_ptr<ShardOptimizer> optimizer_;
  FlatRange owned_;
  std::unique_ptr<StepEngine> engine_;
};

TEST_F(StepEngineTest, ThreeStepsMatchTorchAdamWOverTheAveragedGradient) {
  const std::vector<float> init = Random(Total(), 1);
  ASSERT_TRUE(Init(init).ok());

  // torch: the same two tensors, gaps excluded.
  const TensorPlacement& pa = config_.layout.tensors()[0];
  const TensorPlacement& pb = config_.layout.tensors()[1];
  auto slice = [](const std::vector<float>& v, const TensorPlacement& p,
                  const std::vector<int64_t>& shape) {
    return torch::from_blob(const_cast<float*>(v.data()) + p.offset, shape, torch::kFloat32)
        .clone();
  };
  torch::Tensor a = slice(init, pa, kShapeA).set_requires_grad(true);
  torch::Tensor b = slice(init, pb, kShapeB).set_requires_grad(true);
  torch::optim::AdamW opt({a, b}, torch::optim::AdamWOptions(0.01)
                                      .betas({0.9, 0.999})
                                      .eps(1e-8)
                                      .weight_decay(0.1));
  const float lrs[] = {0.01f, 0.02f, 0.005f};
  for (uint64_t step = 1; step <= 3; ++step) {
    std::vector<float> g0 = Random(Total(), 100 + step), g1 = Random(Total(), 200 + step);
    // The gaps between tensors carry zeros, as a trainer's flat buffer does.
    for (uint64_t i = pa.offset + pa.numel; i < pb.offset; ++i) g0[i] = g1[i] = 0;
    for (uint64_t i = pb.offset + pb.numel; i < Total(); ++i) g0[i] = g1[i] = 0;
    // Rank 1 first: the sum is in rank order whatever order pushes arrive in.
    ASSERT_TRUE(Push(step, 1, g1).ok());
    ASSERT_TRUE(Push(step, 0, g0).ok());
    absl::StatusOr<PrepareResult> prepared = Prepare(step);
    ASSERT_TRUE(prepared.ok()) << prepared.status();
    absl::StatusOr<CommitResult> committed = Commit(step, lrs[step - 1]);
    ASSERT_TRUE(committed.ok()) << committed.status();
    EXPECT_EQ(committed->committed_step, step);
    EXPECT_FALSE(committed->skipped);

    auto mean = [&](const TensorPlacement& p, const std::vector<int64_t>& shape) {
      return (slice(g0, p, shape) + slice(g1, p, shape)) / static_cast<float>(kWorld);
    };
    a.mutable_grad() = mean(pa, kShapeA);
    b.mutable_grad() = mean(pb, kShapeB);
    // The step's norm squared, as the engine answers it for the leader.
    const double norm_sq = (a.grad().square().sum() + b.grad().square().sum()).item<double>();
    EXPECT_NEAR(prepared->grad_sq_sum, norm_sq, 1e-5 * norm_sq);
    for (auto& group : opt.param_groups()) group.options().set_lr(lrs[step - 1]);
    opt.step();

    const std::vector<float> got = Gather(step);
    const torch::Tensor want_a = a.detach().flatten(), want_b = b.detach().flatten();
    for (uint64_t i = 0; i < pa.numel; ++i) {
      EXPECT_NEAR(got[pa.offset + i], want_a[i].item<float>(), 1e-6f) << "a[" << i << "]";
    }
    for (uint64_t i = 0; i < pb.numel; ++i) {
      EXPECT_NEAR(got[pb.offset + i], want_b[i].item<float>(), 1e-6f) << "b[" << i << "]";
    }
    EXPECT_EQ(engine_->committed_step(), step);
  }
}

// A step this copy holds by forward (a backup whose primary died before any
// copy committed it, which the ranks may push again): a push the fresh
// reduction would refuse (a chunk twice) throws nothing away, and a push
// that arrives while the step's commit reads the forwarded gradient finds
// the step prepared, instead of throwing it away under the commit.
TEST_F(StepEngineTest, AStepPreparedByForwardIsKeptFromARefusedPushAndDuringItsCommit) {
  const std::vector<float> g = GapFree(2);
  absl::Status during_commit = absl::UnknownError("no push during the commit");
  engine_.reset();
  StepEngine::Options o;
  o.ledger = &ledger_;
  o.optimizer = optimizer_.get();
  o.while_committing = [&] { during_commit = Push(1, 0, g); };
  absl::StatusOr<std::unique_ptr<StepEngine>> e = StepEngine::Create(&config_, owned_, o);
  ASSERT_TRUE(e.ok()) << e.status();
  engine_ = *std::move(e);
  ASSERT_TRUE(Init(Random(Total(), 1)).ok());
  {
    absl::MutexLock lock(&engine_->commit_lock());
    PrepareResult result;
    result.elements = engine_->owned_unpadded().size();
    result.loss_scale = 1.0f;
    ASSERT_TRUE(engine_
                    ->TakeForwardedStep(1, g.data() + engine_->owned_unpadded().begin, result, {})
                    .ok());
  }
  const uint64_t before = StateHash();
  GradientChunkIn c;
  c.step = 1;
  c.rank = 0;
  c.incarnation = 1;
  c.range = {0, Total()};
  c.dtype = DTypeToProto(DType::kFp32);
  std::string payload;
  Fill({0, Total()}, g, &payload, &c.crc32c);
  c.payload = payload;
  absl::Status s =
      engine_
          ->PushGradient({c, c}, absl::Now() + absl::Seconds(10), [] { return absl::OkStatus(); })
          .status();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_EQ(StateHash(), before);
  EXPECT_TRUE(engine_->prepared());
  absl::StatusOr<CommitResult> committed = Commit(1, 0.01f);
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_TRUE(absl::IsFailedPrecondition(during_commit)) << during_commit;
  EXPECT_FALSE(engine_->prepared());
}

// A rank whose new process joins drops what its old one left in the
// out-of-order buffer, and a push waiting for that room goes on at once.
TEST_F(StepEngineTest, ARankRejoiningWakesAPushWaitingForTheRoomItsOldProcessHeld) {
  config_ = MakeConfig(/*world=*/3);
  engine_.reset();
  StepEngine::Options o;
  o.ledger = &ledger_;
  o.optimizer = optimizer_.get();
  o.reduction_buffer_bytes = Total() * sizeof(float);  // one push waits there
  absl::StatusOr<std::unique_ptr<StepEngine>> e =
      StepEngine::Create(&config_, config_.map.DaemonRange(0), o);
  ASSERT_TRUE(e.ok()) << e.status();
  engine_ = *std::move(e);
  ASSERT_TRUE(Init(Random(Total(), 1)).ok());
  ASSERT_TRUE(Push(1, 1, GapFree(3)).ok());  // waits for rank 0's: buffered
  absl::Status waited = absl::UnknownError("not answered");
  absl::Time answered;
  std::thread rank2([&] {
    waited = Push(1, 2, GapFree(4));  // no room until rank 1's is dropped
    answered = absl::Now();
  });
  absl::SleepFor(absl::Milliseconds(300));  // rank 2's push waits for room by then
  const absl::Time joined = absl::Now();
  absl::StatusOr<uint32_t> dropped = engine_->JoinRank(1, [] { return uint64_t{2}; });
  rank2.join();
  ASSERT_TRUE(dropped.ok()) << dropped.status();
  EXPECT_EQ(*dropped, 1u);
  EXPECT_TRUE(waited.ok()) << waited;
  EXPECT_LT(answered - joined, absl::Seconds(2));
}

TEST_F(StepEngineTest, PrepareWithARankMissingIsRefusedAndChangesNothing) {
  ASSERT_TRUE(Init(Random(Total(), 1)).ok());
  ASSERT_TRUE(Push(1, 0, Random(Total(), 2)).ok());
  const uint64_t before = StateHash();
  absl::StatusOr<PrepareResult> prepared = Prepare(1);
  EXPECT_EQ(prepared.status().code(), absl::StatusCode::kFailedPrecondition) << prepared.status();
  EXPECT_EQ(StateHash(), before);
  EXPECT_FALSE(engine_->prepared());
  // Once the other rank pushes, the step goes through.
  ASSERT_TRUE(Push(1, 1, Random(Total(), 3)).ok());
  EXPECT_TRUE(Prepare(1).ok());
  EXPECT_TRUE(Commit(1, 0.01f).ok());
}

TEST_F(StepEngineTest, BadPushesAreRefusedAndChangeNothing) {
  ASSERT_TRUE(Init(Random(Total(), 1)).ok());
  const uint64_t before = StateHash();
  const auto ledger_before = ledger_.Snapshot();
  EXPECT_EQ(Push(1, 0, Random(Total(), 2), /*corrupt_crc=*/true).code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(Push(2, 0, Random(Total(), 2)).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(StateHash(), before);
  EXPECT_EQ(ledger_.Snapshot(), ledger_before);
  // The same push, well formed, is taken; a second copy of it is not summed.
  ASSERT_TRUE(Push(1, 0, Random(Total(), 2)).ok());
  const uint64_t after_one = StateHash();
  EXPECT_NE(after_one, before);
  EXPECT_EQ(Push(1, 0, Random(Total(), 2)).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(StateHash(), after_one);
}

TEST_F(StepEngineTest, BadCommitsAreRefusedAndChangeNothing) {
  ASSERT_TRUE(Init(Random(Total(), 1)).ok());
  ASSERT_TRUE(Push(1, 0, Random(Total(), 2)).ok());
  ASSERT_TRUE(Push(1, 1, Random(Total(), 3)).ok());
  // Not prepared yet.
  const uint64_t unprepared = StateHash();
  EXPECT_EQ(Commit(1, 0.01f).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(StateHash(), unprepared);
  ASSERT_TRUE(Prepare(1).ok());
  const uint64_t prepared = StateHash();
  EXPECT_EQ(Commit(1, -1.0f).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Commit(2, 0.01f).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(StateHash(), prepared);
  EXPECT_EQ(engine_->committed_step(), 0u);
  ASSERT_TRUE(Commit(1, 0.01f).ok());
  // A repeated commit answers the recorded one and steps nothing again.
  const uint64_t committed = StateHash();
  absl::StatusOr<CommitResult> again = Commit(1, 0.01f);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->committed_step, 1u);
  EXPECT_EQ(StateHash(), committed);
}

TEST_F(StepEngineTest, GatherOfAStepNotCommittedTimesOutWithNoLockHeld) {
  ASSERT_TRUE(Init(Random(Total(), 1)).ok());
  const absl::Time start = absl::Now();
  absl::Status s = engine_->Gather(1, {0, Total()}, DType::kFp32,
                                   start + absl::Milliseconds(200), 1 << 20, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(200));
  // Meanwhile the step proceeds: a push is not held up by a waiting gather.
  EXPECT_TRUE(Push(1, 0, Random(Total(), 2)).ok());
  // Outside the owned range: refused at once.
  s = engine_->Gather(0, {0, owned_.end + 64}, DType::kFp32, absl::Now() + absl::Seconds(1),
                      1 << 20, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
}

// Two ranges; each rank announces both in one staged push (as a client does
// for pulls from its push memory). Each range is summed once every rank's
// chunk of it is there, in one pass, and a push is answered only once all
// of its chunks are summed.
TEST_F(StepEngineTest, AStagedPushOfSeveralChunksIsAnsweredOnceEachRangeIsSummedInOnePass) {
  MakeEngine(absl::Seconds(2));
  ASSERT_TRUE(Init(Random(Total(), 1)).ok());
  const std::vector<FlatRange> ranges = {{0, 16}, {16, Total()}};
  const std::vector<float> g0 = GapFree(11), g1 = GapFree(12);
  std::atomic<bool> answered{false};
  absl::Status first;
  std::thread rank0([&] {
    first = PushStaged(0, ranges, g0, [] { return absl::OkStatus(); });
    answered = true;
  });
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_FALSE(answered);  // held: rank 1 has pushed nothing
  EXPECT_TRUE(PushStaged(1, {ranges[0]}, g1, [] { return absl::OkStatus(); }).ok());
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_FALSE(answered);  // its second range still waits for rank 1
  EXPECT_TRUE(PushStaged(1, {ranges[1]}, g1, [] { return absl::OkStatus(); }).ok());
  rank0.join();
  ASSERT_TRUE(first.ok()) << first;
  const StepEngine::ReductionCounts counts = engine_->Reductions();
  EXPECT_EQ(counts.passes, 2u);  // one per range, both ranks in each
  EXPECT_EQ(counts.contributions, 4u);
  absl::StatusOr<PrepareResult> prepared = Prepare(1);
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  const double want = MeanNormSq(g0, g1);
  EXPECT_NEAR(prepared->grad_sq_sum, want, 1e-6 * want);
}

// Several chunks put into one staging slot together are applied all or
// none, as one batch: not held, whatever waits for other ranks.
TEST_F(StepEngineTest, SeveralChunksPutIntoOneSlotAreAppliedAtOnce) {
  MakeEngine(absl::Hours(1));
  ASSERT_TRUE(Init(Random(Total(), 1)).ok());
  const std::vector<FlatRange> ranges = {{0, 16}, {16, Total()}};
  const std::vector<float> g0 = GapFree(31);
  const absl::Time start = absl::Now();
  // Due in three hours: room for the hold (a push is held only when its
  // deadline leaves twice the hold).
  ASSERT_TRUE(PushStaged(0, ranges, g0, [] { return absl::OkStatus(); }, /*pulled=*/false,
                         absl::Hours(3))
                  .ok());
  // Not held: held, it would wait the hour.
  EXPECT_LT(absl::Now() - start, absl::Minutes(1));
  const StepEngine::ReductionCounts counts = engine_->Reductions();
  EXPECT_EQ(counts.passes, 2u);  // next in order in both ranges: summed at once
  EXPECT_EQ(counts.contributions, 2u);
}

// A staged push of three chunks whose sender stops being current while its
// second chunk is held: the first chunk's range was summed and stays so,
// the second and third are let go unsummed (the error says which), and
// nothing reads the push's payloads once it has returned.
TEST_F(StepEngineTest, AStagedPushOfSeveralChunksThatFailsPartWayLetsGoOfTheRest) {
  MakeEngine(absl::Seconds(2));
  ASSERT_TRUE(Init(Random(Total(), 1)).ok());
  const std::vector<FlatRange> ranges = {{0, 8}, {8, 16}, {16, Total()}};
  std::vector<float> g0 = GapFree(21);
  const std::vector<float> g1 = GapFree(22);
  const std::vector<float> kept0 = g0;
  std::atomic<bool> fenced{false};
  absl::Status first;
  std::thread rank0([&] {
    first = PushStaged(0, ranges, g0, [&] {
      return fenced ? absl::FailedPreconditionError("rank 0 rejoined") : absl::OkStatus();
    });
  });
  absl::SleepFor(absl::Milliseconds(5));
  // Rank 1's first range completes rank 0's: summed.
  EXPECT_TRUE(PushStaged(1, {ranges[0]}, g1, [] { return absl::OkStatus(); }).ok());
  fenced = true;
  rank0.join();
  ASSERT_FALSE(first.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(first)) << first;
  EXPECT_NE(first.message().find("chunk 1 of 3"), std::string::npos) << first;
  EXPECT_NE(first.message().find("may have been applied"), std::string::npos) << first;
  EXPECT_EQ(engine_->Reductions().passes, 1u);
  // Rank 0's payloads are gone: a pass that read them would sum NaN.
  std::fill(g0.begin(), g0.end(), std::numeric_limits<float>::quiet_NaN());
  // Rank 1's other ranges wait (held, then buffered): rank 0's are not
  // there; rank 0's next process pushes them again, which completes them.
  ASSERT_TRUE(PushStaged(1, {ranges[1], ranges[2]}, g1, [] { return absl::OkStatus(); }).ok());
  EXPECT_EQ(engine_->Reductions().passes, 1u);
  ASSERT_TRUE(PushStaged(0, {ranges[1], ranges[2]}, kept0, [] { return absl::OkStatus(); }).ok());
  const StepEngine::ReductionCounts counts = engine_->Reductions();
  EXPECT_EQ(counts.passes, 3u);
  EXPECT_EQ(counts.contributions, 6u);
  absl::StatusOr<PrepareResult> prepared = Prepare(1);
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  EXPECT_FALSE(prepared->found_inf_nan);
  const double want = MeanNormSq(kept0, g1);
  EXPECT_NEAR(prepared->grad_sq_sum, want, 1e-6 * want);
}

TEST(StepEngineLedger, AFootprintOverTheLimitAllocatesNothing) {
  JobConfig config = MakeConfig();
  std::unique_ptr<ShardOptimizer> optimizer = *ShardOptimizer::Create(ShardOptimizer::Options{});
  MemoryLedger ledger(64);  // far below the job's model states
  StepEngine::Options o;
  o.ledger = &ledger;
  o.optimizer = optimizer.get();
  absl::StatusOr<std::unique_ptr<StepEngine>> e =
      StepEngine::Create(&config, config.map.DaemonRange(0), o);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kResourceExhausted) << e.status();
  EXPECT_EQ(ledger.total(), 0u);
  EXPECT_TRUE(ledger.Snapshot().empty());
}

}  // namespace
}  // namespace zeroshard
