#include "common/partition_map.h"

#include <random>

#include "common/layout.h"
#include "gtest/gtest.h"

namespace zeroshard {
namespace {

TEST(PartitionMap, SmallExample) {
  auto map = PartitionMap::Create(1000, 3, 2);
  ASSERT_TRUE(map.ok());
  EXPECT_EQ(map->partition_elements(), 384u);  // ceil(1000/3)=334 -> 384
  EXPECT_EQ(map->padded_elements(), 1152u);
  EXPECT_EQ(map->UnpaddedPartition(2), (FlatRange{768, 1000}));
  EXPECT_EQ(map->DaemonOf(0), 0u);
  EXPECT_EQ(map->DaemonOf(1), 0u);
  EXPECT_EQ(map->DaemonOf(2), 1u);
  EXPECT_EQ(map->DaemonRange(0), (FlatRange{0, 768}));
  auto pieces = map->Split({300, 800});
  ASSERT_TRUE(pieces.ok());
  ASSERT_EQ(pieces->size(), 3u);
  EXPECT_EQ((*pieces)[0].range, (FlatRange{300, 384}));
  EXPECT_EQ((*pieces)[1].range, (FlatRange{384, 768}));
  EXPECT_EQ((*pieces)[2].range, (FlatRange{768, 800}));
  EXPECT_TRUE(map->Split({5, 5})->empty());
}

TEST(PartitionMap, RejectsBadInput) {
  auto expect = [](absl::StatusOr<PartitionMap> m, absl::string_view field) {
    ASSERT_FALSE(m.ok());
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(m.status().message().find(std::string(field)), absl::string_view::npos)
        << m.status();
  };
  expect(PartitionMap::Create(0, 4), "total_elements");
  expect(PartitionMap::Create(uint64_t{1} << 50, 4), "total_elements");
  expect(PartitionMap::Create(100, 0), "world_size");
  expect(PartitionMap::Create(100, 70000), "world_size");
  expect(PartitionMap::Create(100, 4, 0), "num_daemons");
  expect(PartitionMap::Create(100, 4, 5), "num_daemons");
  auto map = PartitionMap::Create(100, 4);
  EXPECT_EQ(map->Split({10, 5}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(map->Split({0, map->padded_elements() + 1}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Random layouts and N_d in 1..1024: the partitions tile the padded space, real
// sizes differ by at most the padding, and every range splits into pieces that
// reassemble it, each inside one partition.
TEST(PartitionMap, PropertiesOverRandomLayouts) {
  std::mt19937_64 rng(20200);
  for (int iter = 0; iter < 300; ++iter) {
    std::vector<TensorSpec> specs;
    const int n = 1 + rng() % 12;
    for (int i = 0; i < n; ++i) {
      std::vector<int64_t> shape;
      const int dims = 1 + rng() % 3;
      for (int d = 0; d < dims; ++d) shape.push_back(1 + rng() % 300);
      specs.push_back({"t" + std::to_string(i), shape, DType::kFp32, static_cast<uint32_t>(i / 2)});
    }
    auto layout = Layout::Create(specs, uint64_t{1} << (rng() % 8));
    ASSERT_TRUE(layout.ok()) << layout.status();
    const uint32_t nd = 1 + rng() % 1024;
    const uint32_t daemons = 1 + rng() % nd;
    auto map = PartitionMap::Create(layout->total_elements(), nd, daemons);
    ASSERT_TRUE(map.ok()) << map.status();
    ASSERT_GE(map->padded_elements(), layout->total_elements());
    // Padding is less than one alignment unit per partition.
    ASSERT_LT(map->padded_elements() - layout->total_elements(),
              uint64_t{nd} * PartitionMap::kPartitionAlignment + nd);
    uint64_t next = 0, min_real = UINT64_MAX, max_real = 0;
    for (uint32_t p = 0; p < nd; ++p) {
      const FlatRange r = map->Partition(p);
      ASSERT_EQ(r.begin, next);
      ASSERT_EQ(r.size(), map->partition_elements());
      next = r.end;
      min_real = std::min(min_real, map->UnpaddedPartition(p).size());
      max_real = std::max(max_real, map->UnpaddedPartition(p).size());
      ASSERT_LT(map->DaemonOf(p), daemons);
      if (p > 0) {
        ASSERT_GE(map->DaemonOf(p), map->DaemonOf(p - 1));
      }
    }
    ASSERT_EQ(next, map->padded_elements());
    ASSERT_LE(max_real - min_real, map->padded_elements() - layout->total_elements());
    uint32_t owned = 0;
    for (uint32_t d = 0; d < daemons; ++d) owned += map->PartitionsOfDaemon(d).size();
    ASSERT_EQ(owned, nd);
    for (int k = 0; k < 20; ++k) {
      uint64_t a = rng() % (map->padded_elements() + 1);
      uint64_t b = rng() % (map->padded_elements() + 1);
      if (a > b) std::swap(a, b);
      auto pieces = map->Split({a, b});
      ASSERT_TRUE(pieces.ok());
      uint64_t pos = a;
      for (const auto& piece : *pieces) {
        ASSERT_EQ(piece.range.begin, pos);
        ASSERT_FALSE(piece.range.empty());
        ASSERT_TRUE(map->Partition(piece.partition).Contains(piece.range));
        pos = piece.range.end;
      }
      ASSERT_EQ(pos, b);
    }
    for (uint32_t layer : layout->layers()) {
      auto lr = layout->LayerRange(layer);
      ASSERT_TRUE(lr.ok());
      ASSERT_TRUE(map->Split(*lr).ok());
    }
  }
}

}  // namespace
}  // namespace zeroshard
