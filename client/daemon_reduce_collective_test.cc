#include "client/daemon_reduce_collective.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "common/protocol.h"
#include "gtest/gtest.h"

namespace zeroshard {
namespace {

// Records pushes in memory.
class FakeDataPath final : public DataPath {
 public:
  struct Received {
    uint64_t step;
    uint32_t micro_batch;
    FlatRange range;
    std::string data;
    const void* source;  // where the bytes were read from
    uint64_t incarnation;
    std::vector<uint32_t> no_grad_tensors;
  };

  explicit FakeDataPath(std::string address) : address_(std::move(address)) {}

  const std::string& address() const override { return address_; }
  const char* name() const override { return "fake"; }

  absl::StatusOr<uint64_t> PushGradient(const GradientPush& push, absl::Time) override {
    absl::SleepFor(delay);
    absl::MutexLock lock(&mu);
    if (!fail.ok()) return fail;
    const size_t bytes = push.range.size() * DTypeSize(push.dtype);
    received.push_back({push.step, push.micro_batch, push.range,
                        keep_data ? std::string(static_cast<const char*>(push.data), bytes) : "",
                        push.data, push.incarnation, push.no_grad_tensors});
    return bytes;
  }
  PullMemory PullMemoryOf(const void*, uint64_t) const override {
    // Every push is pulled from one memory as large as the address space.
    return pull_serial == 0 ? PullMemory{} : PullMemory{pull_serial, 0, UINTPTR_MAX};
  }
  std::vector<absl::StatusOr<uint64_t>> PushGradients(const std::vector<GradientPush>& pushes,
                                                      absl::Time deadline) override {
    {
      absl::MutexLock lock(&mu);
      uint64_t bytes = 0;
      for (const GradientPush& p : pushes) bytes += p.range.size() * DTypeSize(p.dtype);
      batches.push_back({pushes.size(), bytes});
    }
    return DataPath::PushGradients(pushes, deadline);
  }
  absl::StatusOr<uint64_t> InitParameters(const ParameterUpload&, absl::Time) override {
    return absl::UnimplementedError("fake");
  }
  absl::StatusOr<uint64_t> Gather(const GatherRequestSpec&, void*, absl::Time) override {
    return absl::UnimplementedError("fake");
  }

  absl::Mutex mu;
  std::vector<Received> received ABSL_GUARDED_BY(mu);
  // Per PushGradients call: how many pushes, how many payload bytes.
  std::vector<std::pair<size_t, uint64_t>> batches ABSL_GUARDED_BY(mu);
  absl::Status fail ABSL_GUARDED_BY(mu);
  absl::Duration delay = absl::ZeroDuration();
  bool keep_data = true;
  // The serial of the memory PullMemoryOf names for every push (0: none
  // is pulled).
  uint64_t pull_serial = 0;

 private:
  std::string address_;
};

// A stand-in for a CUDA device: "device memory" is host memory inside
// [base, base + bytes); copies convert as the host path does; the copy
// numbered fail_at (from 1) fails.
class FakeDeviceCopier final : public DeviceCopier {
 public:
  int device() const override { return 0; }
  absl::Status CheckDevicePointer(const void* p, size_t n, absl::string_view what) const override {
    const auto* b = static_cast<const uint8_t*>(base);
    const auto* q = static_cast<const uint8_t*>(p);
    if (q < b || q + n > b + bytes) return absl::InvalidArgumentError(absl::StrCat(what, ": host"));
    return absl::OkStatus();
  }
  absl::Status ToHost(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t n,
                      absl::Time) override {
    if (++copies == fail_at) {
      failed_src = src;
      return absl::InternalError("CUDA device-to-host copy: an illegal memory access");
    }
    std::vector<float> tmp(n);
    ToFloat(src_dtype, src, tmp.data(), n);
    FromFloat(dst_dtype, tmp.data(), dst, n);
    return absl::OkStatus();
  }
  absl::Status FromHostAsync(const void*, void*, size_t, int) override {
    return absl::UnimplementedError("fake");
  }
  absl::Status WaitLane(int, absl::Time) override { return absl::OkStatus(); }
  absl::Status Pin(void*, size_t n) override {
    pinned += n;
    return absl::OkStatus();
  }
  void Unpin(void*) override { pinned = 0; }

  const void* base = nullptr;
  size_t bytes = 0;
  int copies = 0;
  int fail_at = -1;
  const void* failed_src = nullptr;
  size_t pinned = 0;
};

Layout TestLayout() {
  return *Layout::Create({{"embed", {97, 13}, DType::kFp32, 0},
                          {"l1.w", {13, 13}, DType::kFp32, 1},
                          {"l1.b", {13}, DType::kFp32, 1},
                          {"big.w", {211, 37}, DType::kFp32, 2},
                          {"big.b", {37}, DType::kFp32, 2},
                          {"head", {5, 3}, DType::kFp32, 3}});
}

// A collective bound to fake daemons.
struct Rig {
  Rig(const Layout& l, uint32_t world, uint32_t daemons, uint64_t bucket_bytes,
      uint32_t staging = 4, DType wire = DType::kFp32, uint32_t micro_batches = 1,
      DeviceCopier* device = nullptr, uint32_t stage = 1)
      : layout(l), map(*PartitionMap::Create(l.total_elements(), world, daemons)) {
    for (uint32_t d = 0; d < daemons; ++d) {
      paths.push_back(std::make_unique<FakeDataPath>("fake:" + std::to_string(d)));
    }
    DaemonReduceCollective::Options o;
    o.bucket_bytes = bucket_bytes;
    o.wire_dtype = wire;
    o.staging_buffers = staging;
    collective = *DaemonReduceCollective::Create(o);
    CollectiveJob job;
    job.job_id = "job";
    job.incarnation = 42;
    job.world_size = world;
    job.layout = &layout;
    job.map = &map;
    job.wire_dtype = wire;
    job.bucket_bytes = bucket_bytes;
    job.micro_batches = micro_batches;
    job.stage = stage;
    for (auto& p : paths) job.daemons.push_back(p.get());
    job.traffic = &traffic;
    job.device = device;
    EXPECT_TRUE(collective->Bind(job).ok());
  }

  absl::StatusOr<PushTicket> Push(uint64_t step, const FlatRange& r, const float* grads,
                                  uint32_t mb = 0, BufferUse use = BufferUse::kCopy) {
    return collective->Reduce(step, mb, r, grads + r.begin, DType::kFp32, use, MemoryKind::kHost,
                              absl::Now() + absl::Seconds(10));
  }
  // How many pushes read their bytes from inside [begin, end).
  int PushesReadFrom(const void* begin, const void* end) {
    int n = 0;
    for (auto& p : paths) {
      absl::MutexLock lock(&p->mu);
      for (const auto& r : p->received) n += r.source >= begin && r.source < end;
    }
    return n;
  }
  absl::Status Finish(uint64_t step) {
    return collective->Finish(step, absl::Now() + absl::Seconds(10));
  }
  // Every push received, ordered by (daemon, range).
  std::vector<std::pair<FlatRange, std::string>> Received() {
    std::vector<std::pair<FlatRange, std::string>> out;
    for (auto& p : paths) {
      absl::MutexLock lock(&p->mu);
      for (const auto& r : p->received) out.push_back({r.range, r.data});
    }
    std::sort(out.begin(), out.end(),
              [](const auto& a, const auto& b) { return a.first.begin < b.first.begin; });
    return out;
  }

  Layout layout;
  PartitionMap map;
  std::vector<std::unique_ptr<FakeDataPath>> paths;
  TrafficCounters traffic;
  std::unique_ptr<DaemonReduceCollective> collective;
};

std::vector<float> Gradient(const Layout& layout, float gap_value) {
  std::vector<float> g(layout.total_elements(), gap_value);
  for (const TensorPlacement& t : layout.tensors()) {
    for (uint64_t i = t.offset; i < t.offset + t.numel; ++i) g[i] = 0.001f * i + 1.0f;
  }
  return g;
}

// The chunks a daemon sees depend on the layout, N_d and C_B only: a whole-model
// push, per-layer pushes in backward order and per-tensor pushes in random order
// produce the same chunk ranges and bytes (gaps as zeros), whether the
// caller's buffer is copied or borrowed.
TEST(DaemonReduceCollectiveTest, ChunksDoNotDependOnHowPushesAreSplit) {
  const Layout layout = TestLayout();
  std::vector<std::vector<std::pair<FlatRange, std::string>>> results;
  for (int mode = 0; mode < 6; ++mode) {
    SCOPED_TRACE(mode);
    const BufferUse use = mode < 3 ? BufferUse::kCopy : BufferUse::kBorrow;
    Rig rig(layout, 3, 2, 4096);
    // Garbage in the gaps of the caller's buffer must not reach the wire.
    const std::vector<float> g = Gradient(layout, mode % 3 == 0 ? 7.0f : 0.0f);
    std::vector<PushTicket> tickets;
    if (mode % 3 == 0) {
      tickets.push_back(*rig.Push(1, {0, layout.total_elements()}, g.data(), 0, use));
    } else if (mode % 3 == 1) {
      for (auto it = layout.layers().rbegin(); it != layout.layers().rend(); ++it) {
        tickets.push_back(*rig.Push(1, *layout.LayerRange(*it), g.data(), 0, use));
      }
    } else {
      std::vector<FlatRange> ranges;
      for (const TensorPlacement& t : layout.tensors()) ranges.push_back(t.range());
      std::shuffle(ranges.begin(), ranges.end(), std::mt19937(3));
      for (const FlatRange& r : ranges) tickets.push_back(*rig.Push(1, r, g.data(), 0, use));
    }
    ASSERT_TRUE(rig.Finish(1).ok());
    for (const PushTicket& t : tickets) EXPECT_TRUE(t.Wait(absl::Now()).ok());
    results.push_back(rig.Received());
    EXPECT_EQ(rig.traffic.Total().push, layout.total_elements() * 4);
  }
  ASSERT_EQ(results[0].size(), results[1].size());
  for (size_t mode = 1; mode < results.size(); ++mode) EXPECT_EQ(results[0], results[mode]) << mode;
  // Gaps are zeros.
  const Layout& l = layout;
  for (const auto& [range, data] : results[0]) {
    const float* v = reinterpret_cast<const float*>(data.data());
    for (uint64_t i = range.begin; i < range.end; ++i) {
      bool real = false;
      for (const TensorPlacement& t : l.tensors()) real = real || t.range().Contains({i, i + 1});
      if (!real) {
        ASSERT_EQ(v[i - range.begin], 0.0f) << i;
      }
    }
  }
}

// Gradients in device memory go through the copier into the (pinned)
// staging pool and reach the daemons as host ones do; a copy that fails
// fails the call, leaves that bucket unwritten and earlier ones written, and
// pushing the rest completes the step with the same bytes.
TEST(DaemonReduceCollectiveTest, DeviceGradientsAndAFailedCopy) {
  const Layout layout = TestLayout();
  const uint64_t total = layout.total_elements();
  const std::vector<float> g = Gradient(layout, 0.0f);
  Rig host(layout, 2, 2, 1024);
  ASSERT_TRUE(host.Push(1, {0, total}, g.data()).ok());
  ASSERT_TRUE(host.Finish(1).ok());

  FakeDeviceCopier device;
  device.base = g.data();
  device.bytes = total * 4;
  device.fail_at = 5;
  Rig rig(layout, 2, 2, 1024, 4, DType::kFp32, 1, &device);
  EXPECT_GT(device.pinned, 0u);
  auto push = [&](const FlatRange& r, const float* from) {
    return rig.collective->Reduce(1, 0, r, from, DType::kFp32, BufferUse::kBorrow,
                                  MemoryKind::kCudaDevice, absl::Now() + absl::Seconds(10));
  };
  // Host memory passed as device memory.
  std::vector<float> elsewhere(total);
  EXPECT_EQ(push({0, total}, elsewhere.data()).status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<PushTicket> failed = push({0, total}, g.data());
  ASSERT_EQ(failed.status().code(), absl::StatusCode::kInternal) << failed.status();
  EXPECT_TRUE(absl::StrContains(failed.status().message(), "from the device")) << failed.status();
  // The bucket holding the failed copy's first element and those after it
  // are still to push.
  const uint64_t failed_at = static_cast<const float*>(device.failed_src) - g.data();
  uint64_t resume = 0;
  for (const Bucket& b : rig.collective->plan().buckets()) {
    if (b.range.Contains({failed_at, failed_at + 1})) resume = b.range.begin;
  }
  ASSERT_GT(resume, 0u);
  EXPECT_EQ(push({0, resume}, g.data()).status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(push({resume, total}, g.data() + resume).ok());
  ASSERT_TRUE(rig.Finish(1).ok());
  EXPECT_EQ(rig.Received(), host.Received());
}

// Buckets queued for one daemon while a send is under way leave together,
// as long as their bytes (with the daemon's per-chunk count) fit one bucket:
// the short last buckets of a daemon's range, from several micro-batches,
// share requests; a full bucket always goes alone. However many partitions
// a daemon's range holds, it is cut by C_B alone.
TEST(DaemonReduceCollectiveTest, SmallBucketsForOneDaemonTravelTogether) {
  const Layout layout = TestLayout();
  constexpr uint32_t kMicroBatches = 8;
  for (const uint64_t bucket_bytes : {uint64_t{65536}, uint64_t{4096}}) {
    SCOPED_TRACE(bucket_bytes);
    Rig rig(layout, 64, 2, bucket_bytes, 8, DType::kFp32, kMicroBatches);
    const size_t nb = rig.collective->plan().buckets().size();
    for (const Bucket& b : rig.collective->plan().buckets()) {
      EXPECT_TRUE(rig.map.DaemonRange(b.daemon).Contains(b.range));
    }
    size_t expected = 0;  // each daemon's real elements cut by C_B alone
    for (uint32_t d = 0; d < 2; ++d) {
      const uint64_t span = rig.map.DaemonRange(d).Intersect({0, layout.total_elements()}).size();
      expected += (span + bucket_bytes / 4 - 1) / (bucket_bytes / 4);
    }
    EXPECT_EQ(nb, expected);
    for (auto& p : rig.paths) p->delay = absl::Milliseconds(20);
    const std::vector<float> g = Gradient(layout, 0.0f);
    // Borrowed, as a trainer with a persistent gradient buffer pushes (a
    // bucket with alignment gaps is still staged, then sent from the pool).
    std::vector<PushTicket> tickets;
    for (uint32_t mb = 0; mb < kMicroBatches; ++mb) {
      tickets.push_back(
          *rig.Push(1, {0, layout.total_elements()}, g.data(), mb, BufferUse::kBorrow));
    }
    ASSERT_TRUE(rig.Finish(1).ok());
    for (const PushTicket& t : tickets) ASSERT_TRUE(t.Wait(absl::Now()).ok());
    size_t calls = 0;
    size_t pushes = 0;
    size_t shared = 0;
    for (auto& p : rig.paths) {
      absl::MutexLock lock(&p->mu);
      calls += p->batches.size();
      for (const auto& [n, bytes] : p->batches) {
        pushes += n;
        if (n > 1) {
          ++shared;
          EXPECT_LE(bytes + n * kPushChunkOverheadBytes, bucket_bytes);
        }
      }
    }
    EXPECT_EQ(pushes, nb * kMicroBatches);
    if (bucket_bytes == 65536) {  // each daemon's range is one bucket of ~19 kB
      EXPECT_EQ(nb, 2u);
      EXPECT_GT(shared, 0u);
      EXPECT_LT(calls, pushes) << calls << " calls";
    }
    EXPECT_EQ(rig.traffic.Total().push, layout.total_elements() * 4 * kMicroBatches);
  }
}

// Pushes the daemon reads from one push memory itself (pulls) go in one
// call however many bytes they cover: the call carries none of them.
TEST(DaemonReduceCollectiveTest, PullsFromOnePushMemoryTravelTogether) {
  const Layout layout = TestLayout();
  constexpr uint64_t kBucketBytes = 4096;
  Rig rig(layout, 2, 1, kBucketBytes);
  const size_t nb = rig.collective->plan().buckets().size();
  ASSERT_GT(nb, 8u);
  rig.paths[0]->pull_serial = 7;
  const std::vector<float> g = Gradient(layout, 0.0f);
  absl::StatusOr<PushTicket> t =
      rig.Push(1, {0, layout.total_elements()}, g.data(), 0, BufferUse::kBorrow);
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_TRUE(rig.Finish(1).ok());
  ASSERT_TRUE(t->Wait(absl::Now()).ok());
  FakeDataPath& path = *rig.paths[0];
  absl::MutexLock lock(&path.mu);
  EXPECT_EQ(path.received.size(), nb);
  // Buckets with gaps go through the staging pool, the others are read
  // from `g` (pulled).
  const auto from_g = [&](const FakeDataPath::Received& r) {
    return r.source >= static_cast<const void*>(g.data()) &&
           r.source < static_cast<const void*>(g.data() + g.size());
  };
  const size_t pulled = std::count_if(path.received.begin(), path.received.end(), from_g);
  ASSERT_GT(pulled, 1u);
  ASSERT_LT(pulled, nb);
  // One borrowed push queues every pulled bucket at once: they leave in one
  // call (at most 64 go in one); each pool bucket goes alone, each answer
  // freeing its buffer.
  ASSERT_LE(nb, 64u);
  size_t largest = 0;
  for (const auto& [n, bytes] : path.batches) largest = std::max(largest, n);
  EXPECT_EQ(largest, pulled);
  EXPECT_EQ(path.batches.size(), nb - pulled + 1);
}

// MarkNoGradient's marks reach the daemons in the chunk of every bucket that
// overlaps a marked tensor: the tensors of that bucket marked for that
// micro-batch, ascending, and only in the step they were marked for.
TEST(DaemonReduceCollectiveTest, PushesCarryTheTensorsMarkedWithoutAGradient) {
  const Layout layout = TestLayout();  // embed, l1.w, l1.b, big.w, big.b, head
  Rig rig(layout, 2, 2, 4096, 4, DType::kFp32, /*micro_batches=*/2);
  const std::vector<float> g = Gradient(layout, 0.0f);
  const std::vector<std::vector<uint32_t>> marked = {{1, 2, 4}, {0, 4, 5}};  // by micro-batch
  EXPECT_EQ(rig.collective->MarkNoGradient(1, 2, {0}).code(), absl::StatusCode::kInvalidArgument);
  for (uint32_t mb = 0; mb < 2; ++mb) {
    ASSERT_TRUE(rig.collective->MarkNoGradient(1, mb, marked[mb]).ok());
  }
  // Marks may come in several calls.
  ASSERT_TRUE(rig.collective->MarkNoGradient(1, 0, {3}).ok());
  const std::vector<std::vector<uint32_t>> expected_marks = {{1, 2, 3, 4}, {0, 4, 5}};
  for (uint32_t mb = 0; mb < 2; ++mb) {
    ASSERT_TRUE(rig.Push(1, {0, layout.total_elements()}, g.data(), mb).ok());
  }
  ASSERT_TRUE(rig.Finish(1).ok());
  auto check = [&](uint64_t step, const std::vector<std::vector<uint32_t>>& marks) {
    size_t pushes = 0, carrying = 0;
    std::vector<std::set<uint32_t>> seen(2);
    for (auto& p : rig.paths) {
      absl::MutexLock lock(&p->mu);
      for (const auto& r : p->received) {
        if (r.step != step) continue;
        ++pushes;
        std::vector<uint32_t> want;
        const auto [first, last] = layout.TensorsIn(r.range);
        for (uint32_t t : marks[r.micro_batch]) {
          if (t >= first && t < last) want.push_back(t);
        }
        EXPECT_EQ(r.no_grad_tensors, want) << "step " << step << " micro-batch " << r.micro_batch
                                           << " range " << r.range;
        carrying += r.no_grad_tensors.empty() ? 0 : 1;
        seen[r.micro_batch].insert(r.no_grad_tensors.begin(), r.no_grad_tensors.end());
      }
    }
    EXPECT_EQ(pushes, 2 * rig.collective->plan().buckets().size());
    // Every marked tensor reached some daemon.
    for (uint32_t mb = 0; mb < 2; ++mb) {
      EXPECT_EQ(seen[mb], std::set<uint32_t>(marks[mb].begin(), marks[mb].end())) << mb;
    }
    return carrying;
  };
  EXPECT_GT(check(1, expected_marks), 2u);
  // The next step carries nothing it was not told.
  for (uint32_t mb = 0; mb < 2; ++mb) {
    ASSERT_TRUE(rig.Push(2, {0, layout.total_elements()}, g.data(), mb).ok());
  }
  ASSERT_TRUE(rig.Finish(2).ok());
  EXPECT_EQ(check(2, {{}, {}}), 0u);
  // Step 3 marks its own.
  ASSERT_TRUE(rig.collective->MarkNoGradient(3, 1, {5}).ok());
  for (uint32_t mb = 0; mb < 2; ++mb) {
    ASSERT_TRUE(rig.Push(3, {0, layout.total_elements()}, g.data(), mb).ok());
  }
  ASSERT_TRUE(rig.Finish(3).ok());
  EXPECT_EQ(check(3, {{}, {5}}), 1u);
}

// Stage 3 pushes layer by layer: its buckets never cross a layer boundary.
TEST(DaemonReduceCollectiveTest, Stage3BucketsFollowTheLayers) {
  const Layout layout = TestLayout();
  auto crossing = [&](const Rig& rig) {
    size_t n = 0;
    for (const Bucket& b : rig.collective->plan().buckets()) {
      bool inside = false;
      for (uint32_t l : layout.layers()) inside = inside || layout.LayerRange(l)->Contains(b.range);
      n += inside ? 0 : 1;
    }
    return n;
  };
  Rig stage2(layout, 2, 2, 4096, 4, DType::kFp32, 1, nullptr, /*stage=*/2);
  Rig stage3(layout, 2, 2, 4096, 4, DType::kFp32, 1, nullptr, /*stage=*/3);
  EXPECT_GT(crossing(stage2), 0u);
  EXPECT_EQ(crossing(stage3), 0u);
  // Layer by layer, in backward order, as stage 3 pushes: the same bytes as
  // one push of everything in stage 2, cut differently.
  const std::vector<float> g = Gradient(layout, 0.0f);
  for (auto it = layout.layers().rbegin(); it != layout.layers().rend(); ++it) {
    ASSERT_TRUE(stage3.Push(1, *layout.LayerRange(*it), g.data()).ok());
  }
  ASSERT_TRUE(stage2.Push(1, {0, layout.total_elements()}, g.data()).ok());
  ASSERT_TRUE(stage2.Finish(1).ok());
  ASSERT_TRUE(stage3.Finish(1).ok());
  auto bytes = [](Rig& rig) {
    std::vector<char> out;
    for (const auto& [range, data] : rig.Received()) {
      out.insert(out.end(), data.begin(), data.end());
    }
    return out;
  };
  EXPECT_EQ(bytes(stage3), bytes(stage2));
  EXPECT_GT(stage3.Received().size(), stage2.Received().size());
}

TEST(DaemonReduceCollectiveTest, ConvertsToTheWireType) {
  const Layout layout = TestLayout();
  Rig rig(layout, 2, 1, 8192, 4, DType::kBf16);
  const std::vector<float> g = Gradient(layout, 0.0f);
  ASSERT_TRUE(rig.Push(1, {0, layout.total_elements()}, g.data()).ok());
  ASSERT_TRUE(rig.Finish(1).ok());
  for (const auto& [range, data] : rig.Received()) {
    ASSERT_EQ(data.size(), range.size() * 2);
    const uint16_t* v = reinterpret_cast<const uint16_t*>(data.data());
    for (uint64_t i = range.begin; i < range.end; ++i) {
      ASSERT_EQ(v[i - range.begin], FloatToBf16(g[i]));
    }
  }
  EXPECT_EQ(rig.traffic.Total().push, layout.total_elements() * 2);
}

// The staging pool is sized by C_B and the buffer count alone: the same for a
// 10M- and a 500M-parameter model, and never exceeded while pushing.
TEST(DaemonReduceCollectiveTest, StagingMemoryIsBoundedByTheBucketSize) {
  const uint64_t cb = 1 << 20;
  uint64_t staging[2];
  const int64_t sizes[2] = {10'000'000, 500'000'000};
  for (int i = 0; i < 2; ++i) {
    const Layout layout = *Layout::Create({{"w", {sizes[i]}, DType::kFp32, 0}});
    Rig rig(layout, 8, 2, cb, 4);
    rig.paths[0]->delay = rig.paths[1]->delay = absl::Milliseconds(2);
    rig.paths[0]->keep_data = rig.paths[1]->keep_data = false;
    staging[i] = rig.collective->staging_bytes();
    // Push about 4M elements (16 buckets) through 4 buffers, ending on a
    // bucket boundary so that every bucket completes.
    uint64_t end = 0;
    for (const Bucket& b : rig.collective->plan().buckets()) {
      if (b.range.end <= (4u << 20)) end = b.range.end;
    }
    ASSERT_GE(end, 15u * (cb / 4));
    std::vector<float> g(end, 1.0f);
    absl::StatusOr<PushTicket> t =
        rig.collective->Reduce(1, 0, {0, g.size()}, g.data(), DType::kFp32, BufferUse::kCopy,
                               MemoryKind::kHost, absl::Now() + absl::Seconds(10));
    ASSERT_TRUE(t.ok());
    ASSERT_TRUE(t->Wait(absl::Now() + absl::Seconds(10)).ok());
    EXPECT_EQ(rig.collective->peak_buffers_in_use(), 4u);
    EXPECT_EQ(rig.traffic.Total().push, g.size() * 4);
  }
  EXPECT_EQ(staging[0], 4 * cb);
  EXPECT_EQ(staging[1], staging[0]);
}

// A borrowed buffer's whole, gap-free buckets in the wire dtype go out from
// the caller's memory without a staging buffer; a bucket the call covers only
// in part is staged. The bytes on the wire are the same either way.
TEST(DaemonReduceCollectiveTest, BorrowedWholeBucketsAreSentFromTheCallersBuffer) {
  const uint64_t cb = 4096;  // 1024 fp32 elements
  const Layout layout = *Layout::Create({{"w", {10 * 1024}, DType::kFp32, 0}});
  std::vector<float> g(layout.total_elements());
  for (size_t i = 0; i < g.size(); ++i) g[i] = 0.25f * static_cast<float>(i);
  const void* g_begin = g.data();
  const void* g_end = g.data() + g.size();
  std::vector<std::pair<FlatRange, std::string>> copied;
  {
    Rig rig(layout, 2, 2, cb);
    ASSERT_TRUE(rig.Push(1, {0, g.size()}, g.data()).ok());
    ASSERT_TRUE(rig.Finish(1).ok());
    EXPECT_EQ(rig.PushesReadFrom(g_begin, g_end), 0);
    copied = rig.Received();
  }
  Rig rig(layout, 2, 2, cb);
  // Every bucket whole: nothing staged.
  absl::StatusOr<PushTicket> t = rig.Push(1, {0, g.size()}, g.data(), 0, BufferUse::kBorrow);
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_TRUE(rig.Finish(1).ok());
  EXPECT_TRUE(t->done());
  EXPECT_EQ(rig.collective->peak_buffers_in_use(), 0u);
  EXPECT_EQ(rig.PushesReadFrom(g_begin, g_end), static_cast<int>(copied.size()));
  EXPECT_EQ(rig.Received(), copied);
  EXPECT_EQ(rig.traffic.Total().push, g.size() * 4);
  // Step 2 cuts the pushes across bucket boundaries: the pieces that make up
  // a whole bucket only together are staged, the whole buckets are not.
  for (auto& p : rig.paths) {
    absl::MutexLock lock(&p->mu);
    p->received.clear();
  }
  const FlatRange a{0, 2500}, b{2500, g.size()};
  ASSERT_TRUE(rig.Push(2, a, g.data(), 0, BufferUse::kBorrow).ok());
  ASSERT_TRUE(rig.Push(2, b, g.data(), 0, BufferUse::kBorrow).ok());
  ASSERT_TRUE(rig.Finish(2).ok());
  EXPECT_GE(rig.collective->peak_buffers_in_use(), 1u);
  const int staged = static_cast<int>(copied.size()) - rig.PushesReadFrom(g_begin, g_end);
  EXPECT_EQ(staged, 1);  // [2048, 3072) only; partitions start at 0 and 5120
  EXPECT_EQ(rig.Received(), copied);
}

// A borrowed push that fails part-way sends nothing from the caller's buffer
// (the caller gets no ticket to wait on) and leaves its whole buckets free to
// be pushed again.
TEST(DaemonReduceCollectiveTest, AFailedBorrowedPushSendsNothingFromTheBuffer) {
  const Layout layout = *Layout::Create({{"w", {10 * 1024}, DType::kFp32, 0}});
  std::vector<float> g(layout.total_elements());
  for (size_t i = 0; i < g.size(); ++i) g[i] = 0.5f * static_cast<float>(i);
  Rig rig(layout, 2, 2, 4096, /*staging=*/2);
  // Both staging buffers hold partly pushed buckets ([0, 1024) and [1024, 2048)).
  ASSERT_TRUE(rig.Push(1, {0, 10}, g.data()).ok());
  ASSERT_TRUE(rig.Push(1, {1024, 1030}, g.data()).ok());
  // Whole bucket [2048, 3072), then part of [3072, 4096), which needs a buffer.
  absl::StatusOr<PushTicket> t = rig.Push(1, {2048, 3100}, g.data(), 0, BufferUse::kBorrow);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kResourceExhausted) << t.status();
  EXPECT_TRUE(rig.Received().empty());
  // Complete the two partial buckets; the whole one can be pushed again.
  ASSERT_TRUE(rig.Push(1, {10, 1024}, g.data()).ok());
  ASSERT_TRUE(rig.Push(1, {1030, 2048}, g.data()).ok());
  ASSERT_TRUE(rig.Push(1, {2048, g.size()}, g.data(), 0, BufferUse::kBorrow).ok());
  ASSERT_TRUE(rig.Finish(1).ok());
  EXPECT_EQ(rig.traffic.Total().push, g.size() * 4);
  EXPECT_EQ(rig.PushesReadFrom(g.data(), g.data() + g.size()), 8);  // [2048, 10240)
}

// A borrowed buffer in another dtype than the wire's is converted, so staged.
TEST(DaemonReduceCollectiveTest, BorrowedBuffersOfAnotherDtypeAreStaged) {
  const Layout layout = *Layout::Create({{"w", {4096}, DType::kFp32, 0}});
  Rig rig(layout, 1, 1, 4096, 4, DType::kBf16);
  const std::vector<float> g(layout.total_elements(), 1.5f);
  ASSERT_TRUE(rig.Push(1, {0, g.size()}, g.data(), 0, BufferUse::kBorrow).ok());
  ASSERT_TRUE(rig.Finish(1).ok());
  EXPECT_EQ(rig.PushesReadFrom(g.data(), g.data() + g.size()), 0);
  EXPECT_EQ(rig.traffic.Total().push, g.size() * 2);
}

TEST(DaemonReduceCollectiveTest, RejectsOverlappingPushes) {
  const Layout layout = TestLayout();
  Rig rig(layout, 2, 1, 4096);
  const std::vector<float> g = Gradient(layout, 0.0f);
  ASSERT_TRUE(rig.Push(1, {0, 100}, g.data()).ok());
  absl::StatusOr<PushTicket> again = rig.Push(1, {50, 150}, g.data());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(again.status().message(), "already pushed")) << again.status();
  ASSERT_TRUE(rig.Push(1, {100, layout.total_elements()}, g.data()).ok());
  // Every bucket is complete and sent now; any range is a duplicate.
  EXPECT_EQ(rig.Push(1, {5000, 5001}, g.data()).status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(rig.Finish(1).ok());
}

TEST(DaemonReduceCollectiveTest, PartlyFilledBucketsThatExhaustThePoolFailAtOnce) {
  const Layout layout = TestLayout();
  Rig rig(layout, 1, 1, 4096, 2);
  const std::vector<float> g = Gradient(layout, 0.0f);
  ASSERT_TRUE(rig.Push(1, {0, 10}, g.data()).ok());
  ASSERT_TRUE(rig.Push(1, {1024, 1030}, g.data()).ok());
  const absl::Time start = absl::Now();
  absl::StatusOr<PushTicket> third = rig.Push(1, {2048, 2050}, g.data());
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted) << third.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
}

TEST(DaemonReduceCollectiveTest, FinishNamesWhatWasNotPushed) {
  const Layout layout = TestLayout();
  Rig rig(layout, 2, 2, 4096);
  const std::vector<float> g = Gradient(layout, 0.0f);
  const FlatRange big = *layout.LayerRange(2);
  ASSERT_TRUE(rig.Push(1, {0, big.begin}, g.data()).ok());
  ASSERT_TRUE(rig.Push(1, {big.end, layout.total_elements()}, g.data()).ok());
  const absl::Status s = rig.Finish(1);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(s.message(), "fake:")) << s;
  // The next step starts clean.
  ASSERT_TRUE(rig.Push(2, {0, layout.total_elements()}, g.data()).ok());
  EXPECT_TRUE(rig.Finish(2).ok());
}

TEST(DaemonReduceCollectiveTest, BucketsOfPaddingOnlyAreSentByFinish) {
  // 4096-element alignment with 1024-element buckets: most buckets hold no
  // tensor element at all.
  const Layout layout = *Layout::Create({{"a", {10}, DType::kFp32, 0},
                                         {"b", {20}, DType::kFp32, 1}},
                                        4096);
  Rig rig(layout, 2, 1, 4096);
  const std::vector<float> g = Gradient(layout, 0.0f);
  for (const TensorPlacement& t : layout.tensors())
    ASSERT_TRUE(rig.Push(1, t.range(), g.data()).ok());
  ASSERT_TRUE(rig.Finish(1).ok());
  EXPECT_EQ(rig.Received().size(), rig.collective->plan().buckets().size());
  EXPECT_EQ(rig.traffic.Total().push, layout.total_elements() * 4);
}

TEST(DaemonReduceCollectiveTest, SendErrorsReachTicketsAndFinish) {
  const Layout layout = TestLayout();
  Rig rig(layout, 2, 2, 4096);
  {
    absl::MutexLock lock(&rig.paths[1]->mu);
    rig.paths[1]->fail = absl::UnavailableError("daemon fake:1: gone");
  }
  const std::vector<float> g = Gradient(layout, 0.0f);
  absl::StatusOr<PushTicket> t = rig.Push(1, {0, layout.total_elements()}, g.data());
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->Wait(absl::Now() + absl::Seconds(10)).code(), absl::StatusCode::kUnavailable);
  const absl::Status s = rig.Finish(1);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(s.message(), "fake:1")) << s;
}

// A retry of a failed step sends only what the daemons did not confirm: the
// buckets daemon 0 took in the first attempt count as delivered and are not
// sent again (were they, this daemon would answer ALREADY_EXISTS, which is
// an error now), whatever the split of the retry's pushes.
TEST(DaemonReduceCollectiveTest, ARetrySkipsTheBucketsDeliveredBefore) {
  const Layout layout = TestLayout();
  Rig rig(layout, 2, 2, 4096);
  {
    absl::MutexLock lock(&rig.paths[1]->mu);
    rig.paths[1]->fail = absl::UnavailableError("daemon fake:1: gone");
  }
  const std::vector<float> g = Gradient(layout, 0.0f);
  ASSERT_TRUE(rig.Push(1, {0, layout.total_elements()}, g.data()).ok());
  EXPECT_EQ(rig.Finish(1).code(), absl::StatusCode::kUnavailable);
  size_t first_attempt = 0;
  {
    absl::MutexLock lock(&rig.paths[0]->mu);
    first_attempt = rig.paths[0]->received.size();
    rig.paths[0]->fail = absl::AlreadyExistsError("already pushed");
  }
  {
    absl::MutexLock lock(&rig.paths[1]->mu);
    rig.paths[1]->fail = absl::OkStatus();
  }
  ASSERT_GT(first_attempt, 0u);
  const uint64_t pushed_before = rig.traffic.Total().push;
  // The retry pushes tensor by tensor, last first, half of them borrowed.
  std::vector<PushTicket> tickets;
  int k = 0;
  for (auto it = layout.tensors().rbegin(); it != layout.tensors().rend(); ++it, ++k) {
    absl::StatusOr<PushTicket> p =
        rig.Push(1, it->range(), g.data(), 0, k % 2 ? BufferUse::kBorrow : BufferUse::kCopy);
    ASSERT_TRUE(p.ok()) << p.status();
    tickets.push_back(*p);
  }
  const absl::Status s = rig.Finish(1);
  ASSERT_TRUE(s.ok()) << s;
  for (const PushTicket& p : tickets) EXPECT_TRUE(p.Wait(absl::Now()).ok());
  {
    absl::MutexLock lock(&rig.paths[0]->mu);
    EXPECT_EQ(rig.paths[0]->received.size(), first_attempt);
  }
  // Every element went out exactly once over the two attempts.
  EXPECT_EQ(rig.traffic.Total().push, layout.total_elements() * 4);
  EXPECT_GT(rig.traffic.Total().push, pushed_before);
  // The next step sends everything again.
  {
    absl::MutexLock lock(&rig.paths[0]->mu);
    rig.paths[0]->fail = absl::OkStatus();
  }
  ASSERT_TRUE(rig.Push(2, {0, layout.total_elements()}, g.data()).ok());
  ASSERT_TRUE(rig.Finish(2).ok());
  EXPECT_EQ(rig.traffic.Total().push, 2 * layout.total_elements() * 4);
}

// After a Step that failed later than Finish (waiting for the other ranks),
// the retry may call Finish again without pushing: everything was delivered.
TEST(DaemonReduceCollectiveTest, FinishingAgainNeedsNoPushWhenEverythingWasDelivered) {
  const Layout layout = TestLayout();
  Rig rig(layout, 2, 2, 4096);
  const std::vector<float> g = Gradient(layout, 0.0f);
  ASSERT_TRUE(rig.Push(1, {0, layout.total_elements()}, g.data()).ok());
  ASSERT_TRUE(rig.Finish(1).ok());
  const uint64_t pushed = rig.traffic.Total().push;
  EXPECT_TRUE(rig.Finish(1).ok());
  // Pushing it again is allowed too, and sends nothing.
  ASSERT_TRUE(rig.Push(1, {0, 100}, g.data()).ok());
  EXPECT_TRUE(rig.Finish(1).ok());
  EXPECT_EQ(rig.traffic.Total().push, pushed);
  // A new step needs its own pushes.
  EXPECT_EQ(rig.Finish(2).code(), absl::StatusCode::kFailedPrecondition);
}

// ALREADY_EXISTS is an error to the collective: only a data path that can
// prove the bytes equal turns a duplicate into "delivered".
TEST(DaemonReduceCollectiveTest, AlreadyExistsIsNotDelivered) {
  const Layout layout = TestLayout();
  Rig rig(layout, 2, 1, 4096);
  {
    absl::MutexLock lock(&rig.paths[0]->mu);
    rig.paths[0]->fail = absl::AlreadyExistsError("duplicate");
  }
  const std::vector<float> g = Gradient(layout, 0.0f);
  ASSERT_TRUE(rig.Push(1, {0, layout.total_elements()}, g.data()).ok());
  EXPECT_EQ(rig.Finish(1).code(), absl::StatusCode::kAlreadyExists);
}

TEST(DaemonReduceCollectiveTest, PushesCarryTheRanksIncarnation) {
  const Layout layout = TestLayout();
  Rig rig(layout, 2, 1, 4096);
  const std::vector<float> g = Gradient(layout, 0.0f);
  ASSERT_TRUE(rig.Push(1, {0, layout.total_elements()}, g.data()).ok());
  ASSERT_TRUE(rig.Finish(1).ok());
  absl::MutexLock lock(&rig.paths[0]->mu);
  ASSERT_FALSE(rig.paths[0]->received.empty());
  for (const auto& r : rig.paths[0]->received) EXPECT_EQ(r.incarnation, 42u);
}

TEST(DaemonReduceCollectiveTest, MicroBatchesArePushedSeparately) {
  const Layout layout = TestLayout();
  Rig rig(layout, 2, 1, 4096, 4, DType::kFp32, 2);
  const std::vector<float> g = Gradient(layout, 0.0f);
  ASSERT_TRUE(rig.Push(1, {0, layout.total_elements()}, g.data(), 0).ok());
  EXPECT_EQ(rig.Push(1, {0, 10}, g.data(), 2).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(rig.Finish(1).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(rig.Push(2, {0, layout.total_elements()}, g.data(), 1).ok());
  ASSERT_TRUE(rig.Push(2, {0, layout.total_elements()}, g.data(), 0).ok());
  EXPECT_TRUE(rig.Finish(2).ok());
}

TEST(DaemonReduceCollectiveTest, ConcurrentPushersShareBuckets) {
  const Layout layout = TestLayout();
  Rig rig(layout, 3, 2, 4096, 3);
  const std::vector<float> g = Gradient(layout, 0.0f);
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  const std::vector<TensorPlacement>& ts = layout.tensors();
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([&, t] {
      for (size_t i = t; i < ts.size(); i += 3) {
        if (!rig.Push(1, ts[i].range(), g.data()).ok()) ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  ASSERT_TRUE(rig.Finish(1).ok());
  Rig whole(layout, 3, 2, 4096);
  ASSERT_TRUE(whole.Push(1, {0, layout.total_elements()}, g.data()).ok());
  ASSERT_TRUE(whole.Finish(1).ok());
  EXPECT_EQ(rig.Received(), whole.Received());
}

}  // namespace
}  // namespace zeroshard
