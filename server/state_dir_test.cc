// Daemons with --state_dir (every job's fp32 masters and optimizer moments in
// a file, in chunks of 1024 elements) train a job exactly as daemons holding
// them in RAM: stages 1-3, fp32 and bf16, tensors without a gradient in
// some steps, 20 steps, the same gathered parameters bit for bit after every
// step (fp32 gathers of a bf16 job read the masters from the file). A
// checkpoint saved from disk resumes on RAM daemons and one saved in RAM on
// disk daemons. The ledger books no moments (nor, with --state_gradients,
// the gradient); /metrics shows the files' bytes.

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/checkpoint_files.h"
#include "gtest/gtest.h"
#include "metrics/metric_names.h"
#include "metrics/registry.h"
#include "server/daemon.h"
#include "server/testing/daemon_fixture.h"

namespace zeroshard {
namespace {

using testing::RandomVector;
using testing::TestCluster;

constexpr int kDaemons = 2;
constexpr uint32_t kWorld = 2;
constexpr int kSteps = 20;

// Stage, precision, and whether the gradient is a file mapping too.
class StateDirTest
    : public ::testing::TestWithParam<std::tuple<uint32_t, v1::DType, bool>> {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/zs-state-dir-test-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Pushes the same gradients to both clusters and commits `step` on both.
  static void StepBoth(TestCluster& a, TestCluster& b, uint64_t step, std::mt19937& rng) {
    std::vector<std::vector<float>> grads;
    for (uint32_t r = 0; r < kWorld; ++r) grads.push_back(RandomVector(rng, a.total(), 0.1f));
    // Tensor 1 without a gradient every third step: its count falls behind.
    const std::vector<uint32_t> no_grad =
        step % 3 == 0 ? std::vector<uint32_t>{1} : std::vector<uint32_t>{};
    const float lr = 0.01f * (1.0f + 0.05f * static_cast<float>(step));
    for (TestCluster* c : {&a, &b}) {
      c->PushAll(step, grads, no_grad);
      c->Step(step, lr, 1.0f);
    }
  }

  static void ExpectSameParameters(TestCluster& a, TestCluster& b, uint64_t step,
                                   v1::DType precision) {
    const std::vector<float> pa = a.GatherAll(step);
    const std::vector<float> pb = b.GatherAll(step);
    ASSERT_EQ(pa.size(), pb.size());
    ASSERT_EQ(std::memcmp(pa.data(), pb.data(), pa.size() * sizeof(float)), 0)
        << "fp32 masters differ after step " << step;
    if (precision != v1::DTYPE_FP32) {
      const std::vector<float> ha = a.GatherAll(step, precision);
      const std::vector<float> hb = b.GatherAll(step, precision);
      ASSERT_EQ(std::memcmp(ha.data(), hb.data(), ha.size() * sizeof(float)), 0)
          << "half copies differ after step " << step;
    }
  }

  std::string dir_;
};

TEST_P(StateDirTest, TrainsBitForBitAsInRam) {
  const auto [stage, precision, gradients] = GetParam();
  TestCluster ram(kDaemons, kWorld, stage, "job", dir_ + "/ckpt-ram", precision);
  TestCluster disk(kDaemons, kWorld, stage, "job", dir_ + "/ckpt-disk", precision, false,
                   dir_ + "/states", 1024, gradients);
  std::mt19937 rng(stage * 7 + static_cast<uint32_t>(precision));
  const std::vector<float> init = RandomVector(rng, ram.total(), 1.0f);
  ram.Init(init);
  disk.Init(init);
  ExpectSameParameters(ram, disk, 0, precision);
  for (uint64_t step = 1; step <= kSteps; ++step) {
    StepBoth(ram, disk, step, rng);
    ExpectSameParameters(ram, disk, step, precision);
    if (HasFatalFailure()) return;
  }
  EXPECT_EQ(ram.TensorSteps(), disk.TensorSteps());
  // Where the bytes are: no moments (and, for bf16, no masters) in RAM.
  for (int d = 0; d < kDaemons; ++d) {
    const CategoryBytes b = disk.daemon(d).ledger().JobBytes("job");
    EXPECT_EQ(b[static_cast<int>(MemoryCategory::kOptimM)], 0u);
    EXPECT_EQ(b[static_cast<int>(MemoryCategory::kOptimV)], 0u);
    EXPECT_GT(b[static_cast<int>(MemoryCategory::kBuffer)], 0u);
    const MemoryCategory grad_category =
        stage >= 2 ? MemoryCategory::kGrad : MemoryCategory::kBuffer;
    if (gradients) {
      EXPECT_EQ(b[static_cast<int>(MemoryCategory::kGrad)], 0u);
    } else if (grad_category == MemoryCategory::kGrad) {
      EXPECT_GT(b[static_cast<int>(MemoryCategory::kGrad)], 0u);
    }
    if (precision != v1::DTYPE_FP32) {
      EXPECT_EQ(b[static_cast<int>(MemoryCategory::kParamMaster)], 0u);
    }
    const CategoryBytes r = ram.daemon(d).ledger().JobBytes("job");
    EXPECT_GT(r[static_cast<int>(MemoryCategory::kOptimM)], 0u);
    // 12 (bf16) or 8 (fp32) bytes per owned element, whole chunks.
    const uint64_t owned = disk.map().DaemonRange(d).size();
    const uint64_t per = precision == v1::DTYPE_FP32 ? 8 : 12;
    const uint64_t chunks = (owned + 1023) / 1024;
    const uint64_t grad_file = gradients ? owned * sizeof(float) : 0;
    EXPECT_EQ(metrics::SumOf(disk.daemon(d).registry().Collect(), metrics::kStateDiskBytes.name,
                             {{"job", "job"}}),
              static_cast<double>(chunks * 1024 * per + grad_file));
  }
  // Checkpoints cross between RAM and disk both ways. A disk-resident
  // save is written from the state file: no snapshot buffers in RAM.
  const uint64_t buffers_before =
      disk.daemon(0).ledger().JobBytes("job")[static_cast<int>(MemoryCategory::kBuffer)];
  disk.SaveCheckpoint("from-disk", kSteps);
  EXPECT_EQ(disk.daemon(0).ledger().JobBytes("job")[static_cast<int>(MemoryCategory::kBuffer)],
            buffers_before);
  ram.SaveCheckpoint("from-ram", kSteps);
  TestCluster ram2(kDaemons, kWorld, stage, "job", dir_ + "/ckpt-disk", precision);
  TestCluster disk2(kDaemons, kWorld, stage, "job", dir_ + "/ckpt-ram", precision, false,
                    dir_ + "/states2");
  ASSERT_TRUE(ram2.LoadCheckpoint("from-disk").ok());
  // A checkpoint with a damaged block: every block is checked before the
  // state is touched, so the load is refused and the job stays usable.
  {
    ram.SaveCheckpoint("broken", kSteps);
    const std::string file = CheckpointPartDir(dir_ + "/ckpt-ram", "job", "broken", 0) + "/" +
                             ArrayFilesOf(disk2.spec())[1];
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('\x7f');
    f.close();
    grpc::Status broken = disk2.LoadCheckpoint("broken");
    EXPECT_EQ(broken.error_code(), grpc::StatusCode::DATA_LOSS) << broken.error_message();
  }
  ASSERT_TRUE(disk2.LoadCheckpoint("from-ram").ok());
  ExpectSameParameters(ram, ram2, kSteps, precision);
  ExpectSameParameters(ram, disk2, kSteps, precision);
  for (uint64_t step = kSteps + 1; step <= kSteps + 3; ++step) {
    StepBoth(ram2, disk2, step, rng);
    ExpectSameParameters(ram2, disk2, step, precision);
  }
}

// A state file that fails under the daemon (cut short: reads past its end)
// in the middle of a commit: the commit fails, and from then on the job's
// steps, gathers and state reads are refused, naming the file, until it is
// registered again.
TEST(StateDirDamageTest, ADamagedStateRefusesStepsGathersAndReads) {
  char tmpl[] = "/tmp/zs-state-dir-damage-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  {
    TestCluster c(1, 1, 3, "job", "", v1::DTYPE_BF16, false, dir + "/states");
    std::mt19937 rng(3);
    c.Init(RandomVector(rng, c.total(), 1.0f));
    c.PushAll(1, {RandomVector(rng, c.total(), 0.1f)});
    c.Step(1, 0.01f, 1.0f);
    std::string path;
    for (const auto& e : std::filesystem::directory_iterator(dir + "/states/d0")) {
      if (e.path().filename().string().find(".lock") == std::string::npos) path = e.path();
    }
    ASSERT_FALSE(path.empty());
    ASSERT_EQ(::truncate(path.c_str(), 3 * 1024 * 12), 0);  // 3 of the chunks
    c.PushAll(2, {RandomVector(rng, c.total(), 0.1f)});
    v1::PrepareStepResponse prepared;
    ASSERT_TRUE(c.client(0).Prepare("job", 2, &prepared).ok());
    grpc::Status commit = c.client(0).Commit("job", 2, 0.01f);
    EXPECT_FALSE(commit.ok());
    std::vector<float> out;
    grpc::Status gather = c.client(0).Gather("job", 1, c.DaemonRange(0), &out, 0, v1::DTYPE_BF16);
    EXPECT_EQ(gather.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_NE(gather.error_message().find(path), std::string::npos) << gather.error_message();
    EXPECT_EQ(c.client(0).Commit("job", 2, 0.01f).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_EQ(c.client(0)
                  .ReadState("job", 0, v1::STATE_ARRAY_EXP_AVG, c.DaemonRange(0), &out)
                  .error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
  }
  std::filesystem::remove_all(dir);
}

// --state_disk_limit: a job whose files would pass it is refused whole at
// registration, naming the limit; one that fits registers.
TEST(StateDirLimitTest, AJobPastTheDiskLimitIsRefused) {
  char tmpl[] = "/tmp/zs-state-dir-limit-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  {
    const Layout layout = testing::SampleLayout();
    DaemonOptions options;
    options.listen = "127.0.0.1:0";
    options.state_dir = dir + "/states";
    options.state_chunk_elements = 1024;
    // SampleLayout on one daemon: 10 chunks of 12 KiB; room for 8.
    options.state_disk_limit_bytes = 8 * 1024 * 12;
    absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(options);
    ASSERT_TRUE(d.ok()) << d.status();
    testing::DaemonClient client((*d)->address());
    v1::JobSpec spec = testing::MakeSpec("big", layout, 3, 1, {(*d)->address()});
    spec.set_precision(v1::DTYPE_BF16);
    grpc::Status s = client.Register(spec, 0);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
    EXPECT_NE(s.error_message().find("--state_disk_limit"), std::string::npos)
        << s.error_message();
    EXPECT_EQ((*d)->ledger().total(), 0u);
    // fp32: 8 bytes per element on disk, 10 chunks of 8 KiB: it fits.
    v1::JobSpec small = testing::MakeSpec("small", layout, 3, 1, {(*d)->address()});
    s = client.Register(small, 0);
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(
    StagesAndPrecisions, StateDirTest,
    ::testing::Values(std::make_tuple(1u, v1::DTYPE_BF16, false),
                      std::make_tuple(2u, v1::DTYPE_BF16, false),
                      std::make_tuple(3u, v1::DTYPE_BF16, false),
                      std::make_tuple(3u, v1::DTYPE_FP32, false),
                      std::make_tuple(2u, v1::DTYPE_BF16, true),
                      std::make_tuple(3u, v1::DTYPE_BF16, true)),
    [](const ::testing::TestParamInfo<std::tuple<uint32_t, v1::DType, bool>>& info) {
      return "Stage" + std::to_string(std::get<0>(info.param)) +
             (std::get<1>(info.param) == v1::DTYPE_FP32 ? "Fp32" : "Bf16") +
             (std::get<2>(info.param) ? "GradientOnDisk" : "");
    });

}  // namespace
}  // namespace zeroshard
