#include "common/dtype.h"

#include "absl/strings/str_cat.h"

namespace zeroshard {

absl::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kFp32: return "fp32";
    case DType::kBf16: return "bf16";
    case DType::kFp16: return "fp16";
  }
  return "unknown";
}

absl::StatusOr<DType> DTypeFromProto(int value, absl::string_view field) {
  switch (value) {
    case 1: return DType::kFp32;
    case 2: return DType::kBf16;
    case 3: return DType::kFp16;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": dtype ", value, " is not one of fp32 (1), bf16 (2), fp16 (3)"));
  }
}

int DTypeToProto(DType t) { return static_cast<int>(t); }

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  if (name == "fp32") return DType::kFp32;
  if (name == "bf16") return DType::kBf16;
  if (name == "fp16") return DType::kFp16;
  return absl::InvalidArgumentError(
      absl::StrCat("dtype \"", name, "\" is not one of fp32, bf16, fp16"));
}

uint16_t FloatToHalf(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;            // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;           // rounds to >= 65520: inf
  if (abs < 0x38800000u) {                                 // below 2^-14: subnormal or zero
    // Scale into the subnormal grid (2^-24 units) with round to nearest even.
    const float scaled = BitsToFloat(abs) * 16777216.0f;   // * 2^24
    float r = scaled;
    // nearbyint with ties to even in the default rounding mode
    r = __builtin_nearbyintf(r);
    return sign | static_cast<uint16_t>(r);
  }
  uint32_t mant = abs & 0x7fffffu;
  uint32_t exp = (abs >> 23) - 127 + 15;
  uint32_t half = (exp << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;
  return sign | static_cast<uint16_t>(half);
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    const float v = static_cast<float>(mant) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  if (exp == 31) return BitsToFloat(sign | 0x7f800000u | (mant << 13));
  return BitsToFloat(sign | ((exp - 15 + 127) << 23) | (mant << 13));
}

void ToFloat(DType from, const void* src, float* dst, size_t n) {
  switch (from) {
    case DType::kFp32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::kBf16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = Bf16ToFloat(s[i]);
      return;
    }
    case DType::kFp16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = HalfToFloat(s[i]);
      return;
    }
  }
}

void FromFloat(DType to, const float* src, void* dst, size_t n) {
  switch (to) {
    case DType::kFp32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::kBf16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = FloatToBf16(src[i]);
      return;
    }
    case DType::kFp16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = FloatToHalf(src[i]);
      return;
    }
  }
}

}  // namespace zeroshard
