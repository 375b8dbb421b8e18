// Memory a daemon cannot be talked out of: a job is booked whole in the
// ledger before any of it is allocated, concurrent registrations cannot pass
// the limit together, and what a request makes the daemon hold besides the
// booked model states is bounded.

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "common/layout.h"
#include "gtest/gtest.h"
#include "server/daemon.h"
#include "server/ledger/system_resources.h"
#include "server/testing/daemon_fixture.h"

namespace zeroshard {
namespace {

using testing::DaemonClient;
using testing::GradientChunks;
using testing::MakeSpec;

// Resident bytes of this process.
// This process's resident bytes; fails the test when /proc cannot say.
uint64_t ResidentBytes() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  EXPECT_NE(f, nullptr) << "cannot read /proc/self/statm";
  if (f == nullptr) return 0;
  unsigned long long size = 0, resident = 0;
  const int n = std::fscanf(f, "%llu %llu", &size, &resident);
  std::fclose(f);
  EXPECT_EQ(n, 2) << "cannot parse /proc/self/statm";
  EXPECT_GT(resident, 0u);
  return n == 2 ? resident * static_cast<uint64_t>(::sysconf(_SC_PAGE_SIZE)) : 0;
}

std::unique_ptr<Daemon> Start(uint64_t memory_limit, const std::string& bulk_transport = "") {
  DaemonOptions options;
  options.listen = "127.0.0.1:0";
  options.memory_limit_bytes = memory_limit;
  options.bulk_transport = bulk_transport;
  options.read_lease = absl::ZeroDuration();
  absl::StatusOr<std::unique_ptr<Daemon>> d = Daemon::Start(options);
  EXPECT_TRUE(d.ok()) << d.status();
  return d.ok() ? *std::move(d) : nullptr;
}

// The bytes a fp32 AdamW job at stage 2 books per owned element: master, m,
// v and the gradient.
constexpr uint64_t kBytesPerElement = 16;

class ResourceLimitsTest : public ::testing::TestWithParam<std::string> {};

// A 2^38-element tensor (4 TiB of model states) on a daemon limited to what
// this machine has: refused before a byte is allocated or touched.
TEST_P(ResourceLimitsTest, HugeJobIsRefusedBeforeAnythingIsAllocated) {
  const uint64_t limit = AutoMemoryLimit();
  ASSERT_GT(limit, 0u);
  ASSERT_LT(limit, (uint64_t{1} << 38) * kBytesPerElement);
  std::unique_ptr<Daemon> daemon = Start(limit, GetParam());
  ASSERT_NE(daemon, nullptr);
  DaemonClient client(daemon->address());
  // A small job first, so that the RPC path's own memory is warm.
  const Layout small = *Layout::Create({{"w", {1024}, DType::kFp32, 0}});
  ASSERT_TRUE(client.Register(MakeSpec("small", small, 2, 1, {daemon->address()}), 0).ok());
  const Layout huge =
      *Layout::Create({{"huge", {int64_t{1} << 19, int64_t{1} << 19}, DType::kFp32, 0}});
  const v1::JobSpec spec = MakeSpec("huge", huge, 2, 1, {daemon->address()});
  const uint64_t ledger_before = daemon->ledger().total();
  const uint64_t rss_before = ResidentBytes();
  grpc::Status s = client.Register(spec, 0);
  const uint64_t rss_after = ResidentBytes();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_NE(s.error_message().find("--memory_limit"), std::string::npos) << s.error_message();
  EXPECT_EQ(daemon->ledger().total(), ledger_before);
  EXPECT_EQ(daemon->ledger().Snapshot().count("huge"), 0u);
  EXPECT_FALSE(daemon->jobs().Find("huge").ok());
  EXPECT_LT(rss_after, rss_before + (8 << 20))
      << "resident memory grew from " << rss_before << " to " << rss_after << " bytes";
}

// Eight registrations at once, each needing 40% of the limit: the ledger
// books each job whole or not at all, so exactly two fit, the ledger never
// exceeds the limit, and the refused ones leave no ledger entry.
TEST_P(ResourceLimitsTest, ConcurrentRegistrationsCannotPassTheLimitTogether) {
  constexpr uint64_t kElements = 1 << 20;
  constexpr uint64_t kJobBytes = kElements * kBytesPerElement;  // 16 MiB
  constexpr uint64_t kLimit = kJobBytes * 5 / 2;                // each job is 40%
  constexpr int kThreads = 8;
  const Layout layout = *Layout::Create({{"w", {kElements}, DType::kFp32, 0}});
  for (int round = 0; round < 3; ++round) {
    std::unique_ptr<Daemon> daemon = Start(kLimit, GetParam());
    ASSERT_NE(daemon, nullptr);
    std::atomic<uint64_t> peak{0};
    std::atomic<bool> done{false};
    std::thread watch([&] {
      while (!done.load()) {
        const uint64_t total = daemon->ledger().total();
        uint64_t seen = peak.load();
        while (total > seen && !peak.compare_exchange_weak(seen, total)) {
        }
        std::this_thread::yield();
      }
    });
    std::vector<std::unique_ptr<DaemonClient>> clients;
    for (int t = 0; t < kThreads; ++t) {
      clients.push_back(std::make_unique<DaemonClient>(daemon->address()));
    }
    std::atomic<int> ready{0};
    std::vector<grpc::Status> results(kThreads);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        const v1::JobSpec spec =
            MakeSpec(absl::StrCat("job", t), layout, 2, 1, {daemon->address()});
        ++ready;
        while (ready.load() < kThreads) std::this_thread::yield();
        results[t] = clients[t]->Register(spec, 0);
      });
    }
    for (std::thread& t : threads) t.join();
    done = true;
    watch.join();
    int registered = 0;
    for (int t = 0; t < kThreads; ++t) {
      const std::string job = absl::StrCat("job", t);
      if (results[t].ok()) {
        ++registered;
        EXPECT_TRUE(daemon->jobs().Find(job).ok());
        continue;
      }
      EXPECT_EQ(results[t].error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
          << results[t].error_message();
      EXPECT_EQ(daemon->ledger().Snapshot().count(job), 0u) << job << " left a ledger entry";
    }
    EXPECT_EQ(registered, 2) << "round " << round;
    EXPECT_LE(peak.load(), kLimit);
    EXPECT_LE(daemon->ledger().total(), kLimit);
    EXPECT_EQ(daemon->ledger().total(), registered * kJobBytes);
    EXPECT_EQ(daemon->ledger().Snapshot().size(), static_cast<size_t>(registered));
  }
}

INSTANTIATE_TEST_SUITE_P(BulkTransports, ResourceLimitsTest, ::testing::Values("", "inproc"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param.empty() ? std::string("StreamOnly") : info.param;
                         });

// RegisterJob with `layout` (fingerprint 0: the bounds are checked first).
grpc::Status RegisterLayout(DaemonClient& client, const Daemon& daemon, const v1::Layout& layout) {
  v1::JobSpec spec =
      MakeSpec("wide", *Layout::Create({{"w", {64}, DType::kFp32, 0}}), 2, 1, {daemon.address()});
  *spec.mutable_layout() = layout;
  spec.set_layout_fingerprint(0);
  return client.Register(spec, 0);
}

// A layout is bounded in tensors and name bytes: the daemon keeps a job's
// spec and layout outside the ledger for the job's lifetime.
TEST(ResourceLimits, LayoutsAreBoundedInTensorsAndNames) {
  std::unique_ptr<Daemon> daemon = Start(64 << 20);
  ASSERT_NE(daemon, nullptr);
  DaemonClient client(daemon->address());
  auto tensor = [](v1::Layout* l, const std::string& name, int dims) {
    v1::TensorSpec* t = l->add_tensors();
    t->set_name(name);
    for (int d = 0; d < dims; ++d) t->add_shape(1);
    t->set_dtype(v1::DTYPE_FP32);
  };
  v1::Layout many;
  for (int i = 0; i <= (1 << 17); ++i) tensor(&many, absl::StrCat("t", i), 1);
  grpc::Status s = RegisterLayout(client, *daemon, many);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("spec.layout.tensors: at most 131072 tensors"),
            std::string::npos)
      << s.error_message();

  v1::Layout long_names;
  for (int i = 0; i < 40000; ++i) {
    tensor(&long_names, absl::StrCat(std::string(240, 'n'), i), 1);
  }
  s = RegisterLayout(client, *daemon, long_names);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("the names take"), std::string::npos) << s.error_message();

  v1::Layout deep;
  tensor(&deep, "deep", 100000);
  s = RegisterLayout(client, *daemon, deep);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("tensors[0].shape: needs 1..8 dimensions"), std::string::npos)
      << s.error_message();

  EXPECT_EQ(daemon->ledger().total(), 0u);
  EXPECT_EQ(daemon->jobs().size(), 0u);
}

// Many tiny chunks: the step's bookkeeping (an entry per chunk range and per
// contribution) is booked as the job's buffer, so pushes of one-element
// chunks reach the daemon's limit instead of growing unbooked memory; the
// push that would pass it is refused whole.
TEST(ResourceLimits, ReductionBookkeepingIsBookedAgainstTheLimit) {
  constexpr uint64_t kElements = 1 << 16;
  const uint64_t footprint = kElements * kBytesPerElement;
  std::unique_ptr<Daemon> daemon = Start(footprint + (3 << 20));
  ASSERT_NE(daemon, nullptr);
  DaemonClient client(daemon->address());
  const Layout layout = *Layout::Create({{"w", {kElements}, DType::kFp32, 0}});
  const v1::JobSpec spec = MakeSpec("tiny", layout, 2, 1, {daemon->address()});
  const JobConfig config = *ParseJobSpec(spec);
  ASSERT_TRUE(client.Register(spec, 0).ok());
  ASSERT_TRUE(client.JoinAll(spec).ok());
  const uint64_t booked = daemon->ledger().total();
  EXPECT_EQ(booked, footprint);
  const std::vector<float> grad(kElements, 0.5f);
  constexpr uint64_t kPerPush = 2048;
  uint64_t pushed = 0;
  grpc::Status refused;
  while (pushed < kElements) {
    const std::vector<v1::GradientChunk> chunks = GradientChunks(
        "tiny", 1, 0, config.map, {pushed, pushed + kPerPush}, grad.data() + pushed, 1);
    const uint64_t hash = (*daemon->jobs().Find("tiny"))->StateHash();
    const uint64_t total = daemon->ledger().total();
    grpc::Status s = client.Push(chunks);
    if (!s.ok()) {
      refused = s;
      EXPECT_EQ((*daemon->jobs().Find("tiny"))->StateHash(), hash);
      EXPECT_EQ(daemon->ledger().total(), total);
      break;
    }
    pushed += kPerPush;
    // At least a map entry's worth per chunk range stays booked.
    EXPECT_GE(daemon->ledger().total(), booked + pushed * 64);
    EXPECT_LE(daemon->ledger().total(), daemon->ledger().limit());
  }
  EXPECT_LT(pushed, kElements) << "every tiny chunk was taken without booking its bookkeeping";
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
  EXPECT_NE(refused.error_message().find("--memory_limit"), std::string::npos)
      << refused.error_message();
}

// What gRPC holds for messages being received is bounded by
// --rpc_memory_bytes and booked at start: a flood of large unary requests
// (read whole before any handler or token check runs) is refused by gRPC
// past the bound, and the daemon goes on answering. Without the bound every
// one of them is read.
TEST(RpcMemoryTest, ReceivedMessagesAreBoundedAndBooked) {
  DaemonOptions o;
  o.listen = "127.0.0.1:0";
  o.memory_limit_bytes = uint64_t{1} << 30;
  o.rpc_memory_bytes = 1 << 20;
  EXPECT_EQ(Daemon::Start(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.rpc_memory_bytes = kMinRpcMemoryBytes;
  o.memory_limit_bytes = kMinRpcMemoryBytes - 1;
  absl::Status small = Daemon::Start(o).status();
  EXPECT_EQ(small.code(), absl::StatusCode::kResourceExhausted) << small;
  EXPECT_NE(small.message().find("--rpc_memory_bytes"), absl::string_view::npos) << small;

  // A RegisterJob whose spec carries ~70 MiB of layout names: refused by the
  // spec's limits once read, so every one that gets in is read whole.
  v1::RegisterJobRequest huge;
  *huge.mutable_spec() = MakeSpec("huge", testing::SampleLayout(), 2, 1, {"127.0.0.1:1"});
  v1::TensorSpec* t = huge.mutable_spec()->mutable_layout()->add_tensors();
  t->set_name(std::string(70 << 20, 'x'));
  t->add_shape(1);
  auto flood = [&](Daemon& daemon, int calls) {
    std::vector<std::thread> threads;
    std::atomic<int> exhausted{0};
    std::atomic<int> read{0};
    for (int i = 0; i < calls; ++i) {
      threads.emplace_back([&] {
        DaemonClient c(daemon.address());
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
        v1::RegisterJobResponse resp;
        const grpc::Status s = c.control->RegisterJob(&ctx, huge, &resp);
        if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) ++exhausted;
        if (s.error_code() == grpc::StatusCode::INVALID_ARGUMENT) ++read;
      });
    }
    for (std::thread& th : threads) th.join();
    return std::make_pair(exhausted.load(), read.load());
  };
  constexpr int kCalls = 8;

  o.memory_limit_bytes = uint64_t{1} << 30;
  absl::StatusOr<std::unique_ptr<Daemon>> bounded = Daemon::Start(o);
  ASSERT_TRUE(bounded.ok()) << bounded.status();
  EXPECT_EQ((*bounded)->ledger().JobBytes(kDaemonLedgerEntry)[static_cast<int>(
                MemoryCategory::kBuffer)],
            kMinRpcMemoryBytes);
  const auto [exhausted, read] = flood(**bounded, kCalls);
  std::printf("bounded: %d of %d refused by gRPC, %d read\n", exhausted, kCalls, read);
  EXPECT_GT(exhausted, 0) << "every message was read past --rpc_memory_bytes";
  EXPECT_LT(read, kCalls);
  {
    DaemonClient c((*bounded)->address());
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::StatusResponse status;
    EXPECT_TRUE(c.admin->Status(&ctx, v1::StatusRequest(), &status).ok())
        << "the daemon stopped answering";
  }
  EXPECT_EQ((*bounded)->ledger().total(), kMinRpcMemoryBytes);
  bounded->reset();

  o.rpc_memory_bytes = 0;
  absl::StatusOr<std::unique_ptr<Daemon>> unbounded = Daemon::Start(o);
  ASSERT_TRUE(unbounded.ok()) << unbounded.status();
  EXPECT_EQ((*unbounded)->ledger().total(), 0u);
  const auto [unbounded_exhausted, unbounded_read] = flood(**unbounded, kCalls);
  std::printf("unbounded: %d of %d refused by gRPC, %d read\n", unbounded_exhausted, kCalls,
              unbounded_read);
  EXPECT_EQ(unbounded_read, kCalls);
}

}  // namespace
}  // namespace zeroshard
