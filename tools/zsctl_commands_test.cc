#include "tools/zsctl_commands.h"

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/client.h"
#include "client/testing/training_data.h"
#include "common/checkpoint_files.h"
#include "gtest/gtest.h"
#include "server/daemon.h"
#include "server/testing/daemon_fixture.h"

namespace zeroshard::tools {
namespace {

TEST(Zsctl, ParsesCountsAndBytes) {
  EXPECT_DOUBLE_EQ(*ParseCount("7.5e9"), 7.5e9);
  EXPECT_DOUBLE_EQ(*ParseCount("7.5B"), 7.5e9);
  EXPECT_DOUBLE_EQ(*ParseCount("350M"), 350e6);
  EXPECT_DOUBLE_EQ(*ParseCount("1T"), 1e12);
  EXPECT_DOUBLE_EQ(*ParseBytes("32GiB"), 32.0 * (1 << 30));
  EXPECT_DOUBLE_EQ(*ParseBytes("32GB"), 32e9);
  EXPECT_DOUBLE_EQ(*ParseBytes("80e9"), 80e9);
  EXPECT_FALSE(ParseCount("").ok());
  EXPECT_FALSE(ParseCount("-5").ok());
  EXPECT_FALSE(ParseCount("7.5X").ok());
  EXPECT_FALSE(ParseBytes("12 parsecs").ok());
}

TEST(Zsctl, EstimatePrintsThePapersFigures) {
  EstimateOptions o;
  o.params = "7.5e9";
  o.world_size = 64;
  auto out = RunEstimate(o);
  ASSERT_TRUE(out.ok()) << out.status();
  for (const char* figure : {"120 GB", "31.4 GB", "16.6 GB", "1.88 GB"}) {
    EXPECT_NE(out->find(figure), std::string::npos) << figure << "\n" << *out;
  }
  o.device_memory = "32GB";
  out = RunEstimate(o);
  ASSERT_TRUE(out.ok());
  EXPECT_NE(out->find("7.64B"), std::string::npos) << *out;
  EXPECT_NE(out->find("128B"), std::string::npos) << *out;
}

TEST(Zsctl, EstimateRejectsBadInput) {
  EstimateOptions o;
  EXPECT_EQ(RunEstimate(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.params = "1e9";
  o.world_size = 0;
  EXPECT_EQ(RunEstimate(o).status().code(), absl::StatusCode::kInvalidArgument);
}

// Bad flags are refused before any RPC: nothing listens on port 1.
TEST(Zsctl, CheckpointRejectsBadFlagsNamingThem) {
  struct Case {
    const char* action;
    CheckpointOptions options;
    const char* text;
  };
  auto options = [](std::string daemons, std::string job, std::string name, int timeout_ms) {
    CheckpointOptions o;
    o.daemons = std::move(daemons);
    o.job = std::move(job);
    o.name = std::move(name);
    o.timeout_ms = timeout_ms;
    return o;
  };
  const Case cases[] = {
      {"snapshot", options("127.0.0.1:1", "j", "n", 1000), "unknown action"},
      {"save", options("", "j", "n", 1000), "--daemons"},
      {"save", options(" , ", "j", "n", 1000), "--daemons"},
      {"save", options("127.0.0.1", "j", "n", 1000), "--daemons"},
      {"list", options("127.0.0.1:1,host:port", "j", "", 1000), "--daemons"},
      {"save", options("127.0.0.1:1", "", "n", 1000), "--job"},
      {"load", options("127.0.0.1:1", "bad/job", "n", 1000), "--job"},
      {"save", options("127.0.0.1:1", "j", "", 1000), "--name"},
      {"save", options("127.0.0.1:1", "j", "latest", 1000), "--name"},
      {"save", options("127.0.0.1:1", "j", "../up", 1000), "--name"},
      {"load", options("127.0.0.1:1", "j", "", 1000), "--name"},
      {"verify", options("127.0.0.1:1", "j", "a b", 1000), "--name"},
      {"list", options("127.0.0.1:1", "j", "", 0), "--timeout_ms"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat(c.action, " ", c.options.daemons, " ", c.options.job, " ",
                              c.options.name));
    absl::StatusOr<std::string> out = RunCheckpoint(c.action, c.options);
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << out.status();
    EXPECT_TRUE(absl::StrContains(out.status().message(), c.text)) << out.status();
  }
}

TEST(Zsctl, CheckpointNamesAnUnreachableDaemon) {
  CheckpointOptions o;
  o.daemons = "127.0.0.1:1";
  o.job = "j";
  o.timeout_ms = 2000;
  for (const char* action : {"save", "list", "verify"}) {
    SCOPED_TRACE(action);
    o.name = "n";
    absl::StatusOr<std::string> out = RunCheckpoint(action, o);
    EXPECT_EQ(out.status().code(), absl::StatusCode::kUnavailable) << out.status();
    EXPECT_TRUE(absl::StrContains(out.status().message(), "127.0.0.1:1")) << out.status();
  }
}

// Two daemons and a job of two ranks on them that trains with the client
// library. The daemons share one checkpoint directory (the parameter) or
// each has its own (local disks).
class ZsctlCheckpointTest : public ::testing::TestWithParam<bool> {
 protected:
  static constexpr char kJob[] = "zsctl-ckpt";

  void SetUp() override {
    const bool shared = GetParam();
    const std::string dir = absl::StrCat(::testing::TempDir(), "/zsctl_checkpoints");
    ASSERT_EQ(std::system(absl::StrCat("rm -rf '", dir, "'").c_str()), 0);
    for (int d = 0; d < 2; ++d) {
      dirs_.push_back(shared ? absl::StrCat(dir, "/shared") : absl::StrCat(dir, "/daemon", d));
      daemons_.push_back(zeroshard::testing::StartDaemon(0, 1, dirs_.back()));
      ASSERT_NE(daemons_.back(), nullptr);
      addresses_.push_back(daemons_.back()->address());
    }
    layout_ = zeroshard::testing::SampleLayout();
    const std::vector<float> init = zeroshard::testing::InitialParams(layout_);
    clients_.resize(2);
    RunRanks([&](uint32_t rank) {
      ClientConfig c;
      c.job_token = testing::kTestToken;
      c.daemons = addresses_;
      c.job_id = kJob;
      c.rank = rank;
      c.world_size = 2;
      c.stage = 2;
      c.precision = DType::kFp32;
      c.bucket_bytes = 4096;
      c.rpc_timeout = absl::Seconds(10);
      c.step_timeout = absl::Seconds(20);
      c.io_threads = 2;
      absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(c);
      ASSERT_TRUE(client.ok()) << client.status();
      ASSERT_TRUE((*client)->RegisterModel(layout_, rank == 0 ? init.data() : nullptr).ok());
      clients_[rank] = *std::move(client);
    });
  }

  void TearDown() override {
    for (auto& c : clients_) {
      if (c != nullptr) EXPECT_TRUE(c->Leave().ok());
    }
  }

  void RunRanks(const std::function<void(uint32_t)>& fn) {
    std::vector<std::thread> threads;
    for (uint32_t r = 0; r < 2; ++r) threads.emplace_back(fn, r);
    for (auto& t : threads) t.join();
  }

  // `steps` more steps on both ranks.
  void Train(int steps) {
    RunRanks([&](uint32_t rank) {
      Client& client = *clients_[rank];
      std::vector<float> params(layout_.total_elements()), grad(layout_.total_elements());
      for (int i = 0; i < steps; ++i) {
        const uint64_t step = client.committed_step() + 1;
        ASSERT_TRUE(client.GatherAll(params.data(), DType::kFp32).ok());
        zeroshard::testing::ComputeGradient(params.data(), 0, grad.size(), rank, step,
                                            grad.data());
        ASSERT_TRUE(client.PushGradients({0, grad.size()}, grad.data(), DType::kFp32).ok());
        absl::StatusOr<StepResult> r = client.Step(1e-2f);
        ASSERT_TRUE(r.ok()) << r.status();
      }
    });
  }

  absl::StatusOr<std::string> Zsctl(const std::string& action, const std::string& name) {
    CheckpointOptions o;
    o.daemons = absl::StrJoin(addresses_, ",");
    o.job = kJob;
    o.name = name;
    o.timeout_ms = 30000;
    o.security = ChannelSecurity::Plaintext(testing::kTestToken);
    return RunCheckpoint(action, o);
  }

  // The bytes of every array file of checkpoint `name`, part by part, each
  // from its daemon's directory.
  std::string Arrays(const std::string& name) {
    std::string out;
    for (uint32_t d = 0; d < 2; ++d) {
      for (const char* file : {kMasterFile, kExpAvgFile, kExpAvgSqFile}) {
        std::ifstream in(absl::StrCat(CheckpointPartDir(dirs_[d], kJob, name, d), "/", file),
                         std::ios::binary);
        EXPECT_TRUE(in.good()) << name << " part " << d << " " << file;
        out.append(std::istreambuf_iterator<char>(in), {});
      }
    }
    return out;
  }

  std::vector<std::string> dirs_;
  std::vector<std::unique_ptr<Daemon>> daemons_;
  std::vector<std::string> addresses_;
  Layout layout_;
  std::vector<std::unique_ptr<Client>> clients_;
};

INSTANTIATE_TEST_SUITE_P(Directories, ZsctlCheckpointTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Shared" : "PerDaemon";
                         });

TEST_P(ZsctlCheckpointTest, SavesListsVerifiesAndLoads) {
  Train(3);
  absl::StatusOr<std::string> out = Zsctl("save", "at-3");
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(absl::StrContains(*out, "checkpoint at-3 of job zsctl-ckpt: step 3")) << *out;
  EXPECT_TRUE(absl::StrContains(*out, "snapshot")) << *out;
  // A complete checkpoint of that name exists.
  EXPECT_EQ(Zsctl("save", "at-3").status().code(), absl::StatusCode::kAlreadyExists);

  Train(2);
  out = Zsctl("save", "at-5");
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(absl::StrContains(*out, "step 5")) << *out;

  out = Zsctl("list", "");
  ASSERT_TRUE(out.ok()) << out.status();
  const size_t at3 = out->find("at-3"), at5 = out->find("at-5");
  EXPECT_NE(at3, std::string::npos) << *out;
  EXPECT_NE(at5, std::string::npos) << *out;
  EXPECT_LT(at3, at5) << "by step\n" << *out;
  EXPECT_TRUE(absl::StrContains(*out, "completed")) << *out;

  out = Zsctl("verify", "");  // latest
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(absl::StrContains(*out, "checkpoint at-5 (step 5) of job zsctl-ckpt")) << *out;
  out = Zsctl("verify", "at-3");
  ASSERT_TRUE(out.ok()) << out.status();

  // Load step 3 back; a save of the loaded state equals the step-3 one.
  out = Zsctl("load", "at-3");
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(absl::StrContains(*out, "loaded checkpoint at-3")) << *out;
  EXPECT_TRUE(absl::StrContains(*out, "committed step 3")) << *out;
  out = Zsctl("save", "reloaded");
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(absl::StrContains(*out, "step 3")) << *out;
  const std::string saved = Arrays("at-3");
  ASSERT_EQ(saved.size(), 3 * sizeof(float) * layout_.total_elements());
  EXPECT_TRUE(saved == Arrays("reloaded"));
  EXPECT_FALSE(saved == Arrays("at-5"));

  out = Zsctl("load", "latest");
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(absl::StrContains(*out, "loaded checkpoint at-5")) << *out;
  EXPECT_TRUE(absl::StrContains(*out, "committed step 5")) << *out;
}

TEST_P(ZsctlCheckpointTest, PassesTheDaemonsErrorsThrough) {
  Train(1);
  absl::StatusOr<std::string> out = Zsctl("load", "never-saved");
  EXPECT_EQ(out.status().code(), absl::StatusCode::kNotFound) << out.status();
  out = Zsctl("verify", "never-saved");
  EXPECT_EQ(out.status().code(), absl::StatusCode::kNotFound) << out.status();
  out = Zsctl("list", "");
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(absl::StrContains(*out, "no complete checkpoint")) << *out;

  CheckpointOptions o;
  o.daemons = absl::StrJoin(addresses_, ",");
  o.job = "no-such-job";
  o.name = "x";
  o.timeout_ms = 10000;
  out = RunCheckpoint("save", o);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kUnauthenticated) << out.status();
  EXPECT_TRUE(absl::StrContains(out.status().message(), "needs a token")) << out.status();
  o.security = ChannelSecurity::Plaintext(testing::kTestToken);
  out = RunCheckpoint("save", o);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kNotFound) << out.status();
  EXPECT_TRUE(absl::StrContains(out.status().message(), addresses_[0])) << out.status();
}

}  // namespace
// A hang explains itself: rank 1 stops pushing, and zsctl status --job says
// which ranks each daemon waits for, with which ranges.
TEST_P(ZsctlCheckpointTest, StatusShowsEachRankAndWhatTheOpenStepWaitsFor) {
  Train(1);
  std::vector<float> grad(layout_.total_elements(), 0.25f);
  absl::StatusOr<PushTicket> pushed =
      clients_[0]->PushGradients({0, grad.size()}, grad.data(), DType::kFp32);
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  ASSERT_TRUE(pushed->Wait(absl::Now() + absl::Seconds(10)).ok());
  AdminOptions o;
  o.daemons = absl::StrJoin(addresses_, ",");
  o.job = kJob;
  o.security = ChannelSecurity::Plaintext(testing::kTestToken);
  absl::StatusOr<std::string> out = RunStatus(o);
  ASSERT_TRUE(out.ok()) << out.status();
  std::printf("zsctl status --job=%s:\n%s", kJob, out->c_str());
  EXPECT_TRUE(absl::StrContains(*out, "last step pushed 2")) << *out;  // rank 0
  EXPECT_TRUE(absl::StrContains(*out, "last step pushed 1")) << *out;  // rank 1
  EXPECT_TRUE(absl::StrContains(*out, "connected")) << *out;
  for (const std::string& a : addresses_) {
    EXPECT_TRUE(
        absl::StrContains(*out, absl::StrCat("step 2: daemon ", a, " waits for rank 1, range [")))
        << *out;
  }
  // Without the job's token the daemons show no job at all.
  o.security = ChannelSecurity::Plaintext();
  out = RunStatus(o);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_FALSE(absl::StrContains(*out, "waits for")) << *out;
  EXPECT_TRUE(absl::StrContains(*out, "jobs 0")) << *out;
  // Rank 1 catches up; the step completes.
  RunRanks([&](uint32_t rank) {
    if (rank == 1) {
      ASSERT_TRUE(clients_[1]->PushGradients({0, grad.size()}, grad.data(), DType::kFp32).ok());
    }
    absl::StatusOr<StepResult> r = clients_[rank]->Step(1e-2f);
    ASSERT_TRUE(r.ok()) << r.status();
  });
}

}  // namespace zeroshard::tools
