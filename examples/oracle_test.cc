// The oracle: the GPT trained through zeroshard (2 daemons, N_d ranks as
// threads, stages 1-3) against the same model trained in one process with
// torch::optim::AdamW on the full global batch.

#include <cmath>
#include <cstdlib>
#include <cstring>
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

// The single-process torch AdamW run, trained once per test process.
const TrainResult* Reference() {
  static const TrainResult* reference = [] {
    auto r = TrainSingleProcess(BaseOptions());
    EXPECT_TRUE(r.ok()) << r.status();
    return new TrainResult(*r);
  }();
  return reference;
}

class OracleTest : public ::testing::TestWithParam<std::tuple<uint32_t, uint32_t>> {};

// Tolerances: examples/oracle_diff.h says why they are not 0.
TEST_P(OracleTest, ShardedTrainingEqualsSingleProcessTraining) {
  const auto [stage, world] = GetParam();
  TrainOptions o = BaseOptions();
  const TrainResult* reference = Reference();
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

// Stage 3 keeping autograd's activations (--activations=keep: no
// checkpoints, no recomputation; each layer's parameter bytes freed after
// its forward and gathered again before its backward) trains bit for bit as
// with checkpoints, and gathers as much (each layer twice a step).
TEST(OracleTest, Stage3KeepingActivationsEqualsCheckpointsBitForBit) {
  TrainOptions o = BaseOptions();
  o.stage = 3;
  o.steps = 6;
  o.job_id = "oracle-s3-checkpoints";
  const std::vector<TrainResult> checkpoints = RunRanks(o, 2, 2);
  o.activations = "keep";
  o.job_id = "oracle-s3-keep";
  const std::vector<TrainResult> keep = RunRanks(o, 2, 2);
  ASSERT_EQ(checkpoints.size(), 2u);
  ASSERT_EQ(keep.size(), 2u);
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(keep[r].params.size(), checkpoints[r].params.size());
    EXPECT_EQ(std::memcmp(keep[r].params.data(), checkpoints[r].params.data(),
                          keep[r].params.size() * sizeof(float)),
              0)
        << "rank " << r << ": parameters differ";
    EXPECT_EQ(keep[r].losses, checkpoints[r].losses) << "rank " << r;
    EXPECT_EQ(keep[r].traffic.last_step.gather, checkpoints[r].traffic.last_step.gather)
        << "rank " << r;
    EXPECT_EQ(keep[r].traffic.last_step.push, checkpoints[r].traffic.last_step.push)
        << "rank " << r;
  }
}

// The trainer collective (--reduction=trainer): the 3 ranks reduce-scatter
// over Gloo (TCP on loopback, one thread each) and each pushes only its own
// partition; the same tolerances hold.
class TrainerCollectiveOracleTest : public ::testing::TestWithParam<uint32_t> {};

TEST_P(TrainerCollectiveOracleTest, EqualsSingleProcessTraining) {
  const uint32_t stage = GetParam();
  constexpr uint32_t kWorld = 3;
  TrainOptions o = BaseOptions();
  const TrainResult* reference = Reference();
  o.stage = stage;
  o.job_id = "oracle-trainer-s" + std::to_string(stage);
  o.reduction = "trainer";
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string dir = std::string(tmp != nullptr ? tmp : "/tmp") + "/gloo-XXXXXX";
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  o.collective_dir = dir;
  const std::vector<TrainResult> ranks = RunRanks(o, kWorld, 2);
  ASSERT_EQ(ranks.size(), kWorld);
  for (uint32_t r = 1; r < kWorld; ++r) {
    ASSERT_EQ(ranks[r].params, ranks[0].params) << "rank " << r << " differs from rank 0";
  }
  const OracleDiff d = CompareWithReference(ranks[0].params, MeanLosses(ranks), *reference);
  std::printf(
      "trainer collective, stage %u N_d %u: params relative L2 %.3g, max %.3g; loss max "
      "relative %.3g\n",
      stage, kWorld, d.params_rel, d.params_max, d.loss_max);
  EXPECT_LE(d.params_rel, kOracleParamsRel);
  EXPECT_LE(d.params_max, kOracleParamsMax);
  EXPECT_LE(d.loss_max, kOracleLossRel);
  // Both modes sum in rank order in fp32: daemon reduce gives the same bits.
  TrainOptions daemon = o;
  daemon.reduction = "daemon";
  daemon.job_id += "-daemon";
  const std::vector<TrainResult> daemon_ranks = RunRanks(daemon, kWorld, 2);
  ASSERT_EQ(daemon_ranks.size(), kWorld);
  EXPECT_TRUE(daemon_ranks[0].params == ranks[0].params)
      << "the trainer collective's parameters differ from daemon reduce's";
  // Per rank and step: its partition to the daemons, (N_d - 1)/N_d of the
  // gradient out to the other ranks and as much in (the reduce-scatter);
  // its partition of the parameters from the daemons, the rest in from the
  // other ranks and its partition out to each of them (the all-gather, of
  // each layer twice in stage 3).
  const Layout layout = *GptLayout(o.model);
  const PartitionMap map = *PartitionMap::Create(layout.total_elements(), kWorld, 2);
  for (uint32_t r = 0; r < kWorld; ++r) {
    const TrafficBytes& t = ranks[r].traffic.last_step;
    std::printf(
        "  rank %u per step: pushed %llu B to daemons (Ψ/N_d x 4 = %.0f B), gathered %llu B; "
        "collective sent %llu B, received %llu B\n",
        r, static_cast<unsigned long long>(t.push), 4.0 * layout.parameter_count() / kWorld,
        static_cast<unsigned long long>(t.gather),
        static_cast<unsigned long long>(t.collective_sent),
        static_cast<unsigned long long>(t.collective_received));
    const uint64_t own = map.UnpaddedPartition(r).size() * 4;
    const uint64_t all = layout.total_elements() * 4;
    // The parameters all-gathered: the whole model, or each layer twice.
    uint64_t gathered = all, gathered_own = own, passes = 1;
    if (stage == 3) {
      gathered = gathered_own = 0;
      passes = 2;
      for (uint32_t layer : layout.layers()) {
        const FlatRange l = *layout.LayerRange(layer);
        gathered += l.size() * 4;
        gathered_own += l.Intersect(map.UnpaddedPartition(r)).size() * 4;
      }
    }
    // And the no-gradient marks, a byte per tensor to and from each peer.
    const uint64_t marks = (kWorld - 1) * layout.tensors().size();
    EXPECT_EQ(t.push, own);
    EXPECT_EQ(t.gather, passes * gathered_own);
    EXPECT_EQ(t.collective_received,
              (kWorld - 1) * own + passes * (gathered - gathered_own) + marks);
    EXPECT_EQ(t.collective_sent, (all - own) + passes * (kWorld - 1) * gathered_own + marks);
  }
}

INSTANTIATE_TEST_SUITE_P(Stages, TrainerCollectiveOracleTest, ::testing::Values(1u, 2u, 3u));

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
