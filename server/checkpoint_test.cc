// Checkpoints on in-process daemons over gRPC: save/complete/load restores
// the state bit for bit; a load re-slices onto another partitioning; a
// corrupted byte, a missing part, a full disk and bad names each get their
// code and message and change nothing.

#include <sys/resource.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "client/checkpoint_driver.h"
#include "common/channel.h"
#include "common/checkpoint_files.h"
#include "common/crc32c.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "server/daemon.h"
#include "server/testing/daemon_fixture.h"

namespace zeroshard {
namespace {

using testing::ExpectRejected;
using testing::RandomVector;
using testing::TestCluster;

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/zs-checkpoint-test-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Trains `steps` steps from step `from` + 1 with gradients drawn from `rng`;
  // in the i-th of them every rank marks the tensors no_grad[i] (if given)
  // as without a gradient.
  static void Train(TestCluster& c, uint32_t world, uint64_t from, int steps, std::mt19937& rng,
                    const std::vector<std::vector<uint32_t>>& no_grad = {}) {
    for (uint64_t step = from + 1; step <= from + steps; ++step) {
      std::vector<std::vector<float>> grads;
      for (uint32_t r = 0; r < world; ++r) grads.push_back(RandomVector(rng, c.total(), 0.1f));
      const size_t i = step - from - 1;
      c.PushAll(step, grads, i < no_grad.size() ? no_grad[i] : std::vector<uint32_t>());
      c.Step(step, 0.01f, 1.0f);
    }
  }

  static grpc::Status Save(TestCluster& c, int d, const std::string& name, uint64_t step,
                           v1::SaveCheckpointResponse* out = nullptr) {
    v1::SaveCheckpointRequest req;
    req.set_job_id(c.job());
    req.set_name(name);
    req.set_step(step);
    v1::SaveCheckpointResponse resp;
    grpc::ClientContext ctx;
    grpc::Status s = c.client(d).checkpoint->SaveCheckpoint(&ctx, req, &resp);
    if (out != nullptr) *out = resp;
    return s;
  }

  static v1::CheckpointStatus WaitWritten(TestCluster& c, int d, const std::string& name) {
    v1::GetCheckpointStatusRequest req;
    req.set_job_id(c.job());
    req.set_name(name);
    req.set_wait_ms(30000);
    v1::CheckpointStatus st;
    grpc::ClientContext ctx;
    grpc::Status s = c.client(d).checkpoint->GetCheckpointStatus(&ctx, req, &st);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return st;
  }

  static grpc::Status Complete(TestCluster& c, const std::string& name,
                               const std::vector<v1::PartManifest>& parts, int d) {
    v1::CompleteCheckpointRequest req;
    req.set_job_id(c.job());
    req.set_name(name);
    for (const auto& p : parts) *req.add_parts() = p;
    v1::CompleteCheckpointResponse resp;
    grpc::ClientContext ctx;
    return c.client(d).checkpoint->CompleteCheckpoint(&ctx, req, &resp);
  }

  // A whole save on every daemon of the cluster.
  static void SaveAll(TestCluster& c, const std::string& name, uint64_t step) {
    c.SaveCheckpoint(name, step);
  }

  static grpc::Status Load(TestCluster& c, int d, const std::string& name,
                           v1::LoadCheckpointResponse* out = nullptr) {
    v1::LoadCheckpointRequest req;
    req.set_job_id(c.job());
    req.set_name(name);
    v1::LoadCheckpointResponse resp;
    grpc::ClientContext ctx;
    grpc::Status s = c.client(d).checkpoint->LoadCheckpoint(&ctx, req, &resp);
    if (out != nullptr) *out = resp;
    return s;
  }

  static uint64_t Hash(TestCluster& c, int d) {
    return (*c.daemon(d).jobs().Find(c.job()))->StateHash();
  }

  std::string dir_;
};

class CheckpointPrecisionTest : public CheckpointTest,
                                public ::testing::WithParamInterface<v1::DType> {};

// The half-precision copy is not saved: a load recomputes it from the
// masters, equal to what the optimizer wrote.
TEST_P(CheckpointPrecisionTest, LoadRestoresTheSavedStateBitForBit) {
  TestCluster c(2, 2, 3, "restore", dir_, GetParam());
  std::mt19937 rng(1);
  c.Init(RandomVector(rng, c.total(), 1.0f));
  Train(c, 2, 0, 3, rng);
  const uint64_t h0 = Hash(c, 0), h1 = Hash(c, 1);
  const std::vector<float> saved = c.GatherAll(3);
  SaveAll(c, "s3", 3);
  Train(c, 2, 3, 2, rng);
  ASSERT_NE(Hash(c, 0), h0);
  for (int d = 0; d < 2; ++d) {
    v1::LoadCheckpointResponse r;
    grpc::Status s = Load(c, d, "latest", &r);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(r.name(), "s3");
    EXPECT_EQ(r.step(), 3u);
  }
  EXPECT_EQ(Hash(c, 0), h0);
  EXPECT_EQ(Hash(c, 1), h1);
  EXPECT_EQ(c.GatherAll(3), saved);
  // Training goes on from the loaded step.
  Train(c, 2, 3, 1, rng);
}

INSTANTIATE_TEST_SUITE_P(Precisions, CheckpointPrecisionTest,
                         ::testing::Values(v1::DTYPE_FP32, v1::DTYPE_BF16, v1::DTYPE_FP16));

// Daemons whose job's ranks all fell silent past --job_idle_timeout_seconds
// (a crashed run) save it before removing it: each daemon writes its part
// of "idle-step-N" (no client is there to complete it: ListCheckpoints
// offers the parts as pending); the client of the run that resumes (the
// same job registered again) completes the checkpoint from every daemon's
// part and loads it: the state the silent job had, bit for bit.
TEST_F(CheckpointTest, AnIdleJobIsSavedBeforeItsRemovalAndResumes) {
  auto idle = [](DaemonOptions& o) {
    o.rank_timeout = absl::Milliseconds(300);
    o.job_idle_timeout = absl::Milliseconds(600);
  };
  TestCluster c(2, 2, 3, "idle", dir_, v1::DTYPE_FP32, false, "", 1024, false, idle);
  std::mt19937 rng(7);
  c.Init(RandomVector(rng, c.total(), 1.0f));
  Train(c, 2, 0, 3, rng);
  const uint64_t h0 = Hash(c, 0), h1 = Hash(c, 1);
  const std::vector<float> before = c.GatherAll(3);

  // Silence: each daemon saves its part and removes the job.
  const absl::Time until = absl::Now() + absl::Seconds(30);
  while ((c.daemon(0).jobs().size() != 0 || c.daemon(1).jobs().size() != 0) &&
         absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_EQ(c.daemon(0).jobs().size() + c.daemon(1).jobs().size(), 0u) << "the idle job stayed";
  for (int d = 0; d < 2; ++d) {
    v1::ListCheckpointsRequest req;
    req.set_job_id(c.job());
    v1::ListCheckpointsResponse list;
    grpc::ClientContext ctx;
    const grpc::Status s = c.client(d).checkpoint->ListCheckpoints(&ctx, req, &list);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(list.checkpoints_size(), 0) << list.ShortDebugString();
    // The daemons share the directory here: each lists both parts.
    ASSERT_EQ(list.pending_size(), 2) << list.ShortDebugString();
    std::set<uint32_t> parts;
    for (const v1::PendingCheckpointPart& p : list.pending()) {
      EXPECT_EQ(p.name(), "idle-step-3");
      EXPECT_EQ(p.part().state().committed_step(), 3u);
      parts.insert(p.part().daemon_index());
    }
    EXPECT_EQ(parts, (std::set<uint32_t>{0, 1}));
  }

  // The run restarts: the job registered again, its ranks joined.
  std::vector<std::string> addresses;
  for (int d = 0; d < 2; ++d) {
    ASSERT_TRUE(c.client(d).Register(c.spec(), d).ok());
    ASSERT_TRUE(c.client(d).JoinAll(c.spec()).ok());
    addresses.push_back(c.daemon(d).address());
  }
  std::unique_ptr<CheckpointDriver> driver = CheckpointDriver::Connect(
      c.job(), addresses, ChannelSecurity::Plaintext(testing::kTestToken));
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  absl::StatusOr<std::vector<v1::CheckpointInfo>> listed = driver->List(deadline);
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].name(), "idle-step-3");
  EXPECT_EQ((*listed)[0].step(), 3u);
  absl::StatusOr<LatestLoad> loaded = driver->LoadLatestVerified(deadline);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->loaded.name(), "idle-step-3");
  EXPECT_EQ(loaded->loaded.step(), 3u);
  EXPECT_EQ(c.GatherAll(3), before);
  EXPECT_EQ(Hash(c, 0), h0);
  EXPECT_EQ(Hash(c, 1), h1);
  Train(c, 2, 3, 1, rng);  // training goes on
}

// A job of one daemon is its own whole checkpoint: the daemon writes the
// MANIFEST too. A job idle at a step the trainers saved is not saved again.
TEST_F(CheckpointTest, AnIdleJobOfOneDaemonIsSavedComplete) {
  auto idle = [](DaemonOptions& o) {
    o.rank_timeout = absl::Milliseconds(300);
    o.job_idle_timeout = absl::Milliseconds(600);
  };
  for (const bool saved_by_trainers : {false, true}) {
    SCOPED_TRACE(saved_by_trainers ? "saved by the trainers" : "not saved");
    const std::string job = saved_by_trainers ? "idle-one-saved" : "idle-one";
    TestCluster c(1, 1, 2, job, dir_, v1::DTYPE_FP32, false, "", 1024, false, idle);
    std::mt19937 rng(9);
    c.Init(RandomVector(rng, c.total(), 1.0f));
    Train(c, 1, 0, 2, rng);
    if (saved_by_trainers) SaveAll(c, "s2", 2);
    const absl::Time until = absl::Now() + absl::Seconds(30);
    while (c.daemon(0).jobs().size() != 0 && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(50));
    }
    ASSERT_EQ(c.daemon(0).jobs().size(), 0u);
    absl::StatusOr<std::vector<v1::CheckpointManifest>> complete =
        ListCompleteCheckpoints(dir_, job);
    ASSERT_TRUE(complete.ok()) << complete.status();
    ASSERT_EQ(complete->size(), 1u);
    EXPECT_EQ((*complete)[0].name(), saved_by_trainers ? "s2" : "idle-step-2");
    EXPECT_EQ((*complete)[0].state().committed_step(), 2u);
    absl::StatusOr<std::vector<PendingPart>> pending = ListPendingParts(dir_, job);
    ASSERT_TRUE(pending.ok()) << pending.status();
    EXPECT_TRUE(pending->empty());
  }
}

TEST_F(CheckpointTest, LoadReslicesOntoAnotherPartitioning) {
  std::vector<float> saved;
  uint64_t saved_steps = 0;
  {
    TestCluster c(2, 4, 2, "reshard", dir_);
    std::mt19937 rng(2);
    c.Init(RandomVector(rng, c.total(), 1.0f));
    Train(c, 4, 0, 2, rng);
    saved = c.GatherAll(2);
    SaveAll(c, "s2", 2);
    saved_steps = 2;
  }
  for (const auto& [daemons, world] : std::vector<std::pair<int, uint32_t>>{{1, 2}, {3, 3}}) {
    TestCluster c(daemons, world, 3, "reshard", dir_);
    for (int d = 0; d < daemons; ++d) {
      grpc::Status s = Load(c, d, "s2");
      ASSERT_TRUE(s.ok()) << s.error_message();
    }
    EXPECT_EQ(c.GatherAll(saved_steps), saved) << daemons << " daemons, N_d " << world;
    std::mt19937 rng(3);
    Train(c, world, saved_steps, 1, rng);
  }
}

// Update counts that lag the commit count (tensors that got no gradient in
// some steps) are saved with each part and restored, also onto another
// partitioning, where a tensor's count may come from another daemon's part.
TEST_F(CheckpointTest, TensorStepCountsSurviveSaveAndLoad) {
  // SampleLayout: embed, l1.w, l1.b, big.w, big.b, head. big.b has no
  // gradient in step 1, l1.b none in steps 2 and 3.
  const std::vector<std::vector<uint32_t>> no_grad = {{4}, {2}, {2}};
  const std::map<uint32_t, uint64_t> expected = {{0, 3}, {1, 3}, {2, 1},
                                                 {3, 3}, {4, 2}, {5, 3}};
  std::vector<float> saved;
  {
    TestCluster c(2, 2, 2, "counts", dir_);
    std::mt19937 rng(7);
    c.Init(RandomVector(rng, c.total(), 1.0f));
    Train(c, 2, 0, 3, rng, no_grad);
    ASSERT_EQ(c.TensorSteps(), expected);
    const uint64_t h0 = Hash(c, 0), h1 = Hash(c, 1);
    saved = c.GatherAll(3);
    SaveAll(c, "s3", 3);
    // Two steps with every gradient: every count moves on.
    Train(c, 2, 3, 2, rng);
    ASSERT_EQ(c.TensorSteps(), (std::map<uint32_t, uint64_t>{{0, 5}, {1, 5}, {2, 3},
                                                              {3, 5}, {4, 4}, {5, 5}}));
    for (int d = 0; d < 2; ++d) {
      grpc::Status s = Load(c, d, "s3");
      ASSERT_TRUE(s.ok()) << s.error_message();
    }
    EXPECT_EQ(c.TensorSteps(), expected);
    EXPECT_EQ(Hash(c, 0), h0);
    EXPECT_EQ(Hash(c, 1), h1);
  }
  for (const auto& [daemons, world] : std::vector<std::pair<int, uint32_t>>{{1, 2}, {3, 3}}) {
    SCOPED_TRACE(::testing::Message() << daemons << " daemons, N_d " << world);
    TestCluster c(daemons, world, 2, "counts", dir_);
    for (int d = 0; d < daemons; ++d) {
      grpc::Status s = Load(c, d, "s3");
      ASSERT_TRUE(s.ok()) << s.error_message();
    }
    EXPECT_EQ(c.TensorSteps(), expected);
    EXPECT_EQ(c.GatherAll(3), saved);
    // A step with l1.b still without a gradient keeps its count.
    std::mt19937 rng(8);
    Train(c, world, 3, 1, rng, {{2}});
    EXPECT_EQ(c.TensorSteps(), (std::map<uint32_t, uint64_t>{{0, 4}, {1, 4}, {2, 1},
                                                              {3, 4}, {4, 3}, {5, 4}}));
  }
}

TEST_F(CheckpointTest, CorruptionMissingPartsAndBadNamesChangeNothing) {
  TestCluster c(2, 2, 2, "damage", dir_);
  std::mt19937 rng(4);
  c.Init(RandomVector(rng, c.total(), 1.0f));
  Train(c, 2, 0, 1, rng);
  SaveAll(c, "good", 1);
  SaveAll(c, "bad", 1);
  Train(c, 2, 1, 1, rng);  // the state now differs from both checkpoints

  // One flipped byte in part 1's moments.
  const std::string victim = CheckpointPartDir(dir_, "damage", "bad", 1) + "/exp_avg.f32";
  {
    std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(17);
    f.put('\x5a');
  }
  ExpectRejected(c.daemon(1), "damage", grpc::StatusCode::DATA_LOSS, "exp_avg.f32",
                 [&] { return Load(c, 1, "bad"); });
  // An incomplete checkpoint: the manifest of "good" gone.
  const std::string manifest = CheckpointDir(dir_, "damage", "good") + "/MANIFEST";
  std::filesystem::rename(manifest, manifest + ".away");
  ExpectRejected(c.daemon(0), "damage", grpc::StatusCode::FAILED_PRECONDITION, "incomplete",
                 [&] { return Load(c, 0, "good"); });
  std::filesystem::rename(manifest + ".away", manifest);
  // A missing part file.
  const std::string part = CheckpointPartDir(dir_, "damage", "good", 0) + "/master.f32";
  std::filesystem::rename(part, part + ".away");
  ExpectRejected(c.daemon(0), "damage", grpc::StatusCode::FAILED_PRECONDITION,
                 "master.f32 (missing)", [&] { return Load(c, 0, "good"); });
  std::filesystem::rename(part + ".away", part);
  ExpectRejected(c.daemon(0), "damage", grpc::StatusCode::NOT_FOUND, "no such checkpoint",
                 [&] { return Load(c, 0, "never"); });

  const std::vector<std::string> bad_names = {"", "..", ".", "a/b", "../x", "latest",
                                              std::string(129, 'n')};
  for (const std::string& name : bad_names) {
    ExpectRejected(c.daemon(0), "damage", grpc::StatusCode::INVALID_ARGUMENT, "name:",
                   [&] { return Save(c, 0, name, 2); });
  }
  ExpectRejected(c.daemon(0), "damage", grpc::StatusCode::INVALID_ARGUMENT, "name:",
                 [&] { return Load(c, 0, "../good"); });
  ExpectRejected(c.daemon(0), "damage", grpc::StatusCode::FAILED_PRECONDITION,
                 "has committed step 2, asked to save 1", [&] { return Save(c, 0, "x", 1); });
  ExpectRejected(c.daemon(0), "damage", grpc::StatusCode::ALREADY_EXISTS, "complete",
                 [&] { return Save(c, 0, "good", 2); });
  // Parts that do not tile the flat space.
  std::vector<v1::PartManifest> parts(2);
  ExpectRejected(c.daemon(0), "damage", grpc::StatusCode::FAILED_PRECONDITION, "has not written",
                 [&] { return Complete(c, "nothing", parts, 0); });

  // Verify reads a part whole: the flipped byte is found, the good part passes.
  auto verify = [&](const std::string& name, uint32_t part) {
    v1::VerifyCheckpointRequest req;
    req.set_job_id("damage");
    req.set_name(name);
    req.set_daemon_index(part);
    v1::VerifyCheckpointResponse resp;
    grpc::ClientContext ctx;
    return c.client(0).checkpoint->VerifyCheckpoint(&ctx, req, &resp);
  };
  ExpectRejected(c.daemon(0), "damage", grpc::StatusCode::DATA_LOSS, "exp_avg.f32",
                 [&] { return verify("bad", 1); });
  ExpectRejected(c.daemon(0), "damage", grpc::StatusCode::INVALID_ARGUMENT, "has 2 parts",
                 [&] { return verify("good", 2); });
  EXPECT_TRUE(verify("good", 1).ok());
  // Status: a wait past the limit, a name never saved, a job not here.
  auto status = [&](const std::string& job, const std::string& name, uint32_t wait_ms) {
    v1::GetCheckpointStatusRequest req;
    req.set_job_id(job);
    req.set_name(name);
    req.set_wait_ms(wait_ms);
    v1::CheckpointStatus st;
    grpc::ClientContext ctx;
    return c.client(0).checkpoint->GetCheckpointStatus(&ctx, req, &st);
  };
  ExpectRejected(c.daemon(0), "damage", grpc::StatusCode::INVALID_ARGUMENT, "wait_ms",
                 [&] { return status("damage", "good", 4000000000u); });
  ExpectRejected(c.daemon(0), "damage", grpc::StatusCode::NOT_FOUND, "no save of checkpoint",
                 [&] { return status("damage", "other", 0); });
  ExpectRejected(c.daemon(0), "damage", grpc::StatusCode::NOT_FOUND, "not registered",
                 [&] { return status("stranger", "good", 0); });
  ExpectRejected(c.daemon(0), "damage", grpc::StatusCode::INVALID_ARGUMENT, "job_id", [&] {
    v1::ListCheckpointsRequest req;
    req.set_job_id("..");
    v1::ListCheckpointsResponse resp;
    grpc::ClientContext ctx;
    return c.client(0).checkpoint->ListCheckpoints(&ctx, req, &resp);
  });
  // Completing with another daemon's part in this daemon's place.
  std::vector<v1::PartManifest> swapped = {WaitWritten(c, 0, "bad").part(),
                                           WaitWritten(c, 0, "bad").part()};
  swapped[1].set_daemon_index(1);
  ExpectRejected(c.daemon(1), "damage", grpc::StatusCode::INVALID_ARGUMENT,
                 "differs from the part this daemon wrote",
                 [&] { return Complete(c, "bad", swapped, 1); });

  // The good checkpoint still loads, and restores what it saved.
  for (int d = 0; d < 2; ++d) {
    grpc::Status s = Load(c, d, "good");
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
}

// A MANIFEST written by whoever can write the checkpoint directory, with a
// block size of 2^62: Verify and Load answer DATA_LOSS naming the field (not
// UNKNOWN from an allocation that throws), and the daemon serves the next
// request.
TEST_F(CheckpointTest, HostileManifestIsDataLossAndTheDaemonServesOn) {
  TestCluster c(2, 2, 2, "hostile", dir_);
  std::mt19937 rng(9);
  c.Init(RandomVector(rng, c.total(), 1.0f));
  Train(c, 2, 0, 1, rng);
  SaveAll(c, "good", 1);
  SaveAll(c, "evil", 1);
  Train(c, 2, 1, 1, rng);
  const std::string dir = CheckpointDir(dir_, "hostile", "evil");
  v1::CheckpointManifest m;
  ASSERT_TRUE(ReadProtoFile(dir + "/MANIFEST", &m).ok());
  m.mutable_parts(0)->mutable_files(0)->set_block_bytes(uint64_t{1} << 62);
  ASSERT_TRUE(WriteProtoFile(dir, kManifestFile, m).ok());

  auto verify = [&](const std::string& name, uint32_t part) {
    v1::VerifyCheckpointRequest req;
    req.set_job_id("hostile");
    req.set_name(name);
    req.set_daemon_index(part);
    v1::VerifyCheckpointResponse resp;
    grpc::ClientContext ctx;
    return c.client(0).checkpoint->VerifyCheckpoint(&ctx, req, &resp);
  };
  ExpectRejected(c.daemon(0), "hostile", grpc::StatusCode::DATA_LOSS,
                 "MANIFEST part 0 file 0 (master.f32) has block_bytes 4611686018427387904",
                 [&] { return verify("evil", 0); });
  ExpectRejected(c.daemon(0), "hostile", grpc::StatusCode::DATA_LOSS, "block_bytes",
                 [&] { return Load(c, 0, "evil"); });
  // "latest" lists every complete checkpoint: the hostile one names itself.
  ExpectRejected(c.daemon(0), "hostile", grpc::StatusCode::DATA_LOSS, "hostile/evil",
                 [&] { return verify("latest", 0); });
  // A spec whose flat space is not the partition map's.
  m.mutable_parts(0)->mutable_files(0)->set_block_bytes(kCheckpointBlockBytes);
  m.mutable_partition_map()->set_total_elements(c.total() + 64);
  ASSERT_TRUE(WriteProtoFile(dir, kManifestFile, m).ok());
  ExpectRejected(c.daemon(0), "hostile", grpc::StatusCode::DATA_LOSS,
                 "partition_map.total_elements", [&] { return verify("evil", 1); });
  // A layout one tensor short under the job's fingerprint, its last part's
  // files cut to it with their CRC-32Cs recomputed: every length checks, but
  // the parts do not cover what this daemon owns.
  ASSERT_TRUE(ReadProtoFile(CheckpointDir(dir_, "hostile", "good") + "/MANIFEST", &m).ok());
  m.set_name("evil");
  m.mutable_spec()->mutable_layout()->mutable_tensors()->RemoveLast();
  absl::StatusOr<Layout> shorter = LayoutFromProto(m.spec().layout());
  ASSERT_TRUE(shorter.ok()) << shorter.status();
  const uint64_t total = shorter->total_elements();
  ASSERT_LT(total, c.total());
  m.mutable_partition_map()->set_total_elements(total);
  v1::PartManifest* last = m.mutable_parts(1);
  ASSERT_LT(last->range().begin(), total);
  last->mutable_range()->set_end(total);
  for (v1::CheckpointFile& f : *last->mutable_files()) {
    const std::string path = CheckpointPartDir(dir_, "hostile", "evil", 1) + "/" + f.name();
    f.set_bytes((total - last->range().begin()) * 4);
    std::filesystem::resize_file(path, f.bytes());
    std::ifstream in(path, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    ASSERT_EQ(bytes.size(), f.bytes());
    ASSERT_LE(f.bytes(), kCheckpointBlockBytes);
    f.set_crc32c(Crc32c(bytes.data(), bytes.size()));
    f.clear_block_crc32c();
    f.add_block_crc32c(f.crc32c());
  }
  ASSERT_TRUE(WriteProtoFile(dir, kManifestFile, m).ok());
  ASSERT_TRUE(verify("evil", 1).ok());
  ExpectRejected(c.daemon(1), "hostile", grpc::StatusCode::FAILED_PRECONDITION,
                 absl::StrCat("checkpoint hostile/evil spans ", total,
                              " elements, this job's layout ", c.total()),
                 [&] { return Load(c, 1, "evil"); });
  // The daemon serves on.
  std::filesystem::remove_all(dir);
  grpc::Status s = verify("good", 0);
  EXPECT_TRUE(s.ok()) << s.error_message();
  s = Load(c, 1, "good");
  EXPECT_TRUE(s.ok()) << s.error_message();
}

// CompleteCheckpoint writes the other daemons' parts into MANIFEST: a part
// with a hostile block size, or a range other than its daemon's (still tiling
// the flat space, its files sized to it), is refused and no MANIFEST written.
TEST_F(CheckpointTest, CompleteRefusesOtherDaemonsHostileParts) {
  TestCluster c(3, 3, 2, "parts", dir_);
  std::mt19937 rng(10);
  c.Init(RandomVector(rng, c.total(), 1.0f));
  Train(c, 3, 0, 1, rng);
  std::vector<v1::PartManifest> parts;
  for (int d = 0; d < 3; ++d) {
    grpc::Status s = Save(c, d, "s1", 1);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  for (int d = 0; d < 3; ++d) parts.push_back(WaitWritten(c, d, "s1").part());
  const std::string manifest = CheckpointDir(dir_, "parts", "s1") + "/MANIFEST";

  std::vector<v1::PartManifest> huge_blocks = parts;
  huge_blocks[1].mutable_files(1)->set_block_bytes(uint64_t{1} << 62);
  ExpectRejected(c.daemon(0), "parts", grpc::StatusCode::INVALID_ARGUMENT,
                 "parts: checkpoint parts/s1: MANIFEST part 1 file 1 (exp_avg.f32) has "
                 "block_bytes 4611686018427387904",
                 [&] { return Complete(c, "s1", huge_blocks, 0); });
  EXPECT_FALSE(std::filesystem::exists(manifest));

  // Move 64 elements from part 2 to part 1.
  std::vector<v1::PartManifest> shifted = parts;
  const uint64_t cut = shifted[1].range().end() + 64;
  shifted[1].mutable_range()->set_end(cut);
  shifted[2].mutable_range()->set_begin(cut);
  for (int d : {1, 2}) {
    const v1::FlatRange& r = shifted[d].range();
    for (v1::CheckpointFile& f : *shifted[d].mutable_files()) {
      f.set_bytes((r.end() - r.begin()) * 4);
    }
  }
  ExpectRejected(c.daemon(0), "parts", grpc::StatusCode::INVALID_ARGUMENT,
                 absl::StrCat("parts[1].range: [", parts[1].range().begin(), ", ", cut,
                              "), daemon 1 of job parts owns [", parts[1].range().begin(), ", ",
                              parts[1].range().end(), ")"),
                 [&] { return Complete(c, "s1", shifted, 0); });
  EXPECT_FALSE(std::filesystem::exists(manifest));

  // The parts as written complete it.
  for (int d = 0; d < 3; ++d) {
    grpc::Status s = Complete(c, "s1", parts, d);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  EXPECT_TRUE(std::filesystem::exists(manifest));
}

TEST_F(CheckpointTest, FullDiskIsResourceExhaustedAndKeepsThePreviousCheckpoint) {
  TestCluster c(1, 1, 1, "full", dir_);
  std::mt19937 rng(5);
  c.Init(RandomVector(rng, c.total(), 1.0f));
  Train(c, 1, 0, 1, rng);
  SaveAll(c, "first", 1);
  Train(c, 1, 1, 1, rng);
  // Files may grow to 1 KiB: the next save's first array does not fit. The
  // signal would end the process; the daemon ignores it (server/main.cc).
  auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  rlimit old;
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  rlimit small = old;
  small.rlim_cur = 1024;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  grpc::Status s = Save(c, 0, "second", 2);
  v1::CheckpointStatus st = WaitWritten(c, 0, "second");
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &old), 0);
  std::signal(SIGXFSZ, old_handler);
  ASSERT_TRUE(s.ok()) << s.error_message();  // the snapshot was taken
  EXPECT_EQ(st.state(), v1::CheckpointStatus::STATE_FAILED);
  EXPECT_EQ(st.error_code(), static_cast<int>(absl::StatusCode::kResourceExhausted)) << st.error();
  EXPECT_NE(st.error().find("full"), std::string::npos) << st.error();
  // Nothing half-written is left under the final names.
  EXPECT_FALSE(std::filesystem::exists(CheckpointPartDir(dir_, "full", "second", 0) + "/PART"));
  // The previous checkpoint is intact and loads.
  s = Load(c, 0, "latest");
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(c.GatherAll(1).size(), c.total());
}

TEST_F(CheckpointTest, WithoutCheckpointDirSavesAreRefused) {
  TestCluster c(1, 1, 1, "nodir");
  std::mt19937 rng(6);
  c.Init(RandomVector(rng, c.total(), 1.0f));
  ExpectRejected(c.daemon(0), "nodir", grpc::StatusCode::FAILED_PRECONDITION,
                 "without --checkpoint_dir", [&] { return Save(c, 0, "x", 0); });
  ExpectRejected(c.daemon(0), "nodir", grpc::StatusCode::FAILED_PRECONDITION,
                 "without --checkpoint_dir", [&] { return Load(c, 0, "latest"); });
}

}  // namespace
}  // namespace zeroshard
