#include "client/bucket_plan.h"

#include <algorithm>
#include <vector>

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

Layout MakeLayout() {
  return *Layout::Create({{"a", {1000, 3}, DType::kFp32, 0},
                          {"b", {77}, DType::kFp32, 1},
                          {"c", {4099}, DType::kFp32, 1},
                          {"d", {5}, DType::kFp32, 2}});
}

// Buckets tile the real elements in order, each inside one span of its cut
// (a partition, or a daemon's run of partitions), cut every bucket_elements
// from the span's start.
TEST(BucketPlanTest, BucketsTileEachSpanFromItsStart) {
  const Layout layout = MakeLayout();
  for (const BucketCut cut : {BucketCut::kPartition, BucketCut::kDaemon}) {
    for (uint32_t world : {1u, 2u, 3u, 5u, 8u}) {
      SCOPED_TRACE(::testing::Message() << "cut " << static_cast<int>(cut) << " world " << world);
      const PartitionMap map =
          *PartitionMap::Create(layout.total_elements(), world, 2 > world ? 1 : 2);
      const BucketPlan plan = *BucketPlan::Create(layout, map, 4096, DType::kFp32, cut);
      ASSERT_EQ(plan.bucket_elements(), 1024u);
      uint64_t pos = 0, real = 0;
      for (const Bucket& b : plan.buckets()) {
        const FlatRange span =
            cut == BucketCut::kPartition ? map.Partition(b.partition) : map.DaemonRange(b.daemon);
        EXPECT_EQ(b.range.begin, pos);
        EXPECT_LE(b.range.size(), plan.bucket_elements());
        EXPECT_TRUE(span.Contains(b.range)) << b.range;
        EXPECT_EQ((b.range.begin - span.begin) % plan.bucket_elements(), 0u);
        EXPECT_TRUE(map.Partition(b.partition).Contains({b.range.begin, b.range.begin + 1}));
        EXPECT_EQ(b.daemon, map.DaemonOf(b.partition));
        real += b.real_elements;
        pos = b.range.end;
      }
      EXPECT_EQ(pos, layout.total_elements());
      EXPECT_EQ(real, layout.parameter_count());
    }
  }
}

// With daemon reduction a rank's gradient for one daemon is cut by C_B alone:
// many small partitions (many ranks) do not multiply the buckets.
TEST(BucketPlanTest, DaemonCutDoesNotGrowWithTheRanks) {
  const Layout layout = *Layout::Create({{"w", {100'000}, DType::kFp32, 0}});
  for (uint32_t world : {4u, 16u, 64u}) {
    const PartitionMap map = *PartitionMap::Create(layout.total_elements(), world, 2);
    const BucketPlan by_daemon =
        *BucketPlan::Create(layout, map, 1 << 20, DType::kFp32, BucketCut::kDaemon);
    const BucketPlan by_partition =
        *BucketPlan::Create(layout, map, 1 << 20, DType::kFp32, BucketCut::kPartition);
    EXPECT_EQ(by_daemon.buckets().size(), 2u) << "world " << world;
    size_t holding = 0;  // partitions with real elements: one bucket each
    for (uint32_t i = 0; i < world; ++i) holding += map.UnpaddedPartition(i).empty() ? 0 : 1;
    EXPECT_EQ(by_partition.buckets().size(), holding);
    EXPECT_GE(holding, world - 1);
  }
}

// Stage 3 pushes layer by layer: with at_layers every layer boundary is a
// bucket boundary too, and the buckets still tile the flat space in order,
// each inside one span of its cut and one layer, cut every bucket_elements
// from the start of that piece.
TEST(BucketPlanTest, AtLayersCutsEveryLayerBoundaryAndStillTiles) {
  const Layout layout = MakeLayout();  // layers [0,3008) [3008,7296) [7296,7360)
  std::vector<FlatRange> layers;
  for (uint32_t l : layout.layers()) layers.push_back(*layout.LayerRange(l));
  ASSERT_EQ(layers.size(), 3u);
  for (const BucketCut cut : {BucketCut::kPartition, BucketCut::kDaemon}) {
    for (uint32_t world : {1u, 2u, 3u, 5u, 8u}) {
      SCOPED_TRACE(::testing::Message() << "cut " << static_cast<int>(cut) << " world " << world);
      const PartitionMap map =
          *PartitionMap::Create(layout.total_elements(), world, 2 > world ? 1 : 2);
      const BucketPlan plan =
          *BucketPlan::Create(layout, map, 4096, DType::kFp32, cut, /*at_layers=*/true);
      uint64_t pos = 0, real = 0;
      for (const Bucket& b : plan.buckets()) {
        const FlatRange span =
            cut == BucketCut::kPartition ? map.Partition(b.partition) : map.DaemonRange(b.daemon);
        EXPECT_EQ(b.range.begin, pos);
        EXPECT_LE(b.range.size(), plan.bucket_elements());
        EXPECT_TRUE(span.Contains(b.range)) << b.range;
        size_t in_layers = 0;
        for (const FlatRange& l : layers) {
          if (l.Contains(b.range)) {
            ++in_layers;
            const uint64_t piece_begin = std::max(l.begin, span.begin);
            EXPECT_EQ((b.range.begin - piece_begin) % plan.bucket_elements(), 0u) << b.range;
          }
        }
        EXPECT_EQ(in_layers, 1u) << b.range;
        EXPECT_EQ(b.daemon, map.DaemonOf(b.partition));
        EXPECT_EQ(b.real_elements, plan.RealElements(b.range));
        real += b.real_elements;
        pos = b.range.end;
      }
      EXPECT_EQ(pos, layout.total_elements());
      EXPECT_EQ(real, layout.parameter_count());
      // Every layer starts a bucket.
      for (const FlatRange& l : layers) {
        EXPECT_TRUE(std::any_of(plan.buckets().begin(), plan.buckets().end(),
                                [&](const Bucket& b) { return b.range.begin == l.begin; }))
            << "layer at " << l.begin;
      }
    }
  }
}

// Without at_layers the cut is what it always was: each span cut every
// bucket_elements from its start, across layer boundaries.
TEST(BucketPlanTest, WithoutAtLayersTheCutIsUnchanged) {
  const Layout layout = MakeLayout();
  for (uint32_t world : {1u, 2u, 3u}) {
    SCOPED_TRACE(world);
    const PartitionMap map =
        *PartitionMap::Create(layout.total_elements(), world, world > 1 ? 2 : 1);
    std::vector<FlatRange> expected;
    for (uint32_t d = 0; d < map.num_daemons(); ++d) {
      const FlatRange span = map.DaemonRange(d).Intersect({0, layout.total_elements()});
      for (uint64_t b = span.begin; b < span.end; b += 1024) {
        expected.push_back({b, std::min(span.end, b + 1024)});
      }
    }
    auto ranges = [](const BucketPlan& plan) {
      std::vector<FlatRange> out;
      for (const Bucket& b : plan.buckets()) out.push_back(b.range);
      return out;
    };
    const BucketPlan by_default =
        *BucketPlan::Create(layout, map, 4096, DType::kFp32, BucketCut::kDaemon);
    const BucketPlan explicit_false =
        *BucketPlan::Create(layout, map, 4096, DType::kFp32, BucketCut::kDaemon, false);
    const BucketPlan at_layers =
        *BucketPlan::Create(layout, map, 4096, DType::kFp32, BucketCut::kDaemon, true);
    EXPECT_EQ(ranges(by_default), expected);
    EXPECT_EQ(ranges(explicit_false), expected);
    // [2048, 3072) crosses the end of layer 0 at 3008: the layer cut differs.
    EXPECT_NE(ranges(at_layers), expected);
    EXPECT_GT(at_layers.buckets().size(), by_default.buckets().size());
  }
}

TEST(BucketPlanTest, HalfPrecisionBucketsHoldTwiceTheElements) {
  const Layout layout = MakeLayout();
  const PartitionMap map = *PartitionMap::Create(layout.total_elements(), 2, 1);
  EXPECT_EQ(
      BucketPlan::Create(layout, map, 8192, DType::kBf16, BucketCut::kPartition)->bucket_elements(),
      4096u);
  EXPECT_EQ(BucketPlan::StagingBytes(8192, DType::kBf16), 8192u);
  // Buckets are capped at the 64 MiB chunk limit.
  EXPECT_EQ(BucketPlan::StagingBytes(1ull << 30, DType::kFp32), 64ull << 20);
}

TEST(BucketPlanTest, OverlappingAndSegments) {
  const Layout layout = MakeLayout();
  const PartitionMap map = *PartitionMap::Create(layout.total_elements(), 3, 1);
  const BucketPlan plan = *BucketPlan::Create(layout, map, 4096, DType::kFp32, BucketCut::kDaemon);
  for (const FlatRange r : {FlatRange{0, 1}, FlatRange{1000, 3100}, FlatRange{0, layout.total_elements()},
                            FlatRange{3000, 3001}}) {
    const auto [first, last] = plan.Overlapping(r);
    ASSERT_LT(first, last);
    EXPECT_LE(plan.buckets()[first].range.begin, r.begin);
    EXPECT_GT(plan.buckets()[first].range.end, r.begin);
    EXPECT_GE(plan.buckets()[last - 1].range.end, r.end);
    EXPECT_LT(plan.buckets()[last - 1].range.begin, r.end);
  }
  // Real and gap segments partition a range.
  const FlatRange r{2990, 3200};  // end of "a", gap, "b", gap, start of "c"
  uint64_t real = 0, gap = 0, pos = r.begin;
  std::vector<std::pair<FlatRange, bool>> segs;
  plan.ForEachRealSegment(r, [&](const FlatRange& s) { segs.push_back({s, true}); real += s.size(); });
  plan.ForEachGapSegment(r, [&](const FlatRange& s) { segs.push_back({s, false}); gap += s.size(); });
  std::sort(segs.begin(), segs.end(),
            [](const auto& a, const auto& b) { return a.first.begin < b.first.begin; });
  for (const auto& [s, is_real] : segs) {
    EXPECT_EQ(s.begin, pos);
    pos = s.end;
  }
  EXPECT_EQ(pos, r.end);
  EXPECT_EQ(real, plan.RealElements(r));
  EXPECT_EQ(real + gap, r.size());
  EXPECT_EQ(real, 10u + 77u + (3200u - 3136u));  // "b" at 3008, "c" at 3136
}

// C_B bounds a bucket whatever Ψ is: only the number of buckets grows.
TEST(BucketPlanTest, BucketSizeDoesNotGrowWithTheModel) {
  const uint64_t cb = 32ull << 20;
  uint64_t largest[2] = {0, 0};
  size_t count[2] = {0, 0};
  const int64_t sizes[2] = {10'000'000, 500'000'000};
  for (int i = 0; i < 2; ++i) {
    const Layout layout = *Layout::Create({{"w", {sizes[i]}, DType::kBf16, 0},
                                           {"b", {1234}, DType::kBf16, 1}});
    const PartitionMap map = *PartitionMap::Create(layout.total_elements(), 4, 2);
    const BucketPlan plan =
        *BucketPlan::Create(layout, map, cb, DType::kBf16, BucketCut::kPartition);
    for (const Bucket& b : plan.buckets()) {
      largest[i] = std::max(largest[i], b.range.size() * 2);
    }
    count[i] = plan.buckets().size();
  }
  EXPECT_LE(largest[0], cb);
  EXPECT_EQ(largest[1], cb);
  EXPECT_EQ(count[0], 4u);   // one bucket per 2.5M-element partition
  EXPECT_EQ(count[1], 32u);  // 125M elements per partition: 8 buckets each
}

TEST(BucketPlanTest, RejectsAMapOfAnotherLayout) {
  const Layout layout = MakeLayout();
  const PartitionMap map = *PartitionMap::Create(layout.total_elements() + 64, 2, 1);
  EXPECT_EQ(BucketPlan::Create(layout, map, 4096, DType::kFp32, BucketCut::kDaemon).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace zeroshard
