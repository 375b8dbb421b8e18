#include "bench/stats.h"

#include <cmath>

#include "gtest/gtest.h"

namespace zeroshard::bench {
namespace {

TEST(MedianTest, OddEvenAndEmpty) {
  EXPECT_EQ(Median({3, 1, 2}), 2);
  EXPECT_EQ(Median({4, 1, 3, 2}), 2.5);
  EXPECT_EQ(Median({7}), 7);
  EXPECT_TRUE(std::isnan(Median({})));
}

}  // namespace
}  // namespace zeroshard::bench
