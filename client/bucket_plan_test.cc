#include "client/bucket_plan.h"

#include <algorithm>

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
