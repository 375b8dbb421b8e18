#include "common/layout.h"

#include <string>
#include <utility>
#include <vector>

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

// A layout without groups, frozen tensors or aliases hashes as it did before
// they existed: checkpoints and registered jobs of older trainers still
// match. The constant is what Layout::Create computed for Specs() at commit
// 9b960a4, before TensorSpec had those fields.
TEST(Layout, FingerprintOfALayoutWithoutTheNewFieldsIsUnchanged) {
  constexpr uint64_t kBeforeGroups = 13418292136185434455ull;
  EXPECT_EQ(Layout::Create(Specs())->fingerprint(), kBeforeGroups);
  // The defaults set explicitly hash the same.
  auto s = Specs();
  for (TensorSpec& t : s) {
    t.group = 0;
    t.frozen = false;
    t.aliases.clear();
  }
  EXPECT_EQ(Layout::Create(s)->fingerprint(), kBeforeGroups);
}

TEST(Layout, FingerprintDependsOnGroupsFrozenFlagsAndAliases) {
  const uint64_t base = Layout::Create(Specs())->fingerprint();
  std::vector<uint64_t> seen = {base};
  auto expect_new = [&](const std::vector<TensorSpec>& s, const char* what) {
    absl::StatusOr<Layout> layout = Layout::Create(s);
    ASSERT_TRUE(layout.ok()) << what << ": " << layout.status();
    for (uint64_t f : seen) EXPECT_NE(layout->fingerprint(), f) << what;
    seen.push_back(layout->fingerprint());
  };
  auto s = Specs();
  s[1].group = 1;
  expect_new(s, "w1 in group 1");
  s[1].group = 2;
  expect_new(s, "w1 in group 2");
  s = Specs();
  s[2].group = 1;
  expect_new(s, "b1 in group 1");
  s = Specs();
  s[2].frozen = true;
  expect_new(s, "b1 frozen");
  s = Specs();
  s[3].frozen = true;
  expect_new(s, "head frozen");
  s = Specs();
  s[3].aliases = {"lm_head"};
  expect_new(s, "head aliased lm_head");
  s[3].aliases = {"lm_head2"};
  expect_new(s, "head aliased lm_head2");
  s[3].aliases = {"lm_head", "out"};
  expect_new(s, "head with two aliases");
  s[3].aliases = {"out", "lm_head"};
  expect_new(s, "head with two aliases in the other order");
  s = Specs();
  s[0].aliases = {"lm_head"};
  expect_new(s, "embed aliased lm_head");
  // The same extended layout hashes the same every time.
  s = Specs();
  s[1].group = 1;
  s[2].frozen = true;
  s[3].aliases = {"lm_head"};
  EXPECT_EQ(Layout::Create(s)->fingerprint(), Layout::Create(s)->fingerprint());
}

TEST(Layout, RejectsBadGroupsAndAliasesNamingTheField) {
  auto s = Specs();
  s[2].group = Layout::kMaxParamGroups;
  ExpectInvalid(s, "tensors[2].group (b1)");
  s[2].group = Layout::kMaxParamGroups - 1;
  EXPECT_TRUE(Layout::Create(s).ok());
  // An alias may not repeat a name, another tensor's alias or its own.
  s = Specs();
  s[3].aliases = {"w1"};
  ExpectInvalid(s, "tensors[3].aliases[0] (head)");
  s = Specs();
  s[0].aliases = {"head"};  // a name that comes later
  ExpectInvalid(s, "tensors[3].name");
  s = Specs();
  s[1].aliases = {"tied"};
  s[3].aliases = {"other", "tied"};
  ExpectInvalid(s, "tensors[3].aliases[1] (head)");
  s = Specs();
  s[3].aliases = {"x", "x"};
  ExpectInvalid(s, "tensors[3].aliases[1]");
  s = Specs();
  s[3].aliases = {"head"};
  ExpectInvalid(s, "tensors[3].aliases[0]");
  // The name rules apply to aliases.
  s = Specs();
  s[2].aliases = {"ok", "bad\talias"};
  ExpectInvalid(s, "tensors[2].aliases[1]");
  s[2].aliases = {""};
  ExpectInvalid(s, "tensors[2].aliases[0]");
  s[2].aliases = {std::string(Layout::kMaxNameBytes + 1, 'a')};
  ExpectInvalid(s, "tensors[2].aliases[0]");
  s[2].aliases = {std::string(Layout::kMaxNameBytes, 'a')};
  EXPECT_TRUE(Layout::Create(s).ok());
  // At most kMaxAliases.
  s = Specs();
  for (size_t a = 0; a <= Layout::kMaxAliases; ++a) {
    s[1].aliases.push_back("w1_" + std::to_string(a));
  }
  ExpectInvalid(s, "tensors[1].aliases (w1)");
  s[1].aliases.pop_back();
  EXPECT_TRUE(Layout::Create(s).ok());
}

TEST(Layout, TensorsInFindsTheOverlappingTensors) {
  // embed [0, 800), w1 [800, 864), b1 [864, 871), head [880, 895); total 896.
  const Layout layout = *Layout::Create(Specs(), 16);
  using P = std::pair<size_t, size_t>;
  EXPECT_EQ(layout.TensorsIn({0, 896}), (P{0, 4}));
  EXPECT_EQ(layout.TensorsIn({0, 1}), (P{0, 1}));
  EXPECT_EQ(layout.TensorsIn({799, 801}), (P{0, 2}));
  EXPECT_EQ(layout.TensorsIn({800, 864}), (P{1, 2}));
  EXPECT_EQ(layout.TensorsIn({863, 865}), (P{1, 3}));
  EXPECT_EQ(layout.TensorsIn({870, 881}), (P{2, 4}));
  // Alignment gaps hold no tensor.
  EXPECT_EQ(layout.TensorsIn({871, 880}), (P{3, 3}));
  EXPECT_EQ(layout.TensorsIn({895, 896}), (P{4, 4}));
  // Every single element agrees with a linear scan.
  for (uint64_t pos = 0; pos < 896; ++pos) {
    size_t first = 4, last = 0;
    for (size_t i = 0; i < layout.tensors().size(); ++i) {
      if (layout.tensors()[i].range().Contains({pos, pos + 1})) {
        first = i;
        last = i + 1;
      }
    }
    const P got = layout.TensorsIn({pos, pos + 1});
    if (first == 4) {
      EXPECT_EQ(got.first, got.second) << pos;
    } else {
      EXPECT_EQ(got, (P{first, last})) << pos;
    }
  }
}

TEST(Layout, GroupCountAndFrozenElements) {
  const Layout plain = *Layout::Create(Specs(), 16);
  EXPECT_EQ(plain.group_count(), 1u);
  EXPECT_EQ(plain.frozen_elements(), 0u);
  auto s = Specs();
  s[1].group = 3;
  s[2].group = 1;
  s[2].frozen = true;
  s[3].frozen = true;
  const Layout layout = *Layout::Create(s, 16);
  EXPECT_EQ(layout.group_count(), 4u);
  EXPECT_EQ(layout.frozen_elements(), 7u + 15u);  // b1 and head, without their gaps
  EXPECT_EQ(layout.parameter_count(), plain.parameter_count());
  EXPECT_EQ(layout.total_elements(), plain.total_elements());
  EXPECT_EQ(layout.tensors()[1].spec.group, 3u);
  EXPECT_TRUE(layout.tensors()[3].spec.frozen);
}

}  // namespace
}  // namespace zeroshard
