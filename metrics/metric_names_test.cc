#include "metrics/metric_names.h"

#include <set>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "metrics/promtool_testutil.h"
#include "metrics/registry.h"
#include "metrics/text_serializer.h"
#include "metrics/validation.h"

namespace zeroshard::metrics {
namespace {

TEST(MetricNamesTest, NamesAndLabelsAreValidAndSorted) {
  std::string previous;
  for (const MetricSpec& spec : kAllMetrics) {
    EXPECT_TRUE(ValidateMetricName(spec.name).ok()) << spec.name;
    EXPECT_TRUE(absl::StartsWith(spec.name, "zeroshard_")) << spec.name;
    EXPECT_LT(previous, spec.name) << "kAllMetrics out of order or duplicated";
    previous = std::string(spec.name);
    EXPECT_FALSE(spec.help.empty()) << spec.name;
    EXPECT_TRUE(ValidateLabelNames(spec.LabelNames(), spec.type).ok())
        << spec.name;
    EXPECT_EQ(FindMetric(spec.name), &spec);
  }
  EXPECT_EQ(FindMetric("zeroshard_nope"), nullptr);
}

TEST(MetricNamesTest, NamesFollowTheConventions) {
  for (const MetricSpec& spec : kAllMetrics) {
    const bool total = absl::EndsWith(spec.name, "_total");
    EXPECT_EQ(total, spec.type == MetricType::kCounter) << spec.name;
    if (spec.type == MetricType::kHistogram) {
      EXPECT_TRUE(absl::EndsWith(spec.name, "_seconds")) << spec.name;
    }
    if (absl::StrContains(spec.name, "bytes")) {
      EXPECT_TRUE(absl::EndsWith(spec.name, "_bytes") ||
                  absl::EndsWith(spec.name, "_bytes_total"))
          << spec.name;
    }
  }
}

TEST(MetricNamesTest, MemoryCategoriesAreTheLedgers) {
  std::set<absl::string_view> categories(std::begin(kMemoryCategories),
                                         std::end(kMemoryCategories));
  EXPECT_EQ(categories.size(), 9u);
  EXPECT_EQ(categories.count("fragmentation"), 1u);
  EXPECT_EQ(categories.count("replica"), 1u);
}

// Every family registers, and a registry holding all of them passes
// `promtool check metrics` (syntax and lint) with no complaint.
TEST(MetricNamesTest, AllFamiliesExportCleanly) {
  Registry registry;
  for (const MetricSpec& spec : kAllMetrics) {
    Labels labels;
    for (const std::string& name : spec.LabelNames()) {
      labels[name] = absl::StrCat(name, "-value");
    }
    switch (spec.type) {
      case MetricType::kCounter: {
        absl::StatusOr<Family<Counter>*> f =
            BuildCounter().Spec(spec).TryRegister(registry);
        ASSERT_TRUE(f.ok()) << f.status();
        (*f)->Add(labels).Increment(3);
        break;
      }
      case MetricType::kGauge: {
        absl::StatusOr<Family<Gauge>*> f =
            BuildGauge().Spec(spec).TryRegister(registry);
        ASSERT_TRUE(f.ok()) << f.status();
        (*f)->Add(labels).Set(1);
        break;
      }
      case MetricType::kHistogram: {
        absl::StatusOr<Family<Histogram>*> f =
            BuildHistogram()
                .Spec(spec)
                .Buckets(LatencySecondsBuckets())
                .TryRegister(registry);
        ASSERT_TRUE(f.ok()) << f.status();
        (*f)->Add(labels).Observe(0.2);
        break;
      }
    }
  }
  const std::vector<MetricFamily> families = registry.Collect();
  ASSERT_EQ(families.size(), std::size(kAllMetrics));
  const std::string text = TextSerializer().Serialize(families);

  const std::string promtool = testing::FindPromtool();
  if (promtool.empty()) {
    GTEST_SKIP() << "promtool not found on PATH or in /usr/bin";
  }
  const testing::CommandResult lint =
      testing::RunPromtool(promtool, "check metrics", text);
  EXPECT_EQ(lint.exit_code, 0) << lint.output;
  EXPECT_EQ(lint.output, "") << text;
}

}  // namespace
}  // namespace zeroshard::metrics
