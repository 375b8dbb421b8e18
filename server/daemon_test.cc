// The daemon end to end over gRPC on loopback: multi-rank push -> reduce ->
// step -> gather against the same computation in one process, determinism
// under shuffled arrival, the memory ledger against the paper's formulas.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>

#include "gtest/gtest.h"
#include "server/daemon.h"
#include "server/ledger/system_resources.h"
#include "common/job_spec.h"
#include "server/testing/daemon_fixture.h"

namespace zeroshard {
namespace {

using testing::DaemonClient;
using testing::GradientChunks;
using testing::MakeSpec;
using testing::SampleLayout;
using testing::StartDaemon;
using testing::RandomVector;
using Cluster = testing::TestCluster;

class DaemonReduceTest : public ::testing::TestWithParam<uint32_t> {};

TEST_P(DaemonReduceTest, ReduceStepGatherEqualsOneProcess) {
  const uint32_t stage = GetParam();
  const uint32_t world = 3;
  Cluster cluster(2, world, stage, "reduce-s" + std::to_string(stage));
  const uint64_t n = cluster.total();
  std::mt19937 rng(stage);
  std::vector<float> params = RandomVector(rng, n, 1.0f);
  cluster.Init(params);

  // The reference: the same arithmetic in this process.
  auto optimizer = *ShardOptimizer::Create({});
  std::vector<float> ref_p = params, m(n, 0), v(n, 0);
  for (uint64_t step = 1; step <= 5; ++step) {
    std::vector<std::vector<float>> grads;
    for (uint32_t r = 0; r < world; ++r) grads.push_back(RandomVector(rng, n, 0.5f));
    // Ranks push in reverse order, to both daemons.
    for (int r = world - 1; r >= 0; --r) {
      for (int d = 0; d < cluster.num_daemons(); ++d) {
        grpc::Status s = cluster.client(d).Push(cluster.RankChunks(step, r, d, grads[r]));
        ASSERT_TRUE(s.ok()) << s.error_message();
      }
    }
    const float lr = 0.01f * static_cast<float>(step);
    const float clip = cluster.Step(step, lr, 1.0f);

    std::vector<float> sum(n);
    for (uint64_t i = 0; i < n; ++i) {
      float acc = grads[0][i];
      for (uint32_t r = 1; r < world; ++r) acc += grads[r][i];
      sum[i] = acc;
    }
    double sum_sq = 0;
    for (int d = 0; d < cluster.num_daemons(); ++d) {
      const FlatRange dr = cluster.DaemonRange(d);
      sum_sq += optimizer->SumSquaresAndFinite(sum.data() + dr.begin, dr.size(), 1.0f / world)
                    .sum_sq;
    }
    const float ref_clip = std::min(1.0f, 1.0f / (static_cast<float>(std::sqrt(sum_sq)) + 1e-6f));
    ASSERT_EQ(clip, ref_clip);
    StepHyperParams hp;
    hp.kind = OptimizerKind::kAdamW;
    hp.lr = lr;
    hp.beta1 = 0.9f;
    hp.beta2 = 0.999f;
    hp.eps = 1e-8f;
    hp.weight_decay = 0.01f;
    hp.step = static_cast<int64_t>(step);
    hp.grad_scale = static_cast<double>(ref_clip) / world;
    ShardBuffers b{ref_p.data(), sum.data(), m.data(), v.data(), nullptr, DType::kBf16, n};
    ASSERT_TRUE(optimizer->Step(hp, b).ok());

    const std::vector<float> got = cluster.GatherAll(step);
    ASSERT_EQ(0, std::memcmp(got.data(), ref_p.data(), n * 4)) << "step " << step;
  }
}

INSTANTIATE_TEST_SUITE_P(Stages, DaemonReduceTest, ::testing::Values(1u, 2u, 3u));

// --optimizer_cpus: one CPU of this process's mask per optimizer thread, or
// the daemon does not start, saying why.
TEST(DaemonTest, OptimizerCpusArePinnedOrRefused) {
  const std::vector<int> allowed = AffinityCpuList();
  ASSERT_FALSE(allowed.empty());
  DaemonOptions o;
  o.optimizer_threads = 1;
  o.optimizer_cpus = {allowed.back()};
  absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
  ASSERT_TRUE(d.ok()) << d.status();
  (*d)->Shutdown(absl::Seconds(1));

  o.optimizer_threads = 2;
  d = Daemon::Start(o);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(d.status().message().find("--optimizer_cpus: 1 CPUs for 2 optimizer threads"),
            absl::string_view::npos)
      << d.status();
  int outside = -1;
  for (int c = 0; c < 1024 && outside < 0; ++c) {
    if (!std::binary_search(allowed.begin(), allowed.end(), c)) outside = c;
  }
  o.optimizer_threads = 1;
  o.optimizer_cpus = {outside};
  d = Daemon::Start(o);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(d.status().message().find("CPU " + std::to_string(outside) +
                                      " is not one this process may run on"),
            absl::string_view::npos)
      << d.status();
}

TEST(DaemonTest, DeterministicUnderShuffledArrival) {
  const uint32_t world = 4;
  std::vector<float> first;
  std::mt19937 data_rng(99);
  Cluster probe(1, world, 2, "probe");
  const uint64_t n = probe.total();
  const std::vector<float> params = RandomVector(data_rng, n, 1.0f);
  std::vector<std::vector<std::vector<float>>> grads(3);  // [step][rank]
  for (auto& g : grads) {
    for (uint32_t r = 0; r < world; ++r) g.push_back(RandomVector(data_rng, n, 1.0f));
  }
  for (int trial = 0; trial < 20; ++trial) {
    Cluster cluster(1, world, 2, "shuffle-" + std::to_string(trial));
    cluster.Init(params);
    std::mt19937 order_rng(1000 + trial);
    for (uint64_t step = 1; step <= 3; ++step) {
      // Every chunk of every rank as its own stream, in a random order; odd
      // trials push from four threads at once.
      std::vector<v1::GradientChunk> all;
      for (uint32_t r = 0; r < world; ++r) {
        for (auto& c : cluster.RankChunks(step, r, 0, grads[step - 1][r])) all.push_back(c);
      }
      std::shuffle(all.begin(), all.end(), order_rng);
      if (trial % 2 == 0) {
        for (const auto& c : all) ASSERT_TRUE(cluster.client(0).Push({c}).ok());
      } else {
        std::vector<std::thread> threads;
        std::atomic<int> failures{0};
        for (int t = 0; t < 4; ++t) {
          threads.emplace_back([&, t] {
            DaemonClient client(cluster.daemon(0).address());
            for (size_t i = t; i < all.size(); i += 4) {
              if (!client.Push({all[i]}).ok()) ++failures;
            }
          });
        }
        for (auto& th : threads) th.join();
        ASSERT_EQ(failures.load(), 0);
      }
      cluster.Step(step, 0.05f, 0.5f);
    }
    const std::vector<float> got = cluster.GatherAll(3);
    if (trial == 0) {
      first = got;
    } else {
      ASSERT_EQ(0, std::memcmp(first.data(), got.data(), n * 4)) << "trial " << trial;
    }
  }
}

TEST(DaemonTest, MicroBatchAccumulationIsOrderIndependent) {
  const uint32_t world = 2;
  std::mt19937 rng(5);
  std::vector<float> reference;
  for (int trial = 0; trial < 2; ++trial) {
    Cluster cluster(1, world, 1, "accum-" + std::to_string(trial));
    std::mt19937 data(7);
    const uint64_t n = cluster.total();
    cluster.Init(RandomVector(data, n, 1.0f));
    std::vector<v1::GradientChunk> all;
    for (uint32_t r = 0; r < world; ++r) {
      for (uint32_t mb = 0; mb < 3; ++mb) {
        auto g = RandomVector(data, n, 1.0f);
        for (auto c : cluster.RankChunks(1, r, 0, g)) {
          c.set_micro_batch(mb);
          c.set_micro_batches(3);
          all.push_back(std::move(c));
        }
      }
    }
    if (trial == 1) std::shuffle(all.begin(), all.end(), rng);
    for (const auto& c : all) ASSERT_TRUE(cluster.client(0).Push({c}).ok());
    cluster.Step(1, 0.01f, 100.0f);
    auto got = cluster.GatherAll(1);
    if (trial == 0) reference = got;
    else ASSERT_EQ(0, std::memcmp(reference.data(), got.data(), n * 4));
  }
}

// Bytes booked as param_master + optim_m + optim_v + grad + param_half equal
// the stage's partitioned terms of the paper's formula for the partitions
// this daemon owns, within 1% plus padding.
TEST(DaemonTest, LedgerMatchesThePapersFormula) {
  const Layout layout = *Layout::Create({{"w", {1000, 1000}, DType::kFp32, 0},
                                         {"b", {777}, DType::kFp32, 0}});
  const uint64_t psi = layout.parameter_count();
  for (v1::DType precision : {v1::DTYPE_FP32, v1::DTYPE_BF16}) {
    for (uint32_t stage = 1; stage <= 3; ++stage) {
      auto daemon = StartDaemon();
      DaemonClient client(daemon->address());
      const uint32_t world = 4;
      v1::JobSpec spec = MakeSpec("ledger", layout, stage, world, {daemon->address()});
      spec.set_precision(precision);
      ASSERT_TRUE(client.Register(spec, 0).ok());
      const CategoryBytes b = daemon->ledger().JobBytes("ledger");
      auto at = [&](MemoryCategory c) { return b[static_cast<int>(c)]; };
      const double measured = at(MemoryCategory::kParamMaster) + at(MemoryCategory::kOptimM) +
                              at(MemoryCategory::kOptimV) + at(MemoryCategory::kGrad) +
                              at(MemoryCategory::kParamHalf);
      // The paper's partitioned terms per rank, times the N_d partitions this
      // daemon owns: K = 12 (stage 1), + gradient (stage 2: 4 B, the fp32
      // shard), + half parameters (stage 3: 2 B when training in bf16).
      double per_param = 12;
      if (stage >= 2) per_param += 4;
      if (stage == 3 && precision == v1::DTYPE_BF16) per_param += 2;
      const double formula = per_param * psi / world * world;
      const JobConfig config = *ParseJobSpec(spec);
      const double padding = per_param * (config.map.padded_elements() - psi);
      EXPECT_LE(std::fabs(measured - formula), 0.01 * formula + padding)
          << "stage " << stage << " precision " << precision;
      EXPECT_EQ(at(MemoryCategory::kParamMaster), 4 * config.map.padded_elements());
      // MemoryReport carries the same numbers.
      grpc::ClientContext ctx;
      v1::MemoryReportRequest req;
      req.set_job_id("ledger");
      v1::MemoryReportResponse resp;
      ASSERT_TRUE(client.admin->MemoryReport(&ctx, req, &resp).ok());
      ASSERT_EQ(resp.jobs_size(), 1);
      uint64_t reported = 0;
      for (const auto& c : resp.jobs(0).categories()) {
        if (c.category() != "buffer" && c.category() != "activation" &&
            c.category() != "fragmentation") {
          reported += c.bytes();
        }
      }
      EXPECT_EQ(reported, static_cast<uint64_t>(measured));
      EXPECT_EQ(resp.jobs(0).formula_bytes(), reported);
      EXPECT_EQ(resp.total_bytes(), daemon->ledger().total());
    }
  }
}

TEST(DaemonTest, LeaveByEveryRankFreesTheJob) {
  auto daemon = StartDaemon();
  DaemonClient client(daemon->address());
  v1::JobSpec spec = MakeSpec("leave", SampleLayout(), 2, 2, {daemon->address()});
  ASSERT_TRUE(client.Register(spec, 0).ok());
  ASSERT_TRUE(client.Join(spec, 0).ok());
  ASSERT_TRUE(client.Join(spec, 1).ok());
  EXPECT_GT(daemon->ledger().total(), 0u);
  for (uint32_t r = 0; r < 2; ++r) {
    grpc::ClientContext ctx;
    v1::LeaveRequest req;
    req.set_incarnation(testing::kTestIncarnation);
    req.set_job_id("leave");
    req.set_rank(r);
    v1::LeaveResponse resp;
    ASSERT_TRUE(client.control->Leave(&ctx, req, &resp).ok());
    EXPECT_EQ(resp.job_removed(), r == 1);
  }
  daemon->jobs().Tick();  // the read lease (0 in tests) has ended: reaped
  EXPECT_EQ(daemon->ledger().total(), 0u);
  EXPECT_FALSE(daemon->jobs().Find("leave").ok());
}

}  // namespace
}  // namespace zeroshard
