#include "tools/json_writer.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "gtest/gtest.h"
#include "tools/json_test_parser.h"

namespace zeroshard::tools {
namespace {

std::string Quoted(absl::string_view text) {
  std::string out;
  AppendJsonString(text, &out);
  return out;
}

TEST(JsonString, EscapesQuotesBackslashesAndControlCharacters) {
  EXPECT_EQ(Quoted(""), R"("")");
  EXPECT_EQ(Quoted("plain /text/"), R"("plain /text/")");
  EXPECT_EQ(Quoted("say \"hi\""), R"("say \"hi\"")");
  EXPECT_EQ(Quoted("C:\\dir\\"), R"("C:\\dir\\")");
  EXPECT_EQ(Quoted("a\nb\tc\rd\be\ff"), R"("a\u000ab\u0009c\u000dd\u0008e\u000cf")");
  EXPECT_EQ(Quoted(std::string("nul\0x", 5)), R"("nul\u0000x")");
  EXPECT_EQ(Quoted("\x1f\x7f"), "\"\\u001f\x7f\"");  // DEL needs no escape
}

TEST(JsonString, CopiesUtf8AndReplacesInvalidBytes) {
  EXPECT_EQ(Quoted("Ψ 7.5B, N_d ≥ 64, 🚀"), "\"Ψ 7.5B, N_d ≥ 64, 🚀\"");
  // A stray continuation byte, a truncated sequence, an overlong '/', an
  // encoded surrogate and a code point above U+10FFFF: one U+FFFD per byte.
  EXPECT_EQ(Quoted("a\x80z"), "\"a\xEF\xBF\xBDz\"");
  EXPECT_EQ(Quoted("\xE2\x89"), "\"\xEF\xBF\xBD\xEF\xBF\xBD\"");
  EXPECT_EQ(Quoted("\xC0\xAF"), "\"\xEF\xBF\xBD\xEF\xBF\xBD\"");
  EXPECT_EQ(Quoted("\xED\xA0\x80"), "\"\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\"");
  EXPECT_EQ(Quoted("\xF4\x90\x80\x80"), "\"\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\"");
}

// Every byte value, alone and inside text, comes back from a strict parser as
// the same text (or U+FFFD where the byte is not UTF-8).
TEST(JsonString, EveryByteRoundTrips) {
  for (int b = 0; b < 256; ++b) {
    SCOPED_TRACE(b);
    const std::string text = std::string("<") + static_cast<char>(b) + ">";
    absl::StatusOr<JsonValue> v = ParseJson(Quoted(text));
    ASSERT_TRUE(v.ok()) << v.status();
    ASSERT_EQ(v->type, JsonValue::Type::kString);
    EXPECT_EQ(v->string, b < 0x80 ? text : "<\xEF\xBF\xBD>");
  }
}

TEST(JsonWriter, WritesNestedDocuments) {
  JsonWriter w;
  w.BeginObject()
      .Key("daemons")
      .BeginArray()
      .BeginObject()
      .Key("address")
      .String("127.0.0.1:7070")
      .Key("jobs")
      .BeginArray()
      .EndArray()
      .Key("draining")
      .Bool(false)
      .EndObject()
      .BeginObject()
      .Key("address")
      .String("h\"1")
      .Key("error")
      .BeginObject()
      .Key("code")
      .String("UNAVAILABLE")
      .EndObject()
      .EndObject()
      .EndArray()
      .Key("empty")
      .BeginObject()
      .EndObject()
      .Key("limit")
      .Null()
      .Key("list")
      .BeginArray()
      .Int(-1)
      .Uint(2)
      .Bool(true)
      .EndArray()
      .EndObject();
  const std::string doc = w.Finish();
  EXPECT_EQ(doc, R"({"daemons":[{"address":"127.0.0.1:7070","jobs":[],"draining":false},)"
                 R"({"address":"h\"1","error":{"code":"UNAVAILABLE"}}],"empty":{},"limit":null,)"
                 R"("list":[-1,2,true]})"
                 "\n");
  EXPECT_TRUE(ParseJson(doc).ok());
  // The writer starts over after Finish.
  w.BeginArray().EndArray();
  EXPECT_EQ(w.Finish(), "[]\n");
}

TEST(JsonWriter, WritesNumbersExactly) {
  JsonWriter w;
  w.BeginArray()
      .Uint(std::numeric_limits<uint64_t>::max())
      .Int(std::numeric_limits<int64_t>::min())
      .Double(7.5e9)
      .Double(0.1)
      .Double(1.0 / 3)
      .Double(-2.5e-300)
      .Double(1e300)
      .Double(12)
      .Double(std::nan(""))
      .Double(std::numeric_limits<double>::infinity())
      .Double(-std::numeric_limits<double>::infinity())
      .EndArray();
  const std::string doc = w.Finish();
  EXPECT_EQ(doc,
            "[18446744073709551615,-9223372036854775808,7500000000,0.1,0.33333333333333331,"
            "-2.5e-300,1e+300,12,null,null,null]\n");
  absl::StatusOr<JsonValue> v = ParseJson(doc);
  ASSERT_TRUE(v.ok()) << v.status();
  ASSERT_EQ(v->elements.size(), 11u);
  EXPECT_EQ(v->elements[4].number, 1.0 / 3);  // 17 digits read back exactly
  EXPECT_EQ(v->elements[5].number, -2.5e-300);
}

TEST(JsonTestParser, RejectsWhatRfc8259Forbids) {
  for (const char* bad :
       {"",         "{",           "[1,]",        "{\"a\":1,}",   "{\"a\" 1}",
        "{a:1}",    "01",          "1.",          ".5",           "-",
        "1e",       "+1",          "NaN",         "nul",          "\"\\x\"",
        "\"a\nb\"", "\"\\ud800\"", "\"\\udc00\"", "\"\xC0\xAF\"", "{\"a\":1,\"a\":2}",
        "[1] 2",    "'a'"}) {
    SCOPED_TRACE(bad);
    EXPECT_FALSE(ParseJson(bad).ok());
  }
  absl::StatusOr<JsonValue> v = ParseJson(" {\"s\" : \"\\u00e9\\ud83d\\ude80\\/\" } ");
  ASSERT_TRUE(v.ok()) << v.status();
  ASSERT_NE(v->Find("s"), nullptr);
  EXPECT_EQ(v->Find("s")->string, "é🚀/");
}

}  // namespace
}  // namespace zeroshard::tools
