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

// The register after `len` zero bytes, from register `crc` (no inversion).
uint32_t ShiftZeros(uint32_t crc, uint64_t len) {
  if (len == 0) return crc;
  // odd: the operator of one zero bit; squared twice, of four.
  uint32_t odd[32], even[32];
  odd[0] = kPoly;
  for (int i = 1; i < 32; ++i) odd[i] = 1u << (i - 1);
  MatrixSquare(even, odd);  // two zero bits
  MatrixSquare(odd, even);  // four zero bits
  // One squaring per bit of len.
  for (;;) {
    MatrixSquare(even, odd);
    if (len & 1) crc = MatrixTimes(even, crc);
    len >>= 1;
    if (len == 0) break;
    MatrixSquare(odd, even);
    if (len & 1) crc = MatrixTimes(odd, crc);
    len >>= 1;
    if (len == 0) break;
  }
  return crc;
}

// Bytes per lane of the three-lane loop: the crc32 instruction has a latency
// of three cycles and a throughput of one, so three independent streams run
// about three times as fast as one; they are joined with kLaneShift.
constexpr size_t kLane = 8192;

struct LaneShift {
  uint32_t columns[32];  // the operator of kLane zero bytes
  LaneShift() {
    for (int i = 0; i < 32; ++i) columns[i] = ShiftZeros(1u << i, kLane);
  }
};

__attribute__((target("sse4.2"))) uint32_t HardwareCrc(const unsigned char* p, size_t n,
                                                      uint32_t c) {
  static const LaneShift shift;
  uint64_t c64 = c;
  while (n >= 3 * kLane) {
    uint64_t c0 = c64, c1 = 0, c2 = 0;
    for (size_t i = 0; i < kLane; i += 8) {
      uint64_t v0, v1, v2;
      std::memcpy(&v0, p + i, 8);
      std::memcpy(&v1, p + kLane + i, 8);
      std::memcpy(&v2, p + 2 * kLane + i, 8);
      c0 = _mm_crc32_u64(c0, v0);
      c1 = _mm_crc32_u64(c1, v1);
      c2 = _mm_crc32_u64(c2, v2);
    }
    // CRC registers are linear: lane k's register moves over the lanes after it.
    const uint32_t joined = MatrixTimes(shift.columns, static_cast<uint32_t>(c0)) ^
                            static_cast<uint32_t>(c1);
    c64 = MatrixTimes(shift.columns, joined) ^ static_cast<uint32_t>(c2);
    p += 3 * kLane;
    n -= 3 * kLane;
  }
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

uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  // The inversions of the two checksums cancel: only the register moves.
  return ShiftZeros(crc_a, len_b) ^ crc_b;
}

}  // namespace zeroshard

namespace zeroshard::internal {
uint32_t Crc32cPortable(const void* data, size_t n, uint32_t crc) {
  return ~TableCrc(static_cast<const unsigned char*>(data), n, ~crc);
}
}  // namespace zeroshard::internal
