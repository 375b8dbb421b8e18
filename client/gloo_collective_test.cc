// GlooCollective: ranks as threads, each with its own Gloo context over TCP
// on loopback, rendezvous in a fresh directory per test.

#include "client/gloo_collective.h"

#include <dirent.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/client.h"
#include "client/testing/ranks.h"
#include "gloo/rendezvous/file_store.h"
#include "gloo/rendezvous/prefix_store.h"
#include "gtest/gtest.h"
#include "server/testing/daemon_fixture.h"

namespace zeroshard {
namespace {

// How far past its deadline a wait may return on a loaded machine (under
// ASan, beside other tests) and still count as honouring it: far below
// the 30 s of Gloo's own store waits that the deadline replaces.
constexpr absl::Duration kDeadlineSlack = absl::Seconds(5);

// Records the pushes it is given; can fail the first `fail_pushes`.
class FakeDataPath final : public DataPath {
 public:
  struct Received {
    uint64_t step;
    uint32_t rank;
    uint32_t micro_batch;
    uint32_t micro_batches;
    FlatRange range;
    DType dtype;
    std::string data;
    std::vector<uint32_t> no_grad_tensors;
  };
  explicit FakeDataPath(std::string address) : address_(std::move(address)) {}
  const std::string& address() const override { return address_; }
  const char* name() const override { return "fake"; }
  absl::StatusOr<uint64_t> PushGradient(const GradientPush& push, absl::Time) override {
    absl::MutexLock lock(&mu_);
    if (fail_pushes_ > 0) {
      --fail_pushes_;
      return absl::UnavailableError("fake daemon: connection reset");
    }
    const size_t bytes = push.range.size() * DTypeSize(push.dtype);
    received_.push_back({push.step, push.rank, push.micro_batch, push.micro_batches, push.range,
                         push.dtype, std::string(static_cast<const char*>(push.data), bytes),
                         push.no_grad_tensors});
    return bytes;
  }
  absl::StatusOr<uint64_t> InitParameters(const ParameterUpload&, absl::Time) override {
    return absl::UnimplementedError("fake");
  }
  absl::StatusOr<uint64_t> Gather(const GatherRequestSpec&, void*, absl::Time) override {
    return absl::UnimplementedError("fake");
  }
  std::vector<Received> received() const {
    absl::MutexLock lock(&mu_);
    return received_;
  }
  void Clear() {
    absl::MutexLock lock(&mu_);
    received_.clear();
  }
  void FailPushes(int n) {
    absl::MutexLock lock(&mu_);
    fail_pushes_ = n;
  }

 private:
  const std::string address_;
  mutable absl::Mutex mu_;
  std::vector<Received> received_ ABSL_GUARDED_BY(mu_);
  int fail_pushes_ ABSL_GUARDED_BY(mu_) = 0;
};

// Tensors of awkward sizes: alignment gaps, and partitions of 2 or 3 ranks
// that differ in their real elements (the last one is short). With chunks
// of the minimum (16384 elements) partition 0 takes one round more than the
// last: 3 vs 2 rounds with 3 ranks, 4 vs 3 with 2.
Layout TestLayout() {
  std::vector<TensorSpec> t = {{"a", {37}, DType::kFp32, 0},
                               {"b", {5, 13}, DType::kFp32, 0},
                               {"c", {98050}, DType::kFp32, 1},
                               {"d", {3}, DType::kFp32, 2}};
  return *Layout::Create(t);
}

using testing::RunRanks;

std::string FreshDir() { return testing::FreshDir("gloo"); }

// Contributes ones for every element as micro-batch 0 of `step`.
absl::Status ContributeOnes(GlooCollective& c, uint64_t total, uint64_t step) {
  const std::vector<float> ones(total, 1.0f);
  absl::StatusOr<PushTicket> t =
      c.Reduce(step, 0, {0, total}, ones.data(), DType::kFp32, BufferUse::kCopy, MemoryKind::kHost,
               absl::Now() + absl::Seconds(10));
  return t.status();
}

// One job's shared pieces and every rank's collective.
struct Job {
  Job(uint32_t world, uint32_t num_daemons, DType wire, uint32_t micro_batches = 1,
      const std::string& rendezvous_dir = "")
      : layout(TestLayout()),
        map(*PartitionMap::Create(layout.total_elements(), world, num_daemons)),
        dir(rendezvous_dir.empty() ? FreshDir() : rendezvous_dir),
        traffic(world) {
    for (uint32_t d = 0; d < num_daemons; ++d) {
      daemons.push_back(std::make_unique<FakeDataPath>(absl::StrCat("fake:", d)));
    }
    for (uint32_t r = 0; r < world; ++r) {
      GlooCollective::Options o;
      o.rendezvous_dir = dir;
      o.chunk_bytes = GlooCollective::kMinExchangeChunkBytes;  // several rounds (see TestLayout)
      collectives.push_back(*GlooCollective::Create(o));
      CollectiveJob j;
      j.job_id = "gloo-test";
      j.rank = r;
      j.incarnation = 1;
      j.world_size = world;
      j.layout = &layout;
      j.map = &map;
      j.wire_dtype = wire;
      j.bucket_bytes = 1000 * DTypeSize(wire);
      j.micro_batches = micro_batches;
      for (auto& d : daemons) j.daemons.push_back(d.get());
      j.traffic = &traffic[r];
      j.rpc_timeout = absl::Seconds(5);
      EXPECT_TRUE(collectives.back()->Bind(j).ok());
    }
  }
  // The pushes received, assembled into the flat space (fp32), with checks
  // that rank p pushed only inside partition p to its owner.
  std::vector<float> Assembled(uint64_t step) const {
    std::vector<float> out(layout.total_elements(), -1.0f);
    for (uint32_t d = 0; d < daemons.size(); ++d) {
      for (const auto& r : daemons[d]->received()) {
        if (r.step != step) continue;
        EXPECT_TRUE(map.UnpaddedPartition(r.rank).Contains(r.range))
            << "rank " << r.rank << " pushed [" << r.range.begin << ", " << r.range.end << ")";
        EXPECT_EQ(map.DaemonOf(r.rank), d);
        EXPECT_EQ(r.micro_batch, 0u);
        EXPECT_EQ(r.micro_batches, 1u);
        ToFloat(r.dtype, r.data.data(), out.data() + r.range.begin, r.range.size());
      }
    }
    return out;
  }
  bool IsReal(uint64_t i) const {
    for (const auto& t : layout.tensors()) {
      if (t.range().Contains({i, i + 1})) return true;
    }
    return false;
  }

  Layout layout;
  PartitionMap map;
  std::string dir;
  std::vector<std::unique_ptr<FakeDataPath>> daemons;
  std::vector<TrafficCounters> traffic;
  std::vector<std::unique_ptr<GlooCollective>> collectives;
};

std::vector<float> RandomGrad(uint64_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> g(n);
  for (float& x : g) x = dist(gen);
  return g;
}

TEST(GlooCollectiveTest, SumsInRankOrderAndPushesOnlyItsPartition) {
  constexpr uint32_t kWorld = 3;
  Job job(kWorld, 2, DType::kFp32);
  const uint64_t total = job.layout.total_elements();
  for (uint64_t step = 1; step <= 2; ++step) {
    std::vector<std::vector<float>> grads;
    for (uint32_t r = 0; r < kWorld; ++r) grads.push_back(RandomGrad(total, step * 10 + r));
    RunRanks(kWorld, [&](uint32_t r) {
      GlooCollective& c = *job.collectives[r];
      // Two calls, split off the partition boundaries.
      const uint64_t cut = 101;
      for (FlatRange range : {FlatRange{cut, total}, FlatRange{0, cut}}) {
        absl::StatusOr<PushTicket> t =
            c.Reduce(step, 0, range, grads[r].data() + range.begin, DType::kFp32,
                     BufferUse::kBorrow, MemoryKind::kHost, absl::Now() + absl::Seconds(10));
        ASSERT_TRUE(t.ok()) << t.status();
        EXPECT_TRUE(t->done());
      }
      const absl::Status s = c.Finish(step, absl::Now() + absl::Seconds(20));
      EXPECT_TRUE(s.ok()) << "rank " << r << ": " << s;
    });
    // What the daemons sum in daemon reduce: rank order, fp32, gaps 0.
    std::vector<float> expected(total, 0.0f);
    for (uint64_t i = 0; i < total; ++i) {
      if (!job.IsReal(i)) continue;
      float s = grads[0][i];
      for (uint32_t r = 1; r < kWorld; ++r) s += grads[r][i];
      expected[i] = s;
    }
    const std::vector<float> got = job.Assembled(step);
    EXPECT_EQ(0, std::memcmp(got.data(), expected.data(), total * 4)) << "step " << step;
  }
  // Per step: Ψ/N_d to the daemons, the other partitions out, N_d - 1
  // copies of its own in.
  for (uint32_t p = 0; p < kWorld; ++p) {
    const TrafficBytes t = job.traffic[p].Total();
    uint64_t others = 0;
    for (uint32_t q = 0; q < kWorld; ++q) {
      if (q != p) others += job.map.UnpaddedPartition(q).size() * 4;
    }
    const uint64_t own = job.map.UnpaddedPartition(p).size() * 4;
    // And each step a byte per tensor to and from every peer: the ranks'
    // no-gradient marks.
    const uint64_t marks = (kWorld - 1) * job.layout.tensors().size();
    EXPECT_EQ(t.push, 2 * own) << "rank " << p;
    EXPECT_EQ(t.collective_sent, 2 * (others + marks)) << "rank " << p;
    EXPECT_EQ(t.collective_received, 2 * ((kWorld - 1) * own + marks)) << "rank " << p;
  }
  EXPECT_LT(job.map.UnpaddedPartition(2).size(), job.map.UnpaddedPartition(0).size());
  // Rank 2 receives nothing in the last round (see TestLayout).
  const uint64_t chunk = GlooCollective::kMinExchangeChunkBytes / 4;
  EXPECT_GT(job.map.UnpaddedPartition(0).size(), 2 * chunk);
  EXPECT_LE(job.map.UnpaddedPartition(2).size(), 2 * chunk);
  // Connected ranks leave no rendezvous files behind.
  DIR* d = opendir(job.dir.c_str());
  ASSERT_NE(d, nullptr);
  std::vector<std::string> left;
  while (const dirent* e = readdir(d)) {
    if (std::string(e->d_name) != "." && std::string(e->d_name) != "..") left.push_back(e->d_name);
  }
  closedir(d);
  EXPECT_TRUE(left.empty()) << left.size() << " files left, e.g. " << left[0];
}

TEST(GlooCollectiveTest, MicroBatchesAndHalfInputsAreSummedInOrder) {
  constexpr uint32_t kWorld = 2;
  constexpr uint32_t kMicro = 3;
  Job job(kWorld, 1, DType::kBf16, kMicro);
  const uint64_t total = job.layout.total_elements();
  // grads[r][m]: bf16 inputs.
  std::vector<std::vector<std::vector<uint16_t>>> grads(kWorld);
  for (uint32_t r = 0; r < kWorld; ++r) {
    for (uint32_t m = 0; m < kMicro; ++m) {
      const std::vector<float> f = RandomGrad(total, 100 + r * 10 + m);
      std::vector<uint16_t> h(total);
      FromFloat(DType::kBf16, f.data(), h.data(), total);
      grads[r].push_back(std::move(h));
    }
  }
  RunRanks(kWorld, [&](uint32_t r) {
    GlooCollective& c = *job.collectives[r];
    for (uint32_t m = 0; m < kMicro; ++m) {
      ASSERT_TRUE(c.Reduce(1, m, {0, total}, grads[r][m].data(), DType::kBf16, BufferUse::kCopy,
                           MemoryKind::kHost, absl::Now() + absl::Seconds(10))
                      .ok());
    }
    EXPECT_TRUE(c.Finish(1, absl::Now() + absl::Seconds(20)).ok());
  });
  std::vector<float> sum(total, 0.0f);
  for (uint64_t i = 0; i < total; ++i) {
    if (!job.IsReal(i)) continue;
    float s = 0;
    for (uint32_t r = 0; r < kWorld; ++r) {
      float local = Bf16ToFloat(grads[r][0][i]);
      for (uint32_t m = 1; m < kMicro; ++m) local += Bf16ToFloat(grads[r][m][i]);
      s = r == 0 ? local : s + local;
    }
    sum[i] = s;
  }
  // On the wire in the job's precision.
  std::vector<uint16_t> wire(total);
  FromFloat(DType::kBf16, sum.data(), wire.data(), total);
  std::vector<float> expected(total);
  ToFloat(DType::kBf16, wire.data(), expected.data(), total);
  const std::vector<float> got = job.Assembled(1);
  EXPECT_EQ(0, std::memcmp(got.data(), expected.data(), total * 4));
  EXPECT_EQ(job.traffic[0].Total().push, job.map.UnpaddedPartition(0).size() * 2);
}

// No-gradient marks: a tensor is pushed as without a gradient only when
// every rank marked it in every micro-batch (as torch.optim skips a
// parameter whose .grad no rank's backward set); each push of rank p names
// those of its bucket's tensors, also for a tensor that spans partitions.
TEST(GlooCollectiveTest, MarksNameTheTensorsNoRankHadAGradientFor) {
  constexpr uint32_t kWorld = 3;
  constexpr uint32_t kMicro = 2;
  Job job(kWorld, 2, DType::kFp32, kMicro);
  const uint64_t total = job.layout.total_elements();
  // Tensor 2 (c, across partitions): marked everywhere. Tensor 0 (a): by
  // every rank but in micro-batch 0 only. Tensor 1 (b): by ranks 0 and 1.
  auto marks = [](uint32_t r, uint32_t m) {
    std::vector<uint32_t> t;
    if (m == 0) t.push_back(0);
    if (r != 2) t.push_back(1);
    t.push_back(2);
    return t;
  };
  for (uint64_t step = 1; step <= 2; ++step) {
    RunRanks(kWorld, [&](uint32_t r) {
      GlooCollective& c = *job.collectives[r];
      const std::vector<float> g(total, 1.0f);
      for (uint32_t m = 0; m < kMicro; ++m) {
        // Step 2 marks nothing: every tensor has a gradient again.
        if (step == 1) ASSERT_TRUE(c.MarkNoGradient(step, m, marks(r, m)).ok());
        ASSERT_TRUE(c.Reduce(step, m, {0, total}, g.data(), DType::kFp32, BufferUse::kCopy,
                             MemoryKind::kHost, absl::Now() + absl::Seconds(10))
                        .ok());
      }
      const absl::Status s = c.Finish(step, absl::Now() + absl::Seconds(20));
      EXPECT_TRUE(s.ok()) << "rank " << r << ": " << s;
    });
    const FlatRange c_range = job.layout.tensors()[2].range();
    int named = 0;
    for (const auto& d : job.daemons) {
      for (const auto& r : d->received()) {
        if (r.step != step) continue;
        std::vector<uint32_t> expected;
        if (step == 1 && !r.range.Intersect(c_range).empty()) expected.push_back(2);
        EXPECT_EQ(r.no_grad_tensors, expected)
            << "step " << step << " rank " << r.rank << " [" << r.range.begin << ", "
            << r.range.end << ")";
        if (!expected.empty()) ++named;
      }
    }
    if (step == 1) {
      EXPECT_GE(named, 2) << "tensor c spans partitions: several pushes name it";
    }
  }
  // The marks must be on layout tensors.
  EXPECT_EQ(job.collectives[0]->MarkNoGradient(3, 0, {4}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(job.collectives[0]->MarkNoGradient(3, kMicro, {0}).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(GlooCollectiveTest, AMissingRankIsDeadlineExceededNotAHang) {
  constexpr uint32_t kWorld = 3;
  Job job(kWorld, 1, DType::kFp32);
  const uint64_t total = job.layout.total_elements();
  // Rank 2 never arrives at the rendezvous.
  const absl::Duration limit = absl::Seconds(3);
  RunRanks(2, [&](uint32_t r) {
    GlooCollective& c = *job.collectives[r];
    ASSERT_TRUE(ContributeOnes(c, total, 1).ok());
    const absl::Time start = absl::Now();
    const absl::Status s = c.Finish(1, start + limit);
    const absl::Duration took = absl::Now() - start;
    std::printf("rank %u after %s: %s\n", r, absl::FormatDuration(took).c_str(),
                s.ToString().c_str());
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_NE(s.message().find("rendezvous"), std::string::npos) << s;
    EXPECT_NE(s.message().find("rank(s) 2 did not arrive"), std::string::npos) << s;
    EXPECT_NE(s.message().find("arrived: 0, 1"), std::string::npos) << s;
    EXPECT_LE(took, limit + kDeadlineSlack) << "rank " << r;
    // Broken for good, with the first error in the message.
    const absl::Status again = c.Finish(1, absl::Now() + absl::Seconds(1));
    EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition) << again;
  });
  EXPECT_TRUE(job.daemons[0]->received().empty());
}

TEST(GlooCollectiveTest, ARankMissingFromAStepIsDeadlineExceededNamingIt) {
  constexpr uint32_t kWorld = 3;
  Job job(kWorld, 1, DType::kFp32);
  const uint64_t total = job.layout.total_elements();
  RunRanks(kWorld, [&](uint32_t r) {
    GlooCollective& c = *job.collectives[r];
    ASSERT_TRUE(ContributeOnes(c, total, 1).ok());
    ASSERT_TRUE(c.Finish(1, absl::Now() + absl::Seconds(20)).ok());
  });
  // Step 2 without rank 1.
  const absl::Duration limit = absl::Seconds(2);
  RunRanks(kWorld, [&](uint32_t r) {
    if (r == 1) return;
    GlooCollective& c = *job.collectives[r];
    ASSERT_TRUE(ContributeOnes(c, total, 2).ok());
    const absl::Time start = absl::Now();
    const absl::Status s = c.Finish(2, start + limit);
    std::printf("rank %u after %s: %s\n", r, absl::FormatDuration(absl::Now() - start).c_str(),
                s.ToString().c_str());
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_NE(s.message().find("rank(s) 1"), std::string::npos) << s;
    EXPECT_LE(absl::Now() - start, limit + kDeadlineSlack);
  });
}

TEST(GlooCollectiveTest, CallerMistakes) {
  Job job(1, 1, DType::kFp32, 2);
  GlooCollective& c = *job.collectives[0];
  const uint64_t total = job.layout.total_elements();
  const std::vector<float> g(total, 1.0f);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  ASSERT_TRUE(c.Reduce(1, 0, {0, 100}, g.data(), DType::kFp32, BufferUse::kCopy, MemoryKind::kHost,
                       deadline)
                  .ok());
  // Contributing twice.
  absl::StatusOr<PushTicket> twice = c.Reduce(1, 0, {50, 150}, g.data(), DType::kFp32,
                                              BufferUse::kCopy, MemoryKind::kHost, deadline);
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kInvalidArgument) << twice.status();
  EXPECT_NE(twice.status().message().find("[50, 100)"), std::string::npos) << twice.status();
  // Micro-batch 1 before micro-batch 0 is complete.
  absl::StatusOr<PushTicket> early = c.Reduce(1, 1, {0, 100}, g.data(), DType::kFp32,
                                              BufferUse::kCopy, MemoryKind::kHost, deadline);
  EXPECT_EQ(early.status().code(), absl::StatusCode::kFailedPrecondition) << early.status();
  // Incomplete: Finish names the first element nobody pushed.
  absl::Status s = c.Finish(1, deadline);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("element 100"), std::string::npos) << s;
  // The step can be contributed again from scratch.
  ASSERT_TRUE(c.Reduce(1, 0, {0, total}, g.data(), DType::kFp32, BufferUse::kCopy,
                       MemoryKind::kHost, deadline)
                  .ok());
  ASSERT_TRUE(c.Reduce(1, 1, {0, total}, g.data(), DType::kFp32, BufferUse::kCopy,
                       MemoryKind::kHost, deadline)
                  .ok());
  absl::StatusOr<PushTicket> done_mb = c.Reduce(1, 0, {0, 10}, g.data(), DType::kFp32,
                                                BufferUse::kCopy, MemoryKind::kHost, deadline);
  EXPECT_EQ(done_mb.status().code(), absl::StatusCode::kInvalidArgument) << done_mb.status();
  EXPECT_TRUE(c.Finish(1, deadline).ok());
  EXPECT_EQ(
      c.Reduce(1, 2, {0, 10}, g.data(), DType::kFp32, BufferUse::kCopy, MemoryKind::kHost, deadline)
          .status()
          .code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GlooCollective::Create({}).status().code(), absl::StatusCode::kInvalidArgument);
  GlooCollective::Options small;
  small.rendezvous_dir = job.dir;
  small.chunk_bytes = GlooCollective::kMinExchangeChunkBytes - 4;
  const absl::Status tiny = GlooCollective::Create(small).status();
  EXPECT_EQ(tiny.code(), absl::StatusCode::kInvalidArgument) << tiny;
  EXPECT_NE(tiny.message().find("chunk_bytes"), std::string::npos) << tiny;
}

// A model whose fp32 gradient cannot be allocated (2^45 elements, 128 TiB:
// all of a 47-bit address space): Bind returns ResourceExhausted naming the
// bytes instead of throwing std::bad_alloc.
TEST(GlooCollectiveTest, AnAllocationFailureIsResourceExhausted) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "ASan aborts a failed allocation unless allocator_may_return_null=1";
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
  GTEST_SKIP() << "ASan aborts a failed allocation unless allocator_may_return_null=1";
#endif
#endif
  const uint64_t n = uint64_t{1} << 45;
  const Layout layout = *Layout::Create({{"huge", {static_cast<int64_t>(n)}, DType::kFp32, 0}});
  const PartitionMap map = *PartitionMap::Create(layout.total_elements(), 1, 1);
  FakeDataPath daemon("fake:0");
  TrafficCounters traffic;
  GlooCollective::Options o;
  o.rendezvous_dir = FreshDir();
  std::unique_ptr<GlooCollective> c = *GlooCollective::Create(o);
  CollectiveJob j;
  j.job_id = "gloo-test";
  j.layout = &layout;
  j.map = &map;
  j.bucket_bytes = 64 << 20;
  j.daemons = {&daemon};
  j.traffic = &traffic;
  const absl::Status s = c->Bind(j);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find(absl::StrCat(n * 4, " bytes")), std::string::npos) << s;
  EXPECT_EQ(c->staging_bytes(), 0u);
}

// Marks `rank` arrived at job "gloo-test"'s rendezvous in `dir`, as a rank
// that then goes no further would.
void FakeArrival(const std::string& dir, uint32_t rank) {
  gloo::rendezvous::FileStore store(dir);
  gloo::rendezvous::PrefixStore prefixed("zeroshard/gloo-test", store);
  prefixed.set(absl::StrCat("arrived/", rank), std::vector<char>{'1'});
}

// While a Finish runs (here: waiting at the rendezvous for rank 1), a second
// Finish and new contributions are refused, naming the running step.
TEST(GlooCollectiveTest, OneStepAtATime) {
  Job job(2, 1, DType::kFp32);
  GlooCollective& c = *job.collectives[0];
  const uint64_t total = job.layout.total_elements();
  const std::vector<float> g(total, 1.0f);
  ASSERT_TRUE(ContributeOnes(c, total, 1).ok());
  absl::Status first;
  std::thread finishing([&] { first = c.Finish(1, absl::Now() + absl::Milliseconds(1500)); });
  absl::SleepFor(absl::Milliseconds(300));
  const absl::Status second = c.Finish(1, absl::Now() + absl::Seconds(1));
  EXPECT_EQ(second.code(), absl::StatusCode::kFailedPrecondition) << second;
  EXPECT_NE(second.message().find("Step for step 1 is running"), std::string::npos) << second;
  const absl::Status push = c.Reduce(2, 0, {0, total}, g.data(), DType::kFp32, BufferUse::kCopy,
                                     MemoryKind::kHost, absl::Now() + absl::Seconds(1))
                                .status();
  EXPECT_EQ(push.code(), absl::StatusCode::kFailedPrecondition) << push;
  EXPECT_NE(push.message().find("while Step for step 1 is running"), std::string::npos) << push;
  finishing.join();
  EXPECT_EQ(first.code(), absl::StatusCode::kDeadlineExceeded) << first;
}

// Rank 0 arrives and goes no further: rank 1's wait for rank 0's address
// inside Gloo's connectFullMesh (30 s in Gloo's FileStore) ends at the
// deadline.
TEST(GlooCollectiveTest, EveryRendezvousWaitEndsAtTheDeadline) {
  Job job(2, 1, DType::kFp32);
  FakeArrival(job.dir, 0);
  GlooCollective& c = *job.collectives[1];
  const uint64_t total = job.layout.total_elements();
  ASSERT_TRUE(ContributeOnes(c, total, 1).ok());
  const absl::Duration limit = absl::Milliseconds(1500);
  const absl::Time start = absl::Now();
  const absl::Status s = c.Finish(1, start + limit);
  const absl::Duration took = absl::Now() - start;
  std::printf("after %s: %s\n", absl::FormatDuration(took).c_str(), s.ToString().c_str());
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_LE(took, limit + kDeadlineSlack);
}

TEST(GlooCollectiveTest, RendezvousDirectoryProblemsAreToldApart) {
  // Files of an earlier failed run of the same job.
  {
    Job job(2, 1, DType::kFp32);
    FakeArrival(job.dir, 0);
    GlooCollective& c = *job.collectives[0];
    const uint64_t total = job.layout.total_elements();
    ASSERT_TRUE(ContributeOnes(c, total, 1).ok());
    const absl::Status s = c.Finish(1, absl::Now() + absl::Seconds(5));
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find("earlier run"), std::string::npos) << s;
  }
  // A path that is no directory: nothing can be written there.
  {
    const std::string file = absl::StrCat(FreshDir(), "/not-a-directory");
    FILE* f = std::fopen(file.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fclose(f);
    Job job(2, 1, DType::kFp32, 1, file);
    GlooCollective& c = *job.collectives[0];
    const uint64_t total = job.layout.total_elements();
    ASSERT_TRUE(ContributeOnes(c, total, 1).ok());
    const absl::Status s = c.Finish(1, absl::Now() + absl::Seconds(5));
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find("cannot be created"), std::string::npos) << s;  // Gloo's text
    EXPECT_NE(s.message().find("cannot write into"), std::string::npos) << s;
    EXPECT_EQ(s.message().find("earlier run"), std::string::npos) << s;
  }
}

TEST(GlooCollectiveTest, AFailedPushIsRetriedWithoutExchangingAgain) {
  constexpr uint32_t kWorld = 2;
  Job job(kWorld, 2, DType::kFp32);
  const uint64_t total = job.layout.total_elements();
  std::vector<std::vector<float>> grads = {RandomGrad(total, 1), RandomGrad(total, 2)};
  job.daemons[0]->FailPushes(1);  // rank 0's first bucket
  RunRanks(kWorld, [&](uint32_t r) {
    GlooCollective& c = *job.collectives[r];
    ASSERT_TRUE(c.Reduce(1, 0, {0, total}, grads[r].data(), DType::kFp32, BufferUse::kCopy,
                         MemoryKind::kHost, absl::Now() + absl::Seconds(10))
                    .ok());
    const absl::Status s = c.Finish(1, absl::Now() + absl::Seconds(20));
    if (r == 0) {
      EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
      EXPECT_NE(s.message().find("fake:0"), std::string::npos) << s;
    } else {
      EXPECT_TRUE(s.ok()) << s;
    }
  });
  // Rank 0 alone retries the step: its Reduce calls are ignored, and it
  // pushes the held rank sum (rank 1 is not there to exchange with).
  GlooCollective& c = *job.collectives[0];
  const std::vector<float> zeros(total, 0.0f);
  ASSERT_TRUE(c.Reduce(1, 0, {0, total}, zeros.data(), DType::kFp32, BufferUse::kCopy,
                       MemoryKind::kHost, absl::Now() + absl::Seconds(10))
                  .ok());
  ASSERT_TRUE(c.Finish(1, absl::Now() + absl::Seconds(5)).ok());
  std::vector<float> expected(total, 0.0f);
  for (uint64_t i = 0; i < total; ++i) {
    if (job.IsReal(i)) expected[i] = grads[0][i] + grads[1][i];
  }
  const std::vector<float> got = job.Assembled(1);
  EXPECT_EQ(0, std::memcmp(got.data(), expected.data(), total * 4));
}

// AllGather: each rank fetches only its partition's part of the range (the
// fake daemons' bytes are a function of the element index) and receives the
// rest from the others, for the whole model, a range across partition
// boundaries and one inside a single partition, fp32 and bf16; the traffic
// counts both sides.
TEST(GlooCollectiveTest, AllGatherFetchesOnlyItsPartitionAndExchangesTheRest) {
  constexpr uint32_t kWorld = 3;
  Job job(kWorld, 2, DType::kFp32);
  const uint64_t total = job.layout.total_elements();
  const FlatRange p1 = job.map.UnpaddedPartition(1);
  const std::vector<FlatRange> ranges = {
      {0, total}, {101, total - 57}, {p1.begin + 3, p1.end - 5}, {0, total}};
  for (DType dtype : {DType::kFp32, DType::kBf16}) {
    const size_t esize = DTypeSize(dtype);
    for (size_t round = 0; round < ranges.size(); ++round) {
      const FlatRange range = ranges[round];
      auto value = [&](uint64_t byte) {  // of the flat space's bytes
        return static_cast<uint8_t>((byte * 131 + round * 7 + byte / 251) & 0xff);
      };
      std::vector<std::vector<uint8_t>> dst(kWorld,
                                            std::vector<uint8_t>(range.size() * esize, 0xee));
      std::vector<TrafficBytes> before;
      for (uint32_t r = 0; r < kWorld; ++r) before.push_back(job.traffic[r].Total());
      RunRanks(kWorld, [&](uint32_t r) {
        int fetches = 0;
        absl::Status s = job.collectives[r]->AllGather(
            range, dst[r].data(), dtype, MemoryKind::kHost,
            [&](const FlatRange& piece, void* out) {
              ++fetches;
              EXPECT_EQ(piece, job.map.UnpaddedPartition(r).Intersect(range)) << "rank " << r;
              auto* b = static_cast<uint8_t*>(out);
              for (uint64_t k = 0; k < piece.size() * esize; ++k) {
                b[k] = value(piece.begin * esize + k);
              }
              return absl::OkStatus();
            },
            absl::Now() + absl::Seconds(20));
        EXPECT_TRUE(s.ok()) << "rank " << r << ": " << s;
        EXPECT_EQ(fetches, job.map.UnpaddedPartition(r).Intersect(range).empty() ? 0 : 1);
      });
      for (uint32_t r = 0; r < kWorld; ++r) {
        uint64_t wrong = 0;
        for (uint64_t k = 0; k < range.size() * esize; ++k) {
          wrong += dst[r][k] != value(range.begin * esize + k);
        }
        EXPECT_EQ(wrong, 0u) << "rank " << r << " " << DTypeName(dtype) << " round " << round;
        const TrafficBytes t = job.traffic[r].Total();
        const uint64_t own = job.map.UnpaddedPartition(r).Intersect(range).size() * esize;
        EXPECT_EQ(t.collective_sent - before[r].collective_sent, own * (kWorld - 1));
        EXPECT_EQ(t.collective_received - before[r].collective_received,
                  range.size() * esize - own);
      }
    }
  }
}

// A rank that does not come to an AllGather: the others fail with
// DeadlineExceeded naming it, by their deadline, and stay failed.
TEST(GlooCollectiveTest, AllGatherWithoutARankIsDeadlineExceededNamingIt) {
  constexpr uint32_t kWorld = 3;
  Job job(kWorld, 1, DType::kFp32);
  const uint64_t total = job.layout.total_elements();
  auto fetch = [](const FlatRange& range, void* out) {
    std::memset(out, 0, range.size() * 4);
    return absl::OkStatus();
  };
  std::vector<std::vector<float>> dst(kWorld, std::vector<float>(total));
  RunRanks(kWorld, [&](uint32_t r) {
    EXPECT_TRUE(job.collectives[r]
                    ->AllGather({0, total}, dst[r].data(), DType::kFp32, MemoryKind::kHost, fetch,
                                absl::Now() + absl::Seconds(20))
                    .ok());
  });
  // Rank 1 stays away: ranks 0 and 2 name it (rank 2's piece reached rank
  // 0, rank 0's reached rank 2).
  const absl::Duration limit = absl::Seconds(2);
  RunRanks(2, [&](uint32_t i) {
    const uint32_t r = i == 0 ? 0 : 2;
    const absl::Time start = absl::Now();
    const absl::Status s = job.collectives[r]->AllGather({0, total}, dst[r].data(), DType::kFp32,
                                                         MemoryKind::kHost, fetch, start + limit);
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_NE(s.message().find("receiving from rank 1"), std::string::npos) << s;
    EXPECT_NE(s.message().find("nothing had come from rank(s) 1 "), std::string::npos) << s;
    EXPECT_LE(absl::Now() - start, limit + kDeadlineSlack) << "rank " << r;
    const absl::Status again = job.collectives[r]->AllGather(
        {0, total}, dst[r].data(), DType::kFp32, MemoryKind::kHost, fetch, absl::Now() + limit);
    EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition) << again;
  });
}

// A rank whose own fetch from the daemons fails does not take part: it and
// the others end broken (FailedPrecondition afterwards), never out of step.
TEST(GlooCollectiveTest, AllGatherWithAFailedFetchBreaksEveryRank) {
  constexpr uint32_t kWorld = 2;
  Job job(kWorld, 1, DType::kFp32);
  const uint64_t total = job.layout.total_elements();
  std::vector<std::vector<float>> dst(kWorld, std::vector<float>(total));
  RunRanks(kWorld, [&](uint32_t r) {
    auto fetch = [r](const FlatRange& range, void* out) {
      if (r == 1) return absl::UnavailableError("daemon gone");
      std::memset(out, 0, range.size() * 4);
      return absl::OkStatus();
    };
    const absl::Status s =
        job.collectives[r]->AllGather({0, total}, dst[r].data(), DType::kFp32, MemoryKind::kHost,
                                      fetch, absl::Now() + absl::Seconds(2));
    EXPECT_EQ(s.code(),
              r == 1 ? absl::StatusCode::kUnavailable : absl::StatusCode::kDeadlineExceeded)
        << s;
    const absl::Status again =
        job.collectives[r]->AllGather({0, total}, dst[r].data(), DType::kFp32, MemoryKind::kHost,
                                      fetch, absl::Now() + absl::Seconds(1));
    EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition) << again;
  });
}

// Through the Client against in-process daemons: three ranks train three
// steps in daemon reduce and in the trainer collective; the parameters are
// the same bits.
TEST(GlooCollectiveTest, TrainsLikeDaemonReduceThroughTheClient) {
  constexpr uint32_t kWorld = 3;
  const Layout layout = testing::SampleLayout();
  const uint64_t total = layout.total_elements();
  std::vector<float> init(total, 0.0f);
  for (const auto& t : layout.tensors()) {
    for (uint64_t i = 0; i < t.numel; ++i) init[t.offset + i] = 0.01f * ((i * 7 + 3) % 23);
  }
  std::vector<std::vector<float>> results;
  std::vector<TrafficBytes> last_step;
  for (ReductionMode mode : {ReductionMode::kDaemon, ReductionMode::kTrainerCollective}) {
    std::vector<std::unique_ptr<Daemon>> daemons;
    std::vector<std::string> addresses;
    for (int d = 0; d < 2; ++d) {
      daemons.push_back(testing::StartDaemon());
      addresses.push_back(daemons.back()->address());
    }
    const std::string dir = FreshDir();
    std::vector<std::vector<float>> params(kWorld, std::vector<float>(total));
    std::vector<TrafficBytes> traffic(kWorld);
    RunRanks(kWorld, [&](uint32_t rank) {
      ClientConfig c;
      c.job_token = testing::kTestToken;
      c.daemons = addresses;
      c.job_id = "gloo-client";
      c.rank = rank;
      c.world_size = kWorld;
      c.stage = 2;
      c.precision = DType::kFp32;
      c.bucket_bytes = 4096;
      c.optimizer.lr = 1e-2f;
      c.max_grad_norm = 1.0f;
      c.rpc_timeout = absl::Seconds(10);
      c.step_timeout = absl::Seconds(20);
      c.reduction = mode;
      std::unique_ptr<Collective> collective;
      if (mode == ReductionMode::kTrainerCollective) {
        GlooCollective::Options o;
        o.rendezvous_dir = dir;
        collective = *GlooCollective::Create(o);
      }
      absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(c, std::move(collective));
      ASSERT_TRUE(client.ok()) << client.status();
      ASSERT_TRUE((*client)->RegisterModel(layout, init.data()).ok());
      std::vector<float> grad(total);
      for (int step = 1; step <= 3; ++step) {
        ASSERT_TRUE((*client)->GatherAll(params[rank].data(), DType::kFp32).ok());
        for (uint64_t i = 0; i < total; ++i) {
          grad[i] = params[rank][i] * 0.5f + 0.001f * static_cast<float>((i + rank * 13) % 17);
        }
        ASSERT_TRUE((*client)->PushGradients({0, total}, grad.data(), DType::kFp32).status().ok());
        absl::StatusOr<StepResult> r = (*client)->Step(0.01f);
        ASSERT_TRUE(r.ok()) << "rank " << rank << ": " << r.status();
      }
      ASSERT_TRUE((*client)->GatherAll(params[rank].data(), DType::kFp32).ok());
      traffic[rank] = (*client)->TrafficReport().last_step;
    });
    for (uint32_t r = 1; r < kWorld; ++r) EXPECT_EQ(params[r], params[0]);
    results.push_back(params[0]);
    last_step.push_back(traffic[0]);
  }
  ASSERT_EQ(results.size(), 2u);
  EXPECT_EQ(0, std::memcmp(results[0].data(), results[1].data(), total * 4));
  const PartitionMap map = *PartitionMap::Create(total, kWorld, 2);
  EXPECT_EQ(last_step[0].push, total * 4);
  EXPECT_EQ(last_step[0].collective(), 0u);
  EXPECT_EQ(last_step[0].gather, total * 4);
  // Trainer collective, rank 0's step: the reduce-scatter's (its partition
  // from the 2 others, the others' partitions to them) and the parameter
  // all-gather's (its partition to the 2 others, theirs in); the daemons
  // see only partition 0, pushed and gathered.
  // Besides, a byte per tensor to and from each of the 2 others: the marks.
  const uint64_t own = map.UnpaddedPartition(0).size() * 4;
  const uint64_t marks = 2 * layout.tensors().size();
  EXPECT_EQ(last_step[1].push, own);
  EXPECT_EQ(last_step[1].gather, own);
  EXPECT_EQ(last_step[1].collective_received, 2 * own + (total * 4 - own) + marks);
  EXPECT_EQ(last_step[1].collective_sent, (total * 4 - own) + 2 * own + marks);
}

}  // namespace
}  // namespace zeroshard
