#include "client/layer_cache.h"

#include <atomic>
#include <cstring>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace zeroshard {
namespace {

Layout ThreeLayers() {
  return *Layout::Create({{"a", {100}, DType::kFp32, 0},
                          {"b", {300}, DType::kFp32, 1},
                          {"c", {50}, DType::kFp32, 2}});
}

// Fills a fetch with `after_step * 1000 + flat index`; fetches of step
// `blocked_step` wait for `release` (at most 10 s).
struct Fetcher {
  absl::Status operator()(const FlatRange& range, uint64_t after_step, void* dst) {
    ++calls;
    if (after_step == blocked_step) {
      started.store(true);
      release.WaitForNotificationWithTimeout(absl::Seconds(10));
    }
    float* out = static_cast<float*>(dst);
    for (uint64_t i = range.begin; i < range.end; ++i) {
      out[i - range.begin] = static_cast<float>(after_step * 1000 + i);
    }
    return absl::OkStatus();
  }
  uint64_t blocked_step = ~0ull;
  std::atomic<bool> started{false};
  std::atomic<int> calls{0};
  absl::Notification release;
};

LayerCache::Options Opts(uint32_t buffers, uint32_t depth) {
  LayerCache::Options o;
  o.dtype = DType::kFp32;
  o.buffers = buffers;
  o.prefetch_depth = depth;
  o.timeout = absl::Seconds(5);
  return o;
}

TEST(LayerCacheTest, GathersPrefetchAheadAndServeHits) {
  const Layout layout = ThreeLayers();
  Fetcher f;
  LayerCache cache(&layout, Opts(3, 2), [&](const FlatRange& r, uint64_t s, void* d) {
    return f(r, s, d);
  });
  EXPECT_EQ(cache.bytes(), 3u * layout.LayerRange(1)->size() * 4);
  std::vector<float> out(layout.total_elements());
  for (size_t i = 0; i < 3; ++i) {
    ASSERT_TRUE(cache.Gather(i, 4, out.data()).ok());
    const FlatRange r = *layout.LayerRange(layout.layers()[i]);
    EXPECT_EQ(out[0], static_cast<float>(4000 + r.begin));
  }
  EXPECT_EQ(cache.misses(), 1u);
  EXPECT_EQ(cache.hits(), 2u);
}

TEST(LayerCacheTest, ViewsAreHeldUntilReleased) {
  const Layout layout = ThreeLayers();
  Fetcher f;
  LayerCache cache(&layout, Opts(2, 0), [&](const FlatRange& r, uint64_t s, void* d) {
    return f(r, s, d);
  });
  absl::StatusOr<const void*> v0 = cache.View(0, 1);
  absl::StatusOr<const void*> v1 = cache.View(1, 1);
  ASSERT_TRUE(v0.ok() && v1.ok());
  EXPECT_EQ(static_cast<const float*>(*v1)[0], 1000.0f + layout.LayerRange(1)->begin);
  EXPECT_EQ(cache.View(2, 1).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(cache.CheckNoneHeld().code(), absl::StatusCode::kFailedPrecondition);
  cache.Release(0);
  cache.Release(1);
  EXPECT_TRUE(cache.CheckNoneHeld().ok());
  EXPECT_TRUE(cache.View(2, 1).ok());
}

// Bug 2's mechanism: discarding the buffers of the old parameters never
// waits for a prefetch still running, and that prefetch's bytes are never
// served for the new step; its buffer returns to the pool when it ends.
TEST(LayerCacheTest, DiscardAllNeitherWaitsNorServesStaleLayers) {
  const Layout layout = ThreeLayers();
  Fetcher f;
  f.blocked_step = 0;
  LayerCache cache(&layout, Opts(1, 0), [&](const FlatRange& r, uint64_t s, void* d) {
    return f(r, s, d);
  });
  cache.Prefetch(1, 0);
  while (!f.started.load()) absl::SleepFor(absl::Milliseconds(1));
  const absl::Time start = absl::Now();
  cache.DiscardAll();
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(100));
  // Step 1's layer is fetched on demand, not taken from the stale buffer.
  std::vector<float> out(layout.total_elements());
  ASSERT_TRUE(cache.Gather(1, 1, out.data()).ok());
  EXPECT_EQ(out[0], 1000.0f + layout.LayerRange(1)->begin);
  // The only buffer is still being filled for step 0: a view waits for it.
  f.release.Notify();
  absl::StatusOr<const void*> v = cache.View(2, 1);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(static_cast<const float*>(*v)[0], 1000.0f + layout.LayerRange(2)->begin);
}

}  // namespace
}  // namespace zeroshard
