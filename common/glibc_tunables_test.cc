#include "common/glibc_tunables.h"

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

TEST(NonTemporalThresholdInTest, FindsTheTunableAmongOthers) {
  EXPECT_EQ(NonTemporalThresholdIn("glibc.cpu.x86_non_temporal_threshold=4194304"), "4194304");
  EXPECT_EQ(
      NonTemporalThresholdIn("glibc.malloc.arena_max=2:glibc.cpu.x86_non_temporal_threshold=1"),
      "1");
  EXPECT_EQ(NonTemporalThresholdIn(""), std::nullopt);
  EXPECT_EQ(NonTemporalThresholdIn("glibc.malloc.arena_max=2"), std::nullopt);
  // Another tunable whose name starts the same way is not it.
  EXPECT_EQ(NonTemporalThresholdIn("glibc.cpu.x86_non_temporal_threshold_x=5"), std::nullopt);
}

}  // namespace
}  // namespace zeroshard
