#include "common/crc32c.h"

#include <nmmintrin.h>

#include <array>
#include <cstring>

namespace zeroshard {
namespace {

constexpr uint32_t kPoly = 0x82f63b78u;  // reflected Castagnoli polynomial

std::array<uint32_t, 256> MakeTable() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
    t[i] = c;
  }
  return t;
}

uint32_t TableCrc(const unsigned char* p, size_t n, uint32_t c) {
  static const std::array<uint32_t, 256> table = MakeTable();
  for (size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return c;
}

__attribute__((target("sse4.2"))) uint32_t HardwareCrc(const unsigned char* p, size_t n,
                                                      uint32_t c) {
  uint64_t c64 = c;
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c64 = _mm_crc32_u64(c64, v);
    p += 8;
    n -= 8;
  }
  c = static_cast<uint32_t>(c64);
  while (n > 0) {
    c = _mm_crc32_u8(c, *p++);
    --n;
  }
  return c;
}

}  // namespace

uint32_t Crc32c(const void* data, size_t n, uint32_t crc) {
  static const bool has_sse42 = __builtin_cpu_supports("sse4.2");
  const auto* p = static_cast<const unsigned char*>(data);
  const uint32_t c = ~crc;
  return ~(has_sse42 ? HardwareCrc(p, n, c) : TableCrc(p, n, c));
}

namespace {

// GF(2) 32x32 matrices acting on CRC registers, one column per bit.
uint32_t MatrixTimes(const uint32_t* m, uint32_t v) {
  uint32_t sum = 0;
  for (int i = 0; v != 0; ++i, v >>= 1) {
    if (v & 1) sum ^= m[i];
  }
  return sum;
}

void MatrixSquare(uint32_t* out, const uint32_t* m) {
  for (int i = 0; i < 32; ++i) out[i] = MatrixTimes(m, m[i]);
}

}  // namespace

uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  if (len_b == 0) return crc_a;
  // odd: the operator of one zero bit; squared twice, of four.
  uint32_t odd[32], even[32];
  odd[0] = kPoly;
  for (int i = 1; i < 32; ++i) odd[i] = 1u << (i - 1);
  MatrixSquare(even, odd);  // two zero bits
  MatrixSquare(odd, even);  // four zero bits
  // Apply len_b zero bytes to crc_a, one squaring per bit of len_b.
  for (;;) {
    MatrixSquare(even, odd);
    if (len_b & 1) crc_a = MatrixTimes(even, crc_a);
    len_b >>= 1;
    if (len_b == 0) break;
    MatrixSquare(odd, even);
    if (len_b & 1) crc_a = MatrixTimes(odd, crc_a);
    len_b >>= 1;
    if (len_b == 0) break;
  }
  return crc_a ^ crc_b;
}

}  // namespace zeroshard

namespace zeroshard::internal {
uint32_t Crc32cPortable(const void* data, size_t n, uint32_t crc) {
  return ~TableCrc(static_cast<const unsigned char*>(data), n, ~crc);
}
}  // namespace zeroshard::internal
