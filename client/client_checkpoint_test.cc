// The Client's checkpoints against in-process daemons: a save completes in
// the background and lists; a new trainer resumes from "latest" with the
// saved parameters and step; a step the previous leader committed on only
// some daemons is finished identically by the next leader.

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <thread>
#include <vector>

#include "client/checkpoint_driver.h"
#include "client/client.h"
#include "client/testing/training_data.h"
#include "gtest/gtest.h"
#include "server/daemon.h"
#include "server/testing/daemon_fixture.h"

namespace zeroshard {
namespace {

using testing::DaemonClient;
using testing::SampleLayout;

std::unique_ptr<Daemon> StartDaemon(const std::string& checkpoint_dir) {
  return testing::StartDaemon(0, 1, checkpoint_dir);
}

ClientConfig MakeConfig(const std::string& job, const std::vector<std::string>& daemons,
                        uint32_t rank = 0) {
  ClientConfig c;
  c.job_token = testing::kTestToken;
  c.daemons = daemons;
  c.job_id = job;
  c.rank = rank;
  c.world_size = static_cast<uint32_t>(daemons.size());
  c.stage = 3;
  c.precision = DType::kFp32;
  c.bucket_bytes = 4096;
  c.optimizer.lr = 1e-2f;
  c.max_grad_norm = 1.0f;
  c.rpc_timeout = absl::Seconds(10);
  c.step_timeout = absl::Seconds(20);
  c.io_threads = 2;
  c.heartbeat_interval = absl::ZeroDuration();
  return c;
}

// Runs fn(rank) for every rank on its own thread.
void RunRanks(uint32_t world, const std::function<void(uint32_t)>& fn) {
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < world; ++r) threads.emplace_back(fn, r);
  for (auto& t : threads) t.join();
}

// Creates and registers one client per rank, concurrently.
std::vector<std::unique_ptr<Client>> ConnectAll(const std::vector<ClientConfig>& configs,
                                                const Layout& layout, const float* init,
                                                absl::StatusCode expect = absl::StatusCode::kOk) {
  std::vector<std::unique_ptr<Client>> clients(configs.size());
  RunRanks(static_cast<uint32_t>(configs.size()), [&](uint32_t r) {
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Create(configs[r]);
    ASSERT_TRUE(c.ok()) << c.status();
    absl::Status s = (*c)->RegisterModel(layout, init);
    EXPECT_EQ(s.code(), expect) << s;
    clients[r] = *std::move(c);
  });
  return clients;
}

// One training step of every rank.
void TrainStep(std::vector<std::unique_ptr<Client>>& clients, const Layout& layout) {
  RunRanks(static_cast<uint32_t>(clients.size()), [&](uint32_t r) {
    Client& client = *clients[r];
  std::vector<float> params(layout.total_elements());
  ASSERT_TRUE(client.GatherAll(params.data(), DType::kFp32).ok());
  std::vector<float> grad(params.size());
  testing::ComputeGradient(params.data(), 0, params.size(), r, client.committed_step() + 1,
                           grad.data());
  auto ticket = client.PushGradients({0, params.size()}, grad.data(), DType::kFp32);
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  absl::StatusOr<StepResult> result = client.Step(0.01f);
  ASSERT_TRUE(result.ok()) << result.status();
  });
}

std::vector<ClientConfig> Configs(const std::string& job,
                                  const std::vector<std::string>& addresses,
                                  const std::string& resume = "") {
  std::vector<ClientConfig> out;
  for (uint32_t r = 0; r < addresses.size(); ++r) {
    out.push_back(MakeConfig(job, addresses, r));
    out.back().resume = resume;
  }
  return out;
}

std::vector<float> Gather(Client& client) {
  std::vector<float> out(client.total_elements());
  EXPECT_TRUE(client.GatherAll(out.data(), DType::kFp32).ok());
  return out;
}

class ClientCheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/zs-client-checkpoint-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  // Starts n daemons writing checkpoints under dir_; their addresses.
  std::vector<std::string> StartDaemons(int n, std::vector<std::unique_ptr<Daemon>>* daemons) {
    std::vector<std::string> addresses;
    for (int i = 0; i < n; ++i) {
      daemons->push_back(StartDaemon(dir_));
      addresses.push_back(daemons->back()->address());
    }
    return addresses;
  }
  std::string dir_;
};

TEST_F(ClientCheckpointTest, SaveInTheBackgroundThenResumeFromLatest) {
  std::vector<std::unique_ptr<Daemon>> daemons;
  const std::vector<std::string> addresses = StartDaemons(2, &daemons);
  const Layout layout = SampleLayout();
  const std::vector<float> init = testing::InitialParams(layout);
  std::vector<float> saved;
  {
    auto clients = ConnectAll(Configs("ck", addresses), layout, init.data());
    Client& leader = *clients[0];
    EXPECT_FALSE(leader.resumed_from().has_value());
    EXPECT_EQ(leader.AwaitCheckpoint().status().code(), absl::StatusCode::kFailedPrecondition);
    for (int i = 0; i < 2; ++i) TrainStep(clients, layout);
    saved = Gather(leader);
    absl::StatusOr<CheckpointStarted> started = leader.SaveCheckpoint("two");
    ASSERT_TRUE(started.ok()) << started.status();
    EXPECT_EQ(started->step, 2u);
    EXPECT_GT(started->bytes, 0u);
    // The next step runs while the daemons write.
    TrainStep(clients, layout);
    absl::StatusOr<CheckpointCompleted> done = leader.AwaitCheckpoint();
    ASSERT_TRUE(done.ok()) << done.status();
    EXPECT_EQ(done->step, 2u);
    EXPECT_EQ(done->bytes, started->bytes);
    EXPECT_EQ(leader.SaveCheckpoint("bad/name").status().code(),
              absl::StatusCode::kInvalidArgument);
    absl::StatusOr<std::vector<v1::CheckpointInfo>> list = leader.ListCheckpoints();
    ASSERT_TRUE(list.ok()) << list.status();
    ASSERT_EQ(list->size(), 1u);
    EXPECT_EQ((*list)[0].name(), "two");
    EXPECT_EQ((*list)[0].step(), 2u);
    for (auto& c : clients) ASSERT_TRUE(c->Leave().ok());
  }
  // New trainers on the same daemons (the job was freed when they left).
  auto clients = ConnectAll(Configs("ck", addresses, "latest"), layout, init.data());
  ASSERT_TRUE(clients[0]->resumed_from().has_value());
  EXPECT_EQ(clients[0]->resumed_from()->name(), "two");
  for (auto& c : clients) EXPECT_EQ(c->committed_step(), 2u);
  EXPECT_EQ(Gather(*clients[1]), saved);
  TrainStep(clients, layout);
  EXPECT_EQ(clients[0]->committed_step(), 3u);
}

TEST_F(ClientCheckpointTest, ResumeFromLatestWithNoneStartsFresh) {
  auto daemon = StartDaemon(dir_);
  const Layout layout = SampleLayout();
  const std::vector<float> init = testing::InitialParams(layout);
  auto clients = ConnectAll(Configs("fresh", {daemon->address()}, "latest"), layout, init.data());
  EXPECT_FALSE(clients[0]->resumed_from().has_value());
  EXPECT_EQ(Gather(*clients[0]), init);
  // A named checkpoint that does not exist is an error.
  ConnectAll(Configs("fresh2", {daemon->address()}, "nope"), layout, init.data(),
             absl::StatusCode::kNotFound);
}

// A newest checkpoint damaged on disk is passed over by resume = "latest"
// (said in resume_skipped()), which resumes from the one before; it does
// not verify (nor load, DataLoss, when named).
TEST_F(ClientCheckpointTest, ResumeFromLatestSkipsADamagedCheckpoint) {
  std::vector<std::unique_ptr<Daemon>> daemons;
  const std::vector<std::string> addresses = StartDaemons(2, &daemons);
  const Layout layout = SampleLayout();
  const std::vector<float> init = testing::InitialParams(layout);
  std::vector<float> at_one;
  {
    auto clients = ConnectAll(Configs("dmg", addresses), layout, init.data());
    Client& leader = *clients[0];
    TrainStep(clients, layout);
    at_one = Gather(leader);
    ASSERT_TRUE(leader.SaveCheckpoint("one").ok());
    ASSERT_TRUE(leader.AwaitCheckpoint().ok());
    TrainStep(clients, layout);
    ASSERT_TRUE(leader.SaveCheckpoint("two").ok());
    ASSERT_TRUE(leader.AwaitCheckpoint().ok());
    for (auto& c : clients) ASSERT_TRUE(c->Leave().ok());
  }
  // One flipped byte in the largest file of checkpoint "two" (part 1).
  std::filesystem::path largest;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir_)) {
    if (!e.is_regular_file() || e.path().string().find("/two/") == std::string::npos) continue;
    if (largest.empty() || e.file_size() > std::filesystem::file_size(largest)) largest = e.path();
  }
  ASSERT_FALSE(largest.empty());
  {
    std::fstream f(largest, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(std::filesystem::file_size(largest) / 2));
    char byte = 0;
    f.read(&byte, 1);
    byte = static_cast<char>(byte ^ 0x40);
    f.seekp(static_cast<std::streamoff>(std::filesystem::file_size(largest) / 2));
    f.write(&byte, 1);
  }
  const absl::Status damaged =
      CheckpointDriver::Connect("dmg", addresses, ChannelSecurity::Plaintext(testing::kTestToken))
          ->Verify("two", absl::Now() + absl::Seconds(10))
          .status();
  EXPECT_EQ(damaged.code(), absl::StatusCode::kDataLoss) << damaged;
  auto clients = ConnectAll(Configs("dmg", addresses, "latest"), layout, init.data());
  ASSERT_TRUE(clients[0]->resumed_from().has_value());
  EXPECT_EQ(clients[0]->resumed_from()->name(), "one");
  ASSERT_EQ(clients[0]->resume_skipped().size(), 1u);
  EXPECT_NE(clients[0]->resume_skipped()[0].find("two (step 2)"), std::string::npos)
      << clients[0]->resume_skipped()[0];
  for (auto& c : clients) EXPECT_EQ(c->committed_step(), 1u);
  EXPECT_EQ(Gather(*clients[1]), at_one);
}

// Drives step 1 of a job of one rank per daemon by raw RPCs (as
// testing::kTestIncarnation), committing it on the daemons in `commit_on`.
void HalfCommit(const v1::JobSpec& spec, const PartitionMap& map,
                const std::vector<std::string>& addresses, const std::vector<int>& commit_on,
                const std::vector<float>& init) {
  std::vector<std::unique_ptr<DaemonClient>> c;
  for (size_t d = 0; d < addresses.size(); ++d) {
    c.push_back(std::make_unique<DaemonClient>(addresses[d]));
    ASSERT_TRUE(c[d]->Register(spec, static_cast<uint32_t>(d)).ok());
    ASSERT_TRUE(c[d]->JoinAll(spec).ok());
  }
  std::vector<std::vector<float>> grads(addresses.size(), std::vector<float>(init.size()));
  for (uint32_t r = 0; r < grads.size(); ++r) {
    testing::ComputeGradient(init.data(), 0, init.size(), r, 1, grads[r].data());
  }
  double sum_sq = 0;
  for (size_t d = 0; d < c.size(); ++d) {
    const FlatRange r = map.DaemonRange(static_cast<uint32_t>(d)).Intersect({0, init.size()});
    ASSERT_TRUE(c[d]->Init(testing::ParamChunks(spec.job_id(), r, init.data() + r.begin)).ok());
    for (uint32_t rank = 0; rank < grads.size(); ++rank) {
      ASSERT_TRUE(c[d]->Push(testing::GradientChunks(spec.job_id(), 1, rank, map, r,
                                                     grads[rank].data() + r.begin, 500))
                      .ok());
    }
    v1::PrepareStepResponse p;
    ASSERT_TRUE(c[d]->Prepare(spec.job_id(), 1, &p).ok());
    sum_sq += p.grad_sq_sum();
  }
  const float norm = static_cast<float>(std::sqrt(sum_sq));
  const float clip = std::min(1.0f, 1.0f / (norm + 1e-6f));
  for (int d : commit_on) ASSERT_TRUE(c[d]->Commit(spec.job_id(), 1, 0.01f, clip).ok());
}

TEST_F(ClientCheckpointTest, NextLeaderFinishesAHalfCommittedStepIdentically) {
  const Layout layout = SampleLayout();
  const std::vector<float> init = testing::InitialParams(layout);
  auto run = [&](const std::string& job, const std::vector<int>& commit_on) {
    std::vector<std::unique_ptr<Daemon>> daemons;
    std::vector<std::string> addresses;
    for (int i = 0; i < 2; ++i) {
      daemons.push_back(StartDaemon(""));
      addresses.push_back(daemons.back()->address());
    }
    const std::vector<ClientConfig> configs = Configs(job, addresses);
    const PartitionMap map = *PartitionMap::Create(layout.total_elements(), 2, 2);
    HalfCommit(ToJobSpec(configs[0], layout), map, addresses, commit_on, init);
    // The next trainers (newer incarnations) register.
    auto clients = ConnectAll(configs, layout, init.data());
    for (auto& c : clients) EXPECT_EQ(c->committed_step(), 1u);
    return Gather(*clients[1]);
  };
  const std::vector<float> whole = run("whole", {0, 1});
  const std::vector<float> half = run("half", {0});
  EXPECT_EQ(half, whole);
  EXPECT_NE(half, init);
}

}  // namespace
}  // namespace zeroshard
