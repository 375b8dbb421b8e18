// Two daemons and four trainer ranks (threads, each with its own Client)
// train 20 steps in ZeRO stages 1, 2 and 3: fp32, AdamW with weight decay,
// gradient-norm clipping, on a layout with a tensor not divisible by N_d and
// one layer much larger than the others. Each rank's gradient depends on the
// parameters it gathered, so a wrong gather shows. At every step, every rank's
// parameters must equal, bit for bit, a single-process reference doing the
// same math: the rank gradients summed in rank order, divided by N_d, the norm
// combined from per-daemon partial sums, clipped, and one AdamW step. Two
// ranks lend their gradient buffers (BufferUse::kBorrow), two have them copied.
// The same training runs over the streaming RPCs and over the "inproc" bulk
// transport (no UCX needed), and over "inproc" and "ucx" with the final
// parameters compared bit for bit (the UCX run skips when UCX cannot
// initialise).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <tuple>
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

struct TrainRun {
  uint32_t stage = 2;
  std::string transport = "stream";  // ClientConfig.transport; daemons serve it if bulk
  std::string ucx_tls;
};

// Starts the daemons of `run` (appending them to `daemons`); false with
// *skip set when the bulk transport cannot be served.
bool StartDaemons(const TrainRun& run, std::vector<std::unique_ptr<Daemon>>* daemons,
                  std::vector<std::string>* addresses, std::string* skip) {
  for (int i = 0; i < kDaemons; ++i) {
    DaemonOptions o;
    o.bulk_transport = run.transport == "stream" ? "inproc" : run.transport;
    o.ucx_tls = run.ucx_tls;
    // Loopback, and every peer is this process: UCX keys may go out over tcp.
    o.ucx_trust_peers = true;
    absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
    if (!d.ok()) {
      ADD_FAILURE() << d.status();
      return false;
    }
    if ((*d)->bulk_transport() == nullptr) {
      *skip = absl::StrCat("the daemon cannot serve ", o.bulk_transport);
      return false;
    }
    addresses->push_back((*d)->address());
    daemons->push_back(*std::move(d));
  }
  return true;
}

ClientConfig RankConfig(const TrainRun& run, const std::vector<std::string>& addresses,
                        uint32_t rank) {
  ClientConfig config;
  config.job_token = testing::kTestToken;
  config.daemons = addresses;
  config.job_id = absl::StrCat("integration-s", run.stage, "-", run.transport);
  config.rank = rank;
  config.world_size = kWorld;
  config.stage = run.stage;
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
  config.transport = run.transport;
  config.ucx_tls = run.ucx_tls;
  return config;
}

// One training step of `rank` (gathers, gradient, pushes); checks the
// parameters it gathered against `expected`.
absl::Status RankStep(Client& client, const Layout& layout, uint32_t rank, int step,
                      const std::vector<float>& expected, std::vector<float>* params,
                      std::vector<float>* backward, std::vector<float>* grad) {
  const uint64_t n = layout.total_elements();
  if (client.config().stage < 3) {
    if (absl::Status s = client.GatherAll(params->data(), DType::kFp32); !s.ok()) return s;
    for (uint64_t i = 0; i < n; ++i) (*grad)[i] = Gradient((*params)[i], i, step, rank);
    if (absl::Status s = PushAll(client, rank, *grad); !s.ok()) return s;
  } else {
    for (uint32_t layer : layout.layers()) {
      absl::Status s = client.Gather(layer, params->data() + layout.LayerRange(layer)->begin);
      if (!s.ok()) return s;
    }
    for (auto it = layout.layers().rbegin(); it != layout.layers().rend(); ++it) {
      const FlatRange r = *layout.LayerRange(*it);
      if (absl::Status s = client.Gather(*it, backward->data() + r.begin); !s.ok()) return s;
      for (uint64_t i = r.begin; i < r.end; ++i) {
        (*grad)[i] = Gradient((*backward)[i], i, step, rank);
      }
      absl::StatusOr<PushTicket> t = client.PushGradients(r, grad->data() + r.begin,
                                                          DType::kFp32, 0, BufferUseOf(rank));
      if (!t.ok()) return t.status();
    }
    if (std::memcmp(backward->data(), expected.data(), n * 4) != 0) {
      return absl::InternalError(
          absl::StrCat("step ", step, ": backward gathers differ from the reference"));
    }
  }
  if (std::memcmp(params->data(), expected.data(), n * 4) != 0) {
    return absl::InternalError(
        absl::StrCat("step ", step, ": parameters differ from the reference"));
  }
  return absl::OkStatus();
}

// Trains kSteps over `run` with kWorld ranks (threads) and kDaemons daemons,
// checking every step against `ref`; returns each rank's final parameters,
// or nothing with *skip set when the transport is not available.
std::vector<std::vector<float>> Train(const TrainRun& run, const Layout& layout,
                                      const std::vector<float>& init, const Reference& ref,
                                      std::string* skip) {
  std::vector<std::unique_ptr<Daemon>> daemons;
  std::vector<std::string> addresses;
  if (!StartDaemons(run, &daemons, &addresses, skip)) return {};
  const uint64_t n = layout.total_elements();
  std::vector<std::vector<float>> final_params(kWorld);
  std::atomic<int> unavailable{0};
  auto rank_main = [&](uint32_t rank) {
    auto fail = [&](const std::string& what) {
      ADD_FAILURE() << "stage " << run.stage << " " << run.transport << " rank " << rank << ": "
                    << what;
    };
    // Before the client: a borrowed `grad` must outlive the sends, which the
    // client's destructor waits for.
    std::vector<float> params(n), backward(n), grad(n);
    absl::StatusOr<std::unique_ptr<Client>> created =
        Client::Create(RankConfig(run, addresses, rank));
    if (absl::IsUnavailable(created.status())) return void(++unavailable);
    if (!created.ok()) return fail(created.status().ToString());
    Client& client = **created;
    // Rank 0 uploads; the others pass their identical copy or nothing.
    absl::Status s = client.RegisterModel(layout, rank % 2 == 0 ? init.data() : nullptr);
    if (!s.ok()) return fail(s.ToString());
    for (int step = 1; step <= kSteps; ++step) {
      s = RankStep(client, layout, rank, step, ref.params[step - 1], &params, &backward, &grad);
      if (!s.ok()) return fail(s.ToString());
      absl::StatusOr<StepResult> r = client.Step(LearningRate(step));
      if (!r.ok()) return fail(r.status().ToString());
      EXPECT_EQ(r->step, static_cast<uint64_t>(step));
      EXPECT_FALSE(r->skipped);
      EXPECT_TRUE(r->have_norm);
      EXPECT_EQ(r->grad_norm, ref.norm[step]) << "rank " << rank << " step " << step;
      EXPECT_EQ(r->clip_coef, ref.clip[step]) << "rank " << rank << " step " << step;
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
  if (unavailable > 0) {
    *skip = absl::StrCat("the client cannot create transport ", run.transport);
    return {};
  }
  return final_params;
}

struct Fixture {
  Fixture() : layout(TestLayout()), map(*PartitionMap::Create(layout.total_elements(), kWorld,
                                                              kDaemons)) {
    const std::vector<bool> real = RealMask(layout);
    init.assign(layout.total_elements(), 0.0f);
    for (uint64_t i = 0; i < init.size(); ++i) {
      if (real[i]) init[i] = static_cast<float>(Mix(i) % 1000) / 1000.0f - 0.5f;
    }
    ref = ComputeReference(layout, map, init);
  }
  Layout layout;
  PartitionMap map;
  std::vector<float> init;
  Reference ref;
};

class IntegrationTest : public ::testing::TestWithParam<std::tuple<uint32_t, const char*>> {};

TEST_P(IntegrationTest, FourRanksTwoDaemonsMatchOneProcessBitForBit) {
  const Fixture f;
  int clipped = 0;
  for (int s = 1; s <= kSteps; ++s) clipped += f.ref.clip[s] < 1.0f;
  ASSERT_GT(clipped, 0) << "the test should exercise clipping";
  TrainRun run;
  run.stage = std::get<0>(GetParam());
  run.transport = std::get<1>(GetParam());
  std::string skip;
  const std::vector<std::vector<float>> final_params = Train(run, f.layout, f.init, f.ref, &skip);
  ASSERT_TRUE(skip.empty()) << skip;
  ASSERT_FALSE(HasFailure());
  const uint64_t n = f.layout.total_elements();
  for (uint32_t r = 0; r < kWorld; ++r) {
    ASSERT_EQ(0, std::memcmp(final_params[r].data(), f.ref.params[kSteps].data(), n * 4))
        << "rank " << r;
  }
  // Training moved the parameters.
  EXPECT_NE(0, std::memcmp(f.ref.params[kSteps].data(), f.init.data(), n * 4));
}

INSTANTIATE_TEST_SUITE_P(
    StagesAndDataPaths, IntegrationTest,
    ::testing::Combine(::testing::Values(1u, 2u, 3u), ::testing::Values("stream", "inproc")),
    [](const ::testing::TestParamInfo<std::tuple<uint32_t, const char*>>& info) {
      return absl::StrCat("Stage", std::get<0>(info.param), "_", std::get<1>(info.param));
    });

// The same training over the inproc bulk transport and over UCX (tcp) ends
// in bit-identical parameters on every rank.
TEST(IntegrationTest, InprocAndUcxGiveBitIdenticalParameters) {
  const Fixture f;
  const uint64_t n = f.layout.total_elements();
  for (uint32_t stage : {2u, 3u}) {
    TrainRun inproc;
    inproc.stage = stage;
    inproc.transport = "inproc";
    TrainRun ucx = inproc;
    ucx.transport = "ucx";
    ucx.ucx_tls = "tcp";
    std::string skip;
    const std::vector<std::vector<float>> a = Train(inproc, f.layout, f.init, f.ref, &skip);
    ASSERT_TRUE(skip.empty()) << skip;
    ASSERT_FALSE(HasFailure());
    const std::vector<std::vector<float>> b = Train(ucx, f.layout, f.init, f.ref, &skip);
    if (!skip.empty()) GTEST_SKIP() << "UCX: " << skip;
    ASSERT_FALSE(HasFailure());
    for (uint32_t r = 0; r < kWorld; ++r) {
      ASSERT_EQ(0, std::memcmp(a[r].data(), b[r].data(), n * 4)) << "stage " << stage
                                                                   << " rank " << r;
    }
  }
}

}  // namespace
}  // namespace zeroshard
