// The node cache (JobSpec.node_cache) on in-process daemons: one daemon
// serves a gather of the whole model, bit for bit what the owners serve,
// reading the other daemon once per step; bad input stays a clear error.

#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "metrics/metric_names.h"
#include "metrics/registry.h"
#include "server/daemon.h"
#include "server/job/job.h"
#include "server/status_page.h"
#include "server/testing/daemon_fixture.h"

namespace zeroshard {
namespace {

using testing::DaemonClient;
using testing::ExpectRejected;
using testing::RandomVector;
using testing::RequestCount;
using testing::TestCluster;

constexpr uint32_t kWorld = 4;

uint64_t CacheBytes(Daemon& daemon, const std::string& job) {
  return daemon.ledger().JobBytes(job)[static_cast<int>(MemoryCategory::kParamCache)];
}

// The job's series of `family` on the daemon's /metrics.
double JobMetric(const Daemon& daemon, const metrics::MetricSpec& family, const std::string& job) {
  return metrics::SumOf(daemon.registry().Collect(), family.name, {{"job", job}});
}

// The whole model as the owners serve it, one gather per daemon (in
// `dtype`, widened to fp32: exact).
std::vector<float> PerOwner(TestCluster& c, uint64_t step, v1::DType dtype = v1::DTYPE_FP32) {
  std::vector<float> all(c.total());
  for (int d = 0; d < c.num_daemons(); ++d) {
    const FlatRange r = c.DaemonRange(d);
    std::vector<float> part;
    grpc::Status s = c.client(d).Gather(c.job(), step, r, &part, 5000, dtype);
    EXPECT_TRUE(s.ok()) << s.error_message();
    if (part.size() == r.size()) std::memcpy(all.data() + r.begin, part.data(), r.size() * 4);
  }
  return all;
}

TEST(NodeCacheTest, ADaemonServesTheWholeModelAsTheOwnersDoReadingThemOncePerStep) {
  TestCluster c(2, kWorld, 3, "nc", "", v1::DTYPE_FP32, /*node_cache=*/true);
  std::mt19937 rng(7);
  c.Init(RandomVector(rng, c.total(), 0.1f));
  const uint64_t others = c.total() - c.DaemonRange(0).size();
  for (uint64_t step = 0; step <= 3; ++step) {
    if (step > 0) {
      std::vector<std::vector<float>> grads;
      for (uint32_t r = 0; r < kWorld; ++r) grads.push_back(RandomVector(rng, c.total(), 1.0f));
      c.PushAll(step, grads);
      c.Step(step, 1e-2f, 1.0f);
    }
    const std::vector<float> want = PerOwner(c, step);
    const double owner_gathers = RequestCount(c.daemon(1), "Gather");
    // Several ranks of daemon 0's host, concurrently: whole model, a range
    // across both daemons, a range of daemon 1's only.
    const FlatRange ranges[] = {{0, c.total()},
                                {c.DaemonRange(0).end - 5, c.DaemonRange(0).end + 7},
                                c.DaemonRange(1)};
    std::vector<std::thread> ranks;
    for (int i = 0; i < 6; ++i) {
      ranks.emplace_back([&, i] {
        const FlatRange r = ranges[i % 3];
        DaemonClient rank(c.daemon(0).address());
        std::vector<float> got;
        grpc::Status s = rank.Gather(c.job(), step, r, &got);
        ASSERT_TRUE(s.ok()) << s.error_message();
        ASSERT_EQ(got.size(), r.size());
        EXPECT_EQ(std::memcmp(got.data(), want.data() + r.begin, r.size() * 4), 0)
            << "step " << step << " range [" << r.begin << ", " << r.end << ")";
      });
    }
    for (std::thread& t : ranks) t.join();
    // One read of daemon 1 for the step, whatever the gathers through daemon 0.
    EXPECT_EQ(RequestCount(c.daemon(1), "Gather") - owner_gathers, 1) << "step " << step;
    EXPECT_EQ(CacheBytes(c.daemon(0), c.job()), others * sizeof(float));
    EXPECT_EQ((*c.daemon(0).jobs().Find(c.job()))->param_cache()->counts().fetches, step + 1);
    // On /metrics: per step one copy fetched (daemon 1's range), and the
    // other five gathers served from it.
    EXPECT_EQ(JobMetric(c.daemon(0), metrics::kNodeCacheFetchesTotal, c.job()), step + 1);
    EXPECT_EQ(JobMetric(c.daemon(0), metrics::kNodeCacheHitsTotal, c.job()), 5 * (step + 1));
    EXPECT_EQ(JobMetric(c.daemon(0), metrics::kNodeCacheFetchBytesTotal, c.job()),
              (step + 1) * others * sizeof(float));
  }
  EXPECT_EQ(JobMetric(c.daemon(1), metrics::kNodeCacheFetchesTotal, c.job()), 0);
  // The status page's node-cache line says the same.
  StatusPageSources sources;
  const std::shared_ptr<Job> job = *c.daemon(0).jobs().Find(c.job());
  sources.jobs = [job] { return std::vector<std::shared_ptr<Job>>{job}; };
  sources.ledger = &c.daemon(0).ledger();
  const std::string page = StatusPage(sources).Render();
  EXPECT_NE(page.find(absl::StrCat("20 gather(s) served from a copy, 4 copies fetched from the "
                                   "owners, ")),
            std::string::npos)
      << page;
  EXPECT_NE(page.find(absl::StrCat("(", 4 * others * sizeof(float), " B) read from them")),
            std::string::npos)
      << page;
  // The owner's side works the same way.
  std::vector<float> got;
  ASSERT_TRUE(c.client(1).Gather(c.job(), 3, {0, c.total()}, &got).ok());
  EXPECT_EQ(std::memcmp(got.data(), PerOwner(c, 3).data(), c.total() * 4), 0);
}

// A bf16 job: the cache holds the half-precision copy; fp32 gathers (the
// masters) are passed through to the owners, a chunk at a time.
TEST(NodeCacheTest, HalfPrecisionIsCachedAndMastersPassThrough) {
  TestCluster c(2, kWorld, 3, "nc-bf16", "", v1::DTYPE_BF16, /*node_cache=*/true);
  std::mt19937 rng(11);
  c.Init(RandomVector(rng, c.total(), 0.1f));
  const uint64_t others = c.total() - c.DaemonRange(0).size();
  for (uint64_t step = 0; step <= 2; ++step) {
    if (step > 0) {
      std::vector<std::vector<float>> grads;
      for (uint32_t r = 0; r < kWorld; ++r) grads.push_back(RandomVector(rng, c.total(), 1.0f));
      c.PushAll(step, grads);
      c.Step(step, 1e-2f, 1.0f);
    }
    for (v1::DType dtype : {v1::DTYPE_BF16, v1::DTYPE_FP32}) {
      const std::vector<float> want = PerOwner(c, step, dtype);
      const double owner_gathers = RequestCount(c.daemon(1), "Gather");
      std::vector<float> got;
      grpc::Status s = c.client(0).Gather(c.job(), step, {0, c.total()}, &got, 5000, dtype);
      ASSERT_TRUE(s.ok()) << s.error_message();
      ASSERT_EQ(got.size(), c.total());
      EXPECT_EQ(std::memcmp(got.data(), want.data(), c.total() * 4), 0)
          << "step " << step << " dtype " << dtype;
      // bf16: one fetch of the step; fp32: daemon 1's part, passed through.
      EXPECT_GE(RequestCount(c.daemon(1), "Gather") - owner_gathers, 1);
    }
    EXPECT_EQ(CacheBytes(c.daemon(0), c.job()), others * 2);
    EXPECT_EQ((*c.daemon(0).jobs().Find(c.job()))->param_cache()->counts().fetches, step + 1);
  }
}

TEST(NodeCacheTest, AStateWriteOutsideAStepIsServedAtOnce) {
  TestCluster c(2, kWorld, 3, "nc-write", "", v1::DTYPE_FP32, /*node_cache=*/true);
  std::mt19937 rng(8);
  c.Init(RandomVector(rng, c.total(), 0.1f));
  std::vector<float> got;
  ASSERT_TRUE(c.client(0).Gather(c.job(), 0, {0, c.total()}, &got).ok());
  // Every rank writes the same state dict to every daemon, then gathers.
  // Twice the values, alignment gaps zeros (as a write demands).
  std::vector<float> written(c.total(), 0.0f);
  const Layout layout = testing::SampleLayout();
  for (const TensorPlacement& t : layout.tensors()) {
    for (uint64_t e = t.range().begin; e < t.range().end; ++e) written[e] = 2 * got[e];
  }
  for (int d = 0; d < 2; ++d) {
    const FlatRange r = c.DaemonRange(d);
    grpc::Status s = c.client(d).WriteState({testing::StateChunk(
        c.job(), 0, v1::STATE_ARRAY_MASTER, r, written.data() + r.begin)});
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  ASSERT_TRUE(c.client(0).Gather(c.job(), 0, {0, c.total()}, &got).ok());
  EXPECT_EQ(std::memcmp(got.data(), PerOwner(c, 0).data(), c.total() * 4), 0);
  EXPECT_EQ(std::memcmp(got.data(), written.data(), c.total() * 4), 0);
}

TEST(NodeCacheTest, BadGathersStayClearErrors) {
  TestCluster plain(2, kWorld, 3, "plain");
  // Without the node cache a daemon serves only its own range.
  ExpectRejected(plain.daemon(0), plain.job(), grpc::StatusCode::INVALID_ARGUMENT, "range:", [&] {
    std::vector<float> out;
    return plain.client(0).Gather(plain.job(), 0, {0, plain.total()}, &out);
  });
  EXPECT_EQ(CacheBytes(plain.daemon(0), plain.job()), 0u);

  TestCluster c(2, kWorld, 3, "nc-bad", "", v1::DTYPE_FP32, /*node_cache=*/true);
  std::mt19937 rng(9);
  c.Init(RandomVector(rng, c.total(), 0.1f));
  std::vector<float> out;
  ExpectRejected(c.daemon(0), c.job(), grpc::StatusCode::INVALID_ARGUMENT, "range:", [&] {
    return c.client(0).Gather(c.job(), 0, {c.total() - 2, c.total() + 3}, &out);
  });
  ExpectRejected(c.daemon(0), c.job(), grpc::StatusCode::FAILED_PRECONDITION, "after_step:", [&] {
    return c.client(0).Gather(c.job(), 5, {0, c.total()}, &out);
  });
  ExpectRejected(c.daemon(0), c.job(), grpc::StatusCode::INVALID_ARGUMENT, "wait_only", [&] {
    v1::GatherRequest req;
    req.set_job_id(c.job());
    req.mutable_range()->set_end(c.total());
    req.set_dtype(v1::DTYPE_FP32);
    req.set_wait_only(true);
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", std::string("Bearer ") + testing::kTestToken);
    auto reader = c.client(0).shard->Gather(&ctx, req);
    v1::ParameterChunk chunk;
    while (reader->Read(&chunk)) {
    }
    return reader->Finish();
  });
  // Another job's token opens nothing, and the owners are not asked.
  const double owner_gathers = RequestCount(c.daemon(1), "Gather");
  ExpectRejected(c.daemon(0), c.job(), grpc::StatusCode::PERMISSION_DENIED, "token", [&] {
    DaemonClient stranger(c.daemon(0).address(), "another-jobs-token-0123456789");
    return stranger.Gather(c.job(), 0, {0, c.total()}, &out);
  });
  EXPECT_EQ(RequestCount(c.daemon(1), "Gather"), owner_gathers);
  EXPECT_EQ(CacheBytes(c.daemon(0), c.job()), 0u);
}

}  // namespace
}  // namespace zeroshard
