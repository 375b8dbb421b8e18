#pragma once

// CRC-32C (Castagnoli), as carried in chunk checksums on the wire. Uses the
// SSE4.2 instruction when the CPU has it, a table otherwise; same result.

#include <cstddef>
#include <cstdint>

namespace zeroshard {

// Extends `crc` (0 for a fresh checksum) over n bytes.
uint32_t Crc32c(const void* data, size_t n, uint32_t crc = 0);

// The CRC-32C of A followed by B, from crc_a = Crc32c(A), crc_b = Crc32c(B)
// and B's length, without reading the bytes again (O(log len_b)).
uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

}  // namespace zeroshard

namespace zeroshard::internal {
// The table-driven path alone (tests compare it with the hardware path).
uint32_t Crc32cPortable(const void* data, size_t n, uint32_t crc = 0);
}  // namespace zeroshard::internal
