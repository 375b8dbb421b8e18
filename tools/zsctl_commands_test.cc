#include "tools/zsctl_commands.h"

#include "gtest/gtest.h"

namespace zeroshard::tools {
namespace {

TEST(Zsctl, ParsesCountsAndBytes) {
  EXPECT_DOUBLE_EQ(*ParseCount("7.5e9"), 7.5e9);
  EXPECT_DOUBLE_EQ(*ParseCount("7.5B"), 7.5e9);
  EXPECT_DOUBLE_EQ(*ParseCount("350M"), 350e6);
  EXPECT_DOUBLE_EQ(*ParseCount("1T"), 1e12);
  EXPECT_DOUBLE_EQ(*ParseBytes("32GiB"), 32.0 * (1 << 30));
  EXPECT_DOUBLE_EQ(*ParseBytes("32GB"), 32e9);
  EXPECT_DOUBLE_EQ(*ParseBytes("80e9"), 80e9);
  EXPECT_FALSE(ParseCount("").ok());
  EXPECT_FALSE(ParseCount("-5").ok());
  EXPECT_FALSE(ParseCount("7.5X").ok());
  EXPECT_FALSE(ParseBytes("12 parsecs").ok());
}

TEST(Zsctl, EstimatePrintsThePapersFigures) {
  EstimateOptions o;
  o.params = "7.5e9";
  o.world_size = 64;
  auto out = RunEstimate(o);
  ASSERT_TRUE(out.ok()) << out.status();
  for (const char* figure : {"120 GB", "31.4 GB", "16.6 GB", "1.88 GB"}) {
    EXPECT_NE(out->find(figure), std::string::npos) << figure << "\n" << *out;
  }
  o.device_memory = "32GB";
  out = RunEstimate(o);
  ASSERT_TRUE(out.ok());
  EXPECT_NE(out->find("7.64B"), std::string::npos) << *out;
  EXPECT_NE(out->find("128B"), std::string::npos) << *out;
}

TEST(Zsctl, EstimateRejectsBadInput) {
  EstimateOptions o;
  EXPECT_EQ(RunEstimate(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.params = "1e9";
  o.world_size = 0;
  EXPECT_EQ(RunEstimate(o).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace zeroshard::tools
