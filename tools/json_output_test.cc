#include "tools/json_output.h"

#include <cmath>
#include <limits>
#include <string>

#include "gtest/gtest.h"

namespace zeroshard::tools {
namespace {

std::string Dumped(const Json& value) { return value.dump(); }

TEST(JsonNumber, WholeNumbersAreIntegers) {
  EXPECT_EQ(Dumped(JsonNumber(7.5e9)), "7500000000");
  EXPECT_TRUE(JsonNumber(7.5e9).is_number_unsigned());
  EXPECT_EQ(Dumped(JsonNumber(12)), "12");
  EXPECT_EQ(Dumped(JsonNumber(0)), "0");
  EXPECT_EQ(Dumped(JsonNumber(-3)), "-3");
  EXPECT_EQ(Dumped(JsonNumber(9007199254740992.0)), "9007199254740992");
}

TEST(JsonNumber, OthersAreShortestDoubles) {
  EXPECT_EQ(Dumped(JsonNumber(0.5)), "0.5");
  EXPECT_EQ(Dumped(JsonNumber(0.1)), "0.1");
  EXPECT_EQ(Dumped(JsonNumber(1e300)), "1e+300");
  EXPECT_EQ(Json::parse(Dumped(JsonNumber(1.0 / 3))).get<double>(), 1.0 / 3);
}

TEST(JsonNumber, NonFiniteIsNull) {
  EXPECT_TRUE(JsonNumber(std::nan("")).is_null());
  EXPECT_TRUE(JsonNumber(std::numeric_limits<double>::infinity()).is_null());
  EXPECT_TRUE(JsonNumber(-std::numeric_limits<double>::infinity()).is_null());
}

TEST(JsonDocument, CompactInInsertionOrderWithANewline) {
  Json doc;
  doc["zeta"] = 1;
  doc["alpha"] = Json::array({true, nullptr, "x"});
  doc["mid"]["b"] = 2;
  EXPECT_EQ(JsonDocument(doc), "{\"zeta\":1,\"alpha\":[true,null,\"x\"],\"mid\":{\"b\":2}}\n");
}

TEST(JsonDocument, EscapesAndReplacesInvalidUtf8) {
  Json doc;
  doc["s"] = "say \"hi\" C:\\ a\nb \x01 Ψ ≥ 🚀";
  const std::string escaped = JsonDocument(doc);
  EXPECT_EQ(escaped, "{\"s\":\"say \\\"hi\\\" C:\\\\ a\\nb \\u0001 Ψ ≥ 🚀\"}\n");

  // A stray continuation byte, a truncated sequence, an encoded surrogate:
  // the document still parses, with U+FFFD in their place.
  doc["s"] = "a\x80z \xE2\x89 \xED\xA0\x80";
  const std::string replaced = JsonDocument(doc);
  const Json back = Json::parse(replaced, nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(back.is_discarded()) << replaced;
  const std::string s = back["s"].get<std::string>();
  EXPECT_EQ(s.substr(0, 1), "a");
  EXPECT_EQ(s.substr(1, 3), "\xEF\xBF\xBD");
  EXPECT_NE(s.find('z'), std::string::npos);
}

}  // namespace
}  // namespace zeroshard::tools
