#include "common/stream_copy.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

std::vector<unsigned char> Pattern(size_t n, uint32_t seed) {
  std::vector<unsigned char> v(n);
  uint32_t x = seed * 2654435761u + 1;
  for (auto& b : v) {
    x = x * 1664525u + 1013904223u;
    b = static_cast<unsigned char>(x >> 24);
  }
  return v;
}

// Every size around the streaming threshold and every alignment of source
// and destination copies exactly the bytes asked for, and nothing around them.
TEST(StreamCopyTest, CopiesExactlyTheBytesForAnyAlignmentAndSize) {
  const size_t sizes[] = {0, 1, 15, 16, 17, 63, 64, 65, 4096,
                          kStreamCopyMinBytes - 1, kStreamCopyMinBytes,
                          kStreamCopyMinBytes + 1, kStreamCopyMinBytes + 77,
                          3 * kStreamCopyMinBytes + 5};
  const std::vector<unsigned char> src = Pattern(3 * kStreamCopyMinBytes + 64, 1);
  std::vector<unsigned char> dst(src.size() + 64);
  for (size_t n : sizes) {
    for (size_t src_shift : {0, 1, 8, 15}) {
      for (size_t dst_shift : {0, 3, 16, 31}) {
        SCOPED_TRACE(testing::Message() << "n " << n << " src+" << src_shift << " dst+"
                                        << dst_shift);
        std::fill(dst.begin(), dst.end(), 0xAB);
        StreamCopy(dst.data() + dst_shift, src.data() + src_shift, n);
        auto untouched = [&](size_t begin, size_t end) {
          return std::all_of(dst.begin() + begin, dst.begin() + end,
                             [](unsigned char b) { return b == 0xAB; });
        };
        ASSERT_TRUE(untouched(0, dst_shift));
        ASSERT_EQ(std::memcmp(dst.data() + dst_shift, src.data() + src_shift, n), 0);
        ASSERT_TRUE(untouched(dst_shift + n, dst.size()));
      }
    }
  }
}

}  // namespace
}  // namespace zeroshard
