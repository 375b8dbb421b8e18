#pragma once

// CRC-32C (Castagnoli), as carried in chunk checksums on the wire. Uses the
// SSE4.2 instruction when the CPU has it, a table otherwise; same result.

#include <cstddef>
#include <cstdint>

namespace zeroshard {

// Extends `crc` (0 for a fresh checksum) over n bytes.
uint32_t Crc32c(const void* data, size_t n, uint32_t crc = 0);

}  // namespace zeroshard

namespace zeroshard::internal {
// The table-driven path alone (tests compare it with the hardware path).
uint32_t Crc32cPortable(const void* data, size_t n, uint32_t crc = 0);
}  // namespace zeroshard::internal
