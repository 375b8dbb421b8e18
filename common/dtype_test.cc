#include "common/dtype.h"

#include <cmath>
#include <limits>

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

TEST(DType, SizesAndNames) {
  EXPECT_EQ(DTypeSize(DType::kFp32), 4u);
  EXPECT_EQ(DTypeSize(DType::kBf16), 2u);
  EXPECT_EQ(DTypeName(DType::kFp16), "fp16");
  EXPECT_EQ(*ParseDType("bf16"), DType::kBf16);
  EXPECT_EQ(ParseDType("int8").status().code(), absl::StatusCode::kInvalidArgument);
  absl::Status s = DTypeFromProto(0, "push.dtype").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("push.dtype"), absl::string_view::npos);
  EXPECT_FALSE(DTypeFromProto(7, "x").ok());
}

TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  // 1 + 2^-8 is exactly half way between bf16 1.0 and 1.0078125: ties to even.
  EXPECT_EQ(FloatToBf16(1.00390625f), 0x3f80);
  EXPECT_EQ(FloatToBf16(1.01171875f), 0x3f82);  // half way, odd below: up
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::nanf("")))));
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(-2.5f)), -2.5f);
}

TEST(DType, HalfRoundTripsEveryHalfValue) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = HalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(f))));
      continue;
    }
    EXPECT_EQ(FloatToHalf(f), h) << "half bits " << h;
  }
}

TEST(DType, HalfRoundingAndOverflow) {
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00);  // rounds up to inf
  EXPECT_EQ(FloatToHalf(1e10f), 0x7c00);
  EXPECT_EQ(FloatToHalf(-1e10f), 0xfc00);
  // 1 + 2^-11 is half way between 1 and the next half: ties to even (1.0).
  EXPECT_EQ(FloatToHalf(1.0f + 1.0f / 2048), 0x3c00);
  EXPECT_EQ(FloatToHalf(1.0f + 3.0f / 2048), 0x3c02);
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -26)), 0x0000);  // underflows to zero
}

TEST(DType, BulkConversions) {
  const float src[5] = {0.5f, -1.25f, 3.0f, 1e-3f, 65504.0f};
  for (DType t : {DType::kFp32, DType::kBf16, DType::kFp16}) {
    uint16_t buf[10];
    float back[5];
    FromFloat(t, src, buf, 5);
    ToFloat(t, buf, back, 5);
    for (int i = 0; i < 5; ++i) EXPECT_NEAR(back[i], src[i], std::fabs(src[i]) * 1e-2) << i;
  }
}

}  // namespace
}  // namespace zeroshard
