#pragma once

// Element types and scalar conversions. The scalar conversions are the
// reference the vectorised paths (server/optimizer, cuda/) are tested against.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"

namespace zeroshard {

enum class DType : uint8_t { kFp32 = 1, kBf16 = 2, kFp16 = 3 };

// Bytes per element: 4 for fp32, 2 for bf16 and fp16.
constexpr size_t DTypeSize(DType t) { return t == DType::kFp32 ? 4 : 2; }

// "fp32", "bf16", "fp16".
absl::string_view DTypeName(DType t);

// From the wire enum value (zeroshard.v1.DType); InvalidArgument naming
// `field` for 0 or unknown values.
absl::StatusOr<DType> DTypeFromProto(int value, absl::string_view field);
int DTypeToProto(DType t);

// Parses "fp32" / "bf16" / "fp16" (for flags); InvalidArgument otherwise.
absl::StatusOr<DType> ParseDType(absl::string_view name);

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// fp32 -> bf16, round to nearest even; NaN stays a (quiet) NaN.
inline uint16_t FloatToBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float Bf16ToFloat(uint16_t h) { return BitsToFloat(static_cast<uint32_t>(h) << 16); }

// fp32 <-> IEEE binary16, round to nearest even, overflow to inf, subnormals kept.
uint16_t FloatToHalf(float f);
float HalfToFloat(uint16_t h);

// Converts n elements of `src` (type `from`) to fp32 in `dst`.
void ToFloat(DType from, const void* src, float* dst, size_t n);
// Converts n fp32 elements to type `to` in `dst`.
void FromFloat(DType to, const float* src, void* dst, size_t n);

}  // namespace zeroshard
