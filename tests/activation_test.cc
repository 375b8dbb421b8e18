// Activation checkpoints on real daemons (in-process zeroshardd instances)
// through the client:
//  - the oracle: gpt_train's stage-3 training with its checkpoints on the
//    daemons ends with the same parameters, bit for bit, and the same loss
//    at every step as with checkpoints kept in the trainer; over the inproc
//    bulk transport (arena Put/Get), over the streaming RPCs, and with an
//    arena much smaller than a step (spilling every step);
//  - spill: a job that offloads ten times a small arena gets every byte back,
//    the spills are counted, and the spill files are gone after the step and
//    after the job leaves;
//  - bad input through the client keeps its code, and a slice stored before
//    a refused request is intact.

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/activation_store.h"
#include "client/client.h"
#include "client/rpc.h"
#include "examples/oracle_diff.h"
#include "examples/trainer.h"
#include "gtest/gtest.h"
#include "server/testing/activation_testing.h"
#include "server/daemon.h"
#include "server/testing/daemon_fixture.h"

namespace zeroshard {
namespace {

constexpr char kToken[] = "activation-test-job-token";

absl::Time In(absl::Duration d) { return absl::Now() + d; }

// A fresh directory under the test's temporary directory.
std::string TempDir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string dir = absl::StrCat(base != nullptr ? base : "/tmp", "/", name, ".", getpid());
  mkdir(dir.c_str(), 0700);
  return dir;
}

// Spill files (not instance locks) in `dir`.
int SpillFiles(const std::string& dir) {
  int n = 0;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      const std::string name = e->d_name;
      if (absl::StartsWith(name, "zeroshard-spill.") && !absl::EndsWith(name, ".lock")) ++n;
    }
    closedir(d);
  }
  return n;
}

std::unique_ptr<Daemon> StartDaemon(uint64_t arena, const std::string& spill_dir = "",
                                    uint64_t spill_bytes = 0) {
  DaemonOptions o;
  o.bulk_transport = "inproc";
  o.activation_arena_bytes = arena;
  o.spill_dir = spill_dir;
  o.spill_bytes = spill_bytes;
  absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(o);
  EXPECT_TRUE(d.ok()) << d.status();
  return d.ok() ? *std::move(d) : nullptr;
}

// ---- the oracle ----

examples::TrainOptions OracleOptions() {
  examples::TrainOptions o;
  o.job_token = kToken;
  o.model.layers = 4;  // six layer ids: more than the store's depths
  o.model.width = 32;
  o.model.heads = 4;
  o.model.seq_len = 16;
  o.steps = 12;
  o.global_batch = 12;
  o.stage = 3;
  o.bucket_bytes = 64 << 10;
  return o;
}

std::vector<examples::TrainResult> Train(examples::TrainOptions o,
                                         const std::vector<Daemon*>& daemons) {
  o.daemons.clear();
  for (Daemon* d : daemons) o.daemons.push_back(d->address());
  std::vector<examples::TrainResult> out;
  for (auto& r : examples::TrainRanksInThreads(o, 2)) {
    EXPECT_TRUE(r.ok()) << r.status();
    if (r.ok()) out.push_back(*std::move(r));
  }
  return out;
}

struct OracleCase {
  const char* name;
  std::string transport;
  uint64_t arena;  // per daemon
  bool spill;
};

class ActivationOracleTest : public ::testing::TestWithParam<OracleCase> {};

TEST_P(ActivationOracleTest, DaemonCheckpointsTrainBitForBitLikeLocalOnes) {
  const OracleCase& c = GetParam();
  const std::string spill_dir = c.spill ? TempDir(absl::StrCat("spill-", c.name)) : "";
  std::unique_ptr<Daemon> d0 = StartDaemon(c.arena, spill_dir, 64 << 20);
  std::unique_ptr<Daemon> d1 = StartDaemon(c.arena, spill_dir, 64 << 20);
  ASSERT_TRUE(d0 != nullptr && d1 != nullptr);
  examples::TrainOptions o = OracleOptions();
  o.transport = c.transport;
  o.job_id = absl::StrCat("local-", c.name);
  o.activations = "local";
  const std::vector<examples::TrainResult> local = Train(o, {d0.get(), d1.get()});
  o.job_id = absl::StrCat("daemon-", c.name);
  o.activations = "daemon";
  const std::vector<examples::TrainResult> daemon = Train(o, {d0.get(), d1.get()});
  ASSERT_EQ(local.size(), 2u);
  ASSERT_EQ(daemon.size(), 2u);
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(daemon[r].params.size(), local[r].params.size());
    EXPECT_EQ(std::memcmp(daemon[r].params.data(), local[r].params.data(),
                          local[r].params.size() * sizeof(float)),
              0)
        << "rank " << r << ": parameters differ";
    EXPECT_EQ(daemon[r].losses, local[r].losses) << "rank " << r;
    ASSERT_TRUE(daemon[r].activation_stats.has_value());
    const SliceStoreStats& st = *daemon[r].activation_stats;
    EXPECT_EQ(st.offloads, st.fetches);
    EXPECT_EQ(st.failures, 0u);
    EXPECT_EQ(st.stored_bytes, 0u);
    if (c.transport == "stream") EXPECT_EQ(st.streamed, st.offloads + st.fetches);
    if (c.spill) EXPECT_GT(st.spilled_fetches, 0u) << "rank " << r;
    // What the trainer held: its depths (two fetches ahead and the layer
    // being recomputed, or two offloads), not the model's six layers.
    const uint64_t largest = 6 * 16 * 32 * sizeof(float);  // a block's input
    EXPECT_LE(daemon[r].activation_bytes, 3 * largest) << "rank " << r;
    EXPECT_LT(daemon[r].activation_bytes, local[r].activation_bytes) << "rank " << r;
    EXPECT_EQ(daemon[r].activation_step_bytes, local[r].activation_bytes);
    std::printf(
        "%s rank %d: trainer held %llu B of checkpoints (local: %llu B); %llu offloads, "
        "%llu read back from spill\n",
        c.name, r, static_cast<unsigned long long>(daemon[r].activation_bytes),
        static_cast<unsigned long long>(local[r].activation_bytes),
        static_cast<unsigned long long>(st.offloads),
        static_cast<unsigned long long>(st.spilled_fetches));
  }
  if (c.spill) EXPECT_EQ(SpillFiles(spill_dir), 0);
}

INSTANTIATE_TEST_SUITE_P(Paths, ActivationOracleTest,
                         ::testing::Values(OracleCase{"inproc", "inproc", 8 << 20, false},
                                           OracleCase{"stream", "stream", 8 << 20, false},
                                           OracleCase{"inproc_spill", "inproc", 36 << 10, true}),
                         [](const ::testing::TestParamInfo<OracleCase>& i) {
                           return std::string(i.param.name);
                         });

// ---- spill and bad input, through one rank's client ----

struct Rank {
  explicit Rank(Daemon& daemon, const std::string& job, const std::string& transport = "inproc") {
    Layout layout = *Layout::Create({{"w", {256}, DType::kFp32, 0}});
    ClientConfig c;
    c.job_token = kToken;
    c.daemons = {daemon.address()};
    c.job_id = job;
    c.stage = 3;
    c.transport = transport;
    c.rpc_timeout = absl::Seconds(30);
    client = *Client::Create(c);
    std::vector<float> init(layout.total_elements(), 0.25f);
    EXPECT_TRUE(client->RegisterModel(layout, init.data()).ok());
    store = *client->OpenActivationStore(0, {});
  }
  ~Rank() { store.reset(); }
  std::unique_ptr<Client> client;
  std::unique_ptr<DaemonSliceStore> store;
};

std::vector<uint8_t> Pattern(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (uint8_t& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

ActivationKey Key(uint64_t step, uint32_t layer) { return {step, 0, layer, 0, 1}; }

TEST(ActivationSpillTest, TenTimesTheArenaComesBackAndLeavesNoFiles) {
  constexpr uint64_t kArena = 4 << 20, kSlice = 1 << 20;
  constexpr int kSlices = 40;
  const std::string dir = TempDir("spill-ten");
  std::unique_ptr<Daemon> daemon = StartDaemon(kArena, dir, 256 << 20);
  ASSERT_TRUE(daemon != nullptr);
  Rank rank(*daemon, "spill");
  std::vector<std::vector<uint8_t>> data;
  for (int i = 0; i < kSlices; ++i) data.push_back(Pattern(kSlice, i));
  for (int i = 0; i < kSlices; ++i) {
    absl::StatusOr<ActivationTicket> t = rank.store->Offload(Key(1, i), data[i].data(), kSlice);
    ASSERT_TRUE(t.ok()) << t.status();
    ASSERT_TRUE(t->Wait(In(absl::Seconds(30))).ok()) << i;
  }
  EXPECT_GT(SpillFiles(dir), 0);
  // Backward: last first, with the hint a trainer gives.
  std::vector<ActivationKey> hint;
  for (int i = kSlices - 3; i >= 0; --i) hint.push_back(Key(1, i));
  ASSERT_TRUE(rank.store->Prefetch(hint).ok());
  std::vector<uint8_t> got(kSlice);
  for (int i = kSlices - 1; i >= 0; --i) {
    absl::Status s =
        rank.store->Fetch(Key(1, i), got.data(), kSlice, AfterFetch::kFree, In(absl::Seconds(30)));
    ASSERT_TRUE(s.ok()) << i << ": " << s;
    ASSERT_EQ(got, data[i]) << "slice " << i;
  }
  SliceStoreStats st = rank.store->Stats();
  EXPECT_GT(st.spilled_fetches, 0u);
  EXPECT_EQ(st.stored_bytes, 0u);
  // The slices still where they were reserved were read there and freed in
  // place; the spilled ones were located (read back) first.
  const double located = testing::RequestCount(*daemon, "LocateActivation");
  EXPECT_GT(located, 0);
  EXPECT_LT(located, kSlices);
  EXPECT_EQ(testing::RequestCount(*daemon, "FreeActivations"), kSlices + located);
  // Freed key by key: the daemon removes the files once its read-backs end.
  EXPECT_EQ(testing::SettledSpillFiles(*daemon->activations(), dir), 0u)
      << "after every slice of the step was fetched and freed";
  // A step whose slices are freed without being fetched.
  for (int i = 0; i < 10; ++i) {
    ASSERT_TRUE(
        rank.store->Offload(Key(2, i), data[i].data(), kSlice)->Wait(In(absl::Seconds(30))).ok());
  }
  EXPECT_GT(SpillFiles(dir), 0);
  absl::StatusOr<uint64_t> freed = rank.store->FreeStep(2, In(absl::Seconds(30)));
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(*freed, 10 * kSlice);
  EXPECT_EQ(SpillFiles(dir), 0) << "after FreeStep";
  // And a job that leaves with slices spilled.
  for (int i = 0; i < 10; ++i) {
    ASSERT_TRUE(
        rank.store->Offload(Key(3, i), data[i].data(), kSlice)->Wait(In(absl::Seconds(30))).ok());
  }
  EXPECT_GT(SpillFiles(dir), 0);
  rank.store.reset();
  ASSERT_TRUE(rank.client->Leave().ok());
  EXPECT_EQ(SpillFiles(dir), 0) << "after the job left";
}

TEST(ActivationBadInputTest, CodesThroughTheClient) {
  std::unique_ptr<Daemon> daemon = StartDaemon(1 << 20);  // no spill directory
  ASSERT_TRUE(daemon != nullptr);
  for (const char* transport : {"inproc", "stream"}) {
    SCOPED_TRACE(transport);
    Rank rank(*daemon, absl::StrCat("bad-", transport), transport);
    const std::vector<uint8_t> a = Pattern(600 << 10, 1), b = Pattern(600 << 10, 2);
    ASSERT_TRUE(
        rank.store->Offload(Key(1, 0), a.data(), a.size())->Wait(In(absl::Seconds(30))).ok());
    std::vector<uint8_t> got(a.size());
    auto fetch = [&](const ActivationKey& k, size_t n, AfterFetch then = AfterFetch::kKeep) {
      got.assign(n, 0);
      return rank.store->Fetch(k, got.data(), n, then, In(absl::Seconds(30)));
    };
    absl::Status s = fetch(Key(1, 9), 16);
    EXPECT_TRUE(absl::IsNotFound(s)) << s;
    s = fetch(Key(1, 0), a.size() - 1);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    // Past the arena and no spill space: refused, and the stored slice stays.
    s = rank.store->Offload(Key(1, 1), b.data(), b.size())->Wait(In(absl::Seconds(30)));
    EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
    ASSERT_TRUE(fetch(Key(1, 0), a.size(), AfterFetch::kFree).ok());
    EXPECT_EQ(got, a);
    s = fetch(Key(1, 0), a.size());
    EXPECT_TRUE(absl::IsNotFound(s)) << "a freed key: " << s;
    // Another job's slices are not this rank's to ask for.
    DaemonSliceStore foreign(
        {"no-such-job", 0, rank.client->incarnation()}, daemon->address(),
        MakeDaemonChannel(daemon->address(), ChannelSecurity::Plaintext(kToken)), nullptr, {});
    s = foreign.Offload(Key(1, 0), a.data(), a.size()).value().Wait(In(absl::Seconds(30)));
    EXPECT_TRUE(absl::IsNotFound(s) || absl::IsFailedPrecondition(s)) << s;
    ASSERT_TRUE(rank.client->Leave().ok());
  }
}

}  // namespace
}  // namespace zeroshard
