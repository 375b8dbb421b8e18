// The step engine's reduction under concurrent pushes: four ranks, two
// micro-batches, eight ranges, each rank's pushes split over two threads
// in a shuffled order, the last micro-batch staged and held. Each range's
// pass runs with the reduction lock released while the other ranges' pushes
// register, so the order of arrivals differs from run to run; the reduced
// gradient must still be the in-order sum, bit for bit, every step. Each
// push's payload is its own allocation, overwritten with NaN and freed as
// soon as the push returns: a pass that read it later would show in the
// sum (and to ASan).

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "common/crc32c.h"
#include "common/job_spec.h"
#include "common/layout.h"
#include "common/protocol.h"
#include "gtest/gtest.h"
#include "server/ledger/memory_ledger.h"
#include "server/optimizer/optimizer.h"
#include "server/step/step_engine.h"

namespace zeroshard {
namespace {

constexpr uint32_t kWorld = 4;
constexpr uint32_t kMicroBatches = 2;
// Ranges large enough that a pass takes a while, so that other pushes
// arrive during it.
constexpr uint64_t kRange = 1 << 16;
constexpr uint64_t kElements = 8 * kRange;

JobConfig MakeConfig() {
  JobSettings s;
  s.job_id = "stress";
  s.stage = 2;
  s.world_size = kWorld;
  s.precision = DType::kFp32;
  s.daemons = {"127.0.0.1:1"};
  absl::StatusOr<Layout> layout =
      Layout::Create({{"w", {static_cast<int64_t>(kElements)}, DType::kFp32, 0}}, 16);
  EXPECT_TRUE(layout.ok()) << layout.status();
  absl::StatusOr<JobConfig> c = ParseJobSpec(ToJobSpec(s, *layout));
  EXPECT_TRUE(c.ok()) << c.status();
  return *std::move(c);
}

// Contribution (rank, micro-batch) of a step.
std::vector<float> Gradient(uint64_t step, uint32_t rank, uint32_t mb) {
  std::mt19937_64 rng(step * 1000 + rank * 10 + mb);
  std::normal_distribution<float> d;
  std::vector<float> v(kElements);
  for (float& x : v) x = d(rng);
  return v;
}

TEST(StepEngineStress, ConcurrentHeldAndStreamedPushesSumInOrder) {
  const JobConfig config = MakeConfig();
  ShardOptimizer::Options oo;
  oo.num_threads = 2;
  std::unique_ptr<ShardOptimizer> optimizer = *ShardOptimizer::Create(oo);
  MemoryLedger ledger(0);
  StepEngine::Options o;
  o.ledger = &ledger;
  o.optimizer = optimizer.get();
  o.reduction_hold = absl::Milliseconds(20);
  const FlatRange owned = config.map.DaemonRange(0);
  absl::StatusOr<std::unique_ptr<StepEngine>> created = StepEngine::Create(&config, owned, o);
  ASSERT_TRUE(created.ok()) << created.status();
  StepEngine& engine = **created;
  ASSERT_EQ(owned.begin, 0u);
  ASSERT_LE(kElements, owned.size());

  std::mt19937 shuffle_rng(7);
  for (uint64_t step = 1; step <= 3; ++step) {
    std::vector<std::vector<float>> grads;  // by order: rank * kMicroBatches + mb
    for (uint32_t r = 0; r < kWorld; ++r) {
      for (uint32_t mb = 0; mb < kMicroBatches; ++mb) grads.push_back(Gradient(step, r, mb));
    }
    std::vector<std::thread> threads;
    std::vector<absl::Status> errors(kWorld * 2);
    for (uint32_t r = 0; r < kWorld; ++r) {
      for (uint32_t half = 0; half < 2; ++half) {
        std::vector<uint64_t> ranges;
        for (uint64_t b = half * kRange; b < kElements; b += 2 * kRange) ranges.push_back(b);
        std::shuffle(ranges.begin(), ranges.end(), shuffle_rng);
        threads.emplace_back([&, r, half, ranges] {
          for (uint32_t mb = 0; mb < kMicroBatches; ++mb) {
            for (uint64_t b : ranges) {
              const std::vector<float>& g = grads[r * kMicroBatches + mb];
              auto payload = std::make_unique<std::vector<float>>(g.begin() + b,
                                                                  g.begin() + b + kRange);
              GradientChunkIn c;
              c.step = step;
              c.rank = r;
              c.incarnation = 1;
              c.range = {b, b + kRange};
              c.dtype = DTypeToProto(DType::kFp32);
              c.micro_batch = mb;
              c.micro_batches = kMicroBatches;
              c.staged = mb + 1 == kMicroBatches;  // the last one may be held
              c.payload = {reinterpret_cast<const char*>(payload->data()),
                           kRange * sizeof(float)};
              c.crc32c = Crc32c(c.payload.data(), c.payload.size());
              absl::StatusOr<PushResult> p = engine.PushGradient(
                  {c}, absl::Now() + absl::Seconds(30), [] { return absl::OkStatus(); });
              std::fill(payload->begin(), payload->end(), std::nanf(""));
              payload.reset();
              if (!p.ok()) {
                errors[r * 2 + half] = p.status();
                return;
              }
            }
          }
        });
      }
    }
    for (std::thread& t : threads) t.join();
    for (const absl::Status& e : errors) ASSERT_TRUE(e.ok()) << e;

    std::vector<float> want(kElements);
    for (uint64_t i = 0; i < kElements; ++i) {
      float s = grads[0][i];
      for (size_t k = 1; k < grads.size(); ++k) s = s + grads[k][i];
      want[i] = s;
    }
    {
      absl::MutexLock lock(&engine.commit_lock());
      absl::StatusOr<StepEngine::Prepared> p = engine.PrepareLocked(step);
      ASSERT_TRUE(p.ok()) << p.status();
      ASSERT_EQ(std::memcmp(p->grad, want.data(), kElements * sizeof(float)), 0) << "step " << step;
      engine.FinishPrepare(false);
    }
    CommitRequest r;
    r.step = step;
    r.lr = 1e-3f;
    absl::StatusOr<float> clip = engine.CheckCommitFields(r, "");
    ASSERT_TRUE(clip.ok()) << clip.status();
    absl::StatusOr<CommitResult> committed = engine.Commit(r, *clip);
    ASSERT_TRUE(committed.ok()) << committed.status();
    EXPECT_EQ(engine.Reductions().contributions, step * kWorld * kMicroBatches * 8);
  }
  // Nothing of the steps is left booked beyond the engine's own arrays.
  const uint64_t arrays = ledger.total();
  created->reset();
  EXPECT_GT(arrays, 0u);
  EXPECT_EQ(ledger.total(), 0u);
}

}  // namespace
}  // namespace zeroshard
