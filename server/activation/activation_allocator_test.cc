#include "server/activation/activation_allocator.h"

#include <algorithm>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

TEST(ArenaAllocator, AlignsSizesAndShrinksTheRangeToBoundaries) {
  ArenaAllocator a(/*begin=*/10, /*capacity=*/1000, /*alignment=*/64);
  EXPECT_EQ(a.begin(), 64u);
  EXPECT_EQ(a.capacity(), 960u - 64u);  // [64, 960)
  EXPECT_EQ(a.RoundUp(1), 64u);
  EXPECT_EQ(a.RoundUp(64), 64u);
  EXPECT_EQ(a.RoundUp(65), 128u);
  std::optional<uint64_t> x = a.Allocate(1);
  ASSERT_TRUE(x.has_value());
  EXPECT_EQ(*x, 64u);
  EXPECT_EQ(a.BlockSize(64), 64u);
  EXPECT_EQ(a.used_bytes(), 64u);
  EXPECT_FALSE(a.Allocate(0).has_value());
  EXPECT_FALSE(a.Allocate(a.capacity()).has_value());
  EXPECT_FALSE(a.Allocate(~uint64_t{0}).has_value());
  EXPECT_EQ(a.Free(64), 64u);
  EXPECT_EQ(a.Free(64), 0u) << "a double free changes nothing";
  EXPECT_EQ(a.Free(65), 0u);
  EXPECT_EQ(a.free_bytes(), a.capacity());
  EXPECT_EQ(a.free_blocks(), 1u);
}

TEST(ArenaAllocator, FirstFitInAddressOrder) {
  ArenaAllocator a(0, 64 * 10, 64);
  std::vector<uint64_t> blocks;
  for (int i = 0; i < 5; ++i) blocks.push_back(*a.Allocate(128));
  EXPECT_EQ(blocks, (std::vector<uint64_t>{0, 128, 256, 384, 512}));
  EXPECT_FALSE(a.Allocate(128).has_value());
  a.Free(128);
  a.Free(384);
  // Two holes of 128: the lower one is taken first.
  EXPECT_EQ(*a.Allocate(64), 128u);
  EXPECT_EQ(*a.Allocate(128), 384u);
  EXPECT_EQ(*a.Allocate(64), 192u);
  EXPECT_EQ(a.free_bytes(), 0u);
}

TEST(ArenaAllocator, FreeCoalescesWithBothNeighbours) {
  ArenaAllocator a(0, 64 * 8, 64);
  const uint64_t b0 = *a.Allocate(64), b1 = *a.Allocate(64), b2 = *a.Allocate(64);
  const uint64_t b3 = *a.Allocate(64);
  a.Free(b0);
  a.Free(b2);
  EXPECT_EQ(a.free_blocks(), 3u);  // [b0], [b2], the tail after b3
  a.Free(b1);                      // joins b0 and b2
  EXPECT_EQ(a.free_blocks(), 2u);
  EXPECT_EQ(a.largest_free(), 4u * 64);
  a.Free(b3);  // joins everything
  EXPECT_EQ(a.free_blocks(), 1u);
  EXPECT_EQ(a.largest_free(), a.capacity());
  EXPECT_EQ(a.fragmentation(), 0u);
}

TEST(ArenaAllocator, FragmentationIsFreeSpaceOutsideTheLargestBlock) {
  ArenaAllocator a(0, 1000 * 64, 64);
  std::vector<uint64_t> blocks;
  for (int i = 0; i < 10; ++i) blocks.push_back(*a.Allocate(100 * 64));
  EXPECT_EQ(a.fragmentation(), 0u);
  // Every other block freed: 5 holes of 100 units, none adjacent.
  for (int i = 0; i < 10; i += 2) a.Free(blocks[i]);
  EXPECT_EQ(a.free_bytes(), 500u * 64);
  EXPECT_EQ(a.largest_free(), 100u * 64);
  EXPECT_EQ(a.fragmentation(), 400u * 64);
  // 150 units do not fit although 500 are free.
  EXPECT_FALSE(a.Fits(150 * 64));
  EXPECT_FALSE(a.Allocate(150 * 64).has_value());
  EXPECT_EQ(a.fragmentation(), 400u * 64) << "a failed allocation changes nothing";
  // Allocating never adds fragmentation; filling a hole removes it.
  ASSERT_EQ(*a.Allocate(100 * 64), blocks[0]);
  EXPECT_EQ(a.fragmentation(), 300u * 64);
  // Freeing the neighbours of a hole makes one block of 300 units.
  a.Free(blocks[3]);
  a.Free(blocks[5]);
  EXPECT_EQ(a.largest_free(), 500u * 64);  // blocks 2..6 but 0 taken: 2,3,4,5,6
  EXPECT_EQ(a.free_bytes(), 600u * 64);
  EXPECT_EQ(a.fragmentation(), 100u * 64);
}

// The pattern the arena serves: a step's forward allocates layer by layer,
// backward frees in reverse order; several steps in a row leave no
// fragmentation and reuse the same offsets.
TEST(ArenaAllocator, ForwardThenReverseBackwardLeavesNoFragmentation) {
  ArenaAllocator a(0, 64 << 20, 64);
  std::vector<uint64_t> first;
  for (int step = 0; step < 5; ++step) {
    std::vector<uint64_t> layers;
    for (int layer = 0; layer < 24; ++layer) {
      std::optional<uint64_t> o = a.Allocate(1000003 + layer * 977);
      ASSERT_TRUE(o.has_value());
      layers.push_back(*o);
    }
    EXPECT_EQ(a.fragmentation(), 0u);
    if (step == 0) first = layers;
    EXPECT_EQ(layers, first);
    for (int layer = 23; layer >= 0; --layer) {
      a.Free(layers[layer]);
      EXPECT_EQ(a.fragmentation(), 0u) << "layer " << layer;
    }
    EXPECT_EQ(a.free_blocks(), 1u);
  }
}

// Random allocations and frees against a byte map: blocks never overlap,
// stay aligned and inside the range, and the counters match the map.
TEST(ArenaAllocator, RandomOperationsMatchAByteMap) {
  constexpr uint64_t kAlign = 64;
  constexpr uint64_t kUnits = 512;
  ArenaAllocator a(0, kUnits * kAlign, kAlign);
  std::vector<int> owner(kUnits, -1);  // block id per unit
  std::vector<std::pair<uint64_t, uint64_t>> live;  // offset, size
  std::mt19937 rng(7);
  for (int i = 0; i < 20000; ++i) {
    if (live.empty() || rng() % 3 != 0) {
      const uint64_t bytes = 1 + rng() % (kAlign * 24);
      std::optional<uint64_t> o = a.Allocate(bytes);
      const uint64_t size = a.RoundUp(bytes);
      // First fit: the lowest run of free units long enough.
      int64_t expected = -1;
      for (uint64_t u = 0, run = 0; u < kUnits; ++u) {
        run = owner[u] < 0 ? run + 1 : 0;
        if (run * kAlign >= size) {
          expected = static_cast<int64_t>((u + 1) * kAlign - size);
          break;
        }
      }
      if (expected < 0) {
        ASSERT_FALSE(o.has_value());
        continue;
      }
      ASSERT_TRUE(o.has_value());
      ASSERT_EQ(*o, static_cast<uint64_t>(expected));
      for (uint64_t u = *o / kAlign; u < (*o + size) / kAlign; ++u) owner[u] = i;
      live.emplace_back(*o, size);
    } else {
      const size_t k = rng() % live.size();
      ASSERT_EQ(a.Free(live[k].first), live[k].second);
      for (uint64_t u = live[k].first / kAlign; u < (live[k].first + live[k].second) / kAlign;
           ++u) {
        owner[u] = -1;
      }
      live[k] = live.back();
      live.pop_back();
    }
    uint64_t free_units = 0, largest = 0;
    for (uint64_t u = 0, run = 0; u < kUnits; ++u) {
      run = owner[u] < 0 ? run + 1 : 0;
      free_units += owner[u] < 0;
      largest = std::max(largest, run);
    }
    ASSERT_EQ(a.free_bytes(), free_units * kAlign);
    ASSERT_EQ(a.largest_free(), largest * kAlign);
    ASSERT_EQ(a.fragmentation(), (free_units - largest) * kAlign);
    ASSERT_EQ(a.used_blocks(), live.size());
  }
}

TEST(ArenaAllocator, CopiesPlanWithoutTouchingTheOriginal) {
  ArenaAllocator a(0, 64 * 4, 64);
  const uint64_t b0 = *a.Allocate(128);
  ASSERT_TRUE(a.Allocate(128).has_value());
  ArenaAllocator plan = a;
  plan.Free(b0);
  EXPECT_TRUE(plan.Fits(128));
  EXPECT_FALSE(a.Fits(64));
  uint64_t h1 = 0, h2 = 0;
  a.Hash(h1);
  plan.Hash(h2);
  EXPECT_NE(h1, h2);
}

}  // namespace
}  // namespace zeroshard
