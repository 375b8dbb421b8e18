#include "tools/zsctl_commands.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/testing/training_data.h"
#include "common/checkpoint_files.h"
#include "common/format.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "server/daemon.h"
#include "server/testing/daemon_fixture.h"

namespace zeroshard::tools {
namespace {

using Json = nlohmann::ordered_json;
using Keys = std::vector<std::string>;

// A --output=json document: one JSON object and a newline.
Json ParseDocument(const std::string& document) {
  EXPECT_TRUE(absl::EndsWith(document, "}\n")) << document;
  Json v = Json::parse(document, nullptr, /*allow_exceptions=*/false);
  EXPECT_FALSE(v.is_discarded()) << document;
  if (v.is_discarded()) return Json();
  EXPECT_TRUE(v.is_object()) << document;
  return v;
}

// The member names of object `v`, in document order.
Keys KeysOf(const Json& v) {
  Keys keys;
  if (!v.is_object()) return keys;
  for (auto it = v.begin(); it != v.end(); ++it) keys.push_back(it.key());
  return keys;
}

// Member `key` of object `v`; a null (and a failure) where there is none.
const Json& Member(const Json& v, absl::string_view key) {
  static const Json* const kMissing = new Json;
  const bool found = v.is_object() && v.contains(std::string(key));
  EXPECT_TRUE(found) << "no \"" << key << "\" among " << absl::StrJoin(KeysOf(v), ",");
  return found ? v.at(std::string(key)) : *kMissing;
}

// A JSON number written as a whole number: digits only, no fraction, no
// exponent, no sign (nlohmann reads exactly those as unsigned integers).
uint64_t Whole(const Json& v) {
  EXPECT_TRUE(v.is_number_unsigned()) << "not a whole number: " << v.dump();
  return v.is_number_unsigned() ? v.get<uint64_t>() : 0;
}

std::string Text(const Json& v) {
  EXPECT_TRUE(v.is_string()) << v.dump();
  return v.is_string() ? v.get<std::string>() : "";
}

double Number(const Json& v) {
  EXPECT_TRUE(v.is_number()) << v.dump();
  return v.is_number() ? v.get<double>() : std::nan("");
}

bool Boolean(const Json& v) {
  EXPECT_TRUE(v.is_boolean()) << v.dump();
  return v.is_boolean() && v.get<bool>();
}

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
  // Without --daemons, one daemon per rank: 7.5e9/64 = 117M elements each,
  // 18 B each in RAM (2.11 GB), or 6 B + 12 MiB (716 MB) beside 12 B on disk.
  EXPECT_TRUE(absl::StrContains(
      *out, "Per daemon (D = 64 daemons, Ψ/D = 117M owned parameters each):\n"
            "  RAM 2.11 GB (all model states in RAM: (K+4+2)Ψ/D)\n"
            "  with --state_dir: RAM 716 MB + NVMe 1.41 GB"))
      << *out;
  // After the table and its note.
  EXPECT_GT(out->find("Per daemon"), out->find("max Ψ: largest model")) << *out;
}

TEST(Zsctl, EstimatePrintsOneDaemonsShare) {
  EstimateOptions o;
  o.params = "3e9";
  o.world_size = 2;
  o.daemons = "2";
  absl::StatusOr<std::string> out = RunEstimate(o);
  ASSERT_TRUE(out.ok()) << out.status();
  std::printf("zsctl estimate --params 3e9 --dp 2 --daemons 2:\n%s", out->c_str());
  // 1.5e9 owned elements: 27 GB in RAM; 9 GB + 12 MiB in RAM and 18 GB on disk.
  EXPECT_TRUE(absl::StrContains(
      *out, "\nPer daemon (D = 2 daemons, Ψ/D = 1.50B owned parameters each):\n"
            "  RAM 27.0 GB (all model states in RAM: (K+4+2)Ψ/D)\n"
            "  with --state_dir: RAM 9.01 GB + NVMe 18.0 GB ((4+2)Ψ/D + 12 MiB of chunk "
            "buffers, KΨ/D)\n"
            "  with --state_dir --state_gradients: RAM 3.01 GB + NVMe 24.0 GB (2Ψ/D + the "
            "buffers, (K+4)Ψ/D)\n"))
      << *out;
  // The daemon count is independent of the ranks; K comes from --optimizer_k.
  o.daemons = "1";
  o.optimizer_k = 8;
  out = RunEstimate(o);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(absl::StrContains(*out, "Per daemon (D = 1 daemon, Ψ/D = 3.00B owned"))
      << *out;
  EXPECT_TRUE(absl::StrContains(*out, "  RAM 42.0 GB (")) << *out;
  EXPECT_TRUE(absl::StrContains(*out, "RAM 18.0 GB + NVMe 24.0 GB")) << *out;
  for (const char* bad : {"0", "x", "-1", "2.5", "4294967296"}) {
    o.daemons = bad;
    for (const absl::StatusOr<std::string>& r : {RunEstimate(o), RunEstimateJson(o)}) {
      EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
      EXPECT_TRUE(absl::StrContains(r.status().message(), "--daemons")) << r.status();
    }
  }
}

TEST(Zsctl, ParsesTheOutputFlag) {
  EXPECT_EQ(*ParseOutputFormat("text"), OutputFormat::kText);
  EXPECT_EQ(*ParseOutputFormat("json"), OutputFormat::kJson);
  for (const char* bad : {"", "JSON", "yaml"}) {
    absl::StatusOr<OutputFormat> f = ParseOutputFormat(bad);
    EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_TRUE(absl::StrContains(f.status().message(), "--output")) << f.status();
  }
  for (const char* c : {"estimate", "status", "memory"}) EXPECT_TRUE(SupportsJson(c)) << c;
  for (const char* c : {"drain", "token", "checkpoint", "export", "bogus"}) {
    EXPECT_FALSE(SupportsJson(c)) << c;
  }
}

TEST(Zsctl, EstimateAsJsonHasThePapersFiguresInBytes) {
  EstimateOptions o;
  o.params = "7.5B";
  o.world_size = 64;
  absl::StatusOr<std::string> out = RunEstimateJson(o);
  ASSERT_TRUE(out.ok()) << out.status();
  std::printf("zsctl estimate --output=json:\n%s", out->c_str());
  Json doc = ParseDocument(*out);
  EXPECT_EQ(KeysOf(doc), Keys({"parameters", "world_size", "optimizer_k", "device_memory_bytes",
                               "stages", "daemon"}));
  EXPECT_EQ(Whole(Member(doc, "parameters")), 7500000000u);
  EXPECT_EQ(Whole(Member(doc, "world_size")), 64u);
  EXPECT_EQ(Number(Member(doc, "optimizer_k")), 12);
  EXPECT_TRUE(Member(doc, "device_memory_bytes").is_null());
  const Json& stages = Member(doc, "stages");
  ASSERT_EQ(stages.size(), 4u) << *out;
  // 16Ψ, 4Ψ+12Ψ/N_d, 2Ψ+14Ψ/N_d, 16Ψ/N_d; 2Ψ elements (3Ψ at stage 3) of 2 bytes.
  const uint64_t kTotal[] = {120000000000, 31406250000, 16640625000, 1875000000};
  const char* const kNames[] = {"baseline DP", "P_os", "P_os+g", "P_os+g+p"};
  for (uint64_t stage = 0; stage < 4; ++stage) {
    SCOPED_TRACE(stage);
    const Json& s = stages[stage];
    EXPECT_EQ(KeysOf(s), Keys({"stage", "name", "formula", "param_bytes", "grad_bytes",
                            "optimizer_bytes", "model_state_bytes", "comm_elements",
                            "comm_bytes_per_step", "max_parameters"}));
    EXPECT_EQ(Whole(Member(s, "stage")), stage);
    EXPECT_EQ(Text(Member(s, "name")), kNames[stage]);
    EXPECT_EQ(Whole(Member(s, "model_state_bytes")), kTotal[stage]);
    EXPECT_EQ(Whole(Member(s, "param_bytes")) + Whole(Member(s, "grad_bytes")) +
                  Whole(Member(s, "optimizer_bytes")),
              kTotal[stage]);
    const uint64_t comm_elements = stage == 3 ? 22500000000 : 15000000000;
    EXPECT_EQ(Whole(Member(s, "comm_elements")), comm_elements);
    EXPECT_EQ(Whole(Member(s, "comm_bytes_per_step")), 2 * comm_elements);
    EXPECT_TRUE(Member(s, "max_parameters").is_null());
  }
  EXPECT_EQ(Text(Member(stages[2], "formula")), "2Ψ+(2+K)Ψ/N_d");
  // One daemon per rank: 7.5e9/64 elements, 18, 6 (+ 12 MiB) and 12 B each.
  const Json& daemon = Member(doc, "daemon");
  EXPECT_EQ(KeysOf(daemon),
            Keys({"daemons", "ram_bytes", "state_dir_ram_bytes", "state_dir_disk_bytes",
                  "state_gradients_ram_bytes", "state_gradients_disk_bytes"}));
  EXPECT_EQ(Whole(Member(daemon, "daemons")), 64u);
  EXPECT_EQ(Whole(Member(daemon, "ram_bytes")), 2109375000u);
  EXPECT_EQ(Whole(Member(daemon, "state_dir_ram_bytes")), 703125000u + 12582912u);
  EXPECT_EQ(Whole(Member(daemon, "state_dir_disk_bytes")), 1406250000u);

  o.device_memory = "32GB";
  out = RunEstimateJson(o);
  ASSERT_TRUE(out.ok()) << out.status();
  doc = ParseDocument(*out);
  EXPECT_EQ(Whole(Member(doc, "device_memory_bytes")), 32000000000u);
  ASSERT_EQ(Member(doc, "stages").size(), 4u);
  // 32 GB / 16 bytes per parameter, and 64 times that with everything sharded.
  EXPECT_DOUBLE_EQ(Number(Member(Member(doc, "stages")[0], "max_parameters")), 2e9);
  EXPECT_DOUBLE_EQ(Number(Member(Member(doc, "stages")[3], "max_parameters")), 128e9);

  EXPECT_EQ(RunEstimateJson(EstimateOptions()).status().code(), absl::StatusCode::kInvalidArgument);

  o.params = "3e9";
  o.world_size = 2;
  o.daemons = "2";
  out = RunEstimateJson(o);
  ASSERT_TRUE(out.ok()) << out.status();
  doc = ParseDocument(*out);
  const Json& two = Member(doc, "daemon");
  EXPECT_EQ(Whole(Member(two, "daemons")), 2u);
  EXPECT_EQ(Whole(Member(two, "ram_bytes")), 27000000000u);
  EXPECT_EQ(Whole(Member(two, "state_dir_ram_bytes")), 9012582912u);
  EXPECT_EQ(Whole(Member(two, "state_dir_disk_bytes")), 18000000000u);
  EXPECT_EQ(Whole(Member(two, "state_gradients_ram_bytes")), 3012582912u);
  EXPECT_EQ(Whole(Member(two, "state_gradients_disk_bytes")), 24000000000u);
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

// --output=json: one entry per daemon, the unreachable one with its error,
// and the command fails as the text one does.
TEST_P(ZsctlCheckpointTest, StatusAsJsonShowsEveryDaemonRankAndWait) {
  Train(1);
  std::vector<float> grad(layout_.total_elements(), 0.25f);
  absl::StatusOr<PushTicket> pushed =
      clients_[0]->PushGradients({0, grad.size()}, grad.data(), DType::kFp32);
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  ASSERT_TRUE(pushed->Wait(absl::Now() + absl::Seconds(10)).ok());
  const std::string kUnreachable = "127.0.0.1:1";
  AdminOptions o;
  o.daemons = absl::StrCat(absl::StrJoin(addresses_, ","), ",", kUnreachable);
  o.job = kJob;
  o.timeout_ms = 5000;
  o.security = ChannelSecurity::Plaintext(testing::kTestToken);
  std::string out;
  const absl::Status s = RunStatusJson(o, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), kUnreachable)) << s;
  EXPECT_EQ(s.code(), RunStatus(o).status().code());
  std::printf("zsctl status --job=%s --output=json:\n%s", kJob, out.c_str());
  const Json doc = ParseDocument(out);
  EXPECT_EQ(KeysOf(doc), Keys({"daemons"}));
  const Json& daemons = Member(doc, "daemons");
  ASSERT_EQ(daemons.size(), 3u) << out;
  for (uint32_t d = 0; d < 2; ++d) {
    SCOPED_TRACE(d);
    const Json& daemon = daemons[d];
    EXPECT_EQ(KeysOf(daemon), Keys({"address", "version", "uptime_seconds", "draining", "jobs"}));
    EXPECT_EQ(Text(Member(daemon, "address")), addresses_[d]);
    EXPECT_TRUE(Member(daemon, "version").is_string());
    EXPECT_GE(Number(Member(daemon, "uptime_seconds")), 0);
    EXPECT_TRUE(Member(daemon, "draining").is_boolean());
    EXPECT_FALSE(Boolean(Member(daemon, "draining")));
    const Json& jobs = Member(daemon, "jobs");
    ASSERT_EQ(jobs.size(), 1u) << out;
    const Json& job = jobs[0];
    EXPECT_EQ(KeysOf(job), Keys({"job_id", "stage", "world_size", "ranks_connected", "committed_step",
                              "parameters", "owned_partitions", "ranks", "open_step"}));
    EXPECT_EQ(Text(Member(job, "job_id")), kJob);
    EXPECT_EQ(Whole(Member(job, "stage")), 2u);
    EXPECT_EQ(Whole(Member(job, "world_size")), 2u);
    EXPECT_EQ(Whole(Member(job, "ranks_connected")), 2u);
    EXPECT_EQ(Whole(Member(job, "committed_step")), 1u);
    EXPECT_EQ(Whole(Member(job, "parameters")), layout_.parameter_count());
    const Json& partitions = Member(job, "owned_partitions");
    ASSERT_EQ(partitions.size(), 1u) << out;
    EXPECT_EQ(Whole(partitions[0]), d);  // partition i on daemon i * 2 / 2
    const Json& ranks = Member(job, "ranks");
    ASSERT_EQ(ranks.size(), 2u) << out;
    for (uint64_t r = 0; r < 2; ++r) {
      const Json& rank = ranks[r];
      EXPECT_EQ(KeysOf(rank), Keys({"rank", "joined", "connected", "incarnation",
                                 "seconds_since_heard", "last_step_pushed"}));
      EXPECT_EQ(Whole(Member(rank, "rank")), r);
      EXPECT_TRUE(Boolean(Member(rank, "joined")));
      EXPECT_TRUE(Boolean(Member(rank, "connected")));
      EXPECT_GT(Whole(Member(rank, "incarnation")), 0u);
      EXPECT_GE(Number(Member(rank, "seconds_since_heard")), 0);
      EXPECT_EQ(Whole(Member(rank, "last_step_pushed")), r == 0 ? 2u : 1u);
    }
    // Step 2 waits for rank 1, on every range of the daemon's partition.
    const Json& open = Member(job, "open_step");
    EXPECT_EQ(KeysOf(open),
              Keys({"step", "prepared", "complete_elements", "owned_elements", "missing"}));
    EXPECT_EQ(Whole(Member(open, "step")), 2u);
    EXPECT_FALSE(Boolean(Member(open, "prepared")));
    EXPECT_EQ(Whole(Member(open, "complete_elements")), 0u);
    const uint64_t owned = Whole(Member(open, "owned_elements"));
    EXPECT_GT(owned, 0u);
    const Json& missing = Member(open, "missing");
    ASSERT_FALSE(missing.empty()) << out;
    uint64_t waiting = 0;
    for (const Json& m : missing) {
      EXPECT_EQ(KeysOf(m), Keys({"rank", "begin", "end", "contributions", "expected"}));
      EXPECT_EQ(Whole(Member(m, "rank")), 1u);
      EXPECT_EQ(Whole(Member(m, "contributions")), 1u);
      EXPECT_EQ(Whole(Member(m, "expected")), 2u);
      EXPECT_LT(Whole(Member(m, "begin")), Whole(Member(m, "end")));
      waiting += Whole(Member(m, "end")) - Whole(Member(m, "begin"));
    }
    EXPECT_EQ(waiting, owned);
  }
  const Json& bad = daemons[2];
  EXPECT_EQ(KeysOf(bad), Keys({"address", "error"}));
  EXPECT_EQ(Text(Member(bad, "address")), kUnreachable);
  const Json& error = Member(bad, "error");
  EXPECT_EQ(KeysOf(error), Keys({"code", "message"}));
  EXPECT_EQ(Text(Member(error, "code")), "UNAVAILABLE");
  EXPECT_TRUE(absl::StrContains(Text(Member(error, "message")), kUnreachable)) << out;

  // Without --job, no ranks; without the token, no jobs.
  o.daemons = absl::StrJoin(addresses_, ",");
  o.job = "";
  ASSERT_TRUE(RunStatusJson(o, &out).ok()) << out;
  Json all = ParseDocument(out);
  ASSERT_EQ(Member(all, "daemons").size(), 2u) << out;
  ASSERT_EQ(Member(Member(all, "daemons")[0], "jobs").size(), 1u) << out;
  EXPECT_FALSE(Member(Member(all, "daemons")[0], "jobs")[0].contains("ranks"))
      << out;
  o.security = ChannelSecurity::Plaintext();
  ASSERT_TRUE(RunStatusJson(o, &out).ok()) << out;
  all = ParseDocument(out);
  ASSERT_EQ(Member(all, "daemons").size(), 2u) << out;
  EXPECT_TRUE(Member(Member(all, "daemons")[1], "jobs").empty()) << out;

  // Rank 1 catches up; the step completes.
  RunRanks([&](uint32_t rank) {
    if (rank == 1) {
      ASSERT_TRUE(clients_[1]->PushGradients({0, grad.size()}, grad.data(), DType::kFp32).ok());
    }
    absl::StatusOr<StepResult> r = clients_[rank]->Step(1e-2f);
    ASSERT_TRUE(r.ok()) << r.status();
  });
}

TEST_P(ZsctlCheckpointTest, MemoryAsJsonHasEveryCategoryInBytes) {
  Train(1);
  AdminOptions o;
  o.daemons = absl::StrJoin(addresses_, ",");
  o.job = kJob;
  o.security = ChannelSecurity::Plaintext(testing::kTestToken);
  std::string out;
  const absl::Status s = RunMemoryJson(o, &out);
  ASSERT_TRUE(s.ok()) << s;
  std::printf("zsctl memory --job=%s --output=json:\n%s", kJob, out.c_str());
  absl::StatusOr<std::string> text = RunMemory(o);
  ASSERT_TRUE(text.ok()) << text.status();
  const Json doc = ParseDocument(out);
  EXPECT_EQ(KeysOf(doc), Keys({"daemons"}));
  const Json& daemons = Member(doc, "daemons");
  ASSERT_EQ(daemons.size(), 2u) << out;
  for (uint32_t d = 0; d < 2; ++d) {
    SCOPED_TRACE(d);
    const Json& daemon = daemons[d];
    EXPECT_EQ(KeysOf(daemon), Keys({"address", "total_bytes", "memory_limit_bytes", "jobs"}));
    EXPECT_EQ(Text(Member(daemon, "address")), addresses_[d]);
    EXPECT_GT(Whole(Member(daemon, "total_bytes")), 0u);
    EXPECT_EQ(Whole(Member(daemon, "memory_limit_bytes")), 0u);  // none
    const Json& jobs = Member(daemon, "jobs");
    ASSERT_EQ(jobs.size(), 1u) << out;
    const Json& job = jobs[0];
    EXPECT_EQ(KeysOf(job), Keys({"job_id", "stage", "parameters", "world_size", "owned_partitions",
                              "categories", "model_state_bytes", "formula_bytes",
                              "state_disk_bytes"}));
    EXPECT_EQ(Text(Member(job, "job_id")), kJob);
    EXPECT_EQ(Whole(Member(job, "stage")), 2u);
    EXPECT_EQ(Whole(Member(job, "parameters")), layout_.parameter_count());
    EXPECT_EQ(Whole(Member(job, "world_size")), 2u);
    EXPECT_EQ(Whole(Member(job, "owned_partitions")), 1u);
    const Json& categories = Member(job, "categories");
    EXPECT_EQ(KeysOf(categories), Keys({"param_master", "param_half", "grad", "optim_m", "optim_v",
                                     "activation", "buffer", "fragmentation", "replica",
                                     "param_cache"}));
    uint64_t model_states = 0;
    for (const char* c : {"param_master", "param_half", "grad", "optim_m", "optim_v"}) {
      model_states += Whole(Member(categories, c));
    }
    EXPECT_GT(Whole(Member(categories, "param_master")), 0u);
    EXPECT_EQ(Whole(Member(job, "model_state_bytes")), model_states);
    EXPECT_GT(Whole(Member(job, "formula_bytes")), 0u);
    EXPECT_EQ(Whole(Member(job, "state_disk_bytes")), 0u);  // no --state_dir
    // The same figures as the text, which prints each category's exact bytes.
    for (const std::string& c : KeysOf(categories)) {
      EXPECT_TRUE(absl::StrContains(*text, absl::StrCat(c, " "))) << c;
      EXPECT_TRUE(absl::StrContains(*text, absl::StrCat("(", Whole(Member(categories, c)), " B)")))
          << c << "\n"
          << *text;
    }
  }

  // A daemon that fails: its entry holds the error, the others their data.
  o.daemons = absl::StrCat("127.0.0.1:1,", addresses_[0]);
  const absl::Status failed = RunMemoryJson(o, &out);
  EXPECT_EQ(failed.code(), absl::StatusCode::kUnavailable) << failed;
  EXPECT_EQ(failed.code(), RunMemory(o).status().code());
  const Json partial = ParseDocument(out);
  ASSERT_EQ(Member(partial, "daemons").size(), 2u) << out;
  EXPECT_EQ(Text(Member(Member(Member(partial, "daemons")[0], "error"), "code")),
            "UNAVAILABLE");
  EXPECT_EQ(KeysOf(Member(partial, "daemons")[1]),
            Keys({"address", "total_bytes", "memory_limit_bytes", "jobs"}));
  // Nothing on disk: the text is as it was, without a --state_dir line.
  EXPECT_FALSE(absl::StrContains(*text, "state_dir")) << *text;
}

// A daemon with --state_dir (no --state_memory): a bf16 job's masters and
// moments live in a file, 12 bytes per owned element in whole chunks of 1024
// elements. zsctl memory shows the file beside the RAM categories, which
// hold no masters and no moments; Admin.Status carries the same bytes.
TEST(ZsctlMemory, ShowsTheStateFileOnDisk) {
  char tmpl[] = "/tmp/zsctl-state-dir-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  {
    constexpr char kJob[] = "zsctl-disk";
    testing::TestCluster cluster(1, 1, 2, kJob, "", v1::DTYPE_BF16, false, dir);
    absl::StatusOr<std::shared_ptr<Job>> job = cluster.daemon(0).jobs().Find(kJob);
    ASSERT_TRUE(job.ok()) << job.status();
    const uint64_t chunks = ((*job)->owned_range().size() + 1023) / 1024;
    const uint64_t disk = chunks * 1024 * 12;
    ASSERT_GT(chunks, 0u);

    AdminOptions o;
    o.daemons = cluster.daemon(0).address();
    o.job = kJob;
    o.security = ChannelSecurity::Plaintext(testing::kTestToken);
    absl::StatusOr<std::string> text = RunMemory(o);
    ASSERT_TRUE(text.ok()) << text.status();
    std::printf("zsctl memory --job=%s (--state_dir):\n%s", kJob, text->c_str());
    const std::string line = absl::StrFormat(
        "    on --state_dir %14s  (%u B) the state file, not in the RAM above\n",
        FormatBytes(disk), disk);
    EXPECT_TRUE(absl::StrContains(*text, line)) << *text;
    for (const char* ram_only : {"param_master", "optim_m", "optim_v"}) {
      EXPECT_TRUE(absl::StrContains(*text, absl::StrFormat("    %-14s %14s  (0 B)\n", ram_only,
                                                           FormatBytes(0))))
          << ram_only << "\n"
          << *text;
    }

    std::string document;
    ASSERT_TRUE(RunMemoryJson(o, &document).ok()) << document;
    const Json doc = ParseDocument(document);
    const Json& jobs = Member(Member(doc, "daemons")[0], "jobs");
    ASSERT_EQ(jobs.size(), 1u) << document;
    EXPECT_EQ(Whole(Member(jobs[0], "state_disk_bytes")), disk);
    EXPECT_EQ(Whole(Member(Member(jobs[0], "categories"), "optim_m")), 0u);

    grpc::ClientContext ctx;
    v1::StatusResponse status;
    ASSERT_TRUE(cluster.client(0).admin->Status(&ctx, v1::StatusRequest(), &status).ok());
    ASSERT_EQ(status.jobs_size(), 1);
    EXPECT_EQ(status.jobs(0).state_disk_bytes(), disk);
  }
  std::filesystem::remove_all(dir);
}

// --- zsctl health -------------------------------------------------------------

namespace {

// A loopback port bound but not listening: connections to it are refused
// until Release, after which a daemon can bind it.
class RefusingPort {
 public:
  RefusingPort() {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr = {};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    socklen_t len = sizeof addr;
    getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    address_ = absl::StrCat("127.0.0.1:", ntohs(addr.sin_port));
  }
  ~RefusingPort() { Release(); }
  void Release() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }
  const std::string& address() const { return address_; }

 private:
  int fd_ = -1;
  std::string address_;
};

AdminOptions Health(const std::string& daemons, int timeout_ms) {
  AdminOptions o;
  o.daemons = daemons;
  o.timeout_ms = timeout_ms;
  o.security = ChannelSecurity::Plaintext();
  return o;
}

TEST(ZsctlHealth, WaitsForADaemonThatStartsLate) {
  std::unique_ptr<Daemon> serving = zeroshard::testing::StartDaemon();
  ASSERT_NE(serving, nullptr);
  RefusingPort late_port;
  absl::StatusOr<std::string> out;
  absl::Time answered;
  std::thread waiter([&] {
    out = RunHealth(Health(absl::StrCat(serving->address(), ",", late_port.address()), 20000));
    answered = absl::Now();
  });
  absl::SleepFor(absl::Seconds(1));
  late_port.Release();
  DaemonOptions o;
  o.listen = late_port.address();
  o.optimizer_threads = 1;
  const absl::Time started = absl::Now();
  absl::StatusOr<std::unique_ptr<Daemon>> late = Daemon::Start(o);
  waiter.join();
  ASSERT_TRUE(late.ok()) << late.status();
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_GE(answered, started);
  EXPECT_EQ(*out, absl::StrCat("daemon ", serving->address(), " serving\ndaemon ",
                               late_port.address(), " serving\n"));
}

TEST(ZsctlHealth, NamesADrainingDaemon) {
  constexpr char kAdminToken[] = "zsctl-health-test-admin-token-01234";
  DaemonOptions o;
  o.listen = "127.0.0.1:0";
  o.optimizer_threads = 1;
  o.admin_token = kAdminToken;
  absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
  ASSERT_TRUE(d.ok()) << d.status();
  const std::string address = (*d)->address();
  ASSERT_TRUE(RunHealth(Health(address, 5000)).ok());

  AdminOptions admin = Health(address, 5000);
  admin.security = ChannelSecurity::Plaintext(kAdminToken);
  ASSERT_TRUE(RunDrain(admin).ok());
  const absl::Time start = absl::Now();
  absl::StatusOr<std::string> out = RunHealth(Health(address, 5000));
  EXPECT_LT(absl::Now() - start, absl::Seconds(2)) << "a NOT_SERVING answer is final";
  EXPECT_EQ(out.status().code(), absl::StatusCode::kUnavailable) << out.status();
  EXPECT_EQ(out.status().message(),
            absl::StrCat("daemon ", address,
                         " is not serving (health: NOT_SERVING; a draining daemon takes no new "
                         "job)"));
}

TEST(ZsctlHealth, GivesUpOnASilentDaemonAtTheTimeout) {
  RefusingPort refusing;
  const absl::Time start = absl::Now();
  absl::StatusOr<std::string> out = RunHealth(Health(refusing.address(), 1500));
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(out.status().code(), absl::StatusCode::kUnavailable) << out.status();
  EXPECT_TRUE(absl::StartsWith(out.status().message(),
                               absl::StrCat("daemon ", refusing.address(),
                                            " did not answer its health check within 1.5s: ")))
      << out.status();
  EXPECT_GE(took, absl::Milliseconds(1400));
  EXPECT_LT(took, absl::Seconds(4));
}

TEST(ZsctlHealth, RejectsBadFlagsNamingThem) {
  for (const char* daemons : {"", " , ", "127.0.0.1", "127.0.0.1:x", "127.0.0.1:1,nohost"}) {
    SCOPED_TRACE(daemons);
    absl::StatusOr<std::string> out = RunHealth(Health(daemons, 1000));
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << out.status();
    EXPECT_TRUE(absl::StrContains(out.status().message(), "--daemons")) << out.status();
  }
  EXPECT_EQ(RunHealth(Health("127.0.0.1:1", 0)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace

}  // namespace zeroshard::tools
