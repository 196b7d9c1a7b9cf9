#include "common/status_macros.h"

#include "gtest/gtest.h"

namespace baton {
namespace {

absl::StatusOr<int> Half(int x) {
  if (x % 2 != 0) return absl::InvalidArgumentError("odd");
  return x / 2;
}

absl::Status Quarter(int x, int* out) {
  BATON_ASSIGN_OR_RETURN(int h, Half(x));
  BATON_ASSIGN_OR_RETURN(*out, Half(h));
  return absl::OkStatus();
}

absl::Status Load(int x) {
  int unused;
  BATON_RETURN_IF_ERROR_CTX(Quarter(x, &unused), "while loading ", x);
  return absl::OkStatus();
}

TEST(StatusMacrosTest, AssignOrReturnPropagatesValueAndError) {
  int out = 0;
  ASSERT_TRUE(Quarter(12, &out).ok());
  EXPECT_EQ(out, 3);
  EXPECT_EQ(Quarter(6, &out).code(), absl::StatusCode::kInvalidArgument);
}

TEST(StatusMacrosTest, ContextIsPrependedAndCodeKept) {
  absl::Status s = Load(6);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "while loading 6: odd");
  EXPECT_TRUE(Load(8).ok());
}

// A status's payloads (what kind of failure it is, e.g. out of memory) ride
// along as context is added.
TEST(StatusMacrosTest, ContextKeepsPayloads) {
  absl::Status s = absl::ResourceExhaustedError("out of memory");
  s.SetPayload("type.baton.dev/test", absl::Cord("x"));
  const absl::Status with = WithContext(WithContext(s, "inner"), "outer");
  EXPECT_EQ(with.message(), "outer: inner: out of memory");
  ASSERT_TRUE(with.GetPayload("type.baton.dev/test").has_value());
  EXPECT_EQ(*with.GetPayload("type.baton.dev/test"), "x");
}

}  // namespace
}  // namespace baton
