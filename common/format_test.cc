#include "common/format.h"

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

TEST(Format, Bytes) {
  EXPECT_EQ(FormatBytes(120e9), "120 GB");
  EXPECT_EQ(FormatBytes(31.40625e9), "31.4 GB");
  EXPECT_EQ(FormatBytes(16.640625e9), "16.6 GB");
  EXPECT_EQ(FormatBytes(1.875e9), "1.88 GB");
  EXPECT_EQ(FormatBytes(15.625e9), "15.6 GB");
  EXPECT_EQ(FormatBytes(512), "512 B");
  EXPECT_EQ(FormatBytes(999.7e6), "1.00 GB");
  EXPECT_EQ(FormatBytes(0), "0 B");
}

TEST(Format, Counts) {
  EXPECT_EQ(FormatCount(7.5e9), "7.50B");
  EXPECT_EQ(FormatCount(128e9), "128B");
  EXPECT_EQ(FormatCount(14e6), "14.0M");
  EXPECT_EQ(FormatCount(12), "12.0");
}

}  // namespace
}  // namespace zeroshard
