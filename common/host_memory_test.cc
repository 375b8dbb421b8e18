#include "common/host_memory.h"

#include <cstdint>

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

bool AllZero(const uint8_t* p, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (p[i] != 0) return false;
  }
  return true;
}

TEST(HostMemoryTest, SmallArraysAreZeroedAndCacheLineAligned) {
  HostArray<uint8_t> a(100);
  ASSERT_NE(a.get(), nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.get()) % 64, 0u);
  EXPECT_TRUE(AllZero(a.get(), 100));
  EXPECT_EQ(AllocateHostArray(0), nullptr);
}

TEST(HostMemoryTest, LargeArraysAreZeroedAndHugePageAligned) {
  const size_t n = 3 * kHugePageBytes + 12345;  // not a multiple
  HostArray<uint8_t> a(n);
  ASSERT_NE(a.get(), nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.get()) % kHugePageBytes, 0u);
  EXPECT_TRUE(AllZero(a.get(), n));
  a.get()[n - 1] = 7;  // the whole length is usable
  HostArray<float> f(kHugePageBytes / sizeof(float));
  ASSERT_NE(f.get(), nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(f.get()) % kHugePageBytes, 0u);
  EXPECT_EQ(f.get()[kHugePageBytes / sizeof(float) - 1], 0.0f);
}

}  // namespace
}  // namespace zeroshard
