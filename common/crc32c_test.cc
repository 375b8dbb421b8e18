#include "common/crc32c.h"

#include <cstring>
#include <string>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

TEST(Crc32c, KnownVectors) {
  EXPECT_EQ(Crc32c("123456789", 9), 0xe3069283u);
  EXPECT_EQ(Crc32c("", 0), 0u);
  std::vector<unsigned char> zeros(32, 0);
  EXPECT_EQ(Crc32c(zeros.data(), zeros.size()), 0x8a9136aau);  // RFC 3720 B.4
}

TEST(Crc32c, HardwareEqualsPortableAndExtends) {
  std::mt19937 rng(7);
  std::vector<unsigned char> data(100007);
  for (auto& b : data) b = static_cast<unsigned char>(rng());
  // Past 3 x 8 KiB the hardware path runs three lanes and joins them.
  for (size_t n : {0, 1, 7, 8, 9, 63, 4096, 10007, 24575, 24576, 24577, 49160, 100007}) {
    EXPECT_EQ(Crc32c(data.data(), n), internal::Crc32cPortable(data.data(), n)) << n;
  }
  const uint32_t whole = Crc32c(data.data(), data.size());
  const uint32_t parts = Crc32c(data.data() + 1000, data.size() - 1000,
                                Crc32c(data.data(), 1000));
  EXPECT_EQ(whole, parts);
}

TEST(Crc32cTest, CombineEqualsTheCrcOfTheConcatenation) {
  std::string a = "The quick brown fox ", b = "jumps over the lazy dog";
  for (int i = 0; i < 300; ++i) b += static_cast<char>(i * 7);
  const std::string ab = a + b;
  EXPECT_EQ(Crc32cCombine(Crc32c(a.data(), a.size()), Crc32c(b.data(), b.size()), b.size()),
            Crc32c(ab.data(), ab.size()));
  EXPECT_EQ(Crc32cCombine(Crc32c(a.data(), a.size()), 0, 0), Crc32c(a.data(), a.size()));
  for (size_t cut = 0; cut <= ab.size(); cut += 37) {
    EXPECT_EQ(Crc32cCombine(Crc32c(ab.data(), cut), Crc32c(ab.data() + cut, ab.size() - cut),
                            ab.size() - cut),
              Crc32c(ab.data(), ab.size()))
        << cut;
  }
}

}  // namespace
}  // namespace zeroshard
