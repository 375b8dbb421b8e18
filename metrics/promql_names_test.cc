#include "metrics/promql_names.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace zeroshard::metrics::testing {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

TEST(PromqlNamesTest, FindsSelectorsInEveryPosition) {
  EXPECT_THAT(ZeroshardMetricsIn("zeroshard_jobs"),
              ElementsAre("zeroshard_jobs"));
  EXPECT_THAT(
      ZeroshardMetricsIn("sum by (job) (rate(zeroshard_comm_bytes_total[1m]))"),
      ElementsAre("zeroshard_comm_bytes_total"));
  EXPECT_THAT(
      ZeroshardMetricsIn("zeroshard_memory_bytes{job=~\"$job\"} / "
                         "zeroshard_memory_limit_bytes > 0.9"),
      ElementsAre("zeroshard_memory_bytes", "zeroshard_memory_limit_bytes"));
}

TEST(PromqlNamesTest, HistogramSuffixesMapToTheFamily) {
  EXPECT_THAT(
      ZeroshardMetricsIn("histogram_quantile(0.99, sum by (le) "
                         "(rate(zeroshard_step_seconds_bucket[5m]))) + "
                         "zeroshard_optimizer_seconds_sum / "
                         "zeroshard_optimizer_seconds_count"),
      ElementsAre("zeroshard_optimizer_seconds", "zeroshard_step_seconds"));
  // Not a histogram in the contract: kept as written, so it fails the check.
  EXPECT_THAT(ZeroshardMetricsIn("zeroshard_jobs_count"),
              ElementsAre("zeroshard_jobs_count"));
  EXPECT_FALSE(IsExportedMetric("zeroshard_jobs_count"));
  EXPECT_TRUE(IsExportedMetric("zeroshard_step_seconds"));
}

TEST(PromqlNamesTest, IgnoresStringsCommentsAndOtherNames) {
  EXPECT_THAT(ZeroshardMetricsIn("up{job=\"zeroshard_x\", a='zeroshard_y', "
                                 "b=`zeroshard_z`} # zeroshard_comment\n"),
              IsEmpty());
  EXPECT_THAT(ZeroshardMetricsIn("my_zeroshard_total + 5m"), IsEmpty());
  EXPECT_THAT(ZeroshardMetricsIn("a{x=\"q\\\"zeroshard_a\"} + zeroshard_jobs"),
              ElementsAre("zeroshard_jobs"));
}

TEST(PromqlNamesTest, CollectsMatcherLabels) {
  const std::vector<Selector> selectors = ZeroshardSelectorsIn(
      "rate(zeroshard_requests_total { code != \"OK\", instance=~'a}b' }[5m])"
      " / on (instance) zeroshard_jobs");
  ASSERT_EQ(selectors.size(), 2u);
  EXPECT_EQ(selectors[0].family, "zeroshard_requests_total");
  EXPECT_THAT(selectors[0].matcher_labels, ElementsAre("code", "instance"));
  EXPECT_EQ(selectors[1].family, "zeroshard_jobs");
  EXPECT_THAT(selectors[1].matcher_labels, IsEmpty());
}

TEST(PromqlNamesTest, CheckAgainstContract) {
  EXPECT_TRUE(CheckAgainstContract(
                  "histogram_quantile(0.5, sum by (le) (rate("
                  "zeroshard_step_seconds_bucket{job=\"a\", le!=\"\"}[5m])))")
                  .ok());
  EXPECT_TRUE(CheckAgainstContract("up{job=\"zeroshard\"} == 0").ok());
  EXPECT_FALSE(CheckAgainstContract("zeroshard_nope").ok());
  // zeroshard_jobs has no job label of its own: job is the scrape job there.
  EXPECT_FALSE(CheckAgainstContract("zeroshard_jobs{job=~\"$job\"}").ok());
  EXPECT_FALSE(CheckAgainstContract("zeroshard_memory_bytes{le=\"1\"}").ok());
}

}  // namespace
}  // namespace zeroshard::metrics::testing
