// Two daemons and four trainer ranks (threads, each with its own Client)
// train 20 steps in ZeRO stages 1, 2 and 3: fp32, AdamW with weight decay,
// gradient-norm clipping, on a layout with a tensor not divisible by N_d and
// one layer much larger than the others. Each rank's gradient depends on the
// parameters it gathered, so a wrong gather shows. At every step, every rank's
// parameters must equal, bit for bit, a single-process reference doing the
// same math: the rank gradients summed in rank order, divided by N_d, the norm
// combined from per-daemon partial sums, clipped, and one AdamW step. Two
// ranks lend their gradient buffers (BufferUse::kBorrow), two have them copied.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "gtest/gtest.h"
#include "server/daemon.h"
#include "server/optimizer/optimizer.h"
#include "server/testing/daemon_fixture.h"

namespace zeroshard {
namespace {

constexpr uint32_t kWorld = 4;
constexpr int kDaemons = 2;
constexpr int kSteps = 20;
constexpr float kMaxGradNorm = 25.0f;
constexpr float kBeta1 = 0.9f, kBeta2 = 0.999f, kEps = 1e-8f, kWeightDecay = 0.05f;

Layout TestLayout() {
  return *Layout::Create({{"embed", {333, 17}, DType::kFp32, 0},  // 5661: not divisible by 4
                          {"l1.w", {17, 17}, DType::kFp32, 1},
                          {"l1.b", {17}, DType::kFp32, 1},
                          {"big.w", {401, 123}, DType::kFp32, 2},  // the large layer
                          {"big.b", {123}, DType::kFp32, 2},
                          {"l3.w", {17, 5}, DType::kFp32, 3},
                          {"head", {7}, DType::kFp32, 4}});
}

float LearningRate(int step) { return 1e-2f * (1.0f + 0.25f * static_cast<float>(step % 4)); }

uint32_t Mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return static_cast<uint32_t>(x);
}

// Rank `rank`'s gradient at flat index i of step `step`, given the parameter
// it holds there.
float Gradient(float param, uint64_t i, int step, uint32_t rank) {
  const float noise =
      static_cast<float>(static_cast<int>(Mix(i * 131 + step * 7919 + rank * 104729) % 2001) -
                         1000) *
      1e-4f;
  return param * (0.5f + 0.1f * static_cast<float>(rank)) + noise;
}

std::vector<bool> RealMask(const Layout& layout) {
  std::vector<bool> real(layout.total_elements(), false);
  for (const TensorPlacement& t : layout.tensors()) {
    std::fill(real.begin() + t.offset, real.begin() + t.offset + t.numel, true);
  }
  return real;
}

struct Reference {
  std::vector<std::vector<float>> params;  // [step]: after `step` (0: initial)
  std::vector<float> norm, clip;           // [step]
};

// The same training in one process. Gap elements hold zeros (the client
// sends them as zeros), so they stay zero.
Reference ComputeReference(const Layout& layout, const PartitionMap& map,
                           const std::vector<float>& init) {
  const uint64_t n = layout.total_elements();
  const std::vector<bool> real = RealMask(layout);
  auto optimizer = *ShardOptimizer::Create({});
  Reference ref;
  ref.params.push_back(init);
  ref.norm.push_back(0);
  ref.clip.push_back(0);
  std::vector<float> p = init, m(n, 0.0f), v(n, 0.0f), sum(n);
  for (int step = 1; step <= kSteps; ++step) {
    for (uint64_t i = 0; i < n; ++i) {
      if (!real[i]) {
        sum[i] = 0.0f;
        continue;
      }
      float acc = Gradient(p[i], i, step, 0);
      for (uint32_t r = 1; r < kWorld; ++r) acc += Gradient(p[i], i, step, r);
      sum[i] = acc;
    }
    // Each daemon's partial sum of squares, combined in daemon order.
    double sum_sq = 0;
    for (uint32_t d = 0; d < kDaemons; ++d) {
      const FlatRange dr = map.DaemonRange(d).Intersect({0, n});
      sum_sq += optimizer->SumSquaresAndFinite(sum.data() + dr.begin, dr.size(), 1.0f / kWorld)
                    .sum_sq;
    }
    const float norm = static_cast<float>(std::sqrt(sum_sq));
    const float clip = std::min(1.0f, kMaxGradNorm / (norm + 1e-6f));
    StepHyperParams hp;
    hp.kind = OptimizerKind::kAdamW;
    hp.lr = LearningRate(step);
    hp.beta1 = kBeta1;
    hp.beta2 = kBeta2;
    hp.eps = kEps;
    hp.weight_decay = kWeightDecay;
    hp.step = step;
    hp.grad_scale = static_cast<double>(clip) / (static_cast<double>(kWorld) * 1.0);
    ShardBuffers b{p.data(), sum.data(), m.data(), v.data(), nullptr, DType::kFp32, n};
    EXPECT_TRUE(optimizer->Step(hp, b).ok());
    ref.params.push_back(p);
    ref.norm.push_back(norm);
    ref.clip.push_back(clip);
  }
  return ref;
}

// Ranks 0 and 1 lend their gradient buffers to the client (sent without a
// copy where a push covers whole buckets), ranks 2 and 3 have them copied.
BufferUse BufferUseOf(uint32_t rank) { return rank < 2 ? BufferUse::kBorrow : BufferUse::kCopy; }

// Pushes `grad` (the whole flat gradient) split the way `rank` likes: ranks
// need not agree on the split.
absl::Status PushAll(Client& client, uint32_t rank, const std::vector<float>& grad) {
  const Layout& layout = client.layout();
  const uint64_t n = grad.size();
  std::vector<FlatRange> ranges;
  if (rank == 0) {
    ranges.push_back({0, n});
  } else if (rank == 1) {
    for (auto it = layout.layers().rbegin(); it != layout.layers().rend(); ++it) {
      ranges.push_back(*layout.LayerRange(*it));
    }
  } else if (rank == 2) {
    for (const TensorPlacement& t : layout.tensors()) ranges.push_back(t.range());
  } else {
    ranges = {{n / 3, n}, {0, n / 3}};
  }
  std::vector<PushTicket> tickets;
  for (const FlatRange& r : ranges) {
    absl::StatusOr<PushTicket> t =
        client.PushGradients(r, grad.data() + r.begin, DType::kFp32, 0, BufferUseOf(rank));
    if (!t.ok()) return t.status();
    tickets.push_back(*t);
  }
  // Tickets of full buckets complete; those of a bucket shared with a later
  // range complete once it is pushed.
  for (const PushTicket& t : tickets) {
    if (absl::Status s = t.Wait(absl::Now() + absl::Seconds(30)); !s.ok()) return s;
  }
  return absl::OkStatus();
}

class IntegrationTest : public ::testing::TestWithParam<uint32_t> {};

TEST_P(IntegrationTest, FourRanksTwoDaemonsMatchOneProcessBitForBit) {
  const uint32_t stage = GetParam();
  std::vector<std::unique_ptr<Daemon>> daemons;
  std::vector<std::string> addresses;
  for (int i = 0; i < kDaemons; ++i) {
    daemons.push_back(testing::StartDaemon());
    addresses.push_back(daemons.back()->address());
  }
  const Layout layout = TestLayout();
  const uint64_t n = layout.total_elements();
  const PartitionMap map = *PartitionMap::Create(n, kWorld, kDaemons);
  const std::vector<bool> real = RealMask(layout);
  std::vector<float> init(n, 0.0f);
  for (uint64_t i = 0; i < n; ++i) {
    if (real[i]) init[i] = static_cast<float>(Mix(i) % 1000) / 1000.0f - 0.5f;
  }
  const Reference ref = ComputeReference(layout, map, init);
  int clipped = 0;
  for (int s = 1; s <= kSteps; ++s) clipped += ref.clip[s] < 1.0f;
  ASSERT_GT(clipped, 0) << "the test should exercise clipping";

  std::vector<std::vector<float>> final_params(kWorld);
  std::atomic<int> failures{0};
  auto rank_main = [&](uint32_t rank) {
    auto fail = [&](const std::string& what) {
      ADD_FAILURE() << "stage " << stage << " rank " << rank << ": " << what;
      ++failures;
    };
    ClientConfig config;
    config.daemons = addresses;
    config.job_id = absl::StrCat("integration-s", stage);
    config.rank = rank;
    config.world_size = kWorld;
    config.stage = stage;
    config.precision = DType::kFp32;
    config.bucket_bytes = 16 << 10;
    config.optimizer.lr = LearningRate(1);
    config.optimizer.beta1 = kBeta1;
    config.optimizer.beta2 = kBeta2;
    config.optimizer.eps = kEps;
    config.optimizer.weight_decay = kWeightDecay;
    config.max_grad_norm = kMaxGradNorm;
    config.rpc_timeout = absl::Seconds(20);
    config.step_timeout = absl::Seconds(40);
    config.io_threads = 2;
    // Before the client: a borrowed `grad` must outlive the sends, which the
    // client's destructor waits for.
    std::vector<float> params(n), backward(n), grad(n);
    absl::StatusOr<std::unique_ptr<Client>> created = Client::Create(config);
    if (!created.ok()) return fail(created.status().ToString());
    Client& client = **created;
    // Rank 0 uploads; the others pass their identical copy or nothing.
    absl::Status s = client.RegisterModel(layout, rank % 2 == 0 ? init.data() : nullptr);
    if (!s.ok()) return fail(s.ToString());
    for (int step = 1; step <= kSteps; ++step) {
      const std::vector<float>& expected = ref.params[step - 1];
      if (stage < 3) {
        s = client.GatherAll(params.data(), DType::kFp32);
        if (!s.ok()) return fail(s.ToString());
        for (uint64_t i = 0; i < n; ++i) grad[i] = Gradient(params[i], i, step, rank);
        s = PushAll(client, rank, grad);
        if (!s.ok()) return fail(s.ToString());
      } else {
        for (uint32_t layer : layout.layers()) {
          s = client.Gather(layer, params.data() + layout.LayerRange(layer)->begin);
          if (!s.ok()) return fail(s.ToString());
        }
        for (auto it = layout.layers().rbegin(); it != layout.layers().rend(); ++it) {
          const FlatRange r = *layout.LayerRange(*it);
          s = client.Gather(*it, backward.data() + r.begin);
          if (!s.ok()) return fail(s.ToString());
          for (uint64_t i = r.begin; i < r.end; ++i) {
            grad[i] = Gradient(backward[i], i, step, rank);
          }
          absl::StatusOr<PushTicket> t = client.PushGradients(
              r, grad.data() + r.begin, DType::kFp32, 0, BufferUseOf(rank));
          if (!t.ok()) return fail(t.status().ToString());
        }
        if (std::memcmp(backward.data(), expected.data(), n * 4) != 0) {
          return fail(absl::StrCat("step ", step, ": backward gathers differ from the reference"));
        }
      }
      if (std::memcmp(params.data(), expected.data(), n * 4) != 0) {
        return fail(absl::StrCat("step ", step, ": parameters differ from the reference"));
      }
      absl::StatusOr<StepResult> r = client.Step(LearningRate(step));
      if (!r.ok()) return fail(r.status().ToString());
      EXPECT_EQ(r->step, static_cast<uint64_t>(step));
      EXPECT_FALSE(r->skipped);
      if (rank == 0) {
        EXPECT_TRUE(r->have_norm);
      }
      if (r->have_norm) {
        EXPECT_EQ(r->grad_norm, ref.norm[step]) << "rank " << rank << " step " << step;
        EXPECT_EQ(r->clip_coef, ref.clip[step]) << "rank " << rank << " step " << step;
      }
    }
    final_params[rank].resize(n);
    s = client.GatherAll(final_params[rank].data(), DType::kFp32);
    if (!s.ok()) return fail(s.ToString());
    s = client.Leave();
    if (!s.ok()) return fail(s.ToString());
  };
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < kWorld; ++r) threads.emplace_back(rank_main, r);
  for (auto& t : threads) t.join();
  ASSERT_EQ(failures.load(), 0);
  for (uint32_t r = 0; r < kWorld; ++r) {
    ASSERT_EQ(0, std::memcmp(final_params[r].data(), ref.params[kSteps].data(), n * 4))
        << "rank " << r;
  }
  // Training moved the parameters.
  EXPECT_NE(0, std::memcmp(ref.params[kSteps].data(), init.data(), n * 4));
}

INSTANTIATE_TEST_SUITE_P(Stages, IntegrationTest, ::testing::Values(1u, 2u, 3u),
                         [](const ::testing::TestParamInfo<uint32_t>& info) {
                           return absl::StrCat("Stage", info.param);
                         });

}  // namespace
}  // namespace zeroshard
