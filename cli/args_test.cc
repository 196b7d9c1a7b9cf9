#include "cli/args.h"

#include "gtest/gtest.h"

namespace baton::cli {
namespace {

TEST(ArgsTest, ParsesBothValueFormsBooleansAndPositionals) {
  auto args = Args::Parse({"show", "--pp=4", "--microbatches", "8", "--json", "extra"},
                          {"pp", "microbatches"}, {"json"});
  ASSERT_TRUE(args.ok()) << args.status();
  EXPECT_EQ(*args->GetInt("pp", 0), 4);
  EXPECT_EQ(*args->GetInt("microbatches", 0), 8);
  EXPECT_EQ(*args->GetInt("virtual", 1), 1);
  EXPECT_TRUE(args->GetBool("json"));
  EXPECT_EQ(args->positionals(), (std::vector<std::string>{"show", "extra"}));
}

TEST(ArgsTest, UnknownFlagIsNamedWithTheKnownOnes) {
  auto args = Args::Parse({"--pq=4"}, {"pp"});
  ASSERT_FALSE(args.ok());
  EXPECT_NE(args.status().message().find("unknown flag --pq"), std::string::npos);
  EXPECT_NE(args.status().message().find("--pp"), std::string::npos);
}

TEST(ArgsTest, MalformedNumbersAndMissingValuesAreErrors) {
  auto args = Args::Parse({"--pp=four", "--lr=x"}, {"pp", "lr"});
  ASSERT_TRUE(args.ok());
  EXPECT_FALSE(args->GetInt("pp", 0).ok());
  EXPECT_FALSE(args->GetDouble("lr", 0).ok());
  EXPECT_FALSE(Args::Parse({"--pp"}, {"pp"}).ok());
  EXPECT_FALSE(Args::Parse({"--json=yes"}, {}, {"json"}).ok());
}

}  // namespace
}  // namespace baton::cli
