// Checkpoints across a change of layout: the GPT example trains at ZeRO
// stage 3 with N_d = 4 ranks over 2 daemons and saves a checkpoint; the same
// job id on fresh daemons that share the checkpoint directory then resumes it
// with N_d = 2 over 1 daemon and with N_d = 3 over 3 daemons. Right after the
// load, the gathered fp32 parameters equal the saved ones bit for bit; 20
// more steps then land where torch::optim::AdamW in one process lands after
// the same 30 steps from the start (the resumed job needs the Adam moments
// and step count to do that), within the oracle's tolerance.

#include <stdlib.h>
#include <sys/stat.h>

#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "examples/oracle_diff.h"
#include "examples/trainer.h"
#include "gtest/gtest.h"
#include "server/daemon.h"
#include "server/testing/daemon_fixture.h"

namespace zeroshard::examples {
namespace {

constexpr char kJob[] = "ckpt-reshard";
constexpr int kSaveStep = 10;
constexpr int kSteps = kSaveStep + 20;
constexpr uint32_t kSavedWorld = 4;
constexpr int kSavedDaemons = 2;

TrainOptions BaseOptions() {
  TrainOptions o;
  o.job_token = testing::kTestToken;
  o.model.layers = 2;
  o.model.width = 32;
  o.model.heads = 4;
  o.model.seq_len = 16;
  o.steps = kSteps;
  o.global_batch = 12;  // divisible by every N_d below, so rank losses average to the batch's
  o.lr = 3e-3f;
  o.weight_decay = 0.01f;
  o.max_grad_norm = 1.0f;
  o.bucket_bytes = 64 << 10;
  o.stage = 3;
  o.job_id = kJob;
  o.transport = "stream";
  return o;
}

std::vector<std::unique_ptr<Daemon>> StartDaemons(int n, const std::string& checkpoint_dir) {
  std::vector<std::unique_ptr<Daemon>> daemons;
  for (int d = 0; d < n; ++d) {
    std::unique_ptr<Daemon> daemon = testing::StartDaemon(0, 1, checkpoint_dir);
    if (daemon != nullptr) daemons.push_back(std::move(daemon));
  }
  return daemons;
}

// Runs `world` ranks as threads against `daemons`; rank 0 calls `on_start`.
// Empty unless every rank succeeded.
std::vector<TrainResult> RunRanks(TrainOptions o, uint32_t world,
                                  const std::vector<std::unique_ptr<Daemon>>& daemons,
                                  const StartCallback& on_start = nullptr) {
  o.daemons.clear();
  for (const auto& d : daemons) o.daemons.push_back(d->address());
  std::vector<absl::StatusOr<TrainResult>> results = TrainRanksInThreads(o, world, on_start);
  std::vector<TrainResult> out;
  for (auto& r : results) {
    EXPECT_TRUE(r.ok()) << r.status();
    if (r.ok()) out.push_back(*std::move(r));
  }
  if (out.size() != world) out.clear();
  return out;
}

// The saved run, shared by every resume below: N_d = 4 over 2 daemons trains
// kSaveStep steps and saves "step-<kSaveStep>" into a fresh directory.
struct Saved {
  std::string checkpoint_dir;
  std::vector<float> params;  // gathered after the last step: the checkpoint's
  std::vector<double> losses;
};

class CheckpointReshardTest : public ::testing::TestWithParam<std::tuple<uint32_t, int>> {
 protected:
  static void SetUpTestSuite() {
    std::string dir = ::testing::TempDir() + "/checkpoint_test.XXXXXX";
    ASSERT_NE(mkdtemp(dir.data()), nullptr);
    saved_ = new Saved{dir, {}, {}};
    {
      const auto daemons = StartDaemons(kSavedDaemons, dir);
      ASSERT_EQ(daemons.size(), size_t{kSavedDaemons});
      TrainOptions o = BaseOptions();
      o.steps = kSaveStep;
      o.checkpoint_every = kSaveStep;
      const std::vector<TrainResult> ranks = RunRanks(o, kSavedWorld, daemons);
      ASSERT_EQ(ranks.size(), kSavedWorld);
      ASSERT_TRUE(ranks[0].last_checkpoint.has_value());
      EXPECT_EQ(ranks[0].last_checkpoint->name, absl::StrCat("step-", kSaveStep));
      EXPECT_EQ(ranks[0].last_checkpoint->step, uint64_t{kSaveStep});
      saved_->params = ranks[0].params;
      saved_->losses = MeanLosses(ranks);
      ASSERT_EQ(saved_->losses.size(), size_t{kSaveStep});
      // The daemons go away here: only the files carry the state on.
    }
    auto reference = TrainSingleProcess(BaseOptions());
    ASSERT_TRUE(reference.ok()) << reference.status();
    reference_ = new TrainResult(*std::move(reference));
  }

  static void TearDownTestSuite() {
    if (saved_ != nullptr) {
      std::error_code ignored;
      std::filesystem::remove_all(saved_->checkpoint_dir, ignored);
    }
    delete saved_;
    delete reference_;
    saved_ = nullptr;
    reference_ = nullptr;
  }

  static Saved* saved_;
  static TrainResult* reference_;
};

Saved* CheckpointReshardTest::saved_ = nullptr;
TrainResult* CheckpointReshardTest::reference_ = nullptr;

TEST_P(CheckpointReshardTest, ResumesExactlyAndTracksTorchAdamW) {
  const auto [world, num_daemons] = GetParam();
  ASSERT_NE(saved_, nullptr);
  ASSERT_NE(reference_, nullptr);
  ASSERT_FALSE(saved_->params.empty());
  const std::string name = absl::StrCat("step-", kSaveStep);
  EXPECT_TRUE(std::filesystem::exists(
      std::filesystem::path(saved_->checkpoint_dir) / kJob / name / "MANIFEST"));

  const auto daemons = StartDaemons(num_daemons, saved_->checkpoint_dir);
  ASSERT_EQ(daemons.size(), size_t(num_daemons));
  TrainOptions o = BaseOptions();
  o.resume = name;
  bool started = false;
  std::vector<float> loaded;
  std::vector<v1::CheckpointInfo> listed;
  absl::Status list_status;
  const StartCallback on_start = [&](Client& client) {
    started = true;
    EXPECT_EQ(client.committed_step(), uint64_t{kSaveStep});
    ASSERT_TRUE(client.resumed_from().has_value());
    EXPECT_EQ(client.resumed_from()->name(), name);
    EXPECT_EQ(client.resumed_from()->step(), uint64_t{kSaveStep});
    loaded.resize(client.total_elements());
    const absl::Status s = client.GatherAll(loaded.data(), DType::kFp32);
    EXPECT_TRUE(s.ok()) << s;
    auto list = client.ListCheckpoints();
    list_status = list.status();
    if (list.ok()) listed = *std::move(list);
  };
  const std::vector<TrainResult> ranks = RunRanks(o, world, daemons, on_start);
  ASSERT_EQ(ranks.size(), world);
  ASSERT_TRUE(started);

  // The load: every fp32 parameter as saved, bit for bit.
  ASSERT_EQ(loaded.size(), saved_->params.size());
  EXPECT_EQ(std::memcmp(loaded.data(), saved_->params.data(), loaded.size() * sizeof(float)), 0)
      << "parameters right after loading differ from the saved ones";
  ASSERT_TRUE(list_status.ok()) << list_status;
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].name(), name);
  EXPECT_EQ(listed[0].step(), uint64_t{kSaveStep});
  EXPECT_EQ(listed[0].world_size(), kSavedWorld);
  EXPECT_EQ(listed[0].daemon_count(), uint32_t{kSavedDaemons});
  EXPECT_EQ(listed[0].stage(), 3u);

  // Training went on from the checkpoint's step to kSteps.
  for (uint32_t r = 0; r < world; ++r) {
    EXPECT_EQ(ranks[r].first_step, kSaveStep + 1) << "rank " << r;
    ASSERT_EQ(ranks[r].losses.size(), size_t{kSteps - kSaveStep}) << "rank " << r;
    ASSERT_EQ(ranks[r].params, ranks[0].params) << "rank " << r << " differs from rank 0";
  }
  std::vector<double> losses = saved_->losses;
  for (double l : MeanLosses(ranks)) losses.push_back(l);
  const OracleDiff d = CompareWithReference(ranks[0].params, losses, *reference_);
  std::printf("N_d %u over %d daemon(s), resumed at step %d from N_d %u over %d: params "
              "relative L2 %.3g, max %.3g; loss max relative %.3g; final loss %.4f vs %.4f\n",
              world, num_daemons, kSaveStep, kSavedWorld, kSavedDaemons, d.params_rel,
              d.params_max, d.loss_max, losses.back(), reference_->losses.back());
  EXPECT_LE(d.params_rel, kOracleParamsRel);
  EXPECT_LE(d.params_max, kOracleParamsMax);
  EXPECT_LE(d.loss_max, kOracleLossRel);
  EXPECT_LT(reference_->losses.back(), reference_->losses.front() - 0.5f);
}

INSTANTIATE_TEST_SUITE_P(NewLayouts, CheckpointReshardTest,
                         ::testing::Values(std::make_tuple(2u, 1), std::make_tuple(3u, 3)),
                         [](const auto& info) {
                           return absl::StrCat("Nd", std::get<0>(info.param), "Over",
                                               std::get<1>(info.param), "Daemons");
                         });

// A --checkpoint_dir that another local user could write into (and so
// replace or read what the daemon saves) stops the daemon at start.
TEST(CheckpointDirTest, DaemonRefusesADirectoryOthersCanWrite) {
  std::string dir = ::testing::TempDir() + "/checkpoint_open.XXXXXX";
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  ASSERT_EQ(::chmod(dir.c_str(), 0777), 0);
  DaemonOptions options;
  options.checkpoint_dir = dir;
  options.listen = "127.0.0.1:0";
  absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(options);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition) << d.status();
  EXPECT_NE(d.status().message().find("--checkpoint_dir"), std::string::npos) << d.status();
  EXPECT_NE(d.status().message().find(absl::StrCat("chmod go-w ", dir)), std::string::npos)
      << d.status();
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
}

}  // namespace
}  // namespace zeroshard::examples
