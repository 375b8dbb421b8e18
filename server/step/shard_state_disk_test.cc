// ShardState with its masters and moments on disk (DiskResidence) against
// the same states in RAM: over a layout of odd tensor sizes, parameter
// groups, frozen tensors and ranges that cut tensors, chunks far smaller
// than the range, every step, read, write, checkpoint form and restore must
// give the same bits; the ledger books no moments in RAM; a directory
// without room refuses the job whole.

#include <signal.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/job_spec.h"
#include "common/layout.h"
#include "gtest/gtest.h"
#include "server/disk/instance_directory.h"
#include "server/ledger/memory_ledger.h"
#include "server/optimizer/optimizer.h"
#include "server/step/shard_state.h"

namespace zeroshard {
namespace {

constexpr uint32_t kTensors = 40;

// Odd sizes (1..6000), three groups, every seventh tensor frozen.
Layout MakeLayout() {
  std::mt19937 rng(5);
  std::vector<TensorSpec> specs;
  for (uint32_t i = 0; i < kTensors; ++i) {
    TensorSpec t;
    t.name = "t" + std::to_string(i);
    t.shape = {static_cast<int64_t>(1 + rng() % 6000)};
    t.group = i % 3;
    t.frozen = i % 7 == 3;
    specs.push_back(t);
  }
  absl::StatusOr<Layout> layout = Layout::Create(std::move(specs), 4);
  EXPECT_TRUE(layout.ok()) << layout.status();
  return *std::move(layout);
}

JobConfig MakeConfig(const Layout& layout, DType precision, OptimizerKind kind) {
  JobConfig c;
  c.job_id = "disk-job";
  c.stage = 3;
  c.precision = precision;
  c.optimizer.kind = kind;
  c.optimizer.momentum = 0.9f;
  c.param_groups = {{0.01f, 0.9f, 0.999f, 1e-8f, 0.01f},
                    {0.05f, 0.8f, 0.95f, 1e-6f, 0.1f},
                    {0.002f, 0.85f, 0.99f, 1e-7f, 0.0f}};
  c.layout = layout;
  return c;
}

std::vector<float> Values(size_t n, std::mt19937& rng, float scale) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> out(n);
  for (float& x : out) x = d(rng);
  return out;
}

bool SameBits(const void* a, const void* b, size_t bytes) { return std::memcmp(a, b, bytes) == 0; }

class ShardStateDiskTest : public ::testing::Test {
 protected:
  void SetUp() override {
    optimizer_ = *ShardOptimizer::Create(ShardOptimizer::Options{});
    char tmpl[] = "/tmp/zs-state-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_path_ = tmpl;
    absl::StatusOr<std::unique_ptr<InstanceDirectory>> dir =
        InstanceDirectory::Open(dir_path_ + "/states", InstanceDirectory::StateNaming());
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = *std::move(dir);
    disk_.dir = dir_.get();
    disk_.chunk_elements = 1024;  // far smaller than a range: many chunks
    disk_.buffers = 4;
    disk_.queue_depth = 3;
  }
  void TearDown() override {
    dir_.reset();
    std::filesystem::remove_all(dir_path_);
  }

  absl::StatusOr<std::unique_ptr<ShardState>> Create(const JobConfig& c, FlatRange owned,
                                                     const DiskResidence& disk) {
    absl::StatusOr<LedgerReservation> booked = LedgerReservation::Create(
        &ledger_, c.job_id, ShardState::Footprint(c, owned, false, disk));
    if (!booked.ok()) return booked.status();
    return ShardState::Create(c, owned, &*booked, /*transport=*/nullptr, false, disk);
  }

  // Trains a RAM and a disk copy of `owned` for 20 steps and compares them
  // after every step.
  void TrainBoth(DType precision, OptimizerKind kind, FlatRange owned) {
    const Layout layout = MakeLayout();
    const JobConfig c = MakeConfig(layout, precision, kind);
    owned = owned.Intersect({0, layout.total_elements()});
    absl::StatusOr<std::unique_ptr<ShardState>> ram = Create(c, owned, {});
    absl::StatusOr<std::unique_ptr<ShardState>> disk = Create(c, owned, disk_);
    ASSERT_TRUE(ram.ok()) << ram.status();
    ASSERT_TRUE(disk.ok()) << disk.status();
    ShardState& r = **ram;
    ShardState& d = **disk;
    ASSERT_TRUE(d.on_disk());
    ASSERT_GT(d.disk_bytes(), 0u);
    std::mt19937 rng(17);
    std::vector<float> init(owned.size(), 0.0f);
    const std::vector<float> values = Values(owned.size(), rng, 1.0f);
    for (const auto& t : layout.tensors()) {
      const FlatRange in = t.range().Intersect(owned);
      for (uint64_t x = in.begin; x < in.end; ++x) init[x - owned.begin] = values[x - owned.begin];
    }
    for (ShardState* s : {&r, &d}) {
      ASSERT_TRUE(s->WriteMasters(optimizer_.get(), owned.begin, init.data(), DType::kFp32,
                                  owned.size())
                      .ok());
      ASSERT_TRUE(s->RefreshHalfCopy(optimizer_.get()).ok());
    }
    const size_t n = owned.size();
    for (int step = 1; step <= 20; ++step) {
      SCOPED_TRACE(::testing::Message() << "step " << step);
      // Zeros in the alignment gaps, as trainers push them.
      std::vector<float> grad(n, 0.0f);
      const std::vector<float> values = Values(n, rng, 0.1f);
      for (const auto& t : layout.tensors()) {
        const FlatRange in = t.range().Intersect(owned);
        for (uint64_t x = in.begin; x < in.end; ++x) {
          grad[x - owned.begin] = values[x - owned.begin];
        }
      }
      std::vector<StepHyperParams> groups = GroupHyperParams(c);
      for (size_t g = 0; g < groups.size(); ++g) {
        groups[g].lr *= 1.0 + 0.1 * step;
        groups[g].grad_scale = 0.5;
      }
      // Some tensors without a gradient, so that counts drift apart and
      // runs split inside chunks.
      std::vector<uint32_t> no_grad;
      for (uint32_t t = 0; t < kTensors; ++t) {
        if ((t * 5 + static_cast<uint32_t>(step)) % 9 == 0) no_grad.push_back(t);
      }
      ASSERT_TRUE(r.Step(optimizer_.get(), groups, grad.data(), owned, no_grad).ok());
      ASSERT_TRUE(d.Step(optimizer_.get(), groups, grad.data(), owned, no_grad).ok());
      std::vector<float> a(n), b(n);
      ASSERT_TRUE(r.Read(owned.begin, n, DType::kFp32, a.data()).ok());
      ASSERT_TRUE(d.Read(owned.begin, n, DType::kFp32, b.data()).ok());
      ASSERT_TRUE(SameBits(a.data(), b.data(), n * 4)) << "masters";
      if (precision != DType::kFp32) {
        std::vector<uint16_t> ha(n), hb(n);
        ASSERT_TRUE(r.Read(owned.begin, n, precision, ha.data()).ok());
        ASSERT_TRUE(d.Read(owned.begin, n, precision, hb.data()).ok());
        ASSERT_TRUE(SameBits(ha.data(), hb.data(), n * 2)) << "half copy";
      }
      for (StateArrayKind k : {StateArrayKind::kExpAvg, StateArrayKind::kExpAvgSq}) {
        if (k == StateArrayKind::kExpAvgSq && kind == OptimizerKind::kSgdMomentum) continue;
        ASSERT_TRUE(r.ReadArray(k, owned, a.data()).ok());
        ASSERT_TRUE(d.ReadArray(k, owned, b.data()).ok());
        ASSERT_TRUE(SameBits(a.data(), b.data(), n * 4)) << "array " << static_cast<int>(k);
      }
      ASSERT_EQ(r.TensorStepsApart().size(), d.TensorStepsApart().size());
    }
    // The checkpoint form, and a restore of it into a new disk copy.
    const size_t arrays = r.checkpoint_arrays();
    ASSERT_EQ(d.checkpoint_arrays(), arrays);
    std::vector<std::vector<float>> out_r(arrays, std::vector<float>(n));
    std::vector<std::vector<float>> out_d(arrays, std::vector<float>(n));
    std::vector<float*> pr, pd;
    for (size_t i = 0; i < arrays; ++i) {
      pr.push_back(out_r[i].data());
      pd.push_back(out_d[i].data());
    }
    ASSERT_TRUE(r.CopyOut(n, pr.data()).ok());
    ASSERT_TRUE(d.CopyOut(n, pd.data()).ok());
    for (size_t i = 0; i < arrays; ++i) {
      ASSERT_TRUE(SameBits(out_r[i].data(), out_d[i].data(), n * 4)) << "checkpoint array " << i;
    }
    absl::StatusOr<std::unique_ptr<ShardState>> back = Create(c, owned, disk_);
    ASSERT_TRUE(back.ok()) << back.status();
    std::vector<const float*> src(pd.begin(), pd.end());
    ASSERT_TRUE((*back)->Restore(optimizer_.get(), n, src.data(), d.optimizer_steps(),
                                 d.TensorStepsApart())
                    .ok());
    uint64_t h1 = 14695981039346656037ull, h2 = h1;
    d.Hash(h1);
    (*back)->Hash(h2);
    EXPECT_EQ(h1, h2);
    // A state write (new values where tensors are, zeros in the gaps)
    // lands the same way in both.
    const FlatRange part{owned.begin + 1000, owned.begin + 5000};
    std::vector<float> masters = Values(part.size(), rng, 2.0f);
    std::vector<float> held(part.size());
    ASSERT_TRUE(r.ReadArray(StateArrayKind::kMaster, part, held.data()).ok());
    for (size_t i = 0; i < held.size(); ++i) {
      if (held[i] != 0.0f) held[i] = masters[i];
    }
    ASSERT_TRUE(r.CheckWrite(StateArrayKind::kMaster, part, held.data(), "w").ok());
    ASSERT_TRUE(r.WriteArray(optimizer_.get(), StateArrayKind::kMaster, part, held.data()).ok());
    ASSERT_TRUE(d.WriteArray(optimizer_.get(), StateArrayKind::kMaster, part, held.data()).ok());
    absl::StatusOr<bool> holds = d.Holds(StateArrayKind::kMaster, part, held.data());
    ASSERT_TRUE(holds.ok()) << holds.status();
    EXPECT_TRUE(*holds);
    std::vector<float> a(n), b(n);
    ASSERT_TRUE(r.Read(owned.begin, n, DType::kFp32, a.data()).ok());
    ASSERT_TRUE(d.Read(owned.begin, n, DType::kFp32, b.data()).ok());
    EXPECT_TRUE(SameBits(a.data(), b.data(), n * 4));
    if (precision != DType::kFp32) {
      std::vector<uint16_t> ha(n), hb(n);
      ASSERT_TRUE(r.Read(owned.begin, n, precision, ha.data()).ok());
      ASSERT_TRUE(d.Read(owned.begin, n, precision, hb.data()).ok());
      EXPECT_TRUE(SameBits(ha.data(), hb.data(), n * 2));
    }
  }

  // The one state file in the directory (a test with one disk state).
  std::string StateFilePath() const {
    std::string path;
    for (const auto& e : std::filesystem::directory_iterator(dir_path_ + "/states")) {
      if (e.path().filename().string().find(".lock") == std::string::npos) path = e.path();
    }
    return path;
  }

  MemoryLedger ledger_{0};
  std::unique_ptr<ShardOptimizer> optimizer_;
  std::string dir_path_;
  std::unique_ptr<InstanceDirectory> dir_;
  DiskResidence disk_;
};

TEST_F(ShardStateDiskTest, Bf16AdamWMatchesRamBitForBit) {
  TrainBoth(DType::kBf16, OptimizerKind::kAdamW, {0, 1u << 20});
}

TEST_F(ShardStateDiskTest, Fp32AdamWMatchesRamBitForBit) {
  TrainBoth(DType::kFp32, OptimizerKind::kAdamW, {0, 1u << 20});
}

TEST_F(ShardStateDiskTest, SgdMomentumOnAPartitionThatCutsTensorsMatchesRam) {
  disk_.buffers = 3;
  TrainBoth(DType::kFp16, OptimizerKind::kSgdMomentum, {20011, 70017});
}

TEST_F(ShardStateDiskTest, TheLedgerBooksOnlyWhatStaysInRam) {
  const Layout layout = MakeLayout();
  const JobConfig c = MakeConfig(layout, DType::kBf16, OptimizerKind::kAdamW);
  const FlatRange owned{0, layout.total_elements()};
  const CategoryBytes bytes = ShardState::Footprint(c, owned, false, disk_);
  EXPECT_EQ(bytes[static_cast<int>(MemoryCategory::kParamMaster)], 0u);
  EXPECT_EQ(bytes[static_cast<int>(MemoryCategory::kOptimM)], 0u);
  EXPECT_EQ(bytes[static_cast<int>(MemoryCategory::kOptimV)], 0u);
  EXPECT_EQ(bytes[static_cast<int>(MemoryCategory::kParamHalf)], owned.size() * 2);
  EXPECT_EQ(bytes[static_cast<int>(MemoryCategory::kBuffer)], 4u * 3 * 1024 * 4);
  // 12 bytes per owned element, rounded up to whole chunks.
  const uint64_t chunks = (owned.size() + 1023) / 1024;
  EXPECT_EQ(ShardState::DiskFootprint(c, owned, disk_), chunks * 1024 * 12);
  {
    absl::StatusOr<std::unique_ptr<ShardState>> s = Create(c, owned, disk_);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ((*s)->disk_bytes(), chunks * 1024 * 12);
    EXPECT_EQ(ledger_.total(), owned.size() * 2 + 4u * 3 * 1024 * 4);
  }
  EXPECT_EQ(ledger_.total(), 0u);
}

TEST_F(ShardStateDiskTest, ReplicatedJobsStayInRam) {
  const Layout layout = MakeLayout();
  JobConfig c = MakeConfig(layout, DType::kBf16, OptimizerKind::kAdamW);
  c.replicas = 2;
  absl::StatusOr<std::unique_ptr<ShardState>> s = Create(c, {0, 4096}, disk_);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition) << s.status();
}

TEST_F(ShardStateDiskTest, ADirectoryWithoutRoomRefusesTheJobWhole) {
  const Layout layout = MakeLayout();
  const JobConfig c = MakeConfig(layout, DType::kBf16, OptimizerKind::kAdamW);
  ::signal(SIGXFSZ, SIG_IGN);
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  rlimit small = old;
  small.rlim_cur = 64 * 1024;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  absl::StatusOr<std::unique_ptr<ShardState>> s =
      Create(c, {0, layout.total_elements()}, disk_);
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &old), 0);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kResourceExhausted) << s.status();
  EXPECT_NE(s.status().message().find(dir_path_), std::string::npos) << s.status();
  EXPECT_NE(s.status().message().find("disk-job"), std::string::npos) << s.status();
  EXPECT_EQ(ledger_.total(), 0u);
  size_t files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir_path_ + "/states")) {
    if (e.path().filename().string().find(".lock") == std::string::npos) ++files;
  }
  EXPECT_EQ(files, 0u);
}

// A file cut short under the daemon (a failing disk): a step whose reads
// fail before anything was written changes nothing; one that fails after
// it wrote chunks damages the state, and everything that reads or writes
// it from then on is refused with the file named.
TEST_F(ShardStateDiskTest, ATransferThatFailsMidStepDamagesTheState) {
  const Layout layout = MakeLayout();
  const JobConfig c = MakeConfig(layout, DType::kBf16, OptimizerKind::kAdamW);
  const FlatRange owned{0, layout.total_elements()};
  absl::StatusOr<std::unique_ptr<ShardState>> made = Create(c, owned, disk_);
  ASSERT_TRUE(made.ok()) << made.status();
  ShardState& s = **made;
  const std::string path = StateFilePath();
  ASSERT_FALSE(path.empty());
  const std::vector<float> grad(owned.size(), 0.01f);
  const std::vector<StepHyperParams> groups = GroupHyperParams(c);
  ASSERT_TRUE(s.Step(optimizer_.get(), groups, grad.data(), owned, {}).ok());
  // Nothing readable: the first read fails, nothing was written.
  ASSERT_EQ(::truncate(path.c_str(), 0), 0);
  absl::Status first = s.Step(optimizer_.get(), groups, grad.data(), owned, {});
  EXPECT_FALSE(first.ok());
  EXPECT_TRUE(s.damaged().ok()) << s.damaged();
  // Half the chunks readable: the step writes the first half, then fails.
  const uint64_t chunks = (owned.size() + 1023) / 1024;
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(chunks / 2 * 1024 * 12)), 0);
  absl::Status torn = s.Step(optimizer_.get(), groups, grad.data(), owned, {});
  EXPECT_FALSE(torn.ok());
  ASSERT_EQ(s.damaged().code(), absl::StatusCode::kFailedPrecondition) << s.damaged();
  EXPECT_NE(s.damaged().message().find(path), std::string::npos) << s.damaged();
  // The file whole again: still refused, nothing on it is trusted.
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(s.disk_bytes())), 0);
  EXPECT_EQ(s.Step(optimizer_.get(), groups, grad.data(), owned, {}).code(),
            absl::StatusCode::kFailedPrecondition);
  std::vector<float> out(owned.size());
  EXPECT_EQ(s.ReadArray(StateArrayKind::kExpAvg, owned, out.data()).code(),
            absl::StatusCode::kFailedPrecondition);
  std::vector<float*> dst = {out.data(), out.data(), out.data()};
  EXPECT_EQ(s.CopyOut(owned.size(), dst.data()).code(), absl::StatusCode::kFailedPrecondition);
}

// A restore whose first read fails changes nothing; one that fails half way
// damages the state; a state write's -0.0 in a frozen tensor's moments
// (where nothing is kept) holds what is held, as in RAM.
TEST_F(ShardStateDiskTest, RestoresLandWholeOrDamageTheState) {
  const Layout layout = MakeLayout();
  const JobConfig c = MakeConfig(layout, DType::kBf16, OptimizerKind::kAdamW);
  const FlatRange owned{0, layout.total_elements()};
  absl::StatusOr<std::unique_ptr<ShardState>> made = Create(c, owned, disk_);
  ASSERT_TRUE(made.ok()) << made.status();
  ShardState& s = **made;
  const std::string path = StateFilePath();
  // -0.0 in a frozen tensor's moments: nothing held there, nothing changes.
  const auto& frozen = layout.tensors()[3];
  ASSERT_TRUE(frozen.spec.frozen);
  const FlatRange fr = frozen.range();
  std::vector<float> negative_zeros(fr.size(), -0.0f);
  ASSERT_TRUE(s.CheckWrite(StateArrayKind::kExpAvg, fr, negative_zeros.data(), "w").ok());
  absl::StatusOr<bool> holds = s.Holds(StateArrayKind::kExpAvg, fr, negative_zeros.data());
  ASSERT_TRUE(holds.ok()) << holds.status();
  EXPECT_TRUE(*holds);

  const size_t n = owned.size();
  std::vector<std::vector<float>> arrays(3, std::vector<float>(n, 0.5f));
  std::vector<const float*> src = {arrays[0].data(), arrays[1].data(), arrays[2].data()};
  ASSERT_EQ(::truncate(path.c_str(), 0), 0);
  EXPECT_FALSE(s.Restore(optimizer_.get(), n, src.data(), 1, {}).ok());
  EXPECT_TRUE(s.damaged().ok()) << s.damaged();
  EXPECT_EQ(s.optimizer_steps(), 0u);
  const uint64_t chunks = (n + 1023) / 1024;
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(chunks / 2 * 1024 * 12)), 0);
  EXPECT_FALSE(s.Restore(optimizer_.get(), n, src.data(), 1, {}).ok());
  EXPECT_EQ(s.damaged().code(), absl::StatusCode::kFailedPrecondition) << s.damaged();
}

}  // namespace
}  // namespace zeroshard
