// The oracle: the GPT trained through zeroshard (2 daemons, N_d ranks as
// threads, stages 1-3) against the same model trained in one process with
// torch::optim::AdamW on the full global batch.

#include <cmath>
#include <thread>

#include "examples/oracle_diff.h"
#include "examples/trainer.h"
#include "gtest/gtest.h"
#include "server/testing/daemon_fixture.h"

namespace zeroshard::examples {
namespace {

TrainOptions BaseOptions() {
  TrainOptions o;
  o.job_token = testing::kTestToken;
  o.model.layers = 2;
  o.model.width = 32;
  o.model.heads = 4;
  o.model.seq_len = 16;
  o.steps = 30;
  o.global_batch = 12;
  o.lr = 3e-3f;
  o.weight_decay = 0.01f;
  o.max_grad_norm = 1.0f;
  o.bucket_bytes = 64 << 10;
  return o;
}

std::vector<TrainResult> RunRanks(TrainOptions o, uint32_t world, int num_daemons) {
  std::vector<std::unique_ptr<Daemon>> daemons;
  o.daemons.clear();
  for (int d = 0; d < num_daemons; ++d) {
    daemons.push_back(testing::StartDaemon());
    o.daemons.push_back(daemons.back()->address());
  }
  std::vector<absl::StatusOr<TrainResult>> results = TrainRanksInThreads(o, world);
  std::vector<TrainResult> out;
  for (auto& r : results) {
    EXPECT_TRUE(r.ok()) << r.status();
    if (r.ok()) out.push_back(*std::move(r));
  }
  return out;
}

class OracleTest : public ::testing::TestWithParam<std::tuple<uint32_t, uint32_t>> {};

// Tolerances: examples/oracle_diff.h says why they are not 0.
TEST_P(OracleTest, ShardedTrainingEqualsSingleProcessTraining) {
  const auto [stage, world] = GetParam();
  TrainOptions o = BaseOptions();
  static const TrainResult* reference = [] {
    auto r = TrainSingleProcess(BaseOptions());
    EXPECT_TRUE(r.ok()) << r.status();
    return new TrainResult(*r);
  }();
  o.stage = stage;
  o.job_id = "oracle-s" + std::to_string(stage) + "-n" + std::to_string(world);
  const std::vector<TrainResult> ranks = RunRanks(o, world, 2);
  ASSERT_EQ(ranks.size(), world);
  for (uint32_t r = 1; r < world; ++r) {
    ASSERT_EQ(ranks[r].params, ranks[0].params) << "rank " << r << " differs from rank 0";
  }
  const OracleDiff d = CompareWithReference(ranks[0].params, MeanLosses(ranks), *reference);
  std::printf("stage %u N_d %u: params relative L2 %.3g, max %.3g; loss max relative %.3g; "
              "final loss %.4f vs %.4f\n",
              stage, world, d.params_rel, d.params_max, d.loss_max, ranks[0].losses.back(),
              reference->losses.back());
  EXPECT_LE(d.params_rel, kOracleParamsRel);
  EXPECT_LE(d.params_max, kOracleParamsMax);
  EXPECT_LE(d.loss_max, kOracleLossRel);
  EXPECT_LT(reference->losses.back(), reference->losses.front() - 0.5f);
}

INSTANTIATE_TEST_SUITE_P(StagesAndRanks, OracleTest,
                         ::testing::Combine(::testing::Values(1u, 2u, 3u),
                                            ::testing::Values(2u, 3u)));

// bf16 on the wire and in the trainers: the loss tracks the fp32 run.
TEST(OracleTest, Bf16TracksFp32) {
  TrainOptions o = BaseOptions();
  o.stage = 3;
  o.job_id = "bf16";
  o.precision = DType::kBf16;
  const auto bf16 = RunRanks(o, 2, 2);
  o.job_id = "fp32";
  o.precision = DType::kFp32;
  const auto fp32 = RunRanks(o, 2, 2);
  ASSERT_EQ(bf16.size(), 2u);
  ASSERT_EQ(fp32.size(), 2u);
  double worst = 0;
  for (int s = 0; s < o.steps; ++s) {
    const double a = (bf16[0].losses[s] + bf16[1].losses[s]) / 2;
    const double b = (fp32[0].losses[s] + fp32[1].losses[s]) / 2;
    worst = std::max(worst, std::fabs(a - b));
  }
  std::printf("bf16 vs fp32: worst loss difference %.4f over %d steps; final %.4f vs %.4f\n",
              worst, o.steps, bf16[0].losses.back(), fp32[0].losses.back());
  EXPECT_LT(worst, 0.05);
  EXPECT_LT(bf16[0].losses.back(), bf16[0].losses.front() - 0.5f);
}

}  // namespace
}  // namespace zeroshard::examples
