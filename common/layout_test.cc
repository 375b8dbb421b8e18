#include "common/layout.h"

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

std::vector<TensorSpec> Specs() {
  return {{"embed", {100, 8}, DType::kFp32, 0},
          {"w1", {8, 8}, DType::kFp32, 1},
          {"b1", {7}, DType::kFp32, 1},
          {"head", {3, 5}, DType::kBf16, 2}};
}

TEST(Layout, PlacesTensorsAligned) {
  auto layout = Layout::Create(Specs(), 16);
  ASSERT_TRUE(layout.ok()) << layout.status();
  const auto& t = layout->tensors();
  EXPECT_EQ(t[0].offset, 0u);
  EXPECT_EQ(t[1].offset, 800u);
  EXPECT_EQ(t[2].offset, 864u);
  EXPECT_EQ(t[3].offset, 880u);
  EXPECT_EQ(layout->parameter_count(), 800u + 64 + 7 + 15);
  EXPECT_EQ(layout->total_elements(), 896u);
  EXPECT_EQ(*layout->LayerRange(1), (FlatRange{800, 880}));
  EXPECT_EQ(*layout->LayerRange(2), (FlatRange{880, 896}));
  EXPECT_EQ(layout->LayerRange(9).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(layout->layers(), (std::vector<uint32_t>{0, 1, 2}));
}

TEST(Layout, FingerprintDependsOnEverything) {
  const uint64_t base = Layout::Create(Specs())->fingerprint();
  EXPECT_EQ(base, Layout::Create(Specs())->fingerprint());
  auto s = Specs();
  s[1].shape = {8, 9};
  EXPECT_NE(base, Layout::Create(s)->fingerprint());
  s = Specs();
  s[3].dtype = DType::kFp16;
  EXPECT_NE(base, Layout::Create(s)->fingerprint());
  s = Specs();
  s[2].name = "b2";
  EXPECT_NE(base, Layout::Create(s)->fingerprint());
  s = Specs();
  s[3].layer = 3;
  EXPECT_NE(base, Layout::Create(s)->fingerprint());
  EXPECT_NE(base, Layout::Create(Specs(), 32)->fingerprint());
}

void ExpectInvalid(std::vector<TensorSpec> specs, absl::string_view field, uint64_t align = 0) {
  auto layout = Layout::Create(std::move(specs), align);
  ASSERT_FALSE(layout.ok());
  EXPECT_EQ(layout.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(layout.status().message().find(std::string(field)), absl::string_view::npos)
      << layout.status();
}

TEST(Layout, RejectsBadInputNamingTheField) {
  ExpectInvalid({}, "tensors");
  auto s = Specs();
  s[1].shape = {8, 0};
  ExpectInvalid(s, "tensors[1].shape[1]");
  s = Specs();
  s[1].shape = {-3};
  ExpectInvalid(s, "tensors[1].shape[0]");
  s = Specs();
  s[2].name = "w1";
  ExpectInvalid(s, "tensors[2].name");
  s = Specs();
  s[0].name = "";
  ExpectInvalid(s, "tensors[0].name");
  s = Specs();
  s[0].name = "bad\nname";
  ExpectInvalid(s, "tensors[0].name");
  s = Specs();
  s[3].layer = 0;
  ExpectInvalid(s, "tensors[3].layer");
  s = Specs();
  s[0].shape = {1 << 30, 1 << 30};  // 2^60 elements
  ExpectInvalid(s, "tensors[0].shape");
  s = Specs();
  s[0].shape = {int64_t{1} << 40, int64_t{1} << 40};  // overflows 64 bits
  ExpectInvalid(s, "tensors[0].shape");
  s = Specs();
  s[0].shape = {};
  ExpectInvalid(s, "tensors[0].shape");
  s = Specs();
  s[1].dtype = static_cast<DType>(9);
  ExpectInvalid(s, "tensors[1].dtype");
  ExpectInvalid(Specs(), "alignment_elements", 24);
  ExpectInvalid(Specs(), "alignment_elements", 8192);
  // Two tensors of 2^47 + 1 elements each: over 2^48 in total.
  ExpectInvalid({{"a", {(int64_t{1} << 47) + 1}, DType::kFp32, 0},
                 {"b", {(int64_t{1} << 47) + 1}, DType::kFp32, 0}},
                "tensors[1]");
}

}  // namespace
}  // namespace zeroshard
