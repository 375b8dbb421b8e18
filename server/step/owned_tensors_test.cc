#include "server/step/owned_tensors.h"

#include <vector>

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

// Tensors of 10, 5 (frozen), 7 and 3 (frozen) elements, aligned to 4:
// [0,10) [12,17) [20,27) [28,31), total 32.
Layout MakeLayout() {
  std::vector<TensorSpec> specs(4);
  const int64_t sizes[] = {10, 5, 7, 3};
  for (int i = 0; i < 4; ++i) {
    specs[i].name = "t" + std::to_string(i);
    specs[i].shape = {sizes[i]};
    specs[i].group = i % 2;
    specs[i].frozen = i % 2 == 1;
  }
  absl::StatusOr<Layout> layout = Layout::Create(std::move(specs), 4);
  EXPECT_TRUE(layout.ok()) << layout.status();
  return *std::move(layout);
}

TEST(OwnedTensorsTest, EntriesAreTheOverlappingTensorsClipped) {
  const Layout layout = MakeLayout();
  OwnedTensors owned(layout, {8, 24});
  ASSERT_EQ(owned.entries().size(), 3u);
  EXPECT_EQ(owned.entries()[0].index, 0u);
  EXPECT_EQ(owned.entries()[0].range, (FlatRange{8, 10}));
  EXPECT_EQ(owned.entries()[1].index, 1u);
  EXPECT_TRUE(owned.entries()[1].frozen);
  EXPECT_EQ(owned.entries()[1].group, 1u);
  EXPECT_EQ(owned.entries()[2].range, (FlatRange{20, 24}));
  EXPECT_EQ(owned.Find(0), 0);
  EXPECT_EQ(owned.Find(2), 2);
  EXPECT_EQ(owned.Find(3), -1);
  EXPECT_EQ(owned.frozen_elements(), 5u);
  EXPECT_EQ(owned.moment_elements(), 16u - 5u);
}

TEST(OwnedTensorsTest, MomentSpaceLeavesOutFrozenElementsOnly) {
  const Layout layout = MakeLayout();
  OwnedTensors owned(layout, {0, 32});
  EXPECT_EQ(owned.MomentIndex(0), 0u);
  EXPECT_EQ(owned.MomentIndex(11), 11u);  // a gap keeps its place
  EXPECT_EQ(owned.MomentIndex(17), 12u);  // after the frozen [12, 17)
  EXPECT_EQ(owned.MomentIndex(27), 22u);
  EXPECT_EQ(owned.MomentIndex(31), 23u);  // after [28, 31), frozen too
  std::vector<FlatRange> stretches;
  owned.ForEachUnfrozen({5, 30}, [&](const FlatRange& r) { stretches.push_back(r); });
  ASSERT_EQ(stretches.size(), 2u);
  EXPECT_EQ(stretches[0], (FlatRange{5, 12}));
  EXPECT_EQ(stretches[1], (FlatRange{17, 28}));
  uint64_t unfrozen = 0;
  owned.ForEachUnfrozen({0, 32}, [&](const FlatRange& r) { unfrozen += r.size(); });
  EXPECT_EQ(unfrozen, owned.moment_elements());
}

TEST(OwnedTensorsTest, InFindsOverlapsOnly) {
  const Layout layout = MakeLayout();
  OwnedTensors owned(layout, {0, 32});
  EXPECT_EQ(owned.In({10, 12}), (std::pair<size_t, size_t>{1, 1}));  // a gap
  EXPECT_EQ(owned.In({9, 13}), (std::pair<size_t, size_t>{0, 2}));
  EXPECT_EQ(owned.In({27, 32}), (std::pair<size_t, size_t>{3, 4}));
}

}  // namespace
}  // namespace zeroshard
