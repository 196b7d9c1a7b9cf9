#include "common/json.h"

#include <cmath>
#include <limits>

#include "gtest/gtest.h"

namespace baton {
namespace {

TEST(JsonTest, ParsesNestedValuesInOrder) {
  auto v = JsonValue::Parse(R"( {"b": [1, -2.5e1, true, null], "a": {"s": "x\"\u00e9\ud83d\ude00"}} )");
  ASSERT_TRUE(v.ok()) << v.status();
  ASSERT_EQ(v->members().size(), 2u);
  EXPECT_EQ(v->members()[0].first, "b");  // member order kept
  const JsonValue& b = *v->Find("b");
  EXPECT_EQ(*b.items()[0].integer(), 1);
  EXPECT_EQ(b.items()[1].number(), -25.0);
  EXPECT_FALSE(b.items()[1].integer().has_value());
  EXPECT_TRUE(b.items()[2].bool_value());
  EXPECT_EQ(b.items()[3].kind(), JsonValue::Kind::kNull);
  EXPECT_EQ(v->Find("a")->Find("s")->str(), "x\"\xC3\xA9\xF0\x9F\x98\x80");
  EXPECT_EQ(v->Find("missing"), nullptr);
}

TEST(JsonTest, RejectsMalformedInputNamingTheOffset) {
  for (const char* bad : {"", "{", "{\"a\":1,}", "[1 2]", "{\"a\":1}x", "\"abc", "01", "-", "1.",
                          "{\"a\":1,\"a\":2}", "\"\\ud800\"", "\"\\q\"", "tru", "{1:2}"}) {
    auto v = JsonValue::Parse(bad);
    EXPECT_FALSE(v.ok()) << bad;
    if (!v.ok()) {
      EXPECT_NE(v.status().message().find("at byte"), absl::string_view::npos) << bad;
    }
  }
  EXPECT_FALSE(JsonValue::Parse(std::string(100, '[') + std::string(100, ']')).ok());  // too deep
}

TEST(JsonTest, QuoteEscapesAndRoundTrips) {
  const std::string nasty = "a\"b\\c\nd\te\x01 \xC3\xA9";
  auto back = JsonValue::Parse(JsonQuote(nasty));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->str(), nasty);
  // Invalid UTF-8 becomes U+FFFD, so the output stays valid JSON text.
  EXPECT_EQ(JsonQuote("x\xFFy\xC3"), "\"x\xEF\xBF\xBDy\xEF\xBF\xBD\"");
}

TEST(JsonTest, NumbersReadBackExactly) {
  for (double d : {0.1, 1.0 / 3, 1e-300, -12345678.9, 3.0}) {
    EXPECT_EQ(JsonValue::Parse(JsonNumber(d))->number(), d) << JsonNumber(d);
  }
  EXPECT_EQ(JsonNumber(3.0), "3");
  EXPECT_EQ(JsonNumber(std::numeric_limits<double>::infinity()), "null");
  EXPECT_EQ(JsonNumber(std::nan("")), "null");
}

}  // namespace
}  // namespace baton
