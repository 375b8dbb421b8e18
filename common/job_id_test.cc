#include "common/job_id.h"

#include <string>

#include "gtest/gtest.h"

namespace zeroshard {
namespace {

TEST(JobIdTest, FollowsTheRule) {
  EXPECT_TRUE(IsValidJobId("run-42_a.b"));
  EXPECT_TRUE(IsValidJobId(std::string(128, 'x')));
  EXPECT_FALSE(IsValidJobId(""));
  EXPECT_FALSE(IsValidJobId(std::string(129, 'x')));
  EXPECT_FALSE(IsValidJobId("a b"));
  EXPECT_FALSE(IsValidJobId("a/b"));
  EXPECT_FALSE(IsValidJobId("."));  // would name a directory that is not the job's
  EXPECT_FALSE(IsValidJobId(".."));
  EXPECT_TRUE(IsValidJobId("..."));
  EXPECT_FALSE(IsValidJobId(absl::string_view("a\0b", 3)));
}

}  // namespace
}  // namespace zeroshard
