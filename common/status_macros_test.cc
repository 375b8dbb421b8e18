#include "common/status_macros.h"

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

absl::StatusOr<int> Half(int v) {
  if (v % 2 != 0) return absl::InvalidArgumentError("odd");
  return v / 2;
}

absl::Status Check(int v) {
  ASSIGN_OR_RETURN(int h, Half(v), "halving ", v);
  RETURN_IF_ERROR(Half(h).status());
  return absl::OkStatus();
}

absl::StatusOr<int> Quarter(int v) {
  ASSIGN_OR_RETURN(int h, Half(v));
  ASSIGN_OR_RETURN(int q, Half(h));
  return q;
}

TEST(StatusMacros, PropagatesWithContext) {
  EXPECT_TRUE(Check(4).ok());
  absl::Status s = Check(3);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "odd: halving 3");
  EXPECT_EQ(Check(6).message(), "odd");
  EXPECT_EQ(*Quarter(8), 2);
  EXPECT_FALSE(Quarter(6).ok());
}

}  // namespace
}  // namespace zeroshard
